"""read_committed replay of one shard's partition with the acceptance rule W3.

Every reader of the WAL (leader bootstrap, followers, audits) goes through this class, so the
rule is applied identically everywhere: only records whose actual offset equals their expected
offset are yielded; the others are skipped and counted.

The replayer tracks its position itself: after record o it is o+1, and it moves past control
markers (commit/abort) and aborted records as soon as librdkafka has skipped them (the
consumer's position), so "reached the end" also works when a partition ends in markers.
librdkafka's PARTITION_EOF event says the same, but only after one more fetch, which the broker
holds for up to fetch.wait.max.ms (500 ms) when there is nothing new: a takeover waiting for the
old leader's last commit marker would wait that long (measured: 0.2-0.3 s of every clean
handover, before the replayer read the consumer's position).

Out of range (docs/design.md §4.1: never a silent jump). The consumer runs with
auto.offset.reset=error. When the broker answers a fetch with OFFSET_OUT_OF_RANGE (the position
is below the log start after a truncation, or above the log end), librdkafka
(rdkafka_fetcher.c -> rd_kafka_offset_reset in rdkafka_offset.c) enqueues one consumer error
_AUTO_OFFSET_RESET carrying the refused offset, and stops fetching the partition (fetch state
NONE: no more records, no PARTITION_EOF, consumer.position() reports OFFSET_INVALID). A
KIP-320 log-truncation detection (_LOG_TRUNCATION) ends the same way. The replayer raises
`OffsetOutOfRangeError` with the partition's log start and end, and keeps raising it from every
poll until the caller calls `seek()` (which re-assigns the partition: librdkafka refuses a plain
seek on a stopped partition with _STATE) or `close()`. It never resumes anywhere by itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import time
from collections.abc import Callable, Iterator

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from wal import clients, record
from wal.errors import OffsetOutOfRangeError, UnavailableError, WalTimeoutError

log = logging.getLogger(__name__)

# librdkafka stops fetching a partition while its local queue holds queued.min.messages (100k) or
# queued.max.messages.kbytes, and then looks again only after fetch.queue.backoff.ms (1 s by
# default). A replay that applies slower than the broker delivers fills the queue, so with the
# default it read for ~0.5 s and then waited ~0.5 s for the next fetch (measured: wal.Replayer
# 113k -> 204k records/s with 200k records, raw consumer ~290k either way). The queue bounds stay
# as they are; only the look comes sooner.
REPLAY_FETCH = {"fetch.queue.backoff.ms": 10}
CONSUME_STEP = 500  # records per consume() within one fetch (`Replayer._fetch` says why)
UNREADABLE_LOGGED = 20  # unreadable records logged one by one per replayer; then every 1000th
_ERROR, _OFFSET = operator.methodcaller("error"), operator.methodcaller("offset")
_VALUE, _HEADERS = operator.methodcaller("value"), operator.methodcaller("headers")


@dataclasses.dataclass
class ReplayStats:
    accepted: int = 0
    rejected_mismatch: int = 0  # well-formed records that landed where they did not expect (W3)
    rejected_malformed: int = 0  # foreign or corrupt records (the unreadable ones included)
    unreadable: int = 0  # of those, records that could not even be judged (e.g. headers that do not decode)

    @property
    def rejected(self) -> int:
        return self.rejected_mismatch + self.rejected_malformed


class Replayer:
    """Consumes one partition read_committed from `start_offset`. Not thread-safe.

    A `start_offset` outside the partition's log (below its start, or above its end) is not an
    error here: the first poll raises `OffsetOutOfRangeError` (see the module docstring).
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        partition: int,
        start_offset: int,
        *,
        poll_timeout_s: float = 0.5,
        call_timeout_s: float = 10.0,
        max_poll_records: int = 5_000,
        security: clients.ClientSecurity | None = None,
    ) -> None:
        assert start_offset >= 0, f"start offset must be >= 0: {start_offset}"
        assert max_poll_records > 0
        self.topic = topic
        self.partition = partition
        self.position = start_offset  # the next offset this replayer has not looked at
        self.stats = ReplayStats()
        self._poll_timeout_s = poll_timeout_s
        self._call_timeout_s = call_timeout_s
        self._max_poll_records = max_poll_records
        self._bootstrap = bootstrap_servers
        self._security = security
        self._ends: clients.PartitionEnds | None = None
        self._consumer = Consumer(clients.consumer_config(bootstrap_servers, "read_committed", REPLAY_FETCH, security))
        self._consumer.assign([TopicPartition(topic, partition, start_offset)])
        # The consumer's position is only ours once a message was consumed since the last
        # seek: librdkafka seeks asynchronously, so just after seek() it may still report the
        # position from before (which would skip unread records when seeking back).
        self._position_current = False
        # librdkafka's _AUTO_OFFSET_RESET error and the offset it refused, once it stopped
        # fetching (out of range); until seek() or close(), every poll raises OffsetOutOfRangeError.
        self._stopped: tuple[KafkaError, int] | None = None

    def end_offset(self) -> int:
        """The high watermark (read_uncommitted end), the target of "replay to the end" (W6).

        A read_committed consumer's watermark query returns the LSO, so ask a separate
        read_uncommitted view: the LSO can lag a committed write whose marker is not yet
        written, and an open transaction below the HW must be waited out, not skipped.
        """
        return self._watermark(stable=False)

    def stable_offset(self) -> int:
        """The last stable offset: what read_committed can deliver right now."""
        return self._watermark(stable=True)

    def log_start(self) -> int:
        """The log start offset (low watermark): records below it were deleted (retention,
        delete_records), so a reader positioned below it cannot replay from there."""
        ends = self._partition_ends()
        try:
            return ends.log_start(self.topic, self.partition)
        except KafkaException as exc:
            raise UnavailableError(f"log start of {self.topic}[{self.partition}]: {exc}") from exc

    def poll(self, timeout_s: float | None = None) -> list[record.AcceptedRecord]:
        """Tail: return the accepted records that arrive within `timeout_s` (maybe none)."""
        deadline = time.monotonic() + (self._poll_timeout_s if timeout_s is None else timeout_s)
        accepted: list[record.AcceptedRecord] = []
        while not accepted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            accepted.extend(self.poll_once(remaining))
        return accepted

    def read_to(self, end_offset: int, timeout_s: float) -> Iterator[record.AcceptedRecord]:
        """Yield accepted records until the position reaches `end_offset`.

        Raises WalTimeoutError if the end is not reached within `timeout_s`, e.g. because an
        open transaction below it keeps the LSO back longer than that.
        """
        deadline = time.monotonic() + timeout_s
        while self.position < end_offset:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WalTimeoutError(
                    f"{self.topic}[{self.partition}] replay stuck at {self.position}, "
                    f"end {end_offset}, after {timeout_s}s (an open transaction holds the LSO?)"
                )
            yield from self.poll_once(min(remaining, self._poll_timeout_s))

    def read_to_end(self, timeout_s: float) -> Iterator[record.AcceptedRecord]:
        """Replay up to the high watermark as of this call."""
        yield from self.read_to(self.end_offset(), timeout_s)

    def seek(self, offset: int) -> None:
        """Resume from `offset` (e.g. a checkpoint); also the way on after `OffsetOutOfRangeError`.

        librdkafka refuses to seek a partition it stopped after an out-of-range fetch (_STATE,
        "Erroneous state"), so then the partition is assigned anew at `offset` instead. If
        `offset` is still outside the log, the next poll raises `OffsetOutOfRangeError` again.
        """
        assert offset >= 0
        tp = TopicPartition(self.topic, self.partition, offset)
        if self._stopped is not None:
            self._consumer.assign([tp])
        else:
            try:
                self._consumer.seek(tp)
            except KafkaException as exc:
                if clients.error_of(exc).code() != KafkaError._STATE:
                    raise
                # Stopped (out of range) before a poll saw the error, which is already queued:
                # drop it first, else it is delivered after the new assignment (seen: librdkafka
                # does not purge it) and would refuse the new position.
                self._drop_queued_refusal()
                self._consumer.assign([tp])
        self._stopped = None
        self.position = offset
        self._position_current = False

    def close(self) -> None:
        self._consumer.close()
        if self._ends is not None:
            self._ends.close()
            self._ends = None

    def __enter__(self) -> Replayer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def poll_once(self, timeout_s: float) -> list[record.AcceptedRecord]:
        """One fetch: the accepted records it brought (maybe none); `position` moves past
        everything it saw, markers and rejected records included.

        Raises `OffsetOutOfRangeError` once librdkafka refused the position (below the log
        start, or above the end), and from then on at every call until `seek()` or `close()`;
        records that arrived before the refusal are returned first, the error comes with the
        next call. Raises `UnavailableError` if the log's ends cannot be read for the error (the
        state stays: the next call tries again).
        """
        out: list[record.AcceptedRecord] = []

        def take(messages: list[Message], offsets: list[int], judged: record.Judged) -> None:
            out.extend(record.AcceptedRecord(offsets[index], payload, writer, messages[index].timestamp()[1])
                       for index, payload, writer in zip(judged.accepted, judged.payloads, judged.writers,
                                                         strict=True))

        self._fetch(timeout_s, take)
        return out

    def poll_payloads(self, timeout_s: float) -> list[tuple[int, bytes]]:
        """`poll_once`, the accepted records as (offset, payload) only: what a replica applies.

        Replay calls this for every batch of a bootstrap, and a record object per record (with
        its writer and timestamp, which apply never reads) cost more than the pairs themselves.
        """
        out: list[tuple[int, bytes]] = []

        def take(messages: list[Message], offsets: list[int], judged: record.Judged) -> None:
            out.extend(zip([offsets[index] for index in judged.accepted], judged.payloads, strict=True))

        self._fetch(timeout_s, take)
        return out

    # ---- internals ---------------------------------------------------------------------------

    def _fetch(self, timeout_s: float, take: Callable[[list[Message], list[int], record.Judged], None]) -> None:
        """One fetch of up to `max_poll_records`, judged by W3 (`record.judge_batch`) in steps of
        `CONSUME_STEP` records: `take` is given each step's data messages, their offsets (the
        judgement's indexes point into both) and the judgement. Stats and position updated,
        errors as `poll_once` says.

        In steps, so that a step's messages (and their header lists) are garbage before the
        next step is consumed: holding a whole fetch of them alive made Python's collector move
        them to its oldest generation and then walk it (measured: ~12% of a bootstrap's time,
        twelve full collections per 200k records)."""
        if self._stopped is not None:
            raise self._out_of_range()
        accepted = 0
        failure: UnavailableError | None = None
        wait_s = timeout_s
        budget = self._max_poll_records
        while budget > 0 and failure is None and self._stopped is None:  # bounded: budget shrinks
            batch = self._consumer.consume(min(budget, CONSUME_STEP), timeout=wait_s)
            if not batch:
                break
            wait_s = 0  # the rest of this fetch: only what librdkafka has already queued
            budget -= len(batch)
            self._position_current = True  # consumed after the last seek (older ones are dropped)
            messages, offsets, values, headers, failure = self._records_of(batch)
            judged = self._judge(offsets, values, headers)
            stats = self.stats
            stats.accepted += len(judged.accepted)
            stats.rejected_mismatch += judged.mismatch
            stats.rejected_malformed += judged.malformed
            accepted += len(judged.accepted)
            take(messages, offsets, judged)
        if failure is not None:
            raise failure
        if self._stopped is not None:
            if accepted:
                return  # the caller's; the error follows with the next call
            raise self._out_of_range()
        self._skip_markers()

    def _records_of(self, batch: list[Message]) -> tuple[list[Message], list[int], list[bytes | None],
                                                         list[record.AnyHeaders], UnavailableError | None]:
        """The records of one consume() past the position, in order, as columns: messages,
        offsets, values, headers; the position moves past them and past what librdkafka says it
        skipped. Error events are handled here (see `poll_once`); a fatal one ends the records
        and is returned, to be raised once those before it are judged and counted."""
        position = self.position
        if not any(map(_ERROR, batch)):
            offsets: list[int] = list(map(_OFFSET, batch))
            if offsets[0] >= position and all(map(operator.lt, offsets, itertools.islice(offsets, 1, None))):
                # Only records, in order, none seen before: what a fetch nearly always is, read a
                # column at a time (~0.2 µs a record less than the loop below).
                self.position = offsets[-1] + 1
                return batch, offsets, list(map(_VALUE, batch)), self._headers_of(batch, offsets), None
        messages: list[Message] = []
        offsets = []
        values: list[bytes | None] = []
        failure: UnavailableError | None = None
        for msg in batch:  # bounded by CONSUME_STEP
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    # The offset past everything read_committed can see, markers included.
                    position = max(position, msg.offset() or 0)
                    continue
                if err.code() == KafkaError._AUTO_OFFSET_RESET:
                    # auto.offset.reset=error: librdkafka stopped fetching (module docstring).
                    refused = msg.offset()
                    self._stopped = (err, refused if refused is not None and refused >= 0 else position)
                    break  # nothing of this partition can follow the refusal
                if err.retriable() or not err.fatal():
                    continue  # transient fetch errors: librdkafka retries by itself
                failure = UnavailableError(f"{self.topic}[{self.partition}]: {err.str()}")
                break  # what came before it is still judged and counted, then this is raised
            offset = msg.offset()
            assert offset is not None, "a fetched record always has an offset"
            if offset < position:
                continue  # a re-delivery after a seek; already judged
            messages.append(msg)
            offsets.append(offset)
            values.append(msg.value())
            position = offset + 1
        headers = self._headers_of(messages, offsets)
        self.position = position
        return messages, offsets, values, headers, failure

    def _judge(self, offsets: list[int], values: list[bytes | None], headers: list[record.AnyHeaders]) -> record.Judged:
        """W3 over one step (`record.judge_batch`). Should judging ever raise on some record's
        bytes (a bug: it must not), the step is judged again record by record, and a record whose
        judgement raises is malformed, logged with its offset: never a failed reader that would
        meet the same record again at the same checkpoint, forever."""
        try:
            return record.judge_batch(offsets, values, headers)
        except Exception:
            log.exception("%s[%d]: judging records %d..%d raised; judging them one by one", self.topic,
                          self.partition, offsets[0], offsets[-1])
        judged = record.Judged([], [], [], 0, 0)
        for index, (offset, value, record_headers) in enumerate(zip(offsets, values, headers, strict=True)):
            try:
                verdict, accepted = record.judge(offset, value, record_headers)
            except Exception as exc:
                self._unreadable(offset, f"judging raised {type(exc).__name__}: {exc}")
                verdict, accepted = record.Verdict.MALFORMED, None
            if accepted is not None:
                judged.accepted.append(index)
                judged.payloads.append(accepted.payload)
                judged.writers.append(accepted.writer)
            elif verdict is record.Verdict.MISMATCH:
                judged = judged._replace(mismatch=judged.mismatch + 1)
            else:
                judged = judged._replace(malformed=judged.malformed + 1)
        return judged

    def _headers_of(self, messages: list[Message], offsets: list[int]) -> list[record.AnyHeaders]:
        """Each message's headers; None (the record is then malformed, W3) for one whose headers
        cannot be read. confluent-kafka builds a key with PyUnicode_FromString, so a key that is
        not UTF-8 makes `headers()` raise SystemError, and the message then caches a list
        holding a NULL that crashes the interpreter when touched: a message whose `headers()`
        raised is never asked again. (Seen: one such record wedged every reader of its shard.)

        `list.extend` keeps the items it appended before its iterator raised (CPython;
        tests/unit/test_replayer_errors.py holds it), so the failing message is the one at the
        list's length, and the rest are asked from the next one on."""
        out: list[record.AnyHeaders] = []
        while True:  # bounded: every turn either ends or moves past one message
            try:
                out.extend(map(_HEADERS, itertools.islice(messages, len(out), None)))
                break
            except Exception as exc:
                failed = len(out)
                assert failed < len(messages), "a message failed that was not asked"
                self._unreadable(offsets[failed], f"{type(exc).__name__}: {exc}")
                out.append(None)
        assert len(out) == len(messages)
        return out

    def _unreadable(self, offset: int, why: str) -> None:
        """A record that cannot even be judged: malformed (W3), counted as such by the caller,
        logged with its offset (the first few per replayer, then every 1000th: a flood of them
        must not flood the log)."""
        self.stats.unreadable += 1
        if self.stats.unreadable <= UNREADABLE_LOGGED or self.stats.unreadable % 1000 == 0:
            log.warning("%s[%d] offset %d: unreadable record (%s): skipped as malformed (%d so far)", self.topic,
                        self.partition, offset, why, self.stats.unreadable)

    def _drop_queued_refusal(self) -> None:
        """Consume what is queued up to librdkafka's _AUTO_OFFSET_RESET error (seek() discards
        prefetched records anyway). librdkafka enqueues that error before it marks the partition
        stopped, so when seek() found it stopped, the error is in the queue already."""
        while messages := self._consumer.consume(self._max_poll_records, timeout=0):
            if any((err := m.error()) is not None and err.code() == KafkaError._AUTO_OFFSET_RESET
                   for m in messages):
                return

    def _skip_markers(self) -> None:
        """Move past control markers and aborted records librdkafka already skipped."""
        if not self._position_current:
            return
        (current,) = self._consumer.position([TopicPartition(self.topic, self.partition)])
        if current.error is None and current.offset is not None and current.offset > self.position:
            self.position = current.offset

    def _out_of_range(self) -> OffsetOutOfRangeError:
        """The error for a partition librdkafka stopped; reads both ends of the log now."""
        assert self._stopped is not None
        err, refused = self._stopped
        log_start = self.log_start()
        log_end = self.end_offset()
        return OffsetOutOfRangeError(
            f"{self.topic}[{self.partition}]: position {self.position} out of range, the log is now "
            f"[{log_start}, {log_end}] (librdkafka refused offset {refused}: {err.str()}); "
            f"fetching stopped until seek() or close()",
            position=self.position, log_start=log_start, log_end=log_end)

    def _partition_ends(self) -> clients.PartitionEnds:
        if self._ends is None:
            self._ends = clients.PartitionEnds(self._bootstrap, self._call_timeout_s, self._security)
        return self._ends

    def _watermark(self, *, stable: bool) -> int:
        ends = self._partition_ends()
        try:
            if stable:
                return ends.stable_offset(self.topic, self.partition)
            return ends.high_watermark(self.topic, self.partition)
        except KafkaException as exc:
            raise UnavailableError(f"watermarks of {self.topic}[{self.partition}]: {exc}") from exc
