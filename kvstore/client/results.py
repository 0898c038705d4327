"""What the client returns: plain, immutable results, so callers never touch protobuf messages.

Each result converts itself from its response message (`from_pb`); revisions are WAL offsets of
one shard, and every result that carries a revision also names its shard (`revisions_of`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from kvstore.client.errors import KvError
from kvstore.client.requests import show_key
from kvstore.v1 import cluster_pb2, kv_pb2


@dataclasses.dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    version: int  # writes since the key was (re)created; 1 after the first put
    mod_revision: int  # WAL offset of the last write
    create_revision: int  # WAL offset of the write that created it

    @classmethod
    def from_pb(cls, kv: kv_pb2.KeyValue) -> KeyValue:
        return cls(kv.key, kv.value, kv.version, kv.mod_revision, kv.create_revision)


@dataclasses.dataclass(frozen=True, slots=True)
class ReadHeader:
    """Where a read was served and how fresh it was (everything below `applied_revision`)."""

    shard: int
    applied_revision: int
    served_by: str

    @classmethod
    def from_pb(cls, header: kv_pb2.ReadHeader) -> ReadHeader:
        return cls(header.shard, header.applied_revision, header.served_by)


@dataclasses.dataclass(frozen=True, slots=True)
class GetResult:
    """`header` is None inside a Txn, which reads the state its compares saw."""

    key: bytes
    found: bool
    kv: KeyValue | None
    header: ReadHeader | None

    @property
    def value(self) -> bytes | None:
        return self.kv.value if self.kv is not None else None

    @classmethod
    def from_pb(cls, key: bytes, resp: kv_pb2.GetResponse) -> GetResult:
        kv = KeyValue.from_pb(resp.kv) if resp.found else None
        header = ReadHeader.from_pb(resp.header) if resp.HasField("header") else None
        return cls(key, resp.found, kv, header)


@dataclasses.dataclass(frozen=True, slots=True)
class PutResult:
    """`revision` is a token of `shard`: a later stale get of the key with
    `min_revision=revision`, or a stale scan with `min_revisions={shard: revision}`
    (`revisions_of`), sees this write."""

    key: bytes
    shard: int
    revision: int
    version: int
    replayed: bool  # True when the store answered a retry with the original result
    request_id: str

    @classmethod
    def from_pb(cls, key: bytes, resp: kv_pb2.PutResponse, request_id: str) -> PutResult:
        r = resp.result
        return cls(key, r.shard, r.revision, resp.version, r.replayed, request_id)


@dataclasses.dataclass(frozen=True, slots=True)
class DeleteResult:
    key: bytes
    shard: int
    revision: int
    deleted: bool  # False when the key did not exist
    replayed: bool
    request_id: str

    @classmethod
    def from_pb(cls, key: bytes, resp: kv_pb2.DeleteResponse, request_id: str) -> DeleteResult:
        r = resp.result
        return cls(key, r.shard, r.revision, resp.deleted, r.replayed, request_id)


TxnOpResult = PutResult | DeleteResult | GetResult


@dataclasses.dataclass(frozen=True, slots=True)
class TxnResult:
    """`succeeded` says which branch ran; `results` has one entry per op of that branch."""

    succeeded: bool
    shard: int
    revision: int | None  # None when the branch that ran wrote nothing
    replayed: bool
    results: tuple[TxnOpResult, ...]
    request_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class ScanPage:
    kvs: tuple[KeyValue, ...]
    next_page_token: bytes  # empty when there is nothing more
    headers: tuple[ReadHeader, ...]

    @property
    def more(self) -> bool:
        return bool(self.next_page_token)


@dataclasses.dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change. (The server's first event of a watch, `created`, is consumed by `Watch`
    itself: iterating a watch yields changes only.)"""

    type: Literal["put", "delete", "unknown"]
    kv: KeyValue  # for deletes: key and mod_revision only
    shard: int

    @classmethod
    def from_pb(cls, ev: kv_pb2.WatchResponse) -> WatchEvent:
        kind: Literal["put", "delete", "unknown"] = (
            "put" if ev.type == kv_pb2.WatchResponse.TYPE_PUT
            else "delete" if ev.type == kv_pb2.WatchResponse.TYPE_DELETE
            else "unknown"
        )
        return cls(kind, KeyValue.from_pb(ev.kv), ev.shard)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """One node's copy of a shard, as that node describes it (docs/design.md §9)."""

    node_id: str
    address: str
    # What the placement log says of it: "replica" (may lead once caught up), "learner", "retiring",
    # "stray" (on disk, not in the log: kept until the log drops it); "follower" (a read replica).
    state: str
    applied_offset: int
    lag: int
    caught_up: bool = False  # reached the end, within the lag bound, able to lead (P2)
    in_group: bool = False  # in the shard's leadership group: may be elected


_REPLICA_STATES = {cluster_pb2.REPLICA_STATE_LEARNER: "learner", cluster_pb2.REPLICA_STATE_REPLICA: "replica",
                   cluster_pb2.REPLICA_STATE_RETIRING: "retiring", cluster_pb2.REPLICA_STATE_FOLLOWER: "follower",
                   cluster_pb2.REPLICA_STATE_STRAY: "stray"}


@dataclasses.dataclass(frozen=True, slots=True)
class ShardInfo:
    shard: int
    leader: str  # gRPC address; empty when the shard has no leader right now
    term: int
    applied_offset: int
    end_offset: int
    lag: int
    open_txn_age_ms: int
    leader_id: str = ""  # node id of the leader (or of the node taking over)
    leader_ready: bool = False  # False while the assigned node fences and bootstraps
    replicas: tuple[ReplicaInfo, ...] = ()  # every copy a node answered for
    placed_on: tuple[str, ...] = ()  # its target replicas, as the placement log says

    def caught_up(self) -> tuple[str, ...]:
        """Addresses of its caught-up copies (replicas in the leadership group, and read
        replicas): where a stale read may go."""
        return tuple(r.address for r in self.replicas
                     if ((r.state == "replica" and r.in_group) or r.state == "follower") and r.address)


@dataclasses.dataclass(frozen=True, slots=True)
class NodeInfo:
    """A node as it describes itself. No process id: nothing a client may do needs one, and a
    tool must not signal a pid a remote node reports (the dev cluster records its children)."""

    node_id: str
    address: str
    leads: tuple[int, ...]  # shards it leads now (fenced and bootstrapped)
    can_lead: bool  # False for a read replica
    zone: str = ""
    version: str = ""  # the kvstore release it runs ("" from a node older than the field)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardMap:
    shard_count: int
    topic: str
    served_by: str
    shards: tuple[ShardInfo, ...]
    nodes: tuple[NodeInfo, ...] = ()
    placement_epoch: int = 0  # the placement log's epoch as the answering node read it
    controller: str = ""  # the placement controller the log names
    # How the answering node reaches Kafka: (bootstrap servers, security protocol, SASL mechanism);
    # ("", "", "") from a node older than the field. Never a credential.
    kafka: tuple[str, str, str] = ("", "", "")

    def node(self, node_id: str) -> NodeInfo | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def leader_of(self, shard: int) -> str:
        """The leader's address, or "" when unknown."""
        for info in self.shards:
            if info.shard == shard:
                return info.leader
        return ""

    @classmethod
    def from_pb(cls, resp: cluster_pb2.ShardMapResponse) -> ShardMap:
        shards = tuple(
            ShardInfo(s.shard, s.leader, s.term, s.applied_offset, s.end_offset, s.lag, s.open_txn_age_ms,
                      s.leader_id, s.leader_ready,
                      tuple(ReplicaInfo(r.node_id, r.address, _REPLICA_STATES.get(r.state, "unknown"), r.applied_offset,
                                        r.lag, r.caught_up, r.in_group) for r in s.replicas),
                      tuple(s.placed_on))
            for s in resp.shards
        )
        nodes = tuple(NodeInfo(n.node_id, n.address, tuple(n.leads), n.can_lead, n.zone,
                                       n.version) for n in resp.nodes)
        return cls(resp.shard_count, resp.topic, resp.served_by, shards, nodes, resp.placement_epoch,
                   resp.controller, (resp.kafka.bootstrap_servers, resp.kafka.security_protocol,
                                     resp.kafka.sasl_mechanism))


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementLogEntry:
    offset: int
    epoch: int  # the placement epoch once it was applied
    kind: str  # settings, controller_started, node_joined, node_gone, drain, pin, step
    summary: str
    reason: str
    at_ms: int  # the controller's wall clock when it decided


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementLog:
    entries: tuple[PlacementLogEntry, ...]
    epoch: int
    controller: str
    controller_term: int
    skipped: dict[str, int]  # records no reader takes (hostile or broken), by reason

    @classmethod
    def from_pb(cls, resp: cluster_pb2.PlacementLogResponse) -> PlacementLog:
        entries = tuple(PlacementLogEntry(e.offset, e.epoch, e.kind, e.summary, e.reason, e.at_ms)
                        for e in resp.entries)
        return cls(entries, resp.epoch, resp.controller, resp.controller_term, dict(resp.skipped))


@dataclasses.dataclass(frozen=True, slots=True)
class TransactionInfo:
    shard: int
    first_offset: int
    end_offset: int
    age_ms: int
    leader_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedTxn:
    """A cross-shard transaction prepared at `shard` and not resolved yet (docs/design.md §10)."""

    txn_id: str
    shard: int
    coordinator: int
    participants: tuple[int, ...]
    age_ms: int
    revision: int
    request_id: str
    locked_keys: int
    leader_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class TxnResolution:
    """What `Client.resolve_transaction` found: committed, aborted, in doubt, or not prepared."""

    txn_id: str
    outcome: str
    detail: str
    shards: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class FenceResult:
    shard: int
    end_offset: int
    notified: str  # the leader node told to check, "" if none


def txn_result(resp: kv_pb2.TxnResponse, success: Sequence[Any], failure: Sequence[Any], request_id: str) -> TxnResult:
    """A Txn's answer: the branch it ran, each of that branch's operations' results (`success`
    and `failure`: the operations sent, anything with a `key`), the write's shard and revision."""
    branch = success if resp.succeeded else failure
    results = tuple(txn_op_result(op.key, r, request_id) for op, r in zip(branch, resp.results, strict=False))
    w = resp.result
    revision = w.revision if w.HasField("revision") else None
    return TxnResult(resp.succeeded, w.shard, revision, w.replayed, results, request_id)


def txn_op_result(key: bytes, result: kv_pb2.TxnOpResult, request_id: str) -> TxnOpResult:
    """The result of one operation of the branch a Txn ran, on `key` (the operation's key)."""
    kind = result.WhichOneof("result")
    if kind == "put":
        return PutResult.from_pb(key, result.put, request_id)
    if kind == "delete":
        return DeleteResult.from_pb(key, result.delete, request_id)
    if kind == "get":
        return GetResult.from_pb(key, result.get)
    raise KvError(f"txn result without an operation for {show_key(key)}")


@dataclasses.dataclass(frozen=True, slots=True)
class ShardWrite:
    """One committed part of a batch: every mutation of it landed at `revision` of `shard`."""

    shard: int
    revision: int
    mutations: int
    replayed: bool  # True when the store answered a retry of this part with the original result
    request_id: str  # the part's own id (the batch's id + "/" + shard)

    @classmethod
    def from_pb(cls, result: kv_pb2.ShardMutationsResult, request_id: str) -> ShardWrite:
        return cls(result.shard, result.result.revision, result.mutations, result.result.replayed, request_id)


@dataclasses.dataclass(frozen=True, slots=True)
class BatchResult:
    """A batch whose every part committed, one `ShardWrite` per shard it touched (by shard)."""

    shards: tuple[ShardWrite, ...]
    request_id: str

    @property
    def mutations(self) -> int:
        return sum(part.mutations for part in self.shards)

    @property
    def revisions(self) -> dict[int, int]:
        """Per shard, where the part committed: `min_revisions` for a stale read of it."""
        return {part.shard: part.revision for part in self.shards}


def revisions_of(results: Iterable[PutResult | DeleteResult | TxnResult]) -> dict[int, int]:
    """Per shard, the highest revision among `results` (writes that wrote nothing are left
    out): the `min_revisions` of a read that must see all of them (read-your-writes on a
    stale scan, which spans shards whose revisions are unrelated)."""
    out: dict[int, int] = {}
    for result in results:
        if result.revision is not None:
            out[result.shard] = max(result.revision, out.get(result.shard, result.revision))
    return out
