"""Exact-answer reward for math word problems (GSM8K, MATH and the like).

GRPO learns only from the reward signal, so the reward must not be fooled by how a
model writes its answer: "$1,234.50.", "\\boxed{\\frac{3}{4}}", "Answer: 12 apples"
and "#### 18" are all ordinary model outputs. This module finds the final answer in
a completion, parses numbers exactly (as fractions, so 0.5 == 1/2 with no float
rounding), and compares it to the dataset's reference answer.

It is numeric and strict: digits inside an identifier ("A2B", "x1") are no number, and a
symbolic ending ("x^2", "3x", "\\frac{1+\\sqrt{5}}{2}") is no answer rather than a number
read out of it; a reward that credits such reads would teach the policy to write them. Clean
integer powers ("2^{10}") in a stated answer are evaluated exactly; nothing else symbolic is.
"""

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from fastgrpo.rewards.completions import completion_text

_GSM8K_MARKER = "####"
_BOXED_COMMANDS = ("\\boxed", "\\fbox")

# "the answer is X", "final answer: X", "**Answer:** X", "A: X" (matched case-insensitively).
_ANSWER_PHRASE = re.compile(
    r"\banswer(?:\s*\*\*)?\s*(?:(?:is|would\s+be|will\s+be)\b|[:=])(?:\s*\*\*)?\s*:?"
    r"|\bA\s*:",
    re.IGNORECASE,
)
# The verb of "Final Answer: The number of eggs left is 9" (matched case-insensitively).
_STATED_BY = re.compile(r"\s(?:is|are|was|were|equals)\s", re.IGNORECASE)
# Where a stated answer's explanation begins: "42 because she had 6 bags of 7".
_EXPLANATION = re.compile(r"\s(?:because|since|as|so|which|given|if|when|where)\b", re.IGNORECASE)
# The end of the sentence that holds a phrase answer: ". " but not the "." of "3.5".
_SENTENCE_END = re.compile(r"[.!?;](?=\s|$)|,\s")

# One letter written right after a number is a variable ("3x", "2n"), except the unit
# symbols g, h, m, s and L ("5g", "2.5h", "4.5L"); two or more letters are a unit ("5km").
_VARIABLE = r"(?![ghmsL])[^\W\d_](?![^\W\d_])"
_UNSIGNED_NUMBER = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
# A number in running text. It must not continue a word or identifier ("A2B", "x1", "v_2"),
# an exponent ("x^2") or a LaTeX argument ("\sqrt{5}"; "\boxed{41" with no "}" is allowed),
# and must not be followed by a digit, "_", "^", "}", a decimal or fraction part, or a
# variable (see _VARIABLE). A minus sign counts only when it is not the binary minus of "16-3".
_NUMBER_IN_TEXT = re.compile(
    rf"(?:(?<![\w)\]])[-\u2212])?(?:(?<=\\boxed\{{)|(?<=\\fbox\{{)|(?<![\w.^{{\\]))"
    rf"{_UNSIGNED_NUMBER}(?:/\d+)?(?![\d_^}}]|{_VARIABLE}|[.,/]\d)"
)
# What makes the end of a text, from its last number on, a symbolic expression rather than a
# number: an exponent ("x^2", "2^{10}"), a number in a LaTeX argument ("\frac{1+\sqrt{5}}{2}",
# "\sqrt{x+3}"), a number times a variable ("3x") or a constant or function ("6\pi", "2\sqrt3").
_SYMBOLIC_TAIL = re.compile(
    r"\^\s*\{?\s*[-\u2212]?\d|\{\s*[-\u2212]?\.?\d|\d\s*\}"
    rf"|(?<![\w.])\d+(?:\.\d+)?{_VARIABLE}"
    r"|\\(?:sqrt|pi|infty|log|ln|exp|sin|cos|tan|sec|csc|cot|theta|alpha|beta|gamma)"
)
# "cm^2" or "m^3" after a number is a unit; its exponent is no part of the answer.
_UNIT_POWER = re.compile(r"(\d\s*[^\W\d_]{1,3})\s*\^\s*(?:\{\s*[23]\s*\}|[23])(?!\d)")

# Thousands groups: "14,916", "14{,}916", "1\,000", "1 000" with a thin (U+2009), narrow
# no-break (U+202F) or, in a stated answer only, a plain space ("3 100-pound bags" in running
# text is two numbers).
_GROUP_SEPARATORS = r"\{,\}|\\,|\\ |\\;|\\!|[,\u2009\u202f]"
_GROUPED_IN_TEXT = re.compile(rf"(?<![\d.,])\d{{1,3}}(?:(?:{_GROUP_SEPARATORS})\d{{3}})+(?!\d)")
_GROUPED_IN_ANSWER = re.compile(
    rf"(?<![\d.,])\d{{1,3}}(?:(?:{_GROUP_SEPARATORS}| )\d{{3}})+(?![\d,])"
)
_GROUP_SEPARATOR = re.compile(rf"{_GROUP_SEPARATORS}| ")

# A fraction of two plain numbers. "\frac{a+1}{2}" is symbolic and stays as it is, and so
# does the mixed number "2\frac{1}{2}" (refused, not misread as 21/2).
_LATEX_FRACTION = re.compile(
    r"(?<![\d}])\\[dt]?frac\s*\{\s*([-\u2212]?\d+(?:\.\d+)?)\s*\}\s*\{\s*(\d+(?:\.\d+)?)\s*\}"
)
_LATEX_WRAPPER = re.compile(
    r"\\(?:text|textbf|textrm|textit|mathrm|mathbf|mbox|boxed|fbox|underline|emph)\s*\{([^{}]*)\}"
)
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ(?:\s*\})?")
_LATEX_NOISE = re.compile(r"\\[!,;: ]|\\left|\\right|\^\{?\\circ\}?|\\%|\\\$")
_NUMERIC_ANSWER = re.compile(
    r"(?P<sign>[-+]?)\s*(?P<numerator>\d+(?:\.\d+)?|\.\d+)"
    r"(?:\s*/\s*(?P<denominator>\d+(?:\.\d+)?|\.\d+))?"
    rf"(?:(?:\s+[^\W\d_]|(?!{_VARIABLE})[^\W\d_])(?:[^\W\d_]|[./ ]|\^\{{?[23]\}}?)*)?\s*\.?"
)
# An integer power, evaluated exactly: "2^{10}" is 1024. Exponents are kept small so that
# a model cannot make the reward build a huge integer ("9^{99999}").
_INTEGER_POWER = re.compile(r"(?P<sign>[-+]?)\s*(?P<base>\d{1,6})\^\{?(?P<exponent>\d{1,2})\}?\.?")
_DROP_SYMBOLS = str.maketrans("", "", "$%€£¥°")


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: a marked answer if any, else its last number."""
    return extract_marked_answer(text) or _last_number(text)


def extract_marked_answer(text: str) -> str | None:
    """The answer a completion states explicitly: ``#### X``, ``\\boxed{X}`` or "answer is X".

    Markers are tried in that priority order; within one kind the last occurrence wins.
    Returns None when the completion marks no (non-empty) answer.
    """
    for find in (_after_last_gsm8k_marker, _last_boxed_content, _after_last_answer_phrase):
        answer = find(text)
        if answer:
            return answer
    return None


def _after_last_gsm8k_marker(text: str) -> str | None:
    """The rest of the line after the last ``####`` that is followed by something."""
    for segment in reversed(text.split(_GSM8K_MARKER)[1:]):
        answer = _clean_answer(segment.lstrip().split("\n", 1)[0])
        if answer:
            return answer
    return None


def _last_boxed_content(text: str) -> str | None:
    """The content of the last well-formed ``\\boxed{...}``, nested braces included."""
    starts = [
        match.end()
        for command in _BOXED_COMMANDS
        for match in re.finditer(re.escape(command) + r"\s*\{", text)
    ]
    for start in sorted(starts, reverse=True):
        content = _braced_content(text, start)
        answer = _clean_answer(content) if content is not None else None
        if answer:
            return answer
    return None


def _braced_content(text: str, start: int) -> str | None:
    """Text from ``start`` (just after a ``{``) up to its matching ``}``; None if unclosed."""
    depth = 1
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[start:index]
    return None


def _after_last_answer_phrase(text: str) -> str | None:
    """What follows the last "the answer is" / "Answer:" / "A:", up to the sentence end."""
    if ":" not in text and "answer" not in text.lower():  # every phrase has one: skip the scan
        return None
    for match in reversed(list(_ANSWER_PHRASE.finditer(text))):
        following = text[match.end() :].lstrip().split("\n", 1)[0]
        sentence = _SENTENCE_END.split(following, maxsplit=1)[0]
        answer = _clean_answer(_stated_value(_EXPLANATION.split(sentence, maxsplit=1)[0]))
        if answer:
            return answer
    return None


def _stated_value(clause: str) -> str:
    """The value a worded answer states: "42" in "The total number of apples is 42".

    Only a clause whose subject holds no digit is cut ("42 is the total" is kept whole)."""
    parts = _STATED_BY.split(clause)
    if len(parts) > 1 and parts[-1].strip() and not any(c.isdigit() for c in parts[0]):
        return parts[-1]
    return clause


def _clean_answer(raw: str) -> str:
    """Trim whitespace, markdown bold and a closing period; keep the right side of an "="."""
    answer = raw.strip().strip("*").strip()
    if "=" in answer:
        answer = answer.rsplit("=", 1)[1].strip()
    return answer.rstrip(".").strip()


# characters scanned before the last digit (then back to a whitespace): longer than any number
_NUMBER_WINDOW = 64


def _last_number(text: str) -> str | None:
    """The last number written in the text, e.g. "-7" in "So x = -7.", "3/4" in "x = \\frac{3}{4}".

    None when the text ends in a symbolic expression ("x = \\frac{1+\\sqrt{5}}{2}", "3x").
    Scans only the end of the text: a number holds no whitespace, so the matches after a
    whitespace character are the same whether the scan starts there or at the beginning, and
    the last one holds the last digit (a long completion of many numbers took ~0.25 ms to scan
    whole, most of a GRPO step's reward time for 64 such completions)."""
    text = _simplify_latex(text)
    last_digit = max(text.rfind(digit) for digit in "0123456789")
    if last_digit < 0:
        return None
    cut = max(0, last_digit - _NUMBER_WINDOW)
    start = max(text.rfind(space, 0, cut) for space in " \n\t") if cut else -1
    return _last_number_from(text, max(start, 0))


def _simplify_latex(text: str) -> str:
    """Running text with "\\frac{3}{4}" as "3/4", "\\text{18}" as "18" and no "^\\circ"."""
    if "\\" not in text:
        return text
    text = _LATEX_FRACTION.sub(r"\1/\2", text)
    return _DEGREES.sub("", _unwrap_latex_commands(text))


def _last_number_from(text: str, start: int) -> str | None:
    """`_last_number` of ``text[start:]``, or of all of it when that part holds no number."""
    tail = _GROUPED_IN_TEXT.sub(_with_comma_groups, text[start:])
    if "^" in tail:
        tail = _UNIT_POWER.sub(r"\1", tail)
    last = next(reversed(list(_NUMBER_IN_TEXT.finditer(tail))), None)
    if last is None:
        return _last_number_from(text, 0) if start else None
    if _SYMBOLIC_TAIL.search(tail, last.start()):
        return None
    return last.group()


def _with_comma_groups(match: re.Match[str]) -> str:
    """A grouped number with its separators written as plain commas: "14{,}916" -> "14,916"."""
    return _GROUP_SEPARATOR.sub(",", match.group())


def normalize_number(text: str) -> Fraction | None:
    """Parse a numeric answer exactly, or return None when it is not a number.

    Accepts "1,234", "$18", "50%", "18 dollars", "3.5 km", "0.50", "3/4",
    "\\frac{3}{4}", "-7", "\u22127", "+5", "$\\$18$" and "18." alike.
    """
    if text is None:
        return None
    cleaned = _strip_number_decoration(str(text))
    match = _NUMERIC_ANSWER.fullmatch(cleaned)
    if match is None:
        return _integer_power(cleaned)
    value = Fraction(match["numerator"])
    if match["denominator"] is not None:
        denominator = Fraction(match["denominator"])
        if denominator == 0:
            return None
        value /= denominator
    return -value if match["sign"] == "-" else value


def _integer_power(text: str) -> Fraction | None:
    """The exact value of "2^{10}" or "-3^2" (a minus applies to the power), else None."""
    match = _INTEGER_POWER.fullmatch(text)
    if match is None:
        return None
    value = Fraction(int(match["base"]) ** int(match["exponent"]))
    return -value if match["sign"] == "-" else value


def _strip_number_decoration(text: str) -> str:
    """Remove LaTeX, currency, percent and thousands separators around a number."""
    cleaned = text.replace("\u2212", "-")
    cleaned = _LATEX_FRACTION.sub(r"\1/\2", cleaned)
    cleaned = _unwrap_latex_commands(cleaned)
    cleaned = _LATEX_NOISE.sub("", cleaned)
    cleaned = cleaned.translate(_DROP_SYMBOLS)
    cleaned = _GROUPED_IN_ANSWER.sub(_without_groups, cleaned.strip())
    return cleaned.strip().strip("*{}").strip()


def _without_groups(match: re.Match[str]) -> str:
    """A grouped number with its thousands separators removed: "1 000" -> "1000"."""
    return _GROUP_SEPARATOR.sub("", match.group())


def _unwrap_latex_commands(text: str) -> str:
    """Replace ``\\text{x}``-style wrappers by their content, innermost first."""
    previous = None
    while previous != text:
        previous, text = text, _LATEX_WRAPPER.sub(r"\1", text)
    return text


def answers_match(predicted: str | None, reference: str) -> bool:
    """True when the answers are equal as numbers, or (if either is not one) as text."""
    if predicted is None:
        return False
    predicted_number = normalize_number(predicted)
    reference_number = normalize_number(reference)
    if predicted_number is not None and reference_number is not None:
        return predicted_number == reference_number
    return _normalize_text(predicted) == _normalize_text(reference)


def _normalize_text(text: str) -> str:
    """Text for a non-numeric comparison: no LaTeX wrappers, case, whitespace or final period."""
    unwrapped = _unwrap_latex_commands(str(text)).replace("$", "")
    return "".join(unwrapped.split()).lower().rstrip(".")


def reference_answer(answer: Any) -> str:
    """The final value of a dataset answer: the text after the last ``####``, else all of it."""
    text = "" if answer is None else str(answer)
    if _GSM8K_MARKER in text:
        text = text.rsplit(_GSM8K_MARKER, 1)[1]
    return text.strip()


def math_accuracy(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[Any],
    **columns: Any,
) -> list[float]:
    """1.0 for each completion whose final answer matches its reference ``answer``, else 0.0."""
    if isinstance(answer, str) or len(answer) != len(completions):
        raise ValueError(
            "math_accuracy needs one reference answer per completion: got "
            f"{_describe_length(answer)} answers for {len(completions)} completions. "
            "Pass the dataset's answer column as a list (answer=[...])."
        )
    return [
        _score_completion(completion, reference)
        for completion, reference in zip(completions, answer)
    ]


def _score_completion(completion: Any, reference: Any) -> float:
    """1.0 if one completion's answer matches one reference, else 0.0."""
    if reference is None:
        return 0.0
    predicted = extract_answer(completion_text(completion))
    return 1.0 if answers_match(predicted, reference_answer(reference)) else 0.0


def _describe_length(values: Any) -> str:
    """How many values a column holds, phrased for an error message."""
    if isinstance(values, str):
        return "a single string instead of a list of"
    return str(len(values))
