"""The read barrier's shell: one watermark query in flight at a time, each serving every
linearizable read that arrived before it was sent (docs/design.md §5). Real broker, real replica; only
the query is wrapped, to count and slow it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from kvstore.core.replica import ClientRequest
from kvstore.core.role import Role
from kvstore.server.metrics import Metrics
from kvstore.server.replica import ShardReplica
from kvstore.v1 import kv_pb2
from tests.integration.test_replica_safety import _config, _topic
from tests.waiting import wait_until_async
from wal.broker import LocalKafka

pytestmark = pytest.mark.kafka


def test_one_query_in_flight_serves_every_read_that_came_meanwhile(kafka: LocalKafka, tmp_path: Path) -> None:
    config = _config(kafka, _topic(kafka), tmp_path, "a")
    lock = threading.Lock()
    sent: list[float] = []
    in_flight, most = 0, 0

    async def scenario() -> None:
        nonlocal in_flight, most
        replica = ShardReplica(config, Metrics())
        replica.start(lead=True)
        try:
            await wait_until_async(lambda: replica.role is Role.LEADING, 30, what="the replica to lead")
            put = kv_pb2.PutRequest(key=b"k", value=b"v")
            written = await replica.write(ClientRequest(put, 0), put.ByteSize())
            assert isinstance(written, kv_pb2.PutResponse)
            real = replica.ends.high_watermark

            def slow(topic: str, shard: int) -> int:
                nonlocal in_flight, most
                with lock:
                    in_flight += 1
                    most = max(most, in_flight)
                    sent.append(time.monotonic())
                try:
                    time.sleep(0.2)  # a slow broker: reads keep arriving while the query is out
                    return real(topic, shard)
                finally:
                    with lock:
                        in_flight -= 1

            replica.ends.high_watermark = slow  # type: ignore[method-assign]

            async def read(delay_s: float) -> float:
                await asyncio.sleep(delay_s)
                arrived = time.monotonic()
                await replica.barrier()
                # Linearizable: the query that served this read was sent after it arrived.
                with lock:
                    assert any(t >= arrived for t in sent), "served by a query sent before the read arrived"
                assert replica.store.applied_offset > written.result.revision
                return arrived

            await asyncio.gather(*(read(i * 0.01) for i in range(60)))  # 0.6 s of arrivals
        finally:
            await replica.stop()

    asyncio.run(scenario())
    assert most == 1, f"{most} watermark queries in flight at once"
    # Reads shared queries (how exactly, round by round, is in tests/unit/test_replica_machine.py's
    # barrier tables, without a clock): far fewer queries than reads, and more than one round.
    assert 2 <= len(sent) < 60, f"{len(sent)} queries for 60 reads over 0.6 s of 0.2 s queries"
