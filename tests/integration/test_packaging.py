"""The base install is the client and the CLI: `pip install .` into a fresh virtualenv, without
extras, talks to a real node, and never installs Kafka's or LevelDB's bindings (docs/development.md, "Packages")."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.integration.store_process import REPO, StoreProcess
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SERVER_ONLY = ("confluent-kafka", "plyvel", "prometheus-client", "pyspark", "pyarrow")
_SKIP = shutil.ignore_patterns(".venv", ".data", ".git", "build", "*.egg-info", "__pycache__", "bench", "tests")


def _run(cmd: list[str], timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)


def test_pip_install_without_extras_gives_a_working_client_and_cli(kafka: LocalKafka, tmp_path: Path) -> None:
    # A copy of the source tree with its generated stubs (as `make proto` leaves them), so the
    # build does not write into the repository.
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=_SKIP)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    installed = _run([python, "-m", "pip", "install", "-q", str(source)], timeout_s=540)
    assert installed.returncode == 0, installed.stderr[-3000:]

    listed = _run([python, "-m", "pip", "list", "--format=freeze"])
    names = {line.split("==")[0].lower().replace("_", "-") for line in listed.stdout.splitlines()}
    assert "grpcio" in names and "protobuf" in names
    assert not names & set(SERVER_ONLY), f"the base install pulled in {sorted(names & set(SERVER_ONLY))}"

    node = StoreProcess(kafka.bootstrap_servers, tmp_path / "node", cluster=f"pkg{tmp_path.name[-6:]}",
                        shards=2).start()
    try:
        cli = str(env_dir / "bin" / "kvstore")
        put = _run([cli, "--endpoints", node.address, "-o", "json", "put", "pkg-key", "pkg-value"])
        assert put.returncode == 0, put.stderr
        got = _run([cli, "--endpoints", node.address, "-o", "json", "get", "pkg-key"])
        assert got.returncode == 0 and '"pkg-value"' in got.stdout, (got.stdout, got.stderr)
        client = _run([python, "-c", (
            "from kvstore.client import Client\n"
            f"with Client(['{node.address}']) as c:\n"
            "    print(c.get(b'pkg-key').value.decode())")])
        assert client.returncode == 0 and client.stdout.strip() == "pkg-value", client.stderr
    finally:
        node.stop()

    # What needs an extra says which one, in one line, instead of a traceback.
    serve = _run([cli, "serve", "--kafka", "127.0.0.1:1"])
    assert serve.returncode == 1 and "pip install 'kvstore[server]'" in serve.stderr, serve.stderr
    assert "Traceback" not in serve.stderr
    audit = _run([cli, "audit", "--kafka", "127.0.0.1:1", "--cluster", "x", "--dir", str(tmp_path / "snaps")])
    assert audit.returncode == 1 and "pip install 'kvstore[spark]'" in audit.stderr, audit.stderr
    assert "Traceback" not in audit.stderr
    assert sys.executable != python
