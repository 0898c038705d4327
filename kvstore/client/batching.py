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
  outcome is the caller's to resolve (read the key). Cancelling a future only stops waiting for
  it: the write is still sent.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Self

from kvstore.client.batch_buffer import (
    DEFAULT_LINGER_MS,
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_MAX_BATCH_MUTATIONS,
    DEFAULT_MAX_BUFFERED_MUTATIONS,
    DEFAULT_MAX_IN_FLIGHT,
    BatchBuffer,
    Entry,
    outcomes,
    write_size,
)
from kvstore.client.errors import DeadlineExceeded, InvalidArgument, Overloaded
from kvstore.client.requests import BytesLike, Op
from kvstore.client.results import BatchResult, ShardWrite
from kvstore.core.sharding import shard_of

if TYPE_CHECKING:
    from kvstore.client.client import Client

_Future = concurrent.futures.Future[ShardWrite]


class BatchingWriter:
    """Collects writes from many threads into WriteBatch calls; thread-safe. Use as a context
    manager, or call `close()`: it sends what is buffered and waits for the answers.

    `put` and `delete` return a `concurrent.futures.Future` of the write's `ShardWrite`; call
    `.result()` to wait for it. `flush()` waits for everything written before it. The buffer's
    rules are `kvstore.client.batch_buffer`'s, shared with `AsyncBatchingWriter`.
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
        self._client = client
        self._max_bytes = max_batch_bytes
        self._call_timeout_s = call_timeout_s
        self._put_timeout_s = put_timeout_s
        self._cond = threading.Condition()
        self._buffer: BatchBuffer[_Future] = BatchBuffer.for_writer(
            max_batch_mutations=max_batch_mutations, max_batch_bytes=max_batch_bytes, linger_ms=linger_ms,
            max_buffered_mutations=max_buffered_mutations, max_in_flight=max_in_flight, call_timeout_s=call_timeout_s,
            put_timeout_s=put_timeout_s)
        self._shard_count: int | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_in_flight, thread_name_prefix="kvstore-batch")
        self._thread = threading.Thread(target=self._run, name="kvstore-batching-writer", daemon=True)
        self._thread.start()

    @property
    def batches(self) -> int:
        """Calls made."""
        return self._buffer.batches

    @property
    def mutations(self) -> int:
        """Mutations sent."""
        return self._buffer.mutations

    # -- the API ---------------------------------------------------------------------------------

    def put(self, key: BytesLike, value: BytesLike) -> _Future:
        return self._add(Op.put(key, value))

    def delete(self, key: BytesLike) -> _Future:
        return self._add(Op.delete(key))

    def flush(self, timeout_s: float | None = None) -> None:
        """Send what is buffered now, without lingering, and wait until every write made before
        this call was answered (each future is then done, with its result or its error)."""
        with self._cond:
            waiting = list(self._buffer.waiting())
            self._buffer.urgent += 1
            self._cond.notify_all()
        try:
            _done, not_done = concurrent.futures.wait(waiting, timeout=timeout_s)
        finally:
            with self._cond:
                self._buffer.urgent -= 1
        if not_done:
            raise DeadlineExceeded(f"flush: {len(not_done)} writes not answered within {timeout_s} s")

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking writes, send the buffered ones and wait for their answers."""
        with self._cond:
            if self._buffer.closed:
                return
            self._buffer.closed = True
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

    def _shard_of(self, key: bytes) -> int:
        if self._shard_count is None:
            self._shard_count = self._client.shard_map().shard_count
            if self._shard_count <= 0:
                self._shard_count = None
                raise DeadlineExceeded("the cluster's shard count is not known yet (no shard map); nothing was sent")
        return shard_of(key, self._shard_count)

    def _add(self, op: Op) -> _Future:
        size = write_size(op, self._max_bytes)
        shard = self._shard_of(op.key)
        future: _Future = concurrent.futures.Future()
        deadline = time.monotonic() + self._put_timeout_s
        with self._cond:
            while self._buffer.full and not self._buffer.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Overloaded(f"BatchingWriter: {self._buffer.outstanding} writes buffered or in flight "
                                     f"(max_buffered_mutations) for {self._put_timeout_s} s; the store is not "
                                     "keeping up. Nothing of this write was sent")
                self._cond.wait(left)
            if self._buffer.closed:
                raise InvalidArgument("the BatchingWriter is closed")
            if self._buffer.add(shard, op, future, size, time.monotonic()):
                self._cond.notify_all()  # the sender may be waiting without a timeout
        return future

    def _run(self) -> None:
        with self._cond:
            while not self._buffer.finished:
                now = time.monotonic()
                taken = self._buffer.take(now)
                if taken:
                    self._pool.submit(self._send, taken)
                    continue
                self._cond.wait(self._buffer.sleep_s(now))

    def _send(self, taken: dict[int, list[Entry[_Future]]]) -> None:
        ops = [op for entries in taken.values() for op, _, _ in entries]
        answer: BatchResult | BaseException
        try:
            answer = self._client.write_batch(ops, timeout_s=self._call_timeout_s)
        except BaseException as exc:  # every future must end, whatever went wrong
            answer = exc
        finally:
            with self._cond:
                self._buffer.done(taken)
                self._cond.notify_all()
        for future, outcome in outcomes(taken, answer):  # outside the lock: callbacks run here
            if not future.set_running_or_notify_cancel():
                continue  # the caller cancelled it: it stopped waiting, the write went anyway
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
