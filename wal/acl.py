"""Who may do what with the WAL on a broker that authorizes (SASL logins, the standard authorizer,
`allow.everyone.if.no.acl.found=false`): the ACLs, as data, and the one call that creates them.

Two principals, and nobody else anything (the broker denies what no ACL allows):

- the store's (every node): appends to the WAL through the shards' transactional ids (W4: the
  ids are what fences a stale leader, so only the store may take them), replays it, creates it
  at the first start, reads its settings (`wal.topic` checks the retention) and runs the
  membership group and the shards' leadership groups (all named after the group), and keeps
  the placement log (`<wal topic>.placement`), appended by its controller through its own
  transactional id (`<wal topic>.placement`, which fences as a shard's does);
- the pipeline's (Spark jobs, `kvstore audit`, ...): reads the WAL, and keeps the registry of
  who still reads it (`wal.readers`, the topic `<wal topic>.readers`: a change feed creates it,
  records its position there and reads it back). It cannot append to the WAL, take a shard's
  transactional id (and so fence a leader) or delete records. Writing the registry only holds
  truncation back (or, by removing a reader, lets it go further), never changes the WAL.

Not granted to either: deleting records (`kvstore wal truncate`, Kafka DeleteRecords) and
altering the topic's settings. Those lose data, so they stay with an administrator (a super
user, who also reads the readers registry before truncating): a leaked store or pipeline
password cannot shorten the WAL. A WAL topic created by hand with a finite retention is
therefore refused by a node (it may not fix it) instead of repaired. The store needs nothing of
the readers registry.

What each request needs (Kafka's authorization of its APIs): Produce WRITE on the topic;
InitProducerId, AddPartitionsToTxn and EndTxn WRITE on the transactional id (which also stands
in for the cluster's IDEMPOTENT_WRITE, KIP-679), FindCoordinator for it DESCRIBE; Fetch and
ListOffsets READ / DESCRIBE on the topic; Metadata DESCRIBE on the topic; CreateTopics CREATE on
the topic; DescribeConfigs DESCRIBE_CONFIGS; JoinGroup, SyncGroup, Heartbeat and LeaveGroup READ
on the group, DescribeGroups DESCRIBE. librdkafka looks up a coordinator for the group id every
consumer has, even one that only reads assigned partitions (`wal.clients.READER_GROUP_PREFIX`),
which needs DESCRIBE on that group. The registry's idempotent producer needs no cluster ACL:
WRITE on a topic stands in for IDEMPOTENT_WRITE (KIP-679).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
from collections.abc import Iterable, Sequence

from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from wal.clients import (
    READER_GROUP_PREFIX,
    ClientSecurity,
    client_config,
    placement_transactional_id,
    shard_transactional_id_prefix,
)
from wal.errors import UnavailableError
from wal.topic import placement_topic, readers_topic


class Resource(enum.Enum):
    TOPIC = "topic"
    GROUP = "group"
    TRANSACTIONAL_ID = "transactional_id"


class Pattern(enum.Enum):
    LITERAL = "literal"  # the resource of exactly that name
    PREFIXED = "prefixed"  # every resource whose name starts with it


@dataclasses.dataclass(frozen=True)
class Grant:
    """One ALLOW rule: `principal` (e.g. "User:store") may `operation` on the resource(s)."""

    principal: str
    resource: Resource
    name: str
    pattern: Pattern
    operation: str  # Kafka's name: READ, WRITE, DESCRIBE, CREATE, DESCRIBE_CONFIGS

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        """The order grants are listed in: by principal, then resource."""
        return self.principal, self.resource.value, self.name, self.pattern.value, self.operation

    def __post_init__(self) -> None:
        assert self.principal.startswith("User:") and len(self.principal) > len("User:"), self.principal
        assert self.name, "an ACL names a resource"
        assert self.operation in OPERATIONS, self.operation


OPERATIONS = ("READ", "WRITE", "DESCRIBE", "CREATE", "DESCRIBE_CONFIGS")


def wal_grants(topic: str, group: str, store: str, pipeline: str) -> list[Grant]:
    """The ACLs of one WAL `topic` with its leadership consumer `group`, for the store's and
    the pipeline's principals ("User:<name>"), sorted. Pure: `create_acls` applies them."""
    assert store != pipeline, "the store and the pipeline must be different principals"
    topic_ = (Resource.TOPIC, topic, Pattern.LITERAL)
    registry = (Resource.TOPIC, readers_topic(topic), Pattern.LITERAL)
    placement = (Resource.TOPIC, placement_topic(topic), Pattern.LITERAL)
    txn = (Resource.TRANSACTIONAL_ID, shard_transactional_id_prefix(topic), Pattern.PREFIXED)
    placement_txn = (Resource.TRANSACTIONAL_ID, placement_transactional_id(topic), Pattern.LITERAL)
    # The membership group and every shard's leadership group, `<group>.<shard>` (kvstore.server.leadership).
    leaders = (Resource.GROUP, group, Pattern.PREFIXED)
    readers = (Resource.GROUP, READER_GROUP_PREFIX, Pattern.PREFIXED)
    rules: list[tuple[str, tuple[Resource, str, Pattern], Sequence[str]]] = [
        (store, topic_, ("WRITE", "READ", "DESCRIBE", "CREATE", "DESCRIBE_CONFIGS")),
        (store, txn, ("WRITE", "DESCRIBE")),
        (store, leaders, ("READ", "DESCRIBE")),
        (store, placement, ("WRITE", "READ", "DESCRIBE", "CREATE", "DESCRIBE_CONFIGS")),
        (store, placement_txn, ("WRITE", "DESCRIBE")),
        (store, readers, ("DESCRIBE",)),
        (pipeline, topic_, ("READ", "DESCRIBE")),
        (pipeline, placement, ("READ", "DESCRIBE")),  # the audit folds the placement log
        (pipeline, registry, ("READ", "WRITE", "DESCRIBE", "CREATE")),
        (pipeline, readers, ("DESCRIBE",)),
    ]
    grants = (Grant(principal, resource, name, pattern, operation)
              for principal, (resource, name, pattern), operations in rules for operation in operations)
    return sorted(grants, key=lambda grant: grant.key)


_RESOURCE_TYPES = {Resource.TOPIC: ResourceType.TOPIC, Resource.GROUP: ResourceType.GROUP,
                   Resource.TRANSACTIONAL_ID: ResourceType.TRANSACTIONAL_ID}
_PATTERN_TYPES = {Pattern.LITERAL: ResourcePatternType.LITERAL, Pattern.PREFIXED: ResourcePatternType.PREFIXED}


def binding(grant: Grant) -> AclBinding:
    """The confluent-kafka form of one grant (any host)."""
    return AclBinding(_RESOURCE_TYPES[grant.resource], grant.name, _PATTERN_TYPES[grant.pattern], grant.principal,
                      "*", AclOperation[grant.operation], AclPermissionType.ALLOW)


def create_acls(bootstrap_servers: str, admin: ClientSecurity, grants: Iterable[Grant],
                timeout_s: float = 30.0) -> None:
    """Create `grants` as a principal allowed to (a super user). Idempotent: an ACL that exists
    already is left as it is. Raises UnavailableError if the broker refuses or does not answer."""
    bindings = [binding(g) for g in grants]
    if not bindings:
        return
    client = AdminClient(client_config(bootstrap_servers, admin, **{"client.id": "wal-acl"}))
    failures: list[str] = []
    for acl, future in client.create_acls(bindings, request_timeout=timeout_s).items():
        try:
            future.result(timeout=timeout_s + 1)
        except KafkaException as exc:
            failures.append(f"{acl}: {exc.args[0]}")
        except concurrent.futures.TimeoutError:
            failures.append(f"{acl}: no answer within {timeout_s:.0f} s")
    if failures:
        raise UnavailableError("creating ACLs failed: " + "; ".join(failures))
