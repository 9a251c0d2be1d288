"""The native rollout engine against Hugging Face generate and against the trainer's log-probs."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from fastgrpo.kernels.decode.decode_attention import decode_attention_ref
from fastgrpo.models.sources import cache_dir
from fastgrpo.models.transformer import ModelConfig, Transformer
from fastgrpo.rollout.decode import PrefillInputs, WaveBuffers, prefill_rows, prompt_buckets
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.engine import row_bytes as engine_row_bytes
from fastgrpo.rollout.sampling import SamplingParams

VOCAB = 97
NEVER = VOCAB - 1  # a stop id the tests force or avoid
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
}


def tiny_pair(family="llama", seed=0):
    """(HF model, our model with the same weights), fp32, 2 layers, GQA (4 query / 2 kv heads)."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    hf_config = config_cls(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **extra,
    )
    hf = model_cls(hf_config).eval()
    ours = Transformer(ModelConfig.from_hf(hf_config)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def hf_greedy(hf, prompt, max_new_tokens, stop_ids):
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stop_ids,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def trainer_logp(model, prompts, generation, num_samples, temperature):
    """Log-probs of the sampled tokens from one packed training forward (prompt + completion)."""
    rows, lengths = [], generation.lengths.tolist()
    for b, length in enumerate(lengths):
        rows.append(prompts[b // num_samples] + generation.tokens[b, :length].tolist())
    flat = torch.tensor([t for r in rows for t in r])
    sizes = [len(r) for r in rows]
    cu = torch.tensor([0, *sizes]).cumsum(0)
    positions = torch.cat([torch.arange(n) for n in sizes])
    with torch.no_grad():
        hidden = model(flat, positions, model.packed_attention(cu, max(sizes)))  # (T, H)
        logits = model.logits(hidden).double() / temperature  # (T, V)
    out = torch.zeros_like(generation.logp, dtype=torch.float64)
    for b, length in enumerate(lengths):
        start = int(cu[b]) + len(prompts[b // num_samples]) - 1  # predicts completion token 0
        logp = logits[start : start + length].log_softmax(-1)
        out[b, :length] = logp.gather(-1, generation.tokens[b, :length, None]).squeeze(-1)
    return out


def trainer_and_engine_models(seed):
    """(fp32 trainer model, bf16 CUDA engine model with packed projections), the same weights
    (rounded to bf16 in both): a Qwen2 shape the decode kernels serve (H 256, 2 kv heads of 64)."""
    torch.manual_seed(seed)
    hf_config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    exact = Transformer(ModelConfig.from_hf(hf_config)).eval()
    for p in exact.parameters():  # the trainer's weights rounded as the engine's are
        p.data = p.data.to(torch.bfloat16).float()
    ours = Transformer(ModelConfig.from_hf(hf_config)).eval()
    ours.load_state_dict(exact.state_dict())
    ours = ours.cuda().to(torch.bfloat16)
    ours.pack_projections()
    return exact, ours


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_match_hf_generate_for_every_prompt_and_sample(family):
    hf, ours = tiny_pair(family)
    engine = RolloutEngine(ours, stop_ids=[NEVER, 3], pad_id=0)
    out = engine.generate(PROMPTS, num_samples=2, max_new_tokens=20, params=GREEDY)
    for b in range(out.tokens.shape[0]):
        expected = hf_greedy(hf, PROMPTS[b // 2], 20, [NEVER, 3])
        length = int(out.lengths[b])
        assert out.tokens[b, :length].tolist() == expected
        assert bool(out.finished[b]) == (expected[-1] in (NEVER, 3))


@pytest.mark.parametrize("params", [SamplingParams(0.7), SamplingParams(1.0, top_k=5, top_p=0.9)])
def test_sampled_logprobs_match_the_trainers_packed_forward(params):
    _, ours = tiny_pair("qwen2", seed=1)
    engine = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    out = engine.generate(PROMPTS, num_samples=4, max_new_tokens=16, params=params, seed=3)
    expected = trainer_logp(ours, PROMPTS, out, 4, params.temperature)
    mask = torch.arange(16) < out.lengths[:, None]
    error = (out.logp.double() - expected)[mask].abs().max().item()
    assert error <= 1e-4, error
    assert (out.logp[~mask] == 0).all()


def test_same_seeds_give_the_same_samples_however_rows_are_split_into_waves():
    _, ours = tiny_pair("llama", seed=2)
    params = SamplingParams(1.0)
    whole = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    engine = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    row_bytes = engine_row_bytes(ours.config, engine.dtype, max(map(len, PROMPTS)), 12)
    for rows_per_wave in (3, 4, 9):  # sub-groups of one prompt; one group; several groups
        engine.memory_bytes = row_bytes * rows_per_wave
        split = engine.generate(PROMPTS, num_samples=4, max_new_tokens=12, params=params, seed=5)
        ref = whole.generate(PROMPTS, num_samples=4, max_new_tokens=12, params=params, seed=5)
        assert torch.equal(split.tokens, ref.tokens), rows_per_wave
        torch.testing.assert_close(split.logp, ref.logp, rtol=0, atol=1e-5)


def test_a_prompt_prefilled_once_for_its_samples_gives_what_separate_prefills_give():
    _, ours = tiny_pair("qwen3", seed=3)
    engine = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    params = SamplingParams(1.0)
    shared = engine.generate(PROMPTS, num_samples=3, max_new_tokens=10, params=params, seed=7)
    separate = engine.generate(
        [p for p in PROMPTS for _ in range(3)],
        num_samples=1,
        max_new_tokens=10,
        params=params,
        seeds=torch.arange(9) + (7 << 32),
    )
    assert torch.equal(shared.tokens, separate.tokens)
    torch.testing.assert_close(shared.logp, separate.logp, rtol=0, atol=1e-5)


def test_rows_end_at_the_first_of_several_stop_tokens_and_are_padded_after():
    _, ours = tiny_pair("llama", seed=4)
    params = SamplingParams(1.0)
    free = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    run = free.generate(PROMPTS, num_samples=2, max_new_tokens=12, params=params, seed=1)
    stops = [int(run.tokens[0, 2]), int(run.tokens[3, 6])]
    engine = RolloutEngine(ours, stop_ids=stops, pad_id=0)
    out = engine.generate(PROMPTS, num_samples=2, max_new_tokens=12, params=params, seed=1)
    for b in range(6):
        row = run.tokens[b].tolist()
        hits = [i for i, t in enumerate(row) if t in stops]
        length = hits[0] + 1 if hits else 12
        assert int(out.lengths[b]) == length
        assert bool(out.finished[b]) == bool(hits)
        assert out.tokens[b, :length].tolist() == row[:length]
        assert (out.tokens[b, length:] == 0).all()
    assert out.finished[0] and int(out.lengths[0]) <= 3


def test_how_often_the_host_checks_for_finished_rows_changes_no_result():
    """The host looks at the finish flags every `check_every` steps (a rollout whose rows have all
    stopped ends at the next look): any spacing gives the same rollout."""
    _, ours = tiny_pair("llama", seed=4)
    params = SamplingParams(1.0)
    free = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    stop = int(free.generate(PROMPTS, num_samples=2, max_new_tokens=4, params=params).tokens[0, 1])
    outs = [
        RolloutEngine(ours, stop_ids=[stop], pad_id=0, check_every=every).generate(
            PROMPTS, num_samples=2, max_new_tokens=13, params=params
        )
        for every in (1, 5, 12, 50)
    ]
    assert outs[0].finished.any() and outs[0].lengths.min() < 13
    for out in outs[1:]:
        assert torch.equal(out.tokens, outs[0].tokens)
        assert torch.equal(out.logp, outs[0].logp)
        assert torch.equal(out.lengths, outs[0].lengths)
    with pytest.raises(ValueError, match="check_every must be at least 1"):
        RolloutEngine(ours, stop_ids=[NEVER], pad_id=0, check_every=0)


def test_prompt_buckets_shrink_by_a_quarter_down_to_one_prompt():
    assert prompt_buckets(64) == [64, 48, 36, 27, 20, 15, 11, 8, 6, 4, 3, 2, 1]
    assert prompt_buckets(1) == [1] and prompt_buckets(2) == [2, 1]
    for P in range(1, 300):
        sizes = prompt_buckets(P)
        assert sizes[0] == P and sizes[-1] == 1
        assert all(b < a and b >= (3 * a) // 4 for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("lagged", [False, True], ids=["plain-looks", "lagged-looks"])
def test_finished_groups_compacted_out_give_the_same_rollout_in_fewer_row_steps(
    monkeypatch, lagged
):
    """Stop ids that end ~1 row in 4 per step: groups finish at different steps, the wave moves
    to smaller buckets of prompts as they do, and every row's tokens, log-probs, length and
    finish flag are those of the rollout that steps every row to the end."""
    _, ours = tiny_pair("qwen2", seed=15)
    params = SamplingParams(1.0)
    prompts = [[(3 * p + i) % NEVER for i in range(2 + p % 4)] for p in range(13)]
    stops = list(range(0, VOCAB - 1, 4))  # 24 of the 96 ids a sample can take
    rows_stepped = []
    real_step = WaveBuffers.step

    def counted(wave):
        rows_stepped.append(wave.live_prompts * wave.group)
        return real_step(wave)

    monkeypatch.setattr(WaveBuffers, "step", counted)
    outs = []
    for compact in (False, True):
        engine = RolloutEngine(ours, stop_ids=stops, pad_id=0, check_every=2, compact=compact)
        engine.lagged_looks = lagged
        rows_stepped.clear()
        outs.append(engine.generate(prompts, num_samples=3, max_new_tokens=24, params=params))
        (wave,) = engine._kept.values()
        assert wave.compacted == compact
        steps = list(rows_stepped)
    whole, compacted = outs
    assert whole.finished.any() and (whole.lengths > 8).any()  # lengths vary
    for field in ("tokens", "lengths", "finished"):
        assert torch.equal(getattr(compacted, field), getattr(whole, field))
    torch.testing.assert_close(compacted.logp, whole.logp, rtol=0, atol=1e-5)
    assert steps[0] == 39 and set(steps) <= {
        39,
        27,
        18,
        12,
        9,
        6,
        3,
    }  # 13, 9, 6, 4, 3, 2, 1 prompts
    assert steps[-1] < 39


def test_a_compacted_wave_starts_the_next_rollout_with_every_row():
    _, ours = tiny_pair("llama", seed=16)
    params = SamplingParams(1.0)
    stops = list(range(0, VOCAB - 1, 3))
    engine = RolloutEngine(ours, stop_ids=stops, pad_id=0, check_every=1)
    prompts = [[5 + p, 6 + p, 7] for p in range(6)]
    engine.generate(prompts, num_samples=2, max_new_tokens=20, params=params, seed=1)
    (wave,) = engine._kept.values()
    assert wave.compacted
    again = engine.generate(prompts, num_samples=2, max_new_tokens=20, params=params, seed=2)
    fresh = RolloutEngine(ours, stop_ids=stops, pad_id=0, check_every=1)
    want = fresh.generate(prompts, num_samples=2, max_new_tokens=20, params=params, seed=2)
    for field in ("tokens", "lengths", "finished"):
        assert torch.equal(getattr(again, field), getattr(want, field))
    torch.testing.assert_close(again.logp, want.logp, rtol=0, atol=1e-6)


def test_lagged_looks_at_the_finish_flags_give_the_same_rollout_one_look_later(monkeypatch):
    """On a GPU each look at the finish flags answers with the copy the look before started (the
    device never drains while the host waits): same tokens, and a wave whose rows have all
    stopped ends one look later than with plain looks, not never."""
    _, ours = tiny_pair("llama", seed=4)
    params = SamplingParams(1.0)
    free = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    stop = int(free.generate(PROMPTS, num_samples=2, max_new_tokens=4, params=params).tokens[0, 1])
    steps = []
    real_step = WaveBuffers.step
    monkeypatch.setattr(WaveBuffers, "step", lambda wave: steps.append(1) or real_step(wave))

    def run(stop_ids, lagged, new_tokens):
        engine = RolloutEngine(ours, stop_ids=stop_ids, pad_id=0, check_every=4)
        engine.lagged_looks = lagged
        steps.clear()
        out = engine.generate(PROMPTS, num_samples=2, max_new_tokens=new_tokens, params=params)
        return out, len(steps)

    (plain, _), (lagged, _) = run([stop], False, 13), run([stop], True, 13)
    assert plain.finished.any() and plain.lengths.min() < 13
    for field in ("tokens", "logp", "lengths", "finished"):
        assert torch.equal(getattr(plain, field), getattr(lagged, field))
    # every token stops a row: all rows stop at the first token, before any decode step
    every = list(range(VOCAB))
    (plain, plain_steps), (lagged, lagged_steps) = run(every, False, 20), run(every, True, 20)
    assert (plain.lengths == 1).all() and (lagged.lengths == 1).all()
    assert (plain_steps, lagged_steps) == (4, 8)


def test_the_engine_samples_from_the_models_current_weights_with_no_copy():
    _, ours = tiny_pair("llama", seed=5)
    engine = RolloutEngine(ours, stop_ids=[NEVER], pad_id=1)
    before = engine.generate(PROMPTS, num_samples=1, max_new_tokens=6, params=GREEDY)
    assert not (before.tokens == 0).all()
    with torch.no_grad():  # what an optimizer step does: change the parameters in place
        ours.lm_head.weight.zero_()
    after = engine.generate(PROMPTS, num_samples=1, max_new_tokens=6, params=GREEDY)
    assert (after.tokens == 0).all()  # all logits tie: greedy takes the lowest id


def test_decode_attention_matches_attention_over_the_whole_sequence():
    torch.manual_seed(0)
    P, G, Lp, Tc, nkv, rep, d = 3, 2, 7, 5, 2, 3, 8
    lens = torch.tensor([7, 2, 5])
    pk, pv = torch.randn(2, P, Lp, nkv, d, dtype=torch.float64)
    ck, cv = torch.randn(2, P * G, Tc, nkv, d, dtype=torch.float64)
    q = torch.randn(P * G, nkv * rep, d, dtype=torch.float64)
    step = torch.tensor(3)
    out = decode_attention_ref(q, pk, pv, lens, ck, cv, step)
    for b in range(P * G):
        p = b // G
        keys = torch.cat([pk[p, : lens[p]], ck[b, : step + 1]])  # (L, nkv, d)
        values = torch.cat([pv[p, : lens[p]], cv[b, : step + 1]])
        keys, values = (x.repeat_interleave(rep, 1).transpose(0, 1) for x in (keys, values))
        probs = (q[b, :, None] @ keys.transpose(1, 2) / d**0.5).softmax(-1)  # (nh, 1, L)
        torch.testing.assert_close(out[b], (probs @ values).squeeze(1))


@pytest.mark.parametrize(
    "prompts, message",
    [([], "no prompts"), ([[1, 2], []], "empty prompt"), ([[1, 2]], "max_new_tokens must be")],
)
def test_bad_requests_get_a_clear_error(prompts, message):
    _, ours = tiny_pair("llama")
    engine = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, num_samples=2, max_new_tokens=0 if prompts else 8, params=GREEDY)


SMOLLM2 = cache_dir() / "models" / "smollm2-135m-instruct"


@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason="default model not cached")
def test_greedy_decoding_of_smollm2_matches_hf_for_64_tokens():
    from fastgrpo.models.native_io import load_native_model

    hf = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()
    ours = load_native_model(str(SMOLLM2), dtype=torch.float32, device="cpu").eval()
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    messages = [{"role": "user", "content": "What is 17 + 25? Explain step by step."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    engine = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    out = engine.generate([prompt], num_samples=1, max_new_tokens=64, params=GREEDY)
    expected = hf_greedy(hf, prompt, 64, [NEVER])
    assert out.tokens[0].tolist() == expected


def test_reused_wave_buffers_give_what_fresh_ones_give():
    _, ours = tiny_pair("qwen2", seed=6)
    params = SamplingParams(1.0)
    kept = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    kept.generate(PROMPTS, num_samples=2, max_new_tokens=9, params=params, seed=1)
    shorter = [[30, 31], [32], [33, 34, 35, 36]]  # same wave shape, stale keys past each prompt
    again = kept.generate(shorter, num_samples=2, max_new_tokens=9, params=params, seed=2)
    assert len(kept._kept) == 1
    fresh = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    expected = fresh.generate(shorter, num_samples=2, max_new_tokens=9, params=params, seed=2)
    assert torch.equal(again.tokens, expected.tokens)
    torch.testing.assert_close(again.logp, expected.logp, rtol=0, atol=1e-6)


def test_prefill_rows_pad_at_most_an_eighth_in_multiples_of_64():
    previous = 0
    for tokens in [1, 63, 64, 65, 500, 1000, 1024, 1025, 4097, 8191, 8192, 8193, 100_000]:
        rows = prefill_rows(tokens)
        assert rows >= tokens and rows % 64 == 0 and rows >= previous
        assert rows - tokens <= max(63, tokens // 8)
        previous = rows


def test_packed_prefill_inputs_put_padding_in_the_spare_row_and_in_no_prompt():
    prompts = [[5, 6, 7], [8], [9, 10]]
    plain = PrefillInputs.pack(prompts, capacity=4)
    assert plain.tokens.tolist() == [5, 6, 7, 8, 9, 10]
    assert plain.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert plain.slots.tolist() == [0, 1, 2, 4, 8, 9]  # prompt * 4 + position
    assert plain.cu.tolist() == [0, 3, 4, 6] and plain.lens.tolist() == [3, 1, 2]
    padded = PrefillInputs.pack(prompts, capacity=4, rows=10)
    assert padded.tokens.tolist() == plain.tokens.tolist() + [0] * 4
    assert padded.positions.tolist() == plain.positions.tolist() + [0] * 4
    assert padded.slots.tolist() == plain.slots.tolist() + [12, 13, 14, 15]  # row 3 of 0..3
    assert torch.equal(padded.cu, plain.cu)  # the padding belongs to no prompt
    with pytest.raises(ValueError, match="cannot hold 6 prompt tokens"):
        PrefillInputs.pack(prompts, capacity=4, rows=5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graphed_prefill_gives_what_an_eager_one_gives_and_replays_for_new_prompts():
    """bf16 (the flash kernels serve): the prefill graph captured by the first rollout is
    replayed by later ones, prompts of a new length included, and gives what a prefill of the
    prompts alone (no padding rows, no graph) gives; the padding's keys stay in the spare row."""
    _, ours = tiny_pair("qwen2", seed=12)
    ours = ours.cuda().to(torch.bfloat16)
    params = SamplingParams(1.0)
    graphed = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    eager = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0, prefill_graphs=False)
    others = [[40, 41, 42, 43], [44, 45], [46, 47, 48, 49, 50, 51]]  # 12 tokens, not 15
    rows = prefill_rows(15)
    assert rows == prefill_rows(12)
    graph = None
    for prompts, seed in ((PROMPTS, 1), (PROMPTS, 2), (others, 3)):
        got = graphed.generate(prompts, num_samples=3, max_new_tokens=10, params=params, seed=seed)
        want = eager.generate(prompts, num_samples=3, max_new_tokens=10, params=params, seed=seed)
        (wave,) = graphed._kept.values()
        assert list(wave.prefill_graphs) == [rows]
        graph = graph or wave.prefill_graphs[rows].graph
        assert wave.prefill_graphs[rows].graph is graph  # captured once, then replayed
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.logp, want.logp, rtol=0, atol=2e-2)
        (eager_wave,) = eager._kept.values()
        assert not eager_wave.prefill_graphs
        for a, b in zip(wave.cache.prompt_k, eager_wave.cache.prompt_k):
            lens = [len(p) for p in prompts]
            for i, n in enumerate(lens):
                torch.testing.assert_close(a[i, :n], b[i, :n], rtol=2e-2, atol=2e-2)
        assert not eager_wave.cache.prompt_store_k[0][len(prompts)].any()  # spare row unused
    assert wave.cache.prompt_store_k[0][len(PROMPTS)].any()  # the padding's keys went there


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefill_graphs_of_several_row_counts_share_a_pool_and_the_oldest_is_dropped():
    """Prefills of 64, 128 and 192 rows in one wave shape: two graphs kept (one memory pool),
    each replay as right as an eager prefill, in any order."""
    _, ours = tiny_pair("qwen2", seed=14)
    ours = ours.cuda().to(torch.bfloat16)
    params = SamplingParams(1.0)
    graphed = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    eager = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0, prefill_graphs=False)

    def prompts(total):  # three prompts of ~total / 3 tokens, at most 60 (one capacity of 64)
        return [
            [(5 * p + i) % NEVER for i in range(total // 3 + (p < total % 3))] for p in range(3)
        ]

    for total, kept in ((15, [64]), (70, [64, 128]), (150, [128, 192]), (70, [192, 128]),
                        (15, [128, 64]), (150, [64, 192])):  # fmt: skip
        got = graphed.generate(prompts(total), num_samples=2, max_new_tokens=6, params=params)
        want = eager.generate(prompts(total), num_samples=2, max_new_tokens=6, params=params)
        (wave,) = graphed._kept.values()
        assert list(wave.prefill_graphs) == kept
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.logp, want.logp, rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_prefill_graph_is_captured_again_when_another_engine_grows_the_rope_table(
    monkeypatch,
):
    """A one-token rollout captures a prefill graph and no decode graph; another engine's longer
    rollout then moves the model's RoPE table: the next prefill must not replay the old graph
    (it would read the freed table), and capturing again must work once the old graph, the last
    user of its memory pool, is gone."""
    _, ours = tiny_pair("llama", seed=13)
    ours = ours.cuda().to(torch.bfloat16)
    params = SamplingParams(1.0)
    captures = []
    real = WaveBuffers._capture_prefill

    def counted(wave, *args):
        captures.append(wave)
        return real(wave, *args)

    monkeypatch.setattr(WaveBuffers, "_capture_prefill", counted)
    short = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    first = short.generate(PROMPTS, num_samples=2, max_new_tokens=1, params=params, seed=4)
    short.generate(PROMPTS, num_samples=2, max_new_tokens=1, params=params, seed=5)
    assert len(captures) == 1  # the second rollout replayed it
    table = ours.rotary.cos.data_ptr()
    long = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
    long.generate(PROMPTS, num_samples=1, max_new_tokens=400, params=params)
    assert ours.rotary.cos.data_ptr() != table  # the table grew into a new tensor
    assert len(captures) == 2
    again = short.generate(PROMPTS, num_samples=2, max_new_tokens=1, params=params, seed=4)
    torch.cuda.synchronize()
    assert len(captures) == 3 and captures[2] is captures[0]  # the short engine's wave again
    assert torch.equal(again.tokens, first.tokens) and torch.equal(again.logp, first.logp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compacted_graphed_steps_give_what_every_row_stepping_gives():
    """bf16 with graphs (the decode kernels, a graph per bucket): the compacted rollout's rows
    are the uncompacted one's, and a second rollout replays the buckets' graphs."""
    _, ours = tiny_pair("qwen2", seed=17)
    ours = ours.cuda().to(torch.bfloat16)
    ours.pack_projections()
    params = SamplingParams(1.0)
    prompts = [[(3 * p + i) % NEVER for i in range(2 + p % 4)] for p in range(16)]
    stops = list(range(0, VOCAB - 1, 5))
    engines = [
        RolloutEngine(ours, stop_ids=stops, pad_id=0, check_every=2, compact=compact)
        for compact in (False, True)
    ]
    for seed in (1, 2):
        whole, compacted = (
            e.generate(prompts, num_samples=4, max_new_tokens=32, params=params, seed=seed)
            for e in engines
        )
        (wave,) = engines[1]._kept.values()
        assert wave.compacted and len(wave.graphs) > 1
        if seed == 1:
            graphs = dict(wave.graphs)
        else:  # replayed, not captured again
            assert all(wave.graphs[p] is g for p, g in graphs.items())
        assert whole.finished.any() and (whole.lengths > 10).any()
        for field in ("tokens", "lengths", "finished"):
            assert torch.equal(getattr(compacted, field), getattr(whole, field))
        torch.testing.assert_close(compacted.logp, whole.logp, rtol=0, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_gives_what_eager_decode_gives():
    _, ours = tiny_pair("qwen3", seed=7)
    ours = ours.cuda().to(torch.bfloat16)
    params = SamplingParams(1.0, top_k=20)
    outs = []
    for graphs in (False, True):
        engine = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0, cuda_graphs=graphs)
        for seed in (1, 2):  # the second call replays the graph captured by the first
            outs.append(
                engine.generate(PROMPTS, num_samples=4, max_new_tokens=24, params=params, seed=seed)
            )
    for eager, graph in zip(outs[:2], outs[2:]):
        assert torch.equal(eager.tokens, graph.tokens)
        assert torch.equal(eager.logp, graph.logp)
    assert not torch.equal(outs[0].tokens, outs[1].tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_graph_samples_from_weights_an_optimizer_changed_in_place():
    _, ours = tiny_pair("llama", seed=8)
    ours = ours.cuda().to(torch.bfloat16)
    ours.pack_projections()
    engine = RolloutEngine(ours, stop_ids=[NEVER], pad_id=1)
    before = engine.generate(PROMPTS, num_samples=2, max_new_tokens=12, params=GREEDY)
    (wave,) = engine._kept.values()
    graph = wave.graph
    assert graph is not None and not (before.tokens == 0).all()
    with torch.no_grad():  # what an optimizer step does: change the parameters in place
        ours.lm_head.weight.zero_()
        ours.model.layers[0].self_attn.k_proj.weight.mul_(0.5)  # a packed projection too
    after = engine.generate(PROMPTS, num_samples=2, max_new_tokens=12, params=GREEDY)
    assert wave.graph is graph  # replayed, not captured again
    assert (after.tokens == 0).all()  # all logits tie: greedy takes the lowest id


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_programmatic_dependent_launch_changes_no_result(monkeypatch):
    """The decode kernels' PDL waits only order memory: with it on and off (FASTGRPO_PDL=0),
    graphed rollouts give bitwise the same tokens and log-probs."""
    from fastgrpo.kernels.decode import pdl

    _, ours = tiny_pair("qwen2", seed=9)
    ours = ours.cuda().to(torch.bfloat16)
    ours.pack_projections()  # the decode linear kernels (which prefetch their weights) too
    params = SamplingParams(1.0, top_k=50)
    outs = []
    for enabled in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        assert pdl.active() == (enabled and torch.cuda.get_device_capability()[0] >= 9)
        engine = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
        outs.append(engine.generate(PROMPTS, num_samples=4, max_new_tokens=40, params=params))
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.equal(outs[0].logp, outs[1].logp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_q_k_v_as_split_k_parts_keep_the_engines_log_probs_as_close_to_the_trainers():
    """Where the Gluon attention serves (Hopper; 64 rows x 2 kv heads of d 64), the packed q/k/v
    GEMM hands it split-K parts plus the bias (Qwen2) to add up: the rollout's log-probs agree
    with the fp32 trainer's as well as with q/k/v whole."""
    from fastgrpo.kernels.decode import decode_attention_gluon, decode_linear

    exact, ours = trainer_and_engine_models(seed=11)
    prompts = [[(7 * p + i) % (VOCAB - 1) for i in range(3 + p)] for p in range(16)]
    params = SamplingParams(1.0)
    calls = []
    real = decode_attention_gluon.launch_parts

    def counted(*args):
        calls.append(1)
        return real(*args)

    errors = {}
    for name, k_range in (("parts", decode_linear.QKV_K_RANGE), ("whole", 0)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(decode_linear, "QKV_K_RANGE", k_range)
            patch.setattr(decode_attention_gluon, "launch_parts", counted)
            engine = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
            out = engine.generate(prompts, num_samples=4, max_new_tokens=12, params=params, seed=5)
        if name == "parts" and torch.cuda.get_device_capability() == (9, 0):
            assert len(calls) >= 2  # every layer's attention added up parts (at capture)
        out = type(out)(*(t.cpu() for t in (out.tokens, out.logp, out.lengths, out.finished)))
        want = trainer_logp(exact, prompts, out, 4, 1.0)
        errors[name] = (out.logp.double() - want).abs().mean().item()
    assert errors["parts"] <= 1.5 * errors["whole"] + 1e-3, errors


def test_the_engines_budget_counts_what_pytorch_holds_unused_as_available(monkeypatch):
    """Memory the caching allocator keeps for reuse is the engine's to take (the driver calls it
    used): a GPU with 10 GiB free and 6 GiB cached but unused gives 70% of 16 GiB."""
    from fastgrpo.rollout import engine as engine_module

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 20 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 14 * gib)
    assert engine_module.available_bytes("cuda") == 16 * gib
    engine = RolloutEngine.__new__(RolloutEngine)
    engine.memory_bytes, engine.device = None, torch.device("cuda")
    assert engine._budget() == int(16 * gib * engine_module.FREE_MEMORY_SHARE)
