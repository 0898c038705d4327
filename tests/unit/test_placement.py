"""The placement rule and a node's per-shard decisions (kvstore.core.placement), without Kafka."""

from __future__ import annotations

import json
import math
import random

import pytest

from kvstore.core.placement import (
    Act,
    Hold,
    Liveness,
    MoveRefused,
    Overrides,
    ShardFacts,
    ShardHold,
    after,
    changes,
    decide,
    drain_entry,
    move,
    overrides_from,
    pin_entry,
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


def test_a_member_counts_until_its_grace_period_ends() -> None:
    live = Liveness(grace_ms=30_000)
    live.observe(["a", "b", "c"], 0)
    live.observe(["a", "b"], 10_000)
    assert live.members(10_000) == {"a", "b", "c"}
    assert live.absent(["a", "b"], 10_000) == {"c": 20_000}
    assert live.members(30_000) == {"a", "b", "c"}  # exactly the grace period: still counted
    live.observe(["a", "b", "c"], 29_000)  # back in time: a restart moves nothing
    assert live.members(59_000) == {"a", "b", "c"}
    assert live.members(59_001) == set()
    live.observe(["d"], 60_000)
    live.observe(["d"], 50_000)  # an older listing does not move "last seen" back
    assert live.members(90_000) == {"d"}


PLACED = ("me", "b")
ELSEWHERE = ("b", "c")


def facts(placed: tuple[str, ...] = PLACED, *, caught_up: bool = False, in_group: tuple[str, ...] = (),
          settled: bool = True) -> ShardFacts:
    return ShardFacts(placed_here="me" in placed, placed=placed, caught_up=caught_up, in_group=frozenset(in_group),
                      view_settled=settled)


def held(hold: Hold, since_ms: int = 0) -> ShardHold:
    return ShardHold(hold, since_ms)


DECISIONS = [
    # (why, hold, facts, now_ms, act)
    ("placed here, not held: open a learner", None, facts(), 0, Act.OPEN),
    ("not placed, not held: nothing", None, facts(ELSEWHERE), 0, Act.NOTHING),
    ("a learner waits until caught up", held(Hold.LEARNING), facts(), 0, Act.NOTHING),
    ("a caught-up learner joins the group", held(Hold.LEARNING), facts(caught_up=True), 0, Act.JOIN),
    ("a learner no longer placed is dropped at once", held(Hold.LEARNING), facts(ELSEWHERE), 0, Act.DROP),
    ("...but not before this node's view settled (a restart elsewhere may place it back)",
     held(Hold.LEARNING), facts(ELSEWHERE, settled=False), 0, Act.NOTHING),
    ("a placed replica keeps serving", held(Hold.SERVING), facts(caught_up=True, in_group=("me", "b")), 0,
     Act.NOTHING),
    ("not placed: it serves on until every placed replica is caught up", held(Hold.SERVING),
     facts(ELSEWHERE, caught_up=True, in_group=("me", "b")), 0, Act.NOTHING),
    ("...then leaves the group, keeping its data", held(Hold.SERVING),
     facts(ELSEWHERE, caught_up=True, in_group=("me", "b", "c")), 0, Act.LEAVE),
    ("a placement with nobody (no members) never retires the last copy", held(Hold.SERVING),
     facts((), caught_up=True, in_group=("me",)), 0, Act.NOTHING),
    ("retiring: it waits for the replicas to stay caught up", held(Hold.RETIRING, 1000),
     facts(ELSEWHERE, caught_up=True, in_group=("b", "c")), 2999, Act.NOTHING),
    ("...and drops once they did for the settle time", held(Hold.RETIRING, 1000),
     facts(ELSEWHERE, caught_up=True, in_group=("b", "c")), 3000, Act.DROP),
    ("...unless its view has not settled yet", held(Hold.RETIRING, 1000),
     facts(ELSEWHERE, caught_up=True, in_group=("b", "c"), settled=False), 3000, Act.NOTHING),
    ("a placed replica dropped out meanwhile: join again", held(Hold.RETIRING, 1000),
     facts(ELSEWHERE, caught_up=True, in_group=("b",)), 3000, Act.JOIN),
    ("placed here again: join again", held(Hold.RETIRING, 1000), facts(caught_up=True, in_group=("b",)), 3000,
     Act.JOIN),
]


@pytest.mark.parametrize(("why", "hold", "shard", "now_ms", "act"), DECISIONS, ids=[d[0] for d in DECISIONS])
def test_decide(why: str, hold: ShardHold | None, shard: ShardFacts, now_ms: int, act: Act) -> None:
    assert decide("me", hold, shard, now_ms) is act, why


def test_the_skip_caught_up_mutation_lets_a_learner_join_early() -> None:
    assert decide("me", held(Hold.LEARNING), facts(), 0, skip_caught_up=True) is Act.JOIN


def test_after_follows_the_act_and_refuses_impossible_steps() -> None:
    hold = after(None, Act.OPEN, 5)
    assert hold == ShardHold(Hold.LEARNING, 5)
    assert after(hold, Act.NOTHING, 6) is hold
    hold = after(hold, Act.JOIN, 7)
    assert hold == ShardHold(Hold.SERVING, 7)
    hold = after(hold, Act.LEAVE, 8)
    assert hold == ShardHold(Hold.RETIRING, 8)
    assert after(hold, Act.JOIN, 9) == ShardHold(Hold.SERVING, 9)
    assert after(hold, Act.DROP, 9) is None
    with pytest.raises(AssertionError):
        after(ShardHold(Hold.SERVING, 0), Act.DROP, 1)  # a serving replica leaves the group first
    with pytest.raises(AssertionError):
        after(ShardHold(Hold.SERVING, 0), Act.OPEN, 1)
    with pytest.raises(AssertionError):
        after(None, Act.JOIN, 1)
    with pytest.raises(AssertionError):
        after(ShardHold(Hold.SERVING, 0), Act.JOIN, 1)
    with pytest.raises(AssertionError):
        after(ShardHold(Hold.LEARNING, 0), Act.LEAVE, 1)


def test_overrides_round_trip_through_control_entries() -> None:
    entries = dict([drain_entry("n1"), pin_entry(3, ["n2", "n0"]), ("other/setting", b"x")])
    overrides, unusable = overrides_from(entries, 8)
    assert overrides == Overrides(frozenset({"n1"}), {3: ("n2", "n0")}) and unusable == []
    assert drain_entry("n1", undo=True) == ("placement/drain/n1", None)
    assert pin_entry(3, None) == ("placement/pin/3", None)


@pytest.mark.parametrize(("key", "value"), [
    ("placement/drain/", b"1"), ("placement/drain/n1", b"yes"),
    ("placement/pin/x", b'["n1"]'), ("placement/pin/9", b'["n1"]'), ("placement/pin/1", b"\xff"),
    ("placement/pin/1", b"{}"), ("placement/pin/1", b"[]"), ("placement/pin/1", b'["n1", 3]'),
    ("placement/pin/1", b'[""]'), ("placement/pin/1", json.dumps(["n"] * 65).encode()),
])
def test_hostile_control_entries_are_named_and_skipped(key: str, value: bytes) -> None:
    overrides, unusable = overrides_from({key: value, **dict([drain_entry("n2")])}, 8)
    assert unusable == [key]
    assert overrides == Overrides(frozenset({"n2"}), {})


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
