"""The product benchmarks: `python -m benchmarks.bench_step` (a whole GRPO step, against TRL),
`bench_rollout` (the generation engine, against HF `generate`), `bench_logprob` (the fused LM-head
loss, against eager, torch.compile and Liger) and `bench_learning` (held-out accuracy against
TRL). Each prints a table and, last, one JSON line; `results/README.md` lists the current results.
One-off tuning, profiling and A/B scripts live in `lab/`.
"""
