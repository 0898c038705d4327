"""One real Spark session (local[2], loopback) for the whole test session: it takes ~7 s to start."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from kvstore import cli
from kvstore.pipeline.session import spark_session
from tests.conftest import unique
from tests.integration.store_process import StoreProcess
from wal.broker import LocalKafka


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = spark_session("local[2]", app_name="kvstore-tests")
    try:
        yield session
    finally:
        session.stop()


NODE_SHARDS = 2


@pytest.fixture
def node(kafka: LocalKafka, tmp_path: Path) -> Iterator[StoreProcess]:
    """One real node process with NODE_SHARDS shards on the session's broker, a cluster of its own."""
    store = StoreProcess(kafka.bootstrap_servers, tmp_path / "node", unique("pl").replace("-", ""),
                         shards=NODE_SHARDS)
    store.start()
    try:
        yield store
    finally:
        store.stop()


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """Run `kvstore ARGV` (exit 0 expected) and return its last stdout line, one JSON object."""
    status = cli.main(list(argv))
    captured = capsys.readouterr()
    assert status == 0, captured.err
    result: dict[str, Any] = json.loads(captured.out.strip().splitlines()[-1])
    return result
