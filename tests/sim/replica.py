"""One node's replica of one shard: the simulated shell around the store's pure cores.

Why it exists: to drive the real protocol code the way `kvstore.server.replica` does, with
messages instead of asyncio and threads. Every decision is taken by a core:

* `kvstore.core.role.RoleMachine`: follower / fencing / catching up / leading / stepping down,
  what each append outcome leads to (`batch_failed`), the read barrier's verdict;
* `wal.guard.Guard` (through `tests.sim.writer.SimWriter`): fencing (W4), expected-offset
  appends (W1), the delivered-offset check before commit (W2), unknown outcomes (W7);
* `kvstore.core.batch`: admission against the request table, batch planning over the overlay,
  what is answered now and what only after the commit (W5);
* `kvstore.core.request_window.MemoryShard`: the replica's state and request-id window, applied
  with `kvstore.core.state.apply_entries`, the one apply (W5: state and checkpoint together);
* `wal.record.judge`: the acceptance rule W3 for every record replayed.

What is left here is sequencing: a follower tails the partition read_committed and applies
what W3 accepts; a leader fences, catches up to the end it fenced at (W6), plans, appends at
the expected offset, applies and answers only after the commit, and does what `batch_failed`
decided (fence again, settle and replay, or step down). The shell also checks what only it can
see: that a leader plans from a state exactly at its upcoming offset (W6) and never starts
catching up from beyond the end it fenced at.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable

from kvstore import errors
from kvstore.core.batch import Answer, BatchLimits, Write, admit, plan_batch, probe_write
from kvstore.core.evaluate import Response, key_value
from kvstore.core.request_window import MemoryShard
from kvstore.core.role import Next, Role, RoleMachine
from kvstore.server.replica import append_outcome  # the server shell's own mapping of WAL errors
from kvstore.v1 import kv_pb2
from tests.sim.kafka import FetchResult
from tests.sim.scheduler import Actor
from tests.sim.world import World
from tests.sim.writer import Result, SimWriter
from wal import errors as wal_errors
from wal.guard import AppendResult
from wal.record import Verdict, WriterIdentity, judge

ReadAnswer = kv_pb2.GetResponse | errors.StoreError
Reply = Callable[[Answer], None]


class _Mode(enum.Enum):
    IDLE = "idle"  # neither tailing nor catching up (leading, fencing, settling)
    FOLLOW = "follow"
    CATCH_UP = "catch_up"


@dataclasses.dataclass
class _Pending:
    write: Write
    reply: Reply | None  # None: the leader's own probe
    deadline_ms: int | None = None  # when its client stops waiting (None: never)


@dataclasses.dataclass
class _InFlight:
    revision: int
    payloads: list[bytes]
    waiting: list[tuple[_Pending, Response]]


@dataclasses.dataclass(eq=False)
class _Waiter:
    offset: int
    done: Callable[[errors.StoreError | None], None]


class Replica:
    def __init__(self, world: World, actor: Actor, shard: int, store: MemoryShard,
                 leader_hint: Callable[[int], str | None]) -> None:
        self.world = world
        self.actor = actor
        self.shard = shard
        self.store = store
        self.leader_hint = leader_hint
        self.role = RoleMachine(shard)
        self.writer: SimWriter | None = None
        self.queue: collections.deque[_Pending] = collections.deque()
        self.in_progress: set[str] = set()  # request ids queued or committing here (membership only)
        self.in_flight: _InFlight | None = None
        self.mode = _Mode.IDLE
        self.waiters: list[_Waiter] = []
        self.probing = False
        self._catch_up_end = 0
        self._catch_up_deadline = 0
        self._fetch_token = 0
        self._settle_token = 0
        self._batch_timer = False
        self._lead_timer = False
        t = world.timing
        self._limits = BatchLimits(t.batch_records, t.batch_bytes, t.record_bytes)
        self._applied = world.audit.applied.setdefault((actor.name, shard), [])

    def start(self) -> None:
        self._follow()

    @property
    def holding(self) -> bool:
        """Still acting as leader (what the group waits for before moving the shard)."""
        return self.role.role not in (Role.FOLLOWER, Role.STOPPED) or self.in_flight is not None

    # ---- leadership, as the group says --------------------------------------------------------------

    def set_lead(self, lead: bool) -> None:
        why = self.role.set_lead(lead)
        assert why is None, why  # nothing in the simulation makes a replica unable to lead
        if lead:
            self._try_lead()
        else:
            self._resign()

    def _try_lead(self) -> None:
        if self.role.role is not Role.FOLLOWER or not self.role.keeps_leading or self._lead_timer:
            return
        self._fetch_token += 1  # the tail stops
        self.mode = _Mode.IDLE
        self.role.begin_fencing()
        writer = self.writer = SimWriter(self.world, self.actor, self.shard)
        self.world.trace.log(f"{self.actor.name} s{self.shard} fencing")
        writer.fence(lambda result: self._on_fenced(writer, result))

    def _resign(self) -> None:
        role = self.role.role
        if role is Role.CATCHING_UP or (role is Role.LEADING and self.in_flight is None):
            self.role.step_down()
            self._stepped_down()
        # FENCING, or LEADING with a batch in flight: that step ends first and sees the change.

    def _on_fenced(self, writer: SimWriter, result: Result) -> None:
        if writer is not self.writer:
            return
        if isinstance(result, wal_errors.WalError):
            self.world.trace.log(f"{self.actor.name} s{self.shard} fence failed: {type(result).__name__}")
            self.role.resync_failed()
            self._stepped_down()
            return
        assert isinstance(result, int)
        if not self.role.fenced(result):
            self._stepped_down()
            return
        writer.identity = WriterIdentity(self.actor.name, self.role.term)
        self._catch_up(result)

    def _catch_up(self, end: int) -> None:
        """Replay from the checkpoint to `end` before leading (W6)."""
        self.store.rewind_unverified()  # the marker slot this node assumed when it led before
        if self.store.applied_offset > end:
            self.world.violation(f"W6: {self.actor.name} shard {self.shard} checkpoint {self.store.applied_offset} "
                                 f"beyond the end {end} it fenced at")
        self.mode = _Mode.CATCH_UP
        self._catch_up_end = end
        self._catch_up_deadline = self.world.sched.now + self.world.timing.bootstrap_timeout_ms
        self._catch_up_progress()

    def _catch_up_progress(self) -> None:
        if not self.role.keeps_leading:
            self.role.step_down()
            self._stepped_down()
            return
        end = self._catch_up_end
        if self.store.applied_offset >= end:
            self.mode = _Mode.IDLE
            if not self.role.replayed_to(end):
                self._stepped_down()
                return
            self.world.audit.counters["leaderships"] += 1
            self.world.trace.log(f"{self.actor.name} s{self.shard} leading at {end} term {self.role.term}")
            self._maybe_start_batch()
            return
        if self.world.sched.now > self._catch_up_deadline:
            self.role.resync_failed()
            self._stepped_down()
            return
        self._fetch(upto=end)

    def _settle(self) -> None:
        """After a definite abort: read the settled end (LSO == HW), then replay to it."""
        self._settle_token += 1
        token = self._settle_token
        world = self.world
        deadline = world.sched.now + world.timing.call_timeout_ms

        def ask() -> None:
            back = world.net.answer_to(self.actor)

            def at_broker() -> None:
                lso, hw = world.broker.ends(self.shard)
                back(lambda: answer(lso, hw))

            world.net.send(at_broker, None)

        def answer(lso: int, hw: int) -> None:
            if token != self._settle_token or self.role.role is not Role.CATCHING_UP:
                return
            if not self.role.keeps_leading:
                self.role.step_down()
                self._stepped_down()
            elif lso == hw:
                self._catch_up(hw)
            elif world.sched.now < deadline:
                world.sched.at(world.timing.settle_poll_ms, ask, self.actor)
            else:
                self.role.resync_failed()
                self._stepped_down()

        def timed_out() -> None:
            if token == self._settle_token and self.role.role is Role.CATCHING_UP and self.mode is _Mode.IDLE:
                self.role.resync_failed()
                self._stepped_down()

        world.sched.at(world.timing.call_timeout_ms * 2, timed_out, self.actor)
        ask()

    def _stepped_down(self) -> None:
        """Nothing of the leadership runs any more: refuse what waited, close the writer, follow."""
        assert self.in_flight is None
        self.role.stepped_down()
        self._settle_token += 1
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        refusal = errors.UnavailableError(f"shard {self.shard}: leadership lost; retry")
        while self.queue:
            self._answer(self.queue.popleft(), refusal)
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            waiter.done(refusal)
        self.world.trace.log(f"{self.actor.name} s{self.shard} follower")
        self._follow()
        if self.role.keeps_leading:  # lost it while still assigned (fenced): take it again, later
            self._lead_timer = True

            def again() -> None:
                self._lead_timer = False
                self._try_lead()

            self.world.sched.at(self.world.timing.refence_pause_ms, again, self.actor)

    # ---- following ----------------------------------------------------------------------------------

    def _follow(self) -> None:
        self.store.rewind_unverified()
        self.mode = _Mode.FOLLOW
        self._fetch(upto=None)

    def _fetch(self, upto: int | None) -> None:
        self._fetch_token += 1
        token = self._fetch_token
        position = self.store.applied_offset
        world, actor, shard = self.world, self.actor, self.shard
        t = world.timing
        back = world.net.answer_to(actor)

        def at_broker() -> None:
            world.broker.fetch(shard, position, upto, t.fetch_limit, t.fetch_wait_ms,
                               lambda result: back(lambda: self._on_fetch(token, position, result)))

        world.net.send(at_broker, None)
        world.sched.at(t.fetch_timeout_ms, lambda: self._fetch_lost(token), actor)

    def _fetch_lost(self, token: int) -> None:
        if token == self._fetch_token:
            self._continue()

    def _on_fetch(self, token: int, position: int, result: FetchResult) -> None:
        if token != self._fetch_token:
            return
        self._fetch_token += 1
        assert position == self.store.applied_offset, (position, self.store.applied_offset)
        accepted: list[tuple[int, bytes]] = []
        for offset, value, headers in result.records:
            verdict, accepted_record = judge(offset, value, headers)  # W3
            if verdict is Verdict.ACCEPTED:
                assert accepted_record is not None
                accepted.append((offset, accepted_record.payload))
            else:
                self.world.audit.counters[f"w3_{verdict.value}"] += 1
        if accepted or result.next_position > position:
            self._apply(accepted, result.next_position)
        self._continue()

    def _continue(self) -> None:
        if self.mode is _Mode.FOLLOW:
            self._fetch(upto=None)
        elif self.mode is _Mode.CATCH_UP:
            self._catch_up_progress()

    def _apply(self, records: list[tuple[int, bytes]], checkpoint: int, unverified: int | None = None) -> None:
        self.store.apply(records, checkpoint, unverified=unverified)
        self._applied.extend(records)
        if self.waiters:
            ready = [w for w in self.waiters if self.store.applied_offset >= w.offset]
            if ready:
                self.waiters = [w for w in self.waiters if self.store.applied_offset < w.offset]
                for waiter in ready:
                    waiter.done(None)

    # ---- writes -------------------------------------------------------------------------------------

    def write(self, write: Write, deadline_ms: int | None, reply: Reply) -> None:
        refusal = self.role.write_refusal(self.leader_hint(self.shard))
        if refusal is not None:
            reply(refusal)
            return
        t = self.world.timing
        answer = admit(write, self.store, self.in_progress, self.world.sched.now, horizon_ms=t.request_horizon_ms,
                       skew_ms=t.clock_skew_ms)
        if answer is not None:
            reply(answer)
            return
        if len(self.queue) >= self.world.timing.max_pending:
            reply(errors.OverloadedError(f"shard {self.shard}: writes pending; back off"))
            return
        if write.request_id:
            self.in_progress.add(write.request_id)
        self.queue.append(_Pending(write, reply, deadline_ms))
        self._maybe_start_batch()

    def _answer(self, pending: _Pending, answer: Answer) -> None:
        if pending.write.request_id:
            self.in_progress.discard(pending.write.request_id)
        if pending.reply is None:
            self.probing = False
        else:
            pending.reply(answer)

    def _maybe_start_batch(self) -> None:
        if self._batch_timer or not self.queue or not self.role.may_start_batch():
            return
        self._batch_timer = True
        self.world.sched.at(self.world.timing.linger_ms, self._start_batch, self.actor)

    def _start_batch(self) -> None:
        self._batch_timer = False
        if not self.queue or not self.role.may_start_batch():
            return
        upcoming = self.role.upcoming
        assert upcoming is not None and self.writer is not None
        if self.store.applied_offset != upcoming:
            self.world.violation(f"W6: {self.actor.name} shard {self.shard} plans at {upcoming} from a state at "
                                 f"{self.store.applied_offset}")
        taken = [self.queue.popleft() for _ in range(min(len(self.queue), 2 * self._limits.max_records))]
        now = self.world.sched.now
        for pending in taken:
            if pending.deadline_ms is not None and pending.deadline_ms < now and pending.write.request_id:
                self.in_progress.discard(pending.write.request_id)  # its client gave up: not written
        taken = [p for p in taken if p.deadline_ms is None or p.deadline_ms >= now]
        if not taken:
            self._maybe_start_batch()
            return
        t = self.world.timing
        plan = plan_batch([p.write for p in taken], upcoming, self.store.get, self.store, now, self._limits,
                          horizon_ms=t.request_horizon_ms, skew_ms=t.clock_skew_ms)
        for index, answer in plan.now:
            self._answer(taken[index], answer)
        for index in reversed(plan.carry):
            self.queue.appendleft(taken[index])
        waiting = [(taken[index], response) for index, response in plan.after_commit]
        if plan.payloads:
            self.role.batch_started(plan.revision, len(plan.payloads))
            self.in_flight = _InFlight(plan.revision, plan.payloads, waiting)
            writer = self.writer
            writer.append(plan.payloads, plan.revision, lambda result: self._on_appended(writer, result))
            return
        if waiting:  # read-only Txns: their answers need a barrier to be linearizable

            def answered(error: errors.StoreError | None) -> None:
                for pending, response in waiting:
                    self._answer(pending, error if error is not None else response)

            self.barrier(answered)
        self._maybe_start_batch()

    def _on_appended(self, writer: SimWriter, result: Result) -> None:
        if writer is not self.writer:
            return
        in_flight, self.in_flight = self.in_flight, None
        assert in_flight is not None
        if isinstance(result, AppendResult):
            self._apply(list(zip(result.offsets, in_flight.payloads, strict=True)), result.upcoming_offset,
                        unverified=result.marker_slot)  # the marker's slot is assumed, not read
            self.world.audit.counters["batches"] += 1
            for pending, response in in_flight.waiting:  # W5: answered only now
                self._answer(pending, response)
            # As the node does: the machine's bookkeeping only once every client has its answer.
            self.role.batch_committed(result.offsets, result.upcoming_offset)
            if self.role.keeps_leading:
                self._maybe_start_batch()
            else:
                self.role.step_down()
                self._stepped_down()
            return
        assert isinstance(result, wal_errors.WalError)
        decision = self.role.batch_failed(append_outcome(result))
        self.world.audit.counters[f"append_{append_outcome(result).value}"] += 1
        self.world.trace.log(f"{self.actor.name} s{self.shard} batch at {in_flight.revision} failed: "
                             f"{type(result).__name__}: {result} -> {decision.then.value}")
        error = decision.error(self.shard)
        for pending, _ in in_flight.waiting:
            self._answer(pending, error)
        if decision.then is Next.REFENCE:
            writer.fence(lambda fenced: self._on_fenced(writer, fenced))
        elif decision.then is Next.SETTLE:
            self._settle()
        else:
            self._stepped_down()

    # ---- reads ----------------------------------------------------------------------------------------

    def read(self, key: bytes, reply: Callable[[ReadAnswer], None]) -> None:
        """A linearizable Get: through the leader's read barrier."""
        refusal = self.role.write_refusal(self.leader_hint(self.shard))
        if refusal is not None:
            reply(refusal)
            return

        def served(error: errors.StoreError | None) -> None:
            if error is not None:
                reply(error)
                return
            state = self.store.get(key)
            response = kv_pb2.GetResponse(found=state is not None)
            if state is not None:
                response.kv.CopyFrom(key_value(key, state))
            reply(response)

        self.barrier(served)

    def barrier(self, done: Callable[[errors.StoreError | None], None]) -> None:
        """Read the high watermark e; the machine says whether to serve once below e is applied,
        or to refuse and probe (someone else wrote beyond this leader's writes)."""
        world = self.world
        back = world.net.answer_to(self.actor)

        def at_broker() -> None:
            _, hw = world.broker.ends(self.shard)
            back(lambda: answer(hw))

        def answer(hw: int) -> None:
            verdict = self.role.barrier(hw)
            if verdict.wait_for is None:
                self._probe()
                done(errors.UnavailableError(verdict.why))
                return
            if self.store.applied_offset >= verdict.wait_for:
                done(None)
                return
            waiter = _Waiter(verdict.wait_for, done)
            self.waiters.append(waiter)

            def expire() -> None:
                if any(w is waiter for w in self.waiters):
                    self.waiters = [w for w in self.waiters if w is not waiter]
                    done(errors.UnavailableError(f"shard {self.shard}: applied {self.store.applied_offset}, "
                                                 f"waited for {waiter.offset}"))

            world.sched.at(world.timing.barrier_timeout_ms, expire, self.actor)

        world.net.send(at_broker, None)

    def _probe(self) -> None:
        if self.probing or self.role.role is not Role.LEADING:
            return
        self.probing = True
        self.queue.append(_Pending(probe_write(), None))
        self._maybe_start_batch()
