"""`Watch`: a running watch, an iterator of changes.

Every watch stream starts with the server's `created` event, sent once the watcher is
registered. Opening a watch waits for it, so when `Client.watch` returns, every change applied
from then on will be delivered: a caller (or a test) writes right after opening instead of
sleeping and hoping the watch got there first. The event is consumed here; iterating yields
changes only.
"""

from __future__ import annotations

import logging
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

logger = logging.getLogger("kvstore.client")

if TYPE_CHECKING:
    from kvstore.client.client import Client


class WatchResume:
    """Where a watch stands, so that a broken stream is continued exactly (pure; the synchronous
    and the asyncio watch share it).

    The server's `created` event names, per shard, the revision from which the stream delivers
    every change (`start_revisions`). A change's revision is the WAL offset of its record, and
    one record may hold several changes a watch matches (a Txn, a batch), so the position in a
    shard is (revision, changes delivered at it): a resumed stream starts at that revision and
    skips that many changes of it, which the WAL replays in the same order. Nothing is lost,
    nothing repeats. A server that names no start revisions (older than the field) leaves no
    position: `resume` says None."""

    def __init__(self, request: kv_pb2.WatchRequest) -> None:
        self.request = request
        self.starts: dict[int, int] | None = None
        self.delivered_at: dict[int, tuple[int, int]] = {}  # shard -> (revision, changes delivered at it)
        self._skip: dict[int, tuple[int, int]] = {}  # shard -> (revision, changes of it still to skip)
        self.reopens = 0  # resumes since the last change delivered

    def created(self, event: kv_pb2.WatchResponse) -> None:
        """The `created` event of the first stream: every shard's starting revision."""
        if self.starts is None and event.start_revisions:
            self.starts = {b.shard: b.revision for b in event.start_revisions}

    def accept(self, event: kv_pb2.WatchResponse) -> bool:
        """Count a change of the stream; False for one delivered before the break (skip it), and
        for a progress event (taken in, never delivered)."""
        if event.type == kv_pb2.WatchResponse.TYPE_PROGRESS:
            self.progress(event)
            return False
        shard, revision = event.shard, event.kv.mod_revision
        skip = self._skip.pop(shard, None)
        if skip is not None and skip[0] == revision and skip[1] > 0:
            if skip[1] > 1:
                self._skip[shard] = (revision, skip[1] - 1)
            return False
        last = self.delivered_at.get(shard)
        self.delivered_at[shard] = (revision, last[1] + 1 if last is not None and last[0] == revision else 1)
        self.reopens = 0
        return True

    def progress(self, event: kv_pb2.WatchResponse) -> None:
        """A progress event: every change of its shard below its revision was delivered, so the
        watch stands there (a resume starts from it, not from an older revision the WAL may have
        truncated since: a prefix whose keys change rarely in a busy shard)."""
        if self.starts is None:
            return  # no positions kept (a server that names no start revisions)
        for mark in event.start_revisions:
            shard, revision = mark.shard, mark.revision
            last = self.delivered_at.get(shard)
            if (last is not None and last[0] >= revision) or self.starts.get(shard, 0) >= revision:
                continue
            self.starts[shard] = revision
            self.delivered_at.pop(shard, None)
            skip = self._skip.get(shard)
            if skip is not None and skip[0] < revision:
                del self._skip[shard]
            self.reopens = 0

    def resume(self) -> kv_pb2.WatchRequest | None:
        """The request that continues the watch where it stands (None: no position known)."""
        if self.starts is None:
            return None
        positions = dict(self.starts)
        self._skip = {}
        for shard, (revision, delivered) in self.delivered_at.items():
            positions[shard] = revision
            self._skip[shard] = (revision, delivered)
        self.reopens += 1
        request = kv_pb2.WatchRequest(key=self.request.key, prefix=self.request.prefix,
                                      progress_notify=self.request.progress_notify)
        request.start_revisions.extend(kv_pb2.ShardRevision(shard=s, revision=r) for s, r in sorted(positions.items()))
        return request


def reopen_request(resume: WatchResume, request: kv_pb2.WatchRequest, delivered: bool, error: KvError,
                   max_reopens: int) -> kv_pb2.WatchRequest | None:
    """What to open after a stream broke with `error`, or None: raise it. Both watches' rule."""
    if retry_action(error) is RetryAction.FAIL or resume.reopens >= max_reopens:
        return None
    resumed = resume.resume()
    if resumed is not None:
        return resumed
    replays = request.HasField("start_revision") or bool(request.start_revisions)
    if delivered or not replays:  # a server that names no start revisions: no position to resume from
        return None
    resume.reopens += 1
    return request


class Watch(Iterator[WatchEvent]):
    """A running watch: iterate for changes; `cancel()` ends it (from any thread).

    Opening (until the server's `created` event) is retried like any call: bounded attempts,
    leader hints, the next endpoint, within the open deadline. Once registered, a stream that
    breaks is resumed from exactly where it stood (`WatchResume`: the start revisions the server
    named, and the changes delivered since), as etcd's clientv3 does: at most `max_attempts`
    reopens in a row without a change delivered between them. It raises only when resuming
    cannot help: the history it needs was truncated (`Compacted`, naming the log start), a
    definite refusal, the reopens exhausted, or a server too old to name its start revisions
    (then a stream that delivered nothing and replays from a start revision is reopened as is).

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
        self._resume = WatchResume(request)
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
        self._resume.created(first)

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
            except (StopIteration, grpc.RpcError) as exc:
                if self._cancelled:
                    raise StopIteration from None
                # A watch has no end of its own: a stream that ended (an older node stopping) broke.
                error = (error_from_rpc(exc, target=self._target) if isinstance(exc, grpc.RpcError)
                         else Unavailable(f"{self._target} ended the watch", target=self._target))
                request = reopen_request(self._resume, self._request, self._delivered, error,
                                         self._client.max_attempts)
                if request is None:
                    error.attempts = self._attempts
                    raise error from None
                logger.debug("watch at %s broke (%s): resuming at %s", self._target, error.message,
                             [(b.shard, b.revision) for b in request.start_revisions])
                self._request = request
                self._prepare_retry(error, None)  # a reopen has no deadline: the whole backoff
                self._attempts = 0  # each reopen has the attempts of an open
                self._open()
                continue
            if not isinstance(event, kv_pb2.WatchResponse):
                raise KvError(f"unexpected watch message: {type(event).__name__}", target=self._target)
            if event.type == kv_pb2.WatchResponse.TYPE_CREATED or not self._resume.accept(event):
                continue  # `created` is consumed by `_open`; a change delivered before a break is skipped
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
