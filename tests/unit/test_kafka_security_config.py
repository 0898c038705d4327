"""Kafka security, the pure parts: the WAL's ACL table, client logins from flags and environment,
the broker's secure listeners. The broker's side is tests/integration/test_kafka_security.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka.admin import AclOperation, AclPermissionType, ResourcePatternType, ResourceType

from kvstore.pipeline.errors import PipelineError
from kvstore.pipeline.target import kafka_security
from kvstore.server.config import NodeConfig
from wal.acl import Grant, Pattern, Resource, binding, wal_grants
from wal.broker import ADMIN_USER, AUTHORIZER, add_scram_arguments, listener_settings
from wal.clients import (
    ClientSecurity,
    client_config,
    java_security_settings,
    security_from,
    security_settings,
    shard_transactional_id,
    shard_transactional_id_prefix,
)

T, G, X = Resource.TOPIC, Resource.GROUP, Resource.TRANSACTIONAL_ID
LIT, PRE = Pattern.LITERAL, Pattern.PREFIXED

# The whole table for cluster "c": docs/security.md ("Kafka security") shows the same.
EXPECTED = {
    ("User:p", G, "wal-reader-", PRE, "DESCRIBE"),
    ("User:p", T, "c.wal", LIT, "DESCRIBE"),
    ("User:p", T, "c.wal", LIT, "READ"),
    ("User:p", T, "c.wal.placement", LIT, "DESCRIBE"),
    ("User:p", T, "c.wal.placement", LIT, "READ"),
    ("User:p", T, "c.wal.readers", LIT, "CREATE"),
    ("User:p", T, "c.wal.readers", LIT, "DESCRIBE"),
    ("User:p", T, "c.wal.readers", LIT, "READ"),
    ("User:p", T, "c.wal.readers", LIT, "WRITE"),
    ("User:s", G, "c.leaders", PRE, "DESCRIBE"),
    ("User:s", G, "c.leaders", PRE, "READ"),
    ("User:s", G, "wal-reader-", PRE, "DESCRIBE"),
    ("User:s", T, "c.wal", LIT, "CREATE"),
    ("User:s", T, "c.wal", LIT, "DESCRIBE"),
    ("User:s", T, "c.wal", LIT, "DESCRIBE_CONFIGS"),
    ("User:s", T, "c.wal", LIT, "READ"),
    ("User:s", T, "c.wal", LIT, "WRITE"),
    ("User:s", T, "c.wal.placement", LIT, "CREATE"),
    ("User:s", T, "c.wal.placement", LIT, "DESCRIBE"),
    ("User:s", T, "c.wal.placement", LIT, "DESCRIBE_CONFIGS"),
    ("User:s", T, "c.wal.placement", LIT, "READ"),
    ("User:s", T, "c.wal.placement", LIT, "WRITE"),
    ("User:s", X, "c.wal.placement", LIT, "DESCRIBE"),
    ("User:s", X, "c.wal.placement", LIT, "WRITE"),
    ("User:s", X, "c.wal.shard-", PRE, "DESCRIBE"),
    ("User:s", X, "c.wal.shard-", PRE, "WRITE"),
}


def test_the_acl_table() -> None:
    grants = wal_grants("c.wal", "c.leaders", "User:s", "User:p")
    assert {(g.principal, g.resource, g.name, g.pattern, g.operation) for g in grants} == EXPECTED
    assert len(grants) == len(EXPECTED)  # no duplicates
    assert grants == sorted(grants, key=lambda g: g.key)


def test_only_the_store_writes_or_takes_transactional_ids_and_nobody_deletes() -> None:
    grants = wal_grants("c.wal", "c.leaders", "User:s", "User:p")
    writers = {g.principal for g in grants if (g.operation == "WRITE" and g.name == "c.wal") or g.resource is X}
    assert writers == {"User:s"}
    # The pipeline keeps the readers registry (change feeds record their positions); the store has no part in it.
    registry = {(g.principal, g.operation) for g in grants if g.name == "c.wal.readers"}
    assert registry == {("User:p", op) for op in ("READ", "WRITE", "DESCRIBE", "CREATE")}
    assert {g.principal for g in grants} == {"User:s", "User:p"}  # nobody else anything
    assert not [g for g in grants if g.operation in ("DELETE", "ALTER", "ALTER_CONFIGS", "ALL")]


def test_the_transactional_id_prefix_covers_every_shard_of_the_topic_only() -> None:
    prefix = shard_transactional_id_prefix("c.wal")
    assert all(shard_transactional_id("c.wal", s).startswith(prefix) for s in (0, 7, 1023))
    assert not shard_transactional_id("c.wal2", 0).startswith(prefix)  # another topic's ids
    assert not shard_transactional_id("d.wal", 0).startswith(prefix)


def test_a_grant_as_confluent_kafka_takes_it() -> None:
    acl = binding(Grant("User:s", X, "c.wal.shard-", PRE, "WRITE"))
    assert (acl.restype, acl.name, acl.resource_pattern_type, acl.principal, acl.host, acl.operation,
            acl.permission_type) == (ResourceType.TRANSACTIONAL_ID, "c.wal.shard-", ResourcePatternType.PREFIXED,
                                     "User:s", "*", AclOperation.WRITE, AclPermissionType.ALLOW)


@pytest.mark.parametrize(("given", "expected"), [
    (("", "", "", ""), ClientSecurity()),
    (("", "", "u", "pw"), ClientSecurity("SASL_PLAINTEXT", "SCRAM-SHA-512", "u", "pw")),
    (("sasl_ssl", "scram-sha-256", "u", "pw"), ClientSecurity("SASL_SSL", "SCRAM-SHA-256", "u", "pw")),
    (("SASL_PLAINTEXT", "PLAIN", "u", "pw"), ClientSecurity("SASL_PLAINTEXT", "PLAIN", "u", "pw")),
])
def test_security_from_settings(given: tuple[str, str, str, str], expected: ClientSecurity) -> None:
    assert security_from(*given) == expected


@pytest.mark.parametrize(("given", "why"), [
    (("", "", "u", ""), "needs a Kafka username and password"),
    (("SASL_PLAINTEXT", "", "", ""), "needs a Kafka username and password"),
    (("PLAINTEXT", "", "u", "pw"), "credentials given"),
    (("", "", "", "pw"), "credentials given"),
    (("TLS", "", "", ""), "security protocol must be"),
    (("", "GSSAPI", "u", "pw"), "SASL mechanism must be"),
])
def test_security_that_cannot_work_is_refused(given: tuple[str, str, str, str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        security_from(*given)


def test_client_settings_for_both_client_libraries() -> None:
    login = ClientSecurity("SASL_PLAINTEXT", "SCRAM-SHA-512", "u", 'p"w\\d')
    assert "p\"w" not in repr(login) and login.principal == "User:u"
    assert ClientSecurity().principal == "User:ANONYMOUS"
    assert security_settings(ClientSecurity()) == {}
    assert client_config("b:1", login, **{"client.id": "x"}) == {
        "bootstrap.servers": "b:1", "security.protocol": "sasl_plaintext", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "u", "sasl.password": 'p"w\\d', "client.id": "x"}
    assert java_security_settings(ClientSecurity()) == {}
    assert java_security_settings(login) == {
        "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required username="u" '
                            'password="p\\"w\\\\d";'}


def test_the_broker_listeners_plain_and_secure() -> None:
    plain = listener_settings(9092, 9093, None)
    assert plain["listeners"] == "PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093"
    assert "authorizer.class.name" not in plain
    secure = listener_settings(9092, 9093, {ADMIN_USER: "secret", "s": "x"})
    assert secure["listeners"] == "SASL_PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093"
    assert (secure["authorizer.class.name"], secure["super.users"], secure["allow.everyone.if.no.acl.found"]) == (
        AUTHORIZER, "User:admin", "false")
    assert secure["inter.broker.listener.name"] == "SASL_PLAINTEXT"
    assert "PLAINTEXT:" not in secure["listener.security.protocol.map"].replace("SASL_PLAINTEXT:", "")
    assert 'user_admin="secret"' in secure["listener.name.controller.plain.sasl.jaas.config"]
    assert add_scram_arguments({"b": "2", "a": "1"}) == [
        "--add-scram", "SCRAM-SHA-512=[name=a,password=1]", "--add-scram", "SCRAM-SHA-512=[name=b,password=2]"]


def _clear_kafka_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SECURITY_PROTOCOL", "SASL_MECHANISM", "USERNAME", "PASSWORD", "PASSWORD_FILE"):
        monkeypatch.delenv(f"KVSTORE_KAFKA_{name}", raising=False)


def test_a_node_takes_its_login_from_the_environment_or_a_password_file(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    _clear_kafka_env(monkeypatch)
    assert NodeConfig.from_env().kafka_security == ClientSecurity()
    monkeypatch.setenv("KVSTORE_KAFKA_USERNAME", "store")
    with pytest.raises(ValueError, match="Kafka login"):
        NodeConfig.from_env()
    monkeypatch.setenv("KVSTORE_KAFKA_PASSWORD", "from-env")
    config = NodeConfig.from_env()
    assert config.kafka_security == ClientSecurity("SASL_PLAINTEXT", "SCRAM-SHA-512", "store", "from-env")
    assert "from-env" not in repr(config)
    secret = tmp_path / "password"
    secret.write_text("from-file\n")
    # The file a flag names beats the environment; the environment's file does not.
    assert NodeConfig.from_env(kafka_password_file=str(secret)).kafka_password == "from-file"
    monkeypatch.setenv("KVSTORE_KAFKA_PASSWORD_FILE", str(secret))
    assert NodeConfig.from_env().kafka_password == "from-env"
    monkeypatch.delenv("KVSTORE_KAFKA_PASSWORD")
    assert NodeConfig.from_env().kafka_password == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        NodeConfig.from_env(kafka_password_file=str(tmp_path / "empty"))


def test_a_pipeline_command_takes_its_login_the_same_way(tmp_path: Path) -> None:
    assert kafka_security(None, None, None, None, environ={}) == ClientSecurity()
    env = {"KVSTORE_KAFKA_USERNAME": "pipeline", "KVSTORE_KAFKA_PASSWORD": "pw"}
    assert kafka_security(None, None, None, None, environ=env) == security_from("", "", "pipeline", "pw")
    secret = tmp_path / "password"
    secret.write_text("file-pw\n")
    assert kafka_security(None, None, "other", str(secret), environ=env).password == "file-pw"
    assert kafka_security(None, None, "other", str(secret), environ=env).username == "other"
    with pytest.raises(PipelineError, match="Kafka password file"):
        kafka_security(None, None, None, str(tmp_path / "missing"), environ=env)
    with pytest.raises(PipelineError, match="username and password"):
        kafka_security(None, None, None, None, environ={"KVSTORE_KAFKA_USERNAME": "pipeline"})
