"""Where a request is served, and when this node may serve it: the rules every service shares.

A read is served here once this node's replica may be read at the asked consistency
(`read_ready`), else refused with NOT_LEADER so that it goes to the leader (`kvstore.server.forward`,
one hop). A request over several shards is split by `plan`: the shards read here, and for each
other node the shards it is asked for in one call. Kept apart from the services because the KV
service's Get and Scan, the watch streams and the peer service's parts must agree on these
rules: a part forwarded under one rule and refused under another would bounce between nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc.aio

from kvstore import errors
from kvstore.v1 import kv_pb2

if TYPE_CHECKING:
    from kvstore.server.node import Node
    from kvstore.server.replica import ShardReplica

STALE_WAIT_DEFAULT_S = 5.0


def deadline_s(context: grpc.aio.ServicerContext[Any, Any], default: float) -> float:
    """The time a call made for this request may take: `default`, cut to what the caller has left."""
    remaining = context.time_remaining()
    return default if remaining is None else max(0.0, min(default, remaining))


async def read_ready(node: Node, shard: int, consistency: int, min_revision: int | None,
                     context: grpc.aio.ServicerContext[Any, Any], *, keys: tuple[bytes, ...] = (),
                     span: tuple[bytes, bytes | None] | None = None) -> tuple[ShardReplica, int]:
    """The replica to read `shard` from, once it may be read at `consistency`, and the state
    epoch it was cleared in: read it only while `ShardReplica.unchanged_since` that epoch. A
    stale read first waits until it applied `min_revision` (a revision of this shard). A
    linearizable read of `keys` or `span` also waits for the resolve of a prepared
    cross-shard transaction holding an exclusive lock on them (T4, in the replica machine)."""
    replica = node.replica(shard)
    epoch = replica.state_epoch
    if consistency in (kv_pb2.CONSISTENCY_UNSPECIFIED, kv_pb2.CONSISTENCY_LINEARIZABLE):
        epoch = await replica.barrier(keys, span)
    elif consistency == kv_pb2.CONSISTENCY_LEADER_LOCAL:
        replica.require_leader()
    elif consistency == kv_pb2.CONSISTENCY_STALE:
        if min_revision is not None:
            await replica.wait_applied(min_revision + 1, deadline_s(context, STALE_WAIT_DEFAULT_S))
            replica.unchanged_since(epoch)
    else:
        raise errors.InvalidRequestError(f"unknown consistency level {consistency}")
    return replica, epoch


def read_header(node: Node, replica: ShardReplica) -> kv_pb2.ReadHeader:
    """Which replica served a read and how fresh it was: a client routes its next reads by it."""
    return kv_pb2.ReadHeader(shard=replica.shard, applied_revision=replica.store.read_revision,
                             served_by=node.config.node_id)


def plan(node: Node, shards: list[int], consistency: int) -> tuple[list[int], dict[str, list[int]]]:
    """Which shards this node reads itself, and which it forwards to which node. Stale reads
    are served by any copy, this node's if it holds one; the others need each shard's leader."""
    local: list[int] = []
    remote: dict[str, list[int]] = {}
    for shard in shards:
        held = node.holds_shard(shard)
        here = consistency == kv_pb2.CONSISTENCY_STALE or node.leads(shard) or not node.config.lead
        if held and here:
            local.append(shard)
            continue
        target = node.leader_address(shard)
        if not target and consistency == kv_pb2.CONSISTENCY_STALE:
            target = node.replica_address(shard)
        if not target:
            raise errors.UnavailableError(f"shard {shard} has no {'replica' if held else 'leader'} known right "
                                          "now; retry")
        remote.setdefault(target, []).append(shard)
    return local, remote
