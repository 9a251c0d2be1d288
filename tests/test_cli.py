"""The `fastgrpo` command: help text and clean, actionable errors (exit code 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fastgrpo.cli import main


def test_help_explains_every_command(capsys):
    assert main([]) == 0
    text = capsys.readouterr().out
    for command in ("train", "eval", "config"):
        assert command in text
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    assert "--resume" in capsys.readouterr().out


def test_console_script_module_runs():
    out = subprocess.run(
        [sys.executable, "-m", "fastgrpo", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("fastgrpo ")


@pytest.mark.parametrize(
    "command", [["--help"], ["config", "--keys"], ["config", "--set", "train.steps=3"]]
)
def test_help_and_config_commands_do_not_import_torch(command):
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fastgrpo", *command],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert "fastgrpo.cli" in imported  # the import log is there to read
    assert not {"torch", "transformers"} & imported


def test_config_keys_lists_type_default_and_meaning(capsys):
    assert main(["config", "--keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["key", "type", "default", "meaning"]
    row = next(line for line in lines if line.startswith("train.learning_rate "))
    assert row.split()[:3] == ["train.learning_rate", "float", "1e-05"]
    assert "learning rate" in row


def _error_of(args, capsys) -> str:
    assert main(args) == 2
    return capsys.readouterr().err


def test_unknown_config_key_suggests_the_nearest(capsys):
    err = _error_of(["config", "--set", "rollout.temprature=0.5"], capsys)
    assert "Did you mean 'rollout.temperature'" in err


def test_missing_dataset_file_is_named(tmp_path, tiny_model_dir, capsys):
    err = _error_of(
        [
            "eval",
            "--set",
            "task.name=jsonl",
            "--set",
            f"task.path={tmp_path / 'nope.jsonl'}",
            "--model",
            tiny_model_dir,
        ],
        capsys,
    )
    assert "nope.jsonl" in err


def test_malformed_jsonl_line_is_reported_as_file_and_line(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(
        '{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": "4"}\n{"prompt": oops}\n'
    )
    err = _error_of(
        [
            "eval",
            "--set",
            "task.name=jsonl",
            "--set",
            f"task.path={data}",
            "--model",
            tiny_model_dir,
        ],
        capsys,
    )
    assert "data.jsonl:3" in err


def test_unknown_model_is_refused_before_any_work(tmp_path, capsys):
    err = _error_of(
        ["train", "--set", "model.name=not a model", "--set", f"run.output_dir={tmp_path / 'run'}"],
        capsys,
    )
    assert "unknown model" in err
    assert not (tmp_path / "run").exists()


def test_resume_of_a_folder_without_checkpoints_is_refused(tmp_path, capsys):
    err = _error_of(["train", "--resume", str(tmp_path)], capsys)
    assert "config.yaml" in err or "no checkpoint" in err


def test_config_prints_resolved_yaml(capsys):
    assert main(["config", "--set", "algo.beta=0.04"]) == 0
    assert "beta: 0.04" in capsys.readouterr().out


def test_unknown_reward_and_impossible_task_knobs_are_config_errors(tmp_path, capsys):
    err = _error_of(
        ["train", "--set", "rewards=[math_acuracy]", "--set", f"run.output_dir={tmp_path / 'a'}"],
        capsys,
    )
    assert "math_accuracy" in err
    err = _error_of(
        ["train", "--set", "task.max_value=2", "--set", f"run.output_dir={tmp_path / 'b'}"], capsys
    )
    assert "task:" in err and "max_value" in err


def _one_line_error(args, capsys) -> str:
    err = _error_of(args, capsys)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "override, names",
    [
        ("train.adam_beta1=1.5", "'train.adam_beta1' is 1.5"),
        ("train.learning_rate=10", "'train.learning_rate' is 10.0"),
        ("task.num_operands=0", "'task.num_operands' is 0"),
    ],
)
def test_out_of_range_values_stop_train_with_one_line(override, names, tmp_path, capsys):
    run_dir = tmp_path / "run"
    err = _one_line_error(
        ["train", "--set", override, "--set", f"run.output_dir={run_dir}"], capsys
    )
    assert names in err and "the default is" in err
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--top-p", "5", "--top-p is 5.0; it must be in (0, 1]"),
        ("--temperature", "-1", "--temperature is -1.0; it must be in [0, 10]"),
        ("--top-k", "-3", "--top-k is -3; it must be >= 0"),
        ("--num", "-1", "--num is -1; it must be >= 0"),
        ("--max-new-tokens", "0", "--max-new-tokens is 0; it must be >= 1"),
    ],
)
def test_eval_flags_outside_their_range_are_one_line_errors(flag, value, message, capsys):
    err = _one_line_error(["eval", "--model", "nowhere", flag, value], capsys)
    assert message in err


def test_a_reader_that_stops_early_gets_no_traceback():
    """`fastgrpo config --keys | head -2`: the pipe closes under the writer."""
    import subprocess
    import sys

    done = subprocess.run(
        f"{sys.executable} -m fastgrpo config --keys | head -2",
        shell=True,
        capture_output=True,
        text=True,
    )
    assert len(done.stdout.splitlines()) == 2
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
