"""The pure parts of the cluster view: group members -> owners, and the merged shard map."""

from __future__ import annotations

import types

import pytest

from kvstore.server import shardmap
from kvstore.v1 import cluster_pb2
from wal.membership import Member, client_id, group_config, members_from, owners, parse_client_id


@pytest.mark.parametrize(("member", "address"), [("n1", "127.0.0.1:50051"), ("node-2", "kv-2:50051"), ("x", "")])
def test_client_id_round_trips(member: str, address: str) -> None:
    assert parse_client_id(client_id(member, address)) == (member, address)


@pytest.mark.parametrize("bad", ["", "a@b"])
def test_client_id_refuses_bad_member_ids(bad: str) -> None:
    with pytest.raises(ValueError, match="member id"):
        client_id(bad, "h:1")


def test_foreign_client_ids_have_no_address() -> None:
    assert parse_client_id("rdkafka") == ("rdkafka", "")


def test_owners_maps_partitions_and_distrusts_double_claims() -> None:
    a = Member("a", "h:1", (0, 2))
    b = Member("b", "h:2", (1, 2))
    assert owners([a, b]) == {0: a, 1: b}  # partition 2 claimed twice: neither is trusted
    assert owners([]) == {}


def test_members_from_a_description_keeps_only_the_wal_topic() -> None:
    tp = types.SimpleNamespace
    description = tp(client_id="n1@h:1", group_instance_id="n1",
                     assignment=tp(topic_partitions=[tp(topic="wal", partition=3), tp(topic="other", partition=0),
                                                     tp(topic="wal", partition=1)]))
    assert members_from(description, "wal") == Member("n1", "h:1", (1, 3))
    empty = tp(client_id="n2@h:2", group_instance_id=None, assignment=None)
    assert members_from(empty, "wal") == Member("n2", "h:2", ())


@pytest.mark.parametrize(("session_ms", "heartbeat_ms"), [(1000, 100), (1500, 100), (6000, 100), (200, 50)])
def test_group_config_heartbeats_often_and_is_static_and_cooperative(session_ms: int, heartbeat_ms: int) -> None:
    config = group_config("b:9092", "g", "n1", "h:1", session_ms)
    assert config["heartbeat.interval.ms"] == heartbeat_ms
    assert config["group.instance.id"] == "n1" and config["client.id"] == "n1@h:1"
    assert config["partition.assignment.strategy"] == "cooperative-sticky"
    assert config["enable.auto.commit"] is False


def view(node: str, address: str, leads: dict[int, int], shards: int = 3) -> cluster_pb2.ShardMapResponse:
    """A node's local view: it leads `leads` (shard -> term), sees the others unled."""
    out = cluster_pb2.ShardMapResponse(shard_count=shards, topic="t", served_by=node)
    out.nodes.append(cluster_pb2.NodeInfo(node_id=node, address=address, leads=sorted(leads), can_lead=True))
    for shard in range(shards):
        mine = shard in leads
        out.shards.append(cluster_pb2.ShardInfo(shard=shard, leader=address if mine else "", term=leads.get(shard, 0),
                                                applied_offset=10 + shard, end_offset=12 + shard, lag=2,
                                                leader_id=node if mine else "", leader_ready=mine))
    return out


def test_merge_takes_each_shard_from_the_node_that_leads_it() -> None:
    local = view("a", "h:1", {0: 5})
    merged = shardmap.merge(local, [view("b", "h:2", {1: 7}), view("c", "h:3", {2: 9})], {})
    assert [(s.leader, s.leader_id, s.term, s.leader_ready) for s in merged.shards] == [
        ("h:1", "a", 5, True), ("h:2", "b", 7, True), ("h:3", "c", 9, True)]
    assert [n.node_id for n in merged.nodes] == ["a", "b", "c"]
    assert merged.served_by == "a" and merged.shard_count == 3


def test_merge_prefers_the_higher_term_when_two_nodes_claim_a_shard() -> None:
    merged = shardmap.merge(view("a", "h:1", {0: 5}), [view("b", "h:2", {0: 8})], {})
    assert (merged.shards[0].leader_id, merged.shards[0].term) == ("b", 8)


def test_merge_shows_the_assigned_node_while_nobody_leads_yet() -> None:
    merged = shardmap.merge(view("a", "h:1", {}), [], {1: ("b", "h:2")})
    shard0, shard1 = merged.shards[0], merged.shards[1]
    assert (shard0.leader, shard0.leader_id, shard0.leader_ready) == ("", "", False)
    assert (shard1.leader, shard1.leader_id, shard1.leader_ready, shard1.term) == ("h:2", "b", False, 0)
    assert shard1.applied_offset == 11  # the answering node's own replica


def test_merge_ignores_a_claim_a_view_makes_for_another_node() -> None:
    forged = view("b", "h:2", {})
    forged.shards[0].leader_id = "z"
    forged.shards[0].leader_ready = True
    merged = shardmap.merge(view("a", "h:1", {}), [forged], {})
    assert merged.shards[0].leader_ready is False


def report(node: str, shards: dict[int, tuple[int, bool, bool]]) -> cluster_pb2.ShardMapResponse:
    """A node's report of itself: shard -> (state, claims it, ready)."""
    out = cluster_pb2.ShardMapResponse(nodes=[cluster_pb2.NodeInfo(node_id=node, address=f"{node}:1")])
    for shard, (state, claims, ready) in shards.items():
        out.shards.append(cluster_pb2.ShardInfo(
            shard=shard, leader_id=node if claims else "other", leader_ready=ready, term=7 if ready else 0,
            replicas=[cluster_pb2.ReplicaInfo(node_id=node, address=f"{node}:1", state=state,
                                              in_group=state == cluster_pb2.REPLICA_STATE_REPLICA)]))
    return out


def test_a_view_from_the_nodes_reports_of_themselves() -> None:
    from kvstore.server.cluster_view import from_reports

    replica, learner = cluster_pb2.REPLICA_STATE_REPLICA, cluster_pb2.REPLICA_STATE_LEARNER
    view = from_reports({"a": "a:1", "b": "b:1", "c": "c:1"}, [
        report("a", {0: (replica, True, True), 1: (replica, False, False)}),
        report("b", {0: (replica, False, False), 1: (replica, True, False), 2: (learner, True, True)}),
        report("c", {1: (replica, True, True)}),  # c leads 1 (ready); b was assigned it and is taking over
        cluster_pb2.ShardMapResponse(),  # a report without a node says nothing
    ], 5.0)
    assert view.in_group(0) == {"a", "b"} and view.in_group(1) == {"a", "b", "c"}
    assert view.in_group(2) == frozenset()  # a learner is in no group, and cannot lead
    assert view.leader(0) is not None and view.leader(0).member_id == "a"  # type: ignore[union-attr]
    assert view.leader(1) is not None and view.leader(1).member_id == "c"  # type: ignore[union-attr]
    assert view.leader(2) is None and view.address("b") == "b:1" and view.at_s == 5.0


def test_a_map_for_clients_names_the_addresses_clients_use() -> None:
    """`--advertise-client` (a published container port): the public shard map and its nodes name
    the client addresses; what the nodes use among themselves stays out of it."""
    from kvstore.server.shardmap import for_clients

    inside = {"node-1:50051": "127.0.0.1:50051", "node-2:50052": "127.0.0.1:50052"}
    smap = cluster_pb2.ShardMapResponse(shard_count=1, shards=[cluster_pb2.ShardInfo(
        shard=0, leader="node-1:50051", replicas=[cluster_pb2.ReplicaInfo(node_id="node-2", address="node-2:50052")])],
        nodes=[cluster_pb2.NodeInfo(node_id="node-1", address="node-1:50051", client_address="127.0.0.1:50051"),
               cluster_pb2.NodeInfo(node_id="node-2", address="node-2:50052")])
    out = for_clients(smap, lambda a: inside.get(a, a))
    assert out.shards[0].leader == "127.0.0.1:50051" and out.shards[0].replicas[0].address == "127.0.0.1:50052"
    assert [n.address for n in out.nodes] == ["127.0.0.1:50051", "127.0.0.1:50052"]
    assert smap.shards[0].leader == "node-1:50051", "the node's own (cached) map is not changed"
    assert for_clients(smap, lambda a: a).shards[0].leader == "node-1:50051"  # no client addresses: the same
