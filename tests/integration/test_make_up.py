"""`make up` and the CLI as a newcomer uses them: start, put/get/shards via `kvstore`, Ctrl-C, resume."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.integration.helpers import REPO

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
KVSTORE = str(Path(sys.executable).parent / "kvstore")  # the installed console script


def kvstore(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVSTORE, "--endpoints", endpoint, *args], capture_output=True, text=True, timeout=60,
                          check=False)


class DevCluster:
    def __init__(self, data_dir: Path, args: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.dev.cluster", "--data-dir", str(data_dir), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_endpoints(self, timeout_s: float = 180) -> dict[str, object]:
        while True:
            line = self.lines.get(timeout=timeout_s)
            if line.startswith("{"):
                info: dict[str, object] = json.loads(line)
                return info

    def interrupt(self) -> int:
        self.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        return self.proc.wait(90)

    def report(self, data_dir: Path) -> None:
        """After a failure: what the cluster printed, its record of its nodes and each node's log
        tail (pytest shows stdout of a failed test), so that a CI failure can be read."""
        while not self.lines.empty():
            print("cluster:", self.lines.get_nowait(), end="")
        record = data_dir / "children.json"
        print(record, record.read_text() if record.exists() else "(none)")
        for log in sorted(data_dir.glob("node-*.log")):
            print(f"--- {log} (last 60 lines)")
            print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))

    def cleanup(self) -> None:
        """After a failure: stop it as Ctrl-C would, so that its nodes (in sessions of their
        own) do not outlive the test and hold the default ports; kill it only as a last resort."""
        if self.proc.poll() is None:
            try:
                self.interrupt()
            except subprocess.TimeoutExpired:
                self.proc.kill()


def test_make_up_serves_round_trips_and_resumes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    cluster = DevCluster(data)
    try:
        info = cluster.wait_endpoints()
        endpoints: list[str] = info["endpoints"]  # type: ignore[assignment]
        assert len(endpoints) == 3
        endpoint = endpoints[0]
        assert kvstore(endpoint, "put", "k", "v").returncode == 0
        got = kvstore(endpoint, "get", "k", "--output", "json")
        assert got.returncode == 0 and json.loads(got.stdout)["value"] == "v", got
        # Each node's Prometheus endpoint, as printed, with the request latency histogram.
        metrics: list[str] = info["metrics"]  # type: ignore[assignment]
        assert len(metrics) == 3 and all(m.startswith("http://127.0.0.1:") for m in metrics), metrics
        scraped = [urllib.request.urlopen(m, timeout=10).read().decode() for m in metrics]
        assert any('kvstore_request_duration_seconds_count{code="OK",method="Put"}' in text for text in scraped)
        shards = kvstore(endpoint, "shards", "--output", "json")
        assert shards.returncode == 0, shards.stderr
        shard_map = json.loads(shards.stdout)
        assert {n["address"] for n in shard_map["nodes"]} == set(endpoints), shard_map
        assert all(s["leader"] in endpoints and s["leader_ready"] for s in shard_map["shards"]), shard_map
        assert kvstore(endpoint, "get", "", "--output", "json").returncode == 2  # clear error, no traceback
        # The demo kills only a node the dev cluster recorded as its own child: without the
        # cluster's data dir it refuses, before any load, with a clear message.
        refused = kvstore(",".join(endpoints), "demo", "failover", "--data-dir", str(tmp_path / "elsewhere"))
        assert refused.returncode == 1 and "only a node the local dev cluster started" in refused.stderr, refused
        assert "Traceback" not in refused.stderr
        # The failover demo against the running cluster: kill a leader under load, then verify.
        demo = kvstore(",".join(endpoints), "demo", "failover", "--data-dir", str(data), "--output", "json",
                       "--warmup", "2", "--after", "3")
        assert demo.returncode == 0, demo.stderr
        result = json.loads(demo.stdout.splitlines()[-1])
        assert result["acked"] > 0 and result["acked_lost"] == 0 and result["duplicates"] == 0, result
        assert result["failed_but_applied"] == 0 and result["ok"], result
        assert result["replicas_equal"] is True and result["new_leader"] != result["killed"], result
        assert cluster.interrupt() == 0
    except BaseException:
        cluster.report(data)
        raise
    finally:
        cluster.cleanup()

    again = DevCluster(data)  # a second run resumes from the same directory
    try:
        endpoint = again.wait_endpoints()["endpoints"][0]  # type: ignore[index]
        got = kvstore(endpoint, "get", "k", "--output", "json")
        assert got.returncode == 0 and json.loads(got.stdout)["value"] == "v", got
        assert again.interrupt() == 0
    finally:
        again.cleanup()
    leftovers = subprocess.run(["pgrep", "-f", str(data)], capture_output=True, text=True, check=False).stdout
    assert leftovers.strip() == "", "processes of the dev cluster survived Ctrl-C"
    assert not (data / "children.json").exists(), "the record of the dev cluster's nodes outlived it"
