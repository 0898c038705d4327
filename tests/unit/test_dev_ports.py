"""`make up`'s node ports (kvstore/dev/cluster.py `_ports`): kept across runs while free, replaced
when another process took one meanwhile (a resume used to wait forever for a node that could not
listen: seen when the suite's other tests ran beside `make up`'s)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from kvstore.dev import cluster
from wal.broker import free_port


def test_a_saved_port_is_kept_while_free_and_replaced_once_taken(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    first, second = free_port(), free_port()
    (tmp_path / "ports.json").write_text(json.dumps([first, second]))
    assert cluster._ports(tmp_path, 2) == [first, second]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", second))
        taken.listen()
        ports = cluster._ports(tmp_path, 2)
    assert ports[0] == first and ports[1] != second
    assert json.loads((tmp_path / "ports.json").read_text()) == ports
    assert f"port {second} is taken by another process; using {ports[1]} instead" in capsys.readouterr().err


def test_metrics_ports_are_kept_apart_from_the_grpc_ports(tmp_path: Path) -> None:
    grpc_ports = cluster._ports(tmp_path, 2)
    clash = grpc_ports[1]  # a saved metrics port that is now one of the gRPC ports
    (tmp_path / "metrics_ports.json").write_text(json.dumps([free_port(), clash]))
    metrics = cluster._ports(tmp_path, 2, first=cluster.FIRST_METRICS_PORT, name="metrics_ports.json",
                             what="metrics port", taken=grpc_ports)
    assert len(set(metrics)) == 2 and not set(metrics) & set(grpc_ports)
    assert json.loads((tmp_path / "metrics_ports.json").read_text()) == metrics
