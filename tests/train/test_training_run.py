"""End-to-end training on a tiny model: CLI, metrics, checkpoints, resume, Ctrl-C, micro-batching."""

from __future__ import annotations

import gc
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastgrpo.cli import main
from fastgrpo.config import ConfigError, load_config
from fastgrpo.train import load_resume_config, run_training
from fastgrpo.train.checkpoint import latest_checkpoint

INTERRUPTING_REWARD = '''
import os, signal
calls = 0

def interrupt_after(prompts, completions, **kwargs):
    """Zero reward; sends Ctrl-C to this process on call number $INTERRUPT_AT."""
    global calls
    calls += 1
    if str(calls) == os.environ.get("INTERRUPT_AT"):
        os.kill(os.getpid(), signal.SIGINT)
    return [0.0] * len(completions)


def digit_share(prompts, completions, **kwargs):
    """Share of digits in the completion: varies even for a random tiny model."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
'''


def tiny_overrides(model_dir, run_dir, steps=3, **extra) -> list[str]:
    settings = {
        "model.name": model_dir,
        "model.device": "cpu",
        "run.output_dir": str(run_dir),
        "run.progress": False,
        "train.steps": steps,
        "train.learning_rate": 1e-3,
        "rollout.prompts_per_step": 2,
        "rollout.num_generations": 4,
        "rollout.max_new_tokens": 6,
        "rollout.temperature": 1.0,
        "eval.num_problems": 4,
        "eval.before": False,
        "eval.after": False,
        "task.num_eval": 8,
        "rewards": "[math_accuracy, answer_format]",
        "run.plots": False,  # pictures cost ~1.5 s of matplotlib; test_plots.py draws them
        **extra,
    }
    return [f"{k}={v}" for k, v in settings.items()]


def write_test_rewards(folder) -> str:
    """A module of test rewards in `folder`; returns its path for "path.py:function" specs."""
    path = folder / "rewards.py"
    path.write_text(INTERRUPTING_REWARD)
    return str(path)


def weights(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model" / "model.safetensors"))


def assert_same_update(model_dir, final_a, final_b, tolerance):
    """What training changed agrees, tensor by tensor, within `tolerance` of its norm. AdamW
    normalises each element's step, so an element whose gradient is ~0 can move by up to the
    learning rate on rounding noise alone: an element-wise tolerance would test that noise."""
    start = load_file(str(Path(model_dir) / "model.safetensors"))
    for name, value in final_a.items():
        step_a, step_b = value - start[name], final_b[name] - start[name]
        error = ((step_b - step_a).norm() / step_a.norm().clamp(min=1e-12)).item()
        assert error < tolerance, (name, error)


def test_cli_train_runs_end_to_end_and_writes_metrics_checkpoint_and_eval(
    tiny_model_dir, tmp_path, capsys
):
    preset = tmp_path / "tiny.yaml"
    preset.write_text(
        textwrap.dedent("""\
        # fastgrpo train tiny.yaml
        algo:
          beta: 0.04
        train:
          num_iterations: 2
          mini_batches: 2
    """)
    )
    run_dir = tmp_path / "run"
    args = ["train", str(preset)]
    for item in tiny_overrides(
        tiny_model_dir, run_dir, steps=2, **{"eval.before": True, "eval.after": True}
    ):
        args += ["--set", item]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy:" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["accuracy_after"] is not None
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind", "train") == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    for key in (
        "reward/mean",
        "rewards/answer_format",
        "accuracy",
        "kl",
        "clip_ratio/region_mean",
        "entropy",
        "completion/mean_length",
        "frac_zero_std_groups",
        "time/rollout",
        "time/reward",
        "time/reference",
        "time/update",
        "time/optimizer",
        "tokens_per_s",
        "peak_memory_gib",
    ):
        assert key in steps[0], key
    assert steps[0]["kl"] >= 0
    assert [r["when"] for r in records if r.get("kind") == "eval"] == ["before", "after"]

    # the CLI continues the run; the accuracy before training comes from the run's metrics
    assert main(["train", "--resume", str(run_dir), "--set", "train.steps=3"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["steps"] == 3 and resumed["accuracy_before"] == summary["accuracy_before"]

    from transformers import AutoModelForCausalLM

    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint.name == "step_000003"
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint / "model")
    assert reloaded.config.num_hidden_layers == 2

    assert (
        main(
            [
                "eval",
                str(preset),
                "--model",
                str(run_dir),
                "--num",
                "3",
                *sum((["--set", s] for s in tiny_overrides(tiny_model_dir, run_dir)), []),
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_problems"] == 3 and 0.0 <= result["accuracy"] <= 1.0


def test_training_changes_the_weights_and_a_new_run_refuses_an_existing_run_folder(
    tiny_model_dir, tmp_path
):
    run_dir = tmp_path / "run"
    result = run_training(
        None,
        overrides=tiny_overrides(
            tiny_model_dir, run_dir, steps=1, **{"rewards": "[answer_format]", "task.min_value": 0}
        ),
    )
    assert result.steps == 1
    before = weights(latest_checkpoint(run_dir))
    with pytest.raises(ConfigError, match="--resume"):
        run_training(None, overrides=tiny_overrides(tiny_model_dir, run_dir, steps=1))
    assert all(torch.equal(before[k], v) for k, v in weights(latest_checkpoint(run_dir)).items())


def live_parameters() -> int:
    gc.collect()
    return sum(isinstance(o, torch.nn.Parameter) for o in gc.get_objects())


def test_a_finished_run_leaves_no_model_alive(tiny_model_dir, tmp_path):
    """Runs in one process (a notebook, a sweep) must not pile up: each used to keep its model,
    and on a GPU its KV cache and graphs, alive through the rollout engine's table."""
    before = live_parameters()
    for name in ("a", "b"):
        overrides = tiny_overrides(tiny_model_dir, tmp_path / name, steps=1, **{"algo.beta": 0.04})
        run_training(None, overrides=overrides)
        assert live_parameters() == before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the fp32 masters resume too
def test_resume_after_ctrl_c_gives_the_same_next_step_as_an_uninterrupted_run(
    tiny_model_dir, tmp_path, monkeypatch, dtype
):
    reward_file = tmp_path / "interrupting.py"
    reward_file.write_text(INTERRUPTING_REWARD)
    rewards = (
        f"[math_accuracy, '{reward_file}:digit_share', "
        f"{{function: '{reward_file}:interrupt_after', weight: 0.0}}]"
    )
    common = {
        "rewards": rewards,
        "train.lr_scheduler": "cosine",
        "train.warmup_steps": 1,
        "train.learning_rate": 1e-5,  # below half a bf16 ulp: only the fp32 masters record it
        "model.dtype": dtype,
    }

    straight = run_training(
        None, overrides=tiny_overrides(tiny_model_dir, tmp_path / "a", steps=3, **common)
    )

    monkeypatch.setenv(
        "INTERRUPT_AT", "2"
    )  # Ctrl-C arrives during step 2 (calls restart at 1 per load)
    stopped = run_training(
        None, overrides=tiny_overrides(tiny_model_dir, tmp_path / "b", steps=3, **common)
    )
    assert stopped.interrupted and stopped.steps == 2
    assert latest_checkpoint(tmp_path / "b").name == "step_000002"
    monkeypatch.delenv("INTERRUPT_AT")

    # its rewards come from a file: resuming runs that code only when trusted
    resumed = run_training(load_resume_config(tmp_path / "b", trust_run_code=True), resume=True)
    assert resumed.steps == 3 and len(resumed.history) == 1
    want, got = straight.history[2], resumed.history[0]
    for key in ("reward/mean", "loss", "grad_norm", "completion/mean_length", "lr", "entropy"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    final_a, final_b = (
        weights(latest_checkpoint(tmp_path / "a")),
        weights(latest_checkpoint(tmp_path / "b")),
    )
    for name, value in final_a.items():
        assert torch.allclose(final_b[name], value, atol=1e-6), name
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_micro_batch_token_budget_does_not_change_the_update(tiny_model_dir, tmp_path):
    reward_file = write_test_rewards(tmp_path)
    finals = []
    for budget, name in ((100000, "one"), (40, "many")):
        overrides = tiny_overrides(
            tiny_model_dir,
            tmp_path / name,
            steps=1,
            **{
                "train.micro_batch_tokens": budget,
                "rewards": f"['{reward_file}:digit_share']",
                "algo.beta": 0.1,
            },
        )
        result = run_training(None, overrides=overrides)
        finals.append((result.history[0], weights(latest_checkpoint(tmp_path / name))))
    (metrics_one, w_one), (metrics_many, w_many) = finals
    assert metrics_one["reward/mean"] == metrics_many["reward/mean"]  # same rollout
    assert metrics_one["loss"] == pytest.approx(metrics_many["loss"], abs=1e-6)
    assert_same_update(tiny_model_dir, w_one, w_many, 1e-4)


def test_config_errors_name_the_problem_and_the_fix():
    with pytest.raises(ConfigError, match="Did you mean 'algo.beta'"):
        load_config(None, ["algo.bta=0.1"])
    with pytest.raises(ConfigError, match="must be >= 2"):
        load_config(None, ["rollout.num_generations=1"])
    with pytest.raises(ConfigError, match="must be float"):
        load_config(None, ["algo.beta=abc"])
    with pytest.raises(ConfigError, match="does not divide"):
        load_config(None, ["train.mini_batches=3"])
    with pytest.raises(ConfigError, match="choose one of"):
        load_config(None, ["algo.loss_type=grpoo"])


def test_ratio_is_exactly_one_when_the_weights_do_not_move_between_inner_epochs(
    tiny_model_dir, tmp_path
):
    reward_file = write_test_rewards(tmp_path)
    overrides = tiny_overrides(
        tiny_model_dir,
        tmp_path / "run",
        steps=2,
        **{
            "train.learning_rate": 0.0,
            "train.num_iterations": 2,
            "train.mini_batches": 2,
            "train.micro_batch_tokens": 150,
            "rewards": f"['{reward_file}:digit_share']",
        },
    )
    result = run_training(None, overrides=overrides)
    for record in result.history:
        assert record["active_rows_frac"] > 0
        assert record["ratio_mean"] == 1.0  # old log-probs are bitwise what the update recomputes
        assert record["clip_ratio/region_mean"] == 0.0


GSM8K = __import__("pathlib").Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"


@pytest.mark.skipif(
    not (GSM8K / "test.jsonl").is_file(), reason="GSM8K copy not beside the repository"
)
def test_eval_reads_gsm8k_from_a_local_folder(tiny_model_dir, capsys):
    args = [
        "eval",
        "--model",
        tiny_model_dir,
        "--num",
        "2",
        "--max-new-tokens",
        "4",
        "--set",
        "task.name=gsm8k",
        "--set",
        f"task.path={GSM8K}",
        "--set",
        "model.device=cpu",
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["task"] == "gsm8k" and result["num_problems"] == 2


@pytest.mark.parametrize(
    "settings",
    [
        {
            "algo.loss_type": "dapo",
            "algo.epsilon_high": 0.28,
            "algo.mask_truncated_completions": True,
        },
        {"algo.loss_type": "dr_grpo", "algo.scale_rewards": "none"},
        {
            "algo.loss_type": "bnpo",
            "algo.baseline": "leave_one_out",
            "algo.kl_estimator": "k2",
            "algo.beta": 0.1,
        },
        {
            "algo.loss_type": "gspo",
            "algo.epsilon_low": 3e-4,
            "algo.epsilon_high": 4e-4,
            "train.num_iterations": 2,
        },
        {"algo.loss_type": "cispo", "algo.epsilon_high": 5.0, "algo.entropy_coef": 0.01},
        {
            "algo.importance_sampling_correction": True,
            "algo.delta": 1.5,
            "train.lr_scheduler": "linear",
        },
    ],
    ids=["dapo", "dr_grpo", "bnpo_rloo_k2", "gspo", "cispo_entropy", "tis_delta"],
)
def test_every_algorithm_variant_trains_through_the_loop(settings, tiny_model_dir, tmp_path):
    reward_file = write_test_rewards(tmp_path)
    overrides = tiny_overrides(
        tiny_model_dir,
        tmp_path / "run",
        steps=1,
        **{"rewards": f"['{reward_file}:digit_share']", **settings},
    )
    record = run_training(None, overrides=overrides).history[0]
    assert math.isfinite(record["loss"]) and record["active_rows_frac"] > 0
    if settings.get("algo.importance_sampling_correction"):
        # HF generate's logits and the trainer's agree in fp32, so the IS weight is ~1
        assert record["is_ratio_mean"] == pytest.approx(1.0, abs=1e-4)


# These run the Triton kernels on the CPU in Triton's interpreter, which tests/conftest.py turns on
# only where there is no GPU (the switch is read once, at import); on a GPU the CUDA test covers it.
CPU_INTERPRETER_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="needs Triton's interpreter (machines without a GPU)"
)


@CPU_INTERPRETER_ONLY
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"algo.beta": 0.05, "train.num_iterations": 2, "algo.loss_type": "dapo"},
        {
            "algo.loss_type": "gspo",
            "algo.epsilon_low": 3e-4,
            "algo.epsilon_high": 4e-4,
            "train.num_iterations": 2,
        },
    ],
    ids=["grpo", "dapo_kl_two_epochs", "gspo_two_pass"],
)
def test_fused_lm_head_path_gives_the_reference_training_curve(extra, tiny_model_dir, tmp_path):
    reward_file = write_test_rewards(tmp_path)
    runs = {}
    for mode in ("off", "on"):
        overrides = tiny_overrides(
            tiny_model_dir,
            tmp_path / mode,
            steps=3,
            **{"rewards": f"['{reward_file}:digit_share']", "train.fused_lm_head": mode, **extra},
        )
        runs[mode] = run_training(None, overrides=overrides)
    for ref, fused in zip(runs["off"].history, runs["on"].history):
        assert fused["reward/mean"] == pytest.approx(ref["reward/mean"], abs=1e-6)  # same samples
        for key in ("loss", "entropy", "ratio_mean", "grad_norm"):
            assert fused[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    final_ref = weights(latest_checkpoint(tmp_path / "off"))
    final_fused = weights(latest_checkpoint(tmp_path / "on"))
    assert_same_update(tiny_model_dir, final_ref, final_fused, 1e-3)


@CPU_INTERPRETER_ONLY
def test_fused_lm_head_on_really_runs_the_fused_kernels(tiny_model_dir, tmp_path, monkeypatch):
    from fastgrpo.kernels.train import lm_head_grpo_loss as fused

    calls = []
    original = fused._FusedLMHeadLoss.apply
    monkeypatch.setattr(fused._FusedLMHeadLoss, "apply", lambda *a: calls.append(1) or original(*a))
    reward_file = write_test_rewards(tmp_path)
    overrides = tiny_overrides(
        tiny_model_dir,
        tmp_path / "run",
        steps=1,
        **{"rewards": f"['{reward_file}:digit_share']", "train.fused_lm_head": "on"},
    )
    run_training(None, overrides=overrides)
    assert calls


def test_fused_lm_head_on_with_a_cpu_model_and_no_interpreter_says_what_to_do(
    tiny_model_dir, tmp_path, monkeypatch
):
    from fastgrpo.train import update

    monkeypatch.setattr(update, "interpreting", lambda: False)
    reward_file = write_test_rewards(tmp_path)
    overrides = tiny_overrides(
        tiny_model_dir,
        tmp_path / "run",
        steps=1,
        **{"rewards": f"['{reward_file}:digit_share']", "train.fused_lm_head": "on"},
    )
    with pytest.raises(ValueError, match="need the model on a CUDA GPU"):
        run_training(None, overrides=overrides)


def test_shared_prompts_give_the_per_row_training_curve(tiny_model_dir, tmp_path, monkeypatch):
    """Fixed seed, fp32 CPU: packing each prompt once for its samples (the default) and packing a
    copy per row give the same samples, metrics and final weights, with two inner epochs and a
    KL term so that the old and reference log-probs take the shared layout too."""
    from fastgrpo.train import logprobs

    reward_file = write_test_rewards(tmp_path)
    runs = {}
    for share in (False, True):
        monkeypatch.setattr(logprobs, "SHARE_PROMPTS", share)
        name = "shared" if share else "copies"
        overrides = tiny_overrides(
            tiny_model_dir,
            tmp_path / name,
            steps=3,
            **{
                "rewards": f"['{reward_file}:digit_share']",
                "algo.beta": 0.05,
                "train.num_iterations": 2,
            },
        )
        runs[name] = run_training(None, overrides=overrides)
    for copies, shared in zip(runs["copies"].history, runs["shared"].history):
        assert shared["reward/mean"] == pytest.approx(copies["reward/mean"], abs=1e-6)
        for key in ("loss", "entropy", "ratio_mean", "grad_norm", "kl"):
            assert shared[key] == pytest.approx(copies[key], rel=1e-4, abs=1e-6), key
    final_copies = weights(latest_checkpoint(tmp_path / "copies"))
    final_shared = weights(latest_checkpoint(tmp_path / "shared"))
    assert_same_update(tiny_model_dir, final_copies, final_shared, 1e-3)


LENGTH_RECORDER = """
import json, os

def record_lengths(prompts, completions, completion_lengths, max_completion_length, **kwargs):
    with open(os.environ["LENGTHS_FILE"], "a") as out:
        out.write(json.dumps([completion_lengths, max_completion_length]) + "\\n")
    return [0.0] * len(completions)
"""


def test_rewards_receive_each_completions_token_count_and_the_limit(
    tiny_model_dir, tmp_path, monkeypatch
):
    (tmp_path / "lengths.py").write_text(LENGTH_RECORDER)
    monkeypatch.setenv("LENGTHS_FILE", str(tmp_path / "lengths.jsonl"))
    rewards = f"['{tmp_path / 'lengths.py'}:record_lengths']"
    result = run_training(
        None, overrides=tiny_overrides(tiny_model_dir, tmp_path / "run", steps=1, rewards=rewards)
    )
    lengths, limits = json.loads((tmp_path / "lengths.jsonl").read_text().splitlines()[0])
    assert limits == [6] * 8  # rollout.max_new_tokens, once per completion
    assert all(1 <= n <= 6 for n in lengths) and len(lengths) == 8
    assert sum(lengths) / 8 == pytest.approx(result.history[0]["completion/mean_length"])


def test_a_slow_checkpoint_is_said_once(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """A save slower than SLOW_SAVE_S warns (once, of two saves) that a stop signal's save may
    be cut short."""
    from fastgrpo.train import loop

    monkeypatch.setattr(loop, "SLOW_SAVE_S", -1.0)  # every save counts as slow here
    run = tmp_path / "run"
    overrides = tiny_overrides(tiny_model_dir, run, steps=2, **{"run.save_every": 1})
    with caplog.at_level("WARNING", logger="fastgrpo.train"):
        run_training(None, overrides=overrides)
    said = [r.getMessage() for r in caplog.records if "a checkpoint took" in r.getMessage()]
    assert len(said) == 1 and "torchrun kills the ranks 30 s later" in said[0]
