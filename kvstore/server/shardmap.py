"""The cluster's shard map, merged from what each node says of itself (pure).

Any node answers `ClusterService.ShardMap`: it asks every group member for its local view
(`PeerService.LocalShardView`, kvstore.internal.v1), then merges here. A shard's leader is the node that
*says* it leads it
(fenced and bootstrapped), with the highest term if two transiently do (the older one is
fenced already; it just has not noticed). A shard nobody leads yet shows the node the group
assigned it to, with `leader_ready` false, so clients know where to retry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvstore.v1 import cluster_pb2


def merge(local: cluster_pb2.ShardMapResponse, peers: Sequence[cluster_pb2.ShardMapResponse],
          assigned: Mapping[int, tuple[str, str]]) -> cluster_pb2.ShardMapResponse:
    """`local`: this node's own view; `peers`: the local views of the nodes that answered;
    `assigned`: shard -> (node id, address) from the consumer group."""
    out = cluster_pb2.ShardMapResponse(shard_count=local.shard_count, topic=local.topic, served_by=local.served_by)
    views = [local, *peers]
    for view in views:
        out.nodes.extend(view.nodes[:1])  # each node describes itself first
    for mine in local.shards:
        claims = [(view, info) for view in views for info in view.shards
                  if info.shard == mine.shard and info.leader_ready and view.nodes and info.leader_id
                  and info.leader_id == view.nodes[0].node_id]
        merged = cluster_pb2.ShardInfo()
        if claims:
            _, best = max(claims, key=lambda claim: claim[1].term)
            merged.CopyFrom(best)
        else:
            merged.CopyFrom(mine)
            merged.term = 0
            merged.leader_ready = False
            merged.open_txn_age_ms = 0
            node_id, address = assigned.get(mine.shard, ("", ""))
            merged.leader_id = node_id
            merged.leader = address
        out.shards.append(merged)
    return out
