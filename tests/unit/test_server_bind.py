"""A node refuses an address another process already serves (no silent SO_REUSEPORT sharing)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc

from wal.broker import free_port

REPO = Path(__file__).resolve().parents[2]


def test_second_node_on_a_taken_address_exits_with_a_clear_message(tmp_path: Path) -> None:
    port = free_port()
    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=[("grpc.so_reuseport", 0)])
    assert other.add_insecure_port(f"127.0.0.1:{port}") == port
    other.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvstore.server", "--kafka", "127.0.0.1:1", "--listen", f"127.0.0.1:{port}",
             "--data-dir", str(tmp_path / "data"), "--cluster", "bind"],
            capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        other.stop(None)
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
