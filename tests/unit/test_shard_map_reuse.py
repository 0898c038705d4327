"""ClusterService.ShardMap merges one map at a time and reuses it for SHARD_MAP_REUSE_S (issue
22's campaign: clients refetching the map after each refusal made every node fan out to its peers
hundreds of times a second, and the brokers starved)."""

from __future__ import annotations

import asyncio
import types

import pytest

from kvstore.server import cluster_service
from kvstore.v1 import cluster_pb2


def _service(monkeypatch: pytest.MonkeyPatch, fail: list[bool]) -> tuple[cluster_service.ClusterService, list[int]]:
    node = types.SimpleNamespace(config=types.SimpleNamespace(lead=True))
    service = cluster_service.ClusterService(node, peers=None)  # type: ignore[arg-type]
    merges: list[int] = []

    async def merge() -> cluster_pb2.ShardMapResponse:
        merges.append(len(merges))
        await asyncio.sleep(0.05)
        if fail and fail.pop():
            raise RuntimeError("a peer answered nonsense")
        return cluster_pb2.ShardMapResponse(shard_count=len(merges))

    monkeypatch.setattr(service, "_merge_map", merge)
    return service, merges


def test_concurrent_maps_share_one_merge_and_reuse_it(monkeypatch: pytest.MonkeyPatch) -> None:
    service, merges = _service(monkeypatch, [])
    now = [100.0]
    monkeypatch.setattr(cluster_service, "_monotonic", lambda: now[0])

    async def scenario() -> None:
        request = cluster_pb2.ShardMapRequest()
        maps = await asyncio.gather(*(service.ShardMap(request, None) for _ in range(20)))
        assert merges == [0] and {m.shard_count for m in maps} == {1}
        assert (await service.ShardMap(request, None)).shard_count == 1  # reused
        now[0] += cluster_service.SHARD_MAP_REUSE_S
        assert (await service.ShardMap(request, None)).shard_count == 2  # too old: merged again
        service.forget_merged_map()  # a move or a drain here
        assert (await service.ShardMap(request, None)).shard_count == 3

    asyncio.run(scenario())


def test_a_failed_merge_reaches_every_caller_and_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    service, merges = _service(monkeypatch, [True])

    async def scenario() -> None:
        request = cluster_pb2.ShardMapRequest()
        results = await asyncio.gather(*(service.ShardMap(request, None) for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results) and merges == [0]
        assert (await service.ShardMap(request, None)).shard_count == 2

    asyncio.run(scenario())


def test_a_caller_that_goes_away_does_not_cancel_the_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    service, merges = _service(monkeypatch, [])

    async def scenario() -> None:
        request = cluster_pb2.ShardMapRequest()
        first = asyncio.ensure_future(service.ShardMap(request, None))
        second = asyncio.ensure_future(service.ShardMap(request, None))
        await asyncio.sleep(0.01)
        first.cancel()
        assert (await second).shard_count == 1 and merges == [0]

    asyncio.run(scenario())
