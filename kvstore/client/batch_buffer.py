"""The batching writers' buffer, without threads, tasks or clocks: which writes wait, which go
in the next call, how long the sender may sleep. `BatchingWriter` (threads) and
`AsyncBatchingWriter` (asyncio) keep one each and differ only in how they wait and send; the
rules (bound, linger, per-shard order, honest outcomes) are in `kvstore.client.batching`'s
docstring. `now` is always the caller's `time.monotonic()`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from kvstore import limits
from kvstore.client.errors import BatchIncomplete, InvalidArgument, KvError, UnknownOutcome
from kvstore.client.requests import Op
from kvstore.client.results import BatchResult, ShardWrite

DEFAULT_MAX_BATCH_MUTATIONS = 1_000
DEFAULT_MAX_BATCH_BYTES = 512 * 1024
DEFAULT_LINGER_MS = 5.0
DEFAULT_MAX_BUFFERED_MUTATIONS = 50_000
DEFAULT_MAX_IN_FLIGHT = 4
OP_OVERHEAD_BYTES = 16  # protobuf tags and lengths of a Mutation around its key and value, rounded up
# A call's parts may all go to one leader: keep the sum under what one request may carry.
MAX_CALL_BYTES = limits.MAX_REQUEST_BYTES - 64 * 1024

F = TypeVar("F")  # the writer's future type (concurrent.futures or asyncio)


def check_writer_options(*, max_batch_mutations: int, max_batch_bytes: int, linger_ms: float,
                         max_buffered_mutations: int, max_in_flight: int, call_timeout_s: float,
                         put_timeout_s: float) -> None:
    """Refuse a writer's options that could not work, naming the bound."""
    if not 1 <= max_batch_mutations <= limits.MAX_BATCH_MUTATIONS:
        raise InvalidArgument(f"max_batch_mutations must be 1..{limits.MAX_BATCH_MUTATIONS} "
                              f"(MAX_BATCH_MUTATIONS): {max_batch_mutations}")
    if not 1 <= max_batch_bytes <= MAX_CALL_BYTES:
        raise InvalidArgument(f"max_batch_bytes must be 1..{MAX_CALL_BYTES} (one request): {max_batch_bytes}")
    if linger_ms < 0 or max_buffered_mutations < max_batch_mutations or max_in_flight < 1:
        raise InvalidArgument("linger_ms must be >= 0, max_buffered_mutations >= max_batch_mutations, "
                              "max_in_flight >= 1")
    if call_timeout_s <= 0 or put_timeout_s <= 0:
        raise InvalidArgument("call_timeout_s and put_timeout_s must be > 0")


def write_size(op: Op, max_batch_bytes: int) -> int:
    """What `op` adds to a batch, in bytes; refuses a write no batch could carry (nothing sent)."""
    if not op.key or len(op.key) > limits.MAX_KEY_BYTES:
        raise InvalidArgument(f"key of {len(op.key)} bytes; keys are 1..{limits.MAX_KEY_BYTES} bytes")
    if len(op.value) > limits.MAX_VALUE_BYTES:
        raise InvalidArgument(f"value of {len(op.value)} bytes; limit MAX_VALUE_BYTES is {limits.MAX_VALUE_BYTES}")
    size = len(op.key) + len(op.value) + OP_OVERHEAD_BYTES
    if size > max_batch_bytes:
        raise InvalidArgument(f"a write of {size} bytes does not fit max_batch_bytes ({max_batch_bytes})")
    return size


Entry = tuple[Op, F, int]  # a write, its future, its size in bytes


class BatchBuffer(Generic[F]):
    """Writes per shard, waiting or in flight, and the counters that bound them."""

    def __init__(self, *, max_mutations: int, max_bytes: int, linger_s: float, max_buffered: int,
                 max_in_flight: int) -> None:
        assert max_mutations >= 1 and max_bytes >= 1 and linger_s >= 0 and max_buffered >= max_mutations
        assert max_in_flight >= 1
        self._max_mutations = max_mutations
        self._max_bytes = max_bytes
        self._linger_s = linger_s
        self._max_buffered = max_buffered
        self._max_in_flight = max_in_flight
        self._buffers: dict[int, list[Entry[F]]] = {}
        self._buffer_bytes: dict[int, int] = {}
        self._oldest: dict[int, float] = {}  # per shard: when its oldest buffered write arrived
        self._busy: set[int] = set()  # shards with a batch in flight (one each: per-shard order)
        self._sending: dict[int, list[Entry[F]]] = {}  # those batches' writes
        self.calls = 0  # calls in flight
        self.outstanding = 0  # mutations buffered or in flight: the bound
        self.urgent = 0  # flushes waiting: send without lingering
        self.closed = False
        self.batches = 0  # calls made
        self.mutations = 0  # mutations sent

    @classmethod
    def for_writer(cls, *, max_batch_mutations: int, max_batch_bytes: int, linger_ms: float,
                   max_buffered_mutations: int, max_in_flight: int, call_timeout_s: float,
                   put_timeout_s: float) -> BatchBuffer[F]:
        """A writer's buffer from its public options, refused (naming the bound) if they could not work."""
        check_writer_options(max_batch_mutations=max_batch_mutations, max_batch_bytes=max_batch_bytes,
                             linger_ms=linger_ms, max_buffered_mutations=max_buffered_mutations,
                             max_in_flight=max_in_flight, call_timeout_s=call_timeout_s, put_timeout_s=put_timeout_s)
        return cls(max_mutations=max_batch_mutations, max_bytes=max_batch_bytes, linger_s=linger_ms / 1000.0,
                   max_buffered=max_buffered_mutations, max_in_flight=max_in_flight)

    @property
    def full(self) -> bool:
        """No room for another write until answers come back (`max_buffered_mutations`)."""
        return self.outstanding >= self._max_buffered

    @property
    def finished(self) -> bool:
        """Closed, and nothing buffered or in flight: the sender may end."""
        return self.closed and not self._buffers and self.calls == 0

    def add(self, shard: int, op: Op, future: F, size: int, now: float) -> bool:
        """Buffer a write (the caller checked `full` and `closed`); True when the sender should
        wake (a batch filled up, or a shard's first write starts its linger)."""
        assert not self.closed and not self.full
        buffer = self._buffers.setdefault(shard, [])
        if not buffer:
            self._oldest[shard] = now
        buffer.append((op, future, size))
        self._buffer_bytes[shard] = self._buffer_bytes.get(shard, 0) + size
        self.outstanding += 1
        return (len(buffer) == 1 or len(buffer) >= self._max_mutations
                or self._buffer_bytes[shard] >= self._max_bytes)

    def waiting(self) -> Iterator[F]:
        """The futures of every write buffered or in flight now."""
        for entries in (*self._buffers.values(), *self._sending.values()):
            for _, future, _ in entries:
                yield future

    def take(self, now: float) -> dict[int, list[Entry[F]]]:
        """The next call's parts (every ready shard's oldest writes, within one call's bounds),
        now in flight; empty when no call may start."""
        if self.calls >= self._max_in_flight:
            return {}
        taken: dict[int, list[Entry[F]]] = {}
        call_bytes = 0
        for shard in sorted(self._buffers, key=lambda s: self._oldest.get(s, now)):
            if not self._ready(shard, now):
                continue
            buffer = self._buffers[shard]
            count, part_bytes = 0, 0
            while count < len(buffer) and count < self._max_mutations and \
                    call_bytes + part_bytes + buffer[count][2] <= self._max_bytes:
                part_bytes += buffer[count][2]
                count += 1
            if count == 0:
                break  # the call is full
            taken[shard] = buffer[:count]
            del buffer[:count]
            call_bytes += part_bytes
            self._buffer_bytes[shard] -= part_bytes
            if buffer:
                self._oldest[shard] = now  # the rest waits its own linger behind this batch
            else:
                del self._buffers[shard], self._buffer_bytes[shard], self._oldest[shard]
        if taken:
            self._busy.update(taken)
            self._sending.update(taken)
            self.calls += 1
            self.batches += 1
            self.mutations += sum(len(entries) for entries in taken.values())
        return taken

    def done(self, taken: dict[int, list[Entry[F]]]) -> None:
        """A call `take` returned was answered (or failed): its shards may send again."""
        for shard, entries in taken.items():
            assert shard in self._busy, f"shard {shard} answered without a batch in flight"
            self._busy.discard(shard)
            self._sending.pop(shard, None)
            self.outstanding -= len(entries)
        self.calls -= 1
        assert self.calls >= 0 and self.outstanding >= 0, (self.calls, self.outstanding)

    def drop_buffered(self) -> list[F]:
        """Close, and take every write not yet sent out of the buffer (its sender stopped: they
        will never be sent); their futures are the caller's to fail."""
        self.closed = True
        dropped = [future for entries in self._buffers.values() for _, future, _ in entries]
        self.outstanding -= len(dropped)
        self._buffers.clear()
        self._buffer_bytes.clear()
        self._oldest.clear()
        return dropped

    def sleep_s(self, now: float) -> float | None:
        """How long the sender may sleep before a linger ends (None: until woken)."""
        if self.calls >= self._max_in_flight:
            return None
        waits = [self._oldest[s] + self._linger_s - now for s in self._buffers if s not in self._busy]
        return max(0.0, min(waits)) if waits else None

    def _ready(self, shard: int, now: float) -> bool:
        if shard in self._busy or not self._buffers.get(shard):
            return False
        return (self.closed or self.urgent > 0 or len(self._buffers[shard]) >= self._max_mutations
                or self._buffer_bytes[shard] >= self._max_bytes or now - self._oldest[shard] >= self._linger_s)


def outcomes(taken: dict[int, list[Entry[F]]],
             answer: BatchResult | BaseException) -> list[tuple[F, ShardWrite | BaseException]]:
    """What each write of a call resolves with: the `ShardWrite` of the part that carried it, or
    that part's error (a Put's classification); any other failure is an unknown outcome, since
    the call may have reached the store."""
    if isinstance(answer, BatchResult):
        parts = {part.shard: part for part in answer.shards}
        return [(future, parts[shard]) for shard, entries in taken.items() for _, future, _ in entries]
    if isinstance(answer, BatchIncomplete):
        settled: list[tuple[F, ShardWrite | BaseException]] = []
        for shard, entries in taken.items():
            part = answer.committed.get(shard)
            outcome: ShardWrite | BaseException = part if part is not None else answer.errors[shard]
            settled.extend((future, outcome) for _, future, _ in entries)
        return settled
    error = answer if isinstance(answer, KvError) else \
        UnknownOutcome(f"the batch failed unexpectedly: {answer!r}; its outcome is unknown")
    return [(future, error) for entries in taken.values() for _, future, _ in entries]
