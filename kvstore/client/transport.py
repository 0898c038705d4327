"""How the client reaches nodes: one gRPC channel per node (`Channels`), where a request goes
(`Router`: the endpoints, the "any node" cursor, the cached shard map), and one attempt of one
call (`invoke`). No retries and no error mapping here: the retry policy (`retry`) and the loop
that applies it (`Client`) sit on top.

Only the public API (kvstore.v1 KV and Cluster) is called: the internal peer service the nodes
use among themselves (kvstore.internal.v1) is not the client's business.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import grpc
from google.protobuf.message import Message

from kvstore.client.errors import KvError
from kvstore.client.results import ShardMap
from kvstore.core.sharding import shard_of
from kvstore.errors import FORWARD_KEY, FORWARD_NEVER
from kvstore.limits import GRPC_MAX_MESSAGE_BYTES
from kvstore.v1 import cluster_pb2_grpc, kv_pb2_grpc

# Channels are cheap but not free (a socket and a poller each); the set of addresses a client
# talks to is the cluster's nodes, so a small bound only matters against a misbehaving server
# that hints ever-new addresses.
DEFAULT_MAX_CHANNELS = 64
MAX_ENDPOINTS = 64  # seeds plus the nodes learned from shard maps
# One endpoint may be black-holed; fetching the map from it must not eat the whole deadline
# before the next endpoint is tried. A node answers the map from what it knows plus its peers'
# views (each bounded by the server's own fan-out deadline), so this is ample.
MAP_FETCH_TIMEOUT_S = 2.0
# Every channel, synchronous or asyncio: the store's own message cap both ways, and no retries of
# gRPC's own (a service config from DNS or xDS could add some): the client's loop retries with the
# same request id and must see every attempt's status, since gRPC reports only the last one, and
# "failed to connect" after an attempt that reached a server must not read as "never sent".
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
)
CLUSTER_METHODS = frozenset({"ShardMap", "ListTransactions", "FenceShard", "Drain", "MoveShard",
                             "ListPreparedTransactions", "ResolveTransaction", "PlacementLog"})
# This client routes every request to its shard's leader itself: a node that does not lead the
# shard answers NOT_LEADER with the leader's address (one round trip, then the map is right)
# instead of forwarding the request there (a second hop on every call while the map is stale).
ROUTED = ((FORWARD_KEY, FORWARD_NEVER),)


@dataclasses.dataclass(slots=True)
class Conn:
    """A channel to one node and the stubs of the two public services on it."""

    channel: Any
    kv: Any
    cluster: Any


class Channels:
    """One channel per node address, opened on first use; at most `max_channels`, the least
    recently used closed first, after `evicted_grace_s` (a call in flight on it, say a batch
    round's, finishes within its own deadline instead of being cancelled; a watch on it is then
    cut and resumes). Thread-safe. After `close()` every use raises `KvError`.
    `credentials`: TLS (and a token, a client certificate) for every channel; None: plaintext."""

    def __init__(self, max_channels: int = DEFAULT_MAX_CHANNELS,
                 credentials: grpc.ChannelCredentials | None = None, *, evicted_grace_s: float = 0.0) -> None:
        self._max = max_channels
        self._credentials = credentials
        self._grace_s = evicted_grace_s
        self._lock = threading.Lock()
        self._conns: collections.OrderedDict[str, Conn] = collections.OrderedDict()
        self._retiring: set[threading.Timer] = set()  # evicted channels' closes, pending their grace
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._conns)

    def get(self, target: str) -> Conn:
        with self._lock:
            if self._closed:
                raise KvError("the client is closed", target=target)
            conn = self._conns.get(target)
            if conn is not None:
                self._conns.move_to_end(target)
                return conn
            channel = (grpc.secure_channel(target, self._credentials, options=CHANNEL_OPTIONS)
                       if self._credentials is not None else grpc.insecure_channel(target, options=CHANNEL_OPTIONS))
            kv_stub: Any = kv_pb2_grpc.KVServiceStub
            cluster_stub: Any = cluster_pb2_grpc.ClusterServiceStub
            conn = Conn(channel, kv_stub(channel), cluster_stub(channel))
            self._conns[target] = conn
            evicted = self._conns.popitem(last=False)[1] if len(self._conns) > self._max else None
        if evicted is not None:
            self._retire(evicted)
        return conn

    def _retire(self, evicted: Conn) -> None:
        if self._grace_s <= 0:
            evicted.channel.close()
            return
        timer = threading.Timer(self._grace_s, lambda: self._closed_after_grace(timer, evicted))
        timer.daemon = True
        with self._lock:
            self._retiring.add(timer)
        timer.start()

    def _closed_after_grace(self, timer: threading.Timer, evicted: Conn) -> None:
        with self._lock:
            self._retiring.discard(timer)
        evicted.channel.close()

    def close(self) -> None:
        """Close every channel (evicted ones still in their grace too); calls in flight on them
        (and watches) end with CANCELLED."""
        with self._lock:
            self._closed = True
            conns = list(self._conns.values())
            self._conns.clear()
            retiring = list(self._retiring)
            self._retiring.clear()
        for conn in conns:
            conn.channel.close()
        for timer in retiring:
            timer.cancel()
            timer.function()  # its close, now


def invoke(conn: Conn, method: str, request: Message, timeout: float) -> Message:
    """One attempt: one unary RPC on one node. Raises `grpc.RpcError`."""
    stub = conn.cluster if method in CLUSTER_METHODS else conn.kv
    response: Message = getattr(stub, method)(request, timeout=timeout, metadata=ROUTED)
    return response


class Router:
    """Where requests go, as far as the client knows; thread-safe, no I/O.

    `endpoints` are the seeds, then the nodes learned from shard maps (bounded by
    MAX_ENDPOINTS, so losing every seed does not lose the cluster). "Any node" requests go to
    the endpoint under a cursor that moves on when that node fails. The cached shard map gives
    each key's leader; it is dropped whenever a node says it is stale (`invalidate`), while the
    shard count, fixed at cluster creation, survives.
    """

    def __init__(self, endpoints: tuple[str, ...]) -> None:
        self._lock = threading.Lock()
        self._endpoints = endpoints
        self._cursor = 0
        self._map: ShardMap | None = None
        self._shard_count: int | None = None

    @property
    def endpoints(self) -> tuple[str, ...]:
        with self._lock:
            return self._endpoints

    def any_endpoint(self) -> str:
        with self._lock:
            return self._endpoints[self._cursor % len(self._endpoints)]

    def rotate(self, failed: str | None = None) -> None:
        """Move "any node" on to the next endpoint (if `failed` was the current one)."""
        with self._lock:
            current = self._endpoints[self._cursor % len(self._endpoints)]
            if failed is None or failed == current:
                self._cursor += 1

    def invalidate(self) -> None:
        with self._lock:
            self._map = None

    def cached(self) -> ShardMap | None:
        with self._lock:
            return self._map

    def shard_count(self) -> int | None:
        with self._lock:
            return self._shard_count

    def learn(self, smap: ShardMap) -> None:
        """Cache a fetched map and learn the nodes it names (a map of no shards says nothing)."""
        if smap.shard_count <= 0:
            return
        with self._lock:
            self._map = smap
            self._shard_count = smap.shard_count
            seen = [n.address for n in smap.nodes] + [s.leader for s in smap.shards]
            learned = list(dict.fromkeys(a for a in seen if a and a not in self._endpoints))
            room = MAX_ENDPOINTS - len(self._endpoints)
            if learned and room > 0:
                self._endpoints = self._endpoints + tuple(learned[:room])

    def leader_for(self, key: bytes, smap: ShardMap) -> str:
        """The leader of `key`'s shard in `smap`, else any endpoint (which will hint)."""
        return smap.leader_of(shard_of(key, smap.shard_count)) or self.any_endpoint()

    def replica_for(self, key: bytes, smap: ShardMap) -> str:
        """A caught-up copy of `key`'s shard in `smap` for a stale read, taken in turn (with "any
        node"'s cursor) so that stale reads spread; else its leader, else any endpoint. A node
        holding no copy would forward the read: one hop saved."""
        shard = shard_of(key, smap.shard_count)
        info = next((s for s in smap.shards if s.shard == shard), None)
        copies = info.caught_up() if info is not None else ()
        if copies:
            with self._lock:
                return copies[self._cursor % len(copies)]
        return self.leader_for(key, smap)
