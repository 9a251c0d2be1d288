"""Plain data records shared by every task: one prompt/answer pair and a train/eval bundle.

Why: the trainer, the evaluator and the reward functions all speak in `Example` objects,
so every data source (built-in arithmetic, local files, the Hugging Face hub) converts
into this one shape and nothing downstream needs to know where the data came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    """One RL prompt with its reference answer.

    `prompt` is the user message before chat templating; `answer` is the reference
    answer exactly as the source gives it; `columns` holds the record's extra columns,
    which reward functions receive as keyword arguments. `columns` always contains
    "answer" (added automatically when the caller leaves it out).
    """

    prompt: str
    answer: str
    columns: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "answer" not in self.columns:
            # Copy rather than mutate the caller's dict; frozen needs object.__setattr__.
            object.__setattr__(self, "columns", {**self.columns, "answer": self.answer})


@dataclass
class TaskData:
    """The train and eval examples of one task, plus the task's name for logs."""

    train: list[Example]
    eval: list[Example]
    name: str
