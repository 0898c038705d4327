"""The single-writer guard as a pure state machine: events in, actions out, no I/O.

This is KIP-27's conditional publish emulated with a Kafka transaction (docs/design.md §4). The
machine decides; `wal.writer.ShardWriter` performs the actions against librdkafka and feeds
back what happened. Because it is pure, every transition is tested without a broker
(tests/unit/test_guard.py) and the same code runs against a real one.

Life of one append, in the happy path::

    Append(n) -> [BeginAndProduce(k, n)]        k = upcoming offset (W1)
    Delivered(k..k+n-1) -> [CommitTransaction]  every offset checked first (W2)
    Committed -> [Complete(AppendResult)]       upcoming offset becomes k+n+1 (marker)

Every external call that fails with a retriable error is repeated at most `retry_limit` times.
Every request ends with exactly one `Complete` or `Fail` action.

Once `commit_transaction` was called, anything but success retires the producer (closed, and
`init_transactions` on a fresh one before the next batch): a commit or abort of this producer
that is still under way must never land on a later transaction (docs/design.md §4.2, the KIP-890 gap).
Such a batch is reported as definitely aborted only if the commit failed before librdkafka sent
EndTxn *and* the abort succeeded; otherwise its outcome is unknown (W7).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

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
from wal.offsets import marker_slot, upcoming_after


class Phase(enum.Enum):
    NEW = "new"  # no producer yet
    INITIALIZING = "initializing"  # init_transactions in flight (fences older writers, W4)
    READING_END = "reading_end"  # asking the partition for its end offset
    READY = "ready"  # idle; upcoming offset known or not
    APPENDING = "appending"  # transaction open, records produced, waiting for delivery
    COMMITTING = "committing"  # commit_transaction in flight
    ABORTING = "aborting"  # abort_transaction in flight
    NEEDS_INIT = "needs_init"  # outcome of the last call unknown or producer broken: re-init first
    FENCED = "fenced"  # a newer writer holds the shard; terminal until an explicit fence()


class Op(enum.Enum):
    """The external call an event reports on."""

    INIT = "init"
    END_OFFSET = "end_offset"
    PRODUCE = "produce"
    COMMIT = "commit"
    ABORT = "abort"


# ---- events (what happened) -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fence:
    """The caller takes the shard: fence older writers, then learn the upcoming offset."""


@dataclasses.dataclass(frozen=True)
class Append:
    """The caller asks to append `count` records, optionally at an offset it dictates."""

    count: int
    expected_offset: int | None = None


@dataclasses.dataclass(frozen=True)
class Initialized:
    pass


@dataclasses.dataclass(frozen=True)
class EndOffsetRead:
    offset: int


@dataclasses.dataclass(frozen=True)
class Delivered:
    offsets: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Committed:
    pass


@dataclasses.dataclass(frozen=True)
class Aborted:
    pass


@dataclasses.dataclass(frozen=True)
class Failed:
    """An external call failed. `before_end_txn` (commit only): the shell knows the error was
    raised before librdkafka sent EndTxn, so the commit cannot have reached the coordinator."""

    op: Op
    error_class: ErrorClass
    reason: str
    before_end_txn: bool = False


Event = Fence | Append | Initialized | EndOffsetRead | Delivered | Committed | Aborted | Failed

# ---- actions (what the shell must do) ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InitTransactions:
    """Run init_transactions; `fresh_producer` asks for a new producer instance first."""

    fresh_producer: bool


@dataclasses.dataclass(frozen=True)
class ReadEndOffset:
    """Read the partition's high watermark (read_uncommitted end), never the LSO (docs/design.md §5)."""


@dataclasses.dataclass(frozen=True)
class BeginAndProduce:
    """begin_transaction, produce records stamped first_offset.., flush, report deliveries."""

    first_offset: int
    count: int


@dataclasses.dataclass(frozen=True)
class CommitTransaction:
    pass


@dataclasses.dataclass(frozen=True)
class AbortTransaction:
    pass


@dataclasses.dataclass(frozen=True)
class CloseProducer:
    """Drop the producer instance: it is fenced, fatal, or its last call's outcome is unknown."""


@dataclasses.dataclass(frozen=True)
class AppendResult:
    offsets: tuple[int, ...]
    upcoming_offset: int

    @property
    def marker_slot(self) -> int:
        """Where this batch's commit marker went: assumed from the last record, never read."""
        return marker_slot(self.offsets[-1])


@dataclasses.dataclass(frozen=True)
class Complete:
    """The request succeeded. For Fence the result is the upcoming offset; for Append an AppendResult."""

    result: int | AppendResult


@dataclasses.dataclass(frozen=True)
class Fail:
    error: WalError


Action = (
    InitTransactions
    | ReadEndOffset
    | BeginAndProduce
    | CommitTransaction
    | AbortTransaction
    | CloseProducer
    | Complete
    | Fail
)


@dataclasses.dataclass
class GuardStats:
    """Counters the shell exports as metrics."""

    commits: int = 0
    aborts: int = 0
    offset_mismatches: int = 0
    fencings: int = 0
    unknown_outcomes: int = 0
    retries: int = 0


class Guard:
    """Conditional-publish guard for one shard. Not thread-safe: one request at a time."""

    def __init__(self, retry_limit: int = 5) -> None:
        assert retry_limit >= 0, "retry_limit must be >= 0"
        self.retry_limit = retry_limit
        self.phase = Phase.NEW
        self.upcoming_offset: int | None = None
        self.stats = GuardStats()
        self._attempts = 0
        self._request: Fence | Append | None = None
        self._batch: BeginAndProduce | None = None
        self._abort_error: WalError | None = None
        # commit_transaction was called for the batch in progress: from then on only success
        # keeps the producer (see the module docstring).
        self._delivered: tuple[int, ...] = ()
        self._commit_called = False
        # A commit attempt of this batch may have sent EndTxn (any commit failure not known to
        # be raised before it): no abort can make the outcome definite any more.
        self._end_txn_maybe_sent = False

    @property
    def busy(self) -> bool:
        return self._request is not None

    def step(self, event: Event) -> list[Action]:
        """Feed one event; return what the shell must do next, in order."""
        if isinstance(event, (Fence, Append)):
            return self._on_request(event)
        assert self._request is not None, f"{event!r} arrived with no request in progress"
        if isinstance(event, Failed):
            return self._on_failed(event)
        if isinstance(event, Initialized):
            self._expect(Phase.INITIALIZING, event)
            return self._read_end()
        if isinstance(event, EndOffsetRead):
            self._expect(Phase.READING_END, event)
            assert event.offset >= 0, f"negative end offset {event.offset}"
            self.upcoming_offset = event.offset
            if isinstance(self._request, Fence):
                return self._complete(event.offset)
            return self._produce(event.offset)
        if isinstance(event, Delivered):
            return self._on_delivered(event)
        if isinstance(event, Committed):
            self._expect(Phase.COMMITTING, event)
            assert self._batch is not None
            offsets = self._delivered  # where the records landed, each checked against its own slot (W2)
            assert offsets == tuple(range(self._batch.first_offset, self._batch.first_offset + self._batch.count))
            self.upcoming_offset = upcoming_after(offsets[-1])  # W1: records, then the marker
            self.stats.commits += 1
            return self._complete(AppendResult(offsets, self.upcoming_offset))
        if isinstance(event, Aborted):
            self._expect(Phase.ABORTING, event)
            self.stats.aborts += 1
            self.upcoming_offset = None  # W2: after any abort the upcoming offset is unknown
            error = self._abort_error or BatchAbortedError("batch aborted")
            if self._commit_called:
                # Definite: the commit never left librdkafka and the abort succeeded. The
                # producer is retired all the same (module docstring).
                assert not self._end_txn_maybe_sent, "an abort after EndTxn may have been sent"
                return [CloseProducer(), *self._fail(error, Phase.NEEDS_INIT)]
            return self._fail(error, Phase.READY)
        raise AssertionError(f"unknown event {event!r}")

    # ---- requests --------------------------------------------------------------------------

    def _on_request(self, event: Fence | Append) -> list[Action]:
        assert self._request is None, f"{event!r} while {self._request!r} is in progress"
        if isinstance(event, Append):  # refuse before taking the request: the guard stays usable
            assert event.count > 0, "an append needs at least one record"
            assert event.expected_offset is None or event.expected_offset >= 0, (
                f"negative expected offset {event.expected_offset}"
            )
        self._request = event
        self._attempts = 0
        if isinstance(event, Fence):
            self.upcoming_offset = None
            return self._init(fresh=self.phase is not Phase.NEW)
        if self.phase is Phase.FENCED:
            return self._fail(FencedError("this writer was fenced by a newer writer"), Phase.FENCED)
        if self.phase in (Phase.NEW, Phase.NEEDS_INIT):
            return self._init(fresh=self.phase is Phase.NEEDS_INIT)
        self._expect(Phase.READY, event)
        if event.expected_offset is not None:
            return self._produce(event.expected_offset)
        if self.upcoming_offset is None:
            return self._read_end()
        return self._produce(self.upcoming_offset)

    def _init(self, *, fresh: bool) -> list[Action]:
        self.phase = Phase.INITIALIZING
        actions: list[Action] = [CloseProducer()] if fresh else []
        return [*actions, InitTransactions(fresh_producer=fresh)]

    def _read_end(self) -> list[Action]:
        self.phase = Phase.READING_END
        self._attempts = 0
        return [ReadEndOffset()]

    def _produce(self, first_offset: int) -> list[Action]:
        assert isinstance(self._request, Append)
        request = self._request
        first = request.expected_offset if request.expected_offset is not None else first_offset
        self._batch = BeginAndProduce(first_offset=first, count=request.count)
        self.phase = Phase.APPENDING
        return [self._batch]

    # ---- outcomes --------------------------------------------------------------------------

    def _on_delivered(self, event: Delivered) -> list[Action]:
        self._expect(Phase.APPENDING, event)
        batch = self._batch
        assert batch is not None
        assert len(event.offsets) == batch.count, (
            f"{len(event.offsets)} delivery reports for a batch of {batch.count}"
        )
        for index, actual in enumerate(event.offsets):
            expected = batch.first_offset + index
            if actual != expected:
                # W2: refuse the whole batch, exactly as KIP-27's broker would have.
                self.stats.offset_mismatches += 1
                message = f"record {index} landed at offset {actual}, expected {expected}"
                return self._abort(OffsetMismatchError(message, expected=expected, actual=actual))
        self.phase = Phase.COMMITTING
        self._attempts = 0
        self._delivered = event.offsets
        self._commit_called = True
        return [CommitTransaction()]

    def _abort(self, error: WalError) -> list[Action]:
        self._abort_error = error
        self.phase = Phase.ABORTING
        self._attempts = 0
        return [AbortTransaction()]

    def _on_failed(self, event: Failed) -> list[Action]:
        expected_phase = {
            Op.INIT: Phase.INITIALIZING,
            Op.END_OFFSET: Phase.READING_END,
            Op.PRODUCE: Phase.APPENDING,
            Op.COMMIT: Phase.COMMITTING,
            Op.ABORT: Phase.ABORTING,
        }[event.op]
        self._expect(expected_phase, event)
        why = f"{event.op.value} failed: {event.reason}"
        if event.op is Op.COMMIT and not event.before_end_txn:
            self._end_txn_maybe_sent = True
        if event.error_class is ErrorClass.FENCED:
            self.stats.fencings += 1
            self.upcoming_offset = None
            error: WalError
            if self._commit_called:
                # Fenced while committing, or while aborting after a failed commit: the new
                # writer's init_transactions either completed our commit or aborted it.
                # The new writer's init_transactions either completed our commit or aborted it.
                self.stats.unknown_outcomes += 1
                error = UnknownOutcomeError(f"fenced while committing: {why}", fenced=True)
            else:
                error = FencedError(why)
            return [CloseProducer(), *self._fail(error, Phase.FENCED)]
        # A produce cannot be repeated inside its transaction: any produce failure aborts.
        retriable = event.error_class is ErrorClass.RETRIABLE and event.op is not Op.PRODUCE
        if retriable and self._attempts < self.retry_limit:
            self._attempts += 1
            self.stats.retries += 1
            return [self._retry_action(event.op)]
        return self._give_up(event, why)

    def _retry_action(self, op: Op) -> Action:
        if op is Op.INIT:
            # librdkafka lets init_transactions be resumed on the same instance after a timeout.
            return InitTransactions(fresh_producer=False)
        if op is Op.END_OFFSET:
            return ReadEndOffset()
        if op is Op.COMMIT:
            return CommitTransaction()
        assert op is Op.ABORT, f"{op} is never retried in place"
        return AbortTransaction()

    def _give_up(self, event: Failed, why: str) -> list[Action]:
        """Non-retriable failure, or the retry bound ran out."""
        op, cls = event.op, event.error_class
        fatal = cls is ErrorClass.FATAL
        if op is Op.INIT:
            self.upcoming_offset = None
            error: WalError = WriterFatalError(why) if fatal else UnavailableError(why)
            return [CloseProducer(), *self._fail(error, Phase.NEEDS_INIT)]
        if op is Op.END_OFFSET:
            return self._fail(UnavailableError(why), Phase.READY)
        if op is Op.PRODUCE:
            if fatal:
                self.upcoming_offset = None
                return [CloseProducer(), *self._fail(WriterFatalError(why), Phase.NEEDS_INIT)]
            return self._abort(BatchAbortedError(why))
        if op is Op.COMMIT:
            if cls is ErrorClass.ABORTABLE and not self._end_txn_maybe_sent:
                # librdkafka refused to commit before sending EndTxn: the transaction must and
                # will be aborted; the batch is definitely not committed once the abort succeeds.
                return self._abort(BatchAbortedError(why))
            # Fatal, retries exhausted, or refused after EndTxn may have gone out: nobody can say
            # whether EndTxn(commit) took effect (W7). The fresh producer's init_transactions
            # settles it on the broker; the log tells whoever replays it.
            return self._unknown(why)
        assert op is Op.ABORT
        if self._commit_called:
            # The abort that was to make a refused commit definite failed: W7, unknown.
            return self._unknown(f"{why} (aborting after a failed commit)")
        # We never asked to commit, so the batch is not committed: the broker aborts the open
        # transaction at transaction.timeout.ms or when the next init_transactions fences it.
        self.upcoming_offset = None
        error = self._abort_error or BatchAbortedError(why)
        return [CloseProducer(), *self._fail(error, Phase.NEEDS_INIT)]

    def _unknown(self, why: str) -> list[Action]:
        self.upcoming_offset = None
        self.stats.unknown_outcomes += 1
        return [CloseProducer(), *self._fail(UnknownOutcomeError(why), Phase.NEEDS_INIT)]

    def _complete(self, result: int | AppendResult) -> list[Action]:
        self.phase = Phase.READY
        self._finish()
        return [Complete(result)]

    def _fail(self, error: WalError, phase: Phase) -> list[Action]:
        self.phase = phase
        self._finish()
        return [Fail(error)]

    def _finish(self) -> None:
        self._request = None
        self._batch = None
        self._abort_error = None
        self._attempts = 0
        self._delivered = ()
        self._commit_called = False
        self._end_txn_maybe_sent = False

    def _expect(self, phase: Phase, event: object) -> None:
        assert self.phase is phase, f"{event!r} arrived in phase {self.phase.value}, expected {phase.value}"

    @staticmethod
    def batch_out_of_bounds(sizes: Sequence[int], max_records: int, max_bytes: int) -> str | None:
        """Why a batch breaks its bounds, or None. Kept here so the rule is testable without I/O."""
        if not sizes:
            return "a batch needs at least one record"
        if len(sizes) > max_records:
            return f"batch has {len(sizes)} records, limit is {max_records}"
        total = sum(sizes)
        if total > max_bytes:
            return f"batch has {total} payload bytes, limit is {max_bytes}"
        return None
