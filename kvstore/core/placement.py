"""Which nodes a shard's replicas belong on (P1; docs/design.md §9): the rule, pure.

**The rule.** Shard s is placed on the R candidates with the highest rendezvous weight
`weight(s, node)` (highest random weight hashing, Thaler and Ravishankar 1998: a hash of the
shard and the node's id, nothing else) among those not yet holding their share of replicas
(`place`: bounded loads, so that every node holds about R·S/N shards), spread over zones. A node
joining or leaving moves little more than the replicas it takes or gives up (a join takes about
R·S/N replicas, one from each shard it enters). `Overrides` are the operator's word on top
(`kvstore drain`, `kvstore move`): a drained node is no candidate, a pinned node comes first in
its shard's list. R is capped by the number of candidates.

Who the members are, the drains and the pins come from the placement log
(kvstore.core.placement_log), where one controller recorded them; every reader computes the same
targets from them with this rule. What happens to the copies (learners, promotions, retirements,
drops) is the controller's (kvstore.core.placement_controller) and the nodes' following
(kvstore.core.placement_follower).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

DEFAULT_REPLICATION_FACTOR = 3
DEFAULT_GRACE_MS = 30_000
MAX_PINNED = 64  # nodes a pin may list


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
