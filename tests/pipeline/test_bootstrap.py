"""Snapshot, truncate, and nodes that come back (or are new) load the snapshot and replay the tail.

Real broker, real node processes, real Spark: after `kvstore wal truncate` a node whose
checkpoint lies below the new log start and a node with an empty data directory, both started
with `--snapshot-dir`, end with the same digest as the node that never stopped, and still answer
a retry of a request made before the cut with its original result (the request-id table travels
in the snapshot).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from kvstore.client import Client
from kvstore.v1 import cluster_pb2
from tests.conftest import unique
from tests.integration.store_process import StoreProcess
from tests.pipeline.conftest import cli_json
from tests.waiting import NotYet, wait_until
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.pipeline, pytest.mark.slow]

SHARDS = 2


class Nodes:
    def __init__(self, kafka: str, base: Path, snapshots: str) -> None:
        self.cluster = unique("boot").replace("-", "")
        self.nodes = {name: StoreProcess(kafka, base / name, self.cluster, shards=SHARDS, node_id=name,
                                         extra_args=("--snapshot-dir", snapshots), metrics=True)
                      for name in ("a", "b", "c")}

    def client(self, *names: str) -> Client:
        return Client([self.nodes[n].address for n in names], timeout_s=30, max_attempts=100, max_backoff_s=0.2)

    def digests(self, name: str) -> dict[int, tuple[int, str]]:
        stub = self.nodes[name].cluster_stub
        out = {}
        for shard in range(SHARDS):
            d = stub.ShardDigest(cluster_pb2.ShardDigestRequest(shard=shard), timeout=10)
            out[shard] = (d.applied_offset, d.sha256)
        return out

    def wait_equal(self, names: list[str], timeout_s: float = 60.0) -> dict[int, tuple[int, str]]:
        def agreed() -> dict[int, tuple[int, str]]:
            seen = {n: self.digests(n) for n in names}
            if any(seen[n] != seen[names[0]] for n in names):
                raise NotYet(seen)
            return seen[names[0]]

        return wait_until(agreed, timeout_s, interval_s=0.5, what=f"replicas {names} to agree")

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


@pytest.fixture
def nodes(kafka: LocalKafka, tmp_path: Path) -> Iterator[Nodes]:
    group = Nodes(kafka.bootstrap_servers, tmp_path, str(tmp_path / "snapshots"))
    try:
        yield group
    finally:
        group.stop()


def test_nodes_bootstrap_from_a_snapshot_after_truncation(
        nodes: Nodes, kafka: LocalKafka, tmp_path: Path, spark: SparkSession,
        capsys: pytest.CaptureFixture[str]) -> None:
    a, b, c = nodes.nodes["a"], nodes.nodes["b"], nodes.nodes["c"]
    a.start()
    b.start()
    with nodes.client("a", "b") as client:
        for i in range(300):
            client.put(f"k{i:03d}", f"v{i}")
        first = client.put("old", "request", request_id="rid-old")
        first_attempt_ms = int(time.time() * 1000)
    nodes.wait_equal(["a", "b"])
    b.stop()  # b's checkpoint stays here, below the cut to come
    with nodes.client("a") as client:
        for i in range(200, 400):
            client.put(f"k{i:03d}", f"w{i}")

    common = ["--endpoints", a.address, "--output", "json"]
    wal = ["--kafka", kafka.bootstrap_servers, "--topic", f"{nodes.cluster}.wal"]
    snapshots = str(tmp_path / "snapshots")
    created = cli_json(capsys, *common, "snapshot", "create", "--dir", snapshots, "--master", "local[2]", *wal)
    cuts = {s["shard"]: s["offset"] for s in created["shards"]}  # type: ignore[attr-defined]
    dry = cli_json(capsys, *common, "wal", "truncate", "--dir", snapshots, "--dry-run", *wal)
    assert all(s["log_start_before"] == 0 for s in dry["shards"])  # type: ignore[attr-defined]
    truncated = cli_json(capsys, *common, "wal", "truncate", "--dir", snapshots, *wal)
    for s in truncated["shards"]:  # type: ignore[attr-defined]
        assert s["log_start_before"] == 0 and s["log_start_after"] == cuts[s["shard"]] - 1 > 0  # the marker slot kept

    with nodes.client("a") as client:  # the tail after the cut
        for i in range(350, 450):
            client.put(f"k{i:03d}", f"x{i}")
        client.delete("k000")

    b.start()  # checkpoint below the log start: out of range, loads the snapshot, replays the tail
    c.start()  # empty: loads the snapshot first
    final = nodes.wait_equal(["a", "b", "c"])
    assert all(final[s][0] > cuts[s] for s in range(SHARDS))
    for name in ("b", "c"):
        loads = {s: nodes.nodes[name].metric("kvstore_snapshot_loads_total", shard=str(s)) for s in range(SHARDS)}
        assert all(n >= 1 for n in loads.values()), f"node {name} did not load the snapshot: {loads}"

    a.stop()  # b and c lead now; neither ever saw rid-old's write happen, only its snapshot
    with nodes.client("b", "c") as client:
        retry = client.put("old", "request", request_id="rid-old", first_attempt_unix_ms=first_attempt_ms)
        assert retry.replayed and retry.revision == first.revision
        assert client.get("old").kv.version == 1  # type: ignore[union-attr]
        assert client.get("k000").kv is None and client.get("k449").kv.value == b"x449"  # type: ignore[union-attr]
