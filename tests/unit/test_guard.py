"""`wal.guard.Guard`, the pure single-writer state machine, driven event by event (no Kafka).

Each scenario is a list of steps: an event fed to the guard and the exact actions expected back.
`Fail` actions are compared by the error's exact type and its attributes (see `fails`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest

from wal.errors import (
    BatchAbortedError,
    ErrorClass,
    FencedError,
    OffsetMismatchError,
    UnavailableError,
    UnknownOutcomeError,
    WalError,
    WriterFatalError,
)
from wal.guard import (
    Aborted,
    AbortTransaction,
    Action,
    Append,
    AppendResult,
    BeginAndProduce,
    CloseProducer,
    Committed,
    CommitTransaction,
    Complete,
    Delivered,
    EndOffsetRead,
    Event,
    Fail,
    Failed,
    Fence,
    Guard,
    GuardStats,
    Initialized,
    InitTransactions,
    Op,
    Phase,
    ReadEndOffset,
)

FENCED, FATAL, ABORTABLE, RETRIABLE = (
    ErrorClass.FENCED,
    ErrorClass.FATAL,
    ErrorClass.ABORTABLE,
    ErrorClass.RETRIABLE,
)
IO_ACTIONS = (InitTransactions, ReadEndOffset, BeginAndProduce, CommitTransaction, AbortTransaction)
IDLE_PHASES = {Phase.NEW, Phase.READY, Phase.NEEDS_INIT, Phase.FENCED}


# ---- expectation helpers ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FailWith:
    """Expected `Fail`: the error's exact type and the attributes that identify it."""

    error_type: type[WalError]
    attrs: tuple[tuple[str, object], ...] = ()


def fails(error_type: type[WalError], **attrs: object) -> FailWith:
    return FailWith(error_type, tuple(sorted(attrs.items())))


def _normalize(action: Action) -> object:
    if isinstance(action, Fail):
        error = action.error
        attrs = {k: getattr(error, k) for k in ("expected", "actual", "fenced") if hasattr(error, k)}
        return FailWith(type(error), tuple(sorted(attrs.items())))
    return action


def failed(op: Op, error_class: ErrorClass) -> Failed:
    return Failed(op, error_class, "injected")


def before_end_txn(error_class: ErrorClass) -> Failed:
    """A commit failure the shell knows librdkafka raised before it sent EndTxn."""
    return Failed(Op.COMMIT, error_class, "injected", before_end_txn=True)


def offsets_from(first: int, count: int) -> tuple[int, ...]:
    return tuple(range(first, first + count))


def result(first: int, count: int) -> Complete:
    """Complete of a committed batch: its offsets, and the marker takes one more (W1)."""
    return Complete(AppendResult(offsets_from(first, count), first + count + 1))


Step = tuple[Event, list[object]]

INIT = InitTransactions(fresh_producer=False)
FRESH_INIT = [CloseProducer(), InitTransactions(fresh_producer=True)]


def fence_at(end: int, *, fresh: bool = False) -> list[Step]:
    """fence() on an idle guard; the partition's end is `end`."""
    init: list[object] = list(FRESH_INIT) if fresh else [INIT]
    return [(Fence(), init), (Initialized(), [ReadEndOffset()]), (EndOffsetRead(end), [Complete(end)])]


def commit_at(first: int, count: int, expected_offset: int | None = None) -> list[Step]:
    """An append on a READY guard that knows its upcoming offset (`first`), committed."""
    start = first if expected_offset is None else expected_offset
    return [
        (Append(count, expected_offset), [BeginAndProduce(start, count)]),
        (Delivered(offsets_from(start, count)), [CommitTransaction()]),
        (Committed(), [result(start, count)]),
    ]


def produce_at(first: int, count: int) -> list[Step]:
    """An append on a READY guard with a known upcoming offset, up to the open transaction."""
    return [(Append(count), [BeginAndProduce(first, count)])]


def delivered_at(first: int, count: int) -> list[Step]:
    return [*produce_at(first, count), (Delivered(offsets_from(first, count)), [CommitTransaction()])]


def mismatch_at_10() -> list[Step]:
    """Fence at 10, append 3 records; record 1 lands at 12 instead of 11; aborted."""
    return [
        *fence_at(10),
        *produce_at(10, 3),
        (Delivered((10, 12, 13)), [AbortTransaction()]),
        (Aborted(), [fails(OffsetMismatchError, expected=11, actual=12)]),
    ]


def fenced_during_produce() -> list[Step]:
    return [
        *fence_at(10),
        *produce_at(10, 1),
        (failed(Op.PRODUCE, FENCED), [CloseProducer(), fails(FencedError)]),
    ]


def commit_unknown(retry_limit: int) -> list[Step]:
    """Commit keeps failing retriably until the bound runs out: unknown outcome (W7)."""
    retries = [(failed(Op.COMMIT, RETRIABLE), [CommitTransaction()]) for _ in range(retry_limit)]
    return [
        *fence_at(10),
        *delivered_at(10, 2),
        *retries,
        (failed(Op.COMMIT, RETRIABLE), [CloseProducer(), fails(UnknownOutcomeError, fenced=False)]),
    ]


@dataclasses.dataclass(frozen=True)
class Scenario:
    steps: list[Step]
    phase: Phase
    upcoming: int | None
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    retry_limit: int = 2


SCENARIOS = {
    # ---- happy paths ----
    "first-append-on-new-guard": Scenario(
        [
            (Append(3), [INIT]),
            (Initialized(), [ReadEndOffset()]),
            (EndOffsetRead(7), [BeginAndProduce(7, 3)]),
            (Delivered((7, 8, 9)), [CommitTransaction()]),
            (Committed(), [Complete(AppendResult((7, 8, 9), 11))]),
        ],
        Phase.READY, 11, {"commits": 1},
    ),
    "first-append-on-empty-partition": Scenario(
        [
            (Append(1), [INIT]),
            (Initialized(), [ReadEndOffset()]),
            (EndOffsetRead(0), [BeginAndProduce(0, 1)]),
            (Delivered((0,)), [CommitTransaction()]),
            (Committed(), [Complete(AppendResult((0,), 2))]),
        ],
        Phase.READY, 2, {"commits": 1},
    ),
    "second-append-starts-after-the-marker": Scenario(
        [
            (Append(3), [INIT]),
            (Initialized(), [ReadEndOffset()]),
            (EndOffsetRead(7), [BeginAndProduce(7, 3)]),
            (Delivered((7, 8, 9)), [CommitTransaction()]),
            (Committed(), [result(7, 3)]),
            *commit_at(11, 2),
        ],
        Phase.READY, 14, {"commits": 2},
    ),
    "fence-on-new-guard-returns-end": Scenario(fence_at(42), Phase.READY, 42),
    "fence-then-append-without-rereading": Scenario(
        [*fence_at(10), *commit_at(10, 2), *commit_at(13, 1)], Phase.READY, 15, {"commits": 2}
    ),
    "fence-while-ready-refences-with-fresh-producer": Scenario(
        [*fence_at(10), *commit_at(10, 1), *fence_at(20, fresh=True), *commit_at(20, 1)],
        Phase.READY, 22, {"commits": 2},
    ),
    "explicit-expected-offset-overrides-upcoming": Scenario(
        [*fence_at(10), *commit_at(10, 2, expected_offset=20)], Phase.READY, 23, {"commits": 1}
    ),
    "explicit-expected-offset-equal-to-upcoming": Scenario(
        [*fence_at(10), *commit_at(10, 2, expected_offset=10)], Phase.READY, 13, {"commits": 1}
    ),
    "explicit-expected-offset-on-new-guard": Scenario(
        [
            (Append(2, expected_offset=5), [INIT]),
            (Initialized(), [ReadEndOffset()]),
            (EndOffsetRead(3), [BeginAndProduce(5, 2)]),
            (Delivered((5, 6)), [CommitTransaction()]),
            (Committed(), [result(5, 2)]),
        ],
        Phase.READY, 8, {"commits": 1},
    ),
    "explicit-expected-offset-when-upcoming-unknown-skips-read": Scenario(
        [*mismatch_at_10(), *commit_at(14, 1, expected_offset=14)],
        Phase.READY, 16, {"commits": 1, "aborts": 1, "offset_mismatches": 1},
    ),
    # ---- W2: delivered offsets checked before commit ----
    "delivered-mismatch-aborts": Scenario(
        mismatch_at_10(), Phase.READY, None, {"aborts": 1, "offset_mismatches": 1}
    ),
    "delivered-mismatch-on-first-record": Scenario(
        [
            *fence_at(10),
            *produce_at(10, 2),
            (Delivered((11, 12)), [AbortTransaction()]),
            (Aborted(), [fails(OffsetMismatchError, expected=10, actual=11)]),
        ],
        Phase.READY, None, {"aborts": 1, "offset_mismatches": 1},
    ),
    "delivered-unknown-offset-minus-one": Scenario(
        [
            *fence_at(10),
            *produce_at(10, 2),
            (Delivered((10, -1)), [AbortTransaction()]),
            (Aborted(), [fails(OffsetMismatchError, expected=11, actual=-1)]),
        ],
        Phase.READY, None, {"aborts": 1, "offset_mismatches": 1},
    ),
    # W2 compares record i with its own expected offset: the same set of offsets in another
    # order is a mismatch (a sorted comparison would let it pass).
    "delivered-reordered-aborts": Scenario(
        [
            *fence_at(10),
            *produce_at(10, 3),
            (Delivered((10, 12, 11)), [AbortTransaction()]),
            (Aborted(), [fails(OffsetMismatchError, expected=11, actual=12)]),
        ],
        Phase.READY, None, {"aborts": 1, "offset_mismatches": 1},
    ),
    "explicit-expected-offset-mismatch": Scenario(
        [
            *fence_at(10),
            (Append(1, expected_offset=8), [BeginAndProduce(8, 1)]),
            (Delivered((10,)), [AbortTransaction()]),
            (Aborted(), [fails(OffsetMismatchError, expected=8, actual=10)]),
        ],
        Phase.READY, None, {"aborts": 1, "offset_mismatches": 1},
    ),
    "after-mismatch-next-append-rereads-end": Scenario(
        [
            *mismatch_at_10(),
            (Append(1), [ReadEndOffset()]),
            (EndOffsetRead(15), [BeginAndProduce(15, 1)]),
            (Delivered((15,)), [CommitTransaction()]),
            (Committed(), [result(15, 1)]),
        ],
        Phase.READY, 17, {"commits": 1, "aborts": 1, "offset_mismatches": 1},
    ),
    # ---- produce failures: never retried inside the transaction ----
    "produce-abortable-aborts": Scenario(
        [
            *fence_at(10),
            *produce_at(10, 2),
            (failed(Op.PRODUCE, ABORTABLE), [AbortTransaction()]),
            (Aborted(), [fails(BatchAbortedError)]),
        ],
        Phase.READY, None, {"aborts": 1},
    ),
    "produce-retriable-aborts-without-retry": Scenario(
        [
            *fence_at(10),
            *produce_at(10, 2),
            (failed(Op.PRODUCE, RETRIABLE), [AbortTransaction()]),
            (Aborted(), [fails(BatchAbortedError)]),
        ],
        Phase.READY, None, {"aborts": 1},
    ),
    "produce-fatal-closes-producer": Scenario(
        [
            *fence_at(10),
            *produce_at(10, 2),
            (failed(Op.PRODUCE, FATAL), [CloseProducer(), fails(WriterFatalError)]),
            (Append(1), FRESH_INIT),
        ],
        Phase.INITIALIZING, None,
    ),
    "produce-fenced-then-appends-fail-without-io": Scenario(
        [
            *fenced_during_produce(),
            (Append(1), [fails(FencedError)]),
            (Append(2, expected_offset=11), [fails(FencedError)]),
        ],
        Phase.FENCED, None, {"fencings": 1},
    ),
    "fence-after-fenced-reinits-fresh": Scenario(
        [*fenced_during_produce(), *fence_at(20, fresh=True), *commit_at(20, 1)],
        Phase.READY, 22, {"fencings": 1, "commits": 1},
    ),
    # ---- commit failures ----
    "commit-retriable-then-committed": Scenario(
        [
            *fence_at(10),
            *delivered_at(10, 2),
            (failed(Op.COMMIT, RETRIABLE), [CommitTransaction()]),
            (failed(Op.COMMIT, RETRIABLE), [CommitTransaction()]),
            (Committed(), [result(10, 2)]),
        ],
        Phase.READY, 13, {"commits": 1, "retries": 2},
    ),
    "commit-retriable-exhausted-unknown-outcome": Scenario(
        commit_unknown(retry_limit=2), Phase.NEEDS_INIT, None, {"unknown_outcomes": 1, "retries": 2}
    ),
    "commit-retry-limit-zero-gives-up-at-once": Scenario(
        commit_unknown(retry_limit=0), Phase.NEEDS_INIT, None, {"unknown_outcomes": 1}, retry_limit=0
    ),
    "commit-retry-limit-five": Scenario(
        commit_unknown(retry_limit=5), Phase.NEEDS_INIT, None, {"unknown_outcomes": 1, "retries": 5},
        retry_limit=5,
    ),
    "after-unknown-outcome-next-append-reinits-fresh": Scenario(
        [
            *commit_unknown(retry_limit=2),
            (Append(1), FRESH_INIT),
            (Initialized(), [ReadEndOffset()]),
            (EndOffsetRead(14), [BeginAndProduce(14, 1)]),
            (Delivered((14,)), [CommitTransaction()]),
            (Committed(), [result(14, 1)]),
        ],
        Phase.READY, 16, {"unknown_outcomes": 1, "retries": 2, "commits": 1},
    ),
    "after-unknown-outcome-fence-reinits-fresh": Scenario(
        [*commit_unknown(retry_limit=2), *fence_at(13, fresh=True)],
        Phase.READY, 13, {"unknown_outcomes": 1, "retries": 2},
    ),
    "commit-fenced-unknown-outcome-fenced": Scenario(
        [
            *fence_at(10),
            *delivered_at(10, 2),
            (failed(Op.COMMIT, FENCED), [CloseProducer(), fails(UnknownOutcomeError, fenced=True)]),
            (Append(1), [fails(FencedError)]),
        ],
        Phase.FENCED, None, {"fencings": 1, "unknown_outcomes": 1},
    ),
    "commit-fenced-after-retries": Scenario(
        [
            *fence_at(10),
            *delivered_at(10, 2),
            (failed(Op.COMMIT, RETRIABLE), [CommitTransaction()]),
            (failed(Op.COMMIT, FENCED), [CloseProducer(), fails(UnknownOutcomeError, fenced=True)]),
        ],
        Phase.FENCED, None, {"fencings": 1, "unknown_outcomes": 1, "retries": 1},
    ),
    "commit-fatal-unknown-outcome": Scenario(
        [
            *fence_at(10),
            *delivered_at(10, 2),
            (failed(Op.COMMIT, FATAL), [CloseProducer(), fails(UnknownOutcomeError, fenced=False)]),
        ],
        Phase.NEEDS_INIT, None, {"unknown_outcomes": 1},
    ),
    # Once commit_transaction was called, anything but success retires the producer, and only a
    # refusal raised before EndTxn plus a successful abort makes the failure definite.
    "commit-abortable-after-end-txn-unknown-and-retired": Scenario(
        [
            *fence_at(10),
            *delivered_at(10, 2),
            (failed(Op.COMMIT, ABORTABLE), [CloseProducer(), fails(UnknownOutcomeError, fenced=False)]),
            (Append(1), FRESH_INIT),
        ],
        Phase.INITIALIZING, None, {"unknown_outcomes": 1},
    ),
    "commit-abortable-before-end-txn-aborted-definite-and-retired": Scenario(
        [
            *fence_at(10),
            *delivered_at(10, 2),
            (before_end_txn(ABORTABLE), [AbortTransaction()]),
            (Aborted(), [CloseProducer(), fails(BatchAbortedError)]),
            (Append(1), FRESH_INIT),
        ],
        Phase.INITIALIZING, None, {"aborts": 1},
    ),
    "commit-abortable-before-end-txn-abort-fails-unknown": Scenario(
        [
            *fence_at(10),
            *delivered_at(10, 1),
            (before_end_txn(ABORTABLE), [AbortTransaction()]),
            (failed(Op.ABORT, FATAL), [CloseProducer(), fails(UnknownOutcomeError, fenced=False)]),
            (Append(1), FRESH_INIT),
        ],
        Phase.INITIALIZING, None, {"unknown_outcomes": 1},
    ),
    "commit-abortable-before-end-txn-abort-fenced-unknown-fenced": Scenario(
        [
            *fence_at(10),
            *delivered_at(10, 1),
            (before_end_txn(ABORTABLE), [AbortTransaction()]),
            (failed(Op.ABORT, FENCED), [CloseProducer(), fails(UnknownOutcomeError, fenced=True)]),
        ],
        Phase.FENCED, None, {"fencings": 1, "unknown_outcomes": 1},
    ),
    "commit-retried-then-refused-before-end-txn-still-unknown": Scenario(
        [
            *fence_at(10),
            *delivered_at(10, 1),
            (failed(Op.COMMIT, RETRIABLE), [CommitTransaction()]),  # this attempt may have sent EndTxn
            (before_end_txn(ABORTABLE), [CloseProducer(), fails(UnknownOutcomeError, fenced=False)]),
        ],
        Phase.NEEDS_INIT, None, {"unknown_outcomes": 1, "retries": 1},
    ),
    "commit-fatal-before-end-txn-still-unknown": Scenario(
        [
            *fence_at(10),
            *delivered_at(10, 1),
            (before_end_txn(FATAL), [CloseProducer(), fails(UnknownOutcomeError, fenced=False)]),
        ],
        Phase.NEEDS_INIT, None, {"unknown_outcomes": 1},
    ),
    # ---- init failures ----
    "init-retriable-then-initialized": Scenario(
        [
            (Append(1), [INIT]),
            (failed(Op.INIT, RETRIABLE), [INIT]),
            (failed(Op.INIT, RETRIABLE), [INIT]),
            (Initialized(), [ReadEndOffset()]),
            (EndOffsetRead(0), [BeginAndProduce(0, 1)]),
        ],
        Phase.APPENDING, 0, {"retries": 2},
    ),
    "init-retriable-exhausted-unavailable": Scenario(
        [
            (Append(1), [INIT]),
            (failed(Op.INIT, RETRIABLE), [INIT]),
            (failed(Op.INIT, RETRIABLE), [INIT]),
            (failed(Op.INIT, RETRIABLE), [CloseProducer(), fails(UnavailableError)]),
            (Append(1), FRESH_INIT),
        ],
        Phase.INITIALIZING, None, {"retries": 2},
    ),
    "init-fatal-writer-fatal": Scenario(
        [
            (Append(1), [INIT]),
            (failed(Op.INIT, FATAL), [CloseProducer(), fails(WriterFatalError)]),
        ],
        Phase.NEEDS_INIT, None,
    ),
    "init-abortable-unavailable": Scenario(
        [
            (Append(1), [INIT]),
            (failed(Op.INIT, ABORTABLE), [CloseProducer(), fails(UnavailableError)]),
        ],
        Phase.NEEDS_INIT, None,
    ),
    "init-fenced": Scenario(
        [
            (Fence(), [INIT]),
            (failed(Op.INIT, FENCED), [CloseProducer(), fails(FencedError)]),
            (Append(1), [fails(FencedError)]),
        ],
        Phase.FENCED, None, {"fencings": 1},
    ),
    "init-retry-on-fresh-init-reuses-producer": Scenario(
        [
            *commit_unknown(retry_limit=1),
            (Fence(), FRESH_INIT),
            (failed(Op.INIT, RETRIABLE), [INIT]),
            (Initialized(), [ReadEndOffset()]),
            (EndOffsetRead(13), [Complete(13)]),
        ],
        Phase.READY, 13, {"unknown_outcomes": 1, "retries": 2}, retry_limit=1,
    ),
    # ---- abort failures ----
    "abort-retriable-then-aborted-keeps-mismatch": Scenario(
        [
            *fence_at(10),
            *produce_at(10, 3),
            (Delivered((10, 12, 13)), [AbortTransaction()]),
            (failed(Op.ABORT, RETRIABLE), [AbortTransaction()]),
            (Aborted(), [fails(OffsetMismatchError, expected=11, actual=12)]),
        ],
        Phase.READY, None, {"aborts": 1, "offset_mismatches": 1, "retries": 1},
    ),
    "abort-fatal-closes-and-keeps-mismatch": Scenario(
        [
            *fence_at(10),
            *produce_at(10, 3),
            (Delivered((10, 12, 13)), [AbortTransaction()]),
            (failed(Op.ABORT, FATAL), [CloseProducer(), fails(OffsetMismatchError, expected=11, actual=12)]),
            (Append(1), FRESH_INIT),
        ],
        Phase.INITIALIZING, None, {"offset_mismatches": 1},
    ),
    "abort-abortable-closes-batch-aborted": Scenario(
        [
            *fence_at(10),
            *produce_at(10, 1),
            (failed(Op.PRODUCE, ABORTABLE), [AbortTransaction()]),
            (failed(Op.ABORT, ABORTABLE), [CloseProducer(), fails(BatchAbortedError)]),
        ],
        Phase.NEEDS_INIT, None,
    ),
    "abort-retriable-exhausted-closes-batch-aborted": Scenario(
        [
            *fence_at(10),
            *produce_at(10, 1),
            (failed(Op.PRODUCE, ABORTABLE), [AbortTransaction()]),
            (failed(Op.ABORT, RETRIABLE), [AbortTransaction()]),
            (failed(Op.ABORT, RETRIABLE), [AbortTransaction()]),
            (failed(Op.ABORT, RETRIABLE), [CloseProducer(), fails(BatchAbortedError)]),
        ],
        Phase.NEEDS_INIT, None, {"retries": 2},
    ),
    "abort-after-refused-commit-retriable-exhausted-unknown": Scenario(
        [
            *fence_at(10),
            *delivered_at(10, 1),
            (before_end_txn(ABORTABLE), [AbortTransaction()]),
            (failed(Op.ABORT, RETRIABLE), [AbortTransaction()]),
            (failed(Op.ABORT, RETRIABLE), [AbortTransaction()]),
            (failed(Op.ABORT, RETRIABLE), [CloseProducer(), fails(UnknownOutcomeError, fenced=False)]),
        ],
        Phase.NEEDS_INIT, None, {"retries": 2, "unknown_outcomes": 1},
    ),
    "abort-fenced": Scenario(
        [
            *fence_at(10),
            *produce_at(10, 1),
            (failed(Op.PRODUCE, ABORTABLE), [AbortTransaction()]),
            (failed(Op.ABORT, FENCED), [CloseProducer(), fails(FencedError)]),
        ],
        Phase.FENCED, None, {"fencings": 1},
    ),
    # ---- end-offset failures ----
    "end-offset-retriable-then-read": Scenario(
        [
            (Append(1), [INIT]),
            (Initialized(), [ReadEndOffset()]),
            (failed(Op.END_OFFSET, RETRIABLE), [ReadEndOffset()]),
            (EndOffsetRead(4), [BeginAndProduce(4, 1)]),
        ],
        Phase.APPENDING, 4, {"retries": 1},
    ),
    "end-offset-exhausted-unavailable-guard-stays-usable": Scenario(
        [
            (Append(1), [INIT]),
            (Initialized(), [ReadEndOffset()]),
            (failed(Op.END_OFFSET, RETRIABLE), [ReadEndOffset()]),
            (failed(Op.END_OFFSET, RETRIABLE), [ReadEndOffset()]),
            (failed(Op.END_OFFSET, RETRIABLE), [fails(UnavailableError)]),
            (Append(1), [ReadEndOffset()]),
            (EndOffsetRead(4), [BeginAndProduce(4, 1)]),
            (Delivered((4,)), [CommitTransaction()]),
            (Committed(), [result(4, 1)]),
        ],
        Phase.READY, 6, {"retries": 2, "commits": 1},
    ),
    "end-offset-fatal-unavailable-at-once": Scenario(
        [
            (Fence(), [INIT]),
            (Initialized(), [ReadEndOffset()]),
            (failed(Op.END_OFFSET, FATAL), [fails(UnavailableError)]),
        ],
        Phase.READY, None,
    ),
    "end-offset-failure-after-mismatch": Scenario(
        [
            *mismatch_at_10(),
            (Append(1), [ReadEndOffset()]),
            (failed(Op.END_OFFSET, ABORTABLE), [fails(UnavailableError)]),
        ],
        Phase.READY, None, {"aborts": 1, "offset_mismatches": 1},
    ),
    "end-offset-fenced": Scenario(
        [
            (Fence(), [INIT]),
            (Initialized(), [ReadEndOffset()]),
            (failed(Op.END_OFFSET, FENCED), [CloseProducer(), fails(FencedError)]),
        ],
        Phase.FENCED, None, {"fencings": 1},
    ),
    # ---- retry budgets are per call, not per request ----
    "retry-budget-resets-per-call": Scenario(
        [
            (Append(1), [INIT]),
            (failed(Op.INIT, RETRIABLE), [INIT]),
            (Initialized(), [ReadEndOffset()]),
            (failed(Op.END_OFFSET, RETRIABLE), [ReadEndOffset()]),
            (EndOffsetRead(0), [BeginAndProduce(0, 1)]),
            (Delivered((0,)), [CommitTransaction()]),
            (failed(Op.COMMIT, RETRIABLE), [CommitTransaction()]),
            (Committed(), [result(0, 1)]),
        ],
        Phase.READY, 2, {"retries": 3, "commits": 1}, retry_limit=1,
    ),
    "retry-budget-resets-per-request": Scenario(
        [
            *fence_at(10),
            *delivered_at(10, 1),
            (failed(Op.COMMIT, RETRIABLE), [CommitTransaction()]),
            (Committed(), [result(10, 1)]),
            *delivered_at(12, 1),
            (failed(Op.COMMIT, RETRIABLE), [CommitTransaction()]),
            (Committed(), [result(12, 1)]),
        ],
        Phase.READY, 14, {"retries": 2, "commits": 2}, retry_limit=1,
    ),
}


def _run(guard: Guard, steps: Sequence[Step]) -> None:
    for index, (event, expected) in enumerate(steps):
        actions = guard.step(event)
        got = [_normalize(a) for a in actions]
        assert got == expected, f"step {index}: {event!r}"
        terminal = bool(actions) and isinstance(actions[-1], (Complete, Fail))
        assert guard.busy is not terminal, f"step {index}: busy={guard.busy} after {actions!r}"


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_scenario(scenario: Scenario) -> None:
    guard = Guard(retry_limit=scenario.retry_limit)
    _run(guard, scenario.steps)
    assert guard.phase is scenario.phase
    assert guard.upcoming_offset == scenario.upcoming
    assert guard.stats == GuardStats(**scenario.stats)


def test_new_guard_state() -> None:
    guard = Guard()
    assert (guard.phase, guard.upcoming_offset, guard.busy, guard.retry_limit) == (Phase.NEW, None, False, 5)
    assert guard.stats == GuardStats()


def test_fence_forgets_upcoming_offset_at_once() -> None:
    guard = Guard()
    _run(guard, fence_at(10))
    assert guard.step(Fence()) == FRESH_INIT
    assert guard.upcoming_offset is None


def test_fail_error_messages_name_the_call() -> None:
    guard = Guard(retry_limit=0)
    actions = guard.step(Append(1))
    actions = guard.step(Failed(Op.INIT, RETRIABLE, "COORDINATOR_NOT_AVAILABLE: boom"))
    fail = actions[-1]
    assert isinstance(fail, Fail)
    assert "init failed: COORDINATOR_NOT_AVAILABLE: boom" in str(fail.error)


# ---- programming errors: the guard refuses events it cannot get ------------------------------

COMMITTING = [*fence_at(10), *delivered_at(10, 1)]

WRONG_PHASE = {
    "initialized-with-no-request": ([], Initialized()),
    "delivered-with-no-request": (fence_at(10), Delivered((10,))),
    "failed-with-no-request": (fence_at(10), failed(Op.COMMIT, RETRIABLE)),
    "aborted-with-no-request": (mismatch_at_10(), Aborted()),
    "end-offset-while-initializing": ([(Append(1), [INIT])], EndOffsetRead(3)),
    "delivered-while-initializing": ([(Append(1), [INIT])], Delivered((0,))),
    "initialized-while-reading-end": ([(Append(1), [INIT]), (Initialized(), [ReadEndOffset()])], Initialized()),
    "committed-while-appending": ([*fence_at(10), *produce_at(10, 1)], Committed()),
    "aborted-while-appending": ([*fence_at(10), *produce_at(10, 1)], Aborted()),
    "delivered-while-committing": (COMMITTING, Delivered((10,))),
    "aborted-while-committing": (COMMITTING, Aborted()),
    "committed-while-aborting": (mismatch_at_10()[:-1], Committed()),
    "failed-init-while-appending": ([*fence_at(10), *produce_at(10, 1)], failed(Op.INIT, RETRIABLE)),
    "failed-commit-while-appending": ([*fence_at(10), *produce_at(10, 1)], failed(Op.COMMIT, FATAL)),
    "failed-produce-while-committing": (COMMITTING, failed(Op.PRODUCE, ABORTABLE)),
    "failed-abort-while-reading-end": (
        [(Append(1), [INIT]), (Initialized(), [ReadEndOffset()])], failed(Op.ABORT, FATAL)
    ),
    "failed-end-offset-while-committing": (COMMITTING, failed(Op.END_OFFSET, RETRIABLE)),
    "delivered-wrong-count": ([*fence_at(10), *produce_at(10, 2)], Delivered((10,))),
    "delivered-too-many": ([*fence_at(10), *produce_at(10, 1)], Delivered((10, 11))),
    "negative-end-offset": ([(Append(1), [INIT]), (Initialized(), [ReadEndOffset()])], EndOffsetRead(-1)),
    # A second request while one is in progress.
    "append-while-initializing": ([(Append(1), [INIT])], Append(1)),
    "fence-while-initializing": ([(Fence(), [INIT])], Fence()),
    "append-while-appending": ([*fence_at(10), *produce_at(10, 1)], Append(1)),
    "fence-while-committing": (COMMITTING, Fence()),
    "append-while-aborting": (mismatch_at_10()[:-1], Append(1, expected_offset=3)),
}


@pytest.mark.parametrize(("prefix", "event"), WRONG_PHASE.values(), ids=WRONG_PHASE.keys())
def test_wrong_event_raises_and_changes_nothing(prefix: list[Step], event: Event) -> None:
    guard = Guard()
    _run(guard, prefix)
    before = (guard.phase, guard.upcoming_offset, guard.busy, dataclasses.replace(guard.stats))
    with pytest.raises(AssertionError):
        guard.step(event)
    assert (guard.phase, guard.upcoming_offset, guard.busy, guard.stats) == before


def test_guard_continues_after_a_refused_event() -> None:
    guard = Guard()
    _run(guard, [*fence_at(10), *produce_at(10, 2)])
    with pytest.raises(AssertionError):
        guard.step(Committed())
    with pytest.raises(AssertionError):
        guard.step(Append(1))
    _run(guard, [(Delivered((10, 11)), [CommitTransaction()]), (Committed(), [result(10, 2)])])
    assert guard.upcoming_offset == 13


INVALID_REQUESTS = {
    "append-zero-records": Append(0),
    "append-negative-count": Append(-1),
    "append-negative-expected-offset": Append(1, expected_offset=-1),
}


@pytest.mark.parametrize("request_", INVALID_REQUESTS.values(), ids=INVALID_REQUESTS.keys())
def test_invalid_append_raises(request_: Append) -> None:
    guard = Guard()
    with pytest.raises(AssertionError):
        guard.step(request_)


@pytest.mark.parametrize("request_", INVALID_REQUESTS.values(), ids=INVALID_REQUESTS.keys())
def test_invalid_append_leaves_guard_usable(request_: Append) -> None:
    guard = Guard()
    _run(guard, fence_at(10))
    with pytest.raises(AssertionError):
        guard.step(request_)
    assert not guard.busy
    assert guard.step(Append(1)) == [BeginAndProduce(10, 1)]


def test_negative_retry_limit_refused() -> None:
    with pytest.raises(AssertionError):
        Guard(retry_limit=-1)


# ---- batch bounds -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "max_records", "max_bytes", "why"),
    [
        pytest.param([], 10, 100, "a batch needs at least one record", id="empty"),
        pytest.param([1], 1, 1, None, id="one-record-at-both-limits"),
        pytest.param([0], 1, 0, None, id="zero-byte-record"),
        pytest.param([1, 1, 1], 3, 100, None, id="records-at-limit"),
        pytest.param([1, 1, 1, 1], 3, 100, "batch has 4 records, limit is 3", id="records-over-limit"),
        pytest.param([5, 5], 10, 10, None, id="bytes-at-limit"),
        pytest.param([5, 6], 10, 10, "batch has 11 payload bytes, limit is 10", id="bytes-over-limit"),
        pytest.param([11], 10, 10, "batch has 11 payload bytes, limit is 10", id="single-record-too-big"),
        pytest.param([9, 9, 9], 2, 10, "batch has 3 records, limit is 2", id="count-reported-before-bytes"),
        pytest.param((4, 4), 2, 8, None, id="tuple-of-sizes"),
    ],
)
def test_batch_out_of_bounds(sizes: Sequence[int], max_records: int, max_bytes: int, why: str | None) -> None:
    assert Guard.batch_out_of_bounds(sizes, max_records, max_bytes) == why


# ---- property: random outcomes never break the request contract --------------------------------

# Fencing is terminal until the next Fence, so it is drawn less often than the other classes.
OUTCOME_CLASSES = [FENCED, FATAL, ABORTABLE, ABORTABLE, RETRIABLE, RETRIABLE, RETRIABLE]
OP_OF = {
    InitTransactions: Op.INIT,
    ReadEndOffset: Op.END_OFFSET,
    BeginAndProduce: Op.PRODUCE,
    CommitTransaction: Op.COMMIT,
    AbortTransaction: Op.ABORT,
}


def _random_request(rng: random.Random) -> Fence | Append:
    roll = rng.random()
    if roll < 0.15:
        return Fence()
    count = rng.randint(1, 4)
    if roll < 0.35:
        return Append(count, expected_offset=rng.randint(0, 200))
    return Append(count)


def _outcome(action: Action, rng: random.Random) -> tuple[Event, bool]:
    """A random outcome for one I/O action; the flag says whether delivery mismatched."""
    if rng.random() < 0.3:
        return Failed(OP_OF[type(action)], rng.choice(OUTCOME_CLASSES), "random"), False
    if isinstance(action, InitTransactions):
        return Initialized(), False
    if isinstance(action, ReadEndOffset):
        return EndOffsetRead(rng.randint(0, 200)), False
    if isinstance(action, BeginAndProduce):
        offsets = list(offsets_from(action.first_offset, action.count))
        if rng.random() < 0.3:
            index = rng.randrange(action.count)
            offsets[index] = rng.choice([-1, offsets[index] + rng.randint(1, 3), max(0, offsets[index] - 1)])
            if offsets[index] == action.first_offset + index:
                offsets[index] += 1
            return Delivered(tuple(offsets)), True
        return Delivered(tuple(offsets)), False
    if isinstance(action, CommitTransaction):
        return Committed(), False
    assert isinstance(action, AbortTransaction)
    return Aborted(), False


def _check_shape(actions: list[Action]) -> None:
    """At most one I/O action or one Complete/Fail, always last; only CloseProducer before it."""
    assert actions, "the guard must always say what to do next"
    *init, last = actions
    assert all(isinstance(a, CloseProducer) for a in init), actions
    assert isinstance(last, (*IO_ACTIONS, Complete, Fail)), actions


def _drive_one(guard: Guard, request: Fence | Append, rng: random.Random) -> None:
    phase_before = guard.phase
    terminals: list[Action] = []
    batch: BeginAndProduce | None = None
    delivered: tuple[int, ...] | None = None
    mismatched = False
    commit_sent = False
    commit_abortable = False
    end_read: int | None = None
    io_count = 0

    actions = guard.step(request)
    for _ in range(200):
        _check_shape(actions)
        last = actions[-1]
        if isinstance(last, (Complete, Fail)):
            terminals.append(last)
            break
        io_count += 1
        if isinstance(last, BeginAndProduce):
            assert isinstance(request, Append)
            assert batch is None, "a request produces at most one batch"
            batch = last
            assert last.count == request.count
            if request.expected_offset is not None:
                assert last.first_offset == request.expected_offset
            else:  # W1: the batch starts at the known upcoming offset
                assert last.first_offset == guard.upcoming_offset
        if isinstance(last, CommitTransaction):
            assert not mismatched, "W2: commit after a mismatched delivery"
            assert delivered is not None and batch is not None
            assert delivered == offsets_from(batch.first_offset, batch.count)
            commit_sent = True
        event, bad = _outcome(last, rng)
        if isinstance(event, Delivered):
            delivered, mismatched = event.offsets, bad
        if isinstance(event, EndOffsetRead):
            end_read = event.offset
        if isinstance(event, Failed) and event.op is Op.COMMIT and event.error_class is ABORTABLE:
            commit_abortable = True
        actions = guard.step(event)
        if isinstance(event, Aborted):
            assert guard.upcoming_offset is None, "W2: after an abort the upcoming offset is unknown"
    else:
        pytest.fail(f"request {request!r} did not finish within 200 steps")

    assert len(terminals) == 1
    terminal = terminals[0]
    assert not guard.busy
    assert guard.phase in IDLE_PHASES - {Phase.NEW}
    if isinstance(terminal, Complete):
        assert guard.phase is Phase.READY
        if isinstance(request, Fence):
            assert terminal.result == end_read == guard.upcoming_offset
        else:
            assert not mismatched, "Complete for an append whose delivered offsets mismatched"
            assert batch is not None and delivered is not None
            assert isinstance(terminal.result, AppendResult)
            assert terminal.result.offsets == delivered == offsets_from(batch.first_offset, batch.count)
            assert terminal.result.upcoming_offset == delivered[-1] + 2 == guard.upcoming_offset
    else:
        assert isinstance(terminal, Fail)
        assert guard.upcoming_offset is None, "after a failure the upcoming offset is unknown"
        if mismatched and not commit_sent:
            assert isinstance(terminal.error, (OffsetMismatchError, FencedError))
        if commit_sent and not commit_abortable:
            # W7: a commit that did not answer is never reported as a definite failure.
            assert isinstance(terminal.error, UnknownOutcomeError)
        if isinstance(terminal.error, UnknownOutcomeError):
            assert commit_sent
    if phase_before is Phase.FENCED and isinstance(request, Append):
        assert io_count == 0 and isinstance(terminal, Fail) and isinstance(terminal.error, FencedError)


@pytest.mark.parametrize("seed", range(300))
def test_random_outcomes_keep_the_request_contract(seed: int) -> None:
    rng = random.Random(seed)
    guard = Guard(retry_limit=rng.randint(0, 3))
    for _ in range(rng.randint(1, 25)):
        _drive_one(guard, _random_request(rng), rng)
