"""Kafka security (docs/security.md, "Kafka security"): SASL/SCRAM logins and the WAL's ACLs, on a real broker.

One secure broker and one store node (logged in as the store's principal) for the whole module,
with the ACLs of `wal.acl` for the node's cluster. Three more logins: the pipeline's principal
(read only), a rogue principal (a valid SCRAM login that no ACL names) and no login at all.

What is held here: the broker refuses whoever lacks the store's credentials everything that
could touch the WAL's content (appending, taking a shard's transactional id, deleting records),
the pipeline may read the WAL and keep its readers registry and nothing more, the node works as
usual; and a principal that may write (the store's, used around the guard) still cannot make a
record count: W3 skips records with a wrong expected offset or without the header, at the node
and in `kvstore audit`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from kvstore.client import Client
from kvstore.core.sharding import shard_of
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.v1 import cluster_pb2
from tests.conftest import unique
from tests.integration.store_process import REPO, StoreProcess
from tests.waiting import NotYet, wait_until
from wal import Reader, ReaderRegistry, RegistryError, Replayer, UnavailableError, delete_below
from wal.acl import create_acls, wal_grants
from wal.broker import QUICK_JVM_FLAGS, LocalKafka
from wal.clients import ClientSecurity, PartitionEnds, client_config, shard_transactional_id
from wal.record import WriterIdentity, encode

pytestmark = pytest.mark.kafka

SHARDS = 2
STORE, PIPELINE, ROGUE = "kvstore", "pipeline", "rogue"
REFUSED_S = 2.0  # how long a refused client may try before we look at what it got (nothing)
TIMEOUT_S = 20.0


@dataclasses.dataclass(frozen=True)
class Secure:
    kafka: LocalKafka
    cluster: str

    @property
    def topic(self) -> str:
        return f"{self.cluster}.wal"

    @property
    def bootstrap(self) -> str:
        return self.kafka.bootstrap_servers

    def login(self, user: str | None) -> ClientSecurity:
        """`user`'s SCRAM login; None: no login at all (the plaintext default)."""
        return ClientSecurity() if user is None else self.kafka.credentials(user)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    kafka = LocalKafka(tmp_path_factory.mktemp("secure-kafka"), secure=True, users=(STORE, PIPELINE, ROGUE),
                       jvm_flags=QUICK_JVM_FLAGS)
    kafka.start()
    try:
        cluster = unique("sec").replace("-", "")
        create_acls(kafka.bootstrap_servers, kafka.credentials(),
                    wal_grants(f"{cluster}.wal", f"{cluster}.leaders", f"User:{STORE}", f"User:{PIPELINE}"))
        yield Secure(kafka, cluster)
    finally:
        kafka.stop()


@pytest.fixture(scope="module")
def node(secure: Secure, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    """The store's node, logged in by flags (user) and a password file; it creates the WAL topic."""
    login = ("--kafka-username", STORE, "--kafka-password-file", str(secure.kafka.password_file(STORE)))
    store = StoreProcess(secure.bootstrap, tmp_path_factory.mktemp("secure-node") / "node", secure.cluster,
                         shards=SHARDS, metrics=True, extra_args=login)
    store.start()
    try:
        yield store
    finally:
        store.stop()


def error_codes(errors: list[KafkaError]) -> set[int]:
    return {e.code() for e in errors}


def produce_one(secure: Secure, user: str | None, **settings: Any) -> KafkaError | None:
    """One record to shard 0 as `user`: the delivery report's error (None: appended)."""
    reports: list[KafkaError | None] = []
    producer = Producer(client_config(secure.bootstrap, secure.login(user), **settings))
    producer.produce(secure.topic, b"let me in", partition=0, on_delivery=lambda err, msg: reports.append(err))
    assert producer.flush(TIMEOUT_S) == 0, "no delivery report in time"
    return reports[0]


def init_transactions_error(secure: Secure, user: str | None, timeout_s: float = TIMEOUT_S) -> KafkaError:
    """What `init_transactions` on shard 0's transactional id (W4) raises as `user`."""
    producer = Producer(client_config(secure.bootstrap, secure.login(user),
                                      **{"transactional.id": shard_transactional_id(secure.topic, 0)}))
    with pytest.raises(KafkaException) as info:
        producer.init_transactions(timeout_s)
    error = info.value.args[0]
    assert isinstance(error, KafkaError)
    return error


def consume_for(secure: Secure, user: str | None, seconds: float) -> tuple[list[int], list[KafkaError]]:
    """Read shard 0 from offset 0 for `seconds` as `user`: (offsets of records, errors seen)."""
    errors: list[KafkaError] = []
    consumer = Consumer(client_config(secure.bootstrap, secure.login(user), error_cb=errors.append,
                                      **{"group.id": unique("wal-reader"), "enable.partition.eof": False}))
    offsets: list[int] = []
    try:
        consumer.assign([TopicPartition(secure.topic, 0, 0)])
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                errors.append(error)
            else:
                offsets.append(int(message.offset() or 0))
    finally:
        consumer.close()
    return offsets, errors


def deletion_refusal(secure: Secure, user: str) -> str:
    """What `user`'s DeleteRecords below offset 1 of shard 0 fails with; nothing was deleted."""
    with pytest.raises(UnavailableError) as info:
        delete_below(secure.bootstrap, secure.topic, {0: 1}, timeout_s=TIMEOUT_S, security=secure.login(user))
    assert PartitionEnds(secure.bootstrap, TIMEOUT_S, secure.kafka.credentials()).log_start(secure.topic, 0) == 0
    return str(info.value)


# ---- who gets in, and what for ------------------------------------------------------------------------


def test_a_client_without_the_credentials_gets_nothing_through(secure: Secure, node: StoreProcess) -> None:
    """No login: the SASL listener drops the connection before any request, so every call runs
    into its own bound. A wrong password: the broker says so (_AUTHENTICATION), then the same."""
    errors: list[KafkaError] = []
    refused = produce_one(secure, None, error_cb=errors.append, **{"message.timeout.ms": int(REFUSED_S * 1000)})
    assert refused is not None and refused.code() == KafkaError._MSG_TIMED_OUT
    assert KafkaError._ALL_BROKERS_DOWN in error_codes(errors)
    assert init_transactions_error(secure, None, timeout_s=REFUSED_S).code() == KafkaError._TIMED_OUT
    offsets, consumer_errors = consume_for(secure, None, REFUSED_S)
    assert offsets == [] and KafkaError._ALL_BROKERS_DOWN in error_codes(consumer_errors)

    wrong = ClientSecurity("SASL_PLAINTEXT", "SCRAM-SHA-512", STORE, "not-the-password")
    errors.clear()
    producer = Producer(client_config(secure.bootstrap, wrong, error_cb=errors.append,
                                      **{"message.timeout.ms": int(REFUSED_S * 1000)}))
    reports: list[KafkaError | None] = []
    producer.produce(secure.topic, b"guessing", partition=0, on_delivery=lambda err, msg: reports.append(err))
    assert producer.flush(TIMEOUT_S) == 0
    assert reports[0] is not None and reports[0].code() == KafkaError._MSG_TIMED_OUT
    assert KafkaError._AUTHENTICATION in error_codes(errors)


def test_a_rogue_principal_may_log_in_but_do_nothing(secure: Secure, node: StoreProcess) -> None:
    refused = produce_one(secure, ROGUE)
    assert refused is not None and refused.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert init_transactions_error(secure, ROGUE).code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    # Reading: librdkafka first looks up its group's coordinator, which needs a group ACL; the
    # WAL topic itself is not even listed to this principal.
    offsets, errors = consume_for(secure, ROGUE, REFUSED_S)
    assert offsets == [] and KafkaError.GROUP_AUTHORIZATION_FAILED in error_codes(errors)
    admin = AdminClient(secure.kafka.client_config(ROGUE))
    listed = admin.list_topics(secure.topic, timeout=TIMEOUT_S).topics[secure.topic]
    assert listed.error is not None and listed.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    # The topic is invisible to it, so librdkafka finds no leader to send DeleteRecords to.
    assert "_NOENT" in deletion_refusal(secure, ROGUE)
    # Nor can it grant itself anything.
    grant = AclBinding(ResourceType.TOPIC, secure.topic, ResourcePatternType.LITERAL, f"User:{ROGUE}", "*",
                       AclOperation.WRITE, AclPermissionType.ALLOW)
    with pytest.raises(KafkaException) as info:
        admin.create_acls([grant], request_timeout=TIMEOUT_S)[grant].result(timeout=TIMEOUT_S)
    assert info.value.args[0].code() == KafkaError.CLUSTER_AUTHORIZATION_FAILED


def test_the_pipeline_reads_the_wal_and_nothing_more(secure: Secure, node: StoreProcess) -> None:
    with Client([node.address], timeout_s=TIMEOUT_S) as client:
        client.put("read-me", "1")
    shard = shard_of(b"read-me", SHARDS)
    with Replayer(secure.bootstrap, secure.topic, shard, 0, security=secure.login(PIPELINE)) as replayer:
        records = list(replayer.read_to_end(TIMEOUT_S))
    assert records, "the pipeline's principal reads the WAL"

    refused = produce_one(secure, PIPELINE)
    assert refused is not None and refused.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    # It cannot take a shard's transactional id, so it cannot fence (W4) a leader either.
    assert init_transactions_error(secure, PIPELINE).code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    # Deleting records is an administrator's (wal.acl): neither the pipeline nor the store may.
    assert "TOPIC_AUTHORIZATION_FAILED" in deletion_refusal(secure, PIPELINE)
    assert "TOPIC_AUTHORIZATION_FAILED" in deletion_refusal(secure, STORE)


def test_the_pipeline_keeps_the_readers_registry_the_admin_reads_it_and_nobody_else(secure: Secure,
                                                                                   node: StoreProcess) -> None:
    """The registry of who still reads the WAL (`wal.readers`): the pipeline creates it, records
    and removes its readers; the admin (who truncates) reads it; the store and a rogue principal
    may neither write nor read it, and not being allowed to read it is an error, never "no
    readers" (which would let a truncation delete what a feed still needs)."""
    feed = Reader("changes:/feed/_checkpoint", "change-feed", "/feed", {0: 3, 1: 4}, 1)
    with ReaderRegistry(secure.bootstrap, secure.topic, security=secure.login(PIPELINE), timeout_s=TIMEOUT_S) as mine:
        mine.record(feed)
        mine.record(Reader("abandoned", "job", "/old", {0: 0}, 1))
        mine.remove("abandoned")
        assert mine.list().readers == (feed,)
    with ReaderRegistry(secure.bootstrap, secure.topic, security=secure.kafka.credentials(),
                        timeout_s=TIMEOUT_S) as admin:
        assert admin.list().readers == (feed,)
    for user in (STORE, ROGUE):
        with ReaderRegistry(secure.bootstrap, secure.topic, security=secure.login(user), timeout_s=5) as other:
            with pytest.raises(RegistryError, match="AUTHORIZATION_FAILED"):
                other.list()
            with pytest.raises(RegistryError):
                other.record(Reader("changes:/forged", "change-feed", "/forged", {0: 10**9}, 1))
    with ReaderRegistry(secure.bootstrap, secure.topic, security=secure.kafka.credentials(),
                        timeout_s=TIMEOUT_S) as admin:
        assert admin.list().readers == (feed,)


def test_a_store_node_serves_on_the_secure_broker(secure: Secure, node: StoreProcess) -> None:
    """The node logged in as the store's principal: created the WAL topic, took both shards
    through their transactional ids, joined the leadership group, and reads and writes."""
    with Client([node.address], timeout_s=TIMEOUT_S) as client:
        first = client.put("greeting", "hello")
        assert client.get("greeting").value == b"hello"
        assert client.put("greeting", "again").version == first.version + 1
    reply = node.cluster_stub.ShardMap(cluster_pb2.ShardMapRequest(), timeout=TIMEOUT_S)
    assert reply.topic == secure.topic
    assert node.metric("kvstore_fencings_total") == 0


# ---- a writer that may write, but misbehaves -----------------------------------------------------------


def forged_put(key: bytes, value: bytes) -> bytes:
    """A well-formed store entry: if any reader applied it, `key` would hold `value`."""
    entry = wal_entry_pb2.WalEntry(request_id=unique("forged"))
    entry.effects.add(put=wal_entry_pb2.PutEffect(key=key, value=value))
    return entry.SerializeToString()


@dataclasses.dataclass(frozen=True)
class Misbehaved:
    mismatch: int  # offset of the record whose expected offset is wrong
    headerless: int  # offset of the record without the expected-offset header


def misbehave(secure: Secure, shard: int, key: bytes) -> Misbehaved:
    """As the store's principal, around the guard: a plain (non-transactional) producer appends
    two records to `shard`'s partition that would overwrite `key` and add another key. The
    first expects an offset two past where it lands; the second expects exactly where it lands
    in its body, but carries no header."""
    producer = Producer(secure.kafka.client_config(STORE, **{"enable.idempotence": True}))
    delivered: list[tuple[KafkaError | None, int]] = []

    def append(value: bytes, headers: list[tuple[str, str | bytes | None]] | None) -> int:
        def report(err: KafkaError | None, msg: Message) -> None:
            delivered.append((err, int(msg.offset() or -1)))

        producer.produce(secure.topic, value, partition=shard, headers=headers, on_delivery=report)
        assert producer.flush(TIMEOUT_S) == 0
        err, offset = delivered[-1]
        assert err is None, f"the store's principal may append: {err}"
        return offset

    end = secure_end(secure, shard)
    body, headers = encode(end + 2, WriterIdentity("misbehaving", 1_000), forged_put(key, b"forged"))
    mismatch = append(body, headers)
    body, _ = encode(mismatch + 1, WriterIdentity("misbehaving", 1_000), forged_put(b"intruder-" + key, b"x"))
    headerless = append(body, None)
    assert (mismatch, headerless) == (end, end + 1), "the node appended meanwhile: nothing else writes here"
    return Misbehaved(mismatch, headerless)


def secure_end(secure: Secure, shard: int) -> int:
    """Where the next record of `shard` lands: the end once no transaction is open (the node's
    last commit marker may be written just after its client got the answer)."""
    ends = PartitionEnds(secure.bootstrap, TIMEOUT_S, secure.login(PIPELINE))
    return ends.settled_end(secure.topic, shard, TIMEOUT_S)


def settled(call: Callable[[], Any]) -> Any:
    """`call` once the leader settled: it sees records beyond its own writes, steps down and
    re-bootstraps by itself (tests/integration/test_store.py says how); meanwhile UNAVAILABLE."""
    def attempt() -> Any:
        try:
            return call()
        except Exception as exc:
            raise NotYet(repr(exc)) from exc

    return wait_until(attempt, TIMEOUT_S, interval_s=0.2, what="the leader to settle after the rogue records")


def keys_of(shard: int, prefix: str) -> bytes:
    return next(k for i in range(1000) if shard_of(k := f"{prefix}{i}".encode(), SHARDS) == shard)


def test_records_of_an_authorised_but_misbehaving_writer_have_no_effect(secure: Secure, node: StoreProcess) -> None:
    shard = 0
    key = keys_of(shard, "victim")
    with Client([node.address], timeout_s=TIMEOUT_S) as client:
        client.put(key, b"honest")
    before = node.cluster_stub.ShardDigest(cluster_pb2.ShardDigestRequest(shard=shard), timeout=TIMEOUT_S)
    rejected_before = node.metric("kvstore_w3_rejections_total", shard=str(shard))

    rogue = misbehave(secure, shard, key)

    with Client([node.address], timeout_s=TIMEOUT_S) as client:
        assert settled(lambda: client.get(key)).value == b"honest"
        assert client.get(b"intruder-" + key).found is False
    after = node.cluster_stub.ShardDigest(cluster_pb2.ShardDigestRequest(shard=shard), timeout=TIMEOUT_S)
    assert (after.sha256, after.keys) == (before.sha256, before.keys)  # the state did not move
    assert after.applied_offset > rogue.headerless  # the replica read past both records
    assert node.metric("kvstore_w3_rejections_total", shard=str(shard)) >= rejected_before + 2
    # Any reader (here the pipeline's principal) skips and counts them the same way.
    with Replayer(secure.bootstrap, secure.topic, shard, rogue.mismatch, security=secure.login(PIPELINE)) as replayer:
        accepted = list(replayer.read_to(rogue.headerless + 1, TIMEOUT_S))
        assert accepted == []
        assert (replayer.stats.rejected_mismatch, replayer.stats.rejected_malformed) == (1, 1)
    with Client([node.address], timeout_s=TIMEOUT_S) as client:  # and writes go on
        assert settled(lambda: client.put(key, b"later")).version == 2


@pytest.mark.pipeline
def test_kvstore_audit_reports_the_misbehaving_writer(secure: Secure, node: StoreProcess, tmp_path: Path) -> None:
    """`kvstore audit`, a process of its own, logged in as the pipeline (environment only)."""
    shard = 1
    key = keys_of(shard, "audited")
    with Client([node.address], timeout_s=TIMEOUT_S) as client:
        client.put(key, b"honest")
    rogue = misbehave(secure, shard, key)
    with Client([node.address], timeout_s=TIMEOUT_S) as client:
        assert settled(lambda: client.get(key)).value == b"honest"
    # What the Python reader counts on the other shard (test order decides whether the test
    # above wrote there): the audit's SQL rule must count the same.
    with Replayer(secure.bootstrap, secure.topic, 0, 0, security=secure.login(PIPELINE)) as replayer:
        list(replayer.read_to_end(TIMEOUT_S))
        other = (replayer.stats.rejected_mismatch, replayer.stats.rejected_malformed)

    # Only the store's endpoint and the pipeline's own login: the node tells the brokers, the topic
    # and the security mode (SASL_PLAINTEXT, SCRAM), never a credential (issue 34).
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVSTORE_ENDPOINTS": node.address,
           "KVSTORE_KAFKA_USERNAME": PIPELINE,
           "KVSTORE_KAFKA_PASSWORD_FILE": str(secure.kafka.password_file(PIPELINE))}
    for unset in ("KVSTORE_KAFKA", "KVSTORE_KAFKA_PASSWORD", "KVSTORE_KAFKA_SECURITY_PROTOCOL",
                  "KVSTORE_KAFKA_SASL_MECHANISM"):
        env.pop(unset, None)
    audit = subprocess.run(
        [sys.executable, "-c", "import sys; from kvstore.cli import main; sys.exit(main())",
         "--output", "json", "audit", "--dir", str(tmp_path / "no-snapshots"), "--master", "local[2]"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300, check=False)
    lines = audit.stdout.strip().splitlines()
    assert lines, audit.stderr[-3000:]
    report = json.loads(lines[-1])
    assert audit.returncode == 1 and report["ok"] is False, report
    by_shard = {s["shard"]: s for s in report["shards"]}
    mine = by_shard[shard]
    assert (mine["rejected"], mine["rejected_offsets"]) == (1, [rogue.mismatch])
    assert (mine["malformed"], mine["malformed_offsets"]) == (1, [rogue.headerless])
    assert (by_shard[0]["rejected"], by_shard[0]["malformed"]) == other
    assert any(str(rogue.mismatch) in anomaly for anomaly in report["anomalies"])
    # The node skipped exactly what the audit rejects: its state is the WAL's.
    for entry in report["shards"]:
        assert [n["equal"] for n in entry["digest_nodes"]] == [True], entry
