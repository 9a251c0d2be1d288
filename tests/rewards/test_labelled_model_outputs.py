"""Both math rewards against real model outputs, labelled by hand.

tests/rewards/smollm2_outputs.jsonl holds 59 completions that SmolLM2-135M-Instruct wrote (the
default model, through fastgrpo's engine on the CPU, 2026-11-27): 39 to 20 of the arithmetic
task's held-out problems (2 samples each at temperature 0.8, 64 new tokens, seed 7) and 20 to the
first 10 GSM8K test problems (2 samples at 0.7, 256 tokens, seed 3). One arithmetic output was
left out as ambiguous ("10 is a compound number..." for 0 + 10). Each was labelled by reading it:
1.0 where the answer the completion gives, and does not take back, is the reference answer. The
rewards' code was not consulted for the labels; no one here wrote the completions.

They are messy in the ways the rewards must survive: restated questions ("To calculate 18 - 17,
you would ..."), wrong sums next to right ones, explanations after the number, `####` lines
repeated or empty, truncation mid-sentence. 9 are right, all on the arithmetic task.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastgrpo.rewards.math import math_accuracy

ROWS = [
    json.loads(line)
    for line in (Path(__file__).parent / "smollm2_outputs.jsonl").read_text().splitlines()
]
IDS = [f"{row['task']}-{i}" for i, row in enumerate(ROWS)]


def test_the_set_is_real_and_holds_both_labels():
    assert len(ROWS) == 59
    labels = [row["label"] for row in ROWS]
    assert labels.count(1.0) == 9 and labels.count(0.0) == 50
    assert {row["task"] for row in ROWS} == {"arithmetic", "gsm8k"}


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_math_accuracy_agrees_with_the_label(row):
    assert math_accuracy(["q"], [row["completion"]], answer=[row["answer"]]) == [row["label"]]


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_math_verify_agrees_with_the_label(row):
    pytest.importorskip("math_verify")
    from fastgrpo.rewards.symbolic import math_verify

    assert math_verify(["q"], [row["completion"]], answer=[row["answer"]]) == [row["label"]]
