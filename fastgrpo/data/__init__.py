"""Tasks for GRPO training: prompts with reference answers, and the order they are visited.

Why: one import point for the trainer and CLI. `build_task(name, **options)` returns a
`TaskData` (train/eval lists of `Example`), `render_prompt` applies the chat template, and
`PromptSampler` gives a seeded, resumable batch order.
"""

from fastgrpo.data.arithmetic import arithmetic_task
from fastgrpo.data.chat import render_prompt
from fastgrpo.data.example import Example, TaskData
from fastgrpo.data.files import DatasetError, file_task, read_records, records_to_examples
from fastgrpo.data.gsm8k import gsm8k_task
from fastgrpo.data.sampler import PromptSampler
from fastgrpo.data.tasks import TASKS, build_task

__all__ = [
    "TASKS",
    "DatasetError",
    "Example",
    "PromptSampler",
    "TaskData",
    "arithmetic_task",
    "build_task",
    "file_task",
    "gsm8k_task",
    "read_records",
    "records_to_examples",
    "render_prompt",
]
