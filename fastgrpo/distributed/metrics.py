"""A step's metrics from every rank, made into the one record rank 0 writes.

Each rank measures its own share of the batch; the job's record takes, per key, what the whole
batch would show: the sum of counts and of throughputs, the min and max of extremes, the slowest
rank's phase times (the step waits for it; `time/X/per_rank` lists every rank's where they differ
by more than 5%), and the mean of everything else (every rank holds the same number of rows, so
the mean of per-rank means is the batch mean for per-row metrics). Keys
may differ between ranks (a reward that failed on one rank only): a key missing on a rank counts
as 0 where summed and is left out of the other reductions. A reward's error text is the first
failing rank's, with that rank named (the run guard stops the job with it).
"""

from __future__ import annotations

SUMMED_PREFIXES = ("reward_failures/", "skipped_steps")
ERROR_PREFIX = "reward_errors/"
SUMMED = {"tokens_per_s"}
LOWEST_SUFFIX = ("/min_length", "/importance_sampling_ratio/min")
HIGHEST_SUFFIX = ("/max_length", "/importance_sampling_ratio/max", "_difference/max")
SLOWEST_PREFIXES = ("time/", "peak_memory_gib")


def combine_records(records: list[dict]) -> dict:
    """One record from the ranks' records, in rank order (see the module docstring for the rule
    per key)."""
    keys = list(dict.fromkeys(k for record in records for k in record))
    out = {}
    for key in keys:
        values = [r[key] for r in records if key in r]
        if key.startswith(ERROR_PREFIX):
            rank = next(i for i, r in enumerate(records) if key in r)
            out[key] = f"{values[0]} (on rank {rank})"
        elif not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[key] = values[0]  # text or flags: rank 0's
        elif key in SUMMED or key.startswith(SUMMED_PREFIXES):
            out[key] = sum(values)
        elif key.endswith(LOWEST_SUFFIX):
            out[key] = min(values)
        elif key.endswith(HIGHEST_SUFFIX) or key.startswith(SLOWEST_PREFIXES):
            out[key] = max(values)
            if key.startswith("time/") and len(values) > 1 and max(values) > 1.05 * min(values):
                out[f"{key}/per_rank"] = values  # where the ranks differ by more than 5%
        else:
            out[key] = sum(values) / len(values)
    return out


def gather_record(record: dict, world) -> dict:
    """Every rank's record combined (on every rank: one small all-gather of Python objects)."""
    return combine_records(world.gather(record))


def combine_eval_scores(scores: list[dict]) -> dict:
    """The scores of the whole evaluation set from each rank's scores of its share (`evaluate`'s
    per-problem means, weighted by the problems each rank scored)."""
    total = sum(s["num_problems"] for s in scores)
    out = {"num_problems": total}
    for key in scores[0]:
        if key != "num_problems":
            out[key] = sum(s[key] * s["num_problems"] for s in scores) / max(total, 1)
    return out
