"""The clock seam (`kvstore.server.clock`): a replica whose clock jumps hours ahead forgets request
ids by time and refuses their retries as expired, never applying them twice; no test sleeps
through a horizon."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from kvstore import errors, limits
from kvstore.core.replica import ClientRequest
from kvstore.core.role import Role
from kvstore.server.clock import SYSTEM_CLOCK
from kvstore.server.metrics import Metrics
from kvstore.server.replica import ShardReplica
from kvstore.v1 import kv_pb2
from tests.integration.test_replica_safety import _config, _topic
from tests.waiting import wait_until_async
from wal.broker import LocalKafka

pytestmark = pytest.mark.kafka


@dataclasses.dataclass
class SteppedClock:
    """The system clock plus an offset the test moves (monotonic time stays real: waits work)."""

    ahead_ms: int = 0

    def unix_ms(self) -> int:
        return SYSTEM_CLOCK.unix_ms() + self.ahead_ms

    def monotonic(self) -> float:
        return SYSTEM_CLOCK.monotonic()

    async def sleep(self, seconds: float) -> None:
        await SYSTEM_CLOCK.sleep(seconds)


async def _put(replica: ShardReplica, key: bytes, request_id: str, first_attempt_unix_ms: int) -> kv_pb2.PutResponse:
    request = kv_pb2.PutRequest(key=key, value=b"v", request_id=request_id,
                                first_attempt_unix_ms=first_attempt_unix_ms)
    response = await replica.write(ClientRequest(request, 0), request.ByteSize())
    assert isinstance(response, kv_pb2.PutResponse)
    return response


def test_ids_forgotten_by_time_are_refused_when_retried(kafka: LocalKafka, tmp_path: Path) -> None:
    clock = SteppedClock()
    config = _config(kafka, _topic(kafka), tmp_path, "a")

    async def scenario() -> None:
        replica = ShardReplica(config, Metrics(), clock=clock)
        replica.start(lead=True)
        try:
            await wait_until_async(lambda: replica.role is Role.LEADING, 30, what="the replica to lead")
            first_attempt = clock.unix_ms()
            first = await _put(replica, b"k", "rid-old", first_attempt)
            again = await _put(replica, b"k", "rid-old", first_attempt)
            assert again.result.replayed and again.result.revision == first.result.revision
            assert replica.store.request("rid-old") is not None

            # The leader's clock moves past the horizon; its next entry forgets the old id by time.
            clock.ahead_ms = limits.REQUEST_ID_HORIZON_MS + 60_000
            await _put(replica, b"other", "rid-new", clock.unix_ms())
            assert replica.store.request("rid-old") is None
            assert replica.store.evicted_through_ms >= first_attempt

            # The retry of the forgotten id: refused (definite for this attempt), not applied again.
            with pytest.raises(errors.RequestExpiredError) as info:
                await _put(replica, b"k", "rid-old", first_attempt)
            assert info.value.definite
            state = replica.store.get(b"k")
            assert state is not None and state.version == 1, "the forgotten id was applied a second time"
        finally:
            await replica.stop()

    asyncio.run(scenario())
