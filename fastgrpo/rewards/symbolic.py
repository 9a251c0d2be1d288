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
    from math_verify import parse, verify

    golds: dict[str, list] = {}
    out = []
    for completion, reference in zip(completions, answer, strict=True):
        text = str(reference).strip()
        if text not in golds:  # G completions share one reference: parse it once
            golds[text] = parse(text if "$" in text else f"${text}$", parsing_timeout=None)
        gold = golds[text]
        predicted = parse(str(completion), parsing_timeout=None)
        right = bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=None)
        out.append(1.0 if right else 0.0)
    return out
