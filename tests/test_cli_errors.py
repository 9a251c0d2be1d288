"""Bad input stops `fastgrpo train` before any work, with exit code 2 and one line that names the
key, file or record and the fix (issue 28, item 7); nothing is written to the run folder."""

from __future__ import annotations

import math
import shutil

import pytest
from safetensors.torch import load_file, save_file

from fastgrpo.cli import main

RECORDS = "".join(f'{{"prompt": "{i}+1", "answer": "{i + 1}"}}\n' for i in range(3))


def train_error(args: list[str], run_dir, capsys) -> str:
    """Runs `fastgrpo train` with `args`; the one error line it printed."""
    argv = ["train", "--set", f"run.output_dir={run_dir}", "--set", "run.progress=false"]
    for item in args:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not run_dir.exists()
    return err


def jsonl_task(path, model_dir) -> list[str]:
    return [
        "task.name=jsonl",
        f"task.path={path}",
        f"model.name={model_dir}",
        "model.device=cpu",
        "task.num_eval=1",
    ]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_device_on_a_machine_without_a_gpu(tiny_model_dir, tmp_path, capsys):
    err = train_error([f"model.name={tiny_model_dir}", "model.device=cuda"], tmp_path / "r", capsys)
    assert "model.device=cuda" in err and "model.device=cpu or auto" in err


@pytest.mark.parametrize("text", ["", "\n  \n\n"], ids=["empty", "blank"])
def test_empty_or_blank_jsonl_names_the_file(text, tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(text)
    err = train_error(jsonl_task(data, tiny_model_dir), tmp_path / "r", capsys)
    assert f"{data} holds no records" in err


def test_fewer_records_than_prompts_per_step_names_the_config_key(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(RECORDS)  # 3 records: 2 to train, 1 to eval
    args = jsonl_task(data, tiny_model_dir) + ["rollout.prompts_per_step=4"]
    err = train_error(args, tmp_path / "r", capsys)
    assert "gives 2 training record(s)" in err and "rollout.prompts_per_step=2" in err
    assert "batch_size" not in err


def test_non_utf8_data_file_names_the_file_line_and_byte(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_bytes(RECORDS.encode() + '{"prompt": "café", "answer": "1"}\n'.encode("latin-1"))
    err = train_error(jsonl_task(data, tiny_model_dir), tmp_path / "r", capsys)
    assert f"{data}:4: not UTF-8" in err and "0xe9" in err


def damage(model_dir, tmp_path, how: str):
    """A copy of the tiny model whose model.safetensors is truncated, garbled, holds a NaN or
    misses a tensor."""
    copy = tmp_path / f"model-{how}"
    shutil.copytree(model_dir, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if how == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif how == "garbled":
        data[8:40] = b"x" * 32  # the JSON header
        weights.write_bytes(data)
    else:
        state = load_file(str(weights))
        if how == "nan":
            state["model.layers.1.self_attn.o_proj.weight"][3, 5] = math.nan
        else:  # a tensor missing
            del state["model.layers.1.mlp.up_proj.weight"]
        save_file(state, str(weights), metadata={"format": "pt"})
    return copy


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("how", ["truncated", "garbled"])
def test_damaged_safetensors_file_is_named(how, backend, tiny_model_dir, tmp_path, capsys):
    model = damage(tiny_model_dir, tmp_path, how)
    args = [f"model.name={model}", "model.device=cpu", f"model.backend={backend}"]
    err = train_error(args, tmp_path / "r", capsys)
    assert str(model) in err and "cannot read the safetensors weights" in err


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_nan_weights_are_refused_naming_the_tensor(backend, tiny_model_dir, tmp_path, capsys):
    model = damage(tiny_model_dir, tmp_path, "nan")
    args = [f"model.name={model}", "model.device=cpu", f"model.backend={backend}"]
    err = train_error(args, tmp_path / "r", capsys)
    assert "tensor 'model.layers.1.self_attn.o_proj.weight' holds 1 NaN/inf value(s)" in err


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_weights_that_do_not_match_the_config_are_named(backend, tiny_model_dir, tmp_path, capsys):
    model = damage(tiny_model_dir, tmp_path, "missing")
    args = [f"model.name={model}", "model.device=cpu", f"model.backend={backend}"]
    err = train_error(args, tmp_path / "r", capsys)
    assert f"{model}: the weights do not match its config.json" in err
    assert "model.layers.1.mlp.up_proj.weight" in err


def test_a_rank_of_a_torchrun_job_tags_its_error_line_with_its_rank(tmp_path, capsys, monkeypatch):
    """The ranks of `fastgrpo train --nproc N` write to one stderr: each line says whose it is."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    run_dir = tmp_path / "r"
    argv = ["train", "--set", f"run.output_dir={run_dir}", "--set", "rollout.prompts_per_step=3"]
    assert main(argv) == 2  # refused before joining the job: 3 prompts do not split over 2 ranks
    err = capsys.readouterr().err
    assert err.startswith("[rank1]: error: ") and err.count("\n") == 1, err
    assert "must be a multiple of the 2 processes" in err
    assert not run_dir.exists()
