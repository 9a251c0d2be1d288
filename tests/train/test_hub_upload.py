"""`fastgrpo push` and `run.push_to_hub`, offline: the folder that would go up, its model card,
and a failed upload that changes nothing and says how to retry."""

from __future__ import annotations

import json

import pytest
import yaml

from fastgrpo.cli import main
from fastgrpo.train import run_training
from fastgrpo.train.hub import model_card, prepare_upload
from tests.train.test_training_run import tiny_overrides


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("hub") / "run"
    extra = {"eval.before": True, "eval.after": True, "eval.num_problems": 3}
    run_training(None, overrides=tiny_overrides(tiny_model_dir, run, steps=2, **extra))
    return run


def test_the_upload_folder_holds_the_model_the_metrics_and_a_card(finished_run, tiny_model_dir):
    staging = prepare_upload(finished_run)
    names = {p.name for p in staging.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "metrics.jsonl",
        "README.md",
    } <= names
    model = finished_run / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    assert (staging / "model.safetensors").read_bytes() == model.read_bytes()
    card = (staging / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == tiny_model_dir and front["library_name"] == "transformers"
    assert "grpo" in front["tags"]
    assert "for 2 steps" in card and "| batch | 2 prompts x 4 samples" in card
    evals = [json.loads(x) for x in (finished_run / "metrics.jsonl").read_text().splitlines()]
    after = [e for e in evals if e.get("kind") == "eval" and e["when"] == "after"][0]
    assert f"after (step 2): {after['accuracy']:.3f} on 3 problems" in card
    assert "[`metrics.jsonl`](metrics.jsonl)" in card


def test_a_lora_card_says_adapter_and_how_to_load_it(tmp_path):
    config = {"model": {"name": "base/m"}, "algo": {"loss_type": "dapo", "beta": 0.0},
              "train": {"learning_rate": 1e-4, "lr_scheduler": "constant"},
              "rollout": {"prompts_per_step": 8, "num_generations": 8, "max_new_tokens": 256},
              "task": {"name": "gsm8k", "path": "data/gsm8k"}, "rewards": ["math_accuracy"],
              "lora": {"rank": 16, "alpha": 32, "target_modules": ["all-linear"]}}  # fmt: skip
    checkpoint = tmp_path / "checkpoints" / "step_000030"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "adapter_config.json").write_text("{}")
    card = model_card(config, tmp_path, checkpoint)
    assert "library_name: peft" in card and "A LoRA adapter for `base/m`" in card
    assert "| LoRA | rank 16, alpha 32, targets all-linear |" in card
    assert "AutoPeftModelForCausalLM" in card and "for 30 steps" in card


def test_an_upload_without_network_is_one_line_and_loses_nothing(finished_run, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = sorted(str(p) for p in finished_run.rglob("*") if "hub_upload" not in str(p))
    assert main(["push", str(finished_run), "someone/tiny-grpo"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not upload to the Hub" in err[0]
    assert f"retry with `fastgrpo push {finished_run} someone/tiny-grpo`" in err[0]
    after = sorted(str(p) for p in finished_run.rglob("*") if "hub_upload" not in str(p))
    assert after == before and (finished_run / "hub_upload" / "README.md").is_file()
    assert main(["push", str(finished_run), "no-slash"]) == 2
    assert "give it as ORG/NAME" in capsys.readouterr().err


def test_push_to_hub_at_the_end_of_a_run_offline_reports_and_keeps_the_run(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    over = tiny_overrides(tiny_model_dir, tmp_path / "run", steps=1, **{"run.push_to_hub": "a/b"})
    result = run_training(None, overrides=over)
    assert result.steps == 1
    assert "hub: could not upload to the Hub" in capsys.readouterr().out
