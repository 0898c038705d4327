"""Which WAL a pipeline job works on: brokers, topic and shard count, resolved once per command."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from kvstore.pipeline.errors import PipelineError

KAFKA_ENV = "KVSTORE_KAFKA"


@dataclasses.dataclass(frozen=True)
class WalTarget:
    bootstrap_servers: str
    topic: str
    shards: int  # the topic's partition count: one partition per shard, fixed at creation


def resolve(kafka: str | None, topic: str | None, cluster: str | None, endpoints: Sequence[str],
            timeout_s: float) -> WalTarget:
    """The brokers come from --kafka or $KVSTORE_KAFKA. The topic from --topic, else from a live
    node's shard map (what the cluster really uses), else `<cluster>.wal` from --cluster."""
    from wal import UnavailableError, partition_count

    bootstrap = kafka or os.environ.get(KAFKA_ENV)
    if not bootstrap:
        raise PipelineError(f"the Kafka brokers are needed: --kafka HOST:PORT or ${KAFKA_ENV}")
    if topic is None:
        topic = _topic_from_cluster(endpoints, timeout_s)
    if topic is None:
        if not cluster:
            raise PipelineError("which WAL? give --topic, or --cluster NAME (topic NAME.wal), or --endpoints of a "
                                "running node")
        topic = f"{cluster}.wal"
    try:
        shards = partition_count(bootstrap, topic, timeout_s=max(timeout_s, 10.0))
    except UnavailableError as exc:
        raise PipelineError(str(exc)) from exc
    return WalTarget(bootstrap, topic, shards)


def _topic_from_cluster(endpoints: Sequence[str], timeout_s: float) -> str | None:
    from kvstore.client import Client, KvError

    try:
        with Client(list(endpoints), timeout_s=timeout_s) as client:
            return client.shard_map().topic or None
    except KvError:
        return None
