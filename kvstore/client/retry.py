"""The client's retry policy, pure: what to do after a failed attempt, how long to wait, and what
a call that gives up reports. The loop that applies it (`Client._attempts`) only executes it.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import time
from collections.abc import Sequence

import grpc

from kvstore.client.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KvError,
    NotLeader,
    Overloaded,
    RequestExpired,
    TxnAborted,
    TxnConflict,
    Unavailable,
    UnknownOutcome,
    Unreachable,
)

DEFAULT_MAX_BACKOFF_S = 1.0
# A healthy node answers well within this (a commit takes milliseconds; a takeover answers
# UNAVAILABLE at once). Longer means it is paused or cut off: try another one.
DEFAULT_ATTEMPT_TIMEOUT_S = 5.0
_JITTER = random.Random()


class RetryAction(enum.Enum):
    """What the retry loop does after an attempt failed."""

    FAIL = "fail"  # raise now: retrying cannot help (or could do harm)
    REDIRECT = "redirect"  # go to the leader hint at once
    REROUTE = "reroute"  # refresh the shard map, try the next endpoint, back off
    BACKOFF = "backoff"  # same target, after a backoff


def retry_action(error: KvError) -> RetryAction:
    """Classify a failed attempt. Pure: the retry policy in one place, table-tested."""
    if isinstance(error, NotLeader):
        return RetryAction.REDIRECT if error.leader_hint else RetryAction.REROUTE
    if isinstance(error, Unavailable | UnknownOutcome):
        # An unknown outcome usually means the leader lost its shard (or its connection)
        # mid-commit: look again. The retry carries the same request id.
        return RetryAction.REROUTE
    if isinstance(error, Overloaded | TxnConflict):
        return RetryAction.BACKOFF
    return RetryAction.FAIL


def check_client_options(endpoints: Sequence[str] | str, *, timeout_s: float, max_attempts: int, backoff_s: float,
                         max_backoff_s: float, max_channels: int, attempt_timeout_s: float) -> tuple[str, ...]:
    """A client's settings checked (either client's), and its seed endpoints: "a:1,b:2" or a
    list, stripped, duplicates dropped."""
    if isinstance(endpoints, str):  # a str is a Sequence[str] of characters: accept "a:1,b:2"
        endpoints = endpoints.split(",")
    seeds = tuple(dict.fromkeys(e.strip() for e in endpoints if e.strip()))
    if not seeds:
        raise InvalidArgument("at least one endpoint is needed")
    if timeout_s <= 0 or max_attempts < 1 or backoff_s < 0 or max_backoff_s < 0 or max_channels < 1:
        raise InvalidArgument("timeout_s must be > 0, max_attempts and max_channels >= 1, backoffs >= 0")
    if attempt_timeout_s <= 0:
        raise InvalidArgument(f"attempt_timeout_s must be > 0: {attempt_timeout_s}")
    return seeds


def deadline_of(timeout_s: float | None, default_s: float) -> float:
    """The monotonic deadline of a call given `timeout_s` (None: the client's `default_s`)."""
    t = default_s if timeout_s is None else timeout_s
    if t <= 0:
        raise InvalidArgument(f"timeout must be positive: {t}")
    return time.monotonic() + t


def capped_attempt_error(error: KvError, *, capped: bool, attempt_timeout_s: float) -> KvError:
    """An attempt cut by the client's own per-attempt cap (`capped`: the cap was shorter than the
    call's deadline), not by the caller's deadline: the node is not answering. A write may have
    committed there (W7), so it is an unknown outcome, retried elsewhere with the same id."""
    if capped and error.code == grpc.StatusCode.DEADLINE_EXCEEDED and isinstance(error, DeadlineExceeded
                                                                                     | UnknownOutcome):
        return UnknownOutcome(f"{error.target} did not answer within {attempt_timeout_s}s",
                              code=grpc.StatusCode.DEADLINE_EXCEEDED, target=error.target,
                              request_id=error.request_id)
    return error


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Delay before attempt `attempt + 1`: exponential, capped, with "equal jitter".

    Half of the delay is fixed so retries still spread out in time; the other half is random so
    clients that failed together do not come back together.
    """
    ceiling = min(cap_s, base_s * 2.0 ** max(0, attempt - 1))
    half = ceiling / 2
    return half + (rng or _JITTER).uniform(0.0, half)


def keep_unknown(error: KvError, unknown: UnknownOutcome | None, *, write: bool = False) -> KvError:
    """W7 for the caller: once an attempt's outcome was unknown, a later "nothing was done"
    (unavailable, not leader, overloaded, invalid, a deadline, ...) says nothing about that
    attempt, so the call as a whole still has an unknown outcome and must not look like a clean
    failure. `RequestExpired` already says the outcome is unknown (and that retrying is futile):
    it is kept. So is `TxnAborted`: the request's recorded outcome, which no earlier attempt can
    change any more. Reads keep their older rule, which also let InvalidArgument and DeadlineExceeded
    through (a read has no outcome to hide)."""
    if unknown is None or isinstance(error, UnknownOutcome | RequestExpired | TxnAborted):
        return error
    if not write and isinstance(error, InvalidArgument | DeadlineExceeded):
        return error
    return UnknownOutcome(
        f"{unknown.message}; the retries then failed: {error.message}",
        code=unknown.code, metadata=unknown.metadata, target=unknown.target, request_id=error.request_id,
        attempts=error.attempts,
    )


@dataclasses.dataclass
class AttemptLog:
    """What a call's failed attempts add up to, pure, shared by the synchronous and the asyncio
    client's retry loops (they only execute it): which attempt's outcome is unknown (W7), whether
    any attempt reached a server, and the one error the call raises when it gives up.

    A call none of whose attempts reached a server (every one `Unreachable`) ends `Unreachable`, a
    definite failure; one with an unknown attempt ends `UnknownOutcome` whatever came after."""

    write: bool
    request_id: str | None = None
    attempts: int = 0
    last: KvError | None = None
    unknown: UnknownOutcome | None = None  # an earlier attempt may have committed (W7)
    reached: bool = False  # some attempt got past gRPC's connect: a server may have seen it

    def started(self) -> int:
        """Count an attempt about to be sent; its number (1-based)."""
        self.attempts += 1
        return self.attempts

    def failed(self, error: KvError) -> RetryAction:
        """Record the attempt's error; what the loop does next."""
        if not isinstance(error, Unreachable):
            self.reached = True
        if isinstance(error, UnknownOutcome):
            self.unknown = error
        self.last = error
        return retry_action(error)

    def raised(self, error: KvError) -> KvError:
        """The error to raise at once (a FAIL action, or the client closed under the call)."""
        error.attempts = max(self.attempts, 1)
        return keep_unknown(error, self.unknown, write=self.write)

    def gave_up(self, *, deadline_passed: bool) -> KvError:
        """The error to raise when the attempts or the deadline ran out."""
        last = self.last
        attempts = max(self.attempts, 1)
        if last is None:
            return DeadlineExceeded("deadline exceeded before any attempt", request_id=self.request_id)
        if self.write and self.unknown is not None and deadline_passed:
            # W7: the deadline ends the retries, not the uncertainty of the unknown attempt.
            unknown = self.unknown
            then = "" if last is unknown else f"; the retries then failed: {last.message}"
            return UnknownOutcome(f"deadline exceeded, outcome unknown: {unknown.message}{then}", code=unknown.code,
                                  metadata=unknown.metadata, target=unknown.target, request_id=self.request_id,
                                  attempts=attempts)
        if not self.reached and self.unknown is None:
            ended = " before the deadline" if deadline_passed else ""
            return Unreachable(f"no node reached{ended}, nothing was sent: {last.message}",
                               code=grpc.StatusCode.UNAVAILABLE, target=last.target, request_id=self.request_id,
                               attempts=attempts)
        if deadline_passed:
            return DeadlineExceeded(f"deadline exceeded; last error: {last.message}",
                                    code=grpc.StatusCode.DEADLINE_EXCEEDED, target=last.target,
                                    request_id=self.request_id, attempts=attempts)
        if isinstance(last, Unreachable):  # the last attempt did not connect, an earlier one reached a server
            last = Unavailable(last.message, code=last.code, metadata=last.metadata, target=last.target,
                               request_id=self.request_id, details=last.details)
        last.attempts = attempts
        return keep_unknown(last, self.unknown, write=self.write)
