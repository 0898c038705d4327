"""Truncation never cuts the commit-marker slot a quiet shard's leader assumed (issue 18, item 2).

A leader that commits a batch ending at `last` records `m:unverified = last + 1` and the
checkpoint `last + 2`; on a quiet shard that checkpoint is exactly the snapshot's cut. Every
resign, rebalance, restart or aborted batch moves the checkpoint back to `last + 1` to read the
slot (`rewind_unverified`). Had truncation deleted below the cut, that replay would start below
the log start: the node would reload the whole snapshot (with `--snapshot-dir`) or refuse the
shard (without). `kvstore wal truncate` keeps the slot (deletes below cut - 1), so none of those
events costs a snapshot load or a refusal.

Real broker, real node processes, real Spark: quiet shards, snapshot, truncate, then each event
in turn on the node that led them: a restart, a resign (a second node joins and takes a shard),
and a batch aborted by W2 (a record slipped in by a producer outside the guard). After each one
the node has loaded no snapshot, refused nothing, and every shard takes writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession

from kvstore.client import Client, ShardMap
from kvstore.core.sharding import shard_of
from tests.conftest import unique
from tests.integration.helpers import placement_settled
from tests.integration.store_process import StoreProcess
from tests.pipeline.conftest import cli_json
from tests.waiting import NotYet, wait_until
from wal.broker import LocalKafka
from wal.clients import PartitionEnds

pytestmark = [pytest.mark.kafka, pytest.mark.pipeline, pytest.mark.slow]

SHARDS = 2
REFUSALS = ("(truncated)", "was truncated at offset", "loading snapshot")  # what _out_of_range/_restore log


class Pair:
    def __init__(self, kafka: LocalKafka, base: Path) -> None:
        self.kafka = kafka
        self.cluster = unique("slot").replace("-", "")
        self.topic = f"{self.cluster}.wal"
        self.snapshots = str(base / "snapshots")
        self.base = base
        self.nodes = {name: StoreProcess(kafka.bootstrap_servers, base / name, self.cluster, shards=SHARDS,
                                         node_id=name, extra_args=("--snapshot-dir", self.snapshots), metrics=True)
                      for name in ("a", "b")}
        self.ends = PartitionEnds(kafka.bootstrap_servers, 20.0)

    def client(self) -> Client:
        live = [n.address for n in self.nodes.values() if n.proc is not None and n.proc.poll() is None]
        return Client(live, timeout_s=30, max_attempts=100, max_backoff_s=0.2)

    def leaders(self, expected_nodes: int) -> ShardMap:
        with self.client() as client:
            def settled() -> ShardMap:
                smap = client.shard_map(timeout_s=10)
                if len(smap.nodes) != expected_nodes or not placement_settled(smap, {n.node_id for n in smap.nodes}):
                    raise NotYet(smap)
                return smap

            return wait_until(settled, 90, interval_s=0.3, what=f"every shard led, {expected_nodes} nodes listed")

    def write_each_shard(self, tag: str) -> None:
        """One write per shard through the client; each must succeed (retries allowed)."""
        with self.client() as client:
            for shard in range(SHARDS):
                key = next(k for i in range(1000) if shard_of((k := f"{tag}-{i}").encode(), SHARDS) == shard)
                client.put(key, tag)
                assert client.get(key).value == tag.encode()

    def quiet(self, leader: str) -> dict[int, int]:
        """Every shard's end, once nothing is open and `leader` applied everything: a quiet shard
        whose last batch is the leader's own, its checkpoint the end and its marker assumed."""
        node = self.nodes[leader]

        def settled() -> dict[int, int]:
            ends = {s: self.ends.settled_end(self.topic, s, 10.0) for s in range(SHARDS)}
            applied = {s: int(node.metric("kvstore_applied_offset", shard=str(s))) for s in range(SHARDS)}
            if applied != ends:
                raise NotYet(f"ends {ends}, applied by {leader} {applied}")
            return ends

        return wait_until(settled, 30, interval_s=0.2, what=f"quiet shards, all applied by {leader}")

    def quiet_snapshot_and_truncate(self, capsys: pytest.CaptureFixture[str], leader: str = "a") -> dict[int, int]:
        """Snapshot the quiet shards and truncate; returns the cuts, which are then both the end of
        every shard and `leader`'s checkpoint (its assumed marker slot, cut - 1, is the log start).
        The leader may write by itself (a probe after its group membership wavered under load):
        a snapshot that such a write overtook is taken again, at most three times."""
        wal = ["--kafka", self.kafka.bootstrap_servers, "--topic", self.topic]
        seen: list[tuple[dict[int, int], dict[int, int]]] = []
        for _attempt in range(3):
            self.quiet(leader)
            created = cli_json(capsys, "--output", "json", "snapshot", "create", "--dir", self.snapshots,
                               "--master", "local[2]", *wal)
            cuts = {s["shard"]: s["offset"] for s in created["shards"]}
            truncated = cli_json(capsys, "--output", "json", "wal", "truncate", "--dir", self.snapshots, *wal)
            for s in truncated["shards"]:
                assert s["verified"] is True and s["held_by"] == []
                assert s["log_start_after"] == max(cuts[s["shard"]] - 1, s["log_start_before"]), s
            ends = self.quiet(leader)
            if ends == cuts:
                assert [self.ends.log_start(self.topic, s) for s in range(SHARDS)] == [cuts[s] - 1
                                                                                       for s in range(SHARDS)]
                return cuts
            seen.append((cuts, ends))
        raise AssertionError(f"the shards never stayed quiet from a snapshot to its truncation (cuts, ends): {seen}")

    def log_of(self, name: str) -> str:
        return (self.base / f"{self.cluster}-{name}.log").read_text(errors="replace")

    def mark(self, name: str) -> tuple[int, dict[int, float]]:
        """Where node `name` stands before an event: its log's length and its snapshot loads
        (0 after a start)."""
        node = self.nodes[name]
        if node.proc is None or node.proc.poll() is not None:
            return len(self.log_of(name)), dict.fromkeys(range(SHARDS), 0.0)
        return len(self.log_of(name)), {s: node.metric("kvstore_snapshot_loads_total", shard=str(s))
                                        for s in range(SHARDS)}

    def assert_no_load_no_refusal(self, name: str, mark: tuple[int, dict[int, float]]) -> None:
        since, loads_before = mark
        node = self.nodes[name]
        loads = {s: node.metric("kvstore_snapshot_loads_total", shard=str(s)) for s in range(SHARDS)}
        assert loads == loads_before, f"node {name} reloaded a snapshot: {loads_before} -> {loads}"
        new = self.log_of(name)[since:]
        refused = [line for line in new.splitlines() if any(r in line for r in REFUSALS)]
        assert not refused, f"node {name}: {refused[:3]}"

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


@pytest.fixture
def pair(kafka: LocalKafka, tmp_path: Path) -> Iterator[Pair]:
    group = Pair(kafka, tmp_path)
    try:
        yield group
    finally:
        group.stop()


def test_restart_resign_and_abort_after_truncating_a_quiet_shard(pair: Pair, spark: SparkSession,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    a, b = pair.nodes["a"], pair.nodes["b"]
    a.start()
    pair.leaders(1)
    pair.write_each_shard("before")

    # 1. Restart: the leader of both quiet shards stops cleanly and comes back (rewinds on lead).
    pair.quiet_snapshot_and_truncate(capsys)
    a.stop()
    mark = pair.mark("a")
    a.start()
    pair.leaders(1)
    pair.write_each_shard("after-restart")
    pair.assert_no_load_no_refusal("a", mark)

    # 2. Resign: b joins, the group moves a shard to it, a resigns that shard and follows it.
    pair.quiet_snapshot_and_truncate(capsys)
    mark = pair.mark("a")
    leads_before = a.metric("kvstore_leader_changes_total")
    b.start()
    smap = pair.leaders(2)
    moved = [s.shard for s in smap.shards if s.leader_id == "b"]
    assert moved, f"b leads nothing: {smap}"
    pair.write_each_shard("after-resign")
    pair.assert_no_load_no_refusal("a", mark)
    b.stop()  # the shard comes back to a (b is empty at start: loading the snapshot is its right)
    pair.leaders(1)
    assert a.metric("kvstore_leader_changes_total") > leads_before

    # 3. An aborted batch: a record slipped in behind a's last commit makes its next batch land one
    # offset late (W2): abort, rewind over the assumed marker slot, catch up, write again.
    pair.write_each_shard("before-abort")
    cuts = pair.quiet_snapshot_and_truncate(capsys)
    mark = pair.mark("a")
    shard = 0
    rejected = a.metric("kvstore_w3_rejections_total", shard=str(shard))
    intruder = Producer({"bootstrap.servers": pair.kafka.bootstrap_servers})
    reports: list[int] = []
    intruder.produce(pair.topic, b"no header, no entry", partition=shard,
                     on_delivery=lambda err, msg: reports.append(-1 if err else int(msg.offset() or 0)))
    assert intruder.flush(10) == 0 and reports == [cuts[shard]]
    pair.write_each_shard("after-abort")
    assert "bootstrapping again" in pair.log_of("a")[mark[0]:], "no batch was aborted: the test missed its point"
    assert a.metric("kvstore_w3_rejections_total", shard=str(shard)) > rejected  # it replayed from the slot on
    pair.assert_no_load_no_refusal("a", mark)
