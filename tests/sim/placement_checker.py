"""The placement's checks (docs/design.md §8, P1-P4), from the final placement log and what the
run really did, never from what a node or the controller said of it.

The oracle (`PlacementOracle`) reads the placement log's partition by the book: read_committed,
W3 through `wal.record.judge`, the one apply (`PlacementState.apply`). Against it:

* **P1, one writer at a time (W2, W4)**: every record W3 accepts after a taken
  `ControllerStarted(node, t)` was written by that node's writer with term t (a deposed
  controller's record is never accepted), a `ControllerStarted` by the writer it names, and the
  terms of the store's records never go back; every batch a controller's guard reported committed
  is in the log where it said (W1); a record of a writer outside the store is never taken.
* **One apply**: once the run converged, every node's fold of the log equals the oracle's.
* **P2, drops**: when the controller decided (the record's `at_ms`) to retire a replica or to
  drop a copy (not a learner: a learner never counted), the shard kept at least
  min(R, candidates) *other* copies that the log lists as replicas and that were really caught
  up at some moment of the `READY_REPORT_MAX_AGE_MS` before the decision (the age of the reports
  a retire or a drop may rest on): the simulated replica itself
  (it reached its partition's end, lag within `CAUGHT_UP_LAG` of the broker's high watermark,
  nothing keeping it from leading; `Audit.caught_up_seen`), whatever any report said. The
  window is the controller's own: a report older than that counts for nothing, so a copy that
  crashed (or lost its disk) after its report may still count, which the controller cannot know
  sooner. R and the candidates are the log's, just before the record.
* **P2, deletions**: a node deletes a copy's data only when the last step the log had for that
  copy, below the position the node had read, is a drop.
* **P4, the floor**: a drain the log takes leaves at least R candidates, or it is forced and the
  operator asked for `--force` (the request answered with that record's offset, or, its answer
  lost, any forced drain of that node). And once healed, if no forced drain is in effect, every
  shard's target has min(R, nodes) nodes (the brief's "no target below min(R, live candidates)":
  while faults last, a member declared gone after a valid drain may leave fewer candidates than
  R, which no request could have prevented, so it is judged once every node is back).
* **P4, epochs**: an operator's request the controller answered as accepted at offsets o.. was
  computed at the epoch the log had just before o (a stale request is never merged; a new
  controller's ControllerStarted that leads its records changes no epoch).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from google.protobuf.message import DecodeError

from kvstore.core.placement_controller import READY_REPORT_MAX_AGE_MS, Drain
from kvstore.core.placement_log import CopyState, PlacementState, Step
from kvstore.internal.v1 import placement_pb2
from tests.sim.checker import FOREIGN_WRITER
from tests.sim.controller import ACCEPTED
from tests.sim.kafka import Partition
from tests.sim.node import Node
from tests.sim.operator import OperatorOp
from tests.sim.world import Audit
from wal.record import Verdict, WriterIdentity, judge


def _decode(payload: bytes) -> placement_pb2.PlacementRecord | None:
    record = placement_pb2.PlacementRecord()
    try:
        record.ParseFromString(payload)
    except (DecodeError, RecursionError, ValueError):
        return None
    return record


@dataclasses.dataclass
class _Context:
    """What the checks compare against (None: fold only)."""

    audit: Audit
    operations: Sequence[OperatorOp]
    violations: list[str]


class PlacementOracle:
    """The placement log folded by the book, incrementally (`catch_up` reads what was added)."""

    def __init__(self, partition: Partition, checks: _Context | None = None) -> None:
        self.partition = partition
        self.state = PlacementState()
        self.position = 0  # every entry below it was looked at
        self.steps: dict[tuple[int, str], list[tuple[int, int]]] = {}  # (shard, node) -> (offset, kind) taken
        self._controller: WriterIdentity | None = None
        self._started_at = -1
        self._last_term = -1
        self._checks = checks
        # The operators' requests answered as accepted: by the offset of their first record (a
        # new controller's ControllerStarted may lead them), and by every offset of their records.
        self._accepted_first: dict[int, OperatorOp] = {}
        self._accepted_by_offset: dict[int, OperatorOp] = {}
        for op in checks.operations if checks is not None else ():
            if op.answer is not None and op.answer.kind == ACCEPTED and op.answer.offsets:
                self._accepted_first[op.answer.offsets[0]] = op
                self._accepted_by_offset.update(dict.fromkeys(op.answer.offsets, op))

    def catch_up(self) -> PlacementState:
        log = self.partition.log
        bound = self.partition.last_stable_offset
        for offset in range(self.position, bound):
            entry = log[offset]
            if entry.control or not entry.committed:
                continue
            verdict, accepted = judge(offset, entry.value, entry.headers)
            if verdict is Verdict.ACCEPTED:
                assert accepted is not None
                self._take(offset, accepted.writer, accepted.payload)
        self.position = max(self.position, bound)
        return self.state

    def check_deletes(self, audit: Audit) -> list[str]:
        """P2's deletions, against the log folded so far."""
        violations = []
        for (name, shard, position, at_ms) in audit.copy_deletes:
            steps = [kind for offset, kind in self.steps.get((shard, name), []) if offset < position]
            if not steps or steps[-1] != Step.COPY_STEP_KIND_DROP:
                last = placement_pb2.CopyStepKind.Name(steps[-1]) if steps else "nothing"
                violations.append(f"P2: {name} deleted its copy of shard {shard} at {at_ms % 10_000_000}ms, though "
                                  f"the log's last word on it below offset {position} was {last}, not a drop")
        return violations

    # ---- one record ---------------------------------------------------------------------------------

    def _take(self, offset: int, writer: WriterIdentity, payload: bytes) -> None:
        state, ctx = self.state, self._checks
        if ctx is None:
            self._apply(offset, payload)
            return
        record = _decode(payload)
        kind = record.WhichOneof("kind") if record is not None else None
        foreign = writer.id == FOREIGN_WRITER
        before = _before(state, record, kind)
        op = self._accepted_first.get(offset)
        if op is not None and op.request.epoch != state.epoch:
            ctx.violations.append(f"P4: {op.request} was computed at epoch {op.request.epoch} but recorded at offset "
                                  f"{offset}, where the placement was at epoch {state.epoch}: a stale request merged")
        taken = self._apply(offset, payload)
        if foreign:
            if taken:
                ctx.violations.append(f"P1: the placement log's record at offset {offset}, written outside the store, "
                                      f"was taken: {record}")
            return
        if writer.term < self._last_term:
            ctx.violations.append(f"W4: placement log offset {offset}: writer {writer.id} term {writer.term} after "
                                  f"term {self._last_term}")
        self._last_term = max(self._last_term, writer.term)
        if taken and record is not None and kind == "controller_started":
            started = record.controller_started
            named = WriterIdentity(started.node_id, started.term)
            if writer != named:
                ctx.violations.append(f"P1: ControllerStarted({named.id}, term {named.term}) at offset {offset} "
                                      f"written by {writer.id} with term {writer.term}")
            self._controller, self._started_at = named, offset
        elif self._controller is not None and writer != self._controller:
            ctx.violations.append(
                f"P1: the placement log's record at offset {offset} ({kind or 'undecodable'}) was written by "
                f"{writer.id} with term {writer.term}, after ControllerStarted({self._controller.id}, term "
                f"{self._controller.term}) at offset {self._started_at}: a deposed controller's record accepted")
        if taken and record is not None:
            self._check_taken(offset, record, kind, before, ctx)

    def _apply(self, offset: int, payload: bytes) -> bool:
        taken = self.state.apply(offset, payload) is None
        if taken:
            record = _decode(payload)
            if record is not None and record.WhichOneof("kind") == "step":
                self.steps.setdefault((record.step.shard, record.step.node_id), []).append((offset, record.step.kind))
        return taken

    def _check_taken(self, offset: int, record: placement_pb2.PlacementRecord, kind: str | None, before: _Before,
                     ctx: _Context) -> None:
        state = self.state
        assert state.settings is not None
        r = state.settings.replication_factor
        if kind == "step" and record.step.kind in (Step.COPY_STEP_KIND_RETIRE, Step.COPY_STEP_KIND_DROP):
            step = record.step
            if before.held is CopyState.LEARNER:
                return  # a learner never counted
            others = sorted(n for n, held in before.copies.items() if n != step.node_id and held is CopyState.REPLICA)
            really = [n for n in others if _seen(ctx.audit, n, step.shard, record.at_ms - READY_REPORT_MAX_AGE_MS,
                                                 record.at_ms)]
            needed = min(before.r, before.candidates)
            if len(really) < needed:
                what = "retires" if step.kind == Step.COPY_STEP_KIND_RETIRE else "drops"
                ctx.violations.append(
                    f"P2: the placement log {what} {step.node_id}'s {before.held.value if before.held else 'stray'} "
                    f"copy of shard {step.shard} at offset {offset} (decided at {record.at_ms % 10_000_000}ms), "
                    f"leaving {len(really)} other copies really caught up ({', '.join(really) or 'none'}; replicas "
                    f"in the log: {', '.join(others) or 'none'}), fewer than min(R, candidates) = {needed}")
        elif kind == "drain" and not record.drain.undo and len(state.candidates) < r:
            node = record.drain.node_id
            op = self._accepted_by_offset.get(offset)
            if op is not None:
                forced = isinstance(op.request, Drain) and op.request.force
            else:
                forced = any(isinstance(o.request, Drain) and o.request.node == node and o.request.force
                             and not o.request.undo for o in ctx.operations)
            if not (record.drain.forced and forced):
                ctx.violations.append(f"P4: the drain of {node} at offset {offset} leaves {len(state.candidates)} "
                                      f"candidates for R = {r}, and the operator did not ask for --force")


@dataclasses.dataclass(frozen=True)
class _Before:
    """What a record's checks need of the placement just before it."""

    held: CopyState | None = None
    copies: dict[str, CopyState] = dataclasses.field(default_factory=dict)
    r: int = 0
    candidates: int = 0


def _before(state: PlacementState, record: placement_pb2.PlacementRecord | None, kind: str | None) -> _Before:
    if record is None or kind != "step" or state.settings is None:
        return _Before()
    return _Before(state.copy_state(record.step.shard, record.step.node_id), dict(state.copies_of(record.step.shard)),
                   state.settings.replication_factor, len(state.candidates))


def _seen(audit: Audit, node: str, shard: int, low: int, high: int) -> bool:
    """Whether that copy was really caught up at some moment in [low, high]."""
    seen = audit.caught_up_seen.get((node, shard), [])
    i = bisect.bisect_left(seen, low)
    return i < len(seen) and seen[i] <= high


def summary(state: PlacementState) -> tuple[object, ...]:
    """Everything a fold decides (what two folds of the same records must agree on)."""
    return (state.settings, state.epoch, state.controller, sorted(state.nodes.items()), sorted(state.drained),
            sorted(state.forced_drains), sorted(state.pins.items()),
            sorted((s, sorted((n, c.value) for n, c in copies.items())) for s, copies in state.copies.items()),
            sorted(state.dropped), state.applied, sorted(state.skipped.items()))


def check_placement(partition: Partition, nodes: Sequence[Node], audit: Audit, operations: Sequence[OperatorOp],
                    placement_partition: int, *, converged: bool) -> list[str]:
    """Every placement check that applies (the module docstring)."""
    violations: list[str] = []
    oracle = PlacementOracle(partition, _Context(audit, operations, violations))
    oracle.catch_up()
    violations += oracle.check_deletes(audit)
    accepted: dict[int, bytes] = {}
    for entry in partition.log:
        if entry.committed and not entry.control:
            verdict, record = judge(entry.offset, entry.value, entry.headers)
            if verdict is Verdict.ACCEPTED:
                assert record is not None
                accepted[entry.offset] = record.payload
    for commit in audit.leader_commits:  # W1 for the controllers' appends
        if commit.shard != placement_partition:
            continue
        for offset, payload in zip(commit.offsets, commit.payloads, strict=True):
            if accepted.get(offset) != payload:
                violations.append(f"W1: controller {commit.node} committed a placement record at offset {offset}, "
                                  "but no accepted record with its payload is there")
                break
    state = oracle.state
    if converged and state.settings is not None:
        truth = summary(state)
        for node in nodes:
            if node.alive and node.following.position >= oracle.position and summary(node.following.state) != truth:
                violations.append(f"one apply: {node.name}'s fold of the placement log differs from the oracle's")
        r = state.settings.replication_factor
        if not state.forced_drains:
            for shard, target in enumerate(state.targets()):
                if len(target) < min(r, len(state.nodes)):
                    violations.append(f"P4: shard {shard}'s target {list(target)} has fewer than min(R = {r}, "
                                      f"{len(state.nodes)} nodes) with no forced drain in effect")
    return violations
