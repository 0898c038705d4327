"""`AsyncClient`: the client for asyncio programs (FastAPI, aiohttp, grpc.aio services).

The same calls, results, errors, retries and routing as the synchronous `kvstore.client.Client`,
over `grpc.aio` channels: it shares the synchronous client's pure parts (requests built by
`kvstore.client.requests`, results by `kvstore.client.results`, errors mapped by
`kvstore.client.errors`, the retry policy and the attempts' bookkeeping of `kvstore.client.retry`,
the routing of `kvstore.client.transport.Router`) and only awaits where the other blocks. So a
write's outcome means the same here: it returns once committed, raises `UnknownOutcome` (with the
`request_id` and `first_attempt_unix_ms` to retry with) when an attempt may have committed,
`Unreachable` when no attempt reached a node, any other `KvError` when nothing was done.

    async with AsyncClient(["127.0.0.1:50051"]) as client:
        await client.put("greeting", "hello")
        print((await client.get("greeting")).value)
        async with await client.watch(prefix="gr") as changes:
            async for event in changes:
                ...

One client per event loop (its channels belong to the loop that first used them). Retries and
redirects are logged at DEBUG (`kvstore.client`). Every call of the synchronous client is here,
the operators' too (drain, move, fence, transactions in doubt, the placement log: requests and
answers from `kvstore.client.admin`), and `AsyncBatchingWriter` is `BatchingWriter` for asyncio.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from kvstore.client import admin
from kvstore.client.aio_batching import AsyncBatchingWriter
from kvstore.client.batch_rounds import Answer, BatchRounds, CallLost, batch_result
from kvstore.client.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KvError,
    NotLeader,
    TxnAborted,
    Unavailable,
    error_from_rpc,
)
from kvstore.client.moves import MoveProgress, PlacementChange, progress
from kvstore.client.requests import (
    BytesLike,
    Compare,
    Consistency,
    Op,
    batch_parts,
    delete_request,
    get_request,
    make_first_attempt_unix_ms,
    make_request_id,
    put_request,
    scan_request,
    txn_request,
    txn_route_key,
    watch_request,
)
from kvstore.client.results import (
    BatchResult,
    DeleteResult,
    FenceResult,
    GetResult,
    KeyValue,
    PlacementLog,
    PreparedTxn,
    PutResult,
    ReadHeader,
    ScanPage,
    ShardMap,
    ShardWrite,
    TransactionInfo,
    TxnResolution,
    TxnResult,
    WatchEvent,
    txn_result,
)
from kvstore.client.retry import (
    DEFAULT_ATTEMPT_TIMEOUT_S,
    DEFAULT_MAX_BACKOFF_S,
    AttemptLog,
    RetryAction,
    backoff_delay,
    capped_attempt_error,
    check_client_options,
    deadline_of,
    retry_action,
)
from kvstore.client.security import ClientSecurity
from kvstore.client.transport import (
    CHANNEL_OPTIONS,
    CLUSTER_METHODS,
    DEFAULT_MAX_CHANNELS,
    MAP_FETCH_TIMEOUT_S,
    ROUTED,
    Conn,
    Router,
)
from kvstore.client.watch import WatchResume, reopen_request
from kvstore.limits import MAX_REQUEST_BYTES
from kvstore.v1 import cluster_pb2, cluster_pb2_grpc, kv_pb2, kv_pb2_grpc

__all__ = ["AioChannels", "AsyncBatchingWriter", "AsyncClient", "AsyncWatch"]
log = logging.getLogger("kvstore.client")
R = TypeVar("R", bound=Message)
T = TypeVar("T")


class AioChannels:
    """One `grpc.aio` channel per node address, opened on first use; at most `max_channels`, the
    least recently used closed first (after `evicted_grace_s`, so calls in flight on it finish;
    a watch on it is then cut and resumes). After `close()` every use raises `KvError`."""

    def __init__(self, max_channels: int, credentials: grpc.ChannelCredentials | None, *,
                 evicted_grace_s: float) -> None:
        self._max = max_channels
        self._grace_s = evicted_grace_s
        self._credentials = credentials
        self._conns: collections.OrderedDict[str, Conn] = collections.OrderedDict()
        self._closed = False
        self._closing: dict[asyncio.Task[None], grpc.aio.Channel] = {}  # evicted channels in their grace

    def get(self, target: str) -> Conn:
        if self._closed:
            raise KvError("the client is closed", target=target)
        conn = self._conns.get(target)
        if conn is not None:
            self._conns.move_to_end(target)
            return conn
        channel = (grpc.aio.secure_channel(target, self._credentials, options=CHANNEL_OPTIONS)
                   if self._credentials is not None else grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS))
        kv_stub: Any = kv_pb2_grpc.KVServiceStub
        cluster_stub: Any = cluster_pb2_grpc.ClusterServiceStub
        conn = Conn(channel, kv_stub(channel), cluster_stub(channel))
        self._conns[target] = conn
        if len(self._conns) > self._max:
            evicted = self._conns.popitem(last=False)[1]
            # With a grace: calls in flight on it (a batch round's, this one's) finish, each within its deadline.
            task = asyncio.get_running_loop().create_task(evicted.channel.close(grace=self._grace_s))
            self._closing[task] = evicted.channel  # held until done: a task nobody references may be collected
            task.add_done_callback(lambda done: self._closing.pop(done, None))
        return conn

    async def close(self) -> None:
        """Close every channel; calls in flight on them (and watches) end with CANCELLED."""
        self._closed = True
        conns = list(self._conns.values())
        self._conns.clear()
        evicted = list(self._closing.values())  # in their grace: closed now, not after it
        await asyncio.gather(*(conn.channel.close() for conn in conns), *(channel.close() for channel in evicted))
        await asyncio.gather(*self._closing)


class AsyncClient:
    """A connection to a kvstore cluster for one event loop. The arguments are the synchronous
    `Client`'s (`kvstore.client.Client`), with the same defaults and meaning."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float = 5.0,
        max_attempts: int = 6,
        backoff_s: float = 0.05,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        max_channels: int = DEFAULT_MAX_CHANNELS,
        attempt_timeout_s: float = DEFAULT_ATTEMPT_TIMEOUT_S,
        security: ClientSecurity | None = None,
    ) -> None:
        seeds = check_client_options(endpoints, timeout_s=timeout_s, max_attempts=max_attempts,
                                     backoff_s=backoff_s, max_backoff_s=max_backoff_s, max_channels=max_channels,
                                     attempt_timeout_s=attempt_timeout_s)
        self._timeout_s = timeout_s
        self._max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._attempt_timeout_s = attempt_timeout_s
        self._router = Router(seeds)
        self._security = security if security is not None else ClientSecurity.from_env()
        self._channels = AioChannels(max_channels, self._security.credentials(),
                                     evicted_grace_s=min(max(timeout_s, attempt_timeout_s), 60.0))
        self._rng = random.Random()

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every channel; calls in flight (and watches) end with `Cancelled`."""
        await self._channels.close()

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The seeds, then the nodes learned from shard maps."""
        return self._router.endpoints

    # -- the API: as `Client`'s (see its methods for what each means) --------------------------

    async def get(self, key: BytesLike, consistency: Consistency = "linearizable", min_revision: int | None = None,
                  *, timeout_s: float | None = None) -> GetResult:
        """Read one key (`Client.get`)."""
        k, request = get_request(key, consistency, min_revision)
        resp = await self._call("Get", request, kv_pb2.GetResponse, key=k, stale=consistency == "stale",
                                timeout_s=timeout_s)
        return GetResult.from_pb(k, resp)

    async def put(self, key: BytesLike, value: BytesLike, request_id: str | None = None, *,
                  timeout_s: float | None = None, first_attempt_unix_ms: int | None = None) -> PutResult:
        """Write one key; answered once committed (`Client.put`: ids and outcomes)."""
        k, request = put_request(key, value, request_id, first_attempt_unix_ms)
        resp = await self._call("Put", request, kv_pb2.PutResponse, key=k, timeout_s=timeout_s,
                                request_id=request.request_id, write=True,
                                first_attempt_unix_ms=request.first_attempt_unix_ms)
        return PutResult.from_pb(k, resp, request.request_id)

    async def delete(self, key: BytesLike, request_id: str | None = None, *, timeout_s: float | None = None,
                     first_attempt_unix_ms: int | None = None) -> DeleteResult:
        """Delete one key (`Client.delete`)."""
        k, request = delete_request(key, request_id, first_attempt_unix_ms)
        resp = await self._call("Delete", request, kv_pb2.DeleteResponse, key=k, timeout_s=timeout_s,
                                request_id=request.request_id, write=True,
                                first_attempt_unix_ms=request.first_attempt_unix_ms)
        return DeleteResult.from_pb(k, resp, request.request_id)

    async def txn(self, compares: Sequence[Compare] = (), success: Sequence[Op] = (), failure: Sequence[Op] = (),
                  request_id: str | None = None, *, timeout_s: float | None = None,
                  first_attempt_unix_ms: int | None = None) -> TxnResult:
        """Compare-and-write over keys of any shards (`Client.txn`: a cross-shard one that aborts
        is tried again under a fresh id only when this call chose the id)."""
        first_ms = make_first_attempt_unix_ms(first_attempt_unix_ms, request_id)
        deadline = deadline_of(timeout_s, self._timeout_s)
        route = txn_route_key(compares, success, failure, await self._known_shard_count(deadline))
        request = txn_request(compares, success, failure, first_ms)
        for fresh in range(self._max_attempts):  # bounded: each round also spends the deadline
            rid = make_request_id(request_id)
            request.request_id = rid
            try:
                resp = await self._call("Txn", request, kv_pb2.TxnResponse, key=route, deadline=deadline,
                                        request_id=rid, write=True,
                                        first_attempt_unix_ms=request.first_attempt_unix_ms)
                break
            except TxnAborted:
                if request_id is not None or fresh + 1 >= self._max_attempts or deadline - time.monotonic() <= 0:
                    raise
                log.debug("txn %s aborted: trying again under a fresh request id", rid)
                request.first_attempt_unix_ms = make_first_attempt_unix_ms(None, None)
                await self._sleep_backoff(fresh + 1, deadline)
        return txn_result(resp, success, failure, rid)

    async def write_batch(self, ops: Iterable[Op], request_id: str | None = None, *, timeout_s: float | None = None,
                          first_attempt_unix_ms: int | None = None) -> BatchResult:
        """Many puts and deletes spanning shards, one WAL record per shard, one call per leader in
        parallel (`Client.write_batch`: each part's request id, `BatchIncomplete`, the limits)."""
        rid = make_request_id(request_id)
        first_ms = make_first_attempt_unix_ms(first_attempt_unix_ms, request_id)
        deadline = deadline_of(timeout_s, self._timeout_s)
        shard_count = await self._known_shard_count(deadline)
        if shard_count is None:
            raise DeadlineExceeded("no node answered the shard map, so the batch could not be split by shard; "
                                   "nothing was sent", request_id=rid, first_attempt_unix_ms=first_ms)
        parts = batch_parts(ops, shard_count, rid, first_ms)
        committed, failed = await self._batch_attempts(parts, deadline)
        return batch_result(parts, committed, failed, rid, first_ms)

    async def put_many(self, items: Mapping[BytesLike, BytesLike] | Iterable[tuple[BytesLike, BytesLike]],
                       request_id: str | None = None, *, timeout_s: float | None = None,
                       first_attempt_unix_ms: int | None = None) -> BatchResult:
        """`write_batch` of puts (`Client.put_many`)."""
        pairs = items.items() if isinstance(items, Mapping) else items
        return await self.write_batch([Op.put(k, v) for k, v in pairs], request_id, timeout_s=timeout_s,
                                      first_attempt_unix_ms=first_attempt_unix_ms)

    async def scan(self, start: BytesLike = b"", end: BytesLike = b"", prefix: BytesLike = b"", limit: int = 0,
                   consistency: Consistency = "linearizable", *, page_token: bytes = b"", keys_only: bool = False,
                   min_revisions: Mapping[int, int] | None = None, timeout_s: float | None = None) -> ScanPage:
        """One page of a range or a prefix, in key order across all shards (`Client.scan`)."""
        request = scan_request(start, end, prefix, limit, consistency, keys_only, min_revisions)
        request.page_token = page_token
        resp = await self._call("Scan", request, kv_pb2.ScanResponse, key=None, timeout_s=timeout_s)
        return ScanPage(tuple(KeyValue.from_pb(kv) for kv in resp.kvs), resp.next_page_token,
                        tuple(ReadHeader.from_pb(h) for h in resp.headers))

    async def scan_all(self, start: BytesLike = b"", end: BytesLike = b"", prefix: BytesLike = b"", limit: int = 0,
                       consistency: Consistency = "linearizable", *, keys_only: bool = False,
                       min_revisions: Mapping[int, int] | None = None,
                       timeout_s: float | None = None) -> AsyncIterator[KeyValue]:
        """Every key of the range, page by page, each page a call with its own deadline."""
        scan_request(start, end, prefix, limit, consistency, keys_only, min_revisions)  # fail early
        token = b""
        while True:
            page = await self.scan(start, end, prefix, limit, consistency, page_token=token, keys_only=keys_only,
                                   min_revisions=min_revisions, timeout_s=timeout_s)
            for kv in page.kvs:
                yield kv
            if not page.next_page_token:
                return
            token = page.next_page_token

    async def watch(self, key: BytesLike = b"", prefix: BytesLike = b"", start_revision: int | None = None, *,
                    start_revisions: Mapping[int, int] | None = None,
                    timeout_s: float | None = None) -> AsyncWatch:
        """Changes to `key` or under `prefix` (`Client.watch`); returns once the server registered
        the watch, so every change applied from then on is delivered. `async for` over it;
        `cancel()` or leaving its `async with` ends it."""
        routed_by, request = watch_request(key, prefix, start_revision, start_revisions)
        watch = AsyncWatch(self, request, routed_by, timeout_s)
        await watch.open()
        return watch

    async def shard_map(self, *, timeout_s: float | None = None) -> ShardMap:
        """The current shard map from any endpoint (and the routing cache refreshed)."""
        deadline = deadline_of(timeout_s, self._timeout_s)
        cap_s = MAP_FETCH_TIMEOUT_S if len(self._router.endpoints) > 1 else None
        attempts = AttemptLog(write=False)
        while attempts.attempts < self._max_attempts and deadline - time.monotonic() > 0:
            attempt = attempts.started()
            target = self._router.any_endpoint()
            try:
                return await self._fetch_map(target, deadline, cap_s)
            except KvError as error:
                self._router.rotate(target)
                # A deadline here is the per-endpoint cap (a node not answering): the next one.
                if attempts.failed(error) is RetryAction.FAIL and not isinstance(error, DeadlineExceeded):
                    raise attempts.raised(error) from None
                log.debug("shard map from %s failed (%s): trying the next endpoint", target, error.message)
            if attempt % len(self._router.endpoints) == 0:  # every endpoint tried: back off
                await self._sleep_backoff(attempt, deadline)
        raise attempts.gave_up(deadline_passed=deadline - time.monotonic() <= 0)

    # -- the operators' calls (`Client`'s; requests and answers from `kvstore.client.admin`) ------

    async def list_transactions(self, older_than_ms: int = 0, *,
                                timeout_s: float | None = None) -> list[TransactionInfo]:
        """Shards whose WAL transaction has been open at least `older_than_ms`."""
        return await self._admin(admin.list_transactions(older_than_ms), timeout_s)

    async def prepared_transactions(self, older_than_ms: int = 0, *,
                                    timeout_s: float | None = None) -> tuple[list[PreparedTxn], list[str]]:
        """Cross-shard transactions prepared and not resolved, and the members that did not answer."""
        return await self._admin(admin.prepared_transactions(older_than_ms), timeout_s)

    async def resolve_transaction(self, txn_id: str, *, timeout_s: float | None = None) -> TxnResolution:
        """Resolve a prepared cross-shard transaction now (`Client.resolve_transaction`)."""
        return await self._admin(admin.resolve_transaction(txn_id), timeout_s)

    async def fence(self, shard: int, *, timeout_s: float | None = None) -> FenceResult:
        """Force-terminate `shard`'s WAL transaction (`Client.fence`)."""
        return await self._admin(admin.fence(shard), timeout_s)

    async def drain(self, node_id: str, *, undo: bool = False, force: bool = False, epoch: int | None = None,
                    timeout_s: float | None = None) -> list[PlacementChange]:
        """Move every shard off `node_id` (`Client.drain`: refusals, `epoch`)."""
        admin.check_drain(node_id)
        epoch = admin.placement_epoch(await self.shard_map()) if epoch is None else epoch
        return await self._admin(admin.drain(node_id, undo=undo, force=force, epoch=epoch), timeout_s)

    async def placement_log(self, limit: int = 50, *, timeout_s: float | None = None) -> PlacementLog:
        """The placement log's newest decisions, with their reasons."""
        return await self._admin(admin.placement_log(limit), timeout_s)

    async def move_shard(self, shard: int, to_node: str = "", from_node: str = "", *, unpin: bool = False,
                         epoch: int | None = None, timeout_s: float | None = None) -> list[PlacementChange]:
        """Move one replica of `shard`, or unpin it (`Client.move_shard`)."""
        admin.check_move(shard, to_node, unpin)
        epoch = admin.placement_epoch(await self.shard_map()) if epoch is None else epoch
        return await self._admin(admin.move_shard(shard, to_node=to_node, from_node=from_node, unpin=unpin,
                                                  epoch=epoch), timeout_s)

    async def wait_moves(self, changes: Sequence[PlacementChange], *, timeout_s: float, poll_s: float = 1.0,
                         on_progress: Callable[[MoveProgress], None] | None = None) -> MoveProgress:
        """Poll the shard map until `changes` are done or `timeout_s` passed (`Client.wait_moves`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            current = progress(await self.shard_map(), changes)
            if on_progress is not None:
                on_progress(current)
            if current.done or time.monotonic() + poll_s > deadline:
                return current
            await asyncio.sleep(poll_s)

    async def _admin(self, call: admin.AdminCall[T], timeout_s: float | None) -> T:
        return call.result(await self._call(call.method, call.request, call.response_type, key=None,
                                            timeout_s=timeout_s))

    # -- the retry seam `AsyncWatch` uses --------------------------------------------------------

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def max_attempts(self) -> int:
        return self._max_attempts

    @property
    def attempt_timeout_s(self) -> float:
        return self._attempt_timeout_s

    async def route(self, key: bytes | None, deadline: float) -> str:
        """Where an attempt about `key` goes (`Client.route`)."""
        return await self._route(key, deadline)

    def connection(self, target: str) -> Conn:
        return self._channels.get(target)

    async def reroute(self, failed: str, attempt: int, deadline: float | None = None) -> None:
        """After a failed attempt that named no better node (`Client.reroute`)."""
        self._router.invalidate()
        self._router.rotate(failed)
        await self._sleep_backoff(attempt, time.monotonic() + self._max_backoff_s if deadline is None else deadline)

    # -- internals ---------------------------------------------------------------------------

    async def _fetch_map(self, target: str, deadline: float, cap_s: float | None) -> ShardMap:
        remaining = deadline - time.monotonic()
        timeout = min(remaining, cap_s) if cap_s is not None else remaining
        try:
            resp = await self._invoke(target, "ShardMap", cluster_pb2.ShardMapRequest(), max(timeout, 0.001))
        except grpc.RpcError as exc:  # grpc.aio.AioRpcError, or a test's fake
            raise error_from_rpc(exc, target=target) from None
        if not isinstance(resp, cluster_pb2.ShardMapResponse):
            raise KvError(f"unexpected response from {target}: {type(resp).__name__}", target=target)
        smap = ShardMap.from_pb(resp)
        self._router.learn(smap)
        return smap

    async def _cached_map(self, deadline: float) -> ShardMap | None:
        cached = self._router.cached()
        if cached is not None:
            return cached
        for _ in range(len(self._router.endpoints)):
            if deadline - time.monotonic() <= 0:
                return None
            target = self._router.any_endpoint()
            try:
                smap = await self._fetch_map(target, deadline, MAP_FETCH_TIMEOUT_S)
            except KvError:
                self._router.rotate(target)
                continue
            return smap if smap.shard_count > 0 else None
        return None

    async def _known_shard_count(self, deadline: float) -> int | None:
        known = self._router.shard_count()
        if known is not None:
            return known
        smap = await self._cached_map(deadline)
        return smap.shard_count if smap is not None else None

    async def _route(self, key: bytes | None, deadline: float, *, stale: bool = False) -> str:
        if key is None:
            return self._router.any_endpoint()
        smap = await self._cached_map(deadline)
        if smap is None:
            return self._router.any_endpoint()
        return self._router.replica_for(key, smap) if stale else self._router.leader_for(key, smap)

    async def _invoke(self, target: str, method: str, request: Message, timeout: float) -> Message:
        """One attempt: one unary RPC to one node. Raises `grpc.aio.AioRpcError`."""
        conn = self._channels.get(target)
        stub = conn.cluster if method in CLUSTER_METHODS else conn.kv
        response: Message = await getattr(stub, method)(request, timeout=timeout, metadata=ROUTED)
        return response

    async def _invoke_many(self, calls: Sequence[tuple[str, Message]], method: str, timeout: float) -> list[Answer]:
        """One attempt on each of several nodes at once: their answers or errors, in order.
        Raises `KvError` only when the client was closed before anything was sent; a call lost
        otherwise (its channel closed under the round) is a `CallLost`, never an exception that
        would drop what the round's other calls committed."""
        conns = [self._channels.get(target) for target, _ in calls]  # closed: raises before any is sent

        async def one(conn: Conn, request: Message) -> Answer:
            try:
                response: Message = await getattr(conn.kv, method)(request, timeout=timeout, metadata=ROUTED)
                return response
            except grpc.RpcError as exc:  # grpc.aio.AioRpcError, or a test's fake
                return exc
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this call's caller is being cancelled: so is the write (docs/client.md)
                return CallLost("cancelled by its channel closing", sent=True)
            except Exception as exc:  # not a status: the runtime lost the call
                return CallLost(f"the call failed: {exc!r}", sent=True)

        return list(await asyncio.gather(*(one(conn, request) for conn, (_, request) in zip(conns, calls,
                                                                                            strict=True))))

    async def _batch_attempts(self, parts: Mapping[int, kv_pb2.ShardMutations],
                              deadline: float) -> tuple[dict[int, ShardWrite], dict[int, KvError]]:
        """The rounds of a batch (`kvstore.client.batch_rounds`), as `Client._batch_attempts`."""
        rounds = BatchRounds(parts, max_attempts=self._max_attempts, attempt_timeout_s=self._attempt_timeout_s)
        while rounds.more(deadline - time.monotonic()):
            smap = await self._cached_map(deadline)
            groups = rounds.start(smap, self._router.any_endpoint)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                answers = await self._invoke_many(rounds.requests(groups), "WriteBatch",
                                                  min(remaining, self._attempt_timeout_s))
            except KvError as closed:  # the client was closed: nothing sent this time
                rounds.closed(closed)
                break
            outcome = rounds.absorb(groups, answers, capped=remaining > self._attempt_timeout_s)
            log.debug("WriteBatch round %d: %d parts committed, %d pending, %d failed", rounds.attempt,
                      len(rounds.committed), len(rounds.pending), len(rounds.failed))
            if outcome.invalidate_map:
                self._router.invalidate()
            for failed in outcome.rotate:
                self._router.rotate(failed)
            if outcome.backoff:
                await self._sleep_backoff(rounds.attempt, deadline, outcome.retry_info)
        return rounds.finish(deadline_passed=deadline - time.monotonic() <= 0)

    async def _sleep_backoff(self, attempt: int, deadline: float, error: KvError | None = None) -> None:
        """The backoff before the next attempt; at least what the server asked (RetryInfo), as
        the synchronous client's."""
        delay = backoff_delay(attempt, self._backoff_s, self._max_backoff_s, self._rng)
        if error is not None and error.retry_delay_s is not None:  # the server's RetryInfo, within our cap
            delay = max(delay, min(error.retry_delay_s, self._max_backoff_s))
        await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))

    async def _call(self, method: str, request: Message, response_type: type[R], *, key: bytes | None,
                    stale: bool = False, timeout_s: float | None = None, deadline: float | None = None,
                    request_id: str | None = None, write: bool = False,
                    first_attempt_unix_ms: int | None = None) -> R:
        """One request with routing and bounded retries (`Client._call`: the same policy)."""
        try:
            size = request.ByteSize()
            if size > MAX_REQUEST_BYTES:  # refused here, never sent: definite
                raise InvalidArgument(f"request has {size} bytes; limit MAX_REQUEST_BYTES is {MAX_REQUEST_BYTES}")
            return await self._attempts(method, request, response_type, key=key, stale=stale,
                                        deadline=deadline_of(timeout_s, self._timeout_s) if deadline is None
                                        else deadline, request_id=request_id, write=write)
        except KvError as error:
            if write:
                error.request_id = request_id
                error.first_attempt_unix_ms = first_attempt_unix_ms
            raise

    async def _attempts(self, method: str, request: Message, response_type: type[R], *, key: bytes | None,
                        stale: bool, deadline: float, request_id: str | None, write: bool) -> R:
        hint: str | None = None
        attempts = AttemptLog(write=write, request_id=request_id)
        while attempts.attempts < self._max_attempts and deadline - time.monotonic() > 0:
            attempt = attempts.started()
            target = hint or await self._route(key, deadline, stale=stale)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            capped = remaining > self._attempt_timeout_s
            try:
                response = await self._invoke(target, method, request, min(remaining, self._attempt_timeout_s))
            except grpc.RpcError as exc:  # grpc.aio.AioRpcError, or a test's fake
                error = capped_attempt_error(error_from_rpc(exc, target=target, request_id=request_id, write=write),
                                             capped=capped, attempt_timeout_s=self._attempt_timeout_s)
            except KvError as closed:  # the client was closed under the call: nothing sent this time
                raise attempts.raised(closed) from None
            else:
                if not isinstance(response, response_type):
                    raise KvError(f"unexpected response from {target}: {type(response).__name__}", target=target)
                return response
            action = attempts.failed(error)
            log.debug("%s attempt %d at %s failed (%s: %s): %s", method, attempt, target, type(error).__name__,
                      error.message, action.value)
            if action is RetryAction.FAIL:
                raise attempts.raised(error)
            if attempt >= self._max_attempts:
                break
            if action is RetryAction.REDIRECT:
                assert isinstance(error, NotLeader)
                self._router.invalidate()
                if error.leader_hint and error.leader_hint != target:
                    hint = error.leader_hint
                    log.debug("%s redirected to the leader %s", method, hint)
                    continue  # a fresh node: no reason to wait
                hint = None
            elif action is RetryAction.REROUTE:
                self._router.invalidate()
                self._router.rotate(target)
                hint = None
            # BACKOFF: keep the target (and any hint).
            await self._sleep_backoff(attempt, deadline, error)
        raise attempts.gave_up(deadline_passed=deadline - time.monotonic() <= 0)


class AsyncWatch:
    """A running watch for asyncio: `async for event in watch`; `cancel()` ends it. Opening, and
    resuming a broken stream where it stood, follow the synchronous `Watch`'s rules
    (`kvstore.client.watch`: `WatchResume`, `reopen_request`)."""

    def __init__(self, client: AsyncClient, request: kv_pb2.WatchRequest, key: bytes | None,
                 timeout_s: float | None) -> None:
        self._client = client
        self._request = request
        self._key = key
        self._timeout_s = timeout_s
        self._cancelled = False
        self._delivered = False
        self._attempts = 0
        self._hint: str | None = None
        self._stream: Any = None
        self._target = ""
        self._resume = WatchResume(request)

    async def open(self) -> None:
        """Open the stream and wait for the server's `created` event, retrying like a call."""
        budget = self._timeout_s if self._timeout_s is not None else self._client.timeout_s
        deadline = time.monotonic() + budget
        while True:
            self._attempts += 1
            try:
                await self._open_once(deadline)
                return
            except KvError as error:
                if self._cancelled:
                    return
                if (retry_action(error) is RetryAction.FAIL or self._attempts >= self._client.max_attempts
                        or deadline - time.monotonic() <= 0):
                    error.attempts = self._attempts
                    raise
                log.debug("watch at %s not opened (%s): retrying", self._target, error.message)
                await self._prepare_retry(error, deadline)

    async def _open_once(self, deadline: float) -> None:
        target = self._hint or await self._client.route(self._key, deadline)
        conn = self._client.connection(target)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded("deadline exceeded before the watch was opened", target=target)
        self._target = target
        self._stream = stream = conn.kv.Watch(self._request, timeout=self._timeout_s)
        cap = min(remaining, self._client.attempt_timeout_s)
        try:
            first = await asyncio.wait_for(stream.read(), cap)
        except TimeoutError:
            stream.cancel()
            if cap < remaining:
                raise Unavailable(f"{target} did not register the watch within {cap:.1f}s", target=target) from None
            raise DeadlineExceeded(f"{target} did not register the watch before the deadline", target=target) from None
        except grpc.RpcError as exc:  # grpc.aio.AioRpcError, or a test's fake
            raise error_from_rpc(exc, target=target) from None
        if first is grpc.aio.EOF:
            raise Unavailable(f"{target} ended the watch before registering it", target=target)
        if not isinstance(first, kv_pb2.WatchResponse) or first.type != kv_pb2.WatchResponse.TYPE_CREATED:
            stream.cancel()
            raise KvError(f"{target} did not start the watch with a `created` event", target=target)
        self._resume.created(first)

    async def _prepare_retry(self, error: KvError, deadline: float | None) -> None:
        if isinstance(error, NotLeader) and error.leader_hint and error.leader_hint != self._target:
            self._hint = error.leader_hint
            return
        self._hint = None
        await self._client.reroute(self._target, self._attempts, deadline)

    def __aiter__(self) -> AsyncWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        while True:
            stream = self._stream
            if self._cancelled or stream is None:
                raise StopAsyncIteration
            try:
                event = await stream.read()
            except asyncio.CancelledError:
                if self._cancelled:
                    raise StopAsyncIteration from None
                raise
            except grpc.RpcError as exc:  # grpc.aio.AioRpcError, or a test's fake
                if self._cancelled:
                    raise StopAsyncIteration from None
                error = error_from_rpc(exc, target=self._target)
                request = reopen_request(self._resume, self._request, self._delivered, error,
                                         self._client.max_attempts)
                if request is None:
                    error.attempts = self._attempts
                    raise error from None
                log.debug("watch at %s broke (%s): resuming at %s", self._target, error.message,
                          [(b.shard, b.revision) for b in request.start_revisions])
                self._request = request
                await self._prepare_retry(error, None)
                self._attempts = 0  # each reopen has the attempts of an open
                await self.open()
                continue
            if event is grpc.aio.EOF:  # a watch has no end of its own: an older node stopping broke it
                if self._cancelled:
                    raise StopAsyncIteration
                error = Unavailable(f"{self._target} ended the watch", target=self._target)
                request = reopen_request(self._resume, self._request, self._delivered, error,
                                         self._client.max_attempts)
                if request is None:
                    raise error
                self._request = request
                await self._prepare_retry(error, None)
                self._attempts = 0
                await self.open()
                continue
            if not isinstance(event, kv_pb2.WatchResponse):
                raise KvError(f"unexpected watch message: {type(event).__name__}", target=self._target)
            if event.type == kv_pb2.WatchResponse.TYPE_CREATED or not self._resume.accept(event):
                continue
            self._delivered = True
            return WatchEvent.from_pb(event)

    def cancel(self) -> None:
        """End the watch; an `async for` over it stops."""
        self._cancelled = True
        if self._stream is not None:
            self._stream.cancel()

    async def __aenter__(self) -> AsyncWatch:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.cancel()

