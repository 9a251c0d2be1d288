"""LM head + GRPO loss, forward + backward, and scoring: fused Triton vs torch eager vs torch.compile.

Workload as in benchmarks/PEERS.md: clipped ratio against old log-probs, k3 KL against reference
log-probs (beta 0.04), grpo aggregation, bf16 hidden states and weight, random inputs. For each
shape: median time (CUDA events via triton.testing.do_bench), peak extra memory (above the inputs and
the returned gradients, as benchmarks/PEERS.md counts it; also reported with the gradients),
TFLOP/s over 6*N*H*V and the ratio to the 6NHV floor at 800 TFLOP/s. Also: scoring only (log-prob +
entropy) and the fused call with half the groups at zero advantage. Prints a table, then one JSON
line. Run on a CUDA GPU:  python -m benchmarks.bench_logprob [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

import torch

from fastgrpo.kernels.train import lm_head_grpo_loss as fused_module  # noqa: E402
from fastgrpo.kernels.train.lm_head_grpo_loss import (  # noqa: E402
    DEFAULT_CHUNK_BYTES,
    _chunk_rows,
    fused_token_loss,
    per_token_loss,
)
from fastgrpo.kernels.train.lm_head_stats import lm_head_stats_ref, lm_head_stats_triton  # noqa: E402

SHAPES = [(16384, 896, 151936), (32768, 896, 151936), (8192, 3584, 152064)]
BIG = (131072, 896, 151936)
SETTINGS = {"loss_type": "grpo", "beta": 0.04, "kl_estimator": "k3", "epsilon_low": 0.2}
FLOOR_TFLOPS = 800.0


def make_inputs(n, h, v, seq_len=1024, zero_frac=0.0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(n, h, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=gen) / h**0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    seqs = n // seq_len
    adv = torch.randn(seqs, device="cuda", generator=gen)
    if zero_frac:
        adv[: int(seqs * zero_frac)] = 0.0
    adv = adv.repeat_interleave(seq_len)
    weights = torch.full((n,), 1.0 / (seq_len * seqs), device="cuda")
    old = -torch.rand(n, device="cuda", generator=gen) * 5 - 8
    ref = old + torch.randn(n, device="cuda", generator=gen) * 0.05
    return hidden, weight, targets, weights, adv, old, ref


def eager_loss(hidden, weight, targets, weights, adv, old, ref):
    logits = (hidden @ weight.t()).float()
    logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    return (weights * per_token_loss(logp, old, ref, adv, None, None, **SETTINGS)).sum()


def fused_loss(hidden, weight, targets, weights, adv, old, ref, settings=SETTINGS, chunk=None):
    chunk = chunk or _chunk_rows(weight, DEFAULT_CHUNK_BYTES)  # what the trainer uses
    return fused_token_loss(
        hidden, weight, targets, weights, adv, old, ref, None, 1.0, chunk, settings
    )[0]


def fused_loss_cublas_backward(*inputs, settings=SETTINGS):
    """The fused call with cuBLAS for the two backward GEMMs (no zero-gradient row skipping)."""
    saved = fused_module.BACKWARD_GEMMS
    fused_module.BACKWARD_GEMMS = "cublas"
    try:
        return fused_loss(*inputs, settings=settings)
    finally:
        fused_module.BACKWARD_GEMMS = saved


def zero_advantage_rows(n, h, v):
    """beta = 0: the same call with every advantage non-zero, then with half the groups at zero."""
    settings = {**SETTINGS, "beta": 0.0}
    out = []
    full, half = make_inputs(n, h, v), make_inputs(n, h, v, zero_frac=0.5)
    for name, fn in (
        ("fused", fused_loss),
        ("fused, cuBLAS backward GEMMs", fused_loss_cublas_backward),
    ):
        call = lambda *x, fn=fn: fn(*x, settings=settings)  # noqa: E731
        full_ms, _, _ = measure(call, full)
        half_ms, _, _ = measure(call, half)
        out.append(
            {
                "shape": [n, h, v],
                "method": f"{name}, beta 0, half the groups at zero advantage",
                "ms": half_ms,
                "all_nonzero_ms": full_ms,
                "ratio_to_all_nonzero": half_ms / full_ms,
            }
        )
    return out


def liger_loss_fn(seq_len=1024):
    """cuBLAS bf16 logits, then Liger-Kernel's Triton GRPO loss on them (benchmarks/PEERS.md's best
    peer), or None when liger-kernel is not installed. Liger takes logits (B, L+1, V), so each
    sequence's hidden states get one zero row appended (0.1% more GEMM work at L=1024)."""
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError:
        return None

    def loss(hidden, weight, targets, weights, adv, old, ref):
        b = hidden.shape[0] // seq_len
        padded = torch.cat(
            [hidden.view(b, seq_len, -1), hidden.new_zeros(b, 1, hidden.shape[1])], 1
        )
        logits = padded @ weight.t()  # (B, L+1, V) bf16
        out = triton_grpo_loss(
            logits,
            old.view(b, seq_len),
            ref.view(b, seq_len),
            targets.view(b, seq_len),
            adv.view(b, seq_len)[:, 0].contiguous(),
            None,
            temperature=1.0,
            beta=SETTINGS["beta"],
            eps_low=SETTINGS["epsilon_low"],
            eps_high=SETTINGS["epsilon_low"],
            loss_type="grpo",
            reduce=True,
        )
        return out[0]

    return loss


def measure(fn, inputs, *, reps=20):
    """(median ms, peak extra GiB excluding the returned gradients, peak extra GiB including them).

    The first memory figure is the one benchmarks/PEERS.md's peer table uses: every method must hand back
    d(hidden) and d(weight), so only memory above the inputs and those gradients counts.
    """
    from triton.testing import do_bench

    hidden, weight = inputs[0], inputs[1]

    def step():
        hidden.grad = weight.grad = None
        fn(*inputs).backward()

    step()
    torch.cuda.synchronize()
    hidden.grad = weight.grad = None
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grads = hidden.grad.nbytes + weight.grad.nbytes
    peak = torch.cuda.max_memory_allocated() - base
    ms = do_bench(step, warmup=25, rep=reps * 25, return_mode="median")
    hidden.grad = weight.grad = None
    return ms, (peak - grads) / 2**30, peak / 2**30


def tflops(n, h, v, ms, passes=6):
    return passes * n * h * v / (ms * 1e-3) / 1e12


# (N, H, V, rows per chunk or None for the library's): 1, 4, 4 and 16 chunks
ACCURACY_SHAPES = [
    (1024, 896, 151936, None),
    (8192, 896, 151936, None),
    (8192, 3584, 152064, None),
    (16384, 896, 32000, 1024),
]


def check_accuracy(n, h, v, chunk):
    """Fused vs fp64 reference: log-prob error, loss error, gradient error vs the bf16 eager path.
    With several chunks dW is summed across them (in fp32 or bf16: see `_dw_in_fp32`)."""
    inputs = make_inputs(n, h, v, seq_len=256)
    hidden, weight = inputs[0], inputs[1]
    loss = fused_loss(*inputs, chunk=chunk)
    loss.backward()
    fused_grads = (hidden.grad.double(), weight.grad.double())
    hidden.grad = weight.grad = None
    eager_loss(*inputs).backward()
    eager_grads = (hidden.grad.double(), weight.grad.double())
    hidden.grad = weight.grad = None
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = eager_loss(h64, w64, *[x.double() if x.is_floating_point() else x for x in inputs[2:]])
    ref.backward()
    ref_value = ref.item()
    del ref
    rows = slice(0, 1024)  # the log-prob check on the first 1024 rows (fp64 logits are large)
    logp, _, _ = lm_head_stats_triton(hidden.detach()[rows], weight.detach(), inputs[2][rows], 1.0)
    want, _, _ = lm_head_stats_ref(h64.detach()[rows], w64.detach(), inputs[2][rows], 1.0)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    return {
        "shape": [n, h, v],
        "chunks": -(-n // (chunk or _chunk_rows(weight, DEFAULT_CHUNK_BYTES))),
        "logp_max_abs_err": (logp.double() - want).abs().max().item(),
        "loss_rel_err": abs(loss.item() - ref_value) / abs(ref_value),
        "grad_hidden_rel_err": rel(fused_grads[0], h64.grad),
        "grad_hidden_rel_err_eager_bf16": rel(eager_grads[0], h64.grad),
        "grad_weight_rel_err": rel(fused_grads[1], w64.grad),
        "grad_weight_rel_err_eager_bf16": rel(eager_grads[1], w64.grad),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="first shape only, no torch.compile")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--fused-only", action="store_true", help="no eager / compile columns")
    parser.add_argument(
        "--fp32-dw", action="store_true", help="sum dW across chunks in fp32 at any chunk count"
    )
    args = parser.parse_args()
    if args.fp32_dw:
        fused_module.MAX_LOW_PRECISION_CHUNKS = 0
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = []
    compiled = torch.compile(eager_loss)
    for n, h, v in shapes:
        floor = 6 * n * h * v / (FLOOR_TFLOPS * 1e12) * 1e3
        inputs = make_inputs(n, h, v)
        methods = [
            ("fused", fused_loss),
            ("fused, cuBLAS backward GEMMs", fused_loss_cublas_backward),
            ("eager", eager_loss),
        ]
        liger = liger_loss_fn()
        if liger is not None:
            methods.append(("cuBLAS logits + Liger grpo_loss", liger))
        if args.fused_only:
            methods = methods[:2]
        elif not (args.quick or args.no_compile):
            methods.append(("torch.compile", compiled))
        for name, fn in methods:
            try:
                ms, peak, peak_with_grads = measure(fn, inputs)
                rows.append(
                    {
                        "shape": [n, h, v],
                        "method": name,
                        "ms": ms,
                        "peak_gib": peak,
                        "peak_gib_incl_grads": peak_with_grads,
                        "tflops": tflops(n, h, v, ms),
                        "floor_ms": floor,
                        "x_floor": ms / floor,
                    }
                )
            except torch.OutOfMemoryError:
                rows.append({"shape": [n, h, v], "method": name, "error": "out of memory"})
            torch.cuda.empty_cache()
        if (n, h, v) == SHAPES[0]:
            rows += zero_advantage_rows(n, h, v)
            from triton.testing import do_bench

            score_args = (inputs[0].detach(), inputs[1].detach(), inputs[2], 1.0)
            score_ms = do_bench(
                lambda args=score_args: lm_head_stats_triton(*args),
                warmup=25,
                rep=500,
                return_mode="median",
            )
            rows.append(
                {
                    "shape": [n, h, v],
                    "method": "scoring (logp+entropy), fused",
                    "ms": score_ms,
                    "tflops": tflops(n, h, v, score_ms, passes=2),
                }
            )
        del inputs
        torch.cuda.empty_cache()
    if not args.quick:
        inputs = make_inputs(*BIG)
        try:
            ms, peak, peak_with_grads = measure(fused_loss, inputs, reps=4)
            rows.append(
                {
                    "shape": list(BIG),
                    "method": "fused",
                    "ms": ms,
                    "peak_gib": peak,
                    "peak_gib_incl_grads": peak_with_grads,
                    "tflops": tflops(*BIG, ms),
                }
            )
        except torch.OutOfMemoryError:
            rows.append({"shape": list(BIG), "method": "fused", "error": "out of memory"})
        del inputs
    accuracy = []
    for shape in ACCURACY_SHAPES[:1] if args.quick else ACCURACY_SHAPES:
        accuracy.append(check_accuracy(*shape))
        torch.cuda.empty_cache()
    print(
        f"{'shape':<22} {'method':<36} {'ms':>8} {'GiB':>7} {'w/grads':>8} {'TFLOP/s':>8} {'x floor':>8}"
    )
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "error" in r:
            print(f"{shape:<22} {r['method']:<36} {r['error']}")
            continue
        print(
            f"{shape:<22} {r['method']:<36} {r['ms']:>8.2f} {r.get('peak_gib', float('nan')):>7.2f} "
            f"{r.get('peak_gib_incl_grads', float('nan')):>8.2f} "
            f"{r.get('tflops', float('nan')):>8.0f} {r.get('x_floor', float('nan')):>8.2f}"
        )
    for r in rows:
        if "ratio_to_all_nonzero" in r:
            print(
                f"{r['method']}: {r['ms']:.2f} ms vs {r['all_nonzero_ms']:.2f} ms with every "
                f"advantage non-zero = {r['ratio_to_all_nonzero']:.2f}x"
            )
    for a in accuracy:
        print("accuracy:", json.dumps(a))
    commit = (
        os.environ.get("FASTGRPO_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    print(
        json.dumps(
            {
                "bench": "logprob",
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "commit": commit or None,
                "rows": rows,
                "accuracy": accuracy,
            }
        )
    )


if __name__ == "__main__":
    main()
