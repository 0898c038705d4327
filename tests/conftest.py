"""Shared fixtures: a real local Kafka broker (never librdkafka's mock cluster)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from wal.broker import LocalKafka


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """One KRaft node shared by the session; tests use their own topics."""
    broker = LocalKafka(tmp_path_factory.mktemp("kafka"), nodes=1)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def own_kafka(tmp_path: Path) -> Iterator[LocalKafka]:
    """A broker of the test's own, for tests that restart or kill it."""
    broker = LocalKafka(tmp_path / "kafka", nodes=1)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def topic(kafka: LocalKafka) -> str:
    name = unique("wal")
    kafka.create_topic(name, partitions=1)
    return name
