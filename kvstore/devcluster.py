"""`make up`: a local Kafka broker plus a store node on loopback, in the foreground.

Data lives in a visible directory (default `.data/`) and a second run resumes it: the broker
keeps its ports and log, the node its LevelDB checkpoint. Ctrl-C stops the node gracefully
(in-flight batches finish and are answered), then the broker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from wal.broker import KAFKA_VERSION, LocalKafka, free_port


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.devcluster", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path(".data"))
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--cluster", default="dev")
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
    node: subprocess.Popen[bytes] | None = None
    port_file = data_dir / "node-1.port"
    port = int(port_file.read_text()) if port_file.exists() else free_port()
    port_file.write_text(f"{port}\n")
    address = f"127.0.0.1:{port}"
    try:
        print(f"starting Kafka {KAFKA_VERSION} (KRaft) in {data_dir / 'kafka'} ...", flush=True)
        kafka.start()
        log_path = data_dir / "node-1.log"
        with open(log_path, "ab") as log:
            node = subprocess.Popen(
                [sys.executable, "-m", "kvstore.server", "--node-id", "node-1", "--listen", address,
                 "--data-dir", str(data_dir / "node-1"), "--kafka", kafka.bootstrap_servers,
                 "--cluster", args.cluster, "--shards", str(args.shards)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        print(f"starting store node-1 on {address} (log: {log_path}) ...", flush=True)
        _wait_serving(address, node, timeout_s=120)
        print(json.dumps({"kafka": kafka.bootstrap_servers, "endpoints": [address], "data_dir": str(data_dir)}))
        print(f"""
The store is up: {args.shards} shards, WAL topic {args.cluster}.wal on {kafka.bootstrap_servers}.

  export KVSTORE_ENDPOINTS={address}
  .venv/bin/kvstore put greeting hello
  .venv/bin/kvstore get greeting
  .venv/bin/kvstore scan --prefix gr
  .venv/bin/kvstore shards --output json
  grpcurl -plaintext {address} list

Ctrl-C stops the node and the broker; `make up` again resumes from {data_dir}.""", flush=True)
        while not stop:
            if node.poll() is not None:
                print(f"store node exited with {node.returncode}; see {log_path}", file=sys.stderr)
                return 1
            time.sleep(0.3)
        return 0
    finally:
        if node is not None and node.poll() is None:
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(30)
            except subprocess.TimeoutExpired:
                node.kill()
        kafka.stop()
        print("stopped.", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
