"""A writer that stalls with an open transaction is aborted by the broker, not waited for forever."""

from __future__ import annotations

import time

import pytest

from tests.integration.helpers import ZombieProcess, payloads, writer
from wal import (
    BatchAbortedError,
    FencedError,
    Replayer,
    UnknownOutcomeError,
    WriterFatalError,
    shard_transactional_id,
)
from wal.broker import LocalKafka

pytestmark = pytest.mark.kafka

TXN_TIMEOUT_MS = 4_000


def test_stalled_writer_is_aborted_after_transaction_timeout(kafka: LocalKafka, topic: str) -> None:
    tid = shard_transactional_id(f"stall.{topic}", 0)
    stalled = ZombieProcess(kafka.bootstrap_servers, topic, tid, ["before", "stalled", "after"],
                            pause_before_commit="stalled", txn_timeout_ms=TXN_TIMEOUT_MS)
    try:
        assert stalled.next_event()["event"] == "fenced-in"
        assert stalled.next_event()["event"] == "committed"
        assert stalled.next_event() == {"event": "paused", "batch": "stalled"}
        stalled.wait_stopped()
        paused_at = time.monotonic()

        # The stalled records sit below the high watermark and hold the LSO back: a reader
        # that wants the end must wait, but only until the broker aborts the transaction.
        with Replayer(kafka.bootstrap_servers, topic, 0, 0) as reader:
            end = reader.end_offset()
            assert reader.stable_offset() < end
            records = list(reader.read_to(end, timeout_s=TXN_TIMEOUT_MS / 1000 + 30))
            waited_s = time.monotonic() - paused_at
        assert payloads(records) == [b"before-0", b"before-1", b"before-2"]
        assert waited_s >= TXN_TIMEOUT_MS / 1000 * 0.5, "the LSO moved before the transaction timed out?"

        stalled.resume()
        events = {e["batch"]: e for e in stalled.finish()}
    finally:
        stalled.kill()

    # The broker's abort bumped the producer epoch: the resumed writer cannot commit.
    assert events["stalled"]["event"] == "error"
    assert events["stalled"]["type"] in {c.__name__ for c in
                                         (UnknownOutcomeError, FencedError, WriterFatalError, BatchAbortedError)}

    survivor = writer(kafka.bootstrap_servers, topic, "survivor")
    survivor = type(survivor)(type(survivor.config)(**{**survivor.config.__dict__, "transactional_id": tid}))
    survivor.append([b"next leader"])
    with Replayer(kafka.bootstrap_servers, topic, 0, 0) as reader:
        everything = payloads(list(reader.read_to_end(30)))
    assert b"next leader" in everything
    assert not any(p.startswith(b"stalled") for p in everything)
    assert events["after"]["event"] == "error" or any(p.startswith(b"after") for p in everything)
    survivor.close()
