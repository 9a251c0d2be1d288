"""Tests for reading dataset files and turning their records into train/eval examples."""

import json
import sys
import types

import pytest

from fastgrpo.data.example import Example
from fastgrpo.data.files import DatasetError, file_task, read_records, records_to_examples


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def numbered_records(count, prefix="q"):
    return [{"prompt": f"{prefix}{i}", "answer": str(i), "level": i % 3} for i in range(count)]


def test_jsonl_records_are_read_in_order_and_blank_lines_skipped(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n  \n{"prompt": "b", "answer": 2}\n')
    assert read_records(path) == [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": 2}]


def test_malformed_jsonl_line_error_names_file_and_line(tmp_path):
    path = tmp_path / "file.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n')
    with pytest.raises(DatasetError, match="invalid JSON") as caught:
        read_records(path)
    assert "file.jsonl:3" in str(caught.value)


def test_jsonl_line_that_is_not_an_object_is_rejected(tmp_path):
    path = tmp_path / "file.jsonl"
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(DatasetError, match=r"file\.jsonl:2: expected a JSON object.*list"):
        read_records(path)


def test_json_file_holding_a_list_of_objects_is_read(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"prompt": "a", "answer": "1"}]))
    assert read_records(path) == [{"prompt": "a", "answer": "1"}]


def test_json_file_that_is_not_a_list_is_rejected(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"prompt": "a"}))
    with pytest.raises(DatasetError, match="expected a JSON list of objects, got dict"):
        read_records(path)


def test_missing_file_error_lists_data_files_nearby(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", numbered_records(2))
    with pytest.raises(DatasetError) as caught:
        read_records(tmp_path / "trian.jsonl")
    message = str(caught.value)
    assert "trian.jsonl does not exist" in message
    assert "train.jsonl" in message and "did you mean 'train.jsonl'" in message


def test_missing_file_in_missing_directory_says_so(tmp_path):
    with pytest.raises(DatasetError, match="does not exist either"):
        read_records(tmp_path / "nowhere" / "train.jsonl")


def test_unsupported_suffix_is_rejected(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        read_records(path)


def test_parquet_without_a_reader_says_to_install_pyarrow(tmp_path, monkeypatch):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(DatasetError, match="pip install pyarrow"):
        read_records(path)


def test_records_become_examples_with_extra_columns():
    records = [{"prompt": "2+2?", "answer": 4, "level": "easy"}]
    examples = records_to_examples(
        records, prompt_field="prompt", answer_field="answer", source="mem"
    )
    assert examples == [
        Example(prompt="2+2?", answer="4", columns={"level": "easy", "answer": "4"})
    ]


def test_missing_field_error_names_field_source_record_and_present_fields():
    records = [{"question": "a", "answer": "1"}, {"questio": "b", "answer": "2"}]
    with pytest.raises(DatasetError) as caught:
        records_to_examples(
            records, prompt_field="question", answer_field="answer", source="train.jsonl"
        )
    message = str(caught.value)
    assert "train.jsonl, record 2: missing field 'question'" in message
    assert "fields present: questio, answer" in message
    assert "did you mean 'questio'?" in message


def test_prompt_template_can_use_prompt_and_any_record_field():
    records = [{"question": "How many?", "answer": "3", "unit": "apples"}]
    examples = records_to_examples(
        records,
        prompt_field="question",
        answer_field="answer",
        source="mem",
        prompt_template="{question} ({unit})\nThink step by step, then give the answer after ####.",
    )
    assert examples[0].prompt == (
        "How many? (apples)\nThink step by step, then give the answer after ####."
    )
    assert examples[0].columns == {"unit": "apples", "answer": "3"}
    again = records_to_examples(
        records,
        prompt_field="question",
        answer_field="answer",
        source="mem",
        prompt_template="Q: {prompt}",
    )
    assert again[0].prompt == "Q: How many?"


def test_prompt_template_with_unknown_field_is_rejected():
    records = [{"prompt": "a", "answer": "1"}]
    with pytest.raises(DatasetError, match=r"uses \{topic\}.*fields present: prompt, answer"):
        records_to_examples(
            records,
            prompt_field="prompt",
            answer_field="answer",
            source="mem",
            prompt_template="{topic}: {prompt}",
        )


def test_directory_with_train_and_test_files_gives_both_splits(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", numbered_records(6, "t"))
    (tmp_path / "test.json").write_text(json.dumps(numbered_records(3, "e")))
    task = file_task(tmp_path, name="mine")
    assert task.name == "mine"
    assert [example.prompt for example in task.train] == [f"t{i}" for i in range(6)]
    assert [example.prompt for example in task.eval] == ["e0", "e1", "e2"]
    assert task.train[4].columns == {"level": 1, "answer": "4"}


def test_directory_subsets_are_seeded_shuffles(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", numbered_records(50, "t"))
    write_jsonl(tmp_path / "test.jsonl", numbered_records(20, "e"))
    first = file_task(tmp_path, num_train=10, num_eval=5, seed=1)
    again = file_task(tmp_path, num_train=10, num_eval=5, seed=1)
    other = file_task(tmp_path, num_train=10, num_eval=5, seed=2)
    assert (len(first.train), len(first.eval)) == (10, 5)
    assert first.train == again.train and first.eval == again.eval
    assert first.train != other.train
    assert [e.prompt for e in first.train] != [f"t{i}" for i in range(10)]


def test_directory_missing_a_split_lists_what_is_there(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", numbered_records(3))
    write_jsonl(tmp_path / "validation.jsonl", numbered_records(3))
    with pytest.raises(DatasetError, match=r"no 'test' split.*validation\.jsonl.*eval_split"):
        file_task(tmp_path)
    task = file_task(tmp_path, eval_split="validation")
    assert len(task.eval) == 3


def test_requesting_more_records_than_exist_is_rejected(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", numbered_records(3))
    write_jsonl(tmp_path / "test.jsonl", numbered_records(3))
    with pytest.raises(DatasetError, match="num_train=4 but .*train.jsonl has only 3 records"):
        file_task(tmp_path, num_train=4)


def test_single_file_is_carved_into_disjoint_train_and_eval(tmp_path):
    path = write_jsonl(tmp_path / "all.jsonl", numbered_records(40))
    task = file_task(path, num_eval=8, seed=3)
    train = {example.prompt for example in task.train}
    evaluation = {example.prompt for example in task.eval}
    assert (len(train), len(evaluation)) == (32, 8)
    assert not train & evaluation
    assert train | evaluation == {f"q{i}" for i in range(40)}
    assert file_task(path, num_eval=8, seed=3).eval == task.eval
    assert file_task(path, num_eval=8, seed=4).eval != task.eval


def test_single_file_defaults_to_a_tenth_for_eval_and_caps_train(tmp_path):
    path = write_jsonl(tmp_path / "all.jsonl", numbered_records(30))
    task = file_task(path)
    assert (len(task.train), len(task.eval)) == (27, 3)
    capped = file_task(path, num_train=5, num_eval=10)
    assert (len(capped.train), len(capped.eval)) == (5, 10)
    assert not {e.prompt for e in capped.train} & {e.prompt for e in capped.eval}


def test_hub_id_without_datasets_installed_suggests_pip_install(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DatasetError) as caught:
        file_task("someorg/somedata:main")
    message = str(caught.value)
    assert "'someorg/somedata:main' does not exist locally" in message
    assert "hub dataset 'someorg/somedata' (config 'main')" in message
    assert "pip install datasets" in message


def test_hub_id_is_loaded_through_datasets_load_dataset(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    calls = []

    def load_dataset(repo_id, config, split):
        calls.append((repo_id, config, split))
        return [{"q": f"{split}-{i}", "a": str(i)} for i in range(4)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    task = file_task("org/name:cfg", prompt_field="q", answer_field="a", num_eval=2, seed=0)
    assert calls == [("org/name", "cfg", "train"), ("org/name", "cfg", "test")]
    assert [example.prompt for example in task.train] == [f"train-{i}" for i in range(4)]
    assert len(task.eval) == 2 and all(e.prompt.startswith("test-") for e in task.eval)


def test_hub_loading_failure_becomes_a_dataset_error(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)

    def load_dataset(repo_id, config, split):
        raise FileNotFoundError(f"Dataset '{repo_id}' doesn't exist on the Hub")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(DatasetError, match="not a local file or folder.*doesn't exist on the Hub"):
        file_task("org/missing")


def test_missing_local_data_file_is_not_mistaken_for_a_hub_id(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "good.jsonl", numbered_records(1))
    with pytest.raises(DatasetError) as caught:
        file_task("data/gone.jsonl")
    message = str(caught.value)
    assert "dataset path data/gone.jsonl does not exist; data holds: good.jsonl" in message
    assert "pip install datasets" not in message
