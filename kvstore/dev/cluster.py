"""`make up`: a local Kafka broker plus three store nodes on loopback, in the foreground.

Data lives in a visible directory (default `.data/`) and a second run resumes it: the broker
keeps its ports and log, each node its LevelDB checkpoint and its port (50051, 50052, 50053
when free). A node that dies (say, killed by `kvstore demo failover`) is restarted after a
moment, like a process supervisor would, and takes shards again. Ctrl-C stops the nodes
gracefully (batches in flight finish and are answered), then the broker.

The nodes it started (id, address, pid, and the process's start time and command line) are
recorded in `children.json` in the data dir, rewritten on every (re)start and removed on exit:
`kvstore demo failover` kills only a process recorded there (`kvstore.dev.children`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.dev import children
from wal.broker import KAFKA_VERSION, LocalKafka, free_port

RESTART_DELAY_S = 2.0
FIRST_PORT = 50051


def _wait_serving(address: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the store node exited with {proc.returncode}; see its log")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KV"), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"the store node did not become SERVING within {timeout_s}s")
    finally:
        channel.close()


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ports(data_dir: Path, nodes: int) -> list[int]:
    """Each node's port, kept across runs (clients and the README's examples keep working)."""
    port_file = data_dir / "ports.json"
    saved: list[int] = json.loads(port_file.read_text()) if port_file.exists() else []
    ports = saved[:nodes]
    for i in range(len(ports), nodes):
        preferred = FIRST_PORT + i
        ports.append(preferred if _port_free(preferred) and preferred not in ports else free_port())
    port_file.write_text(json.dumps(ports) + "\n")
    return ports


class _Node:
    def __init__(self, node_id: str, address: str, data_dir: Path, kafka: str, args: argparse.Namespace) -> None:
        self.node_id = node_id
        self.address = address
        self.log_path = data_dir / f"{node_id}.log"
        self.cmd = [sys.executable, "-m", "kvstore.server", "--node-id", node_id, "--listen", address,
                    "--data-dir", str(data_dir / node_id), "--kafka", kafka, "--cluster", args.cluster,
                    "--shards", str(args.shards), "--session-timeout-ms", str(args.session_timeout_ms),
                    "--snapshot-dir", str(data_dir / "snapshots")]
        self.proc: subprocess.Popen[bytes] | None = None
        self.child: children.Child | None = None
        self.died_at: float | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # Its identity now, while it is our unreaped child: the pid cannot have been reused yet.
        self.child = children.child_of(self.node_id, self.address, self.proc.pid)
        self.died_at = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.dev.cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path(".data"))
    parser.add_argument("--nodes", type=int, default=3, choices=range(1, 10), metavar="N")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--cluster", default="dev")
    parser.add_argument("--session-timeout-ms", type=int, default=1500,
                        help="leadership group session timeout: SIGKILL failover takes about this + ~1 s")
    args = parser.parse_args(argv)
    data_dir: Path = args.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)

    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    kafka = LocalKafka(data_dir / "kafka", nodes=1)
    ports = _ports(data_dir, args.nodes)
    nodes: list[_Node] = []
    try:
        print(f"starting Kafka {KAFKA_VERSION} (KRaft) in {data_dir / 'kafka'} ...", flush=True)
        kafka.start()
        for i, port in enumerate(ports, start=1):
            node = _Node(f"node-{i}", f"127.0.0.1:{port}", data_dir, kafka.bootstrap_servers, args)
            node.start()
            nodes.append(node)
            _record(data_dir, nodes)
            print(f"starting {node.node_id} on {node.address} (log: {node.log_path}) ...", flush=True)
        for node in nodes:
            assert node.proc is not None
            _wait_serving(node.address, node.proc, timeout_s=120)
        endpoints = ",".join(n.address for n in nodes)
        snapshots = data_dir / "snapshots"
        print(json.dumps({"kafka": kafka.bootstrap_servers, "endpoints": [n.address for n in nodes],
                          "data_dir": str(data_dir), "snapshot_dir": str(snapshots)}))
        print(f"""
The store is up: {len(nodes)} nodes, {args.shards} shards, WAL topic {args.cluster}.wal on {kafka.bootstrap_servers}.

  export KVSTORE_ENDPOINTS={endpoints}
  .venv/bin/kvstore put greeting hello
  .venv/bin/kvstore get greeting
  .venv/bin/kvstore scan --prefix gr
  .venv/bin/kvstore shards                        # who leads what, terms, lag, nodes
  .venv/bin/kvstore demo failover --data-dir {data_dir} --output json   # SIGKILL a leader under load, verify
  .venv/bin/kvstore txn list --older-than 5s
  grpcurl -plaintext {nodes[0].address} list

The Spark pipeline (README "The Spark pipeline"); the nodes load snapshots from {snapshots}:

  export KVSTORE_KAFKA={kafka.bootstrap_servers}
  .venv/bin/kvstore snapshot create --dir {snapshots}
  .venv/bin/kvstore audit --dir {snapshots}
  .venv/bin/kvstore wal truncate --dir {snapshots} --dry-run
  .venv/bin/kvstore changes --to {data_dir / "changes"}

A node that dies is restarted after {RESTART_DELAY_S:.0f}s. Ctrl-C stops everything; `make up` again resumes
from {data_dir}.""", flush=True)
        while not stop:
            for node in nodes:
                assert node.proc is not None
                if node.proc.poll() is None:
                    continue
                if node.died_at is None:
                    node.died_at = time.monotonic()
                    print(f"{node.node_id} exited ({_how(node.proc.returncode)}); restarting it in "
                          f"{RESTART_DELAY_S:.0f}s (log: {node.log_path})", flush=True)
                elif time.monotonic() - node.died_at >= RESTART_DELAY_S:
                    node.start()
                    _record(data_dir, nodes)
                    print(f"{node.node_id} restarted on {node.address}", flush=True)
            time.sleep(0.2)
        return 0
    finally:
        for node in nodes:
            node.stop()
        for node in nodes:
            node.wait(30)
        children.forget(data_dir)
        kafka.stop()
        print("stopped.", flush=True)


def _record(data_dir: Path, nodes: list[_Node]) -> None:
    children.record(data_dir, [node.child for node in nodes if node.child is not None])


def _how(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
