"""One node's replica of one shard in the simulation: a driver of the store's own replica machine.

Why it exists: the node (`kvstore.server.replica.ShardReplica`) and this module are the two
drivers of `kvstore.core.replica.ReplicaMachine`, the one place every protocol decision of a
replica is taken (following, fencing, catching up, group commit, what a failed append leads to,
the read barrier, stepping down). Here its actions become messages to the simulated broker
(through `tests.sim.writer.SimWriter`, the guard's shell, for the writer's calls) and operations
on the node's `MemoryShard`; their results come back as the machine's events. Nothing here
decides anything, so the simulation checks the node's protocol, not a copy of it.

Every call that the real node bounds is bounded the same way: an end-offset query whose answer
was lost fails after the call timeout, a fetch whose answer was lost comes back empty.
A machine assertion (a paired check such as W6's "plan only from a state at the upcoming offset")
is recorded as a violation and ends this replica, as an assertion ends a node's process.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from kvstore import errors
from kvstore.core import replica as machine_events
from kvstore.core.batch import Answer, BatchLimits
from kvstore.core.evaluate import key_value
from kvstore.core.recovery import SnapshotOffer, snapshots_to_try
from kvstore.core.replica import (
    READY,
    Action,
    Event,
    Mutation,
    ReplicaConfig,
    ReplicaMachine,
    trace,
)
from kvstore.core.replica.performers import perform_all
from kvstore.core.replica.writes import WriteRequest
from kvstore.core.request_window import MemoryShard
from kvstore.core.role import Role, append_outcome
from kvstore.v1 import kv_pb2
from tests.sim.kafka import FetchResult
from tests.sim.scheduler import Actor
from tests.sim.world import World
from tests.sim.writer import TOPIC, Result, SimWriter
from wal import errors as wal_errors
from wal.guard import AppendResult, Phase
from wal.record import Verdict, WriterIdentity, judge

ReadAnswer = kv_pb2.GetResponse | errors.StoreError
Reply = Callable[[Answer], None]


@dataclasses.dataclass
class ReplicaTrace:
    """Every event stepped into one replica machine, with what it returned (`world.replica_traces`)."""

    name: str
    config: ReplicaConfig
    empty_at_start: bool  # its store held nothing: a replay starts from an empty one too
    steps: list[trace.Step]


@dataclasses.dataclass
class _Request:
    reply: Callable[[Answer], None] | None  # a write's
    read_key: bytes | None = None  # a linearizable Get's key: answered from the store once READY
    read_reply: Callable[[ReadAnswer], None] | None = None
    barrier_reply: Callable[[errors.StoreError | None], None] | None = None  # a bare read barrier's


def machine_config(world: World, shard: int) -> ReplicaConfig:
    """The node's replica settings, in the simulation's shrunken timings."""
    t = world.timing
    return ReplicaConfig(
        shard=shard, standby=True, batch_limits=BatchLimits(t.batch_records, t.batch_bytes, t.record_bytes),
        max_pending=t.max_pending, linger_ms=t.linger_ms, bootstrap_timeout_ms=t.bootstrap_timeout_ms,
        barrier_timeout_ms=t.barrier_timeout_ms, refence_pause_ms=t.refence_pause_ms,
        beyond_end_grace_ms=t.call_timeout_ms * 4, beyond_end_poll_ms=t.settle_poll_ms * 5,
        backoff_first_ms=t.settle_poll_ms * 2, backoff_max_ms=t.call_timeout_ms,
        request_horizon_ms=t.request_horizon_ms, clock_skew_ms=t.clock_skew_ms, mutations=world.mutations)


class Replica:
    def __init__(self, world: World, actor: Actor, shard: int, store: MemoryShard,
                 leader_hint: Callable[[int], str | None]) -> None:
        self.world = world
        self.actor = actor
        self.shard = shard
        self.store = store
        self.leader_hint = leader_hint
        self.machine = ReplicaMachine(machine_config(world, shard), store)
        self.writer: SimWriter | None = None
        self._requests: dict[int, _Request] = {}
        self._tickets = 0
        self._wake_at: int | None = None  # the Tick already scheduled
        self._dead = False
        self._applied = world.audit.applied.setdefault((actor.name, shard), [])
        self.caught_up_once = False  # it reached the partition's end at least once (placement's P2)
        # Asked to resolve prepared transactions a read waits on; the node sets it (its resolvers).
        self.resolve_now: Callable[[tuple[str, ...]], None] = lambda txn_ids: None
        self.recording: ReplicaTrace | None = None
        if world.replica_traces is not None:
            self.recording = ReplicaTrace(f"{actor.name} s{shard}", self.machine.config, store.applied_offset == 0, [])
            world.replica_traces.append(self.recording)

    def close(self) -> None:
        """Dropped by placement: it takes no more events (its pending calls' answers are ignored).
        Whatever still waits on it is told "unknown outcome" (a write may be in a batch that
        commits), as the real replica's callers are when it is stopped under them: nothing that
        waits on a closed replica waits for good (a transaction's forget record did, sim seed 4)."""
        self._dead = True
        waiting, self._requests = self._requests, {}
        error = errors.UnknownOutcomeError(f"shard {self.shard}: the replica was closed (placement dropped it)")
        for ticket in sorted(waiting):
            self.world.sched.at(0, functools.partial(self._refuse, waiting[ticket], error), self.actor)

    @staticmethod
    def _refuse(request: _Request, error: errors.StoreError) -> None:
        if request.barrier_reply is not None:
            request.barrier_reply(error)
        elif request.read_reply is not None:
            request.read_reply(error)
        elif request.reply is not None:
            request.reply(error)

    def start(self) -> None:
        self._step(machine_events.Started())

    @property
    def dead(self) -> bool:
        """Closed by placement, or ended by a failed machine check: it takes no more events."""
        return self._dead

    @property
    def role(self) -> Role:
        return self.machine.role.role

    @property
    def caught_up(self) -> bool:
        return self.machine.caught_up

    @property
    def holding(self) -> bool:
        """Still acting as leader (what the group waits for before moving the shard)."""
        return self.machine.holding

    # ---- what the node asks -----------------------------------------------------------------------

    def set_lead(self, lead: bool) -> None:
        self._step(machine_events.LeadChanged(lead))

    def write(self, write: WriteRequest, deadline_ms: int | None, reply: Reply) -> None:
        """`deadline_ms`: when its client stops waiting (None: it runs whatever, as gRPC's do)."""
        ticket = self._ticket(_Request(reply))
        self._step(machine_events.WriteArrived(ticket, write, 0, self.leader_hint(self.shard) or ""))
        if deadline_ms is not None and ticket in self._requests:
            def gone() -> None:
                if self._requests.pop(ticket, None) is not None:
                    self._step(machine_events.ClientGone(ticket))

            self.world.sched.at(max(0, deadline_ms - self.world.sched.now), gone, self.actor)

    def read(self, key: bytes, reply: Callable[[ReadAnswer], None]) -> None:
        """A linearizable Get: through the leader's read barrier."""
        ticket = self._ticket(_Request(None, key, reply))
        self._step(machine_events.ReadArrived(ticket, self.leader_hint(self.shard) or "", (key,)))

    def barrier(self, reply: Callable[[errors.StoreError | None], None], keys: tuple[bytes, ...] = (),
                span: tuple[bytes, bytes | None] | None = None) -> None:
        """A read barrier: None once this replica has applied everything committed when it was
        asked, as the leader, and no prepared transaction holds an exclusive lock on `keys` or
        in `span` (T4); the refusal otherwise. The caller reads the store at once."""
        ticket = self._ticket(_Request(None, barrier_reply=reply))
        self._step(machine_events.ReadArrived(ticket, self.leader_hint(self.shard) or "", keys, span))

    # ---- the driver ---------------------------------------------------------------------------------

    def _ticket(self, request: _Request) -> int:
        self._tickets += 1
        self._requests[self._tickets] = request
        return self._tickets

    def _step(self, event: Event) -> None:
        if self._dead:
            return
        before = self.machine.role.role
        now = self.world.sched.now
        try:
            actions = self.machine.step(event, now_ms=now, unix_ms=now + self.actor.clock_skew_ms)
        except AssertionError as exc:
            self.world.violation(f"{self.actor.name} shard {self.shard}: the replica machine's check failed "
                                 f"on {type(event).__name__}: {exc}")
            self._dead = True
            return
        if self.recording is not None:
            self.recording.steps.append(trace.Step(now, now + self.actor.clock_skew_ms, event,
                                                   trace.actions_text(actions)))
        if self.machine.role.role is Role.LEADING and before is not Role.LEADING:
            self.world.audit.counters["leaderships"] += 1
            self.world.trace.log(f"{self.actor.name} s{self.shard} leading at {self.machine.role.upcoming} "
                                 f"term {self.machine.term}")
        for result in perform_all(self, actions):  # the core's one table; local results after the list
            self._later(result)
        if self.machine.caught_up:
            self.caught_up_once = True
        self._schedule_tick()

    def _later(self, event: Event) -> None:
        """A local operation's result, reported as the node's loop would: after what is queued."""
        self.world.sched.at(0, lambda: self._step(event), self.actor)

    def _schedule_tick(self) -> None:
        wake = self.machine.wake_at_ms()
        if wake is None:
            return
        at = max(int(wake) + (0 if wake == int(wake) else 1), self.world.sched.now)
        if self._wake_at is not None and self._wake_at <= at and self._wake_at >= self.world.sched.now:
            return

        def tick() -> None:
            if self._wake_at == at:
                self._wake_at = None
            self._step(machine_events.Tick())

        self._wake_at = at
        self.world.sched.at(at - self.world.sched.now, tick, self.actor)

    # ---- the performers (kvstore.core.replica.performers.Performers) ---------------------------------

    def perform_answer(self, action: machine_events.AnswerRequest) -> None:
        self._answer(action.ticket, action.answer)

    def perform_fence(self, action: machine_events.Fence) -> None:
        if self.writer is None:
            self.writer = SimWriter(self.world, self.actor, self.shard)
            self.world.trace.log(f"{self.actor.name} s{self.shard} fencing")
        writer = self.writer
        writer.fence(lambda result: self._fenced(writer, result))

    def perform_set_term(self, action: machine_events.SetTerm) -> None:
        assert self.writer is not None
        self.writer.identity = WriterIdentity(self.actor.name, action.term)

    def perform_append(self, action: machine_events.Append) -> None:
        assert self.writer is not None
        writer = self.writer
        writer.append(list(action.payloads), action.revision, lambda result: self._appended(writer, result))

    def perform_apply_committed(self, action: machine_events.ApplyCommitted) -> str | None:
        self._apply(list(action.records), action.checkpoint, action.marker_slot)
        self.world.audit.counters["batches"] += 1
        return None

    def perform_apply_replayed(self, action: machine_events.ApplyReplayed) -> str | None:
        self._apply(list(action.records), action.checkpoint, None)
        return None

    def perform_fetch(self, action: machine_events.Fetch) -> None:
        self._fetch(action)

    def perform_read_end(self, action: machine_events.ReadEnd) -> None:
        self._read_end(action.purpose)

    def perform_read_settled_end(self, action: machine_events.ReadSettledEnd) -> None:
        self._settled_end()

    def perform_rewind(self, action: machine_events.RewindUnverified) -> None:
        self.store.rewind_unverified()

    def perform_wipe(self, action: machine_events.Wipe) -> None:
        self.world.trace.log(f"{self.actor.name} s{self.shard} wipes its replica: {action.reason}")
        self.store.wipe()

    def perform_load_snapshot(self, action: machine_events.LoadSnapshot) -> machine_events.SnapshotDone:
        return machine_events.SnapshotDone(self._load_snapshot(action.at_least))

    def perform_close_writer(self, action: machine_events.CloseWriter) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.world.trace.log(f"{self.actor.name} s{self.shard} follower")

    def perform_note(self, action: machine_events.Note) -> None:
        if action.metric:
            self.world.audit.counters[f"replica_{action.metric}"] += 1
        if action.warning and action.text:
            self.world.trace.log(f"{self.actor.name} {action.text}")

    def perform_resolve_now(self, action: machine_events.ResolveNow) -> None:
        self.world.audit.counters["read_resolve_now"] += 1
        self.resolve_now(action.txn_ids)

    def perform_unable(self, action: machine_events.Unable) -> None:
        self._unexpected(action)

    def perform_able(self, action: machine_events.Able) -> None:
        self._unexpected(action)

    def _unexpected(self, action: Action) -> None:
        self.world.violation(f"{self.actor.name} shard {self.shard}: nothing in the simulation makes a replica "
                             f"unable to lead, yet: {action}")

    def perform_exit(self, action: machine_events.Exit) -> None:
        pass

    def _load_snapshot(self, at_least: int) -> bool:
        """The snapshot the node would load (`kvstore.core.recovery.snapshots_to_try`, as
        `kvstore.server.restore.load_newest` asks it), in place of the replica."""
        taken = dict(self.world.snapshots.get(self.shard, []))
        offers = [SnapshotOffer(f"cut-{cut}", TOPIC, cut, len(state.keys)) for cut, state in sorted(
            taken.items(), reverse=True)]  # newest first, as listed
        _, end = self.world.broker.ends(self.shard)
        usable, _notes = snapshots_to_try(offers, topic=TOPIC, at_least=at_least, applied=self.store.applied_offset,
                                          end=end)
        if not usable:
            return False
        self.store.load(taken[usable[0].cut])
        self.world.audit.counters["snapshot_loads"] += 1
        self.world.trace.log(f"{self.actor.name} s{self.shard} loaded the snapshot at {usable[0].cut}")
        return True

    def _answer(self, ticket: int, answer: object) -> None:
        request = self._requests.pop(ticket, None)
        if request is None:
            return  # its client gave up
        if request.barrier_reply is not None:
            request.barrier_reply(None if answer is READY else answer)  # type: ignore[arg-type]
            return
        if request.read_reply is not None:
            assert request.read_key is not None
            if answer is READY:
                state = self.store.get(request.read_key)
                response = kv_pb2.GetResponse(found=state is not None)
                if state is not None:
                    response.kv.CopyFrom(key_value(request.read_key, state))
                request.read_reply(response)
            else:
                assert isinstance(answer, errors.StoreError), answer
                request.read_reply(answer)
            return
        assert request.reply is not None and answer is not READY
        request.reply(answer)  # type: ignore[arg-type]

    def _apply(self, records: list[tuple[int, bytes]], checkpoint: int, unverified: int | None) -> None:
        self.store.apply(records, checkpoint, unverified=unverified)
        self._applied.extend(records)

    # ---- the writer's calls, through the guard's shell ------------------------------------------------

    def _fenced(self, writer: SimWriter, result: Result) -> None:
        if writer is not self.writer:
            return
        if isinstance(result, wal_errors.WalError):
            self.world.trace.log(f"{self.actor.name} s{self.shard} fence failed: {type(result).__name__}")
            self._step(machine_events.FenceFailed(f"{type(result).__name__}: {result}"))
            return
        assert isinstance(result, int)
        self._step(machine_events.Fenced(result))

    def _appended(self, writer: SimWriter, result: Result) -> None:
        if writer is not self.writer:
            return
        if isinstance(result, AppendResult):
            self._step(machine_events.Appended(result.offsets, result.upcoming_offset, result.marker_slot))
            return
        assert isinstance(result, wal_errors.WalError)
        outcome = append_outcome(result, writer.guard.phase is Phase.NEEDS_INIT)
        self.world.audit.counters[f"append_{outcome.value}"] += 1
        self.world.trace.log(f"{self.actor.name} s{self.shard} batch failed: {type(result).__name__}: {result}")
        self._step(machine_events.AppendFailed(outcome, f"{type(result).__name__}"))

    # ---- the broker's ends and fetches --------------------------------------------------------------

    def _call(self, at_broker: Callable[[Callable[[Callable[[], None]], None]], None], timeout_ms: int,
              on_timeout: Callable[[], None]) -> None:
        """One request to the broker, bounded: `at_broker(back)` runs there and sends its answer
        with `back`; no answer within `timeout_ms` runs `on_timeout` instead (once, either)."""
        world = self.world
        answered: list[bool] = []
        back = world.net.answer_to(self.actor)

        def reply(deliver: Callable[[], None]) -> None:
            def once() -> None:
                if not answered:
                    answered.append(True)
                    deliver()

            back(once)

        def expire() -> None:
            if not answered:
                answered.append(True)
                on_timeout()

        world.net.send(lambda: at_broker(reply), None, sender=self.actor)
        world.sched.at(timeout_ms, expire, self.actor)

    def _read_end(self, purpose: machine_events.EndPurpose) -> None:
        world, shard = self.world, self.shard

        def at_broker(back: Callable[[Callable[[], None]], None]) -> None:
            _, hw = world.broker.ends(shard)
            back(lambda: self._step(machine_events.EndRead(purpose, hw)))

        self._call(at_broker, world.timing.call_timeout_ms,
                   lambda: self._step(machine_events.EndReadFailed(purpose, "timed out")))

    def _settled_end(self) -> None:
        """The end once no transaction is open (LSO == HW), asked again while one is, within the
        call timeout: `ShardWriter.settled_end_offset`'s contract."""
        world, shard = self.world, self.shard
        deadline = world.sched.now + world.timing.call_timeout_ms
        done: list[bool] = []

        def finish(event: Event) -> None:
            if not done:
                done.append(True)
                self._step(event)

        def ask() -> None:
            def at_broker(back: Callable[[Callable[[], None]], None]) -> None:
                lso, hw = world.broker.ends(shard)
                back(lambda: answer(lso, hw))

            self._call(at_broker, world.timing.call_timeout_ms, lambda: None)

        def answer(lso: int, hw: int) -> None:
            if done:
                return
            if lso == hw:
                finish(machine_events.EndRead(machine_events.EndPurpose.SETTLE, hw))
            elif world.sched.now < deadline:
                world.sched.at(world.timing.settle_poll_ms, ask, self.actor)
            else:
                finish(machine_events.EndReadFailed(machine_events.EndPurpose.SETTLE,
                                                    "a transaction stays open"))

        world.sched.at(world.timing.call_timeout_ms * 2,
                       lambda: finish(machine_events.EndReadFailed(machine_events.EndPurpose.SETTLE, "timed out")),
                       self.actor)
        ask()

    def _fetch(self, action: machine_events.Fetch) -> None:
        world, shard, t = self.world, self.shard, self.world.timing
        position = action.from_offset

        def at_broker(back: Callable[[Callable[[], None]], None]) -> None:
            world.broker.fetch(shard, position, action.upto, t.fetch_limit, t.fetch_wait_ms,
                               lambda result: back(lambda: self._fetched(position, result)))

        # A fetch whose answer never came is, to the reader, a poll that returned nothing.
        self._call(at_broker, t.fetch_timeout_ms,
                   lambda: self._step(machine_events.Fetched(position, (), position)))

    def _fetched(self, position: int, result: FetchResult) -> None:
        if result.below_log_start is not None:
            _, hw = self.world.broker.ends(self.shard)
            self._step(machine_events.FetchOutOfRange(position, True, result.below_log_start, hw))
            return
        accepted: list[tuple[int, bytes]] = []
        for offset, value, headers in result.records:
            verdict, accepted_record = judge(offset, value, headers)  # W3
            if verdict is Verdict.ACCEPTED:
                assert accepted_record is not None
                accepted.append((offset, accepted_record.payload))
            else:
                self.world.audit.counters[f"w3_{verdict.value}"] += 1
        self._step(machine_events.Fetched(position, tuple(accepted), result.next_position))


__all__ = ["Mutation", "Replica", "machine_config"]
