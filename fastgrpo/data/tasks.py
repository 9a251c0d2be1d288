"""Build any task by name from flat options, as a config file or CLI would give them.

Why: configs say `task: gsm8k` plus a bag of options; this module is the single place that
maps such a name to the right loader, so a typo gets a "did you mean" instead of a crash
deep inside training.
"""

from __future__ import annotations

import difflib
from typing import Any

from fastgrpo.data.arithmetic import arithmetic_task
from fastgrpo.data.example import TaskData
from fastgrpo.data.files import file_task
from fastgrpo.data.gsm8k import gsm8k_task

TASKS = ("arithmetic", "gsm8k", "jsonl", "parquet", "hf")

ARITHMETIC_OPTIONS = (
    "seed",
    "num_train",
    "num_eval",
    "min_value",
    "max_value",
    "num_operands",
    "operations",
    "allow_negative",
    "prompt_template",
)
GSM8K_OPTIONS = ("path", "num_train", "num_eval", "seed", "prompt_template")
FILE_OPTIONS = (
    "path",
    "prompt_field",
    "answer_field",
    "train_split",
    "eval_split",
    "num_train",
    "num_eval",
    "seed",
    "prompt_template",
)
KNOWN_OPTIONS = tuple(dict.fromkeys(ARITHMETIC_OPTIONS + GSM8K_OPTIONS + FILE_OPTIONS))


def build_task(name: str, **options: Any) -> TaskData:
    """Build task `name` (one of TASKS) from options.

    Options set to None mean "use the task's default". Options that the chosen task does
    not use are ignored; option names that no task knows raise ValueError.
    """
    _check_task_name(name)
    _check_option_names(options)
    given = {key: value for key, value in options.items() if value is not None}
    if name == "arithmetic":
        return arithmetic_task(**_pick(given, ARITHMETIC_OPTIONS))
    if name == "gsm8k":
        return gsm8k_task(**_pick(given, GSM8K_OPTIONS))
    if "path" not in given:
        raise ValueError(
            f"task {name!r} needs path=...: a data file, a folder holding train/test files, "
            "or a Hugging Face hub id such as 'org/name' or 'org/name:config'"
        )
    return file_task(name=name, **_pick(given, FILE_OPTIONS))


def _check_task_name(name: str) -> None:
    if name in TASKS:
        return
    close = difflib.get_close_matches(str(name), TASKS, n=1, cutoff=0.4)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown task {name!r}{hint} (valid tasks: {', '.join(TASKS)})")


def _check_option_names(options: dict[str, Any]) -> None:
    for key in options:
        if key in KNOWN_OPTIONS:
            continue
        close = difflib.get_close_matches(key, KNOWN_OPTIONS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown task option {key!r}{hint} (known: {', '.join(KNOWN_OPTIONS)})")


def _pick(options: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {key: value for key, value in options.items() if key in names}
