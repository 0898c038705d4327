"""`AsyncBatchingWriter`: `BatchingWriter` for asyncio programs (`kvstore.client.batching` says
why it is built so: bounded, lingering, per-shard order, honest outcomes).

The same buffer (`kvstore.client.batch_buffer.BatchBuffer`) and the same outcomes; a task sends
the batches instead of a thread, `AsyncClient.write_batch` instead of `Client.write_batch`.
`put` and `delete` are coroutines that return once the write is buffered (waiting for room while
`max_buffered_mutations` are outstanding: backpressure, then `Overloaded`), with an
`asyncio.Future` of its `ShardWrite`, as aiokafka's `send`:

    async with AsyncBatchingWriter(client) as writer:
        futures = [await writer.put(f"k{i}", "v") for i in range(10_000)]
        results = await asyncio.gather(*futures, return_exceptions=True)

Cancelling a returned future only stops waiting for it: the write is still sent, and its outcome
is then unknown to the caller (read the key). One writer per event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
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
from kvstore.client.errors import DeadlineExceeded, InvalidArgument, KvError, Overloaded
from kvstore.client.requests import BytesLike, Op
from kvstore.client.results import BatchResult, ShardWrite
from kvstore.core.sharding import shard_of

if TYPE_CHECKING:
    from kvstore.client.aio import AsyncClient

_Future = asyncio.Future[ShardWrite]
log = logging.getLogger("kvstore.client")


class AsyncBatchingWriter:
    """Collects writes from many tasks into WriteBatch calls. Use with `async with`, or await
    `close()`: it sends what is buffered and waits for the answers. The options are
    `BatchingWriter`'s, with the same defaults."""

    def __init__(
        self,
        client: AsyncClient,
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
        self._buffer: BatchBuffer[_Future] = BatchBuffer.for_writer(
            max_batch_mutations=max_batch_mutations, max_batch_bytes=max_batch_bytes, linger_ms=linger_ms,
            max_buffered_mutations=max_buffered_mutations, max_in_flight=max_in_flight, call_timeout_s=call_timeout_s,
            put_timeout_s=put_timeout_s)
        self._shard_count: int | None = None
        self._changed = asyncio.Event()  # the sender's wake-up: a write, a flush, an answer, close
        self._room = asyncio.Event()  # writers waiting for room: an answer freed some
        self._sender: asyncio.Task[None] | None = None  # started by the first write (needs a running loop)
        self._sends: set[asyncio.Task[None]] = set()  # held until done: a task nobody references may be collected
        self._started: set[int] = set()  # the calls (`id` of their `taken`) whose `_send` began

    @property
    def batches(self) -> int:
        """Calls made."""
        return self._buffer.batches

    @property
    def mutations(self) -> int:
        """Mutations sent."""
        return self._buffer.mutations

    # -- the API ---------------------------------------------------------------------------------

    async def put(self, key: BytesLike, value: BytesLike) -> _Future:
        """Buffer a put; returns the future of its `ShardWrite` (await it for the outcome)."""
        return await self._add(Op.put(key, value))

    async def delete(self, key: BytesLike) -> _Future:
        """Buffer a delete; returns the future of its `ShardWrite`."""
        return await self._add(Op.delete(key))

    async def flush(self, timeout_s: float | None = None) -> None:
        """Send what is buffered now, without lingering, and wait until every write made before
        this call was answered (each future is then done, with its result or its error)."""
        waiting = list(self._buffer.waiting())
        if not waiting:
            return
        self._buffer.urgent += 1
        self._changed.set()
        try:
            _done, not_done = await asyncio.wait(waiting, timeout=timeout_s)
        finally:
            self._buffer.urgent -= 1
        if not_done:
            raise DeadlineExceeded(f"flush: {len(not_done)} writes not answered within {timeout_s} s")

    async def close(self, timeout_s: float | None = None) -> None:
        """Stop taking writes, send the buffered ones and wait for their answers."""
        if self._buffer.closed:
            return
        self._buffer.closed = True
        self._changed.set()
        self._room.set()  # writers waiting for room learn it is closed
        if self._sender is None:
            return
        done, _ = await asyncio.wait([self._sender], timeout=timeout_s)
        if not done:
            raise DeadlineExceeded(f"close: writes still outstanding after {timeout_s} s")
        if not self._sender.cancelled() and self._sender.exception() is not None:
            raise KvError(f"the AsyncBatchingWriter's sender failed: {self._sender.exception()!r}")

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- internals -------------------------------------------------------------------------------

    async def _shard_of(self, key: bytes) -> int:
        if self._shard_count is None:
            count = (await self._client.shard_map()).shard_count
            if count <= 0:
                raise DeadlineExceeded("the cluster's shard count is not known yet (no shard map); nothing was sent")
            self._shard_count = count
        return shard_of(key, self._shard_count)

    async def _add(self, op: Op) -> _Future:
        size = write_size(op, self._max_bytes)
        shard = await self._shard_of(op.key)
        deadline = time.monotonic() + self._put_timeout_s
        while self._buffer.full and not self._buffer.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Overloaded(f"AsyncBatchingWriter: {self._buffer.outstanding} writes buffered or in flight "
                                 f"(max_buffered_mutations) for {self._put_timeout_s} s; the store is not keeping "
                                 "up. Nothing of this write was sent")
            self._room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room.wait(), left)
        if self._buffer.closed:
            raise InvalidArgument("the AsyncBatchingWriter is closed")
        future: _Future = asyncio.get_running_loop().create_future()
        if self._buffer.add(shard, op, future, size, time.monotonic()):
            self._changed.set()
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._run(), name="kvstore-batching-writer")
            self._sender.add_done_callback(self._sender_ended)
        return future

    def _sender_ended(self, task: asyncio.Task[None]) -> None:
        """The sender ended. Normally after close, with nothing left; if it was cancelled or
        failed (a loop shutting down), no write buffered now will ever be sent: each fails
        definitely, and the writer takes no more."""
        why = "cancelled" if task.cancelled() else repr(task.exception()) if task.exception() else ""
        dropped = self._buffer.drop_buffered()
        self._room.set()
        for future in dropped:
            if not future.done():
                future.set_exception(KvError(f"the AsyncBatchingWriter's sender stopped ({why or 'closed'}): this "
                                             "write was never sent"))
        if why:
            log.warning("the AsyncBatchingWriter's sender stopped (%s): %d buffered writes failed, never sent", why,
                        len(dropped))

    async def _run(self) -> None:
        while not self._buffer.finished:
            now = time.monotonic()
            taken = self._buffer.take(now)
            if taken:
                task = asyncio.get_running_loop().create_task(self._send(taken))
                self._sends.add(task)
                task.add_done_callback(functools.partial(self._send_ended, taken=taken))
                continue
            self._changed.clear()
            with contextlib.suppress(TimeoutError):  # a linger ended
                await asyncio.wait_for(self._changed.wait(), self._buffer.sleep_s(now))

    def _send_ended(self, task: asyncio.Task[None], *, taken: dict[int, list[Entry[_Future]]]) -> None:
        """A send task cancelled before its first step never ran `_send` (nor its `finally`): its
        call never started, so its writes fail definitely and its shards are released."""
        self._sends.discard(task)
        if id(taken) in self._started:
            self._started.discard(id(taken))
            return
        self._buffer.done(taken)
        self._changed.set()
        self._room.set()
        for _, future, _ in (entry for entries in taken.values() for entry in entries):
            if not future.done():
                future.set_exception(KvError("the AsyncBatchingWriter's send was cancelled before it started: this "
                                             "write was never sent"))

    async def _send(self, taken: dict[int, list[Entry[_Future]]]) -> None:
        self._started.add(id(taken))
        ops = [op for entries in taken.values() for op, _, _ in entries]
        answer: BatchResult | BaseException
        try:
            answer = await self._client.write_batch(ops, timeout_s=self._call_timeout_s)
        except BaseException as exc:  # every future must end, whatever went wrong (even this task cancelled)
            answer = exc
        finally:
            self._buffer.done(taken)
            self._changed.set()
            self._room.set()
        for future, outcome in outcomes(taken, answer):  # a cancellation: unknown, the call may have landed
            if future.done():  # the caller cancelled it: it stopped waiting, the write went anyway
                continue
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        if isinstance(answer, asyncio.CancelledError):
            raise answer
