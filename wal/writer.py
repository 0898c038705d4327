"""The shard writer: a thin librdkafka shell around the pure `Guard`.

It performs the guard's actions (init_transactions, watermark query, produce, commit, abort)
and feeds their outcomes back as events. All decisions (W1, W2, W4, retries, what an error
means) are the guard's; this module only translates between librdkafka and events.

A ShardWriter is not thread-safe and has at most one batch in flight, by design: throughput
comes from batch size, not from concurrent transactions (docs/design.md §5, group commit).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from wal import clients, record
from wal.errors import ErrorClass, InvalidBatchError, UnavailableError, classify, raised_before_end_txn
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

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WriterConfig:
    """Where and how one shard writer writes. Every bound has a name; the batch bounds have no
    default here: they are the caller's (the store's come from `kvstore.limits` through its
    configuration, where its planner cuts batches by the same numbers), so two sets of limits
    cannot drift apart. The writer only checks a batch against them before it writes anything."""

    bootstrap_servers: str
    topic: str
    partition: int
    transactional_id: str
    writer: record.WriterIdentity
    _: dataclasses.KW_ONLY
    max_batch_records: int
    max_batch_bytes: int
    max_record_bytes: int  # below the brokers' message.max.bytes, with room for the envelope
    transaction_timeout_ms: int = 60_000
    # Upper bound for each blocking librdkafka call (init, flush, commit, abort, watermark).
    call_timeout_s: float = 10.0
    # How often a retriable failure of the same call is repeated before giving up.
    retry_limit: int = 5
    producer_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Pause between the end of one transaction and the start of the next. The broker writes the
    # commit markers after answering EndTxn; an AddPartitionsToTxn arriving before they are
    # written gets CONCURRENT_TRANSACTIONS, which librdkafka retries after a hard-coded 20 ms.
    # Measured on loopback (bench/README.md): back to back, 34-75% of transactions paid those
    # 20 ms; with 1-2 ms of pause, 2-7%. A group-committing caller loses nothing: its next batch
    # keeps filling meanwhile.
    commit_gap_ms: float = 2.0
    # Who the producer is to the brokers (SASL credentials of the store's principal, whose ACLs
    # allow this shard's transactional id); the plaintext default needs none.
    security: clients.ClientSecurity = dataclasses.field(default_factory=clients.ClientSecurity)


class ShardWriter:
    """Conditional-publish appender for one shard's partition (W1, W2, W4, W7)."""

    def __init__(self, config: WriterConfig, *, before_commit: Callable[[], None] | None = None) -> None:
        """`before_commit` runs after a batch was delivered and checked, right before
        commit_transaction: a fault-injection seam (the fencing tests pause the process there)."""
        self.config = config
        # Who writes; the caller may set a new term after fence() (the term is often only
        # known once the shard is taken).
        self.identity = config.writer
        self._guard = Guard(retry_limit=config.retry_limit)
        self._before_commit = before_commit
        self._producer: Producer | None = None
        self._ends: clients.PartitionEnds | None = None
        self._payloads: Sequence[bytes] = ()
        assert 0 <= config.commit_gap_ms <= 100, f"commit_gap_ms must be within 0..100, got {config.commit_gap_ms}"
        self._ended_at = 0.0  # monotonic time the last transaction was committed or aborted

    # ---- public API --------------------------------------------------------------------------

    @property
    def upcoming_offset(self) -> int | None:
        """Where the next record will land, or None when unknown (after an abort or a fence)."""
        return self._guard.upcoming_offset

    @property
    def phase(self) -> Phase:
        return self._guard.phase

    @property
    def stats(self) -> GuardStats:
        return self._guard.stats

    def prepare(self) -> None:
        """Connect ahead of `fence()`, so that a takeover does not pay for it; raises UnavailableError.

        Creates the producer without initialising it and reads the partition end once. An
        uninitialised transactional producer never sends InitProducerId by itself, so a
        prepared writer fences nobody (tests/integration/test_fencing.py holds that). Measured
        on loopback: init_transactions takes ~10 ms on a producer created 50 ms or more
        before, ~65 ms on a brand-new one, and ~0.5 s when librdkafka's first coordinator
        query raced its first connection (it retries on a fixed 500 ms timer).
        """
        assert self.phase is Phase.NEW, f"prepare() is for a writer that never fenced, not {self.phase}"
        if self._producer is None:
            self._producer = self._new_producer()
        try:
            self._partition_ends().high_watermark(self.config.topic, self.config.partition)
        except KafkaException as exc:
            raise UnavailableError(f"preparing the writer of {self.config.transactional_id}: {exc}") from exc

    def fence(self) -> int:
        """Take the shard: fence every older writer (W4) and return the upcoming offset (W6)."""
        result = self._drive(Fence())
        assert isinstance(result, int)
        return result

    def append(self, payloads: Sequence[bytes], expected_offset: int | None = None) -> AppendResult:
        """Append one batch in one transaction, or raise a `wal.errors.WalError`.

        With `expected_offset`, the batch must start exactly there (KIP-27's conditional
        publish); without it, at the writer's own upcoming offset, read from the partition
        when unknown. Returns the offsets the records landed at and the new upcoming offset.
        """
        why = Guard.batch_out_of_bounds(
            [len(p) for p in payloads], self.config.max_batch_records, self.config.max_batch_bytes
        )
        if why is not None:
            raise InvalidBatchError(why)
        if expected_offset is not None and expected_offset < 0:
            raise InvalidBatchError(f"expected_offset must be >= 0, got {expected_offset}")
        too_big = [len(p) for p in payloads if len(p) > self.config.max_record_bytes]
        if too_big:
            raise InvalidBatchError(
                f"record of {too_big[0]} bytes exceeds max_record_bytes={self.config.max_record_bytes}"
            )
        self._payloads = payloads
        try:
            result = self._drive(Append(len(payloads), expected_offset))
        finally:
            self._payloads = ()
        assert isinstance(result, AppendResult)
        return result

    def end_offset(self) -> int:
        """The partition's high watermark (read_uncommitted end) now; raises KafkaException.

        Right after a commit or abort this may still lack the marker: see `settled_end`."""
        return self._partition_ends().high_watermark(self.config.topic, self.config.partition)

    def settled_end_offset(self) -> int:
        """The high watermark once no transaction is open on the partition (markers written)."""
        return self._partition_ends().settled_end(self.config.topic, self.config.partition,
                                                  self.config.call_timeout_s)

    def close(self) -> None:
        """Drop the producer without committing anything: an open transaction is aborted by
        the broker (timeout) or by the next writer's init_transactions."""
        self._close_producer()
        if self._ends is not None:
            self._ends.close()
            self._ends = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the event loop ----------------------------------------------------------------------

    def _drive(self, request: Event) -> int | AppendResult:
        pending: collections.deque[Action] = collections.deque(self._guard.step(request))
        while pending:
            action = pending.popleft()
            if isinstance(action, Complete):
                return action.result
            if isinstance(action, Fail):
                log.warning("shard %s: %s: %s", self.config.transactional_id,
                            type(action.error).__name__, action.error)
                raise action.error
            if isinstance(action, CloseProducer):
                self._close_producer()
                continue
            event = self._perform(action)
            assert not pending, f"I/O action {action!r} must be the guard's last action"
            pending.extend(self._guard.step(event))
        raise AssertionError("the guard ended a request without Complete or Fail")

    def _perform(self, action: Action) -> Event:
        if isinstance(action, InitTransactions):
            return self._init(action.fresh_producer)
        if isinstance(action, ReadEndOffset):
            try:
                ends = self._partition_ends()
                return EndOffsetRead(ends.settled_end(self.config.topic, self.config.partition,
                                                      self.config.call_timeout_s))
            except KafkaException as exc:
                return _failed(Op.END_OFFSET, clients.error_of(exc))
        if isinstance(action, BeginAndProduce):
            return self._produce(action)
        if isinstance(action, CommitTransaction):
            return self._call(Op.COMMIT, Committed(), self._commit)
        if isinstance(action, AbortTransaction):
            return self._call(Op.ABORT, Aborted(), self._abort)
        raise AssertionError(f"unknown action {action!r}")

    def _init(self, fresh: bool) -> Event:
        if fresh or self._producer is None:
            self._close_producer()
            self._producer = self._new_producer()
        return self._call(Op.INIT, Initialized(),
                          lambda: self._live_producer().init_transactions(self.config.call_timeout_s))

    def _commit(self) -> None:
        if self._before_commit is not None:
            self._before_commit()
        self._live_producer().commit_transaction(self.config.call_timeout_s)
        self._ended_at = time.monotonic()

    def _abort(self) -> None:
        self._live_producer().abort_transaction(self.config.call_timeout_s)
        self._ended_at = time.monotonic()

    def _produce(self, action: BeginAndProduce) -> Event:
        producer = self._live_producer()
        assert len(self._payloads) == action.count
        # Slot i holds record i's delivery report: W2 compares each record with its own
        # expected offset, whatever order the reports arrive in (docs/design.md §4.1).
        reports: list[tuple[KafkaError | None, int] | None] = [None] * action.count

        gap_s = self.config.commit_gap_ms / 1000 - (time.monotonic() - self._ended_at)
        if gap_s > 0:
            time.sleep(gap_s)  # see WriterConfig.commit_gap_ms
        try:
            producer.begin_transaction()
            for index, payload in enumerate(self._payloads):
                value, headers = record.encode(action.first_offset + index, self.identity, payload)
                producer.produce(self.config.topic, value, partition=self.config.partition,
                                 headers=headers, on_delivery=functools.partial(self._on_delivery, reports, index))
            undelivered = producer.flush(self.config.call_timeout_s)
        except KafkaException as exc:
            return _failed(Op.PRODUCE, clients.error_of(exc))
        except SystemError as exc:
            # confluent-kafka raises a fatal error from flush() as SystemError when a delivery
            # callback ran in the same poll; the KafkaException is its cause. A signal (Ctrl-C)
            # arrives the same way and must not be swallowed as a failed batch.
            _reraise_interrupts(exc)
            return _failed(Op.PRODUCE, _cause(exc))
        except BufferError as exc:  # local queue full: bounded by max_batch_records
            return Failed(Op.PRODUCE, ErrorClass.ABORTABLE, f"producer queue full: {exc}")
        if undelivered:
            return Failed(Op.PRODUCE, ErrorClass.RETRIABLE,
                          f"{undelivered} records undelivered after {self.config.call_timeout_s}s")
        errors = [report[0] for report in reports if report is not None and report[0] is not None]
        if errors:
            return _failed(Op.PRODUCE, errors[0])
        # A record without a report (never expected after a complete flush) gets -1: W2 fails it.
        return Delivered(tuple(-1 if report is None else report[1] for report in reports))

    def _on_delivery(self, reports: list[tuple[KafkaError | None, int] | None], index: int,
                     err: KafkaError | None, msg: Message) -> None:
        """Record record `index`'s delivery report in its own slot. A method, so that a test can
        subclass the writer and disturb the reports (tests/integration/test_conditional_publish.py)."""
        offset = msg.offset() if err is None else None
        # None means librdkafka does not know where it landed: -1 fails the W2 check.
        reports[index] = (err, -1 if offset is None else int(offset))

    def _call(self, op: Op, success: Event, call: Callable[[], None]) -> Event:
        started = time.monotonic()
        try:
            call()
        except (KafkaException, SystemError) as exc:
            if isinstance(exc, SystemError):
                _reraise_interrupts(exc)
            err = clients.error_of(exc) if isinstance(exc, KafkaException) else _cause(exc)
            event = _failed(op, err)
            log.info("shard %s: %s after %.0f ms: %s", self.config.transactional_id, op.value,
                     (time.monotonic() - started) * 1000, event.reason)
            return event
        return success

    def _new_producer(self) -> Producer:
        return Producer(clients.producer_config(self.config.bootstrap_servers, self.config.transactional_id,
                                                self.config.transaction_timeout_ms, self.config.producer_overrides,
                                                self.config.security))

    def _live_producer(self) -> Producer:
        assert self._producer is not None, "no producer: the guard must init first"
        return self._producer

    def _partition_ends(self) -> clients.PartitionEnds:
        if self._ends is None:
            self._ends = clients.PartitionEnds(self.config.bootstrap_servers, self.config.call_timeout_s,
                                               self.config.security)
        return self._ends

    def _close_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            retire(producer, self.config.transactional_id)


# Producers being retired at once in this process: each normally goes within milliseconds; more
# than this many still going means librdkafka is stuck destroying them (logged, never waited for).
RETIRING_WARN_AT = 8
_retiring: set[threading.Thread] = set()
_retiring_lock = threading.Lock()


def retire(producer: Producer, name: str) -> None:
    """Drop `producer` off the caller's thread: purge what it holds, then destroy it.

    Never `Producer.close()`: it flushes with no timeout first, and a transactional producer cut
    off from its coordinator waited there for minutes, holding its shard's writer (and with it the
    shard's leadership and every cross-shard transaction through it) in issue 22's campaign. Nor a
    flush: it would serve the delivery reports of a batch this writer has left behind. A fenced or
    fatal producer refuses the purge; destroying the instance is what matters (the broker aborts
    an open transaction at its timeout, or the next writer's init_transactions does)."""

    def destroy(held: list[Producer]) -> None:
        try:
            with contextlib.suppress(KafkaException, RuntimeError):
                held[0].purge(in_queue=True, in_flight=True, blocking=False)
            held.clear()  # the last reference: rd_kafka_destroy runs here, not in the writer's thread
        finally:
            with _retiring_lock:
                _retiring.discard(threading.current_thread())

    thread = threading.Thread(target=destroy, args=([producer],), daemon=True, name=f"retire-{name}")
    with _retiring_lock:
        _retiring.add(thread)
        busy = len(_retiring)
    del producer
    thread.start()
    if busy > RETIRING_WARN_AT:
        log.warning("%d Kafka producers are being destroyed at once (librdkafka slow to let go of them)", busy)


def retiring() -> int:
    """Producers handed to `retire` and not destroyed yet."""
    with _retiring_lock:
        return len(_retiring)


def _failed(op: Op, err: KafkaError) -> Failed:
    cls = classify(err.name(), fatal=err.fatal(), retriable=err.retriable(),
                   txn_requires_abort=err.txn_requires_abort())
    before_end_txn = op is Op.COMMIT and raised_before_end_txn(err.str())
    return Failed(op, cls, f"{err.name()}: {err.str()}", before_end_txn)


def _reraise_interrupts(exc: SystemError) -> None:
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, (KeyboardInterrupt, SystemExit)):
        raise cause


def _cause(exc: SystemError) -> KafkaError:
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, KafkaException):
        return clients.error_of(cause)
    return KafkaError(KafkaError._FAIL, f"{exc}")
