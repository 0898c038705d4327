"""ClusterService.MoveShard and Drain before a placement controller is known (issue 22's campaign:
a move asked of a node that had not placed the shards yet was refused as "shard 1 does not exist:
the cluster has 0 shards", a misleading INVALID_ARGUMENT for what is retriable), and the epoch
every such request must name (P4)."""

from __future__ import annotations

import asyncio
import types

import pytest

from kvstore import errors
from kvstore.core.placement_log import PlacementState
from kvstore.server.cluster_service import ClusterService
from kvstore.server.node import Node
from kvstore.v1 import cluster_pb2


def starting_node() -> types.SimpleNamespace:
    node = types.SimpleNamespace(config=types.SimpleNamespace(lead=True, shards=3, node_id="n1"), controller=None,
                                 log=types.SimpleNamespace(state=PlacementState()))
    node.placement_request = lambda request, forward=True: Node.placement_request(node, request,  # type: ignore
                                                                                   forward=forward)
    return node


def test_a_move_asked_before_a_controller_is_known_is_retriable() -> None:
    service = ClusterService(starting_node(), peers=None)  # type: ignore[arg-type]
    with pytest.raises(errors.UnavailableError, match="no placement controller is known yet"):
        asyncio.run(service.MoveShard(cluster_pb2.MoveShardRequest(shard=1, to_node="n2", epoch=3), None))
    with pytest.raises(errors.UnavailableError, match="no placement controller is known yet"):
        asyncio.run(service.Drain(cluster_pb2.DrainRequest(node_id="n2", epoch=3), None))


def test_a_request_without_an_epoch_is_refused_naming_it() -> None:
    service = ClusterService(starting_node(), peers=None)  # type: ignore[arg-type]
    for call in (service.MoveShard(cluster_pb2.MoveShardRequest(shard=1, to_node="n2"), None),
                 service.Drain(cluster_pb2.DrainRequest(node_id="n2"), None)):
        with pytest.raises(errors.InvalidRequestError, match="placement epoch"):
            asyncio.run(call)
