"""The placement controller's decisions (P1, P2, P4; docs/design.md §9): pure, events in, records out.

One node at a time is the controller (elected through a consumer group, fenced through the guard
like a shard's leader: kvstore.server.controller). Its shell feeds this machine what it observes:
the membership group's listings (`members_listed`; a failed listing is no event), every node's
report of its copies (`report`), operators' requests (`request`), and asks for the next records
(`plan`), which it appends to the placement log. The machine reads the placement only from the
folded log (`PlacementState`), so a new controller continues exactly where the last one stopped.

The rules, each where it is kept:

* **Members, with a grace period.** A node is a member from its first report (`NodeJoined`, with
  its zone) and stops being one only when the listings have not named it for `grace_ms`,
  measured up to the last listing that succeeded (`NodeGone`): a controller that cannot list
  the group declares nobody dead, and one new in office counts every member as seen when it took
  office. A node back within the grace period moves nothing.
* **Copies move in steps** (`_shard_steps`): a node the target names gets a learner (at most
  `max_learners_per_node` learners per node at once); a learner the node reports caught up is
  promoted; a replica no longer targeted retires (leaves the leadership group), a retired copy
  is dropped. **P2:** a retire or a drop is recorded only while the shard keeps at least
  min(R, candidates) *ready* copies besides it: replicas that their node reports caught up
  (reached the end, lag within `CAUGHT_UP_LAG`, able to lead) and in the leadership group, in a
  report younger than `REPORT_MAX_AGE_MS`. A learner nobody counted on is dropped at once.
* **Operators** (`request`, P4): a request names the epoch it was computed from and is refused
  if the placement's epoch moved since ("placement changed; retry"), never merged. A drain that
  leaves fewer than R nodes able to hold copies, counting those already drained or not listed
  now, is refused naming the shards, unless forced.

Mutations (the simulation must catch each; tests only): `drop-before-caught-up` counts every
replica and learner as ready, `drain-below-r` skips the floor, `merge-stale-request` skips the
epoch check.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from kvstore.core import placement
from kvstore.core.placement_log import CopyState, PlacementState, Settings, Step, node_id_problem, zone_problem
from kvstore.internal.v1 import placement_pb2

CAUGHT_UP_LAG = 1_000  # WAL records a copy may be behind its partition's end and still count as caught up
REPORT_MAX_AGE_MS = 3_000  # an older report of a node tells nothing about its copies
# A retire, a drop or a drain's floor rests only on reports this young (rounds are 0.2 s): a copy
# reported ready a while ago may have died since, and the decision lands later still.
READY_REPORT_MAX_AGE_MS = 1_000
STARTUP_QUIET_MS = 1_000  # a new cluster's members unchanged this long (two listings) before the first placement
MAX_RECORDS_PER_ROUND = 256
DEFAULT_MAX_LEARNERS_PER_NODE = 2

DROP_BEFORE_CAUGHT_UP = "drop-before-caught-up"
DRAIN_BELOW_R = "drain-below-r"
MERGE_STALE_REQUEST = "merge-stale-request"
MUTATIONS = frozenset({DROP_BEFORE_CAUGHT_UP, DRAIN_BELOW_R, MERGE_STALE_REQUEST})


def is_caught_up(reached_end: bool, lag: int, unable: bool) -> bool:
    """P2's "caught up", as a node judges its own copy for its report: it reached its
    partition's end at least once, is within `CAUGHT_UP_LAG` records of it now, and nothing keeps
    it from leading (a rebuild after a failed apply)."""
    return reached_end and 0 <= lag <= CAUGHT_UP_LAG and not unable


@dataclasses.dataclass(frozen=True)
class CopyReport:
    """A node's word on its copy of one shard."""

    in_group: bool  # in the shard's leadership group now
    caught_up: bool  # `is_caught_up`, judged by the node


@dataclasses.dataclass(frozen=True)
class NodeReport:
    node: str
    zone: str
    copies: Mapping[int, CopyReport]
    at_ms: int  # the controller's clock when it got it


@dataclasses.dataclass(frozen=True)
class Drain:
    node: str
    epoch: int
    undo: bool = False
    force: bool = False


@dataclasses.dataclass(frozen=True)
class Move:
    shard: int
    epoch: int
    to: str = ""
    source: str = ""
    unpin: bool = False


Request = Drain | Move


class RequestRefused(ValueError):
    """An operator's request that is not recorded; the message says why. `stale`: computed from
    an older placement (retry with the new one); `below_r`: a drain the floor forbids (--force)."""

    def __init__(self, message: str, *, stale: bool = False, below_r: bool = False, retry: bool = False) -> None:
        super().__init__(message)
        self.stale = stale
        self.below_r = below_r
        self.retry = retry  # the controller cannot judge it now (its reports are old): ask again


def shard_ranges(shards: Iterable[int]) -> str:
    """`0-3, 7, 9-10`: shard numbers for a message."""
    ordered = sorted(set(shards))
    parts: list[str] = []
    start = prev = None
    for shard in [*ordered, None]:
        if shard is not None and prev is not None and shard == prev + 1:
            prev = shard
            continue
        if start is not None:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = shard
    return ", ".join(parts)


class PlacementController:
    def __init__(self, me: str, address: str, term: int, settings: Settings, now_ms: int, *,
                 mutations: frozenset[str] = frozenset(), previous: PlacementController | None = None) -> None:
        """`previous`: this node's own machine of an earlier term (the office given up after a
        failed append and taken again): what it observed stays true, so the grace periods and the
        reports carry over instead of starting again (each new start would postpone every death)."""
        assert settings.problem() is None, settings.problem()
        assert mutations <= MUTATIONS, mutations - MUTATIONS
        self.me = me
        self.address = address
        self.term = term
        self.settings = settings  # this node's own: written as the log's first record if it has none
        self.started_ms = now_ms
        self.mutations = mutations
        self._listed: frozenset[str] = frozenset()
        self._listing_ms: int | None = None  # when the last listing that succeeded was taken
        self._listed_since_ms = now_ms  # when the listing last changed
        self._last_seen_ms: dict[str, int] = {}
        self._reports: dict[str, NodeReport] = {}
        if previous is not None and previous.me == me:
            self.started_ms = previous.started_ms
            self._listed, self._listing_ms = previous._listed, previous._listing_ms
            self._listed_since_ms = previous._listed_since_ms
            self._last_seen_ms = dict(previous._last_seen_ms)
            self._reports = dict(previous._reports)

    # ---- events ----------------------------------------------------------------------------

    def members_listed(self, listed: Iterable[str], now_ms: int) -> None:
        """The membership group listed `listed` at `now_ms` (a failed listing is no event)."""
        names = frozenset(listed)
        if names != self._listed:
            self._listed_since_ms = now_ms
        self._listed = names
        self._listing_ms = now_ms
        for node in names:
            self._last_seen_ms[node] = now_ms

    def report(self, report: NodeReport) -> None:
        self._reports[report.node] = report

    # ---- what it knows ---------------------------------------------------------------------

    def fresh_report(self, node: str, now_ms: int, max_age_ms: int = REPORT_MAX_AGE_MS) -> NodeReport | None:
        report = self._reports.get(node)
        if report is None or now_ms - report.at_ms > max_age_ms:
            return None
        return report

    def listed(self) -> frozenset[str]:
        return self._listed

    def away_ms(self, state: PlacementState) -> dict[str, int]:
        """Members not listed now -> how long they have been away, up to the last listing."""
        if self._listing_ms is None:
            return {}
        return {node: self._listing_ms - self._last_seen_ms.get(node, self.started_ms)
                for node in sorted(state.nodes) if node not in self._listed}

    def ready(self, state: PlacementState, shard: int, now_ms: int,
              max_age_ms: int = READY_REPORT_MAX_AGE_MS) -> frozenset[str]:
        """The shard's copies that count for P2: replicas reported caught up and in the group, in
        a report younger than `max_age_ms`."""
        ready = set()
        for node, held in state.copies_of(shard).items():
            if DROP_BEFORE_CAUGHT_UP in self.mutations and held is not CopyState.RETIRING:
                ready.add(node)
                continue
            report = self.fresh_report(node, now_ms, max_age_ms)
            copy_ = report.copies.get(shard) if report is not None else None
            if held is CopyState.REPLICA and copy_ is not None and copy_.caught_up and copy_.in_group:
                ready.add(node)
        return frozenset(ready)

    def needed(self, state: PlacementState) -> int:
        """Ready copies a shard keeps through any retire or drop: min(R, candidates)."""
        assert state.settings is not None
        return min(state.settings.replication_factor, len(state.candidates))

    # ---- decisions -------------------------------------------------------------------------

    def plan(self, state: PlacementState, now_ms: int) -> list[placement_pb2.PlacementRecord]:
        """The next records to append (none: nothing to do now). The caller appends them, reads
        them back into `state` and only then asks again: one round's records never rest on
        another round's that were not applied yet."""
        if state.settings is None:
            return self._first_records(now_ms)
        started = self._controller_started(state, now_ms)
        if started:
            return started
        members = self._member_records(state, now_ms)
        if members:
            return members
        records: list[placement_pb2.PlacementRecord] = []
        learners = _learners_per_node(state)  # counted over the whole round: the bound is per node
        for shard in range(state.settings.shard_count):
            records += self._shard_steps(state, shard, now_ms, learners)
            if len(records) >= MAX_RECORDS_PER_ROUND:
                break
        return records[:MAX_RECORDS_PER_ROUND]

    def _controller_started(self, state: PlacementState, now_ms: int) -> list[placement_pb2.PlacementRecord]:
        """ControllerStarted, unless the log names this controller in this term already: every
        record after it, a plan's or an operator's request's, is this controller's (P1)."""
        started = state.controller
        if started is not None and (started.node_id, started.term) == (self.me, self.term):
            return []
        return [placement_pb2.PlacementRecord(
            reason="took over as controller", at_ms=now_ms,
            controller_started=placement_pb2.ControllerStarted(node_id=self.me, address=self.address, term=self.term))]

    def _first_records(self, now_ms: int) -> list[placement_pb2.PlacementRecord]:
        """A new cluster: once its listing stayed the same for a while and every member listed
        reported, the settings, the controller and the members in one append."""
        quiet_ms = min(STARTUP_QUIET_MS, self.settings.grace_ms)
        if self._listing_ms is None or not self._listed or now_ms - self._listed_since_ms < quiet_ms:
            return []
        reports = {node: self.fresh_report(node, now_ms) for node in sorted(self._listed)}
        if any(report is None for report in reports.values()):
            return []
        records = [
            placement_pb2.PlacementRecord(reason="a new cluster", at_ms=now_ms, settings=self.settings.to_proto()),
            placement_pb2.PlacementRecord(
                reason="took over as controller", at_ms=now_ms,
                controller_started=placement_pb2.ControllerStarted(node_id=self.me, address=self.address,
                                                                    term=self.term))]
        for node, report in reports.items():
            assert report is not None
            if node_id_problem(node) is not None or zone_problem(report.zone) is not None:
                continue
            records.append(placement_pb2.PlacementRecord(
                reason="a member of the new cluster", at_ms=now_ms,
                node_joined=placement_pb2.NodeJoined(node_id=node, zone=report.zone)))
        return records

    def _member_records(self, state: PlacementState, now_ms: int) -> list[placement_pb2.PlacementRecord]:
        assert state.settings is not None
        records = []
        for node in sorted(self._listed):
            report = self.fresh_report(node, now_ms)
            if report is None or node_id_problem(node) is not None or zone_problem(report.zone) is not None:
                continue  # a record the fold would skip is never written (it would be written again each round)
            if state.nodes.get(node) != report.zone:
                why = "joined the membership group" if node not in state.nodes else "its zone changed"
                records.append(placement_pb2.PlacementRecord(
                    reason=why, at_ms=now_ms, node_joined=placement_pb2.NodeJoined(node_id=node, zone=report.zone)))
        for node, away in self.away_ms(state).items():
            if away > state.settings.grace_ms:
                records.append(placement_pb2.PlacementRecord(
                    reason=f"not in the membership group for {away} ms (grace {state.settings.grace_ms} ms)",
                    at_ms=now_ms, node_gone=placement_pb2.NodeGone(node_id=node)))
        return records

    def _shard_steps(self, state: PlacementState, shard: int, now_ms: int,
                     learners: dict[str, int]) -> list[placement_pb2.PlacementRecord]:
        assert state.settings is not None
        target = state.targets()[shard]
        copies = state.copies_of(shard)
        ready = set(self.ready(state, shard, now_ms))
        needed = self.needed(state)
        records = []

        def add(node: str, kind: placement_pb2.CopyStepKind, reason: str) -> None:
            records.append(placement_pb2.PlacementRecord(
                reason=reason, at_ms=now_ms, step=placement_pb2.CopyStep(shard=shard, node_id=node, kind=kind)))

        for node in target:
            held = copies.get(node)
            report = self.fresh_report(node, now_ms)
            if held is None:
                if report is not None and learners.get(node, 0) < state.settings.max_learners_per_node:
                    learners[node] = learners.get(node, 0) + 1
                    add(node, Step.COPY_STEP_KIND_ADD_LEARNER, "placed there by the rule"
                        + (" (reusing the copy on its disk)" if shard in report.copies else ""))
            elif held is CopyState.RETIRING:
                add(node, Step.COPY_STEP_KIND_REJOIN, "placed there again")
            elif held is CopyState.LEARNER:
                reported = report.copies.get(shard) if report is not None else None
                if reported is not None and reported.caught_up:
                    add(node, Step.COPY_STEP_KIND_PROMOTE, "the learner caught up")
        for node, held in sorted(copies.items()):
            if node in target:
                continue
            report = self.fresh_report(node, now_ms)
            reported = report.copies.get(shard) if report is not None else None
            if held is CopyState.LEARNER:
                add(node, Step.COPY_STEP_KIND_DROP, "a learner no longer placed there")
            elif held is CopyState.REPLICA:
                if len(ready - {node}) >= needed:
                    ready.discard(node)
                    add(node, Step.COPY_STEP_KIND_RETIRE,
                        f"no longer placed there; {len(ready)} ready copies remain (needed {needed})")
            elif len(ready) < needed:
                # Below the floor (a kept replica died or is rebuilding): a retired copy that is
                # still caught up serves again until the target's copies are ready. Judged on the
                # looser window of REPORT_MAX_AGE_MS, so that one late report does not make it flap.
                if len(self.ready(state, shard, now_ms, REPORT_MAX_AGE_MS)) < needed and reported is not None \
                        and reported.caught_up:
                    add(node, Step.COPY_STEP_KIND_REJOIN, f"the shard has {len(ready)} ready copies, needs {needed}")
            elif not (reported is not None and reported.in_group):
                add(node, Step.COPY_STEP_KIND_DROP, f"retired; {len(ready)} ready copies remain (needed {needed})")
        for node in sorted(self._listed):  # copies the log does not list: left by an unfinished drop
            report = self.fresh_report(node, now_ms)
            if (report is None or shard not in report.copies or node in copies or node in target
                    or (shard, node) in state.dropped):
                continue
            if len(ready) >= needed:
                add(node, Step.COPY_STEP_KIND_DROP, f"a copy the log does not give {node}")
        return records

    # ---- operators -------------------------------------------------------------------------

    def request(self, state: PlacementState, request: Request, now_ms: int) -> list[placement_pb2.PlacementRecord]:
        """The records that carry out an operator's request, or RequestRefused. No records: it
        is done already (a drain of a drained node), nothing to append. A controller new in
        office whose ControllerStarted is not in the log yet records it first (as `plan` would)."""
        settings = state.settings
        if settings is None:
            raise RequestRefused("the cluster has no placement yet (its controller is starting): retry")
        if request.epoch != state.epoch and MERGE_STALE_REQUEST not in self.mutations:
            raise RequestRefused(f"placement changed: it is at epoch {state.epoch}, the request was computed at "
                                 f"epoch {request.epoch}; look again and retry", stale=True)
        if isinstance(request, Drain):
            records = self._drain(state, request, now_ms)
        else:
            records = self._move(state, request, now_ms)
        return [*self._controller_started(state, now_ms), *records] if records else []

    def _drain(self, state: PlacementState, request: Drain, now_ms: int) -> list[placement_pb2.PlacementRecord]:
        assert state.settings is not None
        node = request.node
        if request.undo:
            if node not in state.drained:
                return []
            after = (frozenset(state.nodes) - (state.drained - {node})) or frozenset(state.nodes)
            r = state.settings.replication_factor
            if len(after) < min(r, len(state.candidates)) and not request.force:
                # Every member was drained (the rule then used them all): undoing one drain would
                # put every shard on that one node and drop the other copies.
                raise RequestRefused(f"undoing the drain of {node} leaves {len(after)} node(s) to hold copies where "
                                     f"{len(state.candidates)} hold them now (every member is drained): every shard "
                                     "would keep fewer replicas; undo the other drains too, or use --force",
                                     below_r=True)
            return [placement_pb2.PlacementRecord(reason="an operator undid the drain", at_ms=now_ms,
                                                  drain=placement_pb2.DrainNode(node_id=node, undo=True))]
        if node not in state.nodes:
            raise RequestRefused(f"node {node!r} is not a member of the cluster (members: "
                                 f"{', '.join(sorted(state.nodes)) or 'none'})")
        if node in state.drained:
            return []
        # Nodes able to hold copies now: candidates that reported lately (a node SIGKILLed a moment
        # ago may still be listed; a listing can be old when describing fails).
        able = {n for n in state.candidates if self.fresh_report(n, now_ms)} - {node}
        r = settings_r = state.settings.replication_factor
        newest_ms = max((report.at_ms for report in self._reports.values()), default=None)
        if len(able) < r and not request.force and (newest_ms is None or now_ms - newest_ms > REPORT_MAX_AGE_MS):
            # Every report is old: the controller's own rounds are slow, not the nodes away.
            raise RequestRefused("the placement controller's reports are a moment old (its rounds are slow): it "
                                 "cannot judge the drain's floor now; retry", retry=True)
        if len(able) < r and DRAIN_BELOW_R not in self.mutations and not request.force:
            below = [shard for shard, target in enumerate(state.targets()) if node in target or len(target) < r]
            raise RequestRefused(
                f"draining {node} leaves {len(able)} node(s) able to hold copies ({', '.join(sorted(able)) or 'none'}; "
                f"drained or away nodes do not count) for R = {settings_r}: shards {shard_ranges(below)} would keep "
                f"fewer than R replicas; add nodes first, or use --force", below_r=True)
        return [placement_pb2.PlacementRecord(
            reason="an operator drained it" + (" (forced below R)" if len(able) < r else ""), at_ms=now_ms,
            drain=placement_pb2.DrainNode(node_id=node, forced=len(able) < r))]

    def _move(self, state: PlacementState, request: Move, now_ms: int) -> list[placement_pb2.PlacementRecord]:
        assert state.settings is not None
        if not 0 <= request.shard < state.settings.shard_count:
            raise RequestRefused(f"shard {request.shard} does not exist: the cluster has "
                                 f"{state.settings.shard_count} shards")
        if request.unpin:
            if request.shard not in state.pins:
                return []
            return [placement_pb2.PlacementRecord(reason="an operator unpinned it", at_ms=now_ms,
                                                  pin=placement_pb2.PinShard(shard=request.shard))]
        if request.to not in self._listed:
            raise RequestRefused(f"node {request.to!r} is not in the membership group now (listed: "
                                 f"{', '.join(sorted(self._listed)) or 'nobody'})")
        overrides = placement.Overrides(frozenset(state.drained), dict(state.pins))
        try:
            nodes = placement.move(state.targets(), state.nodes, overrides, request.shard, request.to, request.source)
        except placement.MoveRefused as exc:
            raise RequestRefused(str(exc)) from exc
        return [placement_pb2.PlacementRecord(
            reason=f"an operator moved a replica to {request.to}", at_ms=now_ms,
            pin=placement_pb2.PinShard(shard=request.shard, nodes=nodes))]


def _learners_per_node(state: PlacementState) -> dict[str, int]:
    counts: dict[str, int] = {}
    for copies in state.copies.values():
        for node, held in copies.items():
            if held is CopyState.LEARNER:
                counts[node] = counts.get(node, 0) + 1
    return counts


def preview(state: PlacementState, records: Sequence[placement_pb2.PlacementRecord]) -> PlacementState:
    """`state` as it would be once `records` are applied (an operator's answer: what changes)."""
    after = copy.deepcopy(state)
    for record in records:
        after.apply(after.position, record.SerializeToString())
    return after
