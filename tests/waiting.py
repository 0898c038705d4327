"""Bounded waiting for tests: poll a condition instead of sleeping a guessed time.

`wait_until` is the one way a test waits for something to happen: it returns as soon as the
condition holds (fast on an idle machine) and fails with what it saw last (clear on a loaded
one). `holds_for` is the opposite check, for the few tests whose point is that something does
*not* happen for a while (a member that stepped aside gets nothing back, a replica does not jump
over a gap): it watches the condition over the whole window and fails at the first violation.
Both have an async twin for tests that drive an event loop (a blocking sleep would stall it).

A predicate may raise: any exception but AssertionError counts as "not yet" and is reported if
the wait times out (a node not answering yet, a file not written yet); `NotYet(detail)` is the
way to say why not in a predicate whose falsy value would say nothing ("replicas differ: ...").
An AssertionError inside a predicate fails the wait at once: use it for "this must not happen
while waiting" (the process under test died).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_INTERVAL_S = 0.05
_MAX_REPR = 2_000


def _shown(value: object) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _MAX_REPR else text[:_MAX_REPR] + f"... ({len(text)} characters)"


class NotYet(Exception):
    """Raised by a predicate to say why the condition does not hold yet; shown on a timeout."""


class _Poll:
    """The bookkeeping both twins share: the deadline, the attempts, and the last thing seen."""

    def __init__(self, timeout_s: float, interval_s: float, what: str) -> None:
        if timeout_s <= 0 or interval_s <= 0:
            raise ValueError(f"timeout_s and interval_s must be positive, not {timeout_s} and {interval_s}")
        self.what = what
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.attempts = 0
        self.last: str = "nothing (never evaluated)"

    def evaluate(self, predicate: Callable[[], T]) -> T | None:
        """The predicate's value, or None if it raised (anything but AssertionError)."""
        self.attempts += 1
        try:
            value = predicate()
        except AssertionError:
            raise
        except NotYet as exc:
            self.last = f"not yet: {_shown(exc.args[0]) if len(exc.args) == 1 else _shown(exc.args)}"
            return None
        except Exception as exc:
            self.last = f"exception {_shown(repr(exc))}"
            return None
        self.last = f"value {_shown(repr(value))}"
        return value

    def pause_s(self) -> float | None:
        """How long to sleep before the next attempt; None once the deadline has passed."""
        remaining = self.deadline - time.monotonic()
        return None if remaining <= 0 else min(self.interval_s, remaining)

    def timed_out(self) -> AssertionError:
        waited = time.monotonic() - self.started
        return AssertionError(f"timed out waiting for {self.what}: waited {waited:.1f}s (timeout {self.timeout_s:g}s, "
                              f"{self.attempts} attempts); last seen: {self.last}")


def wait_until(predicate: Callable[[], T], timeout_s: float, *, interval_s: float = DEFAULT_INTERVAL_S,
               what: str = "the condition") -> T:
    """Call `predicate` every `interval_s` until it returns something truthy, and return that.

    Raises AssertionError after `timeout_s` naming `what`, how long it waited and the last value
    (or exception) the predicate gave. The predicate is always evaluated at least once, and once
    more when the deadline is reached."""
    poll = _Poll(timeout_s, interval_s, what)
    while True:
        value = poll.evaluate(predicate)
        if value:
            return value
        pause = poll.pause_s()
        if pause is None:
            raise poll.timed_out()
        time.sleep(pause)


async def wait_until_async(predicate: Callable[[], T], timeout_s: float, *, interval_s: float = DEFAULT_INTERVAL_S,
                           what: str = "the condition") -> T:
    """`wait_until` for a coroutine: sleeps with asyncio, so the loop under test keeps running."""
    poll = _Poll(timeout_s, interval_s, what)
    while True:
        value = poll.evaluate(predicate)
        if value:
            return value
        pause = poll.pause_s()
        if pause is None:
            raise poll.timed_out()
        await asyncio.sleep(pause)


def _violated(poll: _Poll) -> AssertionError:
    held = time.monotonic() - poll.started
    return AssertionError(f"{poll.what} stopped holding after {held:.1f}s of the {poll.timeout_s:g}s it must hold "
                          f"({poll.attempts} checks); seen: {poll.last}")


def holds_for(predicate: Callable[[], object], duration_s: float, *, interval_s: float = DEFAULT_INTERVAL_S,
              what: str = "the condition") -> None:
    """Check `predicate` every `interval_s` for `duration_s`; AssertionError at the first falsy
    value or exception. Time-based by nature (an absence can only be watched over a window): use
    it only where "nothing happens for N seconds" is what the test asserts."""
    poll = _Poll(duration_s, interval_s, what)
    while True:
        if not poll.evaluate(predicate):
            raise _violated(poll)
        pause = poll.pause_s()
        if pause is None:
            return
        time.sleep(pause)


async def holds_for_async(predicate: Callable[[], object], duration_s: float, *,
                          interval_s: float = DEFAULT_INTERVAL_S, what: str = "the condition") -> None:
    """`holds_for` for a coroutine."""
    poll = _Poll(duration_s, interval_s, what)
    while True:
        if not poll.evaluate(predicate):
            raise _violated(poll)
        pause = poll.pause_s()
        if pause is None:
            return
        await asyncio.sleep(pause)
