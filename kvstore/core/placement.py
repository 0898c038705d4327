"""Which nodes hold which shards (P1, P2; docs/design.md §9): pure, the same on every node.

**The rule (P1).** Shard s is placed on the R live candidates with the highest rendezvous weight
`weight(s, node)` (highest random weight hashing, Thaler and Ravishankar 1998: a hash of the
shard and the node's id, nothing else) among those not yet holding their share of replicas
(`place`: bounded loads, so that every node holds about R·S/N shards). Every node that sees the
same members computes the same placement, and a node joining or leaving moves little more than
the replicas it takes or gives up (a join takes about R·S/N replicas, one from each shard it
enters). `Overrides` are the operator's word on top (`kvstore drain`, `kvstore move`): a drained
node is no candidate, a pinned node comes first in its shard's list. R is capped by the number
of candidates.

**Live members, with a grace period.** A node that stops being listed (it crashed, it is
restarting) still counts for `grace_ms` (30 s by default) after it was last seen, so a restart
moves nothing; only a node gone for longer has its shards placed elsewhere (`Liveness`).

**A node's own decisions (P2)**, per shard (`decide`, `ShardHold`): a shard placed here and not
held is opened as a *learner*: it loads the newest usable snapshot, replays the tail, and only
once caught up joins the shard's leadership group, where it counts as a replica and may be
chosen to lead. A shard held here but no longer placed here is given up in two steps: first the
node leaves the leadership group (still holding the data) once every placed replica is caught up
(in the group), then, after `settle_ms` during which they stayed so, it drops the data. If any
placed replica drops out of the group meanwhile, it joins again instead. So a planned move never
leaves fewer caught-up replicas than the placement asks for; a learner that is no longer needed is
dropped at once (nobody counted on it). Safety does not rest on any of this (P3): two nodes that
both lead a shard are harmless (W2, W4).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence

DEFAULT_REPLICATION_FACTOR = 3
DEFAULT_GRACE_MS = 30_000
# A replica that left the leadership group waits this long, seeing every placed replica caught up
# throughout, before it drops its data: long enough for two refreshes of the cluster's view.
DEFAULT_SETTLE_MS = 2_000


def weight(shard: int, node: str) -> int:
    """The rendezvous weight of `node` for `shard`: 64 bits of BLAKE2b over both, stable across
    processes, platforms and Python versions (unlike `hash`)."""
    digest = hashlib.blake2b(f"{shard}\0{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def ranked(shard: int, nodes: Iterable[str]) -> list[str]:
    """`nodes` by descending weight for `shard` (ties, which need a 64-bit collision, by name)."""
    return sorted(set(nodes), key=lambda node: (-weight(shard, node), node))


@dataclasses.dataclass(frozen=True)
class Overrides:
    """The operator's word on top of the rule: nodes being drained hold nothing, and pinned
    nodes (`kvstore move SHARD --to NODE`) come first in their shard's replica list."""

    drained: frozenset[str] = frozenset()
    pinned: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)


NO_OVERRIDES = Overrides()


def place(shard_count: int, members: Iterable[str], replication_factor: int,
          overrides: Overrides = NO_OVERRIDES) -> tuple[tuple[str, ...], ...]:
    """Every shard's replicas (index = shard), best first.

    Rendezvous hashing with bounded loads: shards are placed in order, each on its pinned
    candidates first, then on the highest-weight candidates that hold fewer than
    `ceil(R * S / candidates)` replicas so far (if fewer than R such remain, on the
    highest-weight ones regardless). Plain rendezvous hashing moves the fewest replicas but is
    lopsided with few shards (10 shards, R = 2, 5 nodes: 6 on one node, 2 on another); the bound
    holds every node to its share rounded up, at the cost of a few more moves than the minimum
    (over 300 random clusters, tests/unit/test_placement.py: 16 % more on a join, 9 % on a leave).

    R = min(`replication_factor`, candidates). Candidates are the members not drained; if every
    member is drained, all of them (a shard is never placed nowhere while any member lives). No
    members: nowhere."""
    assert replication_factor >= 1, f"replication factor must be at least 1: {replication_factor}"
    assert shard_count >= 0, shard_count
    everyone = frozenset(members)
    candidates = everyone - overrides.drained or everyone
    count = min(replication_factor, len(candidates))
    if count == 0:
        return tuple(() for _ in range(shard_count))
    cap = math.ceil(count * shard_count / len(candidates))
    load = dict.fromkeys(candidates, 0)
    placement: list[tuple[str, ...]] = []
    for shard in range(shard_count):
        chosen: list[str] = []
        for node in overrides.pinned.get(shard, ()):
            if node in candidates and node not in chosen and len(chosen) < count:
                chosen.append(node)
        order = [node for node in ranked(shard, candidates) if node not in chosen]
        under = [node for node in order if load[node] < cap]
        chosen += under[:count - len(chosen)]
        chosen += [node for node in order if node not in chosen][:count - len(chosen)]
        assert len(chosen) == count and len(set(chosen)) == count, chosen
        for node in chosen:
            load[node] += 1
        placement.append(tuple(chosen))
    return tuple(placement)


def shards_of(node: str, placement: Sequence[Sequence[str]]) -> frozenset[int]:
    return frozenset(shard for shard, replicas in enumerate(placement) if node in replicas)


class Liveness:
    """The members placement counts: those listed now, and those last listed less than
    `grace_ms` ago (a restart moves nothing). Pure: time comes with each observation."""

    def __init__(self, grace_ms: int = DEFAULT_GRACE_MS) -> None:
        assert grace_ms >= 0, grace_ms
        self.grace_ms = grace_ms
        self._last_seen_ms: dict[str, int] = {}

    def observe(self, listed: Iterable[str], now_ms: int) -> None:
        """The members the group listed at `now_ms`."""
        for node in listed:
            self._last_seen_ms[node] = max(now_ms, self._last_seen_ms.get(node, now_ms))

    def members(self, now_ms: int) -> frozenset[str]:
        """Who counts at `now_ms`; forgets those gone for longer than the grace period."""
        gone = [node for node, seen in self._last_seen_ms.items() if now_ms - seen > self.grace_ms]
        for node in gone:
            del self._last_seen_ms[node]
        return frozenset(self._last_seen_ms)

    def absent(self, listed: Iterable[str], now_ms: int) -> dict[str, int]:
        """Members counted though not listed now -> how long until their grace ends (ms)."""
        now_listed = set(listed)
        return {node: max(0, seen + self.grace_ms - now_ms) for node, seen in sorted(self._last_seen_ms.items())
                if node not in now_listed}


class Hold(enum.Enum):
    """What a node does with one shard it holds (absent: it holds nothing of it)."""

    LEARNING = "learning"  # loading and replaying; not in the leadership group, counts for nothing
    SERVING = "serving"  # caught up and in the leadership group: a replica, may lead
    RETIRING = "retiring"  # no longer placed here: out of the group, data kept until it may drop


@dataclasses.dataclass(frozen=True)
class ShardHold:
    hold: Hold
    since_ms: int  # when it entered `hold`


class Act(enum.Enum):
    NOTHING = "nothing"
    OPEN = "open"  # start a learner: load the newest snapshot, replay the tail
    JOIN = "join"  # caught up (or needed again): join the shard's leadership group
    LEAVE = "leave"  # no longer placed, every placed replica caught up: leave the group, keep the data
    DROP = "drop"  # close the replica and remove its data


@dataclasses.dataclass(frozen=True)
class ShardFacts:
    """What a node knows of one shard when it decides (`decide`)."""

    placed_here: bool
    placed: tuple[str, ...]  # every node it is placed on, this one included if placed_here
    caught_up: bool  # this node's replica has reached the partition's end at least once
    in_group: frozenset[str]  # the shard's leadership group as last described: its caught-up replicas
    # This node has watched the members for a whole grace period: its view counts the nodes that
    # are away but not gone, as every other node's does. Until then a shard not placed here may be
    # placed here after all (on a node that is only restarting), so nothing is dropped.
    view_settled: bool = True


def decide(me: str, held: ShardHold | None, facts: ShardFacts, now_ms: int, *, settle_ms: int = DEFAULT_SETTLE_MS,
           skip_caught_up: bool = False) -> Act:
    """The one next step for one shard on node `me` (module docstring). `skip_caught_up` is a
    mutation (tests only): a learner joins the group before it caught up, so that a giver may
    drop its copy while fewer than R replicas can serve; the simulation must catch it."""
    others_ready = sum(1 for node in facts.placed if node != me and node in facts.in_group)
    others_placed = sum(1 for node in facts.placed if node != me)
    all_others_ready = others_ready >= others_placed
    if held is None:
        return Act.OPEN if facts.placed_here else Act.NOTHING
    if held.hold is Hold.LEARNING:
        if not facts.placed_here:
            return Act.DROP if facts.view_settled else Act.NOTHING  # nobody counted on a learner
        return Act.JOIN if facts.caught_up or skip_caught_up else Act.NOTHING
    if held.hold is Hold.SERVING:
        if facts.placed_here or not all_others_ready or not facts.placed:
            return Act.NOTHING
        return Act.LEAVE
    # RETIRING: out of the group, data kept
    if facts.placed_here or not all_others_ready or not facts.placed:
        return Act.JOIN
    settled = facts.view_settled and now_ms - held.since_ms >= settle_ms
    return Act.DROP if settled else Act.NOTHING


def after(held: ShardHold | None, act: Act, now_ms: int) -> ShardHold | None:
    """The hold once `act` was done (the node calls it after doing it)."""
    if act is Act.NOTHING:
        return held
    if act is Act.OPEN:
        assert held is None, held
        return ShardHold(Hold.LEARNING, now_ms)
    assert held is not None, f"{act} on a shard not held"
    if act is Act.JOIN:
        assert held.hold is not Hold.SERVING, held
        return ShardHold(Hold.SERVING, now_ms)
    if act is Act.LEAVE:
        assert held.hold is Hold.SERVING, held
        return ShardHold(Hold.RETIRING, now_ms)
    assert act is Act.DROP and held.hold in (Hold.LEARNING, Hold.RETIRING), (act, held)
    return None
