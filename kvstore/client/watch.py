"""`Watch`: a running watch, an iterator of changes.

Every watch stream starts with the server's `created` event, sent once the watcher is
registered. Opening a watch waits for it, so when `Client.watch` returns, every change applied
from then on will be delivered: a caller (or a test) writes right after opening instead of
sleeping and hoping the watch got there first. The event is consumed here; iterating yields
changes only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from kvstore.client.errors import DeadlineExceeded, KvError, NotLeader, Unavailable, error_from_rpc
from kvstore.client.results import WatchEvent
from kvstore.client.retry import RetryAction, retry_action
from kvstore.v1 import kv_pb2

if TYPE_CHECKING:
    from kvstore.client.client import Client


class Watch(Iterator[WatchEvent]):
    """A running watch: iterate for changes; `cancel()` ends it (from any thread).

    Opening (until the server's `created` event) is retried like any call: bounded attempts,
    leader hints, the next endpoint, within the open deadline. Once registered, a failed stream
    is reopened only when that can neither lose nor repeat a change: nothing was delivered yet
    and the watch replays from a start revision. Otherwise the error is raised to the caller,
    who knows the last revision it saw of each shard and can watch again from there with
    `start_revisions` (a watch "from now" that broke may have missed changes meanwhile, and the
    shards it saw nothing of have no position the client could resume from).

    It reaches the client only through its public retry seam (`route`, `connection`, `reroute`
    and the limits), so the client's routing and backoff can change without breaking it.
    """

    def __init__(self, client: Client, request: kv_pb2.WatchRequest, key: bytes | None, timeout_s: float | None):
        self._client = client
        self._request = request
        self._key = key
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._cancelled = False
        self._delivered = False
        self._attempts = 0
        self._hint: str | None = None
        self._stream: Any = None
        self._target = ""
        self._open()

    # -- opening -----------------------------------------------------------------------------

    def _open(self) -> None:
        """Open the stream and wait for `created`, retrying as the policy says; raises the last
        error when it gives up. Returns early (with no stream) when cancelled meanwhile."""
        budget = self._timeout_s if self._timeout_s is not None else self._client.timeout_s
        deadline = time.monotonic() + budget
        while True:
            self._attempts += 1
            try:
                self._open_once(deadline)
                return
            except KvError as error:
                if self._cancelled:
                    return
                if (retry_action(error) is RetryAction.FAIL or self._attempts >= self._client.max_attempts
                        or deadline - time.monotonic() <= 0):
                    error.attempts = self._attempts
                    raise
                self._prepare_retry(error, deadline)

    def _open_once(self, deadline: float) -> None:
        target = self._hint or self._client.route(self._key, deadline)
        conn = self._client.connection(target)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded("deadline exceeded before the watch was opened", target=target)
        with self._lock:
            if self._cancelled:
                return
            self._target = target
            self._stream = stream = conn.kv.Watch(self._request, timeout=self._timeout_s)
        # A node that does not register the watch in time (paused, cut off) is given up on: the
        # stream is cancelled under the blocked `next`. The per-attempt cap sends us to another
        # node; the open deadline ends the tries.
        cap = min(remaining, self._client.attempt_timeout_s)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            stream.cancel()

        timer = threading.Timer(cap, expire)
        timer.daemon = True
        timer.start()
        try:
            first = next(stream)
        except StopIteration:
            raise Unavailable(f"{target} ended the watch before registering it", target=target) from None
        except grpc.RpcError as exc:
            if self._cancelled:
                return
            if expired.is_set():
                if cap < remaining:
                    raise Unavailable(f"{target} did not register the watch within {cap:.1f}s",
                                      target=target) from None
                raise DeadlineExceeded(f"{target} did not register the watch before the deadline",
                                       target=target) from None
            raise error_from_rpc(exc, target=target) from None
        finally:
            timer.cancel()
        if not isinstance(first, kv_pb2.WatchResponse) or first.type != kv_pb2.WatchResponse.TYPE_CREATED:
            stream.cancel()
            raise KvError(f"{target} did not start the watch with a `created` event (a server older than this "
                          f"client?)", target=target)

    def _prepare_retry(self, error: KvError, deadline: float | None) -> None:
        """Where the next attempt goes: the hinted leader at once, else another node after a
        backoff (bounded by `deadline`; None: the client's whole backoff)."""
        if isinstance(error, NotLeader) and error.leader_hint and error.leader_hint != self._target:
            self._hint = error.leader_hint
            return
        self._hint = None
        self._client.reroute(self._target, self._attempts, deadline)

    # -- iterating ---------------------------------------------------------------------------

    def __iter__(self) -> Watch:
        return self

    def __next__(self) -> WatchEvent:
        while True:
            with self._lock:
                stream = self._stream
                if self._cancelled or stream is None:
                    raise StopIteration
            try:
                event = next(stream)
            except StopIteration:
                raise
            except grpc.RpcError as exc:
                if self._cancelled:
                    raise StopIteration from None
                error = error_from_rpc(exc, target=self._target)
                replayable = not self._delivered and (self._request.HasField("start_revision")
                                                      or bool(self._request.start_revisions))
                if not replayable or retry_action(error) is RetryAction.FAIL \
                        or self._attempts >= self._client.max_attempts:
                    error.attempts = self._attempts
                    raise error from None
                self._prepare_retry(error, None)  # a reopen has no deadline: the whole backoff
                self._open()
                continue
            if not isinstance(event, kv_pb2.WatchResponse):
                raise KvError(f"unexpected watch message: {type(event).__name__}", target=self._target)
            if event.type == kv_pb2.WatchResponse.TYPE_CREATED:
                continue  # only ever first, and consumed by `_open`; never a change
            self._delivered = True
            return WatchEvent.from_pb(event)

    def cancel(self) -> None:
        """End the watch; a thread blocked in `next()` gets StopIteration."""
        with self._lock:
            self._cancelled = True
            stream = self._stream
        if stream is not None:
            stream.cancel()

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()
