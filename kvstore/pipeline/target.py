"""Which WAL a pipeline job works on: brokers, topic and shard count, and the Kafka login, resolved
once per command."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvstore.pipeline.errors import PipelineError

if TYPE_CHECKING:  # wal/ (confluent-kafka) is imported only when a command runs: `kvstore --help` needs none
    from wal.clients import ClientSecurity

KAFKA_ENV = "KVSTORE_KAFKA"
# The pipeline's Kafka login, named as the node's (`kvstore serve`) are: the variables of the
# shell that runs the command (docs/security.md, "Kafka security").
SECURITY_PROTOCOL_ENV = "KVSTORE_KAFKA_SECURITY_PROTOCOL"
SASL_MECHANISM_ENV = "KVSTORE_KAFKA_SASL_MECHANISM"
USERNAME_ENV = "KVSTORE_KAFKA_USERNAME"
PASSWORD_ENV = "KVSTORE_KAFKA_PASSWORD"
PASSWORD_FILE_ENV = "KVSTORE_KAFKA_PASSWORD_FILE"


@dataclasses.dataclass(frozen=True)
class WalTarget:
    bootstrap_servers: str
    topic: str
    shards: int  # the topic's partition count: one partition per shard, fixed at creation
    # Who the command's Kafka clients (librdkafka's and Spark's) log in as: the pipeline's
    # principal, which may read the WAL and nothing more (`wal.acl`). None: plaintext, anonymous.
    security: ClientSecurity | None = None


def kafka_security(protocol: str | None, mechanism: str | None, username: str | None, password_file: str | None,
                   environ: Mapping[str, str] = os.environ) -> ClientSecurity:
    """The login from the flags, else the environment. The password from the file
    --kafka-password-file names, else $KVSTORE_KAFKA_PASSWORD, else the file
    $KVSTORE_KAFKA_PASSWORD_FILE names: never from a flag (a command line is visible to all)."""
    from wal.clients import read_password, security_from

    try:
        if password_file:
            password = read_password(password_file)
        elif environ.get(PASSWORD_ENV):
            password = environ[PASSWORD_ENV]
        elif environ.get(PASSWORD_FILE_ENV):
            password = read_password(environ[PASSWORD_FILE_ENV])
        else:
            password = ""
        return security_from(protocol or environ.get(SECURITY_PROTOCOL_ENV, ""),
                             mechanism or environ.get(SASL_MECHANISM_ENV, ""),
                             username or environ.get(USERNAME_ENV, ""), password)
    except ValueError as exc:
        raise PipelineError(f"Kafka login: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class Told:
    """What a live node says of the WAL: its topic, and how it reaches Kafka (no credential)."""

    topic: str
    bootstrap_servers: str
    security_protocol: str
    sasl_mechanism: str


def ask_cluster(endpoints: Sequence[str], timeout_s: float) -> Told | None:
    """The WAL as a live node at `endpoints` (the store's own, KVSTORE_ENDPOINTS) describes it;
    None when no node answered. With TLS and tokens from the same KVSTORE_* settings as the CLI."""
    from kvstore.client import Client, KvError

    try:
        with Client(list(endpoints), timeout_s=timeout_s) as client:
            smap = client.shard_map()
    except KvError:
        return None
    bootstrap, protocol, mechanism = smap.kafka
    return Told(smap.topic, bootstrap, protocol, mechanism)


def resolve(kafka: str | None, topic: str | None, cluster: str | None, told: Told | None,
            timeout_s: float, security: ClientSecurity | None = None) -> WalTarget:
    """The brokers come from --kafka, $KVSTORE_KAFKA, else what a live node said it uses. The
    topic from --topic, else from a live node's shard map (what the cluster really uses), else
    `<cluster>.wal` from --cluster."""
    from wal import UnavailableError, partition_count

    bootstrap = kafka or os.environ.get(KAFKA_ENV) or (told.bootstrap_servers if told else "")
    if not bootstrap:
        raise PipelineError(f"the Kafka brokers are needed: --kafka HOST:PORT, ${KAFKA_ENV}, or --endpoints of a "
                            "running node (it tells the brokers it uses)")
    if topic is None and told is not None and told.topic:
        topic = told.topic
    if topic is None:
        if not cluster:
            raise PipelineError("which WAL? give --topic, or --cluster NAME (topic NAME.wal), or --endpoints of a "
                                "running node")
        topic = f"{cluster}.wal"
    try:
        shards = partition_count(bootstrap, topic, timeout_s=max(timeout_s, 10.0), security=security)
    except UnavailableError as exc:
        raise PipelineError(str(exc)) from exc
    return WalTarget(bootstrap, topic, shards, security)
