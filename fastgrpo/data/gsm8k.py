"""GSM8K grade-school math word problems, from a local copy or the Hugging Face hub.

Why: GSM8K is the standard first benchmark for reasoning RL. Each answer holds worked
reasoning followed by "#### <number>", so the default prompt asks the model to end its
reply the same way, which lets a reward function compare the final numbers.
"""

from __future__ import annotations

from pathlib import Path

from fastgrpo.data.example import TaskData
from fastgrpo.data.files import file_task

HUB_ID = "openai/gsm8k:main"
DEFAULT_PROMPT_TEMPLATE = (
    '{prompt}\nReason briefly, then give the final answer on the last line as "#### <number>".'
)


def gsm8k_task(
    path: str | Path | None = None,
    *,
    num_train: int | None = None,
    num_eval: int | None = None,
    seed: int = 0,
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
) -> TaskData:
    """Load GSM8K: `path` is a folder with train.jsonl/test.jsonl (fields question, answer),
    a single such file, or a hub id; None means the hub dataset "openai/gsm8k" (config "main").
    """
    return file_task(
        HUB_ID if path is None else path,
        name="gsm8k",
        prompt_field="question",
        answer_field="answer",
        train_split="train",
        eval_split="test",
        num_train=num_train,
        num_eval=num_eval,
        seed=seed,
        prompt_template=prompt_template,
    )
