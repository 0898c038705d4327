"""W4: a new writer fences the old one; nothing the zombie does afterwards becomes visible."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvstore.server.config import ReplicaConfig
from kvstore.server.replica import writer_config
from tests.integration.helpers import ZombieProcess, payloads, replay_all, writer
from wal import FencedError, ShardWriter, UnknownOutcomeError, shard_transactional_id
from wal.broker import LocalKafka

pytestmark = pytest.mark.kafka


def test_zombie_appends_fail_as_fenced_and_stay_invisible(kafka: LocalKafka, topic: str) -> None:
    a = writer(kafka.bootstrap_servers, topic, "a")
    b = writer(kafka.bootstrap_servers, topic, "b")
    a.fence()
    a.append([b"a1", b"a2"])

    b.fence()  # takeover: bumps the epoch, A is now a zombie
    b.append([b"b1"])

    for attempt in range(3):  # every later append of A fails the same way
        with pytest.raises(FencedError):
            a.append([f"a-late-{attempt}".encode()])
    b.append([b"b2"])  # B is unaffected by A's attempts

    records, _replayer = replay_all(kafka.bootstrap_servers, topic)
    assert payloads(records) == [b"a1", b"a2", b"b1", b"b2"]
    assert {r.writer.id for r in records} == {"a", "b"}
    assert b.stats.fencings == 0 and a.stats.fencings >= 1
    a.close()
    b.close()


def test_a_prepared_writer_fences_nobody_until_it_fences(kafka: LocalKafka, topic: str) -> None:
    """Standby replicas keep a prepared (connected, uninitialised) writer for a fast takeover:
    it must leave the live leader alone until it calls fence()."""
    a = writer(kafka.bootstrap_servers, topic, "a")
    b = writer(kafka.bootstrap_servers, topic, "b")
    a.fence()
    a.append([b"a1"])
    b.prepare()
    # The point of the test is an absence: the prepared writer, left alone a while (ample time for
    # anything librdkafka might do on its own), has not fenced A. Only A's next append can tell.
    time.sleep(2.0)
    a.append([b"a2"])  # still the shard's writer
    assert b.fence() == a.upcoming_offset
    with pytest.raises(FencedError):
        a.append([b"a-late"])
    b.append([b"b1"])
    records, _replayer = replay_all(kafka.bootstrap_servers, topic)
    assert payloads(records) == [b"a1", b"a2", b"b1"]
    a.close()
    b.close()


def test_paused_zombie_with_open_transaction_is_fenced_on_resume(kafka: LocalKafka, topic: str) -> None:
    """A is really paused (SIGSTOP) with an open, fully delivered transaction; B takes over and
    writes; A resumes and tries to commit. Nothing of A's after B's takeover is visible."""
    tid = shard_transactional_id(f"zombie.{topic}", 0)
    zombie = ZombieProcess(kafka.bootstrap_servers, topic, tid, ["before", "zombie", "after"],
                           pause_before_commit="zombie")
    try:
        assert zombie.next_event()["event"] == "fenced-in"
        assert zombie.next_event() == {"event": "committed", "batch": "before", "offsets": [0, 1, 2]}
        assert zombie.next_event() == {"event": "paused", "batch": "zombie"}
        zombie.wait_stopped()

        b = writer(kafka.bootstrap_servers, topic, "b")
        b = type(b)(type(b.config)(**{**b.config.__dict__, "transactional_id": tid}))
        b.fence()  # aborts A's open transaction and fences A
        b.append([b"b1", b"b2"])

        zombie.resume()
        events = zombie.finish()
    finally:
        zombie.kill()

    by_batch = {e["batch"]: e for e in events}
    # Fenced while committing: the writer cannot know the outcome (W7), but it is fenced.
    assert by_batch["zombie"]["event"] == "error"
    assert by_batch["zombie"]["type"] in (UnknownOutcomeError.__name__, FencedError.__name__)
    assert by_batch["after"] == {**by_batch["after"], "event": "error", "type": FencedError.__name__}

    records, _ = replay_all(kafka.bootstrap_servers, topic)
    assert payloads(records) == [b"before-0", b"before-1", b"before-2", b"b1", b"b2"]
    b.append([b"b3"])
    records, _ = replay_all(kafka.bootstrap_servers, topic)
    assert payloads(records)[-1] == b"b3"
    b.close()


def test_two_deployments_sharing_a_topic_fence_each_other(kafka: LocalKafka, topic: str, tmp_path: Path) -> None:
    """Two clusters by name, one WAL topic (an explicit --topic): their shard writers share the
    transactional id, so the second to take the shard fences the first (W4 across deployments)."""
    def shard_writer(cluster: str) -> ShardWriter:
        return ShardWriter(writer_config(ReplicaConfig(
            cluster=cluster, topic=topic, shard=0, bootstrap_servers=kafka.bootstrap_servers,
            node_id=f"{cluster}-node", data_dir=tmp_path / cluster)))

    blue, green = shard_writer("blue"), shard_writer("green")
    try:
        blue.fence()
        blue.append([b"blue-1"])
        green.fence()
        with pytest.raises(FencedError):
            blue.append([b"blue-late"])
        green.append([b"green-1"])
        records, _ = replay_all(kafka.bootstrap_servers, topic)
        assert payloads(records) == [b"blue-1", b"green-1"]
    finally:
        blue.close()
        green.close()
