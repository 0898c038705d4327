"""The placement log's one apply (P1; docs/design.md §9): every node, the audit and the simulation
fold the log's records into a `PlacementState` with `PlacementState.apply`, and act on nothing
else.

What the log holds (kvstore/internal/v1/placement.proto): the cluster's settings (first record),
who counts as a member (`NodeJoined`, `NodeGone`: the controller's liveness decisions, made once,
so that no two nodes count members differently), the operators' drains and pins, and every step
of every copy (learner added, promoted, retired, rejoined, dropped). The *target* of each shard
(the nodes the rule puts it on) is a function of the members, the drains, the pins, the zones and
the settings, so it too is the same on every reader; it changes only with the **epoch**, which
counts the records that change a target (settings, members, drains, pins). An operator's request
names the epoch it was computed from (P4).

Any byte of the log may be hostile (a producer outside the store, a bug of an older release):
`apply` never raises on a record. A record that does not decode, or that breaks a rule below (a
step that is no valid transition, a shard that does not exist, a name beyond the bounds, anything
before the settings), is skipped and counted with its reason, and every reader skips the same
records, since the rules read nothing but the log.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Mapping

from kvstore.core import placement
from kvstore.internal.v1 import placement_pb2

# Bounds of what the log may say (a record beyond them is skipped, never half taken).
MAX_RECORD_BYTES = 64 * 1024
MAX_NODES = 1_024
MAX_NODE_ID_BYTES = 200
MAX_ZONE_BYTES = 64
MAX_SHARDS = 1_024
MAX_REPLICATION_FACTOR = 64
MAX_LEARNERS_PER_NODE = 64
MAX_GRACE_MS = 3_600_000
MAX_REASON_CHARS = 500
MAX_TERM = 2**62  # a controller's term; a record at or above it is hostile (term + 1 must still fit)
RECENT_RECORDS = 1_000  # the decisions `kvstore placement log` can list


class CopyState(enum.Enum):
    """What the log says of one node's copy of one shard."""

    LEARNER = "learner"  # loading; counts for nothing, never leads
    REPLICA = "replica"  # may lead once caught up (it then joins the shard's leadership group)
    RETIRING = "retiring"  # out of the leadership group, data kept until dropped


Step = placement_pb2.CopyStepKind
# Valid transitions of a copy: the state before (None: no copy) -> the state after (None: dropped).
_STEPS: Mapping[int, tuple[frozenset[CopyState | None], CopyState | None]] = {
    Step.COPY_STEP_KIND_ADD_LEARNER: (frozenset({None}), CopyState.LEARNER),
    Step.COPY_STEP_KIND_PROMOTE: (frozenset({CopyState.LEARNER}), CopyState.REPLICA),
    Step.COPY_STEP_KIND_RETIRE: (frozenset({CopyState.REPLICA}), CopyState.RETIRING),
    Step.COPY_STEP_KIND_REJOIN: (frozenset({CopyState.RETIRING}), CopyState.REPLICA),
    # A drop of a copy the log does not list is valid: a stray copy on a node's disk (a drop the
    # node did not finish before it crashed, a log lost and started again) is dropped by name.
    Step.COPY_STEP_KIND_DROP: (frozenset({None, *CopyState}), None),
}
STEP_NAMES: dict[int, str] = {Step.COPY_STEP_KIND_ADD_LEARNER: "add-learner", Step.COPY_STEP_KIND_PROMOTE: "promote",
              Step.COPY_STEP_KIND_RETIRE: "retire", Step.COPY_STEP_KIND_REJOIN: "rejoin",
              Step.COPY_STEP_KIND_DROP: "drop"}


@dataclasses.dataclass(frozen=True)
class Settings:
    shard_count: int
    replication_factor: int
    grace_ms: int
    max_learners_per_node: int

    def problem(self) -> str | None:
        """Why these settings cannot be a cluster's (None: they can)."""
        if not 1 <= self.shard_count <= MAX_SHARDS:
            return f"shard count {self.shard_count} outside 1..{MAX_SHARDS}"
        if not 1 <= self.replication_factor <= MAX_REPLICATION_FACTOR:
            return f"replication factor {self.replication_factor} outside 1..{MAX_REPLICATION_FACTOR}"
        if not 0 <= self.grace_ms <= MAX_GRACE_MS:
            return f"grace period {self.grace_ms} ms outside 0..{MAX_GRACE_MS}"
        if not 1 <= self.max_learners_per_node <= MAX_LEARNERS_PER_NODE:
            return f"learners per node {self.max_learners_per_node} outside 1..{MAX_LEARNERS_PER_NODE}"
        return None

    def to_proto(self) -> placement_pb2.PlacementSettings:
        return placement_pb2.PlacementSettings(
            shard_count=self.shard_count, replication_factor=self.replication_factor, grace_ms=self.grace_ms,
            max_learners_per_node=self.max_learners_per_node)


@dataclasses.dataclass(frozen=True)
class Controller:
    node_id: str
    address: str
    term: int


@dataclasses.dataclass(frozen=True)
class Entry:
    """One applied record, as `kvstore placement log` lists it."""

    offset: int
    epoch: int
    kind: str
    summary: str
    reason: str
    at_ms: int


def node_id_problem(node: str) -> str | None:
    if not node:
        return "an empty node id"
    if len(node.encode()) > MAX_NODE_ID_BYTES:
        return f"a node id over {MAX_NODE_ID_BYTES} bytes"
    if not node.isprintable():
        return f"a node id with unprintable characters: {_show(node)}"
    return None


class Skipped(Exception):
    """A record no reader takes (internal to `apply`): a fixed `category` (what `skipped` counts:
    a hostile writer cannot grow the counters) and a bounded detail."""

    def __init__(self, category: str, detail: str = "") -> None:
        super().__init__(f"{category}: {detail}" if detail else category)
        self.category = category


def _show(text: str) -> str:
    """A name from the log for a message: bounded, whatever a hostile writer put there."""
    return repr(text[:40] + ("..." if len(text) > 40 else ""))


def zone_problem(zone: str) -> str | None:
    """Why `zone` cannot be a node's zone (None: it can): the fold's rule, and `--zone`'s."""
    if len(zone.encode()) > MAX_ZONE_BYTES:
        return f"a zone over {MAX_ZONE_BYTES} bytes"
    if zone and not zone.isprintable():
        return "a zone with unprintable characters"
    return None


class PlacementState:
    """The placement as the log says it up to `position` (the next offset to read)."""

    def __init__(self) -> None:
        self.settings: Settings | None = None
        self.epoch = 0  # target-changing records applied so far
        self.controller: Controller | None = None
        self.nodes: dict[str, str] = {}  # members -> zone ("" for none)
        self.drained: set[str] = set()
        self.forced_drains: set[str] = set()  # drained with --force (a shard may have fewer than R candidates)
        self.pins: dict[int, tuple[str, ...]] = {}
        self.copies: dict[int, dict[str, CopyState]] = {}
        self.dropped: set[tuple[int, str]] = set()  # (shard, node) whose last step was a drop
        self.position = 0
        self.applied = 0
        self.skipped: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[Entry] = collections.deque(maxlen=RECENT_RECORDS)
        self._targets: tuple[tuple[str, ...], ...] | None = None

    # ---- the one apply ---------------------------------------------------------------------

    def apply(self, offset: int, payload: bytes) -> str | None:
        """Take the record at `offset`; None if taken, else why it was skipped (counted)."""
        assert offset >= self.position, f"records in order: {offset} after {self.position}"
        self.position = offset + 1
        try:
            if len(payload) > MAX_RECORD_BYTES:
                raise Skipped("too large", f"{len(payload)} bytes, over MAX_RECORD_BYTES ({MAX_RECORD_BYTES})")
            record = placement_pb2.PlacementRecord()
            try:
                record.ParseFromString(payload)
            except Exception as exc:  # DecodeError, too deep a nesting, anything odd: protobuf decides
                raise Skipped("undecodable", f"{type(exc).__name__}: {str(exc)[:100]}") from None
            summary = self._take(record)
        except Skipped as why:
            self.skipped[why.category] += 1
            return str(why)
        self.applied += 1
        self.recent.append(Entry(offset, self.epoch, record.WhichOneof("kind") or "", summary,
                                 record.reason[:MAX_REASON_CHARS], record.at_ms))
        return None

    def _take(self, record: placement_pb2.PlacementRecord) -> str:
        kind = record.WhichOneof("kind")
        if kind is None:
            raise Skipped("no known kind")
        if kind == "settings":
            return self._settings(record.settings)
        if self.settings is None:
            raise Skipped("before the settings", f"a {kind} record")
        if kind == "controller_started":
            started = record.controller_started
            _check_node(started.node_id)
            if started.term >= MAX_TERM or (self.controller is not None and started.term <= self.controller.term):
                raise Skipped("invalid controller", f"term {started.term} after term "
                                                    f"{self.controller.term if self.controller else 0}")
            address = started.address[:MAX_NODE_ID_BYTES]
            self.controller = Controller(started.node_id, address, started.term)
            return f"controller {started.node_id} (term {started.term}) at {address}"
        if kind == "node_joined":
            node, zone = record.node_joined.node_id, record.node_joined.zone
            _check_node(node)
            problem = zone_problem(zone)
            if problem is not None:
                raise Skipped("invalid zone", problem)
            if node not in self.nodes and len(self.nodes) >= MAX_NODES:
                raise Skipped("too many nodes", f"more than MAX_NODES ({MAX_NODES}) members")
            self.nodes[node] = zone
            self._changed()
            return f"{node} joined" + (f" (zone {zone})" if zone else "")
        if kind == "node_gone":
            node = record.node_gone.node_id
            _check_node(node)
            if self.nodes.pop(node, None) is None:
                raise Skipped("not a member", f"node {_show(node)} gone")
            self._changed()
            return f"{node} gone"
        if kind == "drain":
            drain = record.drain
            _check_node(drain.node_id)
            if drain.undo:
                self.drained.discard(drain.node_id)
                self.forced_drains.discard(drain.node_id)
            else:
                if drain.node_id not in self.drained and len(self.drained) >= MAX_NODES:
                    raise Skipped("too many nodes", f"more than MAX_NODES ({MAX_NODES}) drained")
                self.drained.add(drain.node_id)
                if drain.forced:
                    self.forced_drains.add(drain.node_id)
            self._changed()
            return f"{drain.node_id} {'undrained' if drain.undo else 'drained'}" + (" (forced)" if drain.forced else "")
        if kind == "pin":
            return self._pin(record.pin)
        assert kind == "step", kind
        return self._step(record.step)

    def _settings(self, proto: placement_pb2.PlacementSettings) -> str:
        settings = Settings(proto.shard_count, proto.replication_factor, proto.grace_ms, proto.max_learners_per_node)
        problem = settings.problem()
        if problem is not None:
            raise Skipped("invalid settings", problem)
        if self.settings is not None and self.settings.shard_count != settings.shard_count:
            raise Skipped("invalid settings", f"the shard count is fixed ({self.settings.shard_count}, "
                                              f"not {settings.shard_count})")
        self.settings = settings
        self._changed()
        return (f"settings: {settings.shard_count} shards, R = {settings.replication_factor}, "
                f"grace {settings.grace_ms} ms, {settings.max_learners_per_node} learners per node")

    def _pin(self, pin: placement_pb2.PinShard) -> str:
        assert self.settings is not None
        if pin.shard >= self.settings.shard_count:
            raise Skipped("invalid pin", f"shard {pin.shard} does not exist")
        nodes = tuple(pin.nodes)
        if len(nodes) > placement.MAX_PINNED or len(set(nodes)) != len(nodes):
            raise Skipped("invalid pin", f"shard {pin.shard} to more than {placement.MAX_PINNED} nodes or to one twice")
        for node in nodes:
            _check_node(node)
        if nodes:
            self.pins[pin.shard] = nodes
        else:
            self.pins.pop(pin.shard, None)
        self._changed()
        return f"shard {pin.shard} pinned to {', '.join(nodes)}" if nodes else f"shard {pin.shard} unpinned"

    def _step(self, step: placement_pb2.CopyStep) -> str:
        assert self.settings is not None
        if step.shard >= self.settings.shard_count:
            raise Skipped("invalid step", f"shard {step.shard} does not exist")
        _check_node(step.node_id)
        rule = _STEPS.get(step.kind)
        if rule is None:
            raise Skipped("invalid step", f"unknown kind {step.kind}")
        sources, result = rule
        now = self.copies.get(step.shard, {}).get(step.node_id)
        name = STEP_NAMES[step.kind]
        if now not in sources:
            raise Skipped("invalid step", f"{name} of shard {step.shard} on {_show(step.node_id)}, "
                                          f"a {now.value if now else 'missing'} copy")
        if result is CopyState.LEARNER and step.node_id not in self.nodes:
            raise Skipped("invalid step", f"{name} of shard {step.shard} on {_show(step.node_id)}, not a member")
        if result is None:
            self.copies.get(step.shard, {}).pop(step.node_id, None)
            self.dropped.add((step.shard, step.node_id))
        else:
            self.copies.setdefault(step.shard, {})[step.node_id] = result
            self.dropped.discard((step.shard, step.node_id))
        return f"shard {step.shard}: {name} on {step.node_id}"

    def _changed(self) -> None:
        self.epoch += 1
        self._targets = None

    # ---- what readers ask ------------------------------------------------------------------

    @property
    def candidates(self) -> frozenset[str]:
        """The members that may be given copies: not drained (every member if all are: the rule,
        `placement.place`, never places a shard nowhere while a member lives)."""
        return frozenset(self.nodes) - self.drained or frozenset(self.nodes)

    def targets(self) -> tuple[tuple[str, ...], ...]:
        """Every shard's target replicas (the rule over the log's members, drains, pins, zones)."""
        if self.settings is None:
            return ()
        if self._targets is None:
            overrides = placement.Overrides(frozenset(self.drained), dict(self.pins))
            self._targets = placement.place(self.settings.shard_count, self.nodes, self.settings.replication_factor,
                                            overrides, self.nodes)
        return self._targets

    def copy_state(self, shard: int, node: str) -> CopyState | None:
        return self.copies.get(shard, {}).get(node)

    def copies_of(self, shard: int) -> Mapping[str, CopyState]:
        return self.copies.get(shard, {})

    def held_by(self, node: str) -> dict[int, CopyState]:
        """The copies the log gives `node`: shard -> state."""
        return {shard: copies[node] for shard, copies in sorted(self.copies.items()) if node in copies}


def _check_node(node: str) -> None:
    problem = node_id_problem(node)
    if problem is not None:
        raise Skipped("invalid node id", problem)


def fold(records: list[tuple[int, bytes]]) -> PlacementState:
    """The state after `records` (offset, payload), in order: the audit's and the tests' way."""
    state = PlacementState()
    for offset, payload in records:
        state.apply(offset, payload)
    return state
