"""A broker restart in the middle of a stream of appends: nothing committed is lost or doubled."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from tests.integration.helpers import replay_all, writer
from tests.waiting import wait_until
from wal import UnknownOutcomeError, WalError, WriterFatalError
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

RECORDS_PER_BATCH = 4


class Appender(threading.Thread):
    """Appends uniquely named batches until stopped, recording each batch's outcome."""

    def __init__(self, kafka: LocalKafka, topic: str) -> None:
        super().__init__(daemon=True)
        self.writer = writer(kafka.bootstrap_servers, topic, call_timeout_s=5.0, retry_limit=4,
                             transaction_timeout_ms=30_000)
        self.committed: list[str] = []
        self.failed: list[str] = []  # definitely not committed (aborted, unavailable)
        self.unknown: list[str] = []  # outcome unknown (W7)
        self.fatal: list[str] = []
        self.stop_flag = threading.Event()

    def run(self) -> None:
        number = 0
        while not self.stop_flag.is_set():
            name = f"batch-{number:05d}"
            number += 1
            batch = [f"{name}/{i}".encode() for i in range(RECORDS_PER_BATCH)]
            try:
                self.writer.append(batch)
                self.committed.append(name)
            except UnknownOutcomeError:
                self.unknown.append(name)
            except WriterFatalError:
                self.fatal.append(name)
                return
            except WalError:
                self.failed.append(name)
                time.sleep(0.1)  # a client's back-off before the next batch, not a wait for a condition


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_broker_restart_during_appends(own_kafka: LocalKafka, how: str) -> None:
    topic = "wal-restart"
    own_kafka.create_topic(topic, partitions=1)
    appender = Appender(own_kafka, topic)
    appender.start()
    try:
        # A bound, not a speed goal: a broker of its own, fresh JVM, on two cores the other workers
        # share (a CI run's sigterm case had fewer than 20 after 30 s).
        wait_until(lambda: len(appender.committed) >= 20, 90, what="20 committed batches before the restart")
        if how == "sigkill":
            own_kafka.kill_node(0)
        else:
            own_kafka.stop_node(0)
        time.sleep(1.0)  # the point of the test: the broker stays down a while under appends
        before_restart = len(appender.committed)
        own_kafka.start_node(0, wait=True)

        def recovered() -> bool:
            assert appender.is_alive(), f"appender died: fatal={appender.fatal}"
            return len(appender.committed) >= before_restart + 20

        wait_until(recovered, 90, interval_s=0.1,
                   what=f"the writer to recover by itself (20 batches committed after the {before_restart} before)")
    finally:
        appender.stop_flag.set()
        appender.join(60)
    assert not appender.fatal
    assert len(appender.committed) >= before_restart + 20, "the writer did not recover by itself"

    records, _replayer = replay_all(own_kafka.bootstrap_servers, topic, timeout_s=60)
    batches = Counter(r.payload.split(b"/")[0].decode() for r in records)
    # Each visible batch is whole, consecutive and appears once.
    assert all(count == RECORDS_PER_BATCH for count in batches.values()), batches
    for name in appender.committed:
        assert batches[name] == RECORDS_PER_BATCH, f"committed {name} lost"
    for name in appender.failed:
        assert name not in batches, f"failed {name} visible"
    assert set(batches) <= set(appender.committed) | set(appender.unknown)
    offsets = [r.offset for r in records]
    assert offsets == sorted(set(offsets))
    appender.writer.close()
