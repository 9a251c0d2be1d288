"""Every config key with its type, default and meaning, for `fastgrpo config --keys`.

The meaning of a key is the comment at the end of its line in the dataclasses of `config.py`, so
that file stays the one place that says what a key does; a test checks every key has one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import json
import re
import tokenize

from fastgrpo.config import Config, all_keys


def key_table() -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every key; the meaning is the comment on the key's line
    in config.py's dataclasses, so the code stays the one place that says what a key does."""
    rows = []
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for key in all_keys():
        section, _, name = key.partition(".")
        if name:
            owner = type(getattr(Config(), section))
            spec = next(f for f in dataclasses.fields(owner) if f.name == name)
            default = getattr(owner(), name)
        else:
            owner, spec, default = Config, sections[section], getattr(Config(), section)
        kind = spec.type if isinstance(spec.type, str) else getattr(spec.type, "__name__", "")
        meaning = _field_comments(owner).get(spec.name, "")
        rows.append((key, kind, json.dumps(default), meaning))
    return rows


@functools.cache
def _field_comments(owner: type) -> dict[str, str]:
    """Field name -> the comment at the end of its line in `owner`'s source."""
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):  # no source (a frozen install): no meanings, nothing else lost
        return {}
    comments = {}
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = lines[token.start[0] - 1]
        match = re.match(r"\s+(\w+)\s*:", line)
        if match and not line.lstrip().startswith("#"):
            comments[match.group(1)] = token.string.lstrip("# ").strip()
    return comments


def format_key_table() -> str:
    """The table as aligned text: key, type, default, then the meaning."""
    rows = [("key", "type", "default", "meaning"), *key_table()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
        for row in rows
    )
