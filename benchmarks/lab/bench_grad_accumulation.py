"""Do bf16 gradients need fp32 accumulation across micro-batches? Measured on the real model.

With fp32 master weights (fastgrpo/train/precision.py) autograd still accumulates each
micro-batch's gradient into the bf16 parameters' bf16 `.grad`, one rounding per micro-batch; the
fp32 cast comes once per optimizer step. The alternative keeps an fp32 gradient buffer alive
through every backward pass (4 bytes a parameter at the peak) and adds each micro-batch's bf16
gradient into it.

This compares both against the fp32 model's gradient (summed in fp64), for K micro-batches of
real text: relative error of the bf16 model's gradient accumulated in bf16, and accumulated in
fp32. If the two are close, the bf16 forward and backward dominate the error and fp32
accumulation buys nothing. Prints a table, then one JSON line.

    python -m benchmarks.lab.bench_grad_accumulation [--model NAME] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json

import torch

from fastgrpo.data import build_task
from fastgrpo.models import load_model


def micro_batches(tokenizer, count: int, rows: int, length: int, device) -> list[torch.Tensor]:
    """`count` (rows, length) batches of GSM8K-like arithmetic prompts, tokenized and cut."""
    task = build_task("arithmetic", seed=0, num_train=count * rows)
    texts = [ex.prompt + " The answer is " + str(ex.columns["answer"]) for ex in task.train]
    ids = tokenizer(texts, padding="max_length", max_length=length, truncation=True)["input_ids"]
    batch = torch.tensor(ids, device=device)
    return list(batch[: count * rows].split(rows))


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    rows, length = ids.shape
    cu = torch.arange(0, (rows + 1) * length, length, dtype=torch.int32, device=ids.device)
    positions = torch.arange(length, device=ids.device).repeat(rows)
    hidden = model(ids.flatten(), positions, model.packed_attention(cu, length))
    logits = model.logits(hidden).float().view(rows, length, -1)[:, :-1]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def gradients(model, batch: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_of(model, batch).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def flat(tensors, dtype=torch.float64) -> torch.Tensor:
    return torch.cat([t.to(dtype).flatten() for t in tensors])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=48)
    args = parser.parse_args()
    fp32, tokenizer, _ = load_model(args.model, dtype="float32", device=args.device)
    bf16, _, _ = load_model(args.model, dtype="bfloat16", device=args.device)
    most = max(args.micro_batches)
    batches = micro_batches(tokenizer, most, args.rows, args.length, args.device)
    reference = [flat(gradients(fp32, b)) for b in batches]  # fp64 copies of fp32 gradients
    low = [gradients(bf16, b) for b in batches]  # bf16 gradients per micro-batch
    rows = []
    for k in args.micro_batches:
        exact = torch.stack(reference[:k]).sum(0)
        in_bf16 = [g.clone() for g in low[0]]
        for grads in low[1:k]:  # what autograd does: bf16 += bf16, rounded each time
            torch._foreach_add_(in_bf16, grads)
        in_fp32 = [g.float() for g in low[0]]
        for grads in low[1:k]:
            torch._foreach_add_(in_fp32, [g.float() for g in grads])
        norm = exact.norm()
        rows.append(
            {
                "micro_batches": k,
                "bf16_accumulation_error": float((flat(in_bf16) - exact).norm() / norm),
                "fp32_accumulation_error": float((flat(in_fp32) - exact).norm() / norm),
                "accumulation_alone": float((flat(in_bf16) - flat(in_fp32)).norm() / norm),
            }
        )
    print(f"\n{'micro-batches':>13} {'bf16 acc. err':>14} {'fp32 acc. err':>14} {'acc. alone':>11}")
    for r in rows:
        print(
            f"{r['micro_batches']:>13} {r['bf16_accumulation_error']:>14.4f} "
            f"{r['fp32_accumulation_error']:>14.4f} {r['accumulation_alone']:>11.4f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "grad_accumulation",
                "model": args.model,
                "device": args.device,
                "torch": torch.__version__,
                "rows": args.rows,
                "length": args.length,
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
