"""Upload a run's final model to the Hugging Face Hub (`fastgrpo push`, `run.push_to_hub`).

What goes up is the newest checkpoint's `model/` folder (the whole model, or a LoRA run's peft
adapter), the run's `metrics.jsonl`, and a model card (`README.md`) written from the run: the
base model, the task, the algorithm settings, the held-out accuracy before and after. The files
are gathered first in `RUN_DIR/hub_upload/` (the checkpoint's large files linked, not copied),
then sent with `huggingface_hub`; when that fails (no network, no token, no access) the error is
one line, the run folder is as it was, and the gathered folder stays ready for the next try.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import yaml

from fastgrpo.errors import RunStopped, UserError
from fastgrpo.train.checkpoint import checkpoint_step, latest_checkpoint

STAGING = "hub_upload"


class HubError(RunStopped):
    """The upload failed (the network or the Hub, not the user's input: the CLI exits 1); the
    message says why and how to retry."""


def prepare_upload(run_dir) -> Path:
    """Gather what `push` sends into RUN_DIR/hub_upload/ (made afresh); that folder."""
    run_dir = Path(run_dir)
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise UserError(f"{run_dir} holds no checkpoint to upload; train first (or check the path)")
    staging = run_dir / STAGING
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    for file in sorted((checkpoint / "model").iterdir()):
        target = staging / file.name
        try:
            os.link(file, target)  # no copy of a 1.6 GB model
        except OSError:
            shutil.copy2(file, target)
    if (run_dir / "metrics.jsonl").is_file():
        shutil.copy2(run_dir / "metrics.jsonl", staging / "metrics.jsonl")
    config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    (staging / "README.md").write_text(model_card(config, run_dir, checkpoint))
    return staging


def model_card(config: dict, run_dir: Path, checkpoint: Path) -> str:
    """The model card of a run: front matter the Hub reads, then what was trained and how."""
    lora = config.get("lora") or {}
    adapter = (checkpoint / "model" / "adapter_config.json").is_file()
    base = config["model"]["name"]
    algo, train, rollout, task = config["algo"], config["train"], config["rollout"], config["task"]
    evals = _evaluations(run_dir)
    front = {
        "base_model": base,
        "library_name": "peft" if adapter else "transformers",
        "tags": ["fastgrpo", "grpo", "reinforcement-learning", algo["loss_type"]],
    }
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {run_dir.name}",
        "",
        f"{'A LoRA adapter for' if adapter else 'A fine-tune of'} `{base}`, trained with "
        f"fastgrpo by {algo['loss_type'].upper()} reinforcement learning for "
        f"{checkpoint_step(checkpoint)} steps.",
        "",
        "| setting | value |",
        "|---|---|",
        f"| task | {task['name']}{' (' + str(task['path']) + ')' if task.get('path') else ''} |",
        f"| rewards | {', '.join(_reward_name(r) for r in config.get('rewards', []))} |",
        f"| loss | {algo['loss_type']}, beta {algo['beta']} |",
        f"| batch | {rollout['prompts_per_step']} prompts x {rollout['num_generations']} samples, "
        f"up to {rollout['max_new_tokens']} new tokens |",
        f"| optimizer | AdamW, lr {train['learning_rate']}, {train['lr_scheduler']} schedule |",
    ]
    if adapter:
        lines.append(
            f"| LoRA | rank {lora.get('rank')}, alpha {lora.get('alpha')}, "
            f"targets {', '.join(lora.get('target_modules') or [])} |"
        )
    if evals:
        lines += ["", "Held-out accuracy (fastgrpo's evaluator):", ""]
        lines += [
            f"- {e['when']} (step {e['step']}): {e['accuracy']:.3f} on {e['num_problems']} problems"
            for e in evals
        ]
    lines += ["", "Every training step's metrics: [`metrics.jsonl`](metrics.jsonl).", ""]
    if adapter:
        lines += [
            "Load it with peft:",
            "",
            "```python",
            "from peft import AutoPeftModelForCausalLM",
            'model = AutoPeftModelForCausalLM.from_pretrained("REPO_ID")',
            "```",
            "",
        ]
    return "\n".join(lines)


def _reward_name(reward) -> str:
    if isinstance(reward, dict):
        return str(reward.get("name") or reward.get("function"))
    return str(reward).split("/")[-1]


def _evaluations(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("kind") == "eval" and "accuracy" in r]


def push(run_dir, repo_id: str, *, private: bool = False, token: str | None = None) -> str:
    """Gather the upload and send it to `repo_id` (made if missing); its URL."""
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise UserError(f"hub repository {repo_id!r}: give it as ORG/NAME (or USER/NAME)")
    staging = prepare_upload(run_dir)
    card = staging / "README.md"
    card.write_text(card.read_text().replace("REPO_ID", repo_id))
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(staging))
    except Exception as error:  # network, token, permissions: all end the same way
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise HubError(
            f"could not upload to the Hub ({reason}); {run_dir} is unchanged and {staging} is "
            f"ready: retry with `fastgrpo push {run_dir} {repo_id}` once online and logged in "
            "(`huggingface-cli login` or HF_TOKEN)"
        ) from None
    return f"https://huggingface.co/{repo_id}"
