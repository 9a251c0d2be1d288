"""LoRA runs end to end on a tiny model: only the adapters train, the reference is the base with
the adapters off (no second model), checkpoints are peft adapters, resume is exact, a peft
adapter continues, and `fastgrpo eval` reads a LoRA run."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from fastgrpo.cli import main
from fastgrpo.config import ConfigError
from fastgrpo.train import load_resume_config, run_training
from fastgrpo.train import loop as loop_module
from fastgrpo.train.checkpoint import latest_checkpoint
from tests.train.test_training_run import tiny_overrides, write_test_rewards

LORA = {"lora.rank": 4, "lora.alpha": 8, "train.learning_rate": 1e-2, "algo.beta": 0.04}


def lora_overrides(model_dir, run_dir, tmp_path, steps=2, **extra):
    rewards = f"['{write_test_rewards(tmp_path)}:digit_share']"
    return tiny_overrides(model_dir, run_dir, steps=steps, rewards=rewards, **{**LORA, **extra})


def adapters(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(run_dir) / "model" / "adapter_model.safetensors"))


@pytest.mark.parametrize("backend", ["native", "native, adapters in the engine", "hf"])
def test_a_lora_run_trains_only_the_adapters_and_loads_no_reference_model(
    tiny_model_dir, tmp_path, monkeypatch, backend
):
    """On the native model (the engine samples merged weights, or the adapted model itself with
    lora.merge_for_rollout false) and through transformers (HF generate runs the adapted model)."""
    extra = {"model.backend": backend.split(",")[0]}
    if backend.endswith("engine"):
        extra["lora.merge_for_rollout"] = False
    loads = []
    real = loop_module.load_configured_model
    monkeypatch.setattr(
        loop_module, "load_configured_model", lambda *a, **k: loads.append(a) or real(*a, **k)
    )
    run = tmp_path / "run"
    over = lora_overrides(tiny_model_dir, run, tmp_path, **extra)
    result = run_training(None, overrides=over)
    assert len(loads) == 1  # beta 0.04: the reference is the base with the adapters off
    folder = latest_checkpoint(run) / "model"
    assert sorted(p.name for p in folder.glob("adapter_*")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert not list(folder.glob("model*.safetensors"))  # no copy of the frozen base
    umask = os.umask(0)
    os.umask(umask)
    assert (folder / "adapter_model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == tiny_model_dir
    saved = adapters(run)
    assert len(saved) == 2 * 7 * 2  # A and B of 7 linears in each of 2 layers
    moved = [k for k, v in saved.items() if ".lora_B." in k and v.abs().max() > 0]
    assert moved  # B starts at zero: the adapters learned something
    first, second = result.history
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # adapted == base before any step
    assert second["kl"] > 0  # the reference stayed the base while the adapters moved


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapters in the engine"])
def test_a_lora_run_resumed_takes_the_step_an_uninterrupted_one_takes(
    tiny_model_dir, tmp_path, merge
):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    extra = {"lora.merge_for_rollout": merge}
    run_training(None, overrides=lora_overrides(tiny_model_dir, straight, tmp_path, 2, **extra))
    run_training(None, overrides=lora_overrides(tiny_model_dir, halves, tmp_path, 1, **extra))
    config = load_resume_config(str(halves), ["train.steps=2"], trust_run_code=True)
    run_training(config, resume=True, trust_run_code=True)
    a, b = adapters(straight), adapters(halves)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def test_a_run_continues_a_peft_adapter_and_eval_reads_a_lora_run(tiny_model_dir, tmp_path, capsys):
    first = tmp_path / "first"
    run_training(None, overrides=lora_overrides(tiny_model_dir, first, tmp_path, steps=1))
    start = adapters(first)
    adapter = str(latest_checkpoint(first) / "model")
    second = tmp_path / "second"
    over = lora_overrides(tiny_model_dir, second, tmp_path, steps=1, **{"lora.adapter": adapter})
    over = [o for o in over if not o.startswith(("lora.rank", "lora.alpha"))]
    result = run_training(None, overrides=over)
    assert result.history[0]["kl"] > 0  # the adapter was read: the model is off its base at once
    moved = max(float((adapters(second)[k] - start[k]).abs().max()) for k in start)
    assert moved > 0  # it went on from the adapter's values
    code = main(["eval", "--model", str(second), "--num", "2", "--trust-run-code"])
    assert code == 0
    assert "accuracy" in capsys.readouterr().out


def test_lora_settings_a_run_cannot_use_are_one_line(tiny_model_dir, tmp_path):
    over = lora_overrides(
        tiny_model_dir, tmp_path / "a", tmp_path, **{"lora.target_modules": "[wq]"}
    )
    with pytest.raises(ConfigError, match="matches no linear layer"):
        run_training(None, overrides=over)
    first = tmp_path / "first"
    run_training(None, overrides=lora_overrides(tiny_model_dir, first, tmp_path, steps=1))
    adapter = str(latest_checkpoint(first) / "model")
    over = lora_overrides(
        tiny_model_dir, tmp_path / "b", tmp_path, **{"lora.adapter": adapter, "lora.rank": 8}
    )
    with pytest.raises(ConfigError, match="lora.rank=8 but the adapter .* has rank 4"):
        run_training(None, overrides=over)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_export_writes_a_lora_run_as_one_merged_model_transformers_loads(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    run_training(None, overrides=lora_overrides(tiny_model_dir, run, tmp_path, steps=1))
    out = tmp_path / "merged"
    assert main(["export", str(run), str(out), "--dtype", "float32"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, latest_checkpoint(run) / "model")
    ids = torch.arange(5, 25)[None]
    with torch.no_grad():
        want, got = adapted(ids).logits, merged(ids).logits
        with adapted.disable_adapter():
            plain = adapted(ids).logits
    assert (want - plain).abs().max() > 1e-4  # the adapters moved: merging them changes things
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert main(["export", str(run), str(out)]) == 2  # never over a folder with files


def test_a_run_with_the_embeddings_trained_whole_saves_them_and_resumes_exactly(
    tiny_model_dir, tmp_path
):
    """lora.modules_to_save=[embed_tokens] on a model whose head is tied to it: both train, the
    adapter file holds the embedding, the reference (adapters off) is the base, resume is exact."""
    extra = {"lora.modules_to_save": "[embed_tokens]"}
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    result = run_training(
        None, overrides=lora_overrides(tiny_model_dir, straight, tmp_path, steps=2, **extra)
    )
    assert result.history[0]["kl"] == pytest.approx(0.0, abs=1e-9)
    run_training(None, overrides=lora_overrides(tiny_model_dir, halves, tmp_path, steps=1, **extra))
    config = load_resume_config(str(halves), ["train.steps=2"], trust_run_code=True)
    run_training(config, resume=True, trust_run_code=True)
    a, b = adapters(straight), adapters(halves)
    key = "base_model.model.model.embed_tokens.weight"
    base = load_file(f"{tiny_model_dir}/model.safetensors")["model.embed_tokens.weight"]
    assert key in a and float((a[key] - base).abs().max()) > 1e-4  # it trained
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
