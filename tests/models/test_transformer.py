"""The native transformer against transformers: logits, gradients, greedy decoding, loading.

Every family (Llama with llama3 RoPE, Qwen2 with q/k/v bias and sliding layers, Qwen3 with q/k
norm, Mistral with a sliding window, tied and untied, GQA and MQA) is built at random from
transformers' own config classes, loaded into ours strictly, and compared on packed rows against
HF run on each sequence alone. The real SmolLM2-135M-Instruct checks parity at scale.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from fastgrpo.models import (
    ModelConfig,
    PackedCausalAttention,
    Transformer,
    UnsupportedModelError,
    causal_attention_ref,
    is_supported,
    load_native_model,
)
from fastgrpo.models import attention as attention_module
from fastgrpo.models.attention import VARLEN, packed_positions
from fastgrpo.models.native_io import save_safetensors
from fastgrpo.models.packed import PackedLinears, packed_linear
from fastgrpo.models.sources import cache_dir
from fastgrpo.models.transformer import Llama3RopeScaling

SMOLLM2 = cache_dir() / "models" / "smollm2-135m-instruct"
needs_smollm2 = pytest.mark.skipif(
    not (SMOLLM2 / "config.json").is_file(), reason="default model not converted and cached"
)


SMALL = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,  # larger than HF's 0.02, so logits are O(1) and tolerances mean much
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
FAMILIES = {
    "llama3-untied-bias": lambda: LlamaConfig(
        **SMALL, rope_parameters=LLAMA3_ROPE, attention_bias=True, mlp_bias=True
    ),
    # token 12 occurs in the packed batch: as in HF, its embedding row gets no input-side gradient
    "llama-tied-pad": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True, pad_token_id=12),
    "qwen2-tied-mqa-sliding": lambda: Qwen2Config(
        **{**SMALL, "num_key_value_heads": 1},
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
    ),
    "qwen3-qknorm-odd-head-dim": lambda: Qwen3Config(**SMALL, head_dim=10, attention_bias=True),
    "mistral-sliding": lambda: MistralConfig(**SMALL, sliding_window=5),
}
# (start position, length) of each packed sequence; one starts far out to test RoPE there
SEQUENCES = [(0, 9), (0, 1), (0, 6), (300, 7)]


def build_pair(hf_config, seed: int = 0):
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    ours = Transformer(ModelConfig.from_hf(hf_config))
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def packed_batch(vocab: int, sequences=SEQUENCES, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n,), generator=generator) for _, n in sequences]
    positions = torch.cat([torch.arange(s, s + n) for s, n in sequences])  # (T,)
    cu = torch.tensor([0] + [n for _, n in sequences]).cumsum(0)  # (N + 1,)
    return ids, positions, cu


def hf_logits_per_sequence(hf, ids, sequences=SEQUENCES):
    rows = []
    for seq, (start, n) in zip(ids, sequences):
        positions = torch.arange(start, start + n, device=seq.device)
        rows.append(hf(seq[None], position_ids=positions[None]).logits[0])
    return torch.cat(rows)  # (T, V)


@pytest.mark.parametrize("family", FAMILIES)
def test_random_weights_give_hf_logits_and_gradients_on_packed_sequences(family):
    hf_config = FAMILIES[family]()
    hf, ours = build_pair(hf_config)
    ids, positions, cu = packed_batch(hf_config.vocab_size)
    attend = ours.packed_attention(cu, max(n for _, n in SEQUENCES))
    ours_logits = ours.logits(ours(torch.cat(ids), positions, attend))  # (T, V)
    hf_logits = hf_logits_per_sequence(hf, ids)  # (T, V)
    assert hf_logits.abs().max() > 0.5  # the comparison below is not between near-zeros
    assert (ours_logits - hf_logits).abs().max() < 1e-5

    weights = torch.randn(hf_logits.shape, generator=torch.Generator().manual_seed(2))  # (T, V)
    (ours_logits * weights).sum().backward()
    (hf_logits * weights).sum().backward()
    hf_params = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        expected = hf_params[name].grad
        assert (param.grad - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max()), name


def test_each_family_decides_its_sliding_windows_as_transformers_does():
    qwen2 = ModelConfig.from_hf(FAMILIES["qwen2-tied-mqa-sliding"]())
    assert qwen2.layer_windows == (None, 4)  # layers from max_window_layers on slide
    assert ModelConfig.from_hf(FAMILIES["mistral-sliding"]()).layer_windows == (5, 5)
    disabled = Qwen2Config(**SMALL, use_sliding_window=False, sliding_window=4)
    assert ModelConfig.from_hf(disabled).sliding_window is None
    assert ModelConfig.from_hf(MistralConfig(**SMALL, sliding_window=None)).layer_windows == (
        None,
        None,
    )


def test_transformers_4_config_json_reads_like_its_5_x_form():
    legacy = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True,
    }
    config = ModelConfig.from_hf(legacy)
    assert config.rope_theta == 500000.0 and config.head_dim == 64
    assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    assert ModelConfig.from_hf(LlamaConfig(**legacy)) == config
    qwen3 = {**legacy, "model_type": "qwen3", "rope_scaling": {"type": "default"}}
    assert ModelConfig.from_hf(qwen3).head_dim == 128  # Qwen3's own default, not hidden / heads
    assert ModelConfig.from_hf(qwen3).rope_scaling is None


def test_unsupported_models_are_refused_with_their_type_named(tmp_path):
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*Hugging Face path"):
        ModelConfig.from_hf({"model_type": "gpt2", "n_embd": 768})
    yarn = LlamaConfig(**SMALL, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        ModelConfig.from_hf(yarn)
    assert not is_supported({"model_type": "phi3"}) and is_supported(LlamaConfig(**SMALL))
    # a directory holding only a config.json: refused before any weight file is looked for
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    with pytest.raises(UnsupportedModelError, match="'gemma2'"):
        load_native_model(str(tmp_path), device="cpu")


def test_activation_checkpointing_gives_identical_gradients():
    _, ours = build_pair(FAMILIES["qwen3-qknorm-odd-head-dim"]())
    ids, positions, cu = packed_batch(ours.config.vocab_size)
    attend = ours.packed_attention(cu, 9)
    grads = []
    for checkpointing in (False, True):
        ours.zero_grad()
        ours.activation_checkpointing = checkpointing
        ours.logits(ours(torch.cat(ids), positions, attend)).square().mean().backward()
        grads.append([p.grad.clone() for p in ours.parameters()])
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)


@pytest.mark.parametrize("lengths", [[5, 1, 8], [20, 1, 1]], ids=["padded", "per-sequence"])
@pytest.mark.parametrize("window", [None, 3])
def test_packed_attention_is_causal_within_each_sequence_only(window, lengths):
    # [5, 1, 8] runs as one padded call (24 padded tokens for 14); [20, 1, 1] as a call per
    # sequence (60 padded tokens for 22 would be more than PADDED_BATCH_LIMIT allows)
    generator = torch.Generator().manual_seed(0)
    T = sum(lengths)
    q = torch.randn(T, 6, 16, generator=generator)  # (T, Hq, D)
    k, v = torch.randn(2, T, 2, 16, generator=generator)  # (T, Hkv, D) each
    attend = PackedCausalAttention.from_lengths(lengths, layer_windows=[window])
    expected = causal_attention_ref(q, k, v, attend.cu_seqlens, window)
    torch.testing.assert_close(attend(0, q, k, v), expected, atol=1e-6, rtol=1e-5)
    # changing a token of the last sequence leaves the other sequences' outputs alone
    v2 = v.clone()
    v2[-1] += 1.0
    changed = (attend(0, q, k, v2) - attend(0, q, k, v)).abs().amax(dim=(1, 2))  # (T,)
    assert changed[: T - lengths[-1]].max() == 0 and changed[-1] > 0
    expected_positions = [i for n in lengths for i in range(n)]
    assert packed_positions(attend.cu_seqlens).tolist() == expected_positions


def test_sharded_checkpoint_loads_and_our_save_is_an_hf_checkpoint(tmp_path):
    from safetensors.torch import save_file

    hf_config = FAMILIES["llama3-untied-bias"]()
    hf, ours = build_pair(hf_config)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    names = sorted(state)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file), metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf_config.save_pretrained(tmp_path)

    loaded = load_native_model(str(tmp_path), dtype="bfloat16", device="cpu")
    assert loaded.lm_head_weight.dtype == torch.bfloat16
    assert all(p.requires_grad and not p.is_meta for p in loaded.parameters())
    for name, param in loaded.named_parameters():
        assert torch.equal(param, state[name].to(torch.bfloat16)), name

    saved = tmp_path / "saved"
    save_safetensors(ours, saved)
    hf_config.save_pretrained(saved)
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    ids, _, _ = packed_batch(hf_config.vocab_size)
    torch.testing.assert_close(reloaded(ids[0][None]).logits, hf(ids[0][None]).logits)


# ----------------------------------------------------------------------------- real weights


@pytest.fixture(scope="module")
def smollm2():
    hf = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()
    ours = load_native_model(str(SMOLLM2), dtype=torch.float32, device="cpu")
    return hf, ours, AutoTokenizer.from_pretrained(SMOLLM2)


@needs_smollm2
@torch.no_grad()
def test_smollm2_logits_on_packed_prompts_match_hf_within_1e_4(smollm2):
    hf, ours, tokenizer = smollm2
    texts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n"]
    ids = [torch.tensor(tokenizer(text)["input_ids"]) for text in texts]
    sequences = [(0, len(seq)) for seq in ids]
    _, positions, cu = packed_batch(1, sequences)
    hidden = ours(torch.cat(ids), positions, ours.packed_attention(cu, max(len(s) for s in ids)))
    error = (ours.logits(hidden) - hf_logits_per_sequence(hf, ids, sequences)).abs().max()
    assert error < 1e-4


class ConcatKVCache:
    """The smallest attend() a generation engine could pass: append k/v per layer, attend over
    everything cached (causal among the new tokens)."""

    def __init__(self, num_layers: int):
        self.k, self.v = [None] * num_layers, [None] * num_layers

    def __call__(self, layer, q, k, v):
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k]), torch.cat([self.v[layer], v])  # (S, Hkv, D)
        self.k[layer], self.v[layer] = k, v
        new, total = q.shape[0], k.shape[0]
        rows = torch.arange(total - new, total)[:, None]  # (T, 1): each query's own position
        mask = torch.arange(total)[None, :] <= rows  # (T, S)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # (S, Hq, D)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )  # (Hq, T, D)
        return out.transpose(0, 1)  # (T, Hq, D)


@needs_smollm2
@torch.no_grad()
def test_greedy_decoding_through_a_kv_cache_callback_matches_hf_generate(smollm2):
    hf, ours, tokenizer = smollm2
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, return_tensors="pt")["input_ids"][0]  # (P,)
    # an explicit mask: SmolLM2's pad id is <|im_end|>, which HF would otherwise mask in the prompt
    expected = hf.generate(
        prompt[None],
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=64,
        do_sample=False,
        eos_token_id=None,
    )
    expected = expected[0, len(prompt) :].tolist()

    cache = ConcatKVCache(ours.config.num_layers)
    tokens, positions, generated = prompt, torch.arange(len(prompt)), []
    for _ in range(64):
        hidden = ours(tokens, positions, cache)  # (T, H)
        tokens = ours.logits(hidden[-1:]).argmax(-1)  # (1,)
        positions = positions[-1:] + 1
        generated.append(int(tokens))
    assert len(expected) == 64 and generated == expected


# ----------------------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_attention_is_within_twice_sdpas_low_precision_error(window, dtype):
    """Relative RMS error against the fp32 reference, output and all three gradients. Measured on
    an H200 (torch 2.11): varlen/SDPA = 1.2x (out), 1.55x (dq), 1.85x (dk), 1.7x (dv)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 1, 128, 64, 300]
    T = sum(lengths)
    q, grad_out = torch.randn(2, T, 8, 64, device="cuda", dtype=dtype, generator=generator)
    k, v = torch.randn(2, T, 2, 64, device="cuda", dtype=dtype, generator=generator)
    fast = PackedCausalAttention.from_lengths(lengths, "cuda", [window])
    assert VARLEN is not None and fast._varlen_applies(q, window)
    slow = PackedCausalAttention(fast.cu_seqlens, fast.max_seqlen, [window], use_varlen=False)

    def run(attend, *inputs):
        inputs = [x.detach().requires_grad_() for x in inputs]
        out = attend(0, *inputs)  # (T, Hq, D)
        out.backward(grad_out.to(out.dtype))
        return [out.float()] + [x.grad.float() for x in inputs]

    def reference(layer, *inputs):
        return causal_attention_ref(*inputs, fast.cu_seqlens, window)

    exact = run(reference, q.float(), k.float(), v.float())
    for name, got, base, ref in zip(
        "out dq dk dv".split(), run(fast, q, k, v), run(slow, q, k, v), exact
    ):
        assert (got - ref).norm() <= 2 * (base - ref).norm(), name


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_attention_without_autograd_calls_flash_directly_with_the_same_result(
    dtype, monkeypatch
):
    """Under no_grad the flash kernel runs on grouped k/v as they are; with autograd, through
    `FlashVarlenCausal` (or `varlen_attn`): the same kernel, so the outputs agree to the last bit
    or within one rounding (k/v repeated or not), and both are within SDPA's error of the fp32
    reference."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    lengths = [37, 1, 128, 64, 300]
    q = torch.randn(sum(lengths), 14, 64, device="cuda", dtype=dtype, generator=generator)
    k, v = torch.randn(2, sum(lengths), 2, 64, device="cuda", dtype=dtype, generator=generator)
    attend = PackedCausalAttention.from_lengths(lengths, "cuda", [None])
    calls = []
    direct_call = PackedCausalAttention._flash_forward
    monkeypatch.setattr(
        PackedCausalAttention, "_flash_forward", lambda *a: calls.append(1) or direct_call(*a)
    )
    with torch.no_grad():
        direct = attend(0, q, k, v)
    assert calls == [1]
    with_grad = attend(0, q.requires_grad_(), k, v).detach()
    assert calls == [1]  # autograd goes through its own function, not _flash_forward
    torch.testing.assert_close(direct, with_grad, atol=2e-3, rtol=0)
    exact = causal_attention_ref(q.detach().float(), k.float(), v.float(), attend.cu_seqlens)
    sdpa = PackedCausalAttention(attend.cu_seqlens, attend.max_seqlen, [None], use_varlen=False)
    with torch.no_grad():
        base = sdpa(0, q.detach(), k, v).float()
    assert (direct.float() - exact).norm() <= 2 * (base - exact).norm()


@pytest.mark.gpu
@needs_cuda
def test_bf16_model_on_cuda_is_within_twice_hfs_bf16_error_in_logits_and_gradients():
    hf_config = FAMILIES["qwen3-qknorm-odd-head-dim"]()
    hf_config.head_dim = 16  # so that flash varlen runs: it takes head dims that are multiples of 8
    hf, ours = build_pair(hf_config)
    ids, positions, cu = packed_batch(hf_config.vocab_size)
    weights = torch.randn(len(positions), hf_config.vocab_size)  # (T, V)

    def logits_and_grads(model, logits_fn):
        model.zero_grad()
        logits = logits_fn()  # (T, V)
        (logits.float() * weights.to(logits.device)).sum().backward()
        grads = {n: p.grad.double().cpu() for n, p in model.named_parameters()}
        return logits.double().cpu(), grads

    exact = logits_and_grads(hf, lambda: hf_logits_per_sequence(hf, ids))
    hf.to("cuda", torch.bfloat16)
    ours.to("cuda", torch.bfloat16)
    ids = [seq.cuda() for seq in ids]
    attend = ours.packed_attention(cu.cuda(), 9)
    assert attend._varlen_applies(torch.empty(1, 16, device="cuda", dtype=torch.bfloat16), None)
    got = logits_and_grads(
        ours, lambda: ours.logits(ours(torch.cat(ids), positions.cuda(), attend))
    )
    base = logits_and_grads(hf, lambda: hf_logits_per_sequence(hf, ids))
    assert (got[0] - exact[0]).norm() <= 2 * (base[0] - exact[0]).norm()
    for name, ref in exact[1].items():
        assert (got[1][name] - ref).norm() <= 2 * (base[1][name] - ref).norm(), name


def test_packed_projections_compute_the_same_outputs_and_follow_in_place_updates(tmp_path):
    _, ours = build_pair(FAMILIES["llama3-untied-bias"]())  # q/k/v and MLP biases
    ids, positions, cu = packed_batch(ours.config.vocab_size)
    attend = ours.packed_attention(cu, int(cu.diff().max()))
    with torch.no_grad():
        before = ours(torch.cat(ids), positions, attend)  # (T, H)
    names = [name for name, _ in ours.named_parameters()]
    ours.pack_projections()
    assert [name for name, _ in ours.named_parameters()] == names
    attention, mlp = ours.model.layers[0].self_attn, ours.model.layers[0].mlp
    x = torch.randn(5, ours.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(ours(torch.cat(ids), positions, attend), before)
        for packed, linears in (
            (attention.qkv, [attention.q_proj, attention.k_proj, attention.v_proj]),
            (mlp.gate_up, [mlp.gate_proj, mlp.up_proj]),
        ):
            for got, linear in zip(packed(x), linears):
                torch.testing.assert_close(got, linear(x), rtol=1e-6, atol=1e-6)
        # an optimizer step updates the parameters in place: the packed GEMM sees it
        attention.k_proj.weight.add_(1.0)
        attention.v_proj.bias.mul_(-2.0)
        _, k, v = attention.qkv(x)
        torch.testing.assert_close(k, attention.k_proj(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v, attention.v_proj(x), rtol=1e-6, atol=1e-6)
    assert attention.qkv.intact()
    attention.q_proj.weight = torch.nn.Parameter(attention.q_proj.weight.clone())  # replaced
    assert not attention.qkv.intact()  # the engine falls back to one GEMM per projection
    save_safetensors(ours, tmp_path)  # shared storage must not stop a checkpoint
    reloaded = Transformer(ours.config)
    reloaded.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    for (name, a), b in zip(ours.named_parameters(), reloaded.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_packed_linear_gives_each_linears_output_and_gradients(bias, packed):
    """One GEMM for several linears of one input, with autograd to each linear's own parameters:
    the same outputs and gradients as the linears one by one (fp64), from the packed storage
    (`PackedLinears` intact) or from concatenated weights."""
    torch.manual_seed(3)
    linears = [torch.nn.Linear(12, n, bias=bias).double() for n in (12, 4, 4)]
    group = PackedLinears(linears) if packed else None
    linears[1].weight.requires_grad_(False)  # a frozen part gets no gradient
    x = torch.randn(7, 12, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(7, 20, dtype=torch.float64)
    out = packed_linear(x, linears, group)  # (7, 20)
    out.backward(grad_out)
    got = [x.grad] + [p.grad for m in linears for p in m.parameters() if p.requires_grad]
    x.grad = None
    for m in linears:
        m.zero_grad(set_to_none=True)
    expected = torch.cat([m(x) for m in linears], -1)
    expected.backward(grad_out)
    want = [x.grad] + [p.grad for m in linears for p in m.parameters() if p.requires_grad]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert linears[1].weight.grad is None
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 40])
def test_flash_autograd_on_grouped_kv_matches_varlen_attn_on_repeated_kv(window):
    """`FlashVarlenCausal` (the ATen flash kernels on grouped-query k/v, no repeat) against
    torch's `varlen_attn` path (k/v repeated to q's head count): the same kernels, so outputs
    agree to the bit and gradients within a bf16 rounding of the group sums."""
    generator = torch.Generator(device="cuda").manual_seed(2)
    lengths = [37, 1, 128, 64, 300]
    T = sum(lengths)
    q, grad_out = torch.randn(
        2, T, 14, 64, device="cuda", dtype=torch.bfloat16, generator=generator
    )
    k, v = torch.randn(2, T, 2, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
    attend = PackedCausalAttention.from_lengths(lengths, "cuda", [window])

    def run(flash_autograd):
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(attention_module, "FLASH_AUTOGRAD", flash_autograd)
            out = attend(0, *inputs)
        out.backward(grad_out)
        return [out] + [x.grad for x in inputs]

    direct, wrapped = run(True), run(False)
    assert torch.equal(direct[0], wrapped[0])
    for name, a, b in zip(("dq", "dk", "dv"), direct[1:], wrapped[1:]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_projections_give_the_engines_forward_within_bf16_rounding():
    _, ours = build_pair(FAMILIES["qwen3-qknorm-odd-head-dim"]())
    ours = ours.cuda().to(torch.bfloat16)
    ids, positions, cu = packed_batch(ours.config.vocab_size)
    ids, positions, cu = torch.cat(ids).cuda(), positions.cuda(), cu.cuda()
    attend = ours.packed_attention(cu, int(cu.diff().max()))
    with torch.no_grad():
        plain = ours(ids, positions, attend, fused_ops=True)  # (T, H)
        ours.pack_projections()
        assert ours.model.layers[0].self_attn.qkv.intact()
        packed = ours(ids, positions, attend, fused_ops=True)
        exact = ours.float()(ids, positions, attend)
    own = (plain.double() - exact.double()).abs()  # bf16's own error on this forward
    assert (packed.double() - exact.double()).abs().max() <= 1.5 * own.max()
