"""Placement with real processes, the cases of issue 33's review that need a cluster of their own
(docs/design.md §9): a drain refused below R and accepted with --force, a cold start of the whole
cluster with one node late past the grace period, a node whose settings disagree with the log's.
Not in the heavy group (tests/conftest.py): four nodes, no load, so it runs beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.client import ShardMap
from tests.integration.helpers import start_all
from tests.integration.store_process import REPO
from tests.integration.test_placement import GRACE_MS, SHARDS, Placed
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_a_drain_below_r_is_refused_unless_forced_and_a_late_node_at_cold_start_drops_no_copy(
        kafka: LocalKafka, tmp_path: Path) -> None:
    """Issue 33's review, with real processes: a drain that would leave a shard fewer than R nodes
    is refused naming the shards, and accepted with --force; then a cold start of the whole cluster
    with one node late past the grace period: its shards are re-placed on the others, and no shard
    that had a ready copy (caught up, in its group) is ever left without one meanwhile (the old
    per-node placement deleted a copy because the new placement named two empty learners)."""
    cluster = Placed(kafka.bootstrap_servers, tmp_path, 4)
    try:
        cluster.start()
        with cluster.client() as client:
            keys = [f"late/{i}".encode() for i in range(40)]
            for key in keys:
                client.put(key, key)
        cli = [sys.executable, "-m", "kvstore.cli", "--endpoints", ",".join(cluster.endpoints)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*cli, *args], cwd=REPO, capture_output=True, text=True, timeout=180, env=env)

        assert run("drain", "n1", "--wait-timeout", "120").returncode == 0
        assert run("drain", "n2", "--wait-timeout", "120").returncode == 0  # 2 left: R = 2 still holds
        refused = run("drain", "n3")
        assert refused.returncode == 1 and "fewer than R replicas" in refused.stderr, \
            (refused.returncode, refused.stderr)
        assert "shards 0-9" in refused.stderr and "--force" in refused.stderr, refused.stderr
        forced = run("drain", "n3", "--force", "--wait-timeout", "120")
        assert forced.returncode == 0, forced.stderr
        for node in ("n1", "n2", "n3"):
            assert run("drain", node, "--undo", "--no-wait").returncode == 0
        cluster.wait_placed(timeout_s=120)

        # A cold start with n4 late past the grace period.
        for node in cluster.nodes:
            node.stop()
        late = cluster.node("n4")
        early = [n for n in cluster.nodes if n is not late]
        ready_once: set[int] = set()
        violations: list[str] = []

        def watch_ready(smap: ShardMap) -> None:
            for info in smap.shards:
                ready = {r.node_id for r in info.replicas if r.state == "replica" and r.in_group and r.caught_up}
                if ready:
                    ready_once.add(info.shard)
                elif info.shard in ready_once:
                    violations.append(f"shard {info.shard}: no ready copy ({info.replicas})")

        start_all(early)
        deadline = time.monotonic() + GRACE_MS / 1000 + 4  # past the grace period: n4 is gone
        while time.monotonic() < deadline:
            with cluster.client() as client:
                watch_ready(client.shard_map(timeout_s=10))
            time.sleep(0.2)
        late.start(timeout_s=90)
        smap = cluster.wait_placed(timeout_s=120)
        watch_ready(smap)
        assert not violations, violations[:5]
        with cluster.client() as client:
            assert [client.get(key).value for key in keys] == keys
        # One configuration: a node whose R disagrees with the cluster's refuses to start, naming both.
        odd = subprocess.run(
            [sys.executable, "-m", "kvstore.server", "--kafka", cluster.kafka, "--cluster", cluster.name,
             "--shards", str(SHARDS), "--replication-factor", "3", "--node-id", "n9", "--data-dir",
             str(tmp_path / "n9"), "--listen", "127.0.0.1:0", "--log-format", "text"],
            cwd=REPO, capture_output=True, text=True, timeout=90, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert odd.returncode == 2, odd.stderr[-2000:]
        assert "replication factor 3 here, 2 in the placement log" in odd.stderr, odd.stderr[-2000:]
    finally:
        cluster.stop()
