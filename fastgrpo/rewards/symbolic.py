"""`math_verify`: symbolic answer checking by the `math-verify` library (the `math` extra).

For answers the numeric `math_accuracy` cannot judge: LaTeX fractions and roots, intervals, sets,
equations (`\\frac{1}{2}` equals `0.5`, `\\sqrt{8}` equals `2\\sqrt{2}`, `\\{2, 1\\}` equals
`\\{1, 2\\}`). The library's own timeouts use SIGALRM, which works in the main thread only, and
rewards run in worker threads: they are turned off here, and `train.reward_timeout` limits each
call of the reward instead (a call past it scores 0 and counts as a failure).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastgrpo.rewards.math import extract_answer

INSTALL = "pip install 'fastgrpo[math]' (or pip install math-verify)"


def require_math_verify() -> None:
    """A one-line error now, at config time, when the library is not installed."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        raise ValueError(
            f"the math_verify reward needs the math-verify package: {INSTALL}"
        ) from None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled", per call


def math_verify(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], **columns: Any
) -> list[float]:
    """1.0 where the completion's final answer equals the reference answer symbolically, else
    0.0 (also when either cannot be parsed)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    answer_forms = [  # what `_final_answer` reads first
        LatexExtractionConfig(boxed_match_priority=0),
        ExprExtractionConfig(try_extract_without_anchor=False),
    ]
    golds: dict[str, list] = {}
    out = []
    for completion, reference in zip(completions, answer, strict=True):
        text = str(reference).strip()
        if text not in golds:  # G completions share one reference: parse it once
            golds[text] = parse(text if "$" in text else f"${text}$", parsing_timeout=None)
        gold = golds[text]
        predicted = _final_answer(str(completion), answer_forms)
        right = bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=None)
        out.append(1.0 if right else 0.0)
    return out


def _final_answer(completion: str, answer_forms: list) -> list:
    """math-verify's parse of the completion's final answer: `answer_forms` (LaTeX math, a boxed
    answer first, or a plain expression after an anchor: "the final answer is ..."); else the span
    `math_accuracy` takes as the final stated answer. Plain expressions without an anchor are not
    read: a completion that restates the question ("to calculate 18 - 17, you would ...") would
    answer with the question's expression, evaluated (1): three of the 59 labelled SmolLM2
    outputs in tests/rewards/smollm2_outputs.jsonl scored 1 that way."""
    from math_verify import parse

    found = parse(completion, extraction_config=answer_forms, parsing_timeout=None)
    if found:
        return found
    span = extract_answer(completion)
    if span is None:
        return []
    return parse(f"${span}$" if "\\" in span else span, parsing_timeout=None)
