"""One error hierarchy for the WAL, and the pure classification of librdkafka errors into it.

The classes follow what a caller must *do*, not where the error came from (seed 003's table and
librdkafka's `fatal` / `txn_requires_abort` / `retriable` flags):

* `WriterFatalError` / `FencedError`: stop writing this shard; another writer owns it.
* `BatchAbortedError` / `OffsetMismatchError`: the batch had no effect; retry is safe.
* `UnknownOutcomeError`: the batch may or may not be committed (W7); retry only with an
  idempotency key the reader can check.
* `UnavailableError`: the broker could not be reached within the retry bound; nothing written.
* `OffsetOutOfRangeError`: a reader's position left the log (truncated below it, or the log is
  behind it); readers never jump silently (auto.offset.reset=error).
"""

from __future__ import annotations

import enum


class WalError(Exception):
    """Base of every error `wal` raises. `retriable` says whether the same call may be repeated."""

    retriable: bool = False


class InvalidBatchError(WalError):
    """The batch breaks a documented limit (empty, too many records, too many bytes)."""


class UnavailableError(WalError):
    """A call kept failing with retriable errors until its retry bound ran out; nothing written."""

    retriable = True


class WalTimeoutError(UnavailableError):
    """A read did not reach its target offset in time (e.g. an open transaction holds the LSO)."""


class OffsetOutOfRangeError(WalError):
    """A reader's position is outside the partition's log (consumers run with
    auto.offset.reset=error, so this is never papered over by a silent jump).

    `position < log_start`: the records the reader needs were truncated (rebuild from a
    snapshot). `position > log_end`: the reader is ahead of the log (the WAL was recreated, or a
    restarted broker briefly reports a stale end): wait, then rebuild if it persists.
    """

    def __init__(self, message: str, *, position: int, log_start: int, log_end: int) -> None:
        super().__init__(message)
        self.position = position
        self.log_start = log_start
        self.log_end = log_end

    @property
    def below_start(self) -> bool:
        return self.position < self.log_start


class WriterFatalError(WalError):
    """The producer is unusable (librdkafka `fatal()`); this writer must stop writing."""


class FencedError(WriterFatalError):
    """A newer writer ran `init_transactions` on this shard's transactional id (W4)."""


class BatchAbortedError(WalError):
    """The batch's transaction was aborted: none of its records is visible to read_committed."""

    retriable = True


class OffsetMismatchError(BatchAbortedError):
    """A delivered offset differed from its expected offset (W2); the batch was aborted.

    Someone else wrote into the partition, or our idea of the upcoming offset was stale.
    The upcoming offset is unknown until it is read from the partition again.
    """

    def __init__(self, message: str, *, expected: int, actual: int) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class UnknownOutcomeError(WalError):
    """The commit's outcome is unknown (W7): anything but success once commit_transaction was
    called (a timeout, a lost connection, fenced while committing, a fatal error, a refusal after
    EndTxn may have been sent, an abort that failed), except a refusal librdkafka raised before it
    sent EndTxn followed by a successful abort, which is a `BatchAbortedError`.

    Never report this as success or failure. The producer is retired: closed, and a fresh one's
    init_transactions (which completes or aborts the transaction on the broker) runs before the
    next batch; the log itself tells the outcome to whoever replays it.
    """

    retriable = True

    def __init__(self, message: str, *, fenced: bool = False) -> None:
        super().__init__(message)
        self.fenced = fenced


class ErrorClass(enum.Enum):
    """What librdkafka's error means for the transaction in progress."""

    FENCED = "fenced"  # another producer with our transactional id exists: stop
    FATAL = "fatal"  # the producer instance is unusable: close it
    ABORTABLE = "abortable"  # the current transaction must be aborted; the producer lives on
    RETRIABLE = "retriable"  # repeat the same call, within a bound


# Error names (confluent_kafka.KafkaError.name()) that mean "a newer producer took the id",
# whatever the flags say. Seed 003: InvalidProducerEpoch is fatal for the old instance.
_FENCED_NAMES = frozenset(
    {
        "_FENCED",
        "PRODUCER_FENCED",
        "INVALID_PRODUCER_EPOCH",
        "TRANSACTIONAL_ID_AUTHORIZATION_FAILED",
    }
)

# Errors the transaction coordinator uses to say "ask again" (seed 003: NotCoordinator,
# CoordinatorNotAvailable; KIP-98: ConcurrentTransactions) plus local timeouts/transport errors.
_RETRIABLE_NAMES = frozenset(
    {
        "NOT_COORDINATOR",
        "COORDINATOR_NOT_AVAILABLE",
        "COORDINATOR_LOAD_IN_PROGRESS",
        "CONCURRENT_TRANSACTIONS",
        "REQUEST_TIMED_OUT",
        "_TIMED_OUT",
        "_TRANSPORT",
        "_ALL_BROKERS_DOWN",
        "_RESOLVE",
        "NOT_ENOUGH_REPLICAS",
        "NOT_ENOUGH_REPLICAS_AFTER_APPEND",
        "NOT_LEADER_OR_FOLLOWER",
        "LEADER_NOT_AVAILABLE",
    }
)


# How librdkafka's commit_transaction words the errors it raises *before* it sends EndTxn
# (src/rdkafka_txnmgr.c: rd_kafka_txn_require_state in the begin-commit and commit ops, the
# flush before the commit, the delivery-failure check, no PID, EndTxn not sendable). A commit
# error not recognised here is taken as raised after EndTxn may have gone out: unknown outcome.
_BEFORE_END_TXN_MESSAGES = (
    "Operation not valid in state",
    "Failed to flush all outstanding messages",
    "message(s) failed delivery",
    "No PID available",
    "Failed to send EndTxn request",
)


def raised_before_end_txn(message: str) -> bool:
    """Whether a commit_transaction error is one librdkafka raises before it sends EndTxn, so
    the commit cannot have reached the transaction coordinator. Conservative: unknown wording
    answers False (the caller then reports an unknown outcome, never a definite failure)."""
    return any(fragment in message for fragment in _BEFORE_END_TXN_MESSAGES)


def classify(name: str, *, fatal: bool, retriable: bool, txn_requires_abort: bool) -> ErrorClass:
    """Map one librdkafka error (its name and flags) to what the guard must do about it.

    Order matters: a fencing error is also flagged fatal, and an abortable error may also be
    flagged retriable; the stronger consequence wins. Unknown errors that carry no flag are
    treated as abortable: aborting is always safe for a batch that is not yet committed, and
    the guard turns an unflagged commit failure into an unknown outcome on its own.
    """
    if name in _FENCED_NAMES:
        return ErrorClass.FENCED
    if fatal:
        return ErrorClass.FATAL
    if txn_requires_abort:
        return ErrorClass.ABORTABLE
    if retriable or name in _RETRIABLE_NAMES:
        return ErrorClass.RETRIABLE
    return ErrorClass.ABORTABLE
