"""The cluster's shard map, merged from what each node says of itself (pure).

Any node answers `ClusterService.ShardMap`: it asks every member for its local view
(`PeerService.LocalShardView`, kvstore.internal.v1), then merges here. Each node describes only
the shards it holds, each with one `ReplicaInfo` of its own copy (replica, learner, retiring,
follower); the merged map lists every copy a node answered for. A shard's leader is the node that
*says* it leads it (fenced and bootstrapped), with the highest term if two transiently do (the
older one is fenced already; it just has not noticed). A shard nobody leads yet shows the node
its leadership group chose, with `leader_ready` false, so clients know where to retry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvstore.v1 import cluster_pb2


def merge(local: cluster_pb2.ShardMapResponse, peers: Sequence[cluster_pb2.ShardMapResponse],
          assigned: Mapping[int, tuple[str, str]],
          placement: Sequence[Sequence[str]] = ()) -> cluster_pb2.ShardMapResponse:
    """`local`: this node's own view; `peers`: the local views of the nodes that answered;
    `assigned`: shard -> (node id, address) its leadership group chose; `placement`: shard ->
    its target in the placement log, as this node read it (with the log's epoch and controller,
    which `local` carries)."""
    out = cluster_pb2.ShardMapResponse(shard_count=local.shard_count, topic=local.topic, served_by=local.served_by,
                                       placement_epoch=local.placement_epoch, controller=local.controller,
                                       kafka=local.kafka)
    views = [local, *peers]
    for view in views:
        out.nodes.extend(view.nodes[:1])  # each node describes itself first
    for shard in range(local.shard_count):
        held = [(view, info) for view in views for info in view.shards if info.shard == shard]
        claims = [(view, info) for view, info in held
                  if info.leader_ready and view.nodes and info.leader_id and info.leader_id == view.nodes[0].node_id]
        merged = cluster_pb2.ShardInfo(shard=shard)
        if claims:
            _, best = max(claims, key=lambda claim: claim[1].term)
            merged.CopyFrom(best)
        else:
            if held:  # the answering node's copy if it has one, else the first that answered
                merged.CopyFrom(held[0][1])
            merged.term = 0
            merged.leader_ready = False
            merged.open_txn_age_ms = 0
            node_id, address = assigned.get(shard, ("", ""))
            merged.leader_id = node_id
            merged.leader = address
        del merged.replicas[:]
        for _, info in held:
            merged.replicas.extend(info.replicas)
        del merged.placed_on[:]
        if shard < len(placement):
            merged.placed_on.extend(placement[shard])
        out.shards.append(merged)
    return out


def for_clients(smap: cluster_pb2.ShardMapResponse,
                client_address: Callable[[str], str]) -> cluster_pb2.ShardMapResponse:
    """The map a client is given: every node's address is the one clients use (`--advertise-
    client`), which may differ from the one the nodes use among themselves (a published
    container port). The same map when no node has one."""
    out = cluster_pb2.ShardMapResponse()
    out.CopyFrom(smap)
    for info in out.shards:
        if info.leader:
            info.leader = client_address(info.leader)
        for replica in info.replicas:
            if replica.address:
                replica.address = client_address(replica.address)
    for node in out.nodes:
        node.address = node.client_address or client_address(node.address)
    return out
