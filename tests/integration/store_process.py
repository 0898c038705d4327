"""A real store node in its own process (`python -m kvstore.server`), for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.v1 import cluster_pb2_grpc, kv_pb2_grpc
from wal.broker import free_port

REPO = Path(__file__).resolve().parents[2]


class StoreProcess:
    def __init__(self, kafka: str, data_dir: Path, cluster: str, shards: int = 4, port: int | None = None,
                 extra_args: tuple[str, ...] = (), node_id: str = "node-1") -> None:
        self.extra_args = extra_args
        self.node_id = node_id
        self.kafka = kafka
        self.data_dir = data_dir
        self.cluster = cluster
        self.shards = shards
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None
        self.env: dict[str, str] = {}  # extra environment, e.g. KVSTORE_FAILPOINTS

    def start(self, timeout_s: float = 60.0) -> StoreProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir.parent / f"{self.cluster}-{self.node_id}.log", "ab")  # noqa: SIM115
        cmd = [sys.executable, "-m", "kvstore.server", "--kafka", self.kafka, "--data-dir", str(self.data_dir),
               "--listen", self.address, "--cluster", self.cluster, "--shards", str(self.shards),
               "--transaction-timeout-ms", "20000", "--node-id", self.node_id, *self.extra_args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO), **self.env})
        log.close()
        self.channel = grpc.insecure_channel(self.address)
        self.wait_serving(timeout_s)
        return self

    def wait_serving(self, timeout_s: float) -> None:
        assert self.channel is not None and self.proc is not None
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"store exited with {self.proc.returncode}"
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KV"), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"store not SERVING after {timeout_s}s")

    @property
    def kv(self) -> kv_pb2_grpc.KVStub:
        assert self.channel is not None
        return kv_pb2_grpc.KVStub(self.channel)

    @property
    def cluster_stub(self) -> cluster_pb2_grpc.ClusterStub:
        assert self.channel is not None
        return cluster_pb2_grpc.ClusterStub(self.channel)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)
