"""The placement controller's shell in a simulated node (P1, P3; docs/design.md §8): it drives
`kvstore.core.placement_controller.PlacementController`, decides nothing itself.

Why it looks like a shard's leader: the controller is one, for the placement log. The member
that the controller's group (`World.controller_group`, a `tests.sim.group.GroupCoordinator` with
one partition: the role) assigns the role takes office:

1. **Fence** the placement log's transactional id through the guard's shell (`SimWriter`, the
   shards' own: `init_transactions` fences every earlier controller, W4) and learn its end; its
   term is that end plus one (as a shard leader's, `kvstore.core.role`), stamped on every record.
2. **Read the log to that end** (W6), keeping what W3 accepts, folded with the one apply.
3. **Loop**: list the membership group's members (`members_listed`; a listing that fails or whose
   answer is lost is no call), ask every node for its report over the network (`report`, stamped
   with the time it asked, so a late answer is never fresher than it is), take operators'
   requests (`request`), `plan`, append the records at the upcoming offset (W1, W2), fold them
   back once committed, and only then plan again.

A failed append leaves the upcoming offset unknown: the shell fences again (a new term, as a
shard leader's re-fence) and reads the log to its new end before it plans again; fenced, it waits
a moment first (a newer controller holds the log). Deposed (the group gave the role to another,
or expelled it), it stops at once; a zombie (paused, then woken) acts on its old view only until
its next append, which the broker refuses as fenced.

Mutation `unfenced-controller` (the shell's, tests only): every controller appends with a
transactional id of its own (its `init_transactions` fences nobody else), stamps each batch with
the partition's end as it reads it just before (not the end of the log it folded: it never reads
another's records after taking office), and a deposed controller keeps deciding.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.core.placement_controller import MUTATIONS as CONTROLLER_MUTATIONS
from kvstore.core.placement_controller import NodeReport, PlacementController, Request, RequestRefused
from kvstore.core.placement_log import PlacementState, Settings
from kvstore.internal.v1 import placement_pb2
from tests.sim.following import fetch_log, fold
from tests.sim.group import GroupAnswer
from tests.sim.kafka import FetchResult
from tests.sim.writer import PLACEMENT_TXN_ID, Result, SimWriter
from wal.errors import FencedError, WalError
from wal.guard import AppendResult, Phase
from wal.record import WriterIdentity

if TYPE_CHECKING:
    from tests.sim.node import Node

UNFENCED_CONTROLLER = "unfenced-controller"


@dataclasses.dataclass(frozen=True)
class RequestAnswer:
    """What the controller answers an operator's request."""

    kind: str  # "accepted" (offsets: where its records landed; none: nothing to do), "refused", "not-controller"
    offsets: tuple[int, ...] = ()
    stale: bool = False  # refused: computed at an older epoch
    message: str = ""


ACCEPTED, REFUSED, NOT_CONTROLLER, UNKNOWN = "accepted", "refused", "not-controller", "unknown"
Reply = Callable[[RequestAnswer], None]


class _Phase(enum.Enum):
    FENCING = "fencing"
    CATCHING_UP = "catching-up"
    RUNNING = "running"
    APPENDING = "appending"
    WAITING = "waiting"  # after a failed append, before it fences again


@dataclasses.dataclass(eq=False)
class _Tenure:
    """One time in office (from the group's assignment to the end of the role or the process)."""

    machine: PlacementController
    state: PlacementState = dataclasses.field(default_factory=PlacementState)
    phase: _Phase = _Phase.FENCING
    writer: SimWriter | None = None
    read_to: int = 0  # the next offset of the log to read: every record below it is folded
    upcoming: int = 0  # where its next append must land (W1)
    reading: int = 0  # the current read's token (a re-fence starts a new one)
    appending: int = 0  # the current append's token
    caught_up_once: bool = False
    requests: collections.deque[tuple[Request, Reply]] = dataclasses.field(default_factory=collections.deque)
    listing_asked_ms: int = -1  # the ask time of the listing last taken
    report_asked_ms: dict[str, int] = dataclasses.field(default_factory=dict)


class ControllerShell:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.world = node.world
        self.joined = False  # a member of the controller's group
        self.tenure: _Tenure | None = None

    @property
    def unfenced(self) -> bool:
        return UNFENCED_CONTROLLER in self.world.placement_mutations

    @property
    def holding(self) -> frozenset[int]:
        """What it tells the controller's group it still holds (the role, while in office)."""
        return frozenset({0}) if self.tenure is not None else frozenset()

    # ---- the role ---------------------------------------------------------------------------------

    def on_group(self, answer: GroupAnswer) -> None:
        """The controller group's heartbeat answer."""
        self.joined = answer.known
        elected = answer.known and 0 in answer.assigned
        if elected and self.tenure is None:
            self._take_office()
        elif not elected and self.tenure is not None and not self.unfenced:
            self._leave_office("no longer assigned the role" if answer.known else "expelled from the group")

    def _take_office(self) -> None:
        world, now = self.world, self.world.sched.now
        assert world.replication_factor is not None
        settings = Settings(world.shards, world.replication_factor, world.timing.placement_grace_ms,
                            world.timing.max_learners_per_node)
        machine = PlacementController(self.node.name, self.node.name, 0, settings, now,
                                      mutations=world.placement_mutations & CONTROLLER_MUTATIONS)
        tenure = self.tenure = _Tenure(machine)
        world.audit.counters["controller_elections"] += 1
        world.trace.log(f"{self.node.name} takes office as the placement controller")
        self._fence(tenure)
        self._poll(tenure)
        self._tick(tenure)

    def _leave_office(self, why: str) -> None:
        tenure, self.tenure = self.tenure, None
        assert tenure is not None
        if tenure.writer is not None:
            tenure.writer.close()
        for _, reply in tenure.requests:
            reply(RequestAnswer(NOT_CONTROLLER, message=why))
        self.world.trace.log(f"{self.node.name} leaves the controller's office: {why}")

    def _current(self, tenure: _Tenure) -> bool:
        return self.tenure is tenure

    def _later(self, delay_ms: int, tenure: _Tenure, then: Callable[[], None]) -> None:
        self.world.sched.at(delay_ms, lambda: then() if self._current(tenure) else None, self.node)

    # ---- fencing and reading (W4, W6) -----------------------------------------------------------------

    def _fence(self, tenure: _Tenure) -> None:
        if tenure.writer is not None:
            tenure.writer.close()
        txn_id = f"{PLACEMENT_TXN_ID}.{self.node.name}" if self.unfenced else PLACEMENT_TXN_ID
        writer = tenure.writer = SimWriter(self.world, self.node, self.world.placement_partition, txn_id)
        tenure.phase = _Phase.FENCING
        writer.fence(lambda result: self._fenced(tenure, writer, result))

    def _fenced(self, tenure: _Tenure, writer: SimWriter, result: Result) -> None:
        if not self._current(tenure) or tenure.writer is not writer:
            return
        world = self.world
        if isinstance(result, WalError):
            world.audit.counters["controller_fence_failed"] += 1
            tenure.phase = _Phase.WAITING
            self._later(world.timing.refence_pause_ms, tenure, lambda: self._fence(tenure))
            return
        assert isinstance(result, int)
        term = result + 1  # the end it fenced at, plus one: never below an earlier controller's
        tenure.machine.term = term
        writer.identity = WriterIdentity(self.node.name, term)
        tenure.upcoming = result
        world.trace.log(f"{self.node.name} controller fenced the placement log at {result} (term {term})")
        if self.unfenced and tenure.caught_up_once:
            tenure.phase = _Phase.RUNNING  # the mutation: never reads another's records again
            return
        tenure.reading += 1
        tenure.phase = _Phase.CATCHING_UP
        self._catch_up(tenure, tenure.reading, result)

    def _catch_up(self, tenure: _Tenure, reading: int, end: int) -> None:
        if tenure.read_to >= end:
            tenure.phase = _Phase.RUNNING
            tenure.caught_up_once = True
            self._round(tenure)
            return

        def fetched(result: FetchResult | None) -> None:
            if not self._current(tenure) or tenure.reading != reading:
                return
            if result is not None:
                fold(self.world, tenure.state, result)
                tenure.read_to = max(tenure.read_to, result.next_position)
            self._catch_up(tenure, reading, end)

        fetch_log(self.world, self.node, tenure.read_to, end, self.world.timing.fetch_wait_ms, fetched)

    # ---- what it observes -------------------------------------------------------------------------------

    def _poll(self, tenure: _Tenure) -> None:
        """List the members and ask every node for its report, every `report_every_ms`."""
        world, now = self.world, self.world.sched.now
        if world.listing_fails.get(self.node.name, 0) > now:
            world.audit.counters["controller_listing_failed"] += 1  # the describe fails: no call
        else:
            back = world.net.answer_to(self.node)

            def at_coordinator() -> None:
                members = tuple(sorted(world.group.members))
                back(lambda: self._listed(tenure, now, members))

            world.net.send(at_coordinator, None, sender=self.node)
        machine = tenure.machine
        for name in sorted(machine.listed() | frozenset(tenure.state.nodes)):
            self._ask_report(tenure, name)
        self._later(world.timing.report_every_ms, tenure, lambda: self._poll(tenure))

    def _listed(self, tenure: _Tenure, asked_ms: int, members: tuple[str, ...]) -> None:
        if self._current(tenure) and asked_ms > tenure.listing_asked_ms:  # never an older listing after a newer
            tenure.listing_asked_ms = asked_ms
            tenure.machine.members_listed(members, asked_ms)

    def _ask_report(self, tenure: _Tenure, name: str) -> None:
        world = self.world
        peer = world.peers.get(name)
        if peer is None:
            return
        asked_ms = world.sched.now
        back = world.net.answer_to(self.node, from_brokers=False)

        def at_peer() -> None:
            zone, copies = peer.zone, peer.following.report()
            back(lambda: self._reported(tenure, NodeReport(name, zone, copies, asked_ms)))

        world.net.send(at_peer, peer)

    def _reported(self, tenure: _Tenure, report: NodeReport) -> None:
        if self._current(tenure) and report.at_ms > tenure.report_asked_ms.get(report.node, -1):
            tenure.report_asked_ms[report.node] = report.at_ms
            tenure.machine.report(report)

    # ---- operators -----------------------------------------------------------------------------------------

    def request(self, request: Request, reply: Reply) -> None:
        """An operator's request arrived here."""
        tenure = self.tenure
        if tenure is None:
            reply(RequestAnswer(NOT_CONTROLLER, message=f"{self.node.name} is not the controller"))
            return
        tenure.requests.append((request, reply))
        self._round(tenure)

    # ---- deciding and appending --------------------------------------------------------------------------------

    def _tick(self, tenure: _Tenure) -> None:
        self._round(tenure)
        self._later(self.world.timing.controller_tick_ms, tenure, lambda: self._tick(tenure))

    def _round(self, tenure: _Tenure) -> None:
        """Answer the requests waiting, then plan; append what either says (one append at a time)."""
        if not self._current(tenure) or tenure.phase is not _Phase.RUNNING:
            return
        world, now = self.world, self.world.sched.now
        while tenure.requests and tenure.machine.listed():  # (the real shell: "not listed yet: retry")
            request, reply = tenure.requests.popleft()
            try:
                records = tenure.machine.request(tenure.state, request, now)
            except RequestRefused as refused:
                world.audit.counters["placement_refused_stale" if refused.stale else "placement_refused"] += 1
                reply(RequestAnswer(REFUSED, stale=refused.stale, message=str(refused)))
                continue
            if not records:
                reply(RequestAnswer(ACCEPTED))
                continue
            self._append(tenure, records, reply)
            return
        records = tenure.machine.plan(tenure.state, now)
        if records:
            self._append(tenure, records, None)

    def _append(self, tenure: _Tenure, records: list[placement_pb2.PlacementRecord], reply: Reply | None) -> None:
        writer = tenure.writer
        assert writer is not None
        tenure.phase = _Phase.APPENDING
        tenure.appending += 1
        token = tenure.appending
        payloads = [record.SerializeToString() for record in records]

        def done(result: Result) -> None:
            self._appended(tenure, writer, payloads, reply, result)

        if not self.unfenced:
            writer.append(payloads, tenure.upcoming, done)
            return
        # The mutation: stamped with the partition's end as read now, whatever the log it folded.
        world = self.world
        back = world.net.answer_to(self.node)

        def mine() -> bool:
            return (tenure.writer is writer and tenure.appending == token and tenure.phase is _Phase.APPENDING
                    and not writer.busy)

        def at_broker() -> None:
            _, end = world.broker.ends(world.placement_partition)
            back(lambda: writer.append(payloads, end, done) if mine() else None)

        def lost() -> None:  # the end's answer never came: nothing was appended
            if mine():
                tenure.phase = _Phase.RUNNING
                if reply is not None:
                    reply(RequestAnswer(UNKNOWN))

        world.net.send(at_broker, None, sender=self.node)
        self._later(world.timing.call_timeout_ms, tenure, lost)

    def _appended(self, tenure: _Tenure, writer: SimWriter, payloads: list[bytes], reply: Reply | None,
                  result: Result) -> None:
        if not self._current(tenure) or tenure.writer is not writer:
            return
        world = self.world
        if isinstance(result, AppendResult):
            for offset, payload in zip(result.offsets, payloads, strict=True):
                why = tenure.state.apply(offset, payload)
                if why is not None:
                    world.violation(f"P1: controller {self.node.name}'s own record at offset {offset} of the "
                                    f"placement log is one the apply skips: {why}")
            world.audit.counters["placement_records"] += len(payloads)
            tenure.upcoming = result.upcoming_offset
            tenure.read_to = max(tenure.read_to, result.upcoming_offset)
            tenure.phase = _Phase.RUNNING
            if reply is not None:
                reply(RequestAnswer(ACCEPTED, offsets=result.offsets))
            self._later(0, tenure, lambda: self._round(tenure))
            return
        assert isinstance(result, WalError)
        fenced = isinstance(result, FencedError) or writer.guard.phase is Phase.FENCED
        world.audit.counters["controller_append_fenced" if fenced else "controller_append_failed"] += 1
        world.trace.log(f"{self.node.name} controller append failed: {type(result).__name__}: {result}")
        if reply is not None:
            reply(RequestAnswer(UNKNOWN, message=str(result)))
        tenure.phase = _Phase.WAITING
        # The upcoming offset is unknown (W2): fence again and read to the new end before planning.
        pause = world.timing.refence_pause_ms if fenced else world.timing.settle_poll_ms * 2
        self._later(pause, tenure, lambda: self._fence(tenure))
