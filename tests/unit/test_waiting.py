"""The tests' waiting helpers: bounded, fast when the condition holds, explicit when it does not."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from tests.waiting import NotYet, holds_for, holds_for_async, wait_until, wait_until_async


def test_wait_until_returns_the_first_truthy_value() -> None:
    values = iter([0, None, "", [], {"leader": "n2"}])
    assert wait_until(lambda: next(values), 5, interval_s=0.001) == {"leader": "n2"}


def test_wait_until_does_not_sleep_when_the_condition_already_holds() -> None:
    started = time.monotonic()
    assert wait_until(lambda: 42, 5, interval_s=1) == 42
    assert time.monotonic() - started < 0.5


def test_wait_until_times_out_saying_what_how_long_and_the_last_value() -> None:
    count = itertools.count()
    started = time.monotonic()
    with pytest.raises(AssertionError) as info:
        wait_until(lambda: next(count) < 0 and "never", 0.2, interval_s=0.02, what="the leader to settle")
    assert 0.2 <= time.monotonic() - started < 2
    text = str(info.value)
    assert text.startswith("timed out waiting for the leader to settle: waited 0.")
    assert "(timeout 0.2s," in text and "last seen: value False" in text


def test_wait_until_reports_the_last_exception_and_retries_after_one() -> None:
    def failing() -> bool:
        raise ConnectionError("node not listening yet")

    with pytest.raises(AssertionError, match=r"last seen: exception ConnectionError\('node not listening yet'\)"):
        wait_until(failing, 0.1, interval_s=0.01)
    attempts = iter([ConnectionError("not yet"), "up"])

    def flaky() -> str:
        item = next(attempts)
        if isinstance(item, Exception):
            raise item
        return item

    assert wait_until(flaky, 5, interval_s=0.001) == "up"


def test_not_yet_says_why_the_condition_does_not_hold() -> None:
    def agreed() -> bool:
        raise NotYet({"a": (12, "d1"), "b": (10, "d0")})

    with pytest.raises(AssertionError, match=r"last seen: not yet: \{'a': \(12, 'd1'\), 'b': \(10, 'd0'\)\}$"):
        wait_until(agreed, 0.05, what="replicas to agree")


def test_an_assertion_inside_the_predicate_fails_at_once() -> None:
    def process_died() -> bool:
        raise AssertionError("store exited with 1")

    started = time.monotonic()
    with pytest.raises(AssertionError, match="store exited with 1"):
        wait_until(process_died, 30)
    assert time.monotonic() - started < 1


class _NotYet:
    """Falsy, with a long repr: a shard map that is not settled yet, say."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "ShardMap(" + "x" * 10_000 + ")"


def test_the_last_value_shown_is_cut_to_a_readable_length() -> None:
    with pytest.raises(AssertionError) as info:
        wait_until(_NotYet, 0.05)
    text = str(info.value)
    assert "last seen: value ShardMap(xxx" in text and "... (10010 characters)" in text and len(text) < 2_500


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        wait_until(lambda: True, 0)
    with pytest.raises(ValueError):
        holds_for(lambda: True, 1, interval_s=0)


def test_holds_for_watches_the_whole_window() -> None:
    started = time.monotonic()
    holds_for(lambda: True, 0.2, interval_s=0.02)
    assert time.monotonic() - started >= 0.2


def test_holds_for_fails_at_the_first_violation() -> None:
    values = iter([True, True, 0, True])
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"a stays out stopped holding after .*seen: value 0"):
        holds_for(lambda: next(values), 30, interval_s=0.01, what="a stays out")
    assert time.monotonic() - started < 1


def test_async_twins_let_the_loop_run() -> None:
    async def scenario() -> None:
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, done.set)
        assert await wait_until_async(done.is_set, 5, what="the timer") is True
        with pytest.raises(AssertionError, match="timed out waiting for never"):
            await wait_until_async(lambda: False, 0.05, what="never")
        await holds_for_async(done.is_set, 0.05)
        later = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, later.set)
        with pytest.raises(AssertionError, match="stopped holding"):
            await holds_for_async(lambda: not later.is_set(), 5)

    asyncio.run(scenario())
