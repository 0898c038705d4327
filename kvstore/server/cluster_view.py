"""The cluster as the group coordinator describes it: who is alive, and each shard's caught-up
replicas and leader. One DescribeConsumerGroups call for the membership group and every shard's
leadership group (kvstore.server.leadership), refreshed by the node every `REFRESH_S` and right
after any rebalance it took part in.

Why the coordinator and not the nodes' own word: it is the one place that decides both who is a
member (the placement's live members, kvstore.core.placement) and who leads a shard, so a view
built from it never names a leader the group has not chosen. The nodes' own word (replicas still
learning, their lag) comes from their local shard views (kvstore.server.app `local_view`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

from confluent_kafka.admin import AdminClient

from kvstore.server.leadership import shard_group
from wal.clients import ClientSecurity, client_config
from wal.membership import Member, members_from

log = logging.getLogger(__name__)

REFRESH_S = 0.5
DESCRIBE_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class View:
    """One description. `members`: node id -> advertised address of the membership group's
    members (the nodes that may hold shards); `groups`: shard -> its leadership group's members,
    only for the shards whose group could be described."""

    members: Mapping[str, str]
    groups: Mapping[int, tuple[Member, ...]]
    at_s: float  # time.monotonic() when it was taken

    def in_group(self, shard: int) -> frozenset[str]:
        """The shard's caught-up replicas: the members of its leadership group."""
        return frozenset(member.member_id for member in self.groups.get(shard, ()))

    def leader(self, shard: int) -> Member | None:
        """The member the group assigned the shard's own partition to (None: nobody right now, or
        a description that shows it twice, which is trusted for neither)."""
        owners = [member for member in self.groups.get(shard, ()) if shard in member.partitions]
        return owners[0] if len(owners) == 1 else None

    def address(self, node_id: str) -> str:
        """A node's advertised address, from any group that lists it ("" if none does)."""
        if node_id in self.members:
            return self.members[node_id]
        for members in self.groups.values():
            for member in members:
                if member.member_id == node_id and member.address:
                    return member.address
        return ""


EMPTY = View({}, {}, 0.0)


class ClusterView:
    """The shell: an admin client and the last view (kept when a description fails)."""

    def __init__(self, *, bootstrap_servers: str, membership_group: str, leader_group: str, topic: str, shards: int,
                 node_id: str, security: ClientSecurity | None = None) -> None:
        self._config = client_config(bootstrap_servers, security, **{"client.id": f"{node_id}-view"})
        self._membership_group = membership_group
        self._groups = {shard_group(leader_group, shard): shard for shard in range(shards)}
        self._topic = topic
        self._admin: AdminClient | None = None
        self.last = EMPTY

    def describe(self, timeout_s: float = DESCRIBE_TIMEOUT_S) -> View:
        """A fresh view (blocking: call it in a thread). A group whose description failed keeps its
        last known members; if the membership group failed, the whole call raises KafkaException."""
        if self._admin is None:
            self._admin = AdminClient(self._config)
        names = [self._membership_group, *self._groups]
        try:
            futures = self._admin.describe_consumer_groups(names, request_timeout=timeout_s)
            membership = futures[self._membership_group].result(timeout=timeout_s + 1)
        except Exception:
            self._admin = None  # a fresh client next time: stale metadata must not stick
            raise
        members = {m.member_id: m.address for m in (members_from(d, self._topic) for d in membership.members)}
        groups = dict(self.last.groups)
        for name, shard in self._groups.items():
            try:
                description = futures[name].result(timeout=timeout_s + 1)
            except Exception as exc:  # keep what we knew of this one
                log.debug("describing %s failed: %s", name, exc)
                continue
            groups[shard] = tuple(members_from(d, self._topic) for d in description.members)
        self.last = View(members, groups, time.monotonic())
        return self.last
