"""The cluster as this node knows it: who is alive (the membership group, as its coordinator
describes it), and each shard's caught-up replicas and leader (as the nodes report themselves),
refreshed by the node: the reports every `REFRESH_S` and right after any rebalance it took part
in (a new leader is known to every node within about that), the members every
`MEMBERS_REFRESH_S` (placement counts them with a grace period of seconds).

Why the coordinator for the members: it is the one place that knows who joined, new nodes
included. Why the nodes' own reports for the shards (`from_reports`, pure): describing every
shard's leadership group too made one DescribeConsumerGroups call fan out to S+1 group
coordinators twice a second on every node, and librdkafka 2.16 aborts the process (an assertion
in `rd_kafka_enq_once_del_source_return`, its admin client's coordinator requests) when a broker
holding some of those coordinators dies: seen on all three nodes at once in
tests/integration/test_three_brokers.py. One group per call is what the nodes described before
placement, and what survived that test. A node's report of its own copies (`Node.local_view`) is
what the shard map shows anyway: a copy in state REPLICA is in its shard's leadership group, and
the node that says it leads (or was assigned) a shard is its leader. A copy that says `in_group`
is in its shard's leadership group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from kvstore.v1 import cluster_pb2
from wal.membership import Member

REFRESH_S = 0.2
MEMBERS_REFRESH_S = 1.0
DESCRIBE_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class View:
    """What a node knows of the cluster. `members`: node id -> advertised address of the
    membership group's members (the nodes that may hold shards); `groups`: shard -> its caught-up
    replicas (in its leadership group), as they reported themselves; `leaders`: shard -> the node
    that leads it (or was assigned it and is taking over)."""

    members: Mapping[str, str]
    groups: Mapping[int, tuple[Member, ...]]
    at_s: float  # time.monotonic() when it was taken
    leaders: Mapping[int, Member] = dataclasses.field(default_factory=dict)

    def in_group(self, shard: int) -> frozenset[str]:
        """The shard's caught-up replicas: the members of its leadership group."""
        return frozenset(member.member_id for member in self.groups.get(shard, ()))

    def leader(self, shard: int) -> Member | None:
        return self.leaders.get(shard)

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


def from_reports(members: Mapping[str, str], reports: Sequence[cluster_pb2.ShardMapResponse], at_s: float) -> View:
    """A view from the membership and every node's report of itself (`Node.local_view`: its own
    copies, each with its state, and the shards it leads or was assigned). Pure. Of two nodes that
    both claim a shard, the one that leads (fenced and ready) with the higher term wins; the other
    is fenced already or about to be."""
    groups: dict[int, list[Member]] = {}
    claims: dict[int, list[tuple[bool, int, str, Member]]] = {}
    for report in reports:
        if not report.nodes:
            continue
        node = report.nodes[0]  # each node describes itself first
        for info in report.shards:
            own = [r for r in info.replicas if r.node_id == node.node_id]
            if not own or not own[0].in_group:
                continue
            claims_it = info.leader_id == node.node_id
            member = Member(node.node_id, node.address, (info.shard,) if claims_it else ())
            groups.setdefault(info.shard, []).append(member)
            if claims_it:
                claims.setdefault(info.shard, []).append((info.leader_ready, info.term, node.node_id, member))
    leaders = {shard: max(found)[3] for shard, found in claims.items()}
    return View(dict(members), {shard: tuple(found) for shard, found in groups.items()}, at_s, leaders)
