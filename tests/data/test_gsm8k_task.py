"""Tests for the GSM8K task on the real local copy and on a tiny stand-in folder."""

import json
import re
import sys
from pathlib import Path

import pytest

from fastgrpo.data.files import DatasetError
from fastgrpo.data.gsm8k import DEFAULT_PROMPT_TEMPLATE, gsm8k_task

GSM8K_DIR = Path("/work/shared/data/gsm8k")
needs_gsm8k = pytest.mark.skipif(
    not (GSM8K_DIR / "train.jsonl").is_file(), reason="local GSM8K copy not present"
)


@needs_gsm8k
def test_real_gsm8k_has_7473_train_and_1319_test_problems():
    task = gsm8k_task(GSM8K_DIR)
    assert (len(task.train), len(task.eval), task.name) == (7473, 1319, "gsm8k")


@needs_gsm8k
def test_real_gsm8k_answers_end_with_hashes_and_a_number():
    task = gsm8k_task(GSM8K_DIR, num_train=50, num_eval=20, seed=7)
    for example in task.train + task.eval:
        assert re.search(r"#### -?[\d,]+(\.\d+)?$", example.answer), example.answer
        assert example.columns == {"answer": example.answer}
    first = task.train[0]
    assert first.prompt.endswith('give the final answer on the last line as "#### <number>".')


@needs_gsm8k
def test_real_gsm8k_first_train_question_is_rendered_with_the_template():
    task = gsm8k_task(GSM8K_DIR, prompt_template="Q: {question}")
    assert task.train[0].prompt.startswith("Q: Natalia sold clips to 48 of her friends")
    assert task.train[0].answer.endswith("#### 72")


def test_gsm8k_reads_question_and_answer_fields_from_a_folder(tmp_path):
    record = {"question": "What is 1+1?", "answer": "1+1=2\n#### 2"}
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps(record) + "\n")
    task = gsm8k_task(tmp_path)
    assert task.train[0].prompt == DEFAULT_PROMPT_TEMPLATE.format(prompt="What is 1+1?")
    assert task.eval[0].answer == "1+1=2\n#### 2"


def test_gsm8k_without_a_path_uses_the_hub_dataset(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DatasetError, match=r"hub dataset 'openai/gsm8k' \(config 'main'\)"):
        gsm8k_task()
