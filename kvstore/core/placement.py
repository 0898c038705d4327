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
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

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

# How the overrides are kept in the WAL's control topic (wal.control): one entry per drained node
# and per pinned shard, so that two operators changing different ones never overwrite each other.
DRAIN_PREFIX = "placement/drain/"
PIN_PREFIX = "placement/pin/"
MAX_PINNED = 64  # nodes a pin may list


def drain_entry(node: str, *, undo: bool = False) -> tuple[str, bytes | None]:
    """The control entry that drains `node` (or, `undo`, stops draining it: a tombstone)."""
    assert node, "a node id"
    return f"{DRAIN_PREFIX}{node}", None if undo else b"1"


def pin_entry(shard: int, nodes: Sequence[str] | None) -> tuple[str, bytes | None]:
    """The control entry that pins `shard` to `nodes` (None: unpin, back to the rule)."""
    assert shard >= 0, shard
    if nodes is None:
        return f"{PIN_PREFIX}{shard}", None
    assert 0 < len(nodes) <= MAX_PINNED and all(nodes), nodes
    return f"{PIN_PREFIX}{shard}", json.dumps(list(nodes)).encode()


def overrides_from(entries: Mapping[str, bytes], shard_count: int) -> tuple[Overrides, list[str]]:
    """The overrides the control entries say, and the keys of the entries that could not be used
    (named so that an operator can fix them; any byte in the topic may be hostile). Entries that
    are not about placement are not looked at."""
    drained: set[str] = set()
    pinned: dict[int, tuple[str, ...]] = {}
    unusable: list[str] = []
    for key, value in sorted(entries.items()):
        if key.startswith(DRAIN_PREFIX):
            node = key[len(DRAIN_PREFIX):]
            if node and value == b"1":
                drained.add(node)
            else:
                unusable.append(key)
        elif key.startswith(PIN_PREFIX):
            nodes = _pinned_nodes(key[len(PIN_PREFIX):], value, shard_count)
            if nodes is None:
                unusable.append(key)
            else:
                pinned[int(key[len(PIN_PREFIX):])] = nodes
    return Overrides(frozenset(drained), pinned), unusable


def _pinned_nodes(shard: str, value: bytes, shard_count: int) -> tuple[str, ...] | None:
    if not shard.isdigit() or int(shard) >= shard_count:
        return None
    try:
        nodes = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(nodes, list) or not 0 < len(nodes) <= MAX_PINNED:
        return None
    if not all(isinstance(node, str) and node for node in nodes):
        return None
    return tuple(nodes)


class MoveRefused(ValueError):
    """A move that cannot be done as asked; the message says why."""


def move(placement: Sequence[Sequence[str]], members: Iterable[str], overrides: Overrides, shard: int, to: str,
         source: str = "") -> tuple[str, ...]:
    """The pin that moves one replica of `shard` to node `to`: its current replicas with `source`
    (default: the last of them) replaced by `to`. Raises MoveRefused (unknown shard or node, a
    drained target, `to` already holds it, `source` does not)."""
    live = set(members)
    if not 0 <= shard < len(placement):
        raise MoveRefused(f"shard {shard} does not exist: the cluster has {len(placement)} shards")
    current = list(placement[shard])
    if to not in live:
        raise MoveRefused(f"node {to!r} is not a member of the cluster (members: {', '.join(sorted(live))})")
    if to in overrides.drained:
        raise MoveRefused(f"node {to!r} is being drained: `kvstore drain {to} --undo` first")
    if to in current:
        raise MoveRefused(f"node {to!r} already holds shard {shard} (on {', '.join(current)})")
    if source and source not in current:
        raise MoveRefused(f"node {source!r} does not hold shard {shard} (on {', '.join(current) or 'nobody'})")
    if not current:
        return (to,)
    giver = source or current[-1]
    return tuple(to if node == giver else node for node in current)


def changes(before: Sequence[Sequence[str]], after_: Sequence[Sequence[str]]) -> list[tuple[int, tuple[str, ...],
                                                                                             tuple[str, ...]]]:
    """(shard, replicas before, replicas after) for every shard whose replica set changes."""
    return [(shard, tuple(old), tuple(new)) for shard, (old, new) in enumerate(zip(before, after_, strict=True))
            if set(old) != set(new)]


def place(shard_count: int, members: Iterable[str], replication_factor: int,
          overrides: Overrides = NO_OVERRIDES, zones: Mapping[str, str] | None = None) -> tuple[tuple[str, ...], ...]:
    """Every shard's replicas (index = shard), best first.

    Rendezvous hashing with bounded loads: shards are placed in order, each on its pinned
    candidates first, then on the highest-weight candidates that hold fewer than
    `ceil(R * S / candidates)` replicas so far (if fewer than R such remain, on the
    highest-weight ones regardless, and a last pass moves replicas from nodes above the bound to
    the least loaded: `_even_out`). Plain rendezvous hashing moves the fewest replicas but is
    lopsided with few shards (10 shards, R = 2, 5 nodes: 6 on one node, 2 on another); the bound
    holds every node to its share rounded up, at the cost of a few more moves than the minimum
    (over 300 random clusters, tests/unit/test_placement.py: 19 % more on a join, 11 % on a leave).

    R = min(`replication_factor`, candidates). Candidates are the members not drained; if every
    member is drained, all of them (a shard is never placed nowhere while any member lives). No
    members: nowhere.

    Zones (`zones`: node -> zone, "" or absent: a zone of its own): each shard's replicas are
    spread over as many zones as the candidates allow (Helix's fault zones, CockroachDB's
    locality): at every pick, an unused zone's node first, in the order above."""
    assert replication_factor >= 1, f"replication factor must be at least 1: {replication_factor}"
    assert shard_count >= 0, shard_count
    everyone = frozenset(members)
    candidates = everyone - overrides.drained or everyone
    count = min(replication_factor, len(candidates))
    if count == 0:
        return tuple(() for _ in range(shard_count))
    cap = math.ceil(count * shard_count / len(candidates))
    zone_of = _zone_function(zones)
    load = dict.fromkeys(candidates, 0)
    placement: list[list[str]] = []
    for shard in range(shard_count):
        chosen: list[str] = []
        for node in overrides.pinned.get(shard, ()):
            if node in candidates and node not in chosen and len(chosen) < count:
                chosen.append(node)
        order = [node for node in ranked(shard, candidates) if node not in chosen]
        _pick(chosen, [node for node in order if load[node] < cap], count, zone_of)
        _pick(chosen, order, count, zone_of)
        assert len(chosen) == count and len(set(chosen)) == count, chosen
        for node in chosen:
            load[node] += 1
        placement.append(chosen)
    _even_out(placement, load, cap, overrides, zone_of)
    return tuple(tuple(chosen) for chosen in placement)


def _zone_function(zones: Mapping[str, str] | None) -> Callable[[str], str]:
    """A node's zone; a node without one is a zone of its own (a name no zone can have)."""
    known = dict(zones or {})
    return lambda node: known.get(node) or f"\0{node}"


def _pick(chosen: list[str], order: Sequence[str], count: int, zone_of: Callable[[str], str]) -> None:
    """Fill `chosen` up to `count` from `order`: nodes of zones not used yet first, then the rest."""
    for spread in (True, False):
        for node in order:
            if len(chosen) >= count:
                return
            if node in chosen or (spread and zone_of(node) in {zone_of(n) for n in chosen}):
                continue
            chosen.append(node)


def _even_out(placement: list[list[str]], load: dict[str, int], cap: int, overrides: Overrides,
              zone_of: Callable[[str], str]) -> None:
    """The greedy pass can end over the bound: the last shards find fewer than R nodes below it
    that do not hold them yet. Move replicas from nodes over the bound to the least loaded ones,
    each time the unpinned shard the receiver weighs highest, until none is over (or nothing can
    move: only pins hold it there)."""
    while True:
        over = sorted((node for node in load if load[node] > cap), key=lambda n: (-load[n], n))
        if not over:
            return
        giver = over[0]
        taker = min(load, key=lambda n: (load[n], n))
        movable = [shard for shard, chosen in enumerate(placement)
                   if giver in chosen and taker not in chosen and giver not in overrides.pinned.get(shard, ())
                   and _spread(chosen, giver, taker, zone_of) >= _spread(chosen, giver, giver, zone_of)]
        if load[taker] >= cap or not movable:
            return
        shard = max(movable, key=lambda s: (weight(s, taker), -s))
        placement[shard][placement[shard].index(giver)] = taker
        load[giver] -= 1
        load[taker] += 1


def _spread(chosen: Sequence[str], giver: str, taker: str, zone_of: Callable[[str], str]) -> int:
    """How many zones `chosen` spans once `taker` replaced `giver` (a move must not narrow it)."""
    return len({zone_of(taker if node == giver else node) for node in chosen})


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
