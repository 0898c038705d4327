"""One real Spark session (local[2], loopback) for the whole test session: it takes ~7 s to start."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from kvstore.pipeline.session import spark_session


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = spark_session("local[2]", app_name="kvstore-tests")
    try:
        yield session
    finally:
        session.stop()
