"""Call a batch's reward functions all at once, each within a time limit.

Rewards that wait (an HTTP grader, an LLM judge, a code sandbox) should not wait one after
another, and one that never returns must not stall a training run. So every call starts at
once: an ``async def`` reward runs on an event loop of its own in a background thread (the
loop stays between batches, so a client the reward made on it can be reused, and a reward that
blocks its loop holds up no other), a plain function runs in a thread of its own. The caller
waits for all of them up to one deadline.

A thread cannot be stopped from outside, so a plain call that passes the deadline is
abandoned: its thread is a daemon that keeps running until the function returns (or the
process exits) and never holds up the interpreter's exit; its result is thrown away. A late
coroutine is cancelled. A coroutine that blocks its loop (``time.sleep`` instead of
``await asyncio.sleep``) cannot be cancelled either; that loop is abandoned like a thread and
a fresh one serves the next calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger("fastgrpo.rewards")

# how long a loop whose coroutine timed out may take to answer before it counts as blocked
_LOOP_CHECK_SECONDS = 0.5
_ABANDONED_THREAD = (
    "Reward '%s' is still running after %s s (train.reward_timeout): its completions score 0, "
    "and as a thread cannot be stopped, the call is abandoned: its daemon thread runs on in the "
    "background but does not keep the process from exiting. Later abandoned calls of it are not "
    "logged."
)
_ABANDONED_LOOP = (
    "Async reward '%s' blocks its event loop (it runs blocking code without await), so it "
    "cannot be cancelled: the loop is abandoned in its daemon thread, which does not keep the "
    "process from exiting, and its next call starts a new one. Await instead, or make the "
    "reward a plain def. Later abandoned loops of it are not logged."
)


class RewardTimeout(Exception):
    """A reward call that returned nothing within its time limit."""


def is_async_reward(function: Callable) -> bool:
    """Whether calling `function` makes a coroutine: an ``async def`` function, a
    functools.partial of one, or an object whose ``__call__`` is ``async def``."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        type(function).__call__
    )


class ConcurrentCalls:
    """Runs named functions at once within one deadline; see the module docstring."""

    def __init__(self):
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}  # each async reward's own
        self._abandoned: dict[str, int] = {}  # name -> its threads or event loops left running

    def run(
        self, calls: Sequence[tuple[str, Callable, dict[str, Any]]], timeout: float | None
    ) -> list[tuple[Any, BaseException | None]]:
        """(result, None) or (None, the error) of each (name, function, keyword arguments)
        call, in order; a call still running `timeout` seconds (None: no limit) after they all
        started gets a RewardTimeout."""
        futures = [self._start(name, function, kwargs) for name, function, kwargs in calls]
        concurrent.futures.wait(futures, timeout=timeout)
        outcomes, late_coroutines = [], []
        for (name, function, _), future in zip(calls, futures):
            if future.done():
                outcomes.append(_outcome(future))
                continue
            if is_async_reward(function):
                future.cancel()  # cancels the coroutine on its loop
                late_coroutines.append(name)
            else:
                self._note_abandoned(name, _ABANDONED_THREAD, f"{timeout:g}")
            late = RewardTimeout(f"returned nothing within {timeout:g} s (train.reward_timeout)")
            outcomes.append((None, late))
        for name in self._blocked_loops(late_coroutines):
            self._abandon_loop(name)
        return outcomes

    def _start(self, name: str, function: Callable, kwargs: dict) -> concurrent.futures.Future:
        if is_async_reward(function):
            return asyncio.run_coroutine_threadsafe(
                _await_call(function, kwargs), self._event_loop(name)
            )
        future: concurrent.futures.Future = concurrent.futures.Future()
        thread = threading.Thread(
            target=_call_into, args=(future, function, kwargs), name=f"reward:{name}", daemon=True
        )
        thread.start()
        return future

    def _event_loop(self, name: str) -> asyncio.AbstractEventLoop:
        """The loop reward `name` runs on, started in a daemon thread on first use."""
        if name not in self._loops:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name=f"reward:{name}", daemon=True).start()
            self._loops[name] = loop
        return self._loops[name]

    def _blocked_loops(self, names: list[str]) -> list[str]:
        """Those of `names` whose event loop runs no callback within _LOOP_CHECK_SECONDS (a
        coroutine blocks it), all checked at once."""
        answered = {name: threading.Event() for name in names}
        for name, event in answered.items():
            self._loops[name].call_soon_threadsafe(event.set)
        deadline = time.monotonic() + _LOOP_CHECK_SECONDS
        return [
            name
            for name, event in answered.items()
            if not event.wait(max(0.0, deadline - time.monotonic()))
        ]

    def _abandon_loop(self, name: str) -> None:
        """Leave a blocked event loop to its thread; the reward's next call starts a fresh one."""
        del self._loops[name]
        self._note_abandoned(name, _ABANDONED_LOOP)

    def _note_abandoned(self, name: str, message: str, *args: Any) -> None:
        """Count a thread or loop of reward `name` left running; the first one is logged."""
        self._abandoned[name] = self._abandoned.get(name, 0) + 1
        if self._abandoned[name] == 1:
            logger.warning(message, name, *args)


def _outcome(future: concurrent.futures.Future) -> tuple[Any, BaseException | None]:
    """(result, None) or (None, error) of a finished call."""
    if future.cancelled():  # a coroutine that cancelled itself
        return None, concurrent.futures.CancelledError("the reward's coroutine was cancelled")
    error = future.exception()
    return (None, error) if error is not None else (future.result(), None)


def _call_into(future: concurrent.futures.Future, function: Callable, kwargs: dict) -> None:
    """Run `function(**kwargs)` in this thread and hand its result or error to `future`."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = function(**kwargs)
    except BaseException as error:  # SystemExit too: a reward must not end a worker silently
        future.set_exception(error)
    else:
        future.set_result(result)


async def _await_call(function: Callable, kwargs: dict) -> Any:
    return await function(**kwargs)
