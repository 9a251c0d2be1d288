"""Tests for building tasks by name, the package exports and the Example record."""

import json
import sys

import pytest

import fastgrpo.data as data
from fastgrpo.data import TASKS, DatasetError, Example, build_task


def test_package_exports_the_public_api():
    for name in (
        "Example",
        "TaskData",
        "DatasetError",
        "build_task",
        "TASKS",
        "arithmetic_task",
        "gsm8k_task",
        "file_task",
        "read_records",
        "render_prompt",
    ):
        assert hasattr(data, name), name
    assert TASKS == ("arithmetic", "gsm8k", "jsonl", "parquet", "hf")


def test_example_always_carries_the_answer_column():
    columns = {"level": 2}
    example = Example(prompt="p", answer="7", columns=columns)
    assert example.columns == {"level": 2, "answer": "7"}
    assert columns == {"level": 2}
    assert Example(prompt="p", answer="7").columns == {"answer": "7"}


def test_arithmetic_task_is_built_with_its_knobs_and_none_means_default():
    task = build_task(
        "arithmetic", seed=2, num_train=30, num_eval=None, operations="*", path="ignored"
    )
    assert (task.name, len(task.train), len(task.eval)) == ("arithmetic", 30, 200)
    assert all(" * " in example.prompt for example in task.train)
    assert task.train == data.arithmetic_task(seed=2, num_train=30, operations="*").train


def test_jsonl_task_is_built_from_a_path_with_field_names(tmp_path):
    record = {"q": "Name a colour", "a": "red"}
    for split in ("train", "dev"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps(record) + "\n")
    task = build_task(
        "jsonl",
        path=str(tmp_path),
        prompt_field="q",
        answer_field="a",
        eval_split="dev",
        prompt_template="{prompt}?",
        min_value=5,
    )
    assert task.name == "jsonl"
    assert (task.train[0].prompt, task.eval[0].answer) == ("Name a colour?", "red")


@pytest.mark.parametrize("name", ["jsonl", "parquet", "hf"])
def test_file_tasks_without_path_are_rejected(name):
    with pytest.raises(ValueError, match=f"task '{name}' needs path="):
        build_task(name)


def test_unknown_task_name_suggests_the_nearest():
    with pytest.raises(ValueError, match=r"unknown task 'gsm8'; did you mean 'gsm8k'\?"):
        build_task("gsm8")
    with pytest.raises(ValueError, match=r"did you mean 'arithmetic'\?"):
        build_task("arithmatic")


def test_unknown_option_name_suggests_the_nearest():
    with pytest.raises(ValueError, match=r"unknown task option 'num_trian'; did you mean"):
        build_task("arithmetic", num_trian=5)


def test_missing_hub_dataset_is_a_dataset_error(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DatasetError, match="pip install datasets"):
        build_task("hf", path="org/name")
