"""`wal.clients.PartitionEnds`: a failed call starts over with a fresh admin client, but never more
than once per RENEW_MIN_INTERVAL_S (issue 22's campaign: a storm of fresh clients, one per failed
read barrier, kept a recovering Kafka starved)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from wal import clients


class _FailingAdmin:
    def __init__(self) -> None:
        self.calls = 0

    def list_offsets(self, request: dict[Any, Any], **_kwargs: Any) -> dict[Any, concurrent.futures.Future[Any]]:
        self.calls += 1
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_exception(KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down")))
        return {tp: future for tp in request}


def test_failures_renew_the_admin_client_at_most_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[_FailingAdmin] = []

    def new_admin(_self: clients.PartitionEnds) -> _FailingAdmin:
        made.append(_FailingAdmin())
        return made[-1]

    monkeypatch.setattr(clients.PartitionEnds, "_new_admin", new_admin)
    now = [1000.0]
    monkeypatch.setattr(clients.time, "monotonic", lambda: now[0])
    ends = clients.PartitionEnds("127.0.0.1:1", timeout_s=0.1)
    for _ in range(50):  # fifty failed end reads within a second: the same client
        with pytest.raises(KafkaException):
            ends.high_watermark("t", 0)
        now[0] += 0.02
    assert len(made) == 1 and made[0].calls == 50 and ends.renewals == 0
    now[0] += clients.PartitionEnds.RENEW_MIN_INTERVAL_S
    with pytest.raises(KafkaException):
        ends.high_watermark("t", 0)
    assert len(made) == 2 and ends.renewals == 1  # the interval passed: fresh metadata
    with pytest.raises(KafkaException):
        ends.log_start("t", 0)
    assert len(made) == 2 and made[1].calls == 1
