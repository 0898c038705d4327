"""Placement with real node processes on a real broker (docs/design.md §9): five nodes, ten shards,
two replicas each.

Each node holds only the shards placed on it, on disk too; a SIGKILLed node's led shards fail
over to their other replica and are re-replicated after the grace period; a sixth node joins
and takes shards, and the givers drop theirs; `drain` empties a node and `move` places a
shard, under a hostile record in the placement log and with the controller's node SIGKILLed
mid-drain. Throughout, the demo's workload checks that nothing acknowledged is lost, nothing applied
twice and replicas end equal, and single-key registers are checked for linearizability.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

import wal
import wal.record
from kvstore.client import Client, ShardMap
from kvstore.core.sharding import shard_of
from kvstore.dev import demo
from kvstore.v1 import kv_pb2
from tests.conftest import unique
from tests.integration.helpers import start_all
from tests.integration.registers import Registers
from tests.integration.store_process import REPO, StoreProcess
from tests.integration.test_cluster import acks_grow
from tests.waiting import wait_until
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SHARDS = 10
RF = 2
GRACE_MS = 4000  # the placement grace period (30 s by default): short, so the test need not wait long
SESSION_TIMEOUT_MS = 1500


class Placed:
    """N store nodes of one cluster with placement (R = 2)."""

    def __init__(self, kafka: str, base: Path, nodes: int) -> None:
        self.kafka = kafka
        self.base = base
        self.name = unique("kp").replace("-", "")
        self.nodes = [self._node(f"n{i}") for i in range(1, nodes + 1)]

    def _node(self, node_id: str) -> StoreProcess:
        return StoreProcess(self.kafka, self.base / node_id, self.name, shards=SHARDS, node_id=node_id, metrics=True,
                            extra_args=("--replication-factor", str(RF), "--placement-grace-ms", str(GRACE_MS),
                                        "--session-timeout-ms", str(SESSION_TIMEOUT_MS)))

    def start(self) -> Placed:
        start_all(self.nodes)
        self.wait_placed()
        return self

    def add(self, node_id: str) -> StoreProcess:
        node = self._node(node_id)
        self.nodes.append(node)
        return node.start(timeout_s=90)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def live(self) -> list[StoreProcess]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    @property
    def endpoints(self) -> list[str]:
        return [n.address for n in self.live()]

    def client(self) -> Client:
        return Client(self.endpoints, timeout_s=20, max_attempts=100, max_backoff_s=0.1)

    def node(self, node_id: str) -> StoreProcess:
        return next(n for n in self.nodes if n.node_id == node_id)

    def wait_placed(self, timeout_s: float = 90.0) -> ShardMap:
        """Settled: every live node listed, every shard led, and held by exactly its placed nodes
        as caught-up replicas (no learner, no retiring copy, nobody else)."""
        live = {n.node_id for n in self.live()}

        def placed() -> ShardMap | None:
            with self.client() as client:
                smap = client.shard_map(timeout_s=10)
            if {n.node_id for n in smap.nodes} != live:
                return None
            for info in smap.shards:
                copies = {(r.node_id, r.state, r.in_group) for r in info.replicas}
                if not info.leader_ready or len(info.placed_on) != min(RF, len(live)) or \
                        copies != {(node, "replica", True) for node in info.placed_on}:
                    return None
            return smap

        return wait_until(placed, timeout_s, interval_s=0.5,
                          what="every shard led and held by exactly its placed nodes")


def write_hostile_record(kafka: str, topic: str, payload: bytes) -> None:
    """A record in the placement log that its readers accept (W3: it lands where its header says)
    but that is no placement record: a producer outside the store, at the log's end."""
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": "hostile", "enable.auto.commit": False})
    try:
        _low, end = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    finally:
        consumer.close()
    value, headers = wal.record.encode(end, wal.WriterIdentity("intruder", 0), payload)
    producer = Producer({"bootstrap.servers": kafka})
    producer.produce(topic, value, partition=0, headers=headers)
    assert producer.flush(10) == 0


def held_on_disk(node: StoreProcess) -> set[int]:
    return {int(p.name.removeprefix("shard-")) for p in node.data_dir.glob("shard-*")
            if p.name.removeprefix("shard-").isdigit()}


def held_in_map(smap: ShardMap, node_id: str) -> set[int]:
    return {info.shard for info in smap.shards if any(r.node_id == node_id for r in info.replicas)}


def keys_of(smap: ShardMap, count: int = 4) -> list[bytes]:
    return [f"register/{i}".encode() for i in range(count)]


@pytest.fixture
def placed(kafka: LocalKafka, tmp_path: Path) -> Iterator[Placed]:
    cluster = Placed(kafka.bootstrap_servers, tmp_path, 5).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def verify(cluster: Placed, workload: demo.Workload, registers: Registers) -> None:
    workload.stop()
    registers.stop()
    with cluster.client() as client:
        verdict = demo.verify(client, workload, timeout_s=90)
    assert verdict.acked > 0
    assert verdict.acked_lost == 0, f"acknowledged writes lost: {verdict.lost_examples}"
    assert verdict.duplicates == 0
    assert verdict.failed_but_applied == 0, verdict.failed_applied_examples
    assert verdict.replicas_equal, verdict.replicas
    assert registers.completed > 20, registers.errors[-5:]
    assert registers.check() is None


def test_each_node_holds_its_shards_and_a_joining_node_takes_some_under_a_pause(placed: Placed) -> None:
    smap = placed.wait_placed()
    for node in placed.nodes:
        mine = held_in_map(smap, node.node_id)
        assert len(mine) == RF * SHARDS // 5, (node.node_id, mine)  # 4 each: the bounded load
        # Nothing else on disk (a copy dropped a moment ago may still be being removed).
        wait_until(lambda n=node, m=mine: held_on_disk(n) == m, 30, interval_s=0.2,
                   what=f"{node.node_id}'s data directory holding exactly its shards")
    workload = demo.Workload(placed.endpoints, SHARDS, writers_per_shard=1).start()
    registers = Registers(placed.endpoints, keys_of(smap)).start()
    acks_grow(workload)
    before = {n.node_id: held_on_disk(n) for n in placed.nodes}
    newcomer = placed.add("n6")
    # While the newcomer's learners load, pause a node past the session timeout: its leaderships
    # fail over, and it wakes up a zombie in the middle of the moves.
    paused = placed.node("n3")
    assert paused.proc is not None
    paused.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(3 * SESSION_TIMEOUT_MS / 1000)
    finally:
        paused.proc.send_signal(signal.SIGCONT)
    smap = placed.wait_placed(timeout_s=120)
    taken = held_in_map(smap, "n6")
    assert 2 <= len(taken) <= 4, taken
    # A dropped copy leaves the map before its directory is gone: wait for the disks to agree.
    wait_until(lambda: all(held_on_disk(n) == held_in_map(smap, n.node_id) for n in placed.nodes), 30,
               interval_s=0.2, what="every data directory holding exactly the node's copies")
    # R·S replicas before and after: the five nodes gave up exactly what the newcomer took.
    old = placed.nodes[:5]
    assert sum(len(before[n.node_id]) for n in old) - sum(len(held_on_disk(n)) for n in old) == len(taken)
    assert newcomer.metric("kvstore_placement_steps_total", step="join") >= len(taken)
    assert newcomer.metric("kvstore_learner_bytes_total") > 0
    assert sum(n.metric("kvstore_placement_steps_total", step="drop") for n in placed.nodes[:5]) >= len(taken)
    acks_grow(workload)
    verify(placed, workload, registers)


def test_a_node_without_a_copy_forwards_writes_reads_and_watches(placed: Placed) -> None:
    smap = placed.wait_placed()
    shard = 5
    outsider = next(n for n in placed.nodes if n.node_id not in smap.shards[shard].placed_on)
    key = next(k for k in (f"fwd/{i}".encode() for i in range(1000)) if shard_of(k, SHARDS) == shard)
    kv = outsider.kv
    watch = kv.Watch(kv_pb2.WatchRequest(key=key), timeout=30)
    assert next(watch).type == kv_pb2.WatchResponse.TYPE_CREATED  # served in a part by a holder
    put = kv.Put(kv_pb2.PutRequest(key=key, value=b"v1", request_id="fwd-1"), timeout=20)
    assert put.result.shard == shard and put.version == 1
    for consistency in (kv_pb2.CONSISTENCY_LINEARIZABLE, kv_pb2.CONSISTENCY_LEADER_LOCAL, kv_pb2.CONSISTENCY_STALE):
        read = kv_pb2.ReadOptions(consistency=consistency, min_revision=put.result.revision)
        got = kv.Get(kv_pb2.GetRequest(key=key, read=read), timeout=20)
        assert got.found and got.kv.value == b"v1" and got.header.served_by != outsider.node_id, consistency
    event = next(watch)
    assert (event.type, event.kv.key, event.kv.value, event.shard) == (kv_pb2.WatchResponse.TYPE_PUT, key, b"v1", shard)
    prefix = kv.Watch(kv_pb2.WatchRequest(prefix=b"fwd/"), timeout=30)  # every shard: some here, some elsewhere
    assert next(prefix).type == kv_pb2.WatchResponse.TYPE_CREATED
    kv.Put(kv_pb2.PutRequest(key=key, value=b"v2", request_id="fwd-2"), timeout=20)
    assert next(prefix).kv.value == b"v2"
    watch.cancel()
    prefix.cancel()
    scan = kv.Scan(kv_pb2.ScanRequest(prefix=b"fwd/"), timeout=20)
    assert [(r.key, r.value) for r in scan.kvs] == [(key, b"v2")]
    assert outsider.metric("kvstore_forwarded_requests_total") >= 4


def test_sigkill_fails_over_to_the_other_replica_and_re_replicates(placed: Placed) -> None:
    smap = placed.wait_placed()
    workload = demo.Workload(placed.endpoints, SHARDS, writers_per_shard=1).start()
    registers = Registers(placed.endpoints, keys_of(smap)).start()
    acks_grow(workload)
    victim = placed.node(smap.shards[0].leader_id)
    led = {info.shard for info in smap.shards if info.leader_id == victim.node_id}
    victim.stop(signal.SIGKILL)
    with placed.client() as client:
        for shard in led:  # each led shard goes to its other replica
            new, _term, _at = demo.wait_for_new_leader(client, shard, victim.node_id, 30)
            assert new in smap.shards[shard].placed_on and new != victim.node_id
    acks_grow(workload)
    # After the grace period the victim's shards are placed on the survivors, who load them.
    smap = placed.wait_placed(timeout_s=120)
    assert all(victim.node_id not in info.placed_on for info in smap.shards)
    verify(placed, workload, registers)


def test_drain_empties_a_node_and_move_places_a_shard(placed: Placed) -> None:
    smap = placed.wait_placed()
    workload = demo.Workload(placed.endpoints, SHARDS, writers_per_shard=1).start()
    registers = Registers(placed.endpoints, keys_of(smap)).start()
    acks_grow(workload)
    drained = placed.node("n2")
    assert held_on_disk(drained)
    # Issue 33: one hostile record, written by a producer outside the store where the log's readers
    # accept it (the right expected offset), stopped placement on every node for good. Now every
    # node skips and counts it, and placement goes on.
    write_hostile_record(placed.kafka, f"{placed.name}.wal.placement", b"[" * 2400)
    cli = [sys.executable, "-m", "kvstore.cli", "--endpoints", ",".join(placed.endpoints), "-o", "json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen([*cli, "drain", "n2", "--wait-timeout", "150"], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env) as drain:
        assert drain.stdout is not None
        line = drain.stdout.readline()
        assert line, drain.communicate(timeout=10)[1]
        first = json.loads(line)  # the changes: recorded by the controller
        assert first["changes"], first
        # The controller's node is SIGKILLed mid-drain and comes back within the grace period: another
        # node takes the office over from the log, and the drain completes.
        with placed.client() as client:
            controller = placed.node(client.shard_map().controller)
            term = client.placement_log(1).controller_term
        controller.stop(signal.SIGKILL)
        controller.start(timeout_s=90)
        out, err = drain.communicate(timeout=180)
    assert drain.returncode == 0, err
    records = [first, *(json.loads(line) for line in out.splitlines())]
    assert records[-1]["done"] is True and len(records) >= 2  # the changes, then progress until done
    with placed.client() as client:
        log = client.placement_log(1000)
    assert log.controller_term > term  # the office moved on
    assert sum(log.skipped.values()) >= 1, log.skipped  # the hostile record, skipped
    assert any(e.kind == "drain" and "n2" in e.summary for e in log.entries)
    smap = placed.wait_placed()
    assert not held_in_map(smap, "n2")
    wait_until(lambda: not held_on_disk(drained), 30, interval_s=0.5, what="n2's data removed")
    # Move one shard to a node that does not hold it.
    shard = 3
    target = next(n.node_id for n in placed.nodes if n.node_id not in smap.shards[shard].placed_on
                  and n.node_id != "n2")
    with placed.client() as client:
        changes = client.move_shard(shard, target)
        assert any(c.shard == shard and target in c.after for c in changes)
        assert client.wait_moves(changes, timeout_s=120).done
        assert target in client.shard_map().shards[shard].placed_on
        client.drain("n2", undo=True)  # n2 may hold shards again

    def n2_holds_shards() -> ShardMap | None:
        smap = placed.wait_placed(timeout_s=120)
        return smap if held_in_map(smap, "n2") else None

    smap = wait_until(n2_holds_shards, 120, interval_s=0.5, what="n2 holding shards again")
    assert target in smap.shards[shard].placed_on  # the pin holds
    assert held_on_disk(drained) == held_in_map(smap, "n2")
    acks_grow(workload)
    time.sleep(0.5)
    verify(placed, workload, registers)

