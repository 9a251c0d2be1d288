"""Rollout speed: the native engine vs Hugging Face `generate` (dynamic and static cache).

Workloads as in issue 4 and benchmarks/PEERS.md, random bf16 weights of real shapes, every completion
forced to its full length (the only stop id is one the model cannot sample):
  A. Qwen2.5-0.5B shape, 64 sequences, prompt 128, 256 new tokens: ms per decode step;
  B. the same shape, 256 sequences, prompt 256, 1024 new tokens: tokens/s;
  C. Qwen2.5-7B shape, 64 sequences, prompt 256, 512 new tokens: ms per step against the floor;
  D. a whole GRPO rollout incl. prefill: 8 prompts x 8 samples x 256 tokens, 0.5B shape: seconds.
Also: the engine's sampled-token log-probs against the trainer's for the same tokens (bf16).
ms per decode step = (time for N new tokens - time for 1 new token) / (N - 1), so the prefill is
left out; for the engine also the mean time between CUDA events recorded before each decode step
of a whole rollout (`ms_per_step_in_rollout`: every step's GPU time and any idle gap after it,
without the setup of the two timed rollouts; while the prefill ran eagerly, its 14-27 ms of host
time moved the difference by up to ~5% from run to run). The floor is the bytes one step must read
(weights + the average KV cache) over the copy bandwidth measured in the same run. D also with
the prefill run eagerly (no prefill graph), 256 tokens and 1. Prints a table, then one JSON line.
Run on a CUDA GPU:  python -m benchmarks.bench_rollout [--quick] [--no-hf]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from fastgrpo.models.transformer import ModelConfig, Transformer  # noqa: E402
from fastgrpo.rollout import decode  # noqa: E402
from fastgrpo.rollout.engine import RolloutEngine  # noqa: E402
from fastgrpo.rollout.kv_cache import kv_bytes_per_token  # noqa: E402
from fastgrpo.rollout.sampling import SamplingParams  # noqa: E402

SHAPES = {
    "0.5B": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7B": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "tiny": dict(  # bench_step.py --tiny: a smoke test of a whole benchmark in seconds on a CPU
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        tie_word_embeddings=True,
    ),
}
PARAMS = SamplingParams(temperature=1.0)


def hf_config(shape):
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES[shape], rope_theta=1e6, max_position_embeddings=32768)


def randomize(model: torch.nn.Module) -> None:
    """Small random weights (norms at 1): activations stay finite."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0, 0.02)


def random_native_model(shape, device="cuda", dtype=torch.bfloat16) -> Transformer:
    """A native transformer of SHAPES[shape] with the random weights of seed 0, its projections
    packed on a GPU as load_native_model packs them."""
    torch.manual_seed(0)
    device = torch.device(device)
    with device:
        model = Transformer(ModelConfig.from_hf(hf_config(shape))).to(dtype)
    randomize(model)
    if device.type == "cuda":  # one GEMM for q/k/v and for gate/up in rollouts
        model.pack_projections()
    return model


def native_model(shape):
    return random_native_model(shape).eval()


def commit() -> str:
    """The commit measured: FASTGRPO_COMMIT (set it where the checkout has no .git), else git's."""
    if os.environ.get("FASTGRPO_COMMIT"):
        return os.environ["FASTGRPO_COMMIT"]
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent,
    )
    return out.stdout.strip() or "unknown"


def print_result_line(bench: str, results: list, device=None, **fields) -> None:
    """The final JSON line of a benchmark: what ran where (GPU, torch, commit), `fields`, results.
    `device` is the one measured (default: the current CUDA device, or the CPU without one)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    line = dict(bench=bench, gpu=gpu, torch=torch.__version__, commit=commit(), **fields)
    print(json.dumps({**line, "results": results}))


def hf_model(ours, shape):
    from transformers import Qwen2ForCausalLM

    with torch.device("cuda"):
        model = Qwen2ForCausalLM(hf_config(shape)).to(torch.bfloat16).eval()
    model.load_state_dict(ours.state_dict(), strict=False)
    return model


def prompts_of(count, length, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (count, length), generator=gen).tolist()


def timed(fn, reps=3):
    """Median wall seconds of fn() with the GPU synchronised around each call (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


class StepEvents:
    """While active, a CUDA event (and the host's clock) before every `WaveBuffers.step`."""

    def __init__(self):
        self.marks: list[tuple[float, torch.cuda.Event]] = []
        self._step = decode.WaveBuffers.step

    def mark(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((time.perf_counter(), event))

    def __enter__(self):
        real = self._step

        def step(wave):
            self.mark()
            real(wave)

        decode.WaveBuffers.step = step
        return self

    def __exit__(self, *exc):
        decode.WaveBuffers.step = self._step

    def step_ms(self) -> list[float]:
        """ms from each step's event to the next step's (the last step, whose interval would
        also hold the rollout's result copies, left out)."""
        marks = self.marks
        return [marks[i][1].elapsed_time(marks[i + 1][1]) for i in range(len(marks) - 1)]


def ours_rollout(model, prompts, samples, new_tokens, graphs=True, prefill_graphs=True):
    """A call that runs one rollout of a fresh engine whose completions all run to full length."""
    never = model.config.vocab_size  # no sampled id equals it: lengths are forced
    engine = RolloutEngine(
        model, stop_ids=[never], pad_id=0, cuda_graphs=graphs, prefill_graphs=prefill_graphs
    )
    return lambda: engine.generate(
        prompts, num_samples=samples, max_new_tokens=new_tokens, params=PARAMS, seed=1
    )


def ours_step_ms_in_rollout(model, prompts, new_tokens, rollouts=3) -> float:
    """Mean ms between consecutive decode steps' events over whole rollouts (after a warm-up)."""
    run = ours_rollout(model, prompts, 1, new_tokens)
    run()
    times = []
    for _ in range(rollouts):
        torch.cuda.synchronize()
        with StepEvents() as steps:
            run()
        torch.cuda.synchronize()
        times += steps.step_ms()
    return sum(times) / len(times)


def ours_seconds(model, prompts, samples, new_tokens, graphs=True, prefill_graphs=True):
    return timed(ours_rollout(model, prompts, samples, new_tokens, graphs, prefill_graphs))


def hf_seconds(model, prompts, samples, new_tokens, cache):
    ids = torch.tensor(prompts, device="cuda").repeat_interleave(samples, 0)
    options = dict(
        max_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=None,
        top_p=None,
        pad_token_id=0,
        eos_token_id=None,
    )
    if cache == "static":
        options["cache_implementation"] = "static"
    return timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **options), 2)


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() / seconds


def floor_ms(model, rows, prompt, new_tokens, bandwidth):
    """Weights + the average KV cache one step reads, at the measured bandwidth."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = kv_bytes_per_token(model.config, torch.bfloat16) * rows * (prompt + new_tokens / 2)
    return (weights + kv) / bandwidth * 1e3


def step_ms(seconds_fn, new_tokens):
    """ms per decode step from a run of `new_tokens` and a run of 1 token."""
    return (seconds_fn(new_tokens) - seconds_fn(1)) / (new_tokens - 1) * 1e3


def decode_rows(shape, rows, prompt, new_tokens, bandwidth, name, *, peers=False, with_hf=False):
    """ms per decode step of the engine; with `peers` also without graphs and (`with_hf`) HF's."""
    model = native_model(shape)
    prompts = prompts_of(rows, prompt, model.config.vocab_size)
    floor = floor_ms(model, rows, prompt, new_tokens, bandwidth)
    out = []
    methods = [("fastgrpo engine", lambda n: ours_seconds(model, prompts, 1, n))]
    if peers:
        methods.append(
            ("fastgrpo engine, no CUDA graph", lambda n: ours_seconds(model, prompts, 1, n, False))
        )
    if peers and with_hf:
        hf = hf_model(model, shape)
        methods += [
            ("HF generate, dynamic cache", lambda n: hf_seconds(hf, prompts, 1, n, "dynamic")),
            ("HF generate, static cache", lambda n: hf_seconds(hf, prompts, 1, n, "static")),
        ]
    for method, fn in methods:
        ms = step_ms(fn, new_tokens)
        row = {
            "workload": name,
            "shape": shape,
            "method": method,
            "ms_per_step": ms,
            "tokens_per_s": rows / ms * 1e3,
            "floor_ms": floor,
            "x_floor": ms / floor,
        }
        line = f"{name:<2} {shape:<5} {method:<34} {ms:8.3f} ms/step  {ms / floor:5.2f}x floor"
        if method == "fastgrpo engine":
            row["ms_per_step_in_rollout"] = ours_step_ms_in_rollout(model, prompts, new_tokens)
            line += f"  ({row['ms_per_step_in_rollout']:.3f} ms step to step in rollouts)"
        out.append(row)
        print(line)
    return out


def whole_rollout(with_hf):
    model = native_model("0.5B")
    prompts = prompts_of(8, 128, model.config.vocab_size)
    rows = [
        ("fastgrpo engine", ours_seconds(model, prompts, 8, 256)),
        ("fastgrpo engine, 1 new token", ours_seconds(model, prompts, 8, 1)),  # prefill + setup
        ("fastgrpo engine, eager prefill", ours_seconds(model, prompts, 8, 256, True, False)),
        (
            "fastgrpo engine, eager prefill, 1 token",
            ours_seconds(model, prompts, 8, 1, True, False),
        ),
    ]
    if with_hf:
        hf = hf_model(model, "0.5B")
        rows.append(("HF generate, static cache", hf_seconds(hf, prompts, 8, 256, "static")))
    out = []
    for method, seconds in rows:
        out.append({"workload": "D", "shape": "0.5B", "method": method, "seconds": seconds})
        print(f"D  0.5B  {method:<40} {seconds:8.3f} s per rollout (8 x 8 x 256, prefill incl.)")
    return out


def logp_agreement():
    """Sampled-token log-probs of the engine against the trainer's packed forward and fused
    scoring kernel on the same tokens (0.5B shape, bf16, 8 prompts x 8 samples x 128 tokens)."""
    from fastgrpo.rollout.native_generate import left_pad
    from fastgrpo.rollout.types import Rollout
    from fastgrpo.train.logprobs import completion_logprobs

    model = native_model("0.5B")
    prompts = prompts_of(8, 128, model.config.vocab_size)
    engine = RolloutEngine(model, stop_ids=[model.config.vocab_size], pad_id=0)
    out = engine.generate(prompts, num_samples=8, max_new_tokens=128, params=PARAMS, seed=3)
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(8)], 0, "cuda")
    mask = torch.ones_like(out.logp)
    rollout = Rollout(prompt_ids, prompt_mask, out.tokens, mask, out.finished)
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, rollout, temperature=1.0)  # (B, T)
    diff = (out.logp - trainer).abs()
    row = {
        "workload": "logp agreement",
        "shape": "0.5B",
        "method": "engine vs trainer (bf16)",
        "mean_abs_diff": diff.mean().item(),
        "max_abs_diff": diff.max().item(),
        "mean_logp": trainer.mean().item(),
    }
    print(
        f"logp agreement (bf16): mean |diff| {row['mean_abs_diff']:.2e}, max {row['max_abs_diff']:.2e}"
    )
    return [row]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="workload A only")
    parser.add_argument("--no-hf", action="store_true", help="leave out HF generate")
    parser.add_argument(
        "--only", nargs="+", choices="ABCD", help="these workloads only (no agreement check)"
    )
    args = parser.parse_args()
    with_hf = not args.no_hf
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    workloads = {
        "A": lambda: decode_rows(
            "0.5B", 64, 128, 256, bandwidth, "A", peers=not args.only, with_hf=with_hf
        ),
        "B": lambda: decode_rows("0.5B", 256, 256, 1024, bandwidth, "B"),
        "C": lambda: decode_rows("7B", 64, 256, 512, bandwidth, "C"),
        "D": lambda: whole_rollout(with_hf),
    }
    chosen = args.only or (["A"] if args.quick else list(workloads))
    results = [] if args.only else logp_agreement()
    for name in chosen:
        torch.cuda.empty_cache()  # the previous workload's model is gone
        results += workloads[name]()
    print_result_line("rollout", results, copy_bandwidth_tb_s=bandwidth / 1e12)


if __name__ == "__main__":
    main()
