"""The operators' calls as data: each call's method, its request built and checked, and how its
answer becomes a result. `Client` and `AsyncClient` send them alike (any node answers: no key
routes them), so both refuse the same bad arguments with the same message before anything is
sent, and read the same answers. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

from kvstore.client.errors import InvalidArgument, Unavailable
from kvstore.client.moves import PlacementChange
from kvstore.client.results import FenceResult, PlacementLog, PreparedTxn, ShardMap, TransactionInfo, TxnResolution
from kvstore.v1 import cluster_pb2

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class AdminCall(Generic[T]):
    """One operator call: `method` of the cluster service with `request`; `result` reads its
    answer (of `response_type`)."""

    method: str
    request: Message
    response_type: type[Message]
    result: Callable[[Any], T]


def list_transactions(older_than_ms: int) -> AdminCall[list[TransactionInfo]]:
    """Shards whose WAL transaction has been open at least `older_than_ms` (seed 004)."""
    if older_than_ms < 0:
        raise InvalidArgument(f"older_than_ms must be >= 0: {older_than_ms}")

    def result(resp: cluster_pb2.ListTransactionsResponse) -> list[TransactionInfo]:
        return [TransactionInfo(t.shard, t.first_offset, t.end_offset, t.age_ms, t.leader_id)
                for t in resp.transactions]

    return AdminCall("ListTransactions", cluster_pb2.ListTransactionsRequest(older_than_ms=older_than_ms),
                     cluster_pb2.ListTransactionsResponse, result)


def prepared_transactions(older_than_ms: int) -> AdminCall[tuple[list[PreparedTxn], list[str]]]:
    """Cross-shard transactions prepared at least `older_than_ms` ago and not resolved, and the
    members that did not answer."""
    if older_than_ms < 0:
        raise InvalidArgument(f"older_than_ms must be >= 0: {older_than_ms}")

    def result(resp: cluster_pb2.ListPreparedTransactionsResponse) -> tuple[list[PreparedTxn], list[str]]:
        return ([PreparedTxn(t.txn_id, t.shard, t.coordinator, tuple(t.participants), t.age_ms, t.revision,
                             t.request_id, t.locked_keys, t.leader_id) for t in resp.transactions],
                list(resp.unreachable))

    return AdminCall("ListPreparedTransactions",
                     cluster_pb2.ListPreparedTransactionsRequest(older_than_ms=older_than_ms),
                     cluster_pb2.ListPreparedTransactionsResponse, result)


def resolve_transaction(txn_id: str) -> AdminCall[TxnResolution]:
    if not txn_id:
        raise InvalidArgument("resolve_transaction needs a txn id (see prepared_transactions)")

    def result(resp: cluster_pb2.ResolveTransactionResponse) -> TxnResolution:
        return TxnResolution(resp.txn_id, resp.outcome, resp.detail, tuple(resp.shards))

    return AdminCall("ResolveTransaction", cluster_pb2.ResolveTransactionRequest(txn_id=txn_id),
                     cluster_pb2.ResolveTransactionResponse, result)


def fence(shard: int) -> AdminCall[FenceResult]:
    if shard < 0:
        raise InvalidArgument(f"shard must be >= 0: {shard}")

    def result(resp: cluster_pb2.FenceShardResponse) -> FenceResult:
        return FenceResult(resp.shard, resp.end_offset, resp.notified)

    return AdminCall("FenceShard", cluster_pb2.FenceShardRequest(shard=shard), cluster_pb2.FenceShardResponse,
                     result)


def placement_log(limit: int) -> AdminCall[PlacementLog]:
    if limit < 0:
        raise InvalidArgument(f"limit must be >= 0: {limit}")
    return AdminCall("PlacementLog", cluster_pb2.PlacementLogRequest(limit=limit), cluster_pb2.PlacementLogResponse,
                     PlacementLog.from_pb)


def _changes(resp: cluster_pb2.DrainResponse | cluster_pb2.MoveShardResponse) -> list[PlacementChange]:
    return [PlacementChange.from_pb(c) for c in resp.changes]


def check_drain(node_id: str) -> None:
    """Refused before the placement epoch is even fetched."""
    if not node_id:
        raise InvalidArgument("drain needs a node id")


def drain(node_id: str, *, undo: bool, force: bool, epoch: int) -> AdminCall[list[PlacementChange]]:
    check_drain(node_id)
    return AdminCall("Drain", cluster_pb2.DrainRequest(node_id=node_id, undo=undo, force=force, epoch=epoch),
                     cluster_pb2.DrainResponse, _changes)


def check_move(shard: int, to_node: str, unpin: bool) -> None:
    """Refused before the placement epoch is even fetched."""
    if shard < 0:
        raise InvalidArgument(f"shard must be >= 0: {shard}")
    if unpin == bool(to_node):
        raise InvalidArgument("give either a node to move to or unpin")


def move_shard(shard: int, *, to_node: str, from_node: str, unpin: bool,
               epoch: int) -> AdminCall[list[PlacementChange]]:
    check_move(shard, to_node, unpin)
    return AdminCall("MoveShard", cluster_pb2.MoveShardRequest(shard=shard, to_node=to_node, from_node=from_node,
                                                               unpin=unpin, epoch=epoch),
                     cluster_pb2.MoveShardResponse, _changes)


def placement_epoch(smap: ShardMap) -> int:
    """The epoch an operator's request is made from (what the caller saw): the shard map's."""
    if smap.placement_epoch == 0:
        raise Unavailable("the cluster has no placement yet (its controller is starting): retry")
    return smap.placement_epoch
