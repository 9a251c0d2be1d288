"""Find reward functions by name and combine several of them into one weighted reward.

A training config names its rewards as strings: a built-in ("math_accuracy"), an
importable function ("my_pkg.rewards:length_penalty") or a function in a file
("rewards/custom.py:score"). :class:`RewardSet` calls them all on a batch at once
(``async def`` rewards on an event loop, plain ones in threads: see concurrent_calls.py)
and sums them with weights, in the set's order, so the total is what calling them one
after another gives. A buggy user reward must not kill or stall a long training run, so
a reward that raises, returns bad values or passes its time limit scores 0 for those
completions, is counted in :attr:`RewardResult.failures`, and is logged (without spamming).
"""

import difflib
import functools
import hashlib
import importlib
import importlib.util
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastgrpo.rewards.concurrent_calls import ConcurrentCalls, RewardTimeout
from fastgrpo.rewards.format import answer_format
from fastgrpo.rewards.math import math_accuracy
from fastgrpo.rewards.overlong import overlong_penalty
from fastgrpo.rewards.symbolic import math_verify, require_math_verify

RewardFunction = Callable[..., Sequence[Any]]

logger = logging.getLogger("fastgrpo.rewards")

BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "math_accuracy": math_accuracy,
    "answer_format": answer_format,
    "overlong_penalty": overlong_penalty,
    "math_verify": math_verify,  # needs the math-verify package (the `math` extra)
}

_USER_SPEC_HINT = "For your own reward use 'module.path:function' or 'path/to/file.py:function'."
_SPEC_DICT_KEYS = {"name", "function", "weight", "options"}
# what math_verify and other SIGALRM-timed graders raise in the threads rewards run in
_SIGNAL_IN_THREAD = "signal only works in main thread"
_SIGNAL_IN_THREAD_HINT = (
    "; rewards run in worker threads, where signal-based timeouts cannot work: turn the "
    "grader's own timeout off (math_verify: parse(..., parsing_timeout=None), verify(..., "
    "timeout_seconds=None)), train.reward_timeout limits the call instead"
)


def resolve_reward(spec: str | RewardFunction) -> RewardFunction:
    """The reward function named by ``spec``: a built-in, "module:function" or "file.py:function"."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"A reward spec must be a non-empty string, got {spec!r}. {_USER_SPEC_HINT}"
        )
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        if spec == "math_verify":
            require_math_verify()
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(_unknown_builtin_message(spec))
    location, function_name = spec.rsplit(":", 1)
    if _looks_like_file(location):
        module = _load_file_module(location, spec)
    else:
        module = _import_module(location, spec)
    return _get_function(module, function_name, spec)


def _unknown_builtin_message(name: str) -> str:
    """An error message for an unknown built-in name, with the closest match if any."""
    available = ", ".join(sorted(BUILTIN_REWARDS))
    close = difflib.get_close_matches(name, BUILTIN_REWARDS, n=1, cutoff=0.5)
    suggestion = f" Did you mean '{close[0]}'?" if close else ""
    return (
        f"Unknown reward '{name}'.{suggestion} Available built-in rewards: {available}. "
        f"{_USER_SPEC_HINT}"
    )


def _looks_like_file(location: str) -> bool:
    """True if the part before ":" is a file path rather than a dotted module name."""
    return location.endswith(".py") or "/" in location or "\\" in location


def _load_file_module(location: str, spec: str) -> Any:
    """Execute a Python file as a fresh module and return it."""
    path = Path(location).expanduser().resolve()
    if not path.is_file():
        raise ValueError(
            f"Reward file '{location}' (from spec '{spec}') does not exist "
            f"(looked at {path}). Fix the path; relative paths start at the current directory."
        )
    module_name = f"fastgrpo_user_reward_{path.stem}_{_short_hash(str(path))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"Cannot load '{location}' (from spec '{spec}') as a Python module.")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        raise ValueError(
            f"Running reward file '{location}' (from spec '{spec}') raised "
            f"{type(error).__name__}: {error}. Fix the error in that file."
        ) from error
    return module


def _short_hash(text: str) -> str:
    """A short stable digest, so files with the same name load as distinct modules."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:10]


def _import_module(location: str, spec: str) -> Any:
    """Import a module by dotted name, with an error that says how to fix a failure."""
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as error:
        raise ValueError(
            f"Cannot import module '{location}' (from spec '{spec}'): {error}. Install it or "
            "add its folder to PYTHONPATH, or give a file path: 'path/to/file.py:function'."
        ) from error
    except Exception as error:
        raise ValueError(
            f"Importing module '{location}' (from spec '{spec}') raised "
            f"{type(error).__name__}: {error}. Fix the error in that module."
        ) from error


def _get_function(module: Any, function_name: str, spec: str) -> RewardFunction:
    """The callable ``function_name`` of ``module``, or a ValueError listing what exists."""
    function = getattr(module, function_name, None)
    if function is None:
        public = sorted(
            n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n])
        )
        raise ValueError(
            f"Module '{module.__name__}' (from spec '{spec}') has no attribute "
            f"'{function_name}'. Callables it defines: {', '.join(public) or 'none'}."
        )
    if not callable(function):
        raise ValueError(
            f"'{function_name}' in spec '{spec}' is a {type(function).__name__}, not a function. "
            "Point the spec at a function fn(prompts, completions, **columns) -> list[float]."
        )
    return function


@dataclass
class RewardResult:
    """Rewards for one batch: weighted totals, each reward's values, and failure counts."""

    total: list[float]
    per_reward: dict[str, list[float]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # each failing reward's error, as text


@dataclass(frozen=True)
class _RewardTerm:
    """One reward in a set: its label, its function and its weight."""

    name: str
    function: RewardFunction
    weight: float


class _BadRewardOutput(Exception):
    """A reward's output as a whole was unusable (wrong type or length)."""


class RewardSet:
    """Several reward functions called on a batch at once and summed with weights,
    fault-tolerantly; each call may take at most `timeout` seconds (None: no limit)."""

    def __init__(
        self,
        rewards: Iterable[tuple[str, RewardFunction, float]],
        warn_every: int = 100,
        timeout: float | None = None,
    ):
        self._terms = [_make_term(name, function, weight) for name, function, weight in rewards]
        _check_unique_names([term.name for term in self._terms])
        self._warn_every = max(1, int(warn_every))
        self._failed_calls: dict[str, int] = {term.name: 0 for term in self._terms}
        self.timeout = _check_timeout(timeout)
        self._calls = ConcurrentCalls()

    @classmethod
    def from_specs(
        cls, specs: Iterable[str | Mapping[str, Any]], timeout: float | None = None
    ) -> "RewardSet":
        """Build a set from config entries: "name", "module:function" or a dict with a weight."""
        return cls((_parse_spec(spec) for spec in specs), timeout=timeout)

    @property
    def names(self) -> list[str]:
        """The rewards' names, in call order."""
        return [term.name for term in self._terms]

    @property
    def weights(self) -> dict[str, float]:
        """Each reward's weight in the total."""
        return {term.name: term.weight for term in self._terms}

    def __len__(self) -> int:
        return len(self._terms)

    def values_of(self, function: RewardFunction, result: RewardResult) -> list[float] | None:
        """The values `function` gave in `result` when it is one of this set's rewards and none
        of them failed (so a metric needs not score the batch again), else None."""
        for term in self._terms:
            if term.function is function and not result.failures.get(term.name):
                return result.per_reward.get(term.name)
        return None

    def __repr__(self) -> str:
        terms = ", ".join(f"{term.name}*{term.weight:g}" for term in self._terms)
        return f"RewardSet({terms})"

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> RewardResult:
        """Score a batch; ``columns`` holds extra dataset columns, one value per completion."""
        columns = dict(columns or {})
        _check_batch(prompts, completions, columns)
        count = len(completions)
        calls = [  # each its own lists, so a reward that edits them changes no other's input
            (term.name, term.function, _own_arguments(prompts, completions, columns))
            for term in self._terms
        ]
        outcomes = self._calls.run(calls, self.timeout)
        total = [0.0] * count
        result = RewardResult(total=total)
        for term, (raw, call_error) in zip(self._terms, outcomes):
            values, failures, error = self._score(term.name, raw, call_error, count)
            result.per_reward[term.name] = values
            result.failures[term.name] = failures
            if error is not None:
                result.errors[term.name] = _error_text(error)
            for index, value in enumerate(values):
                total[index] += term.weight * value
        return result

    def _score(
        self, name: str, raw: Any, call_error: BaseException | None, count: int
    ) -> tuple[list[float], int, BaseException | None]:
        """One reward's sanitized values, how many of them had to be replaced by 0, and why."""
        if call_error is not None:
            traceback = not isinstance(call_error, RewardTimeout)
            self._record_failure(name, count, count, call_error, show_traceback=traceback)
            return [0.0] * count, count, call_error
        try:
            values, bad_values = _sanitize(raw, count)
        except Exception as error:
            self._record_failure(name, count, count, error, show_traceback=False)
            return [0.0] * count, count, error
        problem = None
        if bad_values:
            problem = _BadRewardOutput(f"returned {bad_values} None/NaN/inf/non-numeric value(s)")
            self._record_failure(name, bad_values, count, problem, show_traceback=False)
        return values, bad_values, problem

    def _record_failure(
        self, name: str, bad: int, count: int, error: BaseException, show_traceback: bool
    ) -> None:
        """Count a failing call and log it on the first and every ``warn_every``-th time."""
        self._failed_calls[name] += 1
        failed_calls = self._failed_calls[name]
        if (failed_calls - 1) % self._warn_every != 0:
            return
        logger.warning(
            "Reward '%s' failed (failing call #%d; %d of %d values set to 0; "
            "the next %d failing calls are not logged): %s",
            name,
            failed_calls,
            bad,
            count,
            self._warn_every - 1,
            _error_text(error),
            exc_info=error if show_traceback else None,
        )


def _error_text(error: BaseException) -> str:
    """ "Type: message" of a reward's error, with how to fix one that threads cause."""
    text = f"{type(error).__name__}: {error}"
    return text + _SIGNAL_IN_THREAD_HINT if _SIGNAL_IN_THREAD in text else text


def _own_arguments(
    prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, Sequence[Any]]
) -> dict[str, Any]:
    """One call's keyword arguments, each list copied."""
    arguments = {"prompts": prompts, "completions": completions, **columns}
    return {key: _copy(values) for key, values in arguments.items()}


def _copy(values: Any) -> Any:
    return values.copy() if isinstance(values, list) else values


def _check_timeout(timeout: float | None) -> float | None:
    """A reward call's time limit in seconds: a positive number or None (no limit)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ValueError(f"The reward timeout must be seconds or None, got {timeout!r}.")
    if not 0 < timeout < math.inf:
        raise ValueError(
            f"The reward timeout is {timeout!r}; give a positive number of seconds, or None "
            "for no limit."
        )
    return float(timeout)


def _make_term(name: str, function: RewardFunction, weight: float) -> _RewardTerm:
    """Validate one (name, function, weight) triple."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"A reward name must be a non-empty string, got {name!r}.")
    if not callable(function):
        raise ValueError(f"Reward '{name}' is not callable: got {type(function).__name__}.")
    try:
        weight = float(weight)
    except (TypeError, ValueError) as error:
        raise ValueError(f"Reward '{name}' has a non-numeric weight {weight!r}.") from error
    if not math.isfinite(weight):
        raise ValueError(
            f"Reward '{name}' has a non-finite weight {weight!r}; use a finite number."
        )
    return _RewardTerm(name=name, function=function, weight=weight)


def _check_unique_names(names: list[str]) -> None:
    """Reject two rewards with one name, since their results would overwrite each other."""
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(
            f"Reward names must be unique, but {', '.join(duplicates)} appear more than once. "
            "Give each a distinct 'name' in its spec."
        )


def _check_batch(
    prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, Sequence[Any]]
) -> None:
    """Reject a malformed batch early, with a message naming the mismatch."""
    if len(prompts) != len(completions):
        raise ValueError(
            f"RewardSet got {len(prompts)} prompts for {len(completions)} completions; "
            "repeat each prompt once per completion."
        )
    reserved = sorted({"prompts", "completions"} & set(columns))
    if reserved:
        raise ValueError(f"Dataset columns may not be named {', '.join(reserved)}; rename them.")


def _sanitize(raw: Any, count: int) -> tuple[list[float], int]:
    """Floats from a reward's output, with unusable values replaced by 0 (and counted)."""
    if isinstance(raw, str | bytes | Mapping) or not hasattr(raw, "__len__"):
        raise _BadRewardOutput(f"returned {type(raw).__name__}, expected a list of {count} floats")
    if len(raw) != count:
        raise _BadRewardOutput(f"returned {len(raw)} values for {count} completions")
    values = [_finite_float(value) for value in raw]
    bad_values = sum(value is None for value in values)
    return [0.0 if value is None else value for value in values], bad_values


def _finite_float(value: Any) -> float | None:
    """The value as a finite float, or None if it is missing, non-numeric, NaN or infinite."""
    if value is None or isinstance(value, str | bytes):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _parse_spec(spec: str | Mapping[str, Any]) -> tuple[str, RewardFunction, float]:
    """One config entry as (name, function, weight)."""
    if isinstance(spec, str):
        return _default_name(spec), resolve_reward(spec), 1.0
    if not isinstance(spec, Mapping):
        raise ValueError(f"A reward spec must be a string or a dict, got {type(spec).__name__}.")
    unknown = sorted(set(spec) - _SPEC_DICT_KEYS)
    if unknown:
        raise ValueError(
            f"Reward spec {dict(spec)!r} has unknown keys {', '.join(unknown)}; "
            f"allowed keys are {', '.join(sorted(_SPEC_DICT_KEYS))}."
        )
    target = spec.get("function") or spec.get("name")
    if not target:
        raise ValueError(f"Reward spec {dict(spec)!r} needs a 'name' or 'function'.")
    label = spec.get("name") if "function" in spec else None
    function = resolve_reward(target)
    options = spec.get("options") or {}
    if not isinstance(options, Mapping):
        raise ValueError(
            f"Reward spec {dict(spec)!r}: 'options' must be a mapping of keyword arguments, "
            f"e.g. options: {{overlong_buffer: 64}}"
        )
    if options:  # keyword arguments bound once, e.g. overlong_penalty's buffer and factor
        function = functools.partial(function, **options)
    return label or _default_name(target), function, spec.get("weight", 1.0)


def _default_name(target: Any) -> str:
    """A reward's label: the built-in name, or the function part of "module:function"."""
    if callable(target):
        return getattr(target, "__name__", type(target).__name__)
    return str(target).strip().rsplit(":", 1)[-1]
