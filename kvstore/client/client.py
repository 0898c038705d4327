"""`Client`: the calls of the public API, each with routing, one deadline and bounded retries
(the contract is described in `kvstore.client`'s docstring)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Self, TypeVar

import grpc
from google.protobuf.message import Message

from kvstore.client import admin
from kvstore.client.batch_rounds import Answer, BatchRounds, CallLost, batch_result
from kvstore.client.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KvError,
    NotLeader,
    TxnAborted,
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
    DEFAULT_MAX_CHANNELS,
    MAP_FETCH_TIMEOUT_S,
    ROUTED,
    Channels,
    Conn,
    Router,
    invoke,
)
from kvstore.client.watch import Watch
from kvstore.limits import MAX_REQUEST_BYTES
from kvstore.v1 import cluster_pb2, kv_pb2

R = TypeVar("R", bound=Message)
T = TypeVar("T")


logger = logging.getLogger("kvstore.client")  # DEBUG: every failed attempt, retry and redirect

class Client:
    """A connection to a kvstore cluster; thread-safe, use one per process.

    `endpoints` are seed addresses ("host:port"); the client learns the leaders from the shard
    map. `timeout_s` is the default deadline of every call (retries included), overridable per
    call; `max_attempts` bounds the tries of one call; `backoff_s` is the first backoff, doubled
    per attempt up to `max_backoff_s`. `attempt_timeout_s` caps one attempt, so a node that
    stopped answering (a paused process, a black hole) costs that much, not the whole deadline:
    the attempt counts as "outcome unknown" and is retried elsewhere with the same request id.

    Writes (`put`, `delete`, `txn`) return only once committed, raise `UnknownOutcome` when any
    attempt may have committed (retry later with its `request_id` and `first_attempt_unix_ms`),
    `RequestExpired` when the store refused such a retry as too old (outcome unknown for good),
    and any other `KvError` only when nothing of the write committed (see `kvstore.client`).

    `security`: TLS, a client certificate and/or a bearer token (`ClientSecurity`); None reads
    them from KVSTORE_CA, KVSTORE_CERT, KVSTORE_KEY, KVSTORE_TOKEN, KVSTORE_TOKEN_FILE (none set:
    plaintext); `ClientSecurity()` is plaintext whatever the environment says.
    """

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
        self._channels = Channels(max_channels, self._security.credentials(),
                                  evicted_grace_s=min(max(timeout_s, attempt_timeout_s), 60.0))
        # Seams for tests: no real sleeping, deterministic jitter.
        self._sleep: Callable[[float], None] = time.sleep
        self._rng = random.Random()

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close every channel; calls in flight (and watches) end with `Cancelled`."""
        self._channels.close()

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The seeds, then the nodes learned from shard maps."""
        return self._router.endpoints

    # -- the API -----------------------------------------------------------------------------

    def get(
        self,
        key: BytesLike,
        consistency: Consistency = "linearizable",
        min_revision: int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> GetResult:
        """Read one key. `stale` may be served by any node; `min_revision` (a revision of the
        key's shard, e.g. an earlier `put`'s) makes it wait until that node applied it."""
        k, request = get_request(key, consistency, min_revision)
        resp = self._call("Get", request, kv_pb2.GetResponse, key=k, stale=consistency == "stale", timeout_s=timeout_s)
        return GetResult.from_pb(k, resp)

    def put(
        self,
        key: BytesLike,
        value: BytesLike,
        request_id: str | None = None,
        *,
        timeout_s: float | None = None,
        first_attempt_unix_ms: int | None = None,
    ) -> PutResult:
        """Write one key; answered once its WAL batch committed.

        To finish a write that ended in `UnknownOutcome` (say, in another process), pass its
        `request_id` and `first_attempt_unix_ms`: the store applies it at most once, and refuses
        it with `RequestExpired` if it is older than what the store remembers. Without
        `first_attempt_unix_ms` the first attempt is now, which is right only for a new id."""
        k, request = put_request(key, value, request_id, first_attempt_unix_ms)
        resp = self._call("Put", request, kv_pb2.PutResponse, key=k, timeout_s=timeout_s,
                          request_id=request.request_id, write=True,
                          first_attempt_unix_ms=request.first_attempt_unix_ms)
        return PutResult.from_pb(k, resp, request.request_id)

    def delete(
        self,
        key: BytesLike,
        request_id: str | None = None,
        *,
        timeout_s: float | None = None,
        first_attempt_unix_ms: int | None = None,
    ) -> DeleteResult:
        """Delete one key (not an error if it does not exist); ids and outcomes as in `put`."""
        k, request = delete_request(key, request_id, first_attempt_unix_ms)
        resp = self._call("Delete", request, kv_pb2.DeleteResponse, key=k, timeout_s=timeout_s,
                          request_id=request.request_id, write=True,
                          first_attempt_unix_ms=request.first_attempt_unix_ms)
        return DeleteResult.from_pb(k, resp, request.request_id)

    def txn(
        self,
        compares: Sequence[Compare] = (),
        success: Sequence[Op] = (),
        failure: Sequence[Op] = (),
        request_id: str | None = None,
        *,
        timeout_s: float | None = None,
        first_attempt_unix_ms: int | None = None,
    ) -> TxnResult:
        """Run `success` if every compare holds, else `failure`, atomically and strictly
        serializably, over keys of any shards. Keys of one shard take one WAL record; keys of
        several are a cross-shard transaction (docs/design.md §10), sent to the leader of its
        coordinator shard (the lowest), which drives it. Its result then names the coordinator
        shard and the decision's revision; each operation's result names its own shard. A key
        locked by another cross-shard transaction is retried (`TxnConflict`). Ids and outcomes as
        in `put` (a Txn is a write, even when its branch only reads).

        A cross-shard Txn that aborts (`TxnAborted`: a lock held too long, a shard unavailable)
        spends its request id: the abort is that id's recorded outcome. When this call chose the
        id (`request_id` None), it tries again under a fresh id, within the deadline and the
        client's attempts; the result (or the error) names the id that counted. A caller's own id
        is never replaced: its `TxnAborted` is the answer.
        """
        first_ms = make_first_attempt_unix_ms(first_attempt_unix_ms, request_id)
        deadline = self._deadline(timeout_s)
        route = txn_route_key(compares, success, failure, self._known_shard_count(deadline))
        request = txn_request(compares, success, failure, first_ms)
        for fresh in range(self._max_attempts):  # bounded: each round also spends the deadline
            rid = make_request_id(request_id)
            request.request_id = rid
            try:
                resp = self._call(
                    "Txn", request, kv_pb2.TxnResponse, key=route, deadline=deadline, request_id=rid,
                    write=True, first_attempt_unix_ms=request.first_attempt_unix_ms,
                )
                break
            except TxnAborted:
                if request_id is not None or fresh + 1 >= self._max_attempts or deadline - time.monotonic() <= 0:
                    raise
                request.first_attempt_unix_ms = make_first_attempt_unix_ms(None, None)
                self._sleep_backoff(fresh + 1, deadline, None)
        return txn_result(resp, success, failure, rid)

    def write_batch(
        self,
        ops: Iterable[Op],
        request_id: str | None = None,
        *,
        timeout_s: float | None = None,
        first_attempt_unix_ms: int | None = None,
    ) -> BatchResult:
        """Many puts and deletes (`Op.put`, `Op.delete`) spanning shards: one WAL record per shard
        (atomic per shard, in the given order), one call per leader, sent in parallel.

        Each shard's part has its own request id (`request_id` + "/" + shard), so retries, here
        or by the caller with the same `request_id`, `first_attempt_unix_ms` and operations,
        apply every part at most once. Returns when every part committed; otherwise raises
        `BatchIncomplete` naming the parts that committed and why each other did not (per part,
        exactly a Put's outcome: definite, `UnknownOutcome` or `RequestExpired`). At most
        MAX_BATCH_MUTATIONS per shard and MAX_REQUEST_BYTES per leader's call; for an unbounded
        stream of writes use `BatchingWriter`.
        """
        rid = make_request_id(request_id)
        first_ms = make_first_attempt_unix_ms(first_attempt_unix_ms, request_id)
        deadline = self._deadline(timeout_s)
        shard_count = self._known_shard_count(deadline)
        if shard_count is None:
            # Nothing was sent: the batch cannot be split without the shard count.
            raise DeadlineExceeded("no node answered the shard map, so the batch could not be split by shard; "
                                   "nothing was sent", request_id=rid, first_attempt_unix_ms=first_ms)
        parts = batch_parts(ops, shard_count, rid, first_ms)
        committed, failed = self._batch_attempts(parts, deadline)
        return batch_result(parts, committed, failed, rid, first_ms)

    def put_many(
        self,
        items: Mapping[BytesLike, BytesLike] | Iterable[tuple[BytesLike, BytesLike]],
        request_id: str | None = None,
        *,
        timeout_s: float | None = None,
        first_attempt_unix_ms: int | None = None,
    ) -> BatchResult:
        """`write_batch` of puts: `put_many({"a": "1", "b": "2"})` or of (key, value) pairs."""
        pairs = items.items() if isinstance(items, Mapping) else items
        return self.write_batch([Op.put(k, v) for k, v in pairs], request_id, timeout_s=timeout_s,
                                first_attempt_unix_ms=first_attempt_unix_ms)

    def scan(
        self,
        start: BytesLike = b"",
        end: BytesLike = b"",
        prefix: BytesLike = b"",
        limit: int = 0,
        consistency: Consistency = "linearizable",
        *,
        page_token: bytes = b"",
        keys_only: bool = False,
        min_revisions: Mapping[int, int] | None = None,
        timeout_s: float | None = None,
    ) -> ScanPage:
        """One page of `[start, end)` or of `prefix`, in key order across all shards.

        Any node can answer (it gathers from the shards itself). `limit` 0 = server default.
        `min_revisions` (shard -> revision, with `stale`): each shard is read only once its
        replica applied that revision of that shard, e.g. `revisions_of([put1, put2])` to see
        your own writes. A revision belongs to one shard, so a scan has no single minimum.
        """
        request = scan_request(start, end, prefix, limit, consistency, keys_only, min_revisions)
        request.page_token = page_token
        resp = self._call("Scan", request, kv_pb2.ScanResponse, key=None, timeout_s=timeout_s)
        return ScanPage(
            tuple(KeyValue.from_pb(kv) for kv in resp.kvs),
            resp.next_page_token,
            tuple(ReadHeader.from_pb(h) for h in resp.headers),
        )

    def scan_all(
        self,
        start: BytesLike = b"",
        end: BytesLike = b"",
        prefix: BytesLike = b"",
        limit: int = 0,
        consistency: Consistency = "linearizable",
        *,
        keys_only: bool = False,
        min_revisions: Mapping[int, int] | None = None,
        timeout_s: float | None = None,
    ) -> Iterator[KeyValue]:
        """Every key of the range, page by page (`limit` is the page size); each page is a call
        with its own deadline, so a long scan is not cut off by one timeout."""
        scan_request(start, end, prefix, limit, consistency, keys_only, min_revisions)  # fail early
        token = b""
        while True:
            page = self.scan(
                start, end, prefix, limit, consistency, page_token=token, keys_only=keys_only,
                min_revisions=min_revisions, timeout_s=timeout_s,
            )
            yield from page.kvs
            if not page.next_page_token:
                return
            token = page.next_page_token

    def watch(
        self,
        key: BytesLike = b"",
        prefix: BytesLike = b"",
        start_revision: int | None = None,
        *,
        start_revisions: Mapping[int, int] | None = None,
        timeout_s: float | None = None,
    ) -> Watch:
        """Changes to `key` (or every key under `prefix`) from `start_revision` on (None = from now).

        A revision is an offset of one shard's WAL: a prefix watch over several shards takes
        `start_revisions={shard: revision}` (shards not named: from now), or `start_revision=0`
        for all history; a nonzero shard-less one is refused (`InvalidArgument`). To resume after
        a break, pass each shard's last seen `mod_revision + 1` (`WatchEvent.shard`).

        Returns once the server registered the watch (its `created` event, within `timeout_s` or
        the client's default): every change applied after that is delivered, so a caller may
        write right away, without sleeping first. Returns an iterator of `WatchEvent`s (changes
        only); `cancel()` (or leaving its `with` block) ends it. The stream itself has no
        deadline unless `timeout_s` is given: it is meant to last.
        """
        routed_by, request = watch_request(key, prefix, start_revision, start_revisions)
        return Watch(self, request, routed_by, timeout_s)

    def shard_map(self, *, timeout_s: float | None = None) -> ShardMap:
        """Fetch the current shard map from any endpoint (and refresh the routing cache)."""
        deadline = self._deadline(timeout_s)
        # With several endpoints, one black-holed node must not eat the whole deadline.
        cap_s = MAP_FETCH_TIMEOUT_S if len(self._router.endpoints) > 1 else None
        last: KvError | None = None
        attempts = 0
        while attempts < self._max_attempts:
            for _ in range(len(self._router.endpoints)):
                if attempts >= self._max_attempts or deadline - time.monotonic() <= 0:
                    break
                attempts += 1
                try:
                    return self._fetch_map(self._router.any_endpoint(), deadline, cap_s)
                except KvError as error:
                    last = error
                    self._router.rotate()
                    # A deadline here is the per-endpoint cap (a node not answering): next one.
                    if retry_action(error) is RetryAction.FAIL and not isinstance(error, DeadlineExceeded):
                        raise
            if attempts >= self._max_attempts or deadline - time.monotonic() <= 0:
                break
            self._sleep_backoff(attempts, deadline)
        raise self._give_up(last, attempts, None)

    def list_transactions(self, older_than_ms: int = 0, *, timeout_s: float | None = None) -> list[TransactionInfo]:
        """Shards whose WAL transaction has been open at least `older_than_ms` (seed 004)."""
        return self._admin(admin.list_transactions(older_than_ms), timeout_s)

    def prepared_transactions(self, older_than_ms: int = 0, *,
                              timeout_s: float | None = None) -> tuple[list[PreparedTxn], list[str]]:
        """Cross-shard transactions prepared at least `older_than_ms` ago and not resolved, one
        entry per participant still holding one (docs/design.md §10), oldest first; and the
        members that did not answer (their shards' are missing)."""
        return self._admin(admin.prepared_transactions(older_than_ms), timeout_s)

    def resolve_transaction(self, txn_id: str, *, timeout_s: float | None = None) -> TxnResolution:
        """Resolve a prepared cross-shard transaction now: with its coordinator's decision, or an
        abort decision when there is none (the safe way to end a stuck one; never a commit)."""
        return self._admin(admin.resolve_transaction(txn_id), timeout_s)

    def fence(self, shard: int, *, timeout_s: float | None = None) -> FenceResult:
        """Force-terminate `shard`'s transaction (a fresh init_transactions on its id). The live
        leader finds itself fenced, steps down, and leadership settles again by itself."""
        return self._admin(admin.fence(shard), timeout_s)

    def drain(self, node_id: str, *, undo: bool = False, force: bool = False, epoch: int | None = None,
              timeout_s: float | None = None) -> list[PlacementChange]:
        """Move every shard off `node_id` before it is removed (`undo`: let it hold shards again).
        Returns once the placement controller recorded it, with the changes to expect;
        `wait_moves` follows them. Refused (PlacementRefused, naming the shards) if it would leave
        a shard fewer than R nodes able to hold it, unless `force`. `epoch`: the placement epoch
        the decision was made from (default: the shard map's now); PlacementChanged if the
        placement moved since."""
        admin.check_drain(node_id)
        epoch = admin.placement_epoch(self.shard_map()) if epoch is None else epoch
        return self._admin(admin.drain(node_id, undo=undo, force=force, epoch=epoch), timeout_s)

    def placement_log(self, limit: int = 50, *, timeout_s: float | None = None) -> PlacementLog:
        """The placement log's newest decisions (at most `limit`), with their reasons."""
        return self._admin(admin.placement_log(limit), timeout_s)

    def move_shard(self, shard: int, to_node: str = "", from_node: str = "", *, unpin: bool = False,
                   epoch: int | None = None, timeout_s: float | None = None) -> list[PlacementChange]:
        """Move one replica of `shard` to `to_node` (replacing `from_node`, default its last
        replica), or `unpin` it back to the placement rule. Returns at once with the changes to
        expect; `wait_moves` follows them."""
        admin.check_move(shard, to_node, unpin)
        epoch = admin.placement_epoch(self.shard_map()) if epoch is None else epoch
        return self._admin(admin.move_shard(shard, to_node=to_node, from_node=from_node, unpin=unpin, epoch=epoch),
                           timeout_s)

    def _admin(self, call: admin.AdminCall[T], timeout_s: float | None) -> T:
        return call.result(self._call(call.method, call.request, call.response_type, key=None, timeout_s=timeout_s))

    def wait_moves(self, changes: Sequence[PlacementChange], *, timeout_s: float, poll_s: float = 1.0,
                   on_progress: Callable[[MoveProgress], None] | None = None) -> MoveProgress:
        """Poll the shard map until `changes` are done (or `timeout_s` passed: the last progress
        is returned, not done), telling `on_progress` each time."""
        deadline = time.monotonic() + timeout_s
        while True:
            current = progress(self.shard_map(), changes)
            if on_progress is not None:
                on_progress(current)
            if current.done or time.monotonic() + poll_s > deadline:
                return current
            time.sleep(poll_s)

    # -- the retry seam ----------------------------------------------------------------------
    # What a call the client does not run itself (`Watch`'s stream, which outlives any one
    # deadline) needs to route and retry as the client's own calls do.

    @property
    def timeout_s(self) -> float:
        """The default deadline of a call, retries included (`timeout_s` of the constructor)."""
        return self._timeout_s

    @property
    def max_attempts(self) -> int:
        """The bound on the tries of one call (`max_attempts` of the constructor)."""
        return self._max_attempts

    @property
    def attempt_timeout_s(self) -> float:
        """The cap on one attempt, after which it is given up on as "not answering"."""
        return self._attempt_timeout_s

    def route(self, key: bytes | None, deadline: float) -> str:
        """Where an attempt about `key` goes: its shard's leader when the shard map (fetched
        within `deadline` if none is cached) names one, else any endpoint, which will hint the
        leader; None: a call any node answers."""
        return self._route(key, deadline)

    def connection(self, target: str) -> Conn:
        """The channel to `target` and its stubs, shared by every call of this client (so a
        stream opened on it ends with `close()`); raises `KvError` once the client is closed."""
        return self._conn(target)

    def reroute(self, failed: str, attempt: int, deadline: float | None = None) -> None:
        """After attempt number `attempt` failed at `failed` without naming a better node: forget
        the shard map, move "any node" past `failed`, and back off before the next attempt, at
        most until `deadline` (None: the whole backoff)."""
        self._invalidate_map()
        self._rotate(failed)
        self._sleep_backoff(attempt, time.monotonic() + self._max_backoff_s if deadline is None else deadline)

    # -- internals: routing ------------------------------------------------------------------

    def _deadline(self, timeout_s: float | None) -> float:
        return deadline_of(timeout_s, self._timeout_s)

    def _rotate(self, failed: str | None = None) -> None:
        self._router.rotate(failed)

    def _invalidate_map(self) -> None:
        self._router.invalidate()

    def _fetch_map(self, target: str, deadline: float, cap_s: float | None) -> ShardMap:
        """The merged shard map from `target` (it asks the other nodes), cached for routing."""
        remaining = deadline - time.monotonic()
        timeout = min(remaining, cap_s) if cap_s is not None else remaining
        try:
            resp = self._invoke(target, "ShardMap", cluster_pb2.ShardMapRequest(), max(timeout, 0.001))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, target=target) from None
        if not isinstance(resp, cluster_pb2.ShardMapResponse):
            raise KvError(f"unexpected response from {target}: {type(resp).__name__}", target=target)
        smap = ShardMap.from_pb(resp)
        self._router.learn(smap)
        return smap

    def _cached_map(self, deadline: float) -> ShardMap | None:
        """The cached map, fetched (one try per endpoint) if there is none; None if none answered."""
        cached = self._router.cached()
        if cached is not None:
            return cached
        for _ in range(len(self._router.endpoints)):
            if deadline - time.monotonic() <= 0:
                return None
            target = self._router.any_endpoint()
            try:
                smap = self._fetch_map(target, deadline, MAP_FETCH_TIMEOUT_S)
            except KvError:
                self._router.rotate(target)
                continue
            return smap if smap.shard_count > 0 else None
        return None

    def _known_shard_count(self, deadline: float) -> int | None:
        known = self._router.shard_count()
        if known is not None:
            return known
        smap = self._cached_map(deadline)
        return smap.shard_count if smap is not None else None

    def _route(self, key: bytes | None, deadline: float, *, stale: bool = False) -> str:
        """The leader of `key`'s shard when known (`stale`: one of its caught-up copies, which
        spreads stale reads over them); otherwise any endpoint (which forwards or hints)."""
        if key is None:
            return self._router.any_endpoint()
        smap = self._cached_map(deadline)
        if smap is None:
            return self._router.any_endpoint()
        return self._router.replica_for(key, smap) if stale else self._router.leader_for(key, smap)

    # -- internals: calls and retries --------------------------------------------------------

    def _conn(self, target: str) -> Conn:
        return self._channels.get(target)

    def _invoke(self, target: str, method: str, request: Message, timeout: float) -> Message:
        """One attempt: one RPC to one node. Raises `grpc.RpcError`. (The seam unit tests replace.)"""
        return invoke(self._conn(target), method, request, timeout)

    def _invoke_many(self, calls: Sequence[tuple[str, Message]], method: str, timeout: float) -> list[Answer]:
        """One attempt on each of several nodes at once: their answers or errors, in order.
        Raises `KvError` only when the client was closed before anything was sent; a call lost
        otherwise (its channel closed under the round) is a `CallLost`. (A seam for tests.)"""
        if len(calls) == 1:
            target, request = calls[0]
            try:
                return [self._invoke(target, method, request, timeout)]
            except grpc.RpcError as exc:
                return [exc]
            except KvError:
                raise  # the client was closed: nothing sent
            except Exception as exc:  # not a status: the runtime lost the call (say, its channel closed)
                return [CallLost(f"the call failed: {exc!r}", sent=True)]
        conns = [self._conn(target) for target, _ in calls]  # closed: raises before anything is sent
        started: list[grpc.Future | CallLost] = []
        for conn, (_, request) in zip(conns, calls, strict=True):
            try:
                started.append(getattr(conn.kv, method).future(request, timeout=timeout, metadata=ROUTED))
            except Exception as exc:  # the channel closed under the round: this call never started
                started.append(CallLost(f"not started: {exc!r}", sent=False))
        out: list[Answer] = []
        for call in started:
            if isinstance(call, CallLost):
                out.append(call)
                continue
            try:
                out.append(call.result())
            except grpc.RpcError as exc:
                out.append(exc)
            except Exception as exc:  # not a status: the runtime lost the call after starting it
                out.append(CallLost(f"the call failed: {exc!r}", sent=True))
        return out

    def _batch_attempts(self, parts: Mapping[int, kv_pb2.ShardMutations],
                        deadline: float) -> tuple[dict[int, ShardWrite], dict[int, KvError]]:
        """The rounds of a batch (`kvstore.client.batch_rounds`: what each answer means), sent
        with one call per node, in parallel."""
        rounds = BatchRounds(parts, max_attempts=self._max_attempts, attempt_timeout_s=self._attempt_timeout_s)
        while rounds.more(deadline - time.monotonic()):
            smap = self._cached_map(deadline)
            groups = rounds.start(smap, self._router.any_endpoint)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                answers = self._invoke_many(rounds.requests(groups), "WriteBatch",
                                            min(remaining, self._attempt_timeout_s))
            except KvError as closed:  # the client was closed: nothing sent this time
                rounds.closed(closed)
                break
            outcome = rounds.absorb(groups, answers, capped=remaining > self._attempt_timeout_s)
            if outcome.invalidate_map:
                self._invalidate_map()
            for failed in outcome.rotate:
                self._rotate(failed)
            if outcome.backoff:
                self._sleep_backoff(rounds.attempt, deadline, outcome.retry_info)
        return rounds.finish(deadline_passed=deadline - time.monotonic() <= 0)

    def _sleep_backoff(self, attempt: int, deadline: float, error: KvError | None = None) -> None:
        delay = backoff_delay(attempt, self._backoff_s, self._max_backoff_s, self._rng)
        if error is not None and error.retry_delay_s is not None:  # the server's RetryInfo, within our cap
            delay = max(delay, min(error.retry_delay_s, self._max_backoff_s))
        delay = min(delay, max(0.0, deadline - time.monotonic()))
        if delay > 0:
            self._sleep(delay)

    def _give_up(self, last: KvError | None, attempts: int, request_id: str | None) -> KvError:
        if last is None:
            return DeadlineExceeded("deadline exceeded before any attempt", request_id=request_id)
        last.attempts = max(attempts, 1)
        return last

    def _call(
        self,
        method: str,
        request: Message,
        response_type: type[R],
        *,
        key: bytes | None,
        stale: bool = False,
        timeout_s: float | None = None,
        deadline: float | None = None,
        request_id: str | None = None,
        write: bool = False,
        first_attempt_unix_ms: int | None = None,
    ) -> R:
        """Run one request with routing and bounded retries; the request (and so its request
        id and first-attempt time) is the same object on every attempt.

        `write`: a Put, Delete or Txn, whose errors are classified for W7 (module docstring);
        an error it raises carries `request_id` and `first_attempt_unix_ms` to retry with."""
        try:
            size = request.ByteSize()
            if size > MAX_REQUEST_BYTES:  # refused here, never sent: definite
                raise InvalidArgument(f"request has {size} bytes; limit MAX_REQUEST_BYTES is {MAX_REQUEST_BYTES}")
            return self._attempts(method, request, response_type, key=key, stale=stale, timeout_s=timeout_s,
                                  deadline=deadline, request_id=request_id, write=write)
        except KvError as error:
            if write:
                error.request_id = request_id
                error.first_attempt_unix_ms = first_attempt_unix_ms
            raise

    def _attempts(
        self,
        method: str,
        request: Message,
        response_type: type[R],
        *,
        key: bytes | None,
        stale: bool = False,
        timeout_s: float | None,
        deadline: float | None,
        request_id: str | None,
        write: bool,
    ) -> R:
        if deadline is None:
            deadline = self._deadline(timeout_s)
        hint: str | None = None
        log = AttemptLog(write=write, request_id=request_id)
        while log.attempts < self._max_attempts:
            if deadline - time.monotonic() <= 0:
                break
            attempt = log.started()
            target = hint or self._route(key, deadline, stale=stale)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            capped = remaining > self._attempt_timeout_s
            try:
                response = self._invoke(target, method, request, min(remaining, self._attempt_timeout_s))
            except grpc.RpcError as exc:
                error = capped_attempt_error(error_from_rpc(exc, target=target, request_id=request_id, write=write),
                                             capped=capped, attempt_timeout_s=self._attempt_timeout_s)
            except KvError as closed:  # the client was closed under the call: nothing sent this time
                raise log.raised(closed) from None
            else:
                if not isinstance(response, response_type):
                    raise KvError(f"unexpected response from {target}: {type(response).__name__}", target=target)
                return response
            action = log.failed(error)
            logger.debug("%s attempt %d at %s failed (%s: %s): %s", method, attempt, target, type(error).__name__,
                         error.message, action.value)
            if action is RetryAction.FAIL:
                raise log.raised(error)
            if attempt >= self._max_attempts:
                break
            if action is RetryAction.REDIRECT:
                assert isinstance(error, NotLeader)
                self._invalidate_map()
                new_hint = error.leader_hint
                if new_hint and new_hint != target:
                    hint = new_hint
                    logger.debug("%s redirected to the leader %s", method, hint)
                    continue  # a fresh node: no reason to wait
                hint = None
            elif action is RetryAction.REROUTE:
                self._invalidate_map()
                self._rotate(target)
                hint = None
            # BACKOFF: keep the target (and any hint).
            self._sleep_backoff(attempt, deadline, error)
        raise log.gave_up(deadline_passed=deadline - time.monotonic() <= 0)
