"""`pip install fastgrpo` without Triton (a CPU machine, a Mac): the CLI works, every kernel module
imports, the public ops run their `*_ref`, and a tiny model trains on the CPU.

Each check runs in a fresh interpreter whose imports of `triton` fail as they do where it is not
installed (a meta-path finder raising ImportError, installed before anything else is imported).
TRITON_INTERPRET=1 is set there too, as on the CI machine: the kernels' "or the interpreter"
branches must still see that Triton is absent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NO_TRITON = """
import importlib.abc, sys

class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "triton":
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, _NoTriton())
"""


def run_without_triton(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", NO_TRITON + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )


def run_cli_without_triton(*args: str) -> subprocess.CompletedProcess:
    return run_without_triton(
        "import runpy; runpy.run_module('fastgrpo', run_name='__main__', alter_sys=True)", *args
    )


def test_the_blocker_makes_triton_unimportable():
    out = run_without_triton("import triton")
    assert out.returncode != 0 and "blocked by the test" in out.stderr


def test_cli_help_and_config_work_without_triton():
    help_out = run_cli_without_triton("--help")
    assert help_out.returncode == 0, help_out.stderr
    assert "train" in help_out.stdout and "config" in help_out.stdout
    config_out = run_cli_without_triton("config", "--set", "train.steps=7")
    assert config_out.returncode == 0, config_out.stderr
    assert "steps: 7" in config_out.stdout


def test_every_module_imports_and_the_public_ops_run_their_references_without_triton():
    out = run_without_triton("""
        import importlib, pkgutil
        import torch
        import fastgrpo
        from fastgrpo.kernels import support

        assert support.triton is None and support.gluon is None
        for module in pkgutil.walk_packages(fastgrpo.__path__, "fastgrpo."):
            if module.name != "fastgrpo.__main__":
                importlib.import_module(module.name)

        from fastgrpo.kernels.train.lm_head_grpo_loss import lm_head_grpo_loss, lm_head_grpo_loss_ref
        from fastgrpo.kernels.train.lm_head_logprob import lm_head_logprob, lm_head_logprob_ref
        from fastgrpo.kernels.layers.rms_norm import add_rms_norm_ref, add_rms_norm_train
        from fastgrpo.kernels.layers.rope import apply_rope_qk_ref, rope_qk_train
        from fastgrpo.kernels.layers.swiglu import silu_mul_ref, silu_mul_train

        torch.manual_seed(0)
        x, residual, w = torch.randn(5, 8), torch.randn(5, 8), torch.randn(8)
        for got, want in zip(add_rms_norm_train(x, residual, w, 1e-6),
                             add_rms_norm_ref(x, residual, w, 1e-6)):
            assert torch.equal(got, want)
        q, k, cos, sin = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 8), torch.randn(5, 8)
        for got, want in zip(rope_qk_train(q, k, cos, sin), apply_rope_qk_ref(q, k, cos, sin)):
            assert torch.equal(got, want)
        gate_up = torch.randn(5, 12)
        assert torch.equal(silu_mul_train(gate_up, 6), silu_mul_ref(gate_up[:, :6], gate_up[:, 6:]))
        hidden, weight, targets = torch.randn(6, 8), torch.randn(11, 8), torch.randint(0, 11, (6,))
        for got, want in zip(lm_head_logprob(hidden, weight, targets, 0.7, with_entropy=True),
                             lm_head_logprob_ref(hidden, weight, targets, 0.7, with_entropy=True)):
            assert torch.equal(got, want)
        weights, adv = torch.full((6,), 1 / 6), torch.randn(6)
        got = lm_head_grpo_loss(hidden, weight, targets, weights, adv)
        want = lm_head_grpo_loss_ref(hidden, weight, targets, weights, adv)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        print("ok")
    """)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_a_tiny_model_trains_on_the_cpu_without_triton(tiny_model_dir, tmp_path):
    settings = {
        "model.name": tiny_model_dir,
        "model.device": "cpu",
        "run.output_dir": tmp_path / "run",
        "run.progress": False,
        "train.steps": 2,
        "rollout.prompts_per_step": 2,
        "rollout.num_generations": 2,
        "rollout.max_new_tokens": 4,
        "eval.before": False,
        "eval.after": False,
        "task.num_eval": 4,
    }
    out = run_cli_without_triton("train", *(f"--set={k}={v}" for k, v in settings.items()))
    assert out.returncode == 0, out.stderr[-3000:]
    steps = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(steps) == 2
