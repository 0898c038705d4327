"""A real Apache Kafka on loopback, for development and tests: KRaft, combined broker+controller.

The jars come from Maven Central through `wal/kafka/pom.xml` (`python -m wal.broker fetch`,
run by `make kafka`) into a cache outside git. One node, or three (replication factor 3,
min.insync.replicas=2) for fault tests. Every broker setting the project relies on is in
`BROKER_SETTINGS` below; nothing else in the repo configures the broker.

Never replace this with librdkafka's mock cluster: it lets a fenced producer commit, so it
cannot test the single-writer guard (W4).

Secure mode (`secure=True`, fixed when the data directory is formatted): clients must log in
with SASL/SCRAM-SHA-512 on the broker listener (SASL_PLAINTEXT), and the standard authorizer
refuses everything no ACL allows (`allow.everyone.if.no.acl.found=false`; the ACLs themselves
are `wal.acl`'s). The admin principal is the only super user: the brokers use it among
themselves and the controllers use it on their own listener (SASL/PLAIN, the only user the
controllers know: a client cannot get in there either). Its SCRAM credentials and those of the
`users` asked for are written into the metadata at format time (`kafka-storage format
--add-scram`, KIP-900), so nothing runs unauthenticated even once; the passwords are generated
and kept in `credentials.json` in the data directory (mode 0600), where `credentials()` reads
them for whoever hands them out (the dev cluster, the tests).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    NewTopic,
    OffsetSpec,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialAlteration,
    UserScramCredentialUpsertion,
)

from wal.clients import SASL_PLAINTEXT, SCRAM_SHA_512, ClientSecurity, client_config

KAFKA_VERSION = "4.1.1"  # pinned; the pom's default is kept equal (see wal/kafka/pom.xml)
POM = Path(__file__).resolve().parent / "kafka" / "pom.xml"

# KIP-890 part 2: a server-side epoch bump per transaction closes the "delayed commit lands on
# a later transaction" hole (docs/design.md §4.2). Set explicitly at format time, not left to defaults.
TRANSACTION_VERSION = 2

# The broker settings the store and its tests rely on: this is the one place they live.
BROKER_SETTINGS: Mapping[str, str] = {
    # A writer may ask for any transaction.timeout.ms up to this (the broker refuses more).
    "transaction.max.timeout.ms": "900000",
    # How often the coordinator looks for transactions open past their timeout and aborts them
    # (fencing the stalled producer). Default 10 s; 1 s keeps "stalled leader" tests short.
    "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
    # How often a broker heartbeats its controller (default 2 s); the session is per node count
    # (`_replication_settings`).
    "broker.heartbeat.interval.ms": "500",
    # Lowest consumer-group session timeout a node may ask for (failure detection speed).
    "group.min.session.timeout.ms": "1000",
    "group.initial.rebalance.delay.ms": "0",
    # How long a starting broker waits to register with the controller quorum before its process
    # exits (default 60 s). Every node here is broker and controller in one JVM, so that exit takes
    # a quorum voter down too: in issue 22's campaign, on two starved cores, two restarting nodes
    # gave up in turn, each exit keeping the other from a majority, and Kafka had no controller
    # (nor partition leaders) for minutes. Waiting keeps the voter up.
    "initial.broker.registration.timeout.ms": "600000",
    # Small internal topics start fast on a laptop; production clusters keep the defaults.
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.num.partitions": "4",
    # WAL topics are created on purpose, with a partition count equal to the shard count.
    "auto.create.topics.enable": "false",
    "num.partitions": "1",
}

# The JVM flags of a broker that runs a while (`make up`, benchmarks, the soak): G1 and both JIT
# tiers, Kafka's own defaults.
SERVER_JVM_FLAGS: tuple[str, ...] = ("-XX:+UseG1GC",)
# A broker that lives for a test or a test session: on two shared cores, a fresh JVM spends most
# of its first ~30 s of CPU compiling with C2 and collecting with G1's threads, which a short-lived
# broker never earns back (docs/development.md, "Where the suite's time goes", has the
# measurements). C1 only and the serial collector.
QUICK_JVM_FLAGS: tuple[str, ...] = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")

# Secure mode (module docstring).
ADMIN_USER = "admin"
CREDENTIALS_FILE = "credentials.json"
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
_SCRAM_LOGIN = "org.apache.kafka.common.security.scram.ScramLoginModule"
_PLAIN_LOGIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
_USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # nothing SCRAM or --add-scram must escape


def _replication_settings(nodes: int) -> dict[str, str]:
    rf = "3" if nodes >= 3 else "1"
    min_isr = "2" if nodes >= 3 else "1"
    return {
        "offsets.topic.replication.factor": rf,
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": min_isr,
        "default.replication.factor": rf,
        "min.insync.replicas": min_isr,
        # How long the controller waits for a silent broker before fencing it and moving its
        # partition leaders. Three nodes: 3 s, so a local cluster fails over in ~3 s instead of
        # Kafka's default 9 s. One node has nowhere to move them: its controller fencing its own
        # broker after a stall (a JVM starved of CPU for 3-5 s on 2 shared cores) only leaves
        # every partition, the group coordinator's among them, without a leader, and turned a 5 s
        # stall into 17 s without leadership (issue 18, bench/README.md). Kafka's default there; the
        # price is a restart after SIGKILL, which waits out the dead incarnation's session
        # (measured 14.6 s instead of 11.6 s).
        "broker.session.timeout.ms": "3000" if nodes >= 3 else "9000",
    }


# The authorizer logs every denied request at INFO (secure mode): "why was my client refused".
# The group coordinator logs at INFO why the leadership group changed (a member removed on
# session expiry, a LeaveGroup, a static member rejoining), a few lines per event: "why did this
# node lose its shards" (issue 18).
_LOG4J2 = """\
rootLogger.level=WARN
rootLogger.appenderRef.out.ref=OUT
appender.out.type=Console
appender.out.name=OUT
appender.out.layout.type=PatternLayout
appender.out.layout.pattern=[%d] %p %m (%c)%n
logger.kafka.name=kafka
logger.kafka.level=WARN
logger.started.name=kafka.server.KafkaRaftServer
logger.started.level=INFO
logger.authorizer.name=kafka.authorizer.logger
logger.authorizer.level=INFO
logger.group.name=org.apache.kafka.coordinator.group.GroupMetadataManager
logger.group.level=INFO
"""


class BrokerError(RuntimeError):
    """The local broker could not be fetched, started or stopped."""


def listener_settings(broker_port: int, controller_port: int, credentials: Mapping[str, str] | None,
                      host: str = "127.0.0.1") -> dict[str, str]:
    """The listeners of one node on `host`: plaintext without `credentials`; with them (user ->
    password, the admin among them) SCRAM on the broker listener, PLAIN (the admin only) on the
    controller's, the standard authorizer and the admin as the only super user."""
    broker = f"{host}:{broker_port}"
    controller = f"CONTROLLER://{host}:{controller_port}"
    if credentials is None:
        return {
            "listeners": f"PLAINTEXT://{broker},{controller}",
            "advertised.listeners": f"PLAINTEXT://{broker}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        }
    admin = credentials[ADMIN_USER]
    return {
        "listeners": f"{SASL_PLAINTEXT}://{broker},{controller}",
        "advertised.listeners": f"{SASL_PLAINTEXT}://{broker}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": SASL_PLAINTEXT,
        "listener.security.protocol.map": f"{SASL_PLAINTEXT}:{SASL_PLAINTEXT},CONTROLLER:{SASL_PLAINTEXT}",
        "sasl.enabled.mechanisms": SCRAM_SHA_512,
        "sasl.mechanism.inter.broker.protocol": SCRAM_SHA_512,
        "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config":
            f'{_SCRAM_LOGIN} required username="{ADMIN_USER}" password="{admin}";',
        # SCRAM credentials live in the metadata log, which the controllers serve: they cannot
        # authenticate each other with them, so their listener uses PLAIN with one static user.
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config":
            f'{_PLAIN_LOGIN} required username="{ADMIN_USER}" password="{admin}" user_{ADMIN_USER}="{admin}";',
        "authorizer.class.name": AUTHORIZER,
        "super.users": f"User:{ADMIN_USER}",
        "allow.everyone.if.no.acl.found": "false",
    }


def add_scram_arguments(credentials: Mapping[str, str]) -> list[str]:
    """`kafka-storage format` arguments that put each user's SCRAM-SHA-512 credential into the
    bootstrap metadata (KIP-900)."""
    return [arg for user, password in sorted(credentials.items())
            for arg in ("--add-scram", f"{SCRAM_SHA_512}=[name={user},password={password}]")]


def cache_dir() -> Path:
    """Where the jars live: $KVSTORE_KAFKA_HOME, else ~/.cache/kvstore/kafka-<version>."""
    env = os.environ.get("KVSTORE_KAFKA_HOME")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvstore" / f"kafka-{KAFKA_VERSION}"


def libs_dir() -> Path:
    return cache_dir() / "libs"


def fetch(quiet: bool = True) -> Path:
    """Resolve the pinned Kafka jars from Maven Central (idempotent; a stamp marks success)."""
    libs = libs_dir()
    stamp = cache_dir() / ".complete"
    if stamp.exists() and any(libs.glob("kafka_2.13-*.jar")):
        return libs
    if shutil.which("mvn") is None:
        raise BrokerError("Maven (mvn) is required to fetch Kafka; install it and retry")
    if libs.exists():
        shutil.rmtree(libs)
    cmd = ["mvn", "-B", "-f", str(POM), f"-Dkafka.version={KAFKA_VERSION}",
           "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={libs}"]
    if quiet:
        cmd.insert(1, "-q")
    result = subprocess.run(cmd, check=False)
    if result.returncode != 0:
        raise BrokerError(f"mvn failed ({result.returncode}) resolving Kafka {KAFKA_VERSION}")
    stamp.write_text(KAFKA_VERSION + "\n")
    return libs


def class_archive() -> Path:
    """Kafka's classes as a started broker loaded them, dumped by the JVM (AppCDS): a JVM mapping
    it skips loading and verifying ~5 000 classes, about half of a broker's start-up CPU."""
    return cache_dir() / "broker-classes.jsa"


def make_class_archive(timeout_s: float = 120.0) -> Path | None:
    """Dump `class_archive()` from one throwaway broker start (JDK 13+'s ArchiveClassesAtExit),
    once per Kafka version. Best effort: a JVM that cannot dump one leaves none, and brokers then
    start without it; the archive is written under a temporary name and renamed,
    so a half-written one is never mapped."""
    archive = class_archive()
    if archive.exists():
        return archive
    partial = archive.with_name(f"{archive.name}.{os.getpid()}.tmp")
    with tempfile.TemporaryDirectory(prefix="kafka-cds-") as work:
        broker = LocalKafka(Path(work), jvm_flags=(*QUICK_JVM_FLAGS, f"-XX:ArchiveClassesAtExit={partial}"),
                            use_class_archive=False)
        try:
            broker.start(timeout_s)
            broker.create_topic("warm-up", 1, timeout_s)
        except BrokerError:
            partial.unlink(missing_ok=True)
            return None
        finally:
            broker.stop()  # SIGTERM: the JVM dumps the archive as it exits
    if not partial.exists():
        return None
    os.replace(partial, archive)
    return archive


def _archive_flags() -> list[str]:
    """Map `class_archive()` when `make kafka` made one. A JVM that finds it does not match (another
    JDK, other jars) says so in broker.log and starts without it (-Xshare:auto, the default)."""
    archive = class_archive()
    return [f"-XX:SharedArchiveFile={archive}"] if archive.exists() else []


# Ports handed out below the kernel's ephemeral range: a port from `bind(0)` is an ephemeral one,
# which any outgoing connection may take as its source port while the process it was meant for
# restarts (a node restarted on its port then fails with "Address already in use").
LISTEN_PORTS = (20_000, 32_000)
FREE_PORT_TRIES = 64


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port() -> int:
    """A loopback port nobody listens on now, outside the ephemeral range when it can."""
    low, high = LISTEN_PORTS
    high = min(high, _ephemeral_low() - 1)
    for _ in range(FREE_PORT_TRIES if high > low else 0):
        port = secrets.randbelow(high - low) + low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def answers_api_versions(address: str, timeout_s: float) -> bool:
    """Whether the broker at `address` answers an ApiVersions request (v0, which every broker
    answers before any authentication) within `timeout_s`: it processes requests, so its startup
    is over. Asked on a socket of our own, since a librdkafka client picks its broker itself."""
    host, _, port = address.rpartition(":")
    client_id = b"wal-broker-check"
    correlation_id = 0x6B76
    header = struct.pack(">hhih", 18, 0, correlation_id, len(client_id)) + client_id  # ApiVersions v0
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(struct.pack(">i", len(header)) + header)
            answer = b""
            while len(answer) < 10:  # size, correlation id, error code
                chunk = sock.recv(10 - len(answer))
                if not chunk:
                    return False
                answer += chunk
    except OSError:
        return False
    _size, answered_id, error_code = struct.unpack(">iih", answer)
    return bool(answered_id == correlation_id and error_code == 0)


class LocalKafka:
    """One or three KRaft nodes (each broker+controller) on 127.0.0.1, data under `data_dir`.

    Ports are chosen at construction and kept across restarts, so clients reconnect. A data
    directory that was already formatted is reused (`make up` resumes where it stopped).
    """

    def __init__(self, data_dir: Path, nodes: int = 1, *, heap_mb: int = 512,
                 ports: list[tuple[int, int]] | None = None, secure: bool = False,
                 users: Sequence[str] = (), hosts: Sequence[str] | None = None,
                 launcher: Callable[[int], list[str]] | None = None,
                 jvm_flags: Sequence[str] = SERVER_JVM_FLAGS, use_class_archive: bool = True) -> None:
        """`secure`: SASL/SCRAM and ACLs (module docstring), with SCRAM users `users` besides
        the admin; a data directory keeps the mode it was formatted with.

        `hosts` (one per node; default 127.0.0.1 for all) and `launcher` (node -> the command
        prefix that starts its JVM, e.g. `nsenter --net=...`) put each node in a network of its
        own: the robustness campaign runs every broker in its own network namespace, so links
        between them can be cut (tests/robustness/net.py). The prefix must exec the JVM in place
        (the pid stays the JVM's, for kill and pause)."""
        assert nodes in (1, 3), "the local cluster has one node or three"
        assert hosts is None or len(hosts) == nodes, f"one host per node: {hosts}"
        self.hosts = list(hosts) if hosts is not None else ["127.0.0.1"] * nodes
        self.launcher = launcher
        self.jvm_flags = tuple(jvm_flags)  # SERVER_JVM_FLAGS, or QUICK_JVM_FLAGS for a short-lived broker
        self.use_class_archive = use_class_archive  # False only while making the archive
        assert secure or not users, "SCRAM users need secure=True"
        for user in users:
            assert _USER_NAME.match(user), f"user names are [A-Za-z0-9._-], at most 64: {user!r}"
        self.data_dir = Path(data_dir)
        self.nodes = nodes
        self.heap_mb = heap_mb
        self.secure = secure
        self.users = tuple(dict.fromkeys((ADMIN_USER, *users))) if secure else ()
        saved = self._load_ports()
        self.ports = ports or saved or [(free_port(), free_port()) for _ in range(nodes)]
        assert len(self.ports) == nodes
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._log_from: dict[int, int] = {}  # where each node's broker.log was at its last start
        self._startup_over: set[int] = set()  # nodes whose JVM logged its startup over since then
        self._credentials: dict[str, str] = {}  # user -> password (secure mode), from start() on

    # ---- addresses ---------------------------------------------------------------------------

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"{host}:{broker}" for host, (broker, _) in zip(self.hosts, self.ports, strict=True))

    def node_bootstrap(self, node: int) -> str:
        return f"{self.hosts[node]}:{self.ports[node][0]}"

    @property
    def credentials_file(self) -> Path:
        return self.data_dir / CREDENTIALS_FILE

    def credentials(self, user: str = ADMIN_USER) -> ClientSecurity:
        """How `user` logs in (secure mode; after start()). Without secure mode: the plaintext
        default, whoever asks."""
        if not self.secure:
            return ClientSecurity()
        if not self._credentials:
            raise BrokerError("the passwords are read (or made) by start(): start the broker first")
        if user not in self._credentials:
            raise BrokerError(f"no SCRAM user {user!r} on this broker (users: {', '.join(sorted(self._credentials))})")
        return ClientSecurity(SASL_PLAINTEXT, SCRAM_SHA_512, user, self._credentials[user])

    def password_file(self, user: str) -> Path:
        """`user`'s password in a file of its own (mode 0600), for `--kafka-password-file` and
        KVSTORE_KAFKA_PASSWORD_FILE: a password handed over by path never shows in a command
        line or a process environment."""
        path = self.data_dir / f"{user}.password"
        _write_private(path, self.credentials(user).password + "\n")
        return path

    def client_config(self, user: str = ADMIN_USER, **settings: Any) -> dict[str, Any]:
        """A librdkafka config for this broker as `user` (the admin by default)."""
        return client_config(self.bootstrap_servers, self.credentials(user), **settings)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout_s: float = 90.0) -> LocalKafka:
        libs = libs_dir()
        if not any(libs.glob("kafka_2.13-*.jar")):
            raise BrokerError(f"Kafka jars missing in {libs}: run `make kafka` first")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._save_ports()
        cluster_id = self._cluster_id()
        formatted = [(self._node_dir(n) / "data" / "meta.properties").exists() for n in range(self.nodes)]
        if any(formatted) and self.secure != self.credentials_file.exists():
            raise BrokerError(f"{self.data_dir} was formatted {'with' if not self.secure else 'without'} SASL and "
                              f"ACLs; it keeps that mode (start it with secure={not self.secure}, or use a new "
                              "data directory)")
        added = self._load_credentials(new_cluster=not any(formatted)) if self.secure else []
        for node in range(self.nodes):
            self._write_config(node)
            if not formatted[node]:
                self._format(node, cluster_id)
        for node in range(self.nodes):
            self.start_node(node, wait=False)
        self.wait_ready(timeout_s)
        if added:
            self._add_users(added, timeout_s)
        return self

    def start_node(self, node: int, wait: bool = True, timeout_s: float = 60.0) -> None:
        proc = self._procs.get(node)
        if proc is not None and proc.poll() is None:
            return
        log = open(self._node_dir(node) / "broker.log", "ab")  # noqa: SIM115 - owned by Popen
        self._log_from[node] = log.tell()
        self._startup_over.discard(node)
        prefix = self.launcher(node) if self.launcher is not None else []
        cmd = [*prefix, self._java(), f"-Xmx{self.heap_mb}m", f"-Xms{min(self.heap_mb, 256)}m",
               "-Djava.awt.headless=true", *self.jvm_flags, *(_archive_flags() if self.use_class_archive else []),
               f"-Dlog4j2.configurationFile={self._node_dir(node) / 'log4j2.properties'}",
               "-cp", str(libs_dir() / "*"), "kafka.Kafka", str(self._node_dir(node) / "server.properties")]
        self._procs[node] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        if wait:
            self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until every running node is registered with the controller and answers metadata."""
        deadline = time.monotonic() + timeout_s
        expected = {n + 1 for n, p in self._procs.items() if p.poll() is None}
        # Quiet: "connection refused" is the expected answer until the JVM is up.
        admin = AdminClient(self.client_config(log_level=0))
        last_error = "no answer"
        while time.monotonic() < deadline:
            for node, proc in self._procs.items():
                if proc.poll() is not None:
                    raise BrokerError(f"node {node} exited with {proc.returncode}; see "
                                      f"{self._node_dir(node) / 'broker.log'}")
            try:
                meta = admin.list_topics(timeout=2)
                if expected <= set(meta.brokers):
                    return
                last_error = f"brokers {sorted(meta.brokers)} of {sorted(expected)}"
            except KafkaException as exc:
                last_error = str(exc)
            time.sleep(0.2)
        raise BrokerError(f"Kafka not ready after {timeout_s}s: {last_error}")

    def serving(self, node: int, timeout_s: float = 2.0) -> bool:
        """Whether `node` itself answers requests on its broker listener, and the cluster's
        metadata lists every broker: its startup is over (a broker serves requests only once the
        controller has acknowledged it caught up). Metadata alone proves nothing of one broker:
        a client asks whichever broker it likes, and the others list a killed broker until its
        session times out, a restarted one before it registered."""
        proc = self._procs.get(node)
        if proc is None or proc.poll() is not None or not answers_api_versions(self.node_bootstrap(node), timeout_s):
            return False
        admin = AdminClient(client_config(self.node_bootstrap(node), self.credentials(), log_level=0))
        try:
            meta = admin.list_topics(timeout=timeout_s)
        except KafkaException:
            return False
        return set(meta.brokers) == set(range(1, self.nodes + 1))

    def startup_over(self, node: int) -> bool:
        """Whether `node`'s JVM logged "Kafka Server started" since its last start: its
        controller and its broker have both finished starting (`KafkaRaftServer`, whose INFO lines
        `_LOG4J2` keeps). A broker serves requests and may even be listed in every ISR before
        that; a controller still replaying the metadata log is a voter that cannot elect anyone
        (issue 22's sixth long run: the active controller killed then, and Kafka had no
        controller, hence no partition leader moves, for minutes)."""
        if node in self._startup_over:
            return True
        try:
            with open(self._node_dir(node) / "broker.log", "rb") as log:
                log.seek(self._log_from.get(node, 0))
                if b"Kafka Server started" not in log.read():
                    return False
        except OSError:
            return False
        self._startup_over.add(node)
        return True

    def under_replicated(self, timeout_s: float = 2.0) -> list[str] | None:
        """The partitions (`topic-N`, internal topics included) whose in-sync replicas are fewer
        than their replicas in any running broker's view, or None when a running broker does not
        answer. Every broker is asked: a restarted one may still hold the image it had before its
        kill, where every replica was in sync."""
        lagging: set[str] = set()
        for node in range(self.nodes):
            proc = self._procs.get(node)
            if proc is None or proc.poll() is not None:
                continue
            admin = AdminClient(client_config(self.node_bootstrap(node), self.credentials(), log_level=0))
            try:
                meta = admin.list_topics(timeout=timeout_s)
            except KafkaException:
                return None
            for topic in meta.topics.values():
                for partition in topic.partitions.values():
                    if len(partition.isrs) < len(partition.replicas):
                        lagging.add(f"{topic.topic}-{partition.id}")
        return sorted(lagging)

    def in_sync(self, timeout_s: float = 2.0) -> bool:
        """Every node started (`startup_over`), every broker serving (`serving`) and every
        partition's replicas all in sync: the cluster has its full redundancy again. Serving is
        not enough: a restarted broker answers
        requests while the controller still holds it fenced, out of every ISR (a minute, on two
        starved cores), and it must then catch up before it rejoins them. Issue 22's fifth long
        run killed a second broker in that window, and the partitions whose ISR had shrunk to it
        had no leader for the five minutes its restart took."""
        return (all(self.startup_over(node) and self.serving(node, timeout_s) for node in range(self.nodes))
                and self.under_replicated(timeout_s) == [])

    def stop_node(self, node: int, timeout_s: float = 30.0) -> None:
        """Controlled shutdown (SIGTERM), SIGKILL if it does not exit in time."""
        proc = self._procs.get(node)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def process(self, node: int) -> subprocess.Popen[bytes] | None:
        """The node's JVM as last started (None before), for a supervisor that watches it exit."""
        return self._procs.get(node)

    def kill_node(self, node: int) -> None:
        proc = self._procs.get(node)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def pause_node(self, node: int) -> None:
        self._signal(node, signal.SIGSTOP)

    def resume_node(self, node: int) -> None:
        self._signal(node, signal.SIGCONT)

    def restart_node(self, node: int, timeout_s: float = 60.0) -> None:
        self.stop_node(node)
        self.start_node(node, wait=True, timeout_s=timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Controlled shutdown of every node at once, SIGKILL for any still running after
        `timeout_s`. Not one after another: the last of three KRaft nodes has no controller
        quorum left to acknowledge its controlled shutdown and hung until its SIGKILL (30 s
        of every three-broker test's teardown)."""
        running = [proc for proc in self._procs.values() if proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGCONT)  # a paused JVM cannot handle SIGTERM
            proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def create_topic(self, name: str, partitions: int, timeout_s: float = 30.0) -> None:
        """Create a topic replicated on every node (min.insync.replicas from the broker)."""
        admin = AdminClient(self.client_config())
        futures = admin.create_topics([NewTopic(name, partitions, replication_factor=min(self.nodes, 3))],
                                      request_timeout=timeout_s)
        for future in futures.values():
            future.result(timeout_s)
        # CreateTopics answers once the controller has the topic; a broker's metadata can lag behind
        # it (seen with three brokers: the topic listed with no partitions yet). Callers read the
        # partition leaders right away, so wait (bounded) until every partition has one.
        deadline = time.monotonic() + timeout_s
        while True:
            topic = admin.list_topics(name, timeout=max(0.1, deadline - time.monotonic())).topics.get(name)
            if (topic is not None and topic.error is None and len(topic.partitions) == partitions
                    and all(p.leader >= 0 for p in topic.partitions.values())):
                break
            if time.monotonic() >= deadline:
                raise BrokerError(f"topic {name!r} created but its {partitions} partitions have no leader "
                                  f"in the metadata after {timeout_s:.0f} s")
            time.sleep(0.1)
        # ... and the metadata can be ahead of the leader itself: a ListOffsets right after it was
        # answered NOT_LEADER_FOR_PARTITION (a CI run's first append to a new topic failed so), so
        # wait (bounded) until every partition's leader answers one.
        latest = {TopicPartition(name, p): OffsetSpec.latest()  # type: ignore[no-untyped-call]
                  for p in range(partitions)}
        while True:
            try:
                for future in admin.list_offsets(latest, request_timeout=5).values():
                    future.result(5)
                return
            except KafkaException as exc:
                if time.monotonic() >= deadline:
                    raise BrokerError(f"topic {name!r} created but a partition's leader does not answer "
                                      f"ListOffsets after {timeout_s:.0f} s: {exc}") from exc
            time.sleep(0.1)

    def __enter__(self) -> LocalKafka:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- internals ---------------------------------------------------------------------------

    def _signal(self, node: int, sig: signal.Signals) -> None:
        proc = self._procs.get(node)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)

    def _node_dir(self, node: int) -> Path:
        return self.data_dir / f"node-{node + 1}"

    def _java(self) -> str:
        java_home = os.environ.get("JAVA_HOME")
        if java_home and (Path(java_home) / "bin" / "java").exists():
            return str(Path(java_home) / "bin" / "java")
        java = shutil.which("java")
        if java is None:
            raise BrokerError("Java 17+ is required to run Kafka; no `java` on PATH")
        return java

    def _cluster_id(self) -> str:
        path = self.data_dir / "cluster.id"
        if not path.exists():
            # Like Kafka's Uuid.randomUuid: never starting with "-", which CLIs take for a flag.
            cluster_id = "-"
            while cluster_id.startswith("-"):
                cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            path.write_text(cluster_id + "\n")
        return path.read_text().strip()

    def _load_credentials(self, new_cluster: bool) -> list[str]:
        """Read the users' passwords, generating those not there yet; returns the users that
        are new to an existing cluster (created through the admin API once it is up)."""
        path = self.credentials_file
        saved: dict[str, str] = json.loads(path.read_text())["users"] if path.exists() else {}
        if not new_cluster and ADMIN_USER not in saved:
            raise BrokerError(f"{path} lacks the admin's password: the cluster cannot be administered")
        missing = [user for user in self.users if user not in saved]
        credentials = {**saved, **{user: secrets.token_hex(24) for user in missing}}
        if missing or not path.exists():
            _write_private(path, json.dumps({"mechanism": SCRAM_SHA_512, "admin": ADMIN_USER,
                                             "bootstrap_servers": self.bootstrap_servers,
                                             "users": credentials}, indent=2) + "\n")
        self._credentials = credentials
        return [] if new_cluster else missing

    def _add_users(self, users: Sequence[str], timeout_s: float) -> None:
        """Create SCRAM credentials on a running cluster (users asked for after it was formatted)."""
        admin = AdminClient(self.client_config())
        info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
        upserts: list[UserScramCredentialAlteration] = [
            UserScramCredentialUpsertion(user, info, self._credentials[user].encode()) for user in users]
        for future in admin.alter_user_scram_credentials(upserts, request_timeout=timeout_s).values():
            future.result(timeout_s)

    def _ports_file(self) -> Path:
        return self.data_dir / "ports"

    def _load_ports(self) -> list[tuple[int, int]] | None:
        path = self._ports_file()
        if not path.exists():
            return None
        pairs = [tuple(int(p) for p in line.split()) for line in path.read_text().splitlines() if line]
        ports = [(p[0], p[1]) for p in pairs if len(p) == 2]
        return ports if len(ports) == self.nodes else None

    def _save_ports(self) -> None:
        self._ports_file().write_text("".join(f"{b} {c}\n" for b, c in self.ports))

    def _write_config(self, node: int) -> None:
        directory = self._node_dir(node)
        (directory / "data").mkdir(parents=True, exist_ok=True)
        broker_port, controller_port = self.ports[node]
        voters = ",".join(f"{n + 1}@{self.hosts[n]}:{c}" for n, (_, c) in enumerate(self.ports))
        settings = {
            "process.roles": "broker,controller",
            "node.id": str(node + 1),
            "controller.quorum.voters": voters,
            **listener_settings(broker_port, controller_port, self._credentials if self.secure else None,
                                self.hosts[node]),
            "log.dirs": str(directory / "data"),
            **_replication_settings(self.nodes),
            **BROKER_SETTINGS,
        }
        text = "".join(f"{k}={v}\n" for k, v in settings.items())
        _write_private(directory / "server.properties", text)  # holds the admin's password in secure mode
        (directory / "log4j2.properties").write_text(_LOG4J2)

    def _format(self, node: int, cluster_id: str) -> None:
        directory = self._node_dir(node)
        cmd = [self._java(), "-Xmx256m", *QUICK_JVM_FLAGS, *(_archive_flags() if self.use_class_archive else []),
               "-cp", str(libs_dir() / "*"),
               f"-Dlog4j2.configurationFile={directory / 'log4j2.properties'}",
               "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}",
               "-c", str(directory / "server.properties"),
               "--feature", f"transaction.version={TRANSACTION_VERSION}",
               *(add_scram_arguments(self._credentials) if self.secure else [])]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise BrokerError(f"formatting node {node + 1} failed: {result.stdout}{result.stderr}")


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (it may hold passwords), atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(tmp, 0o600)  # an older file of that name kept its mode
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wal.broker", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="resolve the pinned Kafka jars from Maven Central")
    up = sub.add_parser("up", help="run a local broker in the foreground until Ctrl-C")
    up.add_argument("--data-dir", default=".data/kafka", type=Path)
    up.add_argument("--nodes", type=int, default=1, choices=(1, 3))
    up.add_argument("--secure", action="store_true",
                    help="SASL/SCRAM logins and ACLs (fixed when the data directory is formatted)")
    up.add_argument("--user", action="append", default=[], help="with --secure: a SCRAM user to create (repeatable)")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        print(fetch(quiet=False))
        archive = make_class_archive()
        print(archive if archive is not None else "no class archive (this JVM dumped none): brokers start without one")
        return 0
    kafka = LocalKafka(args.data_dir, args.nodes, secure=args.secure, users=args.user)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        kafka.start()
        print(f"Kafka {KAFKA_VERSION} (KRaft, {args.nodes} node(s)) is up.", flush=True)
        print(f"  bootstrap servers: {kafka.bootstrap_servers}", flush=True)
        print(f"  data directory:    {args.data_dir.resolve()}", flush=True)
        print(f"  export KVSTORE_KAFKA={kafka.bootstrap_servers}", flush=True)
        if kafka.secure:
            print(f"  SASL/SCRAM-SHA-512 logins and ACLs; passwords in {kafka.credentials_file}", flush=True)
        print("Ctrl-C stops it.", flush=True)
        while not stop:
            time.sleep(0.5)
    finally:
        kafka.stop()
        print("Kafka stopped.", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
