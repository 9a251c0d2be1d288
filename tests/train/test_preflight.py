"""`fastgrpo check`: a few real rollouts of a config, the numbers that decide whether it can
learn, and advice for each problem found."""

from __future__ import annotations

from fastgrpo.cli import main
from fastgrpo.config import load_config
from fastgrpo.train.preflight import CheckReport, advise
from tests.train.test_training_run import tiny_overrides, write_test_rewards

CONSTANT = """
def constant(prompts, completions, **kwargs):
    return [1.0] * len(completions)

def broken(prompts, completions, **kwargs):
    raise RuntimeError("no grader here")
"""


def test_check_reports_equal_rewards_truncation_and_failing_rewards(
    tiny_model_dir, tmp_path, capsys
):
    (tmp_path / "r.py").write_text(CONSTANT)
    rewards = f"['{tmp_path / 'r.py'}:constant', '{tmp_path / 'r.py'}:broken']"
    sets = [
        f"--set={s}" for s in tiny_overrides(tiny_model_dir, tmp_path / "never", rewards=rewards)
    ]
    assert main(["check", *sets, "--steps", "2"]) == 1
    out = capsys.readouterr().out
    assert "rolled out 2 step(s), 16 completions" in out
    assert "groups with equal rewards (no gradient): 100%" in out  # a constant reward
    assert (
        "completions cut off at the length limit: 100%" in out
    )  # 6 tokens: the tiny model rambles
    assert "reward broken failed on 100% of completions" in out
    assert "consider algo.dynamic_sampling=true" in out and "raise it, or set" in out
    assert "no grader here" in out  # its first error, named
    assert not (tmp_path / "never").exists()  # nothing written


def test_a_healthy_check_is_ready(tiny_model_dir, tmp_path, capsys):
    rewards = f"['{write_test_rewards(tmp_path)}:digit_share']"
    extra = {"rollout.max_new_tokens": 40, "rollout.num_generations": 8, "rewards": rewards}
    sets = [f"--set={s}" for s in tiny_overrides(tiny_model_dir, tmp_path / "x", **extra)]
    code = main(["check", *sets, "--steps", "1"])
    out = capsys.readouterr().out
    assert "completion tokens/s" in out and "verdict:" in out
    assert "predicted peak GPU memory of a bf16 run on an H100 80GB:" in out
    assert "the longest completion that fits at this batch" in out
    assert code == (0 if "verdict: ready to train" in out else 1)


def test_advice_names_each_problem_with_its_fix():
    config = load_config()
    fine = CheckReport(2, 64, 0.1, 0.05, 0.4, 0.4, 100.0, 20.0)
    assert advise(fine, config) == []
    dead = CheckReport(
        2, 64, 1.0, 0.0, 0.0, 0.0, 100.0, 20.0, failures={"r": 0.5}, errors={"r": "E"}
    )
    text = " | ".join(advise(dead, config))
    assert "100% of groups have equal rewards" in text and "every completion scored 0" in text
    assert "reward r failed on 50% of completions (first error: E)" in text
