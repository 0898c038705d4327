"""ClusterService.MoveShard on a node that is still starting (issue 22's campaign: a move asked of
a node that had not placed the shards yet was refused as "shard 1 does not exist: the cluster has
0 shards", a misleading INVALID_ARGUMENT for what is retriable)."""

from __future__ import annotations

import asyncio
import types

import pytest

from kvstore import errors
from kvstore.server.cluster_service import ClusterService
from kvstore.v1 import cluster_pb2


def test_a_move_asked_before_the_node_placed_the_shards_is_retriable() -> None:
    node = types.SimpleNamespace(config=types.SimpleNamespace(lead=True, shards=3), placement=(),
                                 overrides=types.SimpleNamespace(pinned={}))
    service = ClusterService(node, peers=None)  # type: ignore[arg-type]
    request = cluster_pb2.MoveShardRequest(shard=1, to_node="n2")
    with pytest.raises(errors.UnavailableError, match="has not placed the shards yet"):
        asyncio.run(service.MoveShard(request, None))
