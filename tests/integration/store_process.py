"""A real store node in its own process (`python -m kvstore.server`), for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvstore.v1 import cluster_pb2_grpc, kv_pb2_grpc
from tests.waiting import wait_until
from wal.broker import free_port

REPO = Path(__file__).resolve().parents[2]
# A metric family's samples: the family's own name (gauges) or it with the type's suffix.
_SAMPLE_SUFFIXES = ("", "_total", "_created", "_sum", "_count", "_bucket")


class StoreProcess:
    def __init__(self, kafka: str, data_dir: Path, cluster: str, shards: int = 4, port: int | None = None,
                 extra_args: tuple[str, ...] = (), node_id: str = "node-1", metrics: bool = False,
                 credentials: grpc.ChannelCredentials | None = None, host: str = "127.0.0.1",
                 launcher: tuple[str, ...] = (), log_path: Path | None = None) -> None:
        """`host` and `launcher` (a command prefix that execs the node in place, e.g. `nsenter
        --net=...`) run it in a network of its own (tests/robustness)."""
        self.launcher = launcher
        self.log_path = log_path
        self.extra_args = extra_args
        self.credentials = credentials  # TLS for `channel` (a node started with --tls-cert); None: plaintext
        self.node_id = node_id
        self.kafka = kafka
        self.data_dir = data_dir
        self.cluster = cluster
        self.shards = shards
        self.port = port or free_port()
        self.address = f"{host}:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None
        self.env: dict[str, str] = {}  # extra environment, e.g. KVSTORE_FAILPOINTS
        # The node's Prometheus endpoint (`metric()`): what tests assert on instead of log text.
        self.metrics_port = free_port() if metrics else None

    def start(self, timeout_s: float = 60.0) -> StoreProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path or self.data_dir.parent / f"{self.cluster}-{self.node_id}.log", "ab")  # noqa: SIM115
        cmd = [*self.launcher, sys.executable, "-m", "kvstore.server", "--kafka", self.kafka,
               "--data-dir", str(self.data_dir), "--listen", self.address, "--cluster", self.cluster,
               "--shards", str(self.shards), "--transaction-timeout-ms", "20000", "--node-id", self.node_id,
               *self.extra_args]
        if self.metrics_port is not None:
            cmd += ["--metrics-port", str(self.metrics_port)]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO), **self.env})
        log.close()
        self.channel = (grpc.secure_channel(self.address, self.credentials) if self.credentials is not None
                        else grpc.insecure_channel(self.address))
        self.wait_serving(timeout_s)
        return self

    def wait_serving(self, timeout_s: float) -> None:
        assert self.channel is not None and self.proc is not None
        health = health_pb2_grpc.HealthStub(self.channel)
        proc = self.proc

        def serving() -> bool:
            assert proc.poll() is None, f"store exited with {proc.returncode}"
            reply = health.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVService"), timeout=1)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

        wait_until(serving, timeout_s, interval_s=0.1, what=f"store {self.node_id} at {self.address} to be SERVING")

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the node's samples called `name` (e.g. `kvstore_fencings_total`) whose labels
        include `labels`; 0 if it has none with those labels. Needs `metrics=True`. A name the node
        does not export at all fails (a typo must not read as 0)."""
        assert self.metrics_port is not None, "start the node with metrics=True"
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        families = list(text_string_to_metric_families(text))
        exported = {family.name + suffix for family in families for suffix in _SAMPLE_SUFFIXES}
        assert name in exported, f"node {self.node_id} exports no metric {name}"
        samples = [sample for family in families for sample in family.samples if sample.name == name]
        return sum(s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items()))

    @property
    def kv(self) -> kv_pb2_grpc.KVServiceStub:
        assert self.channel is not None
        return kv_pb2_grpc.KVServiceStub(self.channel)

    @property
    def cluster_stub(self) -> cluster_pb2_grpc.ClusterServiceStub:
        assert self.channel is not None
        return cluster_pb2_grpc.ClusterServiceStub(self.channel)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
            print(f"{self.node_id} did not stop within {timeout_s} s of {sig.name}: killed")
        if sig in (signal.SIGTERM, signal.SIGINT) and code != 0:  # a graceful stop failed: show why (pytest prints it)
            self.print_log_tail()
        return code

    def print_log_tail(self, lines: int = 80) -> None:
        path = self.log_path or self.data_dir.parent / f"{self.cluster}-{self.node_id}.log"
        if path.exists():
            print(f"--- {path} (last {lines} lines)")
            print("\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
