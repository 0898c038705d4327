"""A node's configuration: every setting defined once, here, with its type, default, help and
checks, and read from three places, highest first: `kvstore serve` flags, KVSTORE_* environment
variables, a TOML file (`--config FILE` or KVSTORE_CONFIG). The flags are generated from the
fields (`add_flags`), so a setting cannot exist in one place and not in another.

A KVSTORE_* variable that names no setting (a typo: KVSTORE_SHRADS) is refused at startup with the
closest name, and so is an unknown key in the file: a setting silently ignored is a node silently
misconfigured. Variables the node does not read but other parts of the project do (the CLI's
KVSTORE_ENDPOINTS, the dev tools') are known here by name (`OTHER_VARIABLES`), so one shell can
hold them all.

`ReplicaConfig` is the part each shard replica runs with: internal, built by the node.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import difflib
import os
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

import wal.clients
import wal.writer
from kvstore import limits
from kvstore.core import placement, placement_log
from kvstore.core.placement_controller import DEFAULT_MAX_LEARNERS_PER_NODE

ENV_PREFIX = "KVSTORE_"
CONFIG_VARIABLE = "KVSTORE_CONFIG"  # the TOML file, when --config is not given

# KVSTORE_* variables read elsewhere (not node settings): a node accepts them in its environment.
OTHER_VARIABLES: Mapping[str, str] = {
    CONFIG_VARIABLE: "kvstore serve: the configuration file",
    "KVSTORE_ENDPOINTS": "the CLI and the client: the nodes to ask",
    "KVSTORE_CA": "the client: the CA of the nodes' certificates",
    "KVSTORE_CERT": "the client: its certificate",
    "KVSTORE_KEY": "the client: its private key",
    "KVSTORE_TOKEN": "the client: its bearer token",
    "KVSTORE_TOKEN_FILE": "the client: a file holding its bearer token",
    "KVSTORE_DEV_DATA_DIR": "kvstore demo: the dev cluster's data directory",
    "KVSTORE_KAFKA_HOME": "the local Kafka's jars (wal.broker)",
    "KVSTORE_SPARK_HOME": "the Spark jars (kvstore.pipeline)",
    "KVSTORE_SPARK_MASTER": "the Spark master of the pipeline",
    "KVSTORE_SPARK_LOG_LEVEL": "the Spark log level of the pipeline",
    "KVSTORE_FAILPOINTS": "tests: failures injected into a node",
    "KVSTORE_CLOCK_OFFSET_FILE": "tests: a file whose integer (ms) is added to the node's wall clock",
    "KVSTORE_SIM_SEED": "tests: the simulation's seed",
    "KVSTORE_SIM_SEEDS": "tests: the simulation's seeds",
    "KVSTORE_SIM_STEPS": "tests: the simulation's length",
    "KVSTORE_SIM_MUTATION": "tests: the simulation's broken variant to run",
}

# Flags that are not `--<field-name>`: (flag, the value it sets, its help). Fields mapped to None
# have no flag (a password never sits in a command line, where `ps` shows it).
_SPECIAL_FLAGS: Mapping[str, tuple[str, object, str] | None] = {
    "lead": ("--follower", False, "never lead: a read replica that only follows (stale reads, scans, watches)"),
    "standby": ("--no-standby", False, "do not follow the shards this node does not lead (takeovers then "
                                       "replay everything since the checkpoint)"),
    "kafka_password": None,
}

# A node id names its consumer group members, its records in the placement log
# (kvstore.core.placement_log.MAX_NODE_ID_BYTES, the same bound) and its copies in every shard map: short.
MAX_NODE_ID_BYTES = placement_log.MAX_NODE_ID_BYTES

_FILE_VALUES: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar("kvstore_config_file",
                                                                                        default=None)


class _FileSource(PydanticBaseSettingsSource):
    """The TOML file's values (read by `NodeConfig.load`), below the environment."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_FILE_VALUES.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_VALUES.get() or {})


class NodeConfig(BaseSettings):
    """Every setting of a node. Frozen once loaded; checked as a whole (`_check`)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid", case_sensitive=False,
                                      validate_default=True)

    node_id: str = Field("node-1", description="this node's name, unique in the cluster")
    listen: str = Field("127.0.0.1:50051", description="gRPC host:port")
    advertise: str = Field("", description="the address clients and nodes should use (default: --listen)")
    advertise_client: str = Field("", description="the address clients should use when it is not the one the other "
                                                  "nodes use (a published container port, a NAT; as Kafka's "
                                                  "advertised listeners): shard maps and leader hints name it "
                                                  "(default: --advertise)")
    data_dir: Path = Field(Path(".data/node-1"), description="the replicas' LevelDB directory")
    kafka: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers")
    cluster: str = Field("kvstore", description="cluster name; names the WAL topic, transactional ids and group")
    shards: int = Field(4, ge=1, le=1024, description="shard count, fixed when the cluster is created")
    topic: str = Field("", description="the WAL topic (default <cluster>.wal)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus metrics port (0: no metrics endpoint)")
    # Loopback by default: the endpoint has no authentication. 0.0.0.0 in a container, for a
    # Prometheus on the same network.
    metrics_host: str = Field("127.0.0.1", description="address the metrics endpoint binds (it has no authentication)")
    transaction_timeout_ms: int = Field(60_000, ge=1000, description="the WAL writer's Kafka transaction timeout")
    replication_factor: int = Field(placement.DEFAULT_REPLICATION_FACTOR, ge=1, le=64,
                                    description="replicas of each shard, capped by the number of nodes: a node "
                                                "stores and applies only the shards placed on it (docs/design.md §9)")
    placement_grace_ms: int = Field(placement.DEFAULT_GRACE_MS, ge=0, le=3_600_000,
                                    description="how long a node that left or died still counts for placement before "
                                                "its shards are placed elsewhere (a restart within it moves nothing)")
    placement_max_learners: int = Field(DEFAULT_MAX_LEARNERS_PER_NODE, ge=1, le=64,
                                        description="learners one node bootstraps at once, at most (the cluster's "
                                                    "setting, recorded in the placement log by its first controller)")
    watch_progress_ms: int = Field(limits.WATCH_PROGRESS_MS, ge=100, le=3_600_000,
                                   description="how often, at most, a watch that asked for progress events learns how "
                                               "far each busy shard got (etcd's progress notify)")
    zone: str = Field("", max_length=64, description="this node's zone (rack, availability zone): placement spreads "
                                                     "each shard's replicas over as many zones as it can")
    txn_in_doubt_ms: int = Field(limits.TXN_IN_DOUBT_AFTER_MS, ge=100, le=86_400_000,
                                 description="a cross-shard transaction prepared this long ago at a shard this node "
                                             "leads is in doubt: the node resolves it from its coordinator's WAL "
                                             "(abort if undecided; docs/design.md §10)")
    txn_finish_after_ms: int = Field(limits.TXN_FINISH_AFTER_MS, ge=100, le=86_400_000,
                                     description="a cross-shard decision the coordinator shards this node leads have "
                                                 "held this long is resolved again at every participant, then "
                                                 "forgotten (its driver died, or a participant was away)")
    max_request_ids: int = Field(limits.MAX_REQUEST_IDS, ge=16, le=10_000_000,
                                 description="request ids each shard remembers (with the time horizon, "
                                             "REQUEST_ID_HORIZON_MS): every node of a cluster must use the same value "
                                             "(a snapshot records it); lowered only by tests that must see ids "
                                             "forgotten")
    wal_replication_factor: int = Field(0, ge=0, description="the WAL topic's Kafka replication factor when the node "
                                                             "creates it (0: min(3, number of brokers))")
    max_pending_writes: int = Field(limits.MAX_PENDING_WRITES_PER_SHARD, ge=1, le=1_000_000,
                                    description="writes queued per shard before RESOURCE_EXHAUSTED")
    lead: bool = Field(True, description="hold the shards placed on this node and lead them when elected (false: "
                                         "a read replica of every shard that never leads and holds no placement: "
                                         "stale reads, scans, watches)")
    standby: bool = Field(True, description="follow the shards this node does not lead, for short takeovers "
                                            "(false: they stay at their checkpoint and a takeover replays the rest)")
    session_timeout_ms: int = Field(1500, ge=1000, le=300_000,
                                    description="leadership group session timeout: how long a dead node keeps its "
                                                "shards (SIGKILL failover takes about this + ~1 s; at least the "
                                                "broker's group.min.session.timeout.ms)")
    group: str = Field("", description="the membership consumer group; each shard's leadership group is "
                                       "<group>.<shard> (default <cluster>.leaders)")
    snapshot_dir: str = Field("", description="snapshots (`kvstore snapshot create --dir`) to bootstrap an empty, "
                                              "suspect or truncated-below replica from")
    # How the node logs in to Kafka (all of its clients, as one principal: docs/security.md, "Kafka security").
    kafka_security_protocol: str = Field("", description="PLAINTEXT (default), or SASL_PLAINTEXT with a username, "
                                                         "SASL_SSL, SSL")
    kafka_sasl_mechanism: str = Field("", description="SASL mechanism (default SCRAM-SHA-512)")
    kafka_username: str = Field("", description="the store's Kafka principal")
    kafka_password: str = Field("", repr=False, description="its password (environment or file only, never a flag)")
    kafka_password_file: str = Field("", description="a file holding the Kafka password")
    # gRPC security (docs/security.md; kvstore.server.auth checks the combination). No
    # certificate: plaintext, no authentication, and a loud warning at startup.
    tls_cert: str = Field("", description="this node's certificate chain, PEM; with --tls-key the port speaks "
                                          "TLS only. Without: plaintext, no authentication")
    tls_key: str = Field("", description="its private key, PEM")
    tls_client_ca: str = Field("", description="mutual TLS: every caller must present a certificate this CA "
                                               "signed; its role is a URI SAN kvstore-role:ROLE")
    tokens_file: str = Field("", description="bearer tokens: '<sha256 hex> <role> <name>' per line")
    node_token_file: str = Field("", description="the token (role node) this node shows the other nodes")
    peer_ca: str = Field("", description="the CA of the other nodes' certificates (default --tls-client-ca, "
                                         "else the system's roots)")
    auth: str = Field("", description="none: TLS without authentication, on purpose (default auto: TLS needs "
                                      "--tokens-file or --tls-client-ca)")

    wal_topic_default_suffix: ClassVar[str] = ".wal"

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (given to the constructor) over KVSTORE_* variables over the file."""
        return init_settings, env_settings, _FileSource(settings_cls)

    @field_validator("cluster")
    @classmethod
    def _cluster(cls, value: str) -> str:
        if not value or "." in value:  # it names the topic "<cluster>.wal" and the group "<cluster>.leaders"
            raise ValueError("must be non-empty and contain no dot")
        return value

    @field_validator("zone")
    @classmethod
    def _zone(cls, value: str) -> str:
        problem = placement_log.zone_problem(value)
        if problem is not None:  # the placement log's own rule: a zone it would skip is refused here
            raise ValueError(f"--zone: {problem}")
        return value

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, value: str) -> str:
        if not value or "@" in value or len(value.encode()) > MAX_NODE_ID_BYTES:
            raise ValueError(f"must be 1..{MAX_NODE_ID_BYTES} bytes and contain no '@'")
        return value

    @model_validator(mode="after")
    def _check(self) -> NodeConfig:
        """What no single setting decides: the Kafka login's combination."""
        try:
            self.kafka_security.validate()
        except ValueError as exc:
            raise ValueError(f"Kafka login: {exc}") from exc
        return self

    @property
    def wal_topic(self) -> str:
        return self.topic or f"{self.cluster}{self.wal_topic_default_suffix}"

    @property
    def leader_group(self) -> str:
        return self.group or f"{self.cluster}.leaders"

    @property
    def address(self) -> str:
        return self.advertise or self.listen

    @property
    def kafka_security(self) -> wal.clients.ClientSecurity:
        """What every Kafka client of the node is configured with (checked by `_check`)."""
        return wal.clients.security_from(self.kafka_security_protocol, self.kafka_sasl_mechanism,
                                         self.kafka_username, self.kafka_password)

    # ---- loading ---------------------------------------------------------------------------

    @classmethod
    def env_name(cls, field: str) -> str:
        return f"{ENV_PREFIX}{field.upper()}"

    @classmethod
    def load(cls, flags: Mapping[str, object] | None = None, *, config_file: Path | str | None = None) -> NodeConfig:
        """Flags (`from_args`) over the environment over the file over the defaults; raises
        ConfigError saying which setting, from where, and why."""
        env = {name.upper(): value for name, value in os.environ.items()}
        problems = unknown_variables(env)
        if problems:
            raise ConfigError("; ".join(problems))
        path = config_file or env.get(CONFIG_VARIABLE) or None
        file_values = _read_file(Path(path)) if path else {}
        given = {k: v for k, v in (flags or {}).items() if v is not None}
        # The Kafka password: from the file a flag names, else a password given in the
        # environment (or the config file), else from the file those name.
        password_given = env.get(cls.env_name("kafka_password")) or file_values.get("kafka_password")
        password_file = given.get("kafka_password_file") or (
            None if password_given else env.get(cls.env_name("kafka_password_file")) or
            file_values.get("kafka_password_file"))
        if password_file:
            given["kafka_password"] = wal.clients.read_password(str(password_file))
        token = _FILE_VALUES.set(file_values)
        try:
            return cls(**given)  # type: ignore[arg-type]  # strings from flags: pydantic converts them
        except ValidationError as exc:
            raise ConfigError(_explain(exc, given, env, path)) from None
        finally:
            _FILE_VALUES.reset(token)

    @classmethod
    def from_env(cls, **flags: object) -> NodeConfig:
        """The environment (and KVSTORE_CONFIG) with `flags` over it: `load` by another name."""
        return cls.load(flags)


class ConfigError(ValueError):
    """A setting is unknown or invalid; the message names it and where it came from."""


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """Why each KVSTORE_* variable in `environ` that nobody reads is refused (with the closest
    known name). Pure."""
    known = {NodeConfig.env_name(name) for name in NodeConfig.model_fields} | set(OTHER_VARIABLES)
    problems = []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX) or name.upper() in known:
            continue
        close = difflib.get_close_matches(name.upper(), sorted(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        problems.append(f"unknown setting {name}{hint}: no part of kvstore reads it; unset it")
    return problems


def _read_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as source:
            raw = tomllib.load(source)
    except OSError as exc:
        raise ConfigError(f"configuration file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"configuration file {path} is not TOML: {exc}") from exc
    unknown = sorted(set(raw) - set(NodeConfig.model_fields))
    if unknown:
        hints = [f"{key}" + (f" (did you mean {m[0]}?)" if (m := difflib.get_close_matches(
            key, sorted(NodeConfig.model_fields), n=1)) else "") for key in unknown]
        raise ConfigError(f"configuration file {path}: unknown settings {', '.join(hints)}")
    return raw


def _explain(exc: ValidationError, flags: Mapping[str, object], env: Mapping[str, str], path: object) -> str:
    lines = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        message = str(error["msg"]).removeprefix("Value error, ")
        if not name:
            lines.append(message)
            continue
        where = (f"flag {flag_of(name) or name}" if name in flags else f"env {NodeConfig.env_name(name)}"
                 if NodeConfig.env_name(name) in env else f"file {path}" if path else "default")
        lines.append(f"{name} ({where}): {message} (got {error.get('input')!r})")
    return "invalid configuration: " + "; ".join(lines)


def flag_of(field: str) -> str:
    """The flag that sets `field` ("" for a setting that has none)."""
    if field not in _SPECIAL_FLAGS:
        return "--" + field.replace("_", "-")
    special = _SPECIAL_FLAGS[field]
    return special[0] if special else ""


def _shown(default: object) -> str:
    return "none" if default in ("", None) else str(default)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, from the fields (help, env name, default): `from_args` reads them."""
    group = parser.add_argument_group("settings (flag > env > --config file > default)")
    group.add_argument("--config", metavar="FILE", help=f"a TOML file of settings (env {CONFIG_VARIABLE})")
    for name, field in NodeConfig.model_fields.items():
        special = _SPECIAL_FLAGS.get(name, ())
        if special is None:
            continue
        help_text = f"{field.description} (env {NodeConfig.env_name(name)}; default {_shown(field.default)})"
        if special:
            flag, value, text = special
            group.add_argument(flag, dest=name, action="store_const", const=value, default=None,
                               help=f"{text} (env {NodeConfig.env_name(name)}=false)")
        elif field.annotation is bool:
            group.add_argument(f"--{name.replace('_', '-')}", dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        else:
            group.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, help=help_text,
                               metavar=name.upper())


def from_args(args: argparse.Namespace) -> NodeConfig:
    """The configuration of parsed `add_flags` arguments (strings: pydantic converts and checks)."""
    flags = {name: getattr(args, name) for name in NodeConfig.model_fields if hasattr(args, name)}
    return NodeConfig.load(flags, config_file=args.config)


def describe() -> Iterator[tuple[str, str, str, str]]:
    """(setting, flag, environment variable, help) of every setting, for a table of them (docs/operations.md)."""
    for name, field in NodeConfig.model_fields.items():
        yield name, flag_of(name), NodeConfig.env_name(name), str(field.description)


@dataclasses.dataclass(frozen=True)
class ReplicaConfig:
    cluster: str
    topic: str
    shard: int
    bootstrap_servers: str
    node_id: str
    data_dir: Path
    transaction_timeout_ms: int = 60_000
    call_timeout_s: float = 10.0
    bootstrap_timeout_s: float = 120.0
    linger_ms: float = limits.BATCH_LINGER_MS
    max_batch_records: int = limits.MAX_BATCH_RECORDS
    max_batch_bytes: int = limits.MAX_BATCH_BYTES
    max_record_bytes: int = limits.MAX_WAL_RECORD_BYTES
    max_pending_writes: int = limits.MAX_PENDING_WRITES_PER_SHARD
    barrier_timeout_s: float = 10.0
    # Snapshots to load when this replica is empty or below the WAL's log start (None: replay only).
    snapshot_dir: str | None = None
    max_request_ids: int = limits.MAX_REQUEST_IDS  # the request-id table's count bound (NodeConfig)
    # The node's Kafka login, for every client the replica creates (writer, replayers, ends).
    kafka_security: wal.clients.ClientSecurity = dataclasses.field(default_factory=wal.clients.ClientSecurity)
