"""The placement rule (kvstore.core.placement), without Kafka. The controller's decisions and the
nodes' following: tests/unit/test_placement_controller.py."""

from __future__ import annotations

import math
import random

import pytest

from kvstore.core.placement import (
    MoveRefused,
    Overrides,
    changes,
    move,
    place,
    ranked,
    shards_of,
    weight,
)


def test_the_weight_is_a_stable_hash_of_shard_and_node() -> None:
    # Golden values: every node, every release and every platform must compute the same placement.
    assert weight(0, "n0") == 13003372362819317630
    assert weight(3, "node-1") == 8671340536844071033
    assert weight(0, "n0") != weight(1, "n0") != weight(0, "n1")
    assert ranked(7, ["b", "a", "c", "a"]) == ranked(7, ["c", "a", "b"])
    assert len(ranked(7, ["b", "a", "c", "a"])) == 3


def one(shard: int, nodes: list[str], r: int, overrides: Overrides | None = None) -> tuple[str, ...]:
    return place(shard + 1, nodes, r, overrides or Overrides())[shard]


def test_the_first_shards_take_the_top_of_their_ranking_and_r_is_capped() -> None:
    nodes = [f"n{i}" for i in range(5)]
    assert one(0, nodes, 2) == tuple(ranked(0, nodes)[:2])  # nobody is full yet
    assert all(set(replicas) == set(nodes) for replicas in place(10, nodes, 9))
    assert place(3, ["only"], 3) == (("only",),) * 3
    assert place(2, [], 3) == ((), ())
    assert place(0, nodes, 2) == ()
    with pytest.raises(AssertionError):
        place(1, nodes, 0)


@pytest.mark.parametrize(("nodes", "shards", "r"), [(5, 10, 2), (3, 4, 3), (6, 10, 2), (4, 7, 3), (7, 64, 3)])
def test_no_node_holds_more_than_its_share(nodes: int, shards: int, r: int) -> None:
    names = [f"n{i}" for i in range(nodes)]
    placement = place(shards, names, r)
    counts = [len(shards_of(node, placement)) for node in names]
    assert sum(counts) == shards * min(r, nodes)
    share = shards * min(r, nodes) / nodes
    assert max(counts) <= math.ceil(share), counts  # nobody holds more than its share, rounded up
    assert all(len(set(replicas)) == min(r, nodes) for replicas in placement)
    # With R = N every node holds every shard: the default three-node cluster is as before.
    assert all(set(replicas) == {"n0", "n1", "n2"} for replicas in place(4, ["n0", "n1", "n2"], 3))


def moved(before: tuple[tuple[str, ...], ...], after_: tuple[tuple[str, ...], ...]) -> int:
    return sum(len(set(old) - set(new)) for old, new in zip(before, after_, strict=True))


def test_a_join_or_a_departure_moves_little_more_than_it_must() -> None:
    """Over many random clusters: the replicas moved on a join or a leave, against the least any
    rule could move (what the newcomer takes, what the leaver held)."""
    rng = random.Random(1)
    joined_moves = joined_least = left_moves = left_least = 0
    for _ in range(300):
        nodes = [f"node-{rng.randrange(10**6)}" for _ in range(rng.randint(2, 8))]
        shards, r = rng.choice([4, 10, 16, 32, 64]), rng.randint(1, 3)
        before = place(shards, nodes, r)
        joined = place(shards, [*nodes, "newcomer"], r)
        joined_moves += moved(before, joined)
        joined_least += len(shards_of("newcomer", joined)) if len(nodes) >= r else 0
        left = place(shards, nodes[1:], r)
        left_moves += moved(before, left)
        left_least += len(shards_of(nodes[0], before))
    print(f"join: {joined_moves} moved, {joined_least} at least; leave: {left_moves} moved, {left_least} at least")
    assert joined_moves <= 1.25 * joined_least, (joined_moves, joined_least)
    assert left_moves <= 1.25 * left_least, (left_moves, left_least)


def test_drained_nodes_hold_nothing_and_pins_come_first() -> None:
    nodes = ["n0", "n1", "n2", "n3"]
    drained = place(8, nodes, 2, Overrides(drained=frozenset({"n1"})))
    assert not shards_of("n1", drained)
    assert all(len(replicas) == 2 for replicas in drained)
    # Draining everyone places on everyone: a shard is never placed nowhere.
    assert place(8, nodes, 2, Overrides(drained=frozenset(nodes))) == place(8, nodes, 2)
    outsider = next(n for n in nodes if n not in one(0, nodes, 2))
    pinned = one(0, nodes, 2, Overrides(pinned={0: (outsider,)}))
    assert pinned == (outsider, ranked(0, nodes)[0])  # it replaced the lower-ranked replica
    # A pin on a node that is gone or drained is ignored; so is one beyond R.
    assert one(0, nodes, 2, Overrides(pinned={0: ("gone",)})) == one(0, nodes, 2)
    assert one(0, nodes, 2, Overrides(drained=frozenset({outsider}), pinned={0: (outsider,)})) == \
        one(0, [n for n in nodes if n != outsider], 2)
    assert one(0, nodes, 1, Overrides(pinned={0: ("n3", "n2")})) == ("n3",)


def test_move_replaces_one_replica_and_refuses_what_cannot_be() -> None:
    nodes = ["n0", "n1", "n2", "n3"]
    placement = place(4, nodes, 2)
    holder, other = placement[0]
    outsider = next(n for n in nodes if n not in placement[0])
    assert move(placement, nodes, Overrides(), 0, outsider) == (holder, outsider)  # the last one gives
    assert move(placement, nodes, Overrides(), 0, outsider, holder) == (outsider, other)
    assert move(((),), nodes, Overrides(), 0, "n1") == ("n1",)
    refused = [
        (9, outsider, "", "does not exist"), (0, "ghost", "", "not a member"),
        (0, holder, "", "already holds"), (0, outsider, "ghost", "does not hold"),
    ]
    for shard, to, source, why in refused:
        with pytest.raises(MoveRefused, match=why):
            move(placement, nodes, Overrides(), shard, to, source)
    with pytest.raises(MoveRefused, match="being drained"):
        move(placement, nodes, Overrides(drained=frozenset({outsider})), 0, outsider)
    # Pinned, the move is what the rule places (the pin comes first, in its order).
    pinned = place(4, nodes, 2, Overrides(pinned={0: move(placement, nodes, Overrides(), 0, outsider)}))
    assert set(pinned[0]) == {holder, outsider}


def test_changes_lists_the_shards_whose_replicas_change() -> None:
    assert changes([("a", "b"), ("c",)], [("b", "a"), ("d",)]) == [(1, ("c",), ("d",))]


def test_the_bound_is_kept_by_moving_replicas_but_pins_may_exceed_it() -> None:
    # Ten shards on five nodes, R = 2: the greedy pass alone leaves one node at 5 and one at 3.
    counts = [len(shards_of(f"n{i}", place(10, [f"n{i}" for i in range(1, 6)], 2))) for i in range(1, 6)]
    assert counts == [4, 4, 4, 4, 4]
    # Pins are the operator's word: they may put more on a node than its share.
    pinned = place(2, ["n1", "n2"], 1, Overrides(pinned={0: ("n1",), 1: ("n1",)}))
    assert pinned == (("n1",), ("n1",))
