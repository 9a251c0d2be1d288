"""Read prompt/answer datasets from local files (.jsonl, .json, .parquet) or the HF hub.

Why: most RL data arrives as a JSONL or Parquet file with one record per problem. This module
turns such files into `Example`s with errors that say exactly what is wrong and where
("train.jsonl:3: invalid JSON ...", "missing field 'prompt'; fields present: question, ...")
so a bad config is fixed in one try instead of after a stack-trace hunt.
"""

from __future__ import annotations

import difflib
import json
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastgrpo.data.example import Example, TaskData
from fastgrpo.errors import UserError

SUPPORTED_SUFFIXES = (".jsonl", ".parquet", ".json")
# "org/name" or "name", optionally followed by ":config".
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")


class DatasetError(UserError):
    """A dataset file or record cannot be used; the message says where and how to fix it."""


def read_records(path: str | Path) -> list[dict]:
    """Read a .jsonl, .json (a list of objects) or .parquet file into a list of dicts."""
    path = Path(path)
    if path.is_dir():
        raise DatasetError(f"{path} is a directory; pass a file, or use file_task() for folders")
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist; {describe_nearby(path)}")
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise DatasetError(
            f"cannot read {path}: unsupported file type {path.suffix!r}; "
            f"supported: {', '.join(SUPPORTED_SUFFIXES)}"
        )
    records = reader(path)
    if not records:
        raise DatasetError(
            f"{path} holds no records (the file is empty or blank); add at least one, "
            'e.g. {"prompt": "What is 2+3?", "answer": "5"}'
        )
    return records


def describe_nearby(path: Path) -> str:
    """One sentence about what does exist near a missing path (for error messages)."""
    folder = path.parent
    if not folder.is_dir():
        existing = next((parent for parent in folder.parents if parent.is_dir()), None)
        return f"directory {folder} does not exist either (nearest existing: {existing})"
    candidates = sorted(
        entry.name
        for entry in folder.iterdir()
        if entry.is_dir() or entry.suffix.lower() in SUPPORTED_SUFFIXES
    )
    if not candidates:
        return f"{folder} holds no {'/'.join(SUPPORTED_SUFFIXES)} files"
    hint = difflib.get_close_matches(path.name, candidates, n=1)
    suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
    return f"{folder} holds: {', '.join(candidates[:20])}{suggestion}"


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    for line_number, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(
                f"{path}:{line_number}: invalid JSON: {error.msg} (column {error.colno})"
            ) from error
        if not isinstance(record, dict):
            raise DatasetError(
                f"{path}:{line_number}: expected a JSON object per line, "
                f"got {type(record).__name__}"
            )
        records.append(record)
    return records


def _read_text(path: Path) -> str:
    """A data file's text; one that is not UTF-8 is refused with the line and byte at fault."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line_number = raw.count(b"\n", 0, error.start) + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise DatasetError(
            f"{path}:{line_number}: not UTF-8 text (byte {raw[error.start]:#04x} at column "
            f"{column}); re-save the file as UTF-8, e.g. "
            f"`iconv -f latin1 -t utf-8 {path.name} > fixed{path.suffix}`"
        ) from error


def _read_json(path: Path) -> list[dict]:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as error:
        raise DatasetError(
            f"{path}:{error.lineno}: invalid JSON: {error.msg} (column {error.colno})"
        ) from error
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    for index, item in enumerate(data):
        if not isinstance(item, dict):
            raise DatasetError(
                f"{path}: item {index} of the list is a {type(item).__name__}, not an object"
            )
    return data


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        parquet = None
    if parquet is not None:
        import pyarrow

        try:
            return parquet.read_table(path).to_pylist()
        except (pyarrow.ArrowException, OSError) as error:
            raise DatasetError(
                f"{path} is not a readable Parquet file ({error}); re-write it, e.g. with "
                "pandas.DataFrame.to_parquet"
            ) from error
    try:
        import pandas
    except ImportError as error:
        raise DatasetError(f"reading {path} needs a Parquet reader: pip install pyarrow") from error
    try:
        frame = pandas.read_parquet(path)
    except ImportError as error:
        raise DatasetError(f"reading {path} needs pyarrow: pip install pyarrow") from error
    return frame.to_dict(orient="records")


def records_to_examples(
    records: Iterable[dict],
    *,
    prompt_field: str,
    answer_field: str,
    source: str,
    prompt_template: str = "{prompt}",
) -> list[Example]:
    """Turn raw records into Examples.

    `prompt_template` may use `{prompt}` (the value of `prompt_field`) and any record field by
    name. Every column other than the prompt and answer fields goes into `Example.columns`,
    together with "answer" (the reference answer, which overrides a column named "answer").
    """
    return [
        _record_to_example(record, number, prompt_field, answer_field, source, prompt_template)
        for number, record in enumerate(records, start=1)
    ]


def _record_to_example(
    record: dict,
    number: int,
    prompt_field: str,
    answer_field: str,
    source: str,
    prompt_template: str,
) -> Example:
    for field_name, knob in ((prompt_field, "prompt_field"), (answer_field, "answer_field")):
        if field_name not in record:
            raise DatasetError(
                f"{source}, record {number}: missing field {field_name!r} "
                f"(set {knob}=...); {_fields_hint(field_name, record)}"
            )
    answer = record[answer_field]
    if answer is None:
        raise DatasetError(f"{source}, record {number}: field {answer_field!r} is empty (null)")
    answer = answer if isinstance(answer, str) else str(answer)
    prompt = _fill_template(prompt_template, record, prompt_field, source, number)
    columns = {k: v for k, v in record.items() if k not in (prompt_field, answer_field)}
    columns["answer"] = answer
    return Example(prompt=prompt, answer=answer, columns=columns)


def _fill_template(template: str, record: dict, prompt_field: str, source: str, number: int) -> str:
    values = {**record, "prompt": record[prompt_field]}
    try:
        return template.format_map(values)
    except KeyError as error:
        missing = str(error.args[0])
        raise DatasetError(
            f"prompt_template uses {{{missing}}} but {source}, record {number} has no field "
            f"{missing!r}; {_fields_hint(missing, record)}"
        ) from error
    except (IndexError, ValueError) as error:
        raise DatasetError(
            f"prompt_template {template!r} is not a valid format string ({error}); "
            "write literal braces as '{{' and '}}'"
        ) from error


def _fields_hint(wanted: str, record: dict) -> str:
    present = [str(key) for key in record]
    hint = f"fields present: {', '.join(present) or '(none)'}"
    close = difflib.get_close_matches(wanted, present, n=1, cutoff=0.3)
    return hint + (f"; did you mean {close[0]!r}?" if close else "")


def file_task(
    path: str | Path,
    *,
    name: str = "jsonl",
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    train_split: str = "train",
    eval_split: str = "test",
    num_train: int | None = None,
    num_eval: int | None = None,
    seed: int = 0,
    prompt_template: str = "{prompt}",
) -> TaskData:
    """Build a task from a folder of split files, a single file, or a Hugging Face hub id.

    Folder: reads `{train_split}` and `{eval_split}` (.jsonl, .parquet or .json). num_train /
    num_eval None keep every record in file order; an int keeps the first n after a seeded
    shuffle. Single file: eval is the last num_eval records after a seeded shuffle (None: 10%,
    at least 1) and train is the rest (capped at num_train). Hub id: "org/name[:config]",
    loaded with `datasets.load_dataset` when the path does not exist locally.
    """
    _check_counts(num_train, num_eval)
    train_records, eval_records, train_source, eval_source = _load_splits(
        path, train_split, eval_split, num_train, num_eval, seed
    )
    options = {"prompt_field": prompt_field, "answer_field": answer_field}
    return TaskData(
        train=records_to_examples(
            train_records, source=train_source, prompt_template=prompt_template, **options
        ),
        eval=records_to_examples(
            eval_records, source=eval_source, prompt_template=prompt_template, **options
        ),
        name=name,
    )


def _check_counts(num_train: int | None, num_eval: int | None) -> None:
    for knob, value in (("num_train", num_train), ("num_eval", num_eval)):
        if value is not None and value < 0:
            raise ValueError(f"{knob} must be >= 0 or None, got {value}")


def _load_splits(
    path: str | Path,
    train_split: str,
    eval_split: str,
    num_train: int | None,
    num_eval: int | None,
    seed: int,
) -> tuple[list[dict], list[dict], str, str]:
    """Return (train_records, eval_records, train_source, eval_source)."""
    location = Path(path)
    if location.is_file():
        records = read_records(location)
        train_records, eval_records = _carve(records, num_train, num_eval, seed, str(location))
        return train_records, eval_records, str(location), str(location)
    if location.is_dir():
        train_file = find_split_file(location, train_split, "train_split")
        eval_file = find_split_file(location, eval_split, "eval_split")
        sources = (str(train_file), str(eval_file))
        all_train, all_eval = read_records(train_file), read_records(eval_file)
    else:
        hub_id = str(path)
        sources = (f"{hub_id} [{train_split}]", f"{hub_id} [{eval_split}]")
        all_train = load_hub_split(hub_id, train_split)
        all_eval = load_hub_split(hub_id, eval_split)
    train_records = _subset(all_train, num_train, f"file-train-{seed}", "num_train", sources[0])
    eval_records = _subset(all_eval, num_eval, f"file-eval-{seed}", "num_eval", sources[1])
    return train_records, eval_records, sources[0], sources[1]


def find_split_file(folder: Path, split: str, knob: str) -> Path:
    """The `{split}.jsonl|.parquet|.json` file in `folder` (first that exists)."""
    for suffix in SUPPORTED_SUFFIXES:
        candidate = folder / f"{split}{suffix}"
        if candidate.is_file():
            return candidate
    expected = ", ".join(f"{split}{suffix}" for suffix in SUPPORTED_SUFFIXES)
    raise DatasetError(
        f"no {split!r} split in {folder}: expected one of {expected}; "
        f"{describe_nearby(folder / f'{split}.jsonl')} (set {knob}=... to choose another)"
    )


def _subset(
    records: list[dict], count: int | None, rng_seed: str, knob: str, source: str
) -> list[dict]:
    """All records in order when count is None, else the first `count` after a seeded shuffle."""
    if count is None:
        return list(records)
    if count > len(records):
        raise DatasetError(f"{knob}={count} but {source} has only {len(records)} records")
    shuffled = list(records)
    random.Random(rng_seed).shuffle(shuffled)
    return shuffled[:count]


def _carve(
    records: list[dict], num_train: int | None, num_eval: int | None, seed: int, source: str
) -> tuple[list[dict], list[dict]]:
    """Split one file into disjoint (train, eval) after a seeded shuffle."""
    if num_eval is None:
        num_eval = max(1, len(records) // 10) if len(records) >= 2 else 0
    if num_eval > len(records):
        raise DatasetError(f"num_eval={num_eval} but {source} has only {len(records)} records")
    shuffled = list(records)
    random.Random(f"file-carve-{seed}").shuffle(shuffled)
    cut = len(shuffled) - num_eval
    train_pool, eval_records = shuffled[:cut], shuffled[cut:]
    if num_train is None:
        return train_pool, eval_records
    if num_train > len(train_pool):
        raise DatasetError(
            f"num_train={num_train} but {source} has only {len(train_pool)} records left "
            f"after carving num_eval={num_eval} for eval"
        )
    return train_pool[:num_train], eval_records


def looks_like_hub_id(text: str) -> bool:
    """True for "org/name", "name" or "name:config" that is not a data file name."""
    if not _HUB_ID.match(text):
        return False
    return Path(text.split(":")[0]).suffix.lower() not in SUPPORTED_SUFFIXES


def load_hub_split(spec: str, split: str) -> list[dict]:
    """Load `split` of hub dataset "org/name[:config]" as a list of dicts."""
    if not looks_like_hub_id(spec):
        raise DatasetError(f"dataset path {spec} does not exist; {describe_nearby(Path(spec))}")
    datasets = _import_datasets(spec)
    repo_id, _, config = spec.partition(":")
    try:
        dataset = datasets.load_dataset(repo_id, config or None, split=split)
    except Exception as error:  # the hub raises many types; re-raise as one clear error
        raise DatasetError(
            f"{spec} is not a local file or folder, and loading split {split!r} of hub "
            f"dataset {repo_id!r} (config {config or None!r}) failed: {error}"
        ) from error
    return [dict(row) for row in dataset]


def _import_datasets(spec: str) -> Any:
    try:
        import datasets
    except ImportError as error:
        repo_id, _, config = spec.partition(":")
        config_note = f" (config {config!r})" if config else ""
        raise DatasetError(
            f"dataset path {spec!r} does not exist locally ({describe_nearby(Path(spec))}); "
            f"if you meant the Hugging Face hub dataset {repo_id!r}{config_note}: "
            "pip install datasets"
        ) from error
    return datasets
