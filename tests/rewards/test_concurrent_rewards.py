"""Rewards that cannot stall a run (issue 31, item 7): `async def` rewards, all of a set's rewards
called at once, and a time limit per call after which the call scores 0 and counts as failed."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fastgrpo.rewards import RewardSet, answer_format, math_accuracy
from fastgrpo.rewards.concurrent_calls import is_async_reward

PROMPTS = ["What is 9 * 2?"] * 4
COMPLETIONS = ["9 * 2 = 18\n#### 18", "It is 17", "The answer is 18.", "no idea"]
COLUMNS = {"answer": ["18"] * 4}
REPO = Path(__file__).resolve().parents[2]


def length_share(prompts, completions, **columns):
    return [len(text) / 20 for text in completions]


async def async_length_share(prompts, completions, **columns):
    await asyncio.sleep(0)
    return [len(text) / 20 for text in completions]


class AsyncDigitCount:
    """A reward object whose ``__call__`` is a coroutine function."""

    async def __call__(self, prompts, completions, **columns):
        return [float(sum(c.isdigit() for c in text)) for text in completions]


def sleeps(seconds, value=1.0):
    def reward(prompts, completions, **columns):
        time.sleep(seconds)
        return [value] * len(completions)

    return reward


def async_sleeps(seconds, value=1.0):
    async def reward(prompts, completions, **columns):
        await asyncio.sleep(seconds)
        return [value] * len(completions)

    return reward


def never_returns(prompts, completions, **columns):
    threading.Event().wait()  # no one sets it


async def never_returns_async(prompts, completions, **columns):
    await asyncio.Event().wait()


async def blocks_its_loop(prompts, completions, **columns):
    time.sleep(3)  # blocking code in a coroutine: the loop can run nothing else meanwhile
    return [1.0] * len(completions)


def test_async_rewards_are_recognised():
    assert is_async_reward(async_length_share)
    assert is_async_reward(functools.partial(async_length_share, scale=2))
    assert is_async_reward(AsyncDigitCount())
    assert not is_async_reward(length_share)
    assert not is_async_reward(math_accuracy)


def test_an_async_reward_gives_what_its_plain_twin_gives():
    plain = RewardSet([("share", length_share, 0.5)])(PROMPTS, COMPLETIONS, COLUMNS)
    both = RewardSet([("share", async_length_share, 0.5)])(PROMPTS, COMPLETIONS, COLUMNS)
    assert both == plain
    assert plain.per_reward["share"] == [0.9, 0.4, 0.85, 0.35]


def test_rewards_called_at_once_sum_to_what_calling_them_one_after_another_gives():
    terms = [
        ("math_accuracy", math_accuracy, 1.0),
        ("answer_format", answer_format, 0.2),
        ("share", async_length_share, -0.5),
        ("digits", AsyncDigitCount(), 0.25),
        ("slow", sleeps(0.05, value=3.0), 1.0),
    ]
    result = RewardSet(terms, timeout=10)(PROMPTS, COMPLETIONS, COLUMNS)
    expected_total = [0.0] * len(COMPLETIONS)
    for name, function, weight in terms:  # one after another, in the set's order
        values = function(PROMPTS, COMPLETIONS, **COLUMNS)
        if asyncio.iscoroutine(values):
            values = asyncio.run(values)
        assert result.per_reward[name] == [float(v) for v in values], name
        expected_total = [t + weight * v for t, v in zip(expected_total, values)]
    assert result.total == expected_total  # same order of additions: equal, not just close
    assert result.total[0] == 1.0 + 0.2 * 1.0 - 0.5 * 0.9 + 0.25 * 6 + 3.0
    assert not any(result.failures.values()) and not result.errors


@pytest.mark.parametrize(
    "first, second",
    [
        (sleeps(0.5), sleeps(0.5)),
        (async_sleeps(0.5), async_sleeps(0.5)),
        (sleeps(0.5), async_sleeps(0.5)),
    ],
    ids=["plain+plain", "async+async", "plain+async"],
)
def test_two_rewards_that_each_sleep_half_a_second_run_at_the_same_time(first, second):
    rewards = RewardSet([("first", first, 1.0), ("second", second, 2.0)], timeout=30)
    start = time.perf_counter()
    result = rewards(PROMPTS, COMPLETIONS, COLUMNS)
    elapsed = time.perf_counter() - start
    assert 0.5 <= elapsed < 0.9  # one after another: >= 1.0 s
    assert result.total == [3.0] * 4


@pytest.mark.parametrize(
    "hangs, threads_left, loops_left",  # logged once each; a cancelled coroutine is no leftover
    [(never_returns, 1, 0), (never_returns_async, 0, 0), (blocks_its_loop, 0, 1)],
    ids=["plain", "async", "blocking"],
)
def test_a_reward_that_never_returns_scores_zero_and_counts_as_failed(
    hangs, threads_left, loops_left, caplog
):
    rewards = RewardSet(
        [("good", async_sleeps(0.0, 2.0), 1.0), ("hangs", hangs, 1.0), ("fine", length_share, 1.0)],
        timeout=0.5,
    )
    for _ in range(2):  # the second batch: nothing left over from the first gets in its way
        start = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="fastgrpo.rewards"):
            result = rewards(PROMPTS, COMPLETIONS, COLUMNS)
        elapsed = time.perf_counter() - start
        assert 0.5 <= elapsed < 2.5  # the limit, plus at most 0.5 s to see a blocked loop
        assert result.per_reward["hangs"] == [0.0] * 4
        assert result.failures == {"good": 0, "hangs": 4, "fine": 0}
        assert result.errors == {
            "hangs": "RewardTimeout: returned nothing within 0.5 s (train.reward_timeout)"
        }
        assert result.total == [2.0 + v for v in (0.9, 0.4, 0.85, 0.35)]
    messages = [record.getMessage() for record in caplog.records]
    assert sum("'hangs' is still running" in m for m in messages) == threads_left
    assert sum("'hangs' blocks its event loop" in m for m in messages) == loops_left


def test_an_abandoned_call_is_logged_once_and_every_late_call_is_counted(caplog):
    rewards = RewardSet([("hangs", never_returns, 1.0)], timeout=0.2, warn_every=100)
    with caplog.at_level(logging.WARNING, logger="fastgrpo.rewards"):
        failures = [rewards(PROMPTS, COMPLETIONS, COLUMNS).failures["hangs"] for _ in range(3)]
    assert failures == [4, 4, 4]
    abandoned = [r for r in caplog.records if "abandoned" in r.getMessage()]
    assert len(abandoned) == 1 and "'hangs' is still running after 0.2 s" in abandoned[0].message
    assert sum("failing call #1;" in r.getMessage() for r in caplog.records) == 1


def test_without_a_limit_a_slow_reward_is_waited_for():
    rewards = RewardSet([("slow", sleeps(0.3, 1.5), 1.0)], timeout=None)
    result = rewards(PROMPTS, COMPLETIONS, COLUMNS)
    assert result.total == [1.5] * 4 and result.failures == {"slow": 0}


def test_a_reward_that_edits_its_arguments_changes_no_other_rewards_input():
    def edits(prompts, completions, answer, **columns):
        completions[:] = ["#### 18"] * len(completions)
        answer[:] = ["17"] * len(answer)
        return [0.0] * len(completions)

    rewards = RewardSet([("edits", edits, 1.0), ("math_accuracy", math_accuracy, 1.0)])
    result = rewards(PROMPTS, list(COMPLETIONS), {"answer": list(COLUMNS["answer"])})
    assert result.per_reward["math_accuracy"] == [1.0, 0.0, 1.0, 0.0]


def test_a_reward_timed_by_sigalrm_fails_with_how_to_fix_it():
    def alarm_timed(prompts, completions, **columns):
        signal.signal(signal.SIGALRM, lambda *_: None)  # what math_verify's timeout does
        return [1.0] * len(completions)

    result = RewardSet([("verify", alarm_timed, 1.0)])(PROMPTS, COMPLETIONS, COLUMNS)
    assert result.failures == {"verify": 4}
    assert result.errors["verify"].startswith("ValueError: signal only works in main thread")
    assert "parsing_timeout=None" in result.errors["verify"]
    assert "train.reward_timeout" in result.errors["verify"]


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), "60", True])
def test_a_bad_timeout_is_refused_saying_what_to_give(timeout):
    with pytest.raises(ValueError, match="seconds"):
        RewardSet([("share", length_share, 1.0)], timeout=timeout)


HANGING_SCRIPT = textwrap.dedent("""\
    import time
    from fastgrpo.rewards import RewardSet

    def sleeps_forever(prompts, completions, **columns):
        time.sleep(10**6)

    def spins_forever(prompts, completions, **columns):
        while True:
            pass

    async def blocks_its_loop(prompts, completions, **columns):
        time.sleep(10**6)

    rewards = RewardSet(
        [("sleeps", sleeps_forever, 1.0), ("spins", spins_forever, 1.0),
         ("blocks", blocks_its_loop, 1.0)],
        timeout=0.3,
    )
    print(rewards(["q", "q"], ["a", "b"]).failures, flush=True)
""")


def test_a_process_whose_rewards_hang_forever_still_exits():
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", HANGING_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,  # a process kept alive by a reward thread would hang here
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{'sleeps': 2, 'spins': 2, 'blocks': 2}"
    assert elapsed < 20  # ~1 s: imports, the 0.3 s limit, 0.5 s to see the blocked loop
