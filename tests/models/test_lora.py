"""LoRA adapters (`models/lora.py`) against peft: the same logits and gradients on the same
weights, peft's scaling (rsLoRA too) and init, files peft loads, and the pieces a LoRA run uses
(adapters off is the base, the merged copy for the engine, the fused training path)."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fastgrpo.models import Transformer
from fastgrpo.models.lora import (
    ADAPTER_CONFIG,
    LoraError,
    LoraLinear,
    LoraSettings,
    adapters_off,
    add_adapters,
    load_adapters,
    lora_modules,
    merge_adapters,
    save_adapters,
    target_names,
)
from fastgrpo.models.lora_merged import MergedWeights
from fastgrpo.models.lora_train import MERGED
from tests.models.test_transformer import FAMILIES, SEQUENCES, build_pair, packed_batch

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def randomise_adapters(model, seed: int = 5) -> None:
    """B is zeros at first (the adapter changes nothing): give both factors random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_A.weight.copy_(torch.randn(m.lora_A.weight.shape, generator=g) * 0.3)
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.3)


def peft_twin(hf, ours, settings: LoraSettings):
    """peft's LoRA model over `hf` with our adapters' values."""
    targets = settings.target_modules
    config = peft.LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        lora_dropout=0.0, use_rslora=settings.use_rslora,
    )  # fmt: skip
    twin = peft.get_peft_model(hf, config)
    state = {}
    for name, m in lora_modules(ours).items():
        state[f"base_model.model.{name}.lora_A.default.weight"] = m.lora_A.weight.detach()
        state[f"base_model.model.{name}.lora_B.default.weight"] = m.lora_B.weight.detach()
    missing = set(state) - dict(twin.named_parameters()).keys()
    assert not missing, sorted(missing)[:3]
    twin.load_state_dict(state, strict=False)
    return twin


def ours_and_peft_logits(family: str, settings: LoraSettings):
    hf_config = FAMILIES[family]()
    hf, ours = build_pair(hf_config)
    add_adapters(ours, settings)
    randomise_adapters(ours)
    twin = peft_twin(hf, ours, settings).eval()
    ids, positions, cu = packed_batch(hf_config.vocab_size)
    attend = ours.packed_attention(cu, max(n for _, n in SEQUENCES))
    mine = ours.logits(ours(torch.cat(ids), positions, attend))
    theirs = torch.cat(
        [
            twin(seq[None], position_ids=torch.arange(s, s + n)[None]).logits[0]
            for seq, (s, n) in zip(ids, SEQUENCES)
        ]
    )
    return ours, twin, mine, theirs


@pytest.mark.parametrize(
    ("family", "targets", "rslora"),
    [
        ("llama3-untied-bias", ["all-linear"], False),
        ("qwen2-tied-mqa-sliding", ["q_proj", "v_proj"], False),
        ("qwen3-qknorm-odd-head-dim", ALL, True),
    ],
)
def test_the_adapted_model_gives_pefts_logits_and_adapter_gradients(family, targets, rslora):
    settings = LoraSettings(rank=4, alpha=8.0, target_modules=targets, use_rslora=rslora)
    ours, twin, mine, theirs = ours_and_peft_logits(family, settings)
    assert (mine - theirs).abs().max() < 1e-5
    weights = torch.randn(mine.shape, generator=torch.Generator().manual_seed(3))
    (mine * weights).sum().backward()
    (theirs * weights).sum().backward()
    peft_params = dict(twin.named_parameters())
    trained = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    for name, param in ours.named_parameters():
        if not param.requires_grad:
            assert param.grad is None, name  # the base is frozen
            continue
        key = "base_model.model." + name.replace(".weight", ".default.weight")
        expected = peft_params[key].grad
        assert (param.grad - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max()), name


def test_scaling_follows_pefts_alpha_over_rank_and_rslora():
    assert LoraSettings(rank=16, alpha=32).scaling == 2.0
    assert LoraSettings(rank=16, alpha=32, use_rslora=True).scaling == 8.0
    hf, ours = build_pair(FAMILIES["llama-tied-pad"]())
    add_adapters(ours, LoraSettings(rank=4, alpha=8.0))
    layer = ours.model.layers[0].self_attn.q_proj
    assert isinstance(layer, LoraLinear) and layer.scaling == 2.0
    assert torch.equal(layer.lora_B.weight, torch.zeros_like(layer.lora_B.weight))  # no change
    bound = 1 / math.sqrt(layer.in_features)  # kaiming_uniform(a=sqrt 5), as peft draws A
    assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.std() > bound / 3


def test_all_linear_skips_the_lm_head_and_names_that_match_nothing_say_which_exist():
    _, ours = build_pair(FAMILIES["llama3-untied-bias"]())
    names = target_names(ours, ["all-linear"])
    assert len(names) == 2 * 7 and not any("lm_head" in n for n in names)
    assert target_names(ours, ["q_proj"]) == [f"model.layers.{i}.self_attn.q_proj" for i in (0, 1)]
    with pytest.raises(LoraError, match="matches no linear layer.*down_proj.*all-linear"):
        target_names(ours, ["query_key_value"])


def adapted(family: str, settings: LoraSettings):
    """(our model with random adapters, its logits function on the packed test batch)."""
    hf_config = FAMILIES[family]()
    _, ours = build_pair(hf_config)
    add_adapters(ours, settings)
    randomise_adapters(ours)
    ids, positions, cu = packed_batch(hf_config.vocab_size)
    attend = ours.packed_attention(cu, 9)

    @torch.no_grad()
    def logits(model):
        return model.logits(model(torch.cat(ids), positions, attend))

    return ours, logits


def test_adapters_off_is_the_base_model():
    ours, logits = adapted("llama3-untied-bias", LoraSettings(rank=4, alpha=8.0))
    _, base = build_pair(FAMILIES["llama3-untied-bias"]())
    want = logits(base)
    with adapters_off(ours):
        off = logits(ours)
    on = logits(ours)
    assert torch.equal(off, want)
    assert (on - want).abs().max() > 1e-2  # and on again after the block
    twin = copy.deepcopy(ours)  # its own list of adapted modules (listed once by add_adapters)
    with adapters_off(twin):
        assert torch.equal(logits(twin), want)
        assert torch.equal(logits(ours), on)  # the original's adapters stay on
    assert torch.equal(logits(twin), on)


def packed_adapted_with_merged_copy():
    """A packed native model with random adapters, its `MergedWeights`, and its HF config."""
    hf_config = FAMILIES["llama3-untied-bias"]()
    _, ours = build_pair(hf_config)
    ours.pack_projections()
    add_adapters(ours, LoraSettings(rank=4, alpha=8.0))
    randomise_adapters(ours)
    return ours, MergedWeights(ours), hf_config


def test_the_merged_copy_gives_the_adapted_logits_shares_the_rest_and_follows_updates():
    ours, merged, hf_config = packed_adapted_with_merged_copy()
    engine = merged.current(0)
    assert engine.model.layers[0].is_packed()  # the engine's packed GEMMs, on merged weights
    assert engine.model.embed_tokens.weight is ours.model.embed_tokens.weight  # shared
    assert engine.lm_head.weight is ours.lm_head.weight
    ids, positions, cu = packed_batch(hf_config.vocab_size)
    attend = ours.packed_attention(cu, 9)

    def logits(model, through_merged=True):
        """The model's logits; `through_merged` False: the trainer's forward without the merged
        weights `MergedWeights` attached to it (the base and the low-rank product)."""
        saved = {} if through_merged else {
            m: m.__dict__.pop(MERGED) for m in model.modules() if MERGED in m.__dict__
        }  # fmt: skip
        try:
            with torch.no_grad():
                return model.logits(model(torch.cat(ids), positions, attend))
        finally:
            for m, value in saved.items():
                m.__dict__[MERGED] = value

    torch.testing.assert_close(logits(engine), logits(ours, False), rtol=1e-5, atol=5e-5)
    pointers = [p.data_ptr() for p in engine.parameters()]
    randomise_adapters(ours, seed=9)  # as an optimizer step would change them
    stale = logits(engine)
    assert merged.current(0) is engine and (stale - logits(ours, False)).abs().max() > 1e-3
    # the trainer's forward reads the merged weights (stale here, as the engine's)
    torch.testing.assert_close(logits(ours), stale, rtol=1e-6, atol=1e-6)
    merged.current(1)  # a new version: merged again, in place
    torch.testing.assert_close(logits(engine), logits(ours, False), rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(logits(ours), logits(engine), rtol=1e-6, atol=1e-6)
    assert [p.data_ptr() for p in engine.parameters()] == pointers  # CUDA graphs stay valid


def test_saved_adapters_load_in_peft_in_another_process_with_the_same_logits(tmp_path):
    hf_config = FAMILIES["llama3-untied-bias"]()
    hf, ours = build_pair(hf_config)
    hf.save_pretrained(tmp_path / "base")
    settings = LoraSettings(rank=4, alpha=16.0, target_modules=["all-linear"])
    add_adapters(ours, settings)
    randomise_adapters(ours)
    save_adapters(ours, settings, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16.0
    assert sorted(config["target_modules"]) == sorted(ALL)
    ids = torch.arange(3, 12)
    with torch.no_grad():
        want = ours.logits(
            ours(ids, torch.arange(9), ours.packed_attention(torch.tensor([0, 9]), 9))
        )
    torch.save(want, tmp_path / "want.pt")
    script = f"""
import torch, peft
from transformers import AutoModelForCausalLM
base = AutoModelForCausalLM.from_pretrained({str(tmp_path / "base")!r}, dtype=torch.float32)
model = peft.PeftModel.from_pretrained(base, {str(tmp_path / "adapter")!r}).eval()
with torch.no_grad():
    got = model(torch.arange(3, 12)[None]).logits[0]
want = torch.load({str(tmp_path / "want.pt")!r})
print("max diff", float((got - want).abs().max()))
assert (got - want).abs().max() < 1e-5
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_peft_adapter_loads_back_and_a_wrong_one_is_one_line(tmp_path):
    hf_config = FAMILIES["llama3-untied-bias"]()
    hf, ours = build_pair(hf_config)
    settings = LoraSettings(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    add_adapters(ours, settings)
    randomise_adapters(ours)
    peft_twin(hf, ours, settings).save_pretrained(tmp_path / "peft")  # peft's own files
    _, again = build_pair(hf_config)
    add_adapters(again, settings)
    load_adapters(again, tmp_path / "peft")
    for (name, a), (_, b) in zip(lora_modules(ours).items(), lora_modules(again).items()):
        assert torch.equal(a.lora_A.weight, b.lora_A.weight), name
        assert torch.equal(a.lora_B.weight, b.lora_B.weight), name
    _, other = build_pair(hf_config)
    add_adapters(other, LoraSettings(rank=4, alpha=8.0, target_modules=["all-linear"]))
    with pytest.raises(LoraError, match="does not fit this model: 20 adapter tensor"):
        load_adapters(other, tmp_path / "peft")


def test_merging_gives_the_adapted_logits_in_a_plain_model():
    ours, logits = adapted("mistral-sliding", LoraSettings(rank=2, alpha=4.0))
    want = logits(ours)
    merge_adapters(ours)
    got = logits(ours)
    assert not lora_modules(ours) and isinstance(ours, Transformer)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama3-untied-bias", "qwen3-qknorm-odd-head-dim"])
def test_the_fused_training_path_gives_pefts_logits_and_gradients(family, monkeypatch):
    """The CUDA trainer's forward (`forward_train`: packed q/k/v and gate/up GEMMs, the fused
    SiLU-down kernel), interpreted: each adapter's part is added to its packed GEMM's output,
    down_proj's from SiLU(gate) * up, and the frozen base gets no gradient."""
    from fastgrpo.models import transformer

    monkeypatch.setattr(transformer, "use_train_kernels", lambda x: True)
    hf_config = FAMILIES[family]()
    hf, ours = build_pair(hf_config)
    ours.pack_projections()
    settings = LoraSettings(rank=3, alpha=6.0)
    add_adapters(ours, settings)
    randomise_adapters(ours)
    twin = peft_twin(hf, ours, settings).eval()
    sequences = [(0, 5), (0, 3)]
    ids, positions, cu = packed_batch(hf_config.vocab_size, sequences)
    mine = ours.logits(ours(torch.cat(ids), positions, ours.packed_attention(cu, 5)))
    theirs = torch.cat(
        [
            twin(seq[None], position_ids=torch.arange(s, s + n)[None]).logits[0]
            for seq, (s, n) in zip(ids, sequences)
        ]
    )
    assert (mine - theirs).abs().max() < 1e-4
    weights = torch.randn(mine.shape, generator=torch.Generator().manual_seed(3))
    (mine * weights).sum().backward()
    (theirs * weights).sum().backward()
    peft_params = dict(twin.named_parameters())
    for name, param in ours.named_parameters():
        if not param.requires_grad:
            assert param.grad is None, name
            continue
        expected = peft_params["base_model.model." + name.replace(".weight", ".default.weight")]
        assert (param.grad - expected.grad).abs().max() <= 1e-4 * max(
            1.0, expected.grad.abs().max()
        ), name


def test_modules_to_save_train_whole_as_in_peft_and_the_reference_keeps_their_base(tmp_path):
    """lm_head in modules_to_save: it trains beside the adapters (peft's gradients), its trained
    values go into the adapter file (peft loads it), and adapters_off gives the base head."""
    hf_config = FAMILIES["llama3-untied-bias"]()
    hf, ours = build_pair(hf_config)
    base_head = ours.lm_head.weight.detach().clone()
    settings = LoraSettings(
        rank=2, alpha=4.0, target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    add_adapters(ours, settings)
    randomise_adapters(ours)
    with torch.no_grad():  # as training would move it
        ours.lm_head.weight.add_(0.05 * torch.randn_like(base_head))
    twin = peft.get_peft_model(
        hf,
        peft.LoraConfig(
            r=2, lora_alpha=4.0, target_modules=["q_proj"], modules_to_save=["lm_head"]
        ),
    )
    state = {f"base_model.model.{n}.lora_{p}.default.weight": getattr(m, f"lora_{p}").weight
             for n, m in lora_modules(ours).items() for p in "AB"}  # fmt: skip
    state["base_model.model.lm_head.modules_to_save.default.weight"] = ours.lm_head.weight
    twin.load_state_dict({k: v.detach() for k, v in state.items()}, strict=False)
    ids, positions, cu = packed_batch(hf_config.vocab_size)
    mine = ours.logits(ours(torch.cat(ids), positions, ours.packed_attention(cu, 9)))
    theirs = torch.cat(
        [twin(seq[None], position_ids=torch.arange(s, s + n)[None]).logits[0]
         for seq, (s, n) in zip(ids, SEQUENCES)]
    )  # fmt: skip
    assert (mine - theirs).abs().max() < 1e-5
    weights = torch.randn(mine.shape, generator=torch.Generator().manual_seed(3))
    (mine * weights).sum().backward()
    (theirs * weights).sum().backward()
    peft_head = dict(twin.named_parameters())[
        "base_model.model.lm_head.modules_to_save.default.weight"
    ]
    assert ours.lm_head.weight.grad is not None
    torch.testing.assert_close(ours.lm_head.weight.grad, peft_head.grad, rtol=1e-4, atol=1e-5)
    with adapters_off(ours):
        assert torch.equal(ours.lm_head.weight, base_head)
    assert not torch.equal(ours.lm_head.weight, base_head)  # the trained head is back
    save_adapters(ours, settings, tmp_path / "ours", base_model="unused")
    twin.save_pretrained(tmp_path / "peft")
    for folder in (tmp_path / "ours", tmp_path / "peft"):  # either file loads into a fresh model
        _, again = build_pair(hf_config)
        add_adapters(again, settings)
        load_adapters(again, folder)
        assert torch.equal(again.lm_head.weight, ours.lm_head.weight.detach())


def test_a_bf16_layers_adapters_keep_no_fp32_copy_of_their_inputs():
    """What autograd keeps for backward on the in-GEMM path (an adapted linear, and down_proj's
    adapter in the fused MLP, here interpreted): the bf16 inputs (which the layer keeps anyway)
    and the (tokens, r) products, never a (tokens, in) fp32 copy per adapter."""
    from fastgrpo.models.lora_train import lora_silu_mul_linear

    settings = LoraSettings(rank=4, alpha=8)
    base = torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    layer = LoraLinear(base, settings)
    down = LoraLinear(torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16), settings)
    x = torch.randn(33, 64, dtype=torch.bfloat16, requires_grad=True)
    gate_up = torch.randn(33, 2 * 64, dtype=torch.bfloat16, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = layer(x).float().sum() + lora_silu_mul_linear(gate_up, 64, down).float().sum()
    big_fp32 = [t for t in kept if t.dtype == torch.float32 and t.shape[-1] >= 64 and t.dim() == 2
                and t.shape[0] == 33]  # fmt: skip
    assert big_fp32 == [], [tuple(t.shape) for t in big_fp32]
    out.sum().backward()
    assert x.grad is not None and gate_up.grad is not None and layer.lora_A.weight.grad is not None
    assert down.lora_A.weight.grad is not None


@pytest.mark.parametrize("last", [(2, 3.0), (3, 1.0)], ids=["one-scaling", "two-scalings"])
def test_the_in_gemm_adapters_give_autograds_gradients_in_float64_and_follow_updates(last):
    """A packed group of three linears, two with adapters (LowRankLinear over the block-diagonal
    factors; their scalings the same, the GEMM's alpha, or not, folded into the B blocks): values
    and gradients of x, A and B against the plain expression in float64; after the adapters
    change in place (as an optimizer step changes them), the output follows, from the same
    factor tensors refilled."""
    from fastgrpo.models.lora_train import CACHE, lora_linear

    g = torch.Generator().manual_seed(4)
    settings = LoraSettings(rank=2, alpha=3.0)
    bases = [torch.nn.Linear(7, n, bias=True, dtype=torch.float64) for n in (3, 4, 2)]
    linears = [LoraLinear(bases[0], settings), bases[1], LoraLinear(bases[2], LoraSettings(*last))]
    assert (linears[0].scaling == linears[2].scaling) == (last == (2, 3.0))
    for m in linears:
        m.requires_grad_(False)
        if isinstance(m, LoraLinear):
            m.lora_A.to(torch.float64).requires_grad_(True)
            m.lora_B.to(torch.float64).requires_grad_(True)
            with torch.no_grad():
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g))
    x = torch.randn(2, 5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    params = [
        p for m in linears if isinstance(m, LoraLinear) for p in (m.lora_A.weight, m.lora_B.weight)
    ]

    def plain(x):
        parts = [F.linear(x, m.weight, m.bias) for m in linears]
        for i in (0, 2):
            m = linears[i]
            parts[i] = parts[i] + m.scaling * (x @ m.lora_A.weight.t()) @ m.lora_B.weight.t()
        return torch.cat(parts, -1)

    mine, theirs = lora_linear(x, linears), plain(x)
    torch.testing.assert_close(mine, theirs)
    w = torch.randn(mine.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad((mine * w).sum(), [x, *params])
    want = torch.autograd.grad((theirs * w).sum(), [x, *params])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    made = linears[0].__dict__[CACHE][1]
    with torch.no_grad():  # an optimizer step's in-place change
        for p in params:
            p.add_(0.1)
    torch.testing.assert_close(lora_linear(x, linears), plain(x))
    again = linears[0].__dict__[CACHE][1]
    assert again is made and again.a_cat.data_ptr() == made.a_cat.data_ptr()


def test_the_down_projections_adapter_in_the_fused_mlp_gives_autograds_gradients():
    """LoraSiluMulLinear (silu(gate) * up recomputed in the backward by the MLP's kernels, here
    interpreted) against torch's autograd on the plain expression, fp32, a real-ish width."""
    from fastgrpo.models.lora_train import lora_silu_mul_linear

    g = torch.Generator().manual_seed(8)
    inner, out_features, rank = 40, 24, 4
    gate_up = torch.randn(13, 2 * inner, generator=g, requires_grad=True)
    weight = torch.randn(out_features, inner, generator=g) / 6
    a = (torch.randn(rank, inner, generator=g) / 6).requires_grad_()
    b = torch.randn(out_features, rank, generator=g).requires_grad_()
    down = LoraLinear(torch.nn.Linear(inner, out_features, bias=False), LoraSettings(4, 6.0))
    with torch.no_grad():
        down.weight.copy_(weight), down.lora_A.weight.copy_(a), down.lora_B.weight.copy_(b)
    a, b = down.lora_A.weight, down.lora_B.weight
    mine = lora_silu_mul_linear(gate_up, inner, down)
    gate, up = gate_up.split(inner, -1)
    act = torch.nn.functional.silu(gate) * up
    theirs = act @ weight.t() + 1.5 * (act @ a.t()) @ b.t()
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    w = torch.randn(mine.shape, generator=g)
    grads = torch.autograd.grad((mine * w).sum(), (gate_up, a, b))
    expected = torch.autograd.grad((theirs * w).sum(), (gate_up, a, b))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_cached_factors_follow_a_fused_adamw_step_which_moves_no_version_counter():
    """Fused AdamW (the trainer's on GPUs) changes the adapters without moving their version
    counters; the trainer's optimizer announces each step (`adapters_stepped`), so the next
    forward uses the new values."""
    from fastgrpo.models.lora_train import lora_linear
    from fastgrpo.train.optim import ModelOptimizer

    layer = LoraLinear(torch.nn.Linear(6, 5), LoraSettings(rank=2, alpha=4.0))
    params = [layer.lora_A.weight, layer.lora_B.weight]
    optimizer = ModelOptimizer(
        layer, learning_rate=0.1, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8
    )
    try:  # the GPU's AdamW, on this device
        optimizer.adamw = torch.optim.AdamW(params, lr=0.1, fused=True)
    except RuntimeError:
        pytest.skip("no fused AdamW on this device")
    x = torch.randn(4, 6)
    before = lora_linear(x, [layer])  # the factors are cached now
    versions = [p._version for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step(max_grad_norm=0.0)
    assert [p._version for p in params] == versions  # why the step must be announced
    expected = (
        F.linear(x, layer.weight, layer.bias)
        + layer.scaling * (x @ layer.lora_A.weight.t()) @ layer.lora_B.weight.t()
    )
    assert not torch.allclose(expected, before)
    torch.testing.assert_close(lora_linear(x, [layer]), expected)


@pytest.mark.parametrize(
    ("family", "targets"),
    [("llama3-untied-bias", ["all-linear"]), ("qwen3-qknorm-odd-head-dim", ["q_proj", "v_proj"])],
)
def test_the_engines_own_adapters_give_the_adapted_logits_and_follow_updates(
    family, targets, monkeypatch
):
    """`lora.merge_for_rollout: false`: the engine's forward (the fused inference path, packed
    GEMMs; interpreted here) adds each group's adapters to its GEMM, equal to the adapted model's
    logits; its factors change in place when the version does (CUDA graphs read them)."""
    from fastgrpo.models import transformer
    from fastgrpo.models.lora_decode import DecodeAdapters

    monkeypatch.setattr(transformer, "use_fused_ops", lambda x, asked: asked)
    hf_config = FAMILIES[family]()
    _, ours = build_pair(hf_config)
    ours.pack_projections()
    add_adapters(ours, LoraSettings(rank=4, alpha=8.0, target_modules=targets))
    randomise_adapters(ours)
    rollout = DecodeAdapters(ours)
    engine = rollout.current(0)
    assert engine is ours  # no copy of any weight
    tables = [layer.decode_adapters for layer in ours.model.layers]
    want_groups = (
        {"qkv", "o_proj", "gate_up", "down_proj"} if targets == ["all-linear"] else {"qkv"}
    )
    assert all(t.keys() == want_groups for t in tables)
    ids, positions, cu = packed_batch(hf_config.vocab_size)
    attend = ours.packed_attention(cu, 9)

    def logits(fused: bool):
        with torch.no_grad():
            return ours.logits(ours(torch.cat(ids), positions, attend, fused_ops=fused))

    with adapters_off(ours):
        base = logits(False)
    torch.testing.assert_close(logits(True), logits(False), rtol=1e-5, atol=5e-5)
    assert (logits(True) - base).abs().max() > 1e-2  # the adapters do change the logits
    pointers = [t.data_ptr() for _, f in rollout.groups for t in (f.a_cat, f.b_bd)]
    randomise_adapters(ours, seed=9)
    assert rollout.current(0) is ours and (logits(True) - logits(False)).abs().max() > 1e-3
    rollout.current(1)  # a new version: the factors written again, in place
    torch.testing.assert_close(logits(True), logits(False), rtol=1e-5, atol=5e-5)
    assert [t.data_ptr() for _, f in rollout.groups for t in (f.a_cat, f.b_bd)] == pointers


def test_merging_in_blocks_of_rows_gives_w_plus_s_b_a_and_leaves_the_base_alone(monkeypatch):
    """merge_into computes W + s B A a few rows at a time (MERGE_BLOCK values of fp32 at once):
    against float64 for a bf16 and an fp32 weight, whose base is never written (an fp32 weight's
    .float() would be the weight itself)."""
    from fastgrpo.models import lora as lora_module

    monkeypatch.setattr(lora_module, "MERGE_BLOCK", 3 * 37)  # 3 rows of 37 inputs per block
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.bfloat16, torch.float32):
        layer = LoraLinear(torch.nn.Linear(37, 10, bias=False).to(dtype), LoraSettings(4, 6.0))
        with torch.no_grad():
            layer.lora_B.weight.copy_(torch.randn(10, 4, generator=g))
        base = layer.weight.detach().clone()
        merged = torch.empty_like(layer.weight)
        layer.merge_into(merged)
        want = base.double() + 1.5 * layer.lora_B.weight.double() @ layer.lora_A.weight.double()
        assert torch.equal(layer.weight, base)
        torch.testing.assert_close(merged, want.to(dtype))  # one rounding: the dtype's tolerance


def test_a_stochastic_merge_rounds_each_value_to_a_bf16_neighbour_and_is_unbiased():
    """`merge_into(out, stochastic=True)`: every merged value is one of the two bf16 values
    around W + s B A (fp32), and their average over many merges comes far closer to it than
    rounding to nearest does: a small adapter change is not rounded away on average."""
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    m = LoraLinear(base, LoraSettings(rank=4, alpha=8.0))
    with torch.no_grad():
        m.lora_B.weight.normal_(0, 1e-3)  # small: most of s B A is below half a bf16 ulp of W
    exact = m.weight.float() + m.scaling * m.lora_B.weight @ m.lora_A.weight
    nearest = torch.empty_like(m.weight)
    m.merge_into(nearest)
    below = exact.to(torch.bfloat16)
    draws = []
    for _ in range(400):
        out = torch.empty_like(m.weight)
        m.merge_into(out, stochastic=True)
        draws.append(out.float())
    draws = torch.stack(draws)
    assert bool(((draws == draws.min(0).values) | (draws == draws.max(0).values)).all())
    spread = draws.max(0).values - draws.min(0).values
    ulp = (below.float().abs() * 2.0**-7).clamp(min=1e-30)
    assert bool((spread <= ulp * 1.01).all())  # two neighbours at most
    # and those are the bf16 values on either side of the exact fp32 value (its truncation
    # toward zero, and one bf16 step further out)
    cut = exact.view(torch.int32) & -(1 << 16)
    inner, outer = cut.view(torch.float32), (cut + (1 << 16)).view(torch.float32)
    assert bool(((draws == inner) | (draws == outer)).all())
    err_stochastic = (draws.mean(0) - exact).abs().mean()
    err_nearest = (nearest.float() - exact).abs().mean()
    assert err_stochastic < 0.25 * err_nearest


def test_an_optimizer_step_refreshes_the_merged_weights_the_trainer_reads():
    """`adapters_stepped` (every optimizer step) merges again at once: the trainer's next
    forward, which reads the merged weights, sees the new adapters before any rollout."""
    from fastgrpo.models.lora_train import adapters_stepped

    ours, merged, hf_config = packed_adapted_with_merged_copy()
    merged.current(0)
    ids, positions, cu = packed_batch(hf_config.vocab_size)
    attend = ours.packed_attention(cu, 9)

    def logits():
        with torch.no_grad():
            return ours.logits(ours(torch.cat(ids), positions, attend))

    before = logits()
    randomise_adapters(ours, seed=9)
    torch.testing.assert_close(logits(), before, rtol=1e-6, atol=1e-6)  # merged: not yet
    adapters_stepped()
    after = logits()
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(
        after,
        merged.model.logits(merged.model(torch.cat(ids), positions, attend)).detach(),
        rtol=1e-6,
        atol=1e-6,
    )


def test_the_step_merge_is_not_repeated_by_the_rollout_but_a_load_is_merged_again(monkeypatch):
    """After the optimizer's merge (`adapters_stepped`) the rollout's `current(new version)`
    merges nothing more; an adapter changed in place otherwise (a load moves its version
    counter) is merged at the next version."""
    from fastgrpo.models.lora_train import adapters_stepped

    ours, merged, hf_config = packed_adapted_with_merged_copy()
    merged.current(0)
    merges = []
    monkeypatch.setattr(merged, "_merge", lambda: merges.append(1))  # counted, not run
    randomise_adapters(ours, seed=9)
    adapters_stepped()
    assert len(merges) == 1
    merged.current(1)
    assert len(merges) == 1  # the step's merge holds these adapters already
    a = next(m for m in ours.modules() if hasattr(m, "lora_B"))
    with torch.no_grad():
        a.lora_B.weight.mul_(2.0)  # as a checkpoint load writes into the adapters
    merged.current(2)
    assert len(merges) == 2
    merged.current(2)
    assert len(merges) == 2  # same version: nothing to merge
