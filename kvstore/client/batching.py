"""`BatchingWriter`: puts and deletes from many threads, sent as few large WriteBatch calls.

One write per call costs a round trip and a WAL record per key; a WriteBatch carries thousands
of mutations in one record per shard. The writer sits between the two: callers hand it single
writes and get a future each, and it sends them in batches (`Client.write_batch`). Why it is
built this way:

* **Bounded.** At most `max_buffered_mutations` are buffered or in flight; a caller that would
  exceed it waits (at most `put_timeout_s`), then gets `Overloaded`: a store that does not keep
  up slows its writers instead of growing a queue without end.
* **Linger.** A shard's buffer is sent once it holds `max_batch_mutations` (or
  `max_batch_bytes`), or `linger_ms` after its oldest write arrived, whichever comes first: a
  lone write waits at most the linger, a busy stream fills whole batches.
* **Per-shard order.** At most one batch per shard is in flight (batches of different shards
  go in parallel, up to `max_in_flight` calls), so two writes to a key from one thread commit in
  the order they were made. While a shard's batch is in flight its next one fills up.
* **Honest outcomes (W7).** Each future resolves with the `ShardWrite` of the part that carried
  it (every write of a part shares its revision), or with the part's error, classified exactly
  as a Put's: definite, `UnknownOutcome` (it may have committed; the part's request id is on
  the error) or `RequestExpired`. The writer's batches carry generated request ids and retry
  within `call_timeout_s`; it never resends a batch after its call gave up, so an unknown
  outcome is the caller's to resolve (read the key).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Self

from kvstore import limits
from kvstore.client.errors import (
    BatchIncomplete,
    DeadlineExceeded,
    InvalidArgument,
    KvError,
    Overloaded,
    UnknownOutcome,
)
from kvstore.client.requests import BytesLike, Op
from kvstore.client.results import ShardWrite
from kvstore.core.sharding import shard_of

if TYPE_CHECKING:
    from kvstore.client.client import Client

DEFAULT_MAX_BATCH_MUTATIONS = 1_000
DEFAULT_MAX_BATCH_BYTES = 512 * 1024
DEFAULT_LINGER_MS = 5.0
DEFAULT_MAX_BUFFERED_MUTATIONS = 50_000
DEFAULT_MAX_IN_FLIGHT = 4
OP_OVERHEAD_BYTES = 16  # protobuf tags and lengths of a Mutation around its key and value, rounded up
# A call's parts may all go to one leader: keep the sum under what one request may carry.
MAX_CALL_BYTES = limits.MAX_REQUEST_BYTES - 64 * 1024

_Entry = tuple[Op, "concurrent.futures.Future[ShardWrite]", int]


class BatchingWriter:
    """Collects writes from many threads into WriteBatch calls; thread-safe. Use as a context
    manager, or call `close()`: it sends what is buffered and waits for the answers.

    `put` and `delete` return a `concurrent.futures.Future` of the write's `ShardWrite`; call
    `.result()` to wait for it. `flush()` waits for everything written before it.
    """

    def __init__(
        self,
        client: Client,
        *,
        max_batch_mutations: int = DEFAULT_MAX_BATCH_MUTATIONS,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        linger_ms: float = DEFAULT_LINGER_MS,
        max_buffered_mutations: int = DEFAULT_MAX_BUFFERED_MUTATIONS,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        call_timeout_s: float = 30.0,
        put_timeout_s: float = 30.0,
    ) -> None:
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
        self._client = client
        self._max_mutations = max_batch_mutations
        self._max_bytes = max_batch_bytes
        self._linger_s = linger_ms / 1000.0
        self._max_buffered = max_buffered_mutations
        self._max_in_flight = max_in_flight
        self._call_timeout_s = call_timeout_s
        self._put_timeout_s = put_timeout_s
        self._cond = threading.Condition()
        self._buffers: dict[int, list[_Entry]] = {}
        self._buffer_bytes: dict[int, int] = {}
        self._oldest: dict[int, float] = {}  # per shard: when its oldest buffered write arrived
        self._busy: set[int] = set()  # shards with a batch in flight (one each: per-shard order)
        self._sending: dict[int, list[_Entry]] = {}  # those batches' writes
        self._calls = 0  # calls in flight
        self._outstanding = 0  # mutations buffered or in flight: the bound
        self._urgent = 0  # flushes waiting: send without lingering
        self._closed = False
        self._shard_count: int | None = None
        self.batches = 0  # calls made
        self.mutations = 0  # mutations sent
        self._pool = concurrent.futures.ThreadPoolExecutor(max_in_flight, thread_name_prefix="kvstore-batch")
        self._thread = threading.Thread(target=self._run, name="kvstore-batching-writer", daemon=True)
        self._thread.start()

    # -- the API ---------------------------------------------------------------------------------

    def put(self, key: BytesLike, value: BytesLike) -> concurrent.futures.Future[ShardWrite]:
        return self._add(Op.put(key, value))

    def delete(self, key: BytesLike) -> concurrent.futures.Future[ShardWrite]:
        return self._add(Op.delete(key))

    def flush(self, timeout_s: float | None = None) -> None:
        """Send what is buffered now, without lingering, and wait until every write made before
        this call was answered (each future is then done, with its result or its error)."""
        with self._cond:
            waiting = [future for entries in self._buffers.values() for _, future, _ in entries]
            waiting.extend(self._in_flight_futures)
            self._urgent += 1
            self._cond.notify_all()
        try:
            _done, not_done = concurrent.futures.wait(waiting, timeout=timeout_s)
        finally:
            with self._cond:
                self._urgent -= 1
        if not_done:
            raise DeadlineExceeded(f"flush: {len(not_done)} writes not answered within {timeout_s} s")

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking writes, send the buffered ones and wait for their answers."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._pool.shutdown(wait=True)
        if self._thread.is_alive():
            raise DeadlineExceeded(f"close: writes still outstanding after {timeout_s} s")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------

    @property
    def _in_flight_futures(self) -> list[concurrent.futures.Future[ShardWrite]]:
        return [future for entries in self._sending.values() for _, future, _ in entries]

    def _shard_of(self, key: bytes) -> int:
        if self._shard_count is None:
            self._shard_count = self._client.shard_map().shard_count
            if self._shard_count <= 0:
                self._shard_count = None
                raise DeadlineExceeded("the cluster's shard count is not known yet (no shard map); nothing was sent")
        return shard_of(key, self._shard_count)

    def _add(self, op: Op) -> concurrent.futures.Future[ShardWrite]:
        if not op.key or len(op.key) > limits.MAX_KEY_BYTES:
            raise InvalidArgument(f"key of {len(op.key)} bytes; keys are 1..{limits.MAX_KEY_BYTES} bytes")
        if len(op.value) > limits.MAX_VALUE_BYTES:
            raise InvalidArgument(f"value of {len(op.value)} bytes; limit MAX_VALUE_BYTES is {limits.MAX_VALUE_BYTES}")
        size = len(op.key) + len(op.value) + OP_OVERHEAD_BYTES
        if size > self._max_bytes:
            raise InvalidArgument(f"a write of {size} bytes does not fit max_batch_bytes ({self._max_bytes})")
        shard = self._shard_of(op.key)
        future: concurrent.futures.Future[ShardWrite] = concurrent.futures.Future()
        deadline = time.monotonic() + self._put_timeout_s
        with self._cond:
            while self._outstanding >= self._max_buffered and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Overloaded(f"BatchingWriter: {self._outstanding} writes buffered or in flight "
                                     f"(max_buffered_mutations) for {self._put_timeout_s} s; the store is not "
                                     "keeping up. Nothing of this write was sent")
                self._cond.wait(left)
            if self._closed:
                raise InvalidArgument("the BatchingWriter is closed")
            buffer = self._buffers.setdefault(shard, [])
            if not buffer:
                self._oldest[shard] = time.monotonic()
            buffer.append((op, future, size))
            self._buffer_bytes[shard] = self._buffer_bytes.get(shard, 0) + size
            self._outstanding += 1
            if len(buffer) >= self._max_mutations or self._buffer_bytes[shard] >= self._max_bytes:
                self._cond.notify_all()
            elif len(buffer) == 1:
                self._cond.notify_all()  # the flusher may be waiting without a timeout
        return future

    def _ready(self, shard: int, now: float) -> bool:
        if shard in self._busy or not self._buffers.get(shard):
            return False
        return (self._closed or self._urgent > 0 or len(self._buffers[shard]) >= self._max_mutations
                or self._buffer_bytes[shard] >= self._max_bytes or now - self._oldest[shard] >= self._linger_s)

    def _take(self, now: float) -> dict[int, list[_Entry]]:
        """The next call's parts: every ready shard's oldest writes, within the call's bounds."""
        taken: dict[int, list[_Entry]] = {}
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
        return taken

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._closed and not self._buffers and self._calls == 0:
                    return
                now = time.monotonic()
                if self._calls < self._max_in_flight:
                    taken = self._take(now)
                    if taken:
                        self._busy.update(taken)
                        self._sending.update(taken)
                        self._calls += 1
                        self.batches += 1
                        self.mutations += sum(len(entries) for entries in taken.values())
                        self._pool.submit(self._send, taken)
                        continue
                waits = [self._oldest[s] + self._linger_s - now for s in self._buffers
                         if s not in self._busy and self._buffers[s]]
                self._cond.wait(max(0.0, min(waits)) if waits and self._calls < self._max_in_flight else None)

    def _send(self, taken: dict[int, list[_Entry]]) -> None:
        ops = [op for entries in taken.values() for op, _, _ in entries]
        settle: list[Callable[[], None]] = []
        try:
            result = self._client.write_batch(ops, timeout_s=self._call_timeout_s)
            parts = {part.shard: part for part in result.shards}
            for shard, entries in taken.items():
                settle.extend(_resolve(future, parts[shard]) for _, future, _ in entries)
        except BatchIncomplete as incomplete:
            for shard, entries in taken.items():
                part = incomplete.committed.get(shard)
                outcome: ShardWrite | BaseException = part if part is not None else incomplete.errors[shard]
                settle.extend(_resolve(future, outcome) for _, future, _ in entries)
        except BaseException as exc:  # every future must end, whatever went wrong
            if not isinstance(exc, KvError):
                exc = UnknownOutcome(f"the batch failed unexpectedly: {exc!r}; its outcome is unknown")
            settle.extend(_resolve(future, exc) for entries in taken.values() for _, future, _ in entries)
        finally:
            with self._cond:
                for shard, entries in taken.items():
                    self._busy.discard(shard)
                    self._sending.pop(shard, None)
                    self._outstanding -= len(entries)
                self._calls -= 1
                self._cond.notify_all()
        for resolve in settle:  # outside the lock: callbacks run here
            resolve()


def _resolve(future: concurrent.futures.Future[ShardWrite],
             outcome: ShardWrite | BaseException) -> Callable[[], None]:
    if isinstance(outcome, BaseException):
        return lambda: future.set_exception(outcome)
    return lambda: future.set_result(outcome)
