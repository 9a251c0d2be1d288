"""A rank that fails in a data-parallel job, a check: each scenario runs `fastgrpo train --nproc 2`
with a fault on rank 1 under a wall-clock bound, and reports how the job ended.

The requirement: a rank that fails (an exception, OOM, a reward that hangs, a kill) ends the whole
job within a bounded time, with the failing rank and its error in the message; never a silent
hang. A reward that raises is the exception to it: fastgrpo scores its completions 0 and counts
the failures (one bad completion must not kill a run), and stops every rank through the run guard
only when the reward keeps failing.

Scenarios, every fault on rank 1 at step 2 (a fault module, written to a temp folder, is one of
the run's rewards: each rank calls it once a step, and rank 1 alone wraps the step's update):
  reward_raises         ValueError from a reward once: the job finishes, step 2 counts failures
  reward_keeps_raising  ValueError from a reward every step: the run guard ends every rank
  step_raises           RuntimeError inside the training step (before the update's all-reduce)
  step_oom              an allocation no device holds, inside the training step
  rank_exits            os._exit(3) inside a reward: a crash no Python handler sees
  rank_killed           SIGKILL to rank 1's process (found as torchrun's child in /proc)
  reward_hangs          a reward that never returns; the other rank's collective must time out
                        (shortened for the check to --hang-timeout s with the private
                        torch.distributed _set_pg_timeout; 0 keeps fastgrpo's 600 s)

    python -m benchmarks.lab.check_rank_failure_gpu [--device cuda|cpu] [--model DIR] [--only ...]

Without --model it builds a tiny random Llama (hidden 32, 2 layers, a character tokenizer). Per
scenario: the exit code, the seconds from the fault to the job's end (bound: --bound, plus the
collective timeout for a hang), whether the fault's error is in the output, whether a line (or
torchrun's root-cause entry) gives it to rank 1, and the rank torchrun calls the root cause:
without error files its failure times have 1 s resolution, so a rank that died of its peer's
crash in the same second can be named instead (seen on gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.conftest import build_tiny_model

REPO = Path(__file__).resolve().parents[2]  # the fastgrpo checkout the job imports

FAULTS = '''
"""Faults for check_rank_failure_gpu, on rank FAULT_RANK at step FAULT_STEP (rewards are called
once a step per rank: evaluations are off). FAULT_MARK gets the time the fault fired."""
import datetime, os, time

FAULT = os.environ["FAULT"]
HIT = os.environ.get("RANK") == os.environ["FAULT_RANK"]
AT = int(os.environ["FAULT_STEP"])
calls = 0


def fired():
    with open(os.environ["FAULT_MARK"], "w") as f:
        f.write(repr(time.time()))


def fault(prompts, completions, **kwargs):
    """The share of digits in each completion (it varies even for a random model), or a fault."""
    global calls
    calls += 1
    now = calls == AT or (FAULT == "reward_keeps_raising" and calls >= AT)
    if HIT and now and FAULT in ("reward_raises", "reward_keeps_raising", "rank_exits",
                                 "reward_hangs"):
        fired()
        if FAULT == "rank_exits":
            os._exit(3)
        while FAULT == "reward_hangs":
            time.sleep(60)
        raise ValueError(f"injected reward error at step {calls}")  # the rank: fastgrpo's to say
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


if FAULT in ("step_raises", "step_oom") and HIT:
    import torch
    import fastgrpo.train.step as step

    update_policy = step.update_policy

    def failing_update(model, *args, **kwargs):
        if calls == AT:
            fired()
            if FAULT == "step_oom":
                torch.empty(2**62, dtype=torch.uint8, device=model.device)
            raise RuntimeError(f"injected fault in the training step at step {calls}")
        return update_policy(model, *args, **kwargs)

    step.update_policy = failing_update

if FAULT == "reward_hangs" and float(os.environ.get("HANG_TIMEOUT_S", "0")) > 0:
    import torch.distributed.distributed_c10d as c10d

    c10d._set_pg_timeout(datetime.timedelta(seconds=float(os.environ["HANG_TIMEOUT_S"])))
'''


@dataclass
class Scenario:
    name: str
    ends: bool  # the job must end early, with an error (else: finish every step, exit 0)
    error: str  # a regular expression for the fault's error in the job's output
    steps: int = 4


SCENARIOS = [
    Scenario("reward_raises", ends=False, error=r"injected reward error"),
    Scenario("reward_keeps_raising", ends=True, error=r"injected reward error"),
    Scenario("step_raises", ends=True, error=r"RuntimeError: injected fault in the training step"),
    Scenario("step_oom", ends=True, error=r"out of memory|can't allocate memory"),
    Scenario("rank_exits", ends=True, error=r"exitcode\s*:\s*3\b"),
    Scenario("rank_killed", ends=True, error=r"Signal 9 \(SIGKILL\)", steps=50),
    Scenario("reward_hangs", ends=True, error=r"[Tt]imed? ?out"),
]


def command(args, scenario: Scenario, root: Path) -> list[str]:
    rewards = f"['{root / 'faults.py'}:fault']"
    settings = {
        "model.name": args.model, "model.device": args.device, "model.dtype": args.dtype,
        "run.output_dir": root / scenario.name, "run.progress": False, "run.plots": False,
        "train.steps": scenario.steps, "train.learning_rate": 1e-3,
        "rollout.prompts_per_step": 4, "rollout.num_generations": 4,
        "rollout.max_new_tokens": args.max_new_tokens, "rollout.temperature": 1.0,
        "eval.before": False, "eval.after": False, "rewards": rewards,
        # the guard stops a reward failing on more than 1/4 of a step's completions (rank 1
        # holds half of them) in 2 steps in a row
        "train.max_reward_failure_frac": 0.25, "train.max_failing_reward_steps": 2,
    }  # fmt: skip
    sets = [f"--set={key}={value}" for key, value in settings.items()]
    return [sys.executable, "-m", "fastgrpo", "train", "--nproc", "2", *sets]


def descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, parent pid) of every process below `pid`, from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += [(k, parent) for k in kids]
        frontier += kids
    return found


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of torchrun's worker of global rank `rank`: a child whose parent has no RANK."""
    tree = descendants(launcher)
    environs = {}
    for pid, _ in tree:
        try:
            environs[pid] = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            environs[pid] = []
    for pid, parent in tree:
        parent_ranked = any(v.startswith(b"RANK=") for v in environs.get(parent, []))
        if f"RANK={rank}".encode() in environs[pid] and not parent_ranked:
            return pid
    return None


def wait_for_step(run_dir: Path, launcher: subprocess.Popen, deadline: float) -> bool:
    """Whether a step's record reached metrics.jsonl before the job ended or the deadline."""
    metrics = run_dir / "metrics.jsonl"
    while launcher.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and '"time/step"' in metrics.read_text():
            return True
        time.sleep(0.2)
    return False


def run(args, scenario: Scenario, root: Path) -> dict:
    mark = root / f"{scenario.name}.fired"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"FAULT": scenario.name, "FAULT_RANK": "1", "FAULT_STEP": "2",
            "FAULT_MARK": str(mark), "HANG_TIMEOUT_S": str(args.hang_timeout),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}  # fmt: skip
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py: no kernel needs a GPU
    log_path = root / f"{scenario.name}.log"
    start = time.monotonic()
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would hang the job
        launcher = subprocess.Popen(
            command(args, scenario, root), env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        if scenario.name == "rank_killed":
            if wait_for_step(root / scenario.name, launcher, start + args.timeout):
                pid = rank_pid(launcher.pid, 1)
                if pid is not None:
                    mark.write_text(repr(time.time()))
                    os.kill(pid, signal.SIGKILL)
        try:
            code = launcher.wait(timeout=max(1.0, start + args.timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None  # a hang: end what this script started, by pid
            for pid, _ in reversed(descendants(launcher.pid)):
                _kill(pid)
            _kill(launcher.pid)
            launcher.wait()
    seconds, ended = time.monotonic() - start, time.time()
    after = ended - float(mark.read_text()) if mark.exists() else None  # the mark: wall clock
    return judge(args, scenario, root, log_path.read_text(), code, seconds, after)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def root_cause(output: str) -> tuple[int | None, str]:
    """The rank torchrun's failure report names as the root cause (its first observed failure),
    and that entry of the report."""
    found = re.search(r"Root Cause \(first observed failure\):\s*\[\d+\]:(.*?)(?:={20}|$)",
                      output, re.S)  # fmt: skip
    rank = re.search(r"rank\s*:\s*(\d+)", found.group(1)) if found else None
    return (int(rank.group(1)) if rank else None), (found.group(1) if found else "")


def names_rank_1(output: str, error: str) -> bool:
    """Whether the output gives the error to rank 1: a line with both (torch tags a rank's
    traceback "[rank1]:", fastgrpo its log and error lines), or torchrun's root cause entry."""
    for line in output.splitlines():
        if re.search(error, line) and re.search(r"\[rank1\]|\brank 1\b", line):
            return True
    rank, entry = root_cause(output)
    return rank == 1 and bool(re.search(error, entry))


def judge(args, scenario, root, output, code, seconds, after) -> dict:
    bound = args.bound + (args.hang_timeout or 600) * (scenario.name == "reward_hangs")
    row = {"scenario": scenario.name, "exit": code, "seconds": round(seconds, 1),
           "after_fault_s": None if after is None else round(after, 1), "bound_s": bound,
           "root_cause_rank": root_cause(output)[0],
           "error_named": bool(re.search(scenario.error, output)),
           "rank_1_named": names_rank_1(output, scenario.error)}  # fmt: skip
    if scenario.ends:
        row["passed"] = (
            code not in (0, None) and after is not None and after <= bound
            and row["error_named"] and row["rank_1_named"]
        )  # fmt: skip
    else:  # the job goes on: step 2's record counts rank 1's failures and names rank 1
        records = [json.loads(line) for line in _lines(root / scenario.name / "metrics.jsonl")]
        steps = {r["step"]: r for r in records if "time/step" in r}
        row["reward_failures_step_2"] = steps.get(2, {}).get("reward_failures/fault")
        row["reward_error_step_2"] = steps.get(2, {}).get("reward_errors/fault")
        rank_1_rows = 4 // 2 * 4  # prompts_per_step / 2 ranks x num_generations
        row["passed"] = (
            code == 0 and sorted(steps) == list(range(1, scenario.steps + 1))
            and row["reward_failures_step_2"] == rank_1_rows
            and "on rank 1" in str(row["reward_error_step_2"]) and row["rank_1_named"]
        )  # fmt: skip
    row["log"] = str(root / f"{scenario.name}.log")
    return row


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--model", help="a model folder; default: a tiny random Llama")
    parser.add_argument("--dtype", default=None, help="model.dtype (default: bfloat16 on cuda)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--only", nargs="*", choices=[s.name for s in SCENARIOS])
    parser.add_argument("--bound", type=float, default=60.0,
                        help="seconds from the fault to the job's end (torchrun gives ranks 30 s "
                             "between its SIGTERM and SIGKILL)")  # fmt: skip
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=30.0,
        help="reward_hangs: the collective timeout, s (0: fastgrpo's 600 s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a scenario may run at all before it counts as a hang",
    )
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.hang_timeout <= 0:
        args.timeout = max(args.timeout, 600 + args.bound + 120)
    root = Path(tempfile.mkdtemp(prefix="rank_failure_"))
    (root / "faults.py").write_text(FAULTS)
    args.model = args.model or str(build_tiny_model(root / "model"))
    rows = []
    print(f"{'scenario':21} {'exit':>5} {'wall s':>7} {'after fault s':>13} {'error named':>11} "
          f"{'as rank 1':>9} {'torchrun root':>13}  result")  # fmt: skip
    for scenario in [s for s in SCENARIOS if not args.only or s.name in args.only]:
        row = run(args, scenario, root)
        rows.append(row)
        print(f"{row['scenario']:21} {str(row['exit']):>5} {row['seconds']:7.1f} "
              f"{str(row['after_fault_s']):>13} {str(row['error_named']):>11} "
              f"{str(row['rank_1_named']):>9} {str(row['root_cause_rank']):>13}  "
              f"{'pass' if row['passed'] else 'FAIL'}", flush=True)  # fmt: skip
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    print(json.dumps({"bench": "check_rank_failure_gpu", "device": args.device, "gpu": gpu,
                      "gpus": torch.cuda.device_count(), "torch": torch.__version__,
                      "commit": os.environ.get("FASTGRPO_COMMIT", "unknown"),
                      "model": args.model, "bound_s": args.bound,
                      "hang_timeout_s": args.hang_timeout, "results": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
