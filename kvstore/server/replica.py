"""One shard's replica on a node: the asyncio driver of `kvstore.core.replica.ReplicaMachine`.

Every protocol decision is the machine's (following, fencing, catching up, group commit, what
a failed append leads to, the read barrier, stepping down, rebuilding; docs/design.md §5.1).
This module is to it what `wal.writer.ShardWriter._drive` is to the guard: it reports what
happened as events and performs the actions the machine returns, in order. Blocking calls
(librdkafka, snapshot loads) run in worker threads as tasks whose results come back as events;
LevelDB is touched only from the event-loop thread, so applies and reads never race.

Three things it owns because they are about I/O, not the protocol: a writer closed only once
no call runs on it (closing under a running commit_transaction would crash or hang it); a
standby's spare writer, connected ahead of a takeover (`ShardWriter.prepare`); and the bound on
a shutdown, past which an append still running is reported cancelled (its clients hear
"unknown outcome") while its thread finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
from collections.abc import Callable, Coroutine
from typing import Any

import wal
import wal.clients
import wal.guard
import wal.writer
from kvstore import errors, limits
from kvstore.core import replica as core
from kvstore.core.batch import BatchLimits
from kvstore.core.evaluate import Response
from kvstore.core.locks import LockView
from kvstore.core.replica.performers import perform_all
from kvstore.core.role import Role, append_outcome
from kvstore.core.state import Change, DecidedTxn, KeyState, RequestRecord
from kvstore.server import failpoints, restore
from kvstore.server.clock import SYSTEM_CLOCK, Clock
from kvstore.server.config import ReplicaConfig
from kvstore.server.metrics import Metrics
from kvstore.server.watch import Watcher
from kvstore.storage.shard_store import ShardStore, StorageError

log = logging.getLogger(__name__)

FOLLOW_POLL_S = 0.1  # a follower's poll (a takeover waits for at most one)
CATCH_UP_POLL_S = 0.02  # a takeover waits for the tail (often one batch and its marker): poll briskly
REFENCE_PAUSE_S = 1.0  # after being fenced while still assigned the shard, before fencing back
# Kafka's default replica.lag.time.max.ms: for about this long a restarted or newly elected
# partition leader may report a high watermark below what was acknowledged before.
BROKER_REPLICA_LAG_TIME_MAX_MS = 30_000
# How long a checkpoint beyond the partition end must persist before the replica is rebuilt:
# longer than the broker's own window above, so a stale end is waited out, never wiped over.
BEYOND_END_GRACE_S = BROKER_REPLICA_LAG_TIME_MAX_MS / 1000 * 1.5


class _View:
    """The machine's read-only view of the store: always the current one (a snapshot load
    swaps the store object)."""

    def __init__(self, replica: ShardReplica) -> None:
        self._replica = replica

    @property
    def applied_offset(self) -> int:
        return self._replica.store.applied_offset

    @property
    def evicted_through_ms(self) -> int:
        return self._replica.store.evicted_through_ms

    def get(self, key: bytes) -> KeyState | None:
        return self._replica.store.get(key)

    def request(self, request_id: str) -> RequestRecord | None:
        return self._replica.store.request(request_id)

    @property
    def locks(self) -> LockView:
        return self._replica.store.locks

    def decided_txn(self, txn_id: str) -> DecidedTxn | None:
        return self._replica.store.decided_txn(txn_id)

    def decided_request(self, request_id: str) -> DecidedTxn | None:
        return self._replica.store.decided_request(request_id)


def machine_config(config: ReplicaConfig, standby: bool) -> core.ReplicaConfig:
    """The machine's bounds, from the node's settings (one source: `kvstore.limits` via config)."""
    return core.ReplicaConfig(
        shard=config.shard, standby=standby,
        batch_limits=BatchLimits(config.max_batch_records, config.max_batch_bytes, config.max_record_bytes),
        max_pending=config.max_pending_writes, linger_ms=config.linger_ms,
        patient_linger_ms=max(config.linger_ms, limits.PATIENT_LINGER_MS),
        bootstrap_timeout_ms=config.bootstrap_timeout_s * 1000, barrier_timeout_ms=config.barrier_timeout_s * 1000,
        refence_pause_ms=REFENCE_PAUSE_S * 1000, beyond_end_grace_ms=BEYOND_END_GRACE_S * 1000)


class ShardReplica:
    def __init__(self, config: ReplicaConfig, metrics: Metrics, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.clock = clock  # every wait and every time stamp (kvstore.server.clock)
        self.shard = config.shard
        self.metrics = metrics
        self.store = ShardStore(config.data_dir / f"shard-{config.shard}", topic=config.topic, shard=config.shard,
                                max_request_ids=config.max_request_ids)
        # A snapshot load cut short (crash) leaves its scratch directory: never trust it.
        shutil.rmtree(restore.scratch_path(self.store.path), ignore_errors=True)
        self.machine = core.ReplicaMachine(machine_config(config, standby=True), _View(self))
        self.end_offset = 0  # last known high watermark
        self.watchers: set[Watcher] = set()
        self.ends = wal.clients.PartitionEnds(config.bootstrap_servers, config.call_timeout_s, config.kafka_security)
        # Where the leader is, for "not the leader" answers; the node sets it (group view).
        self.leader_hint: Callable[[], str] = lambda: ""
        # Told (shard, reason) when this replica cannot lead (it must leave the assignment so
        # that another node leads) and (shard, None) once it can again; the node sets it.
        self.on_unable_to_lead: Callable[[int, str | None], None] = lambda shard, reason: None
        # Asked to resolve prepared transactions a read waits on (T4); the node sets it (its resolvers).
        self.resolve_now: Callable[[tuple[str, ...]], None] = lambda txn_ids: None
        # Bumped whenever the store may go back or miss a committed batch (a wipe, a failed apply,
        # a restart of the machine, a stop): a read cleared before must not read after (`unchanged_since`).
        self.state_epoch = 0
        self._tickets: dict[int, asyncio.Future[Any]] = {}  # requests waiting for an AnswerRequest
        self._reads: set[int] = set()  # which of them are read barriers
        self._next_ticket = 0
        self._later: list[core.Event] = []  # results of local actions, stepped after the current list
        self._relead_to: core.ReplicaMachine | None = None  # a started-over machine that will be told to lead
        self._stepping = False
        self._changed = asyncio.Event()  # set after every step: waits for the machine's state
        self._applied = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        # The one timer that ticks the machine at the time it asked for (`wake_at_ms`).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_ms = 0.0
        self._exited = asyncio.Event()
        self._writer: wal.ShardWriter | None = None
        self._writer_call: asyncio.Future[Any] | None = None  # fence / append / settled end running in a thread
        self._closing: list[asyncio.Task[None]] = []
        self._spare: wal.ShardWriter | None = None  # a standby's connected, unfenced writer
        self._spare_task: asyncio.Task[None] | None = None
        self._reader: wal.Replayer | None = None
        self._reader_call: asyncio.Future[Any] | None = None
        self._counted_rejections = 0  # W3 rejections of `_reader` already counted
        self._txn_started: float | None = None
        self._fence_started = 0.0
        label = str(self.shard)
        for family in (metrics.w3_rejections, metrics.fencings, metrics.leader_changes, metrics.rebuilds,
                       metrics.snapshot_loads):
            family.labels(shard=label)  # export zeros from the start, so rates and alerts work
        metrics.applied_offset.labels(shard=label).set(self.store.applied_offset)
        if self.store.rebuilt_reason:
            metrics.rebuilds.labels(shard=label).inc()

    # ---- what the node and the API ask ----------------------------------------------------------------

    @property
    def role(self) -> Role:
        return self.machine.role.role

    @property
    def term(self) -> int:
        return self.machine.term

    @property
    def caught_up(self) -> bool:
        return self.machine.caught_up

    def start(self, lead: bool, standby: bool = True) -> None:
        """Run the replica: lead while `lead` (see `set_lead`), otherwise follow the shard if
        `standby` (so a takeover replays only a short tail) or stay idle at its checkpoint."""
        self.machine.config = dataclasses.replace(self.machine.config, standby=standby)
        self._step(core.Started())
        if lead:
            self._step(core.LeadChanged(True))

    def set_standby(self, standby: bool) -> None:
        """Follow the shard while not leading (True) or stay at the checkpoint: from the next time
        the replica stops leading or starts over."""
        self.machine.config = dataclasses.replace(self.machine.config, standby=standby)

    def set_lead(self, lead: bool) -> None:
        """Gain (or drop, without waiting) leadership."""
        self._relead_to = None  # told now: a lead pending since a start-over is moot
        self._step(core.LeadChanged(lead))

    async def resign(self, timeout_s: float) -> None:
        """Stop leading: the batch in flight finishes and is answered, queued writes are refused
        (UNAVAILABLE, retriable elsewhere), and nothing more is written. Bounded by `timeout_s`."""
        self._relead_to = None
        self._step(core.LeadChanged(False))
        if not await self._until(lambda: not self.machine.holding, timeout_s):
            log.warning("shard %d: still leading %.1fs after resigning", self.shard, timeout_s)

    async def stop(self) -> None:
        """Graceful: stop taking writes, let the batch in flight finish and answer its clients.
        Past 2 x call_timeout_s an append still running is reported cancelled (its clients hear
        "unknown outcome"); its producer is closed only once its thread returned."""
        self._state_changed()
        self._step(core.StopRequested())
        bound_s = self.config.call_timeout_s * 2
        if not await self._until(self._exited.is_set, bound_s):
            log.warning("shard %d: replica did not stop within %.1fs; cutting its calls short", self.shard, bound_s)
            self._step(core.StopOverdue())
        if self._timer is not None:
            self._timer.cancel()
        if self._tasks:  # a poll, an end read, a snapshot load: each returns within its own bound
            await asyncio.wait(set(self._tasks), timeout=self.config.call_timeout_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*self._closing, return_exceptions=True)
        for watcher in list(self.watchers):  # the node stops, or placement dropped the shard here
            watcher.close(f"shard {self.shard}: this node stopped serving it")
        await self._close_reader()
        if self._spare_task is not None:
            await asyncio.gather(self._spare_task, return_exceptions=True)
        spare, self._spare = self._spare, None
        if spare is not None:
            await asyncio.to_thread(spare.close)
        self.store.close()

    def require_leader(self) -> None:
        """For a leader-local read: the machine's verdict on serving it here now."""
        refusal = self.machine.role.write_refusal(self.leader_hint())
        if refusal is not None:
            raise refusal

    async def write(self, request: core.WriteRequest, size: int) -> Response:
        """Queue a write (its request as data, `kvstore.core.replica.writes`) for the next batch
        and wait for its answer (after commit). `size`: the request's bytes, a pre-bound on the batch."""
        ticket, future = self._ticket()
        self._step(core.WriteArrived(ticket, request, size, self.leader_hint()))
        answer: Response = await future
        return answer

    async def barrier(self, keys: tuple[bytes, ...] = (), span: tuple[bytes, bytes | None] | None = None) -> int:
        """Linearizable read barrier (docs/design.md §5), shared by the reads waiting at that
        moment; then, for `keys` or `span`, until no prepared cross-shard transaction holds an
        exclusive lock on what is read (T4, bounded: the machine's `read_lock_wait_ms`).
        Returns the state epoch the read was cleared in: read the store only while
        `unchanged_since` it (between the answer and the caller's resumption the store may
        have been wiped)."""
        epoch = self.state_epoch
        ticket, future = self._ticket()
        self._reads.add(ticket)
        future.add_done_callback(lambda _f: self._reads.discard(ticket))
        self._step(core.ReadArrived(ticket, self.leader_hint(), keys, span))
        await future
        self.unchanged_since(epoch)
        return epoch

    def unchanged_since(self, epoch: int) -> None:
        """Raise UNAVAILABLE (retriable: nothing was read) if the store may have gone back or
        missed a committed batch since `epoch` (`state_epoch`). Callers read the store right
        after, with no await in between."""
        if self.state_epoch != epoch:
            raise errors.UnavailableError(f"shard {self.shard}: this replica's state changed while the read waited "
                                          "(a failed apply, a rebuild or a restart); nothing was read: retry")

    def _state_changed(self) -> None:
        self.state_epoch += 1

    def check_fenced(self) -> bool:
        """Told that someone may have fenced us: probe the log (an empty entry); if we were
        fenced it fails and the leader steps down. False if this replica does not lead."""
        if self.role is not Role.LEADING:
            return False
        self._step(core.ProbeRequested())
        return True

    async def next_apply(self, timeout_s: float) -> None:
        """Until the store applies anything more (or `timeout_s` passes, silently)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._applied.wait(), timeout_s)

    async def wait_applied(self, offset: int, timeout_s: float) -> None:
        """Until everything below `offset` is applied here (a stale read's freshness floor)."""
        deadline = self.clock.monotonic() + timeout_s
        while self.store.applied_offset < offset:
            remaining = deadline - self.clock.monotonic()
            if remaining <= 0:
                raise errors.UnavailableError(
                    f"shard {self.shard}: applied {self.store.applied_offset}, waited for {offset}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._applied.wait(), remaining)

    def open_txn_age_ms(self) -> int:
        started = self._txn_started
        return int((self.clock.monotonic() - started) * 1000) if started is not None else 0

    def writer_config(self) -> wal.WriterConfig:
        return writer_config(self.config)

    # ---- the driver --------------------------------------------------------------------------------------

    def _ticket(self) -> tuple[int, asyncio.Future[Any]]:
        self._next_ticket += 1
        ticket = self._next_ticket
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._tickets[ticket] = future

        def gone(f: asyncio.Future[Any]) -> None:
            if f.cancelled() and self._tickets.pop(ticket, None) is not None and not self.machine.exited:
                self._step(core.ClientGone(ticket))

        future.add_done_callback(gone)
        return ticket, future

    def _step(self, event: core.Event) -> None:
        """Report `event`, perform what follows; results of local actions are stepped after
        the current list, never inside it."""
        if self._stepping:
            self._later.append(event)
            return
        self._stepping = True
        try:
            pending = [event]
            while pending:
                for next_event in pending:
                    if self.machine.exited:
                        self._refuse_after_exit(next_event)
                        continue
                    if isinstance(next_event, core.CommitApplied):
                        # The machine's bookkeeping (and its paired W2 assertions) only now, after
                        # every client of the batch has its committed answer.
                        failpoints.check("bookkeeping-after-commit")
                    self._perform_all(self.machine.step(next_event, now_ms=self.clock.monotonic() * 1000,
                                                        unix_ms=self.clock.unix_ms()))
                pending, self._later = self._later, []
        except Exception as exc:
            self._later = []
            self._start_over(exc)
        finally:
            self._stepping = False
            self._changed.set()
            self._changed = asyncio.Event()
        self._schedule_tick()

    def _report(self, machine: core.ReplicaMachine, event: core.Event) -> None:
        """The result of an action `machine` asked for: dropped if that machine is gone (started
        over, or exited)."""
        if machine is self.machine and not machine.exited:
            self._step(event)

    def _refuse_after_exit(self, event: core.Event) -> None:
        if isinstance(event, (core.WriteArrived, core.ReadArrived)):
            future = self._tickets.pop(event.ticket, None)
            if future is not None and not future.done():
                future.set_exception(errors.UnavailableError(f"shard {self.shard}: node shutting down"))

    def _start_over(self, exc: Exception) -> None:
        """The machine (or performing what it asked) raised: a bug, or a paired assertion that
        failed. Like a process that crashes on an assertion, the replica starts over from what
        is durable (the store and the WAL) with a fresh machine; every request still waiting is
        told "unknown outcome" (a batch may have been committing), the writer is closed once no
        call runs on it (the next fence settles its transaction)."""
        log.error("shard %d: the replica failed (%s: %s); starting it over from the store and the WAL", self.shard,
                  type(exc).__name__, exc, exc_info=exc)
        old = self.machine
        self._state_changed()
        tickets, self._tickets = self._tickets, {}
        for ticket, future in tickets.items():
            if not future.done():
                future.set_exception(errors.UnavailableError(f"shard {self.shard}: replica restarting; retry")
                                     if ticket in self._reads else errors.UnknownOutcomeError(
                                         f"shard {self.shard}: replica restarting; retry with the same request id"))
        self._reads.clear()
        self._close_writer()
        self._writer_call = None
        self._txn_started = None
        self._spawn(self._close_reader())
        machine = self.machine = core.ReplicaMachine(old.config, _View(self))
        machine.role.unable.update(old.role.unable)
        if old.exited or old.role.stopping:
            machine.exited = True
            self._exited.set()
            return
        # Its first results (a rewind done at once) are stepped after the pause, not left in
        # `_later`, which the failed step dropped: a follower would wait in its rewind for an
        # event that never comes. The pause bounds how fast a replica that keeps failing restarts.
        results = perform_all(self, machine.step(core.Started(), now_ms=self.clock.monotonic() * 1000,
                                                 unix_ms=self.clock.unix_ms()))
        loop = asyncio.get_running_loop()
        if results:
            loop.call_later(REFENCE_PAUSE_S, self._report_all, machine, results)
        # The intent to lead goes to the new machine, and on to the next if this one starts over
        # before the pause is out (its own want_lead is not set until it is told).
        if old.role.want_lead or self._relead_to is old:
            self._relead_to = machine
            loop.call_later(REFENCE_PAUSE_S, self._relead, machine)

    def _report_all(self, machine: core.ReplicaMachine, events: list[core.Event]) -> None:
        for event in events:
            self._report(machine, event)

    def _relead(self, machine: core.ReplicaMachine) -> None:
        if self._relead_to is machine:
            self._relead_to = None
            self._report(machine, core.LeadChanged(True))

    def _perform_all(self, actions: list[core.Action]) -> None:
        """Through the core's one table (`kvstore.core.replica.performers`): results of local
        work are stepped after the list."""
        self._later.extend(perform_all(self, actions))

    # ---- the performers (kvstore.core.replica.performers.Performers) ------------------------------

    def perform_answer(self, action: core.AnswerRequest) -> None:
        future = self._tickets.pop(action.ticket, None)
        if future is not None and not future.done():
            if isinstance(action.answer, Exception):
                future.set_exception(action.answer)
            else:
                future.set_result(None if action.answer is core.READY else action.answer)

    def perform_set_term(self, action: core.SetTerm) -> None:
        assert self._writer is not None
        self._writer.identity = wal.WriterIdentity(self.config.node_id, action.term)

    def perform_read_end(self, action: core.ReadEnd) -> None:
        self._spawn(self._read_end(self.machine, action.purpose))

    def perform_rewind(self, action: core.RewindUnverified) -> None:
        self.store.rewind_unverified()

    def perform_wipe(self, action: core.Wipe) -> None:
        self._state_changed()
        self.store.wipe(action.reason)
        self._end_watches(f"shard {self.shard}: the replica serving this watch is rebuilding ({action.reason})")
        self._after_apply([])

    def perform_load_snapshot(self, action: core.LoadSnapshot) -> None:
        self._spawn(self._load_snapshot(self.machine, action))

    def perform_close_writer(self, action: core.CloseWriter) -> None:
        self._close_writer()

    def perform_unable(self, action: core.Unable) -> None:
        self._state_changed()  # e.g. a committed batch failed to apply: the store lacks it
        self.on_unable_to_lead(self.shard, action.reason)

    def perform_able(self, action: core.Able) -> None:
        self.on_unable_to_lead(self.shard, None)

    def perform_resolve_now(self, action: core.ResolveNow) -> None:
        self.resolve_now(action.txn_ids)

    def perform_exit(self, action: core.Exit) -> None:
        self._exited.set()

    def perform_note(self, note: core.Note) -> None:
        if note.metric:
            getattr(self.metrics, note.metric).labels(shard=str(self.shard)).inc()
        if note.text:
            log.log(logging.WARNING if note.warning else logging.INFO, "%s", note.text)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = self.clock.monotonic() + timeout_s
        while not done():
            remaining = deadline - self.clock.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    def _schedule_tick(self) -> None:
        """Keep one timer at the machine's `wake_at_ms` (a linger, a deadline): rescheduled only
        when the machine wants to be woken earlier than it is set for."""
        wake = self.machine.wake_at_ms()
        if wake is None or self.machine.exited:
            return
        if self._timer is not None:
            if self._timer_at_ms <= wake:
                return
            self._timer.cancel()
        self._timer_at_ms = wake
        delay_s = max(0.0, wake / 1000 - self.clock.monotonic())
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if not self.machine.exited:
            self._step(core.Tick())

    # ---- the writer --------------------------------------------------------------------------------------

    def _writer_thread(self, call: Callable[..., Any], *args: Any,
                       done: Callable[[asyncio.Future[Any]], None]) -> None:
        """One writer call in a worker thread, shielded: a shutdown must not make it look
        finished while librdkafka may still commit."""
        assert self._writer_call is None or self._writer_call.done(), "two writer calls at once"
        future = asyncio.ensure_future(asyncio.to_thread(call, *args))
        self._writer_call = future
        future.add_done_callback(done)

    def perform_fence(self, action: core.Fence) -> None:
        if self._writer is None:
            self._writer, self._spare = self._spare or wal.ShardWriter(self.writer_config()), None
        writer, machine = self._writer, self.machine
        self._fence_started = self.clock.monotonic()

        def done(f: asyncio.Future[Any]) -> None:
            error = None if f.cancelled() else f.exception()
            if f.cancelled() or error is not None:
                self._report(machine, core.FenceFailed(f"{type(error).__name__}: {error}" if error else "cancelled"))
                return
            log.info("shard %d: fenced in %d ms", self.shard, (self.clock.monotonic() - self._fence_started) * 1000)
            self._report(machine, core.Fenced(f.result()))

        self._writer_thread(writer.fence, done=done)

    def perform_append(self, action: core.Append) -> None:
        writer, machine = self._writer, self.machine
        assert writer is not None
        self._txn_started = started = self.clock.monotonic()

        def done(f: asyncio.Future[Any]) -> None:
            self._txn_started = None
            error = None if f.cancelled() else f.exception()
            if error is None and not f.cancelled():
                result: wal.AppendResult = f.result()
                label = str(self.shard)
                self.metrics.commit_latency.labels(shard=label).observe(self.clock.monotonic() - started)
                self.metrics.batch_records.labels(shard=label).observe(len(action.payloads))
                self._report(machine, core.Appended(result.offsets, result.upcoming_offset, result.marker_slot))
            else:
                if not isinstance(error, wal.WalError):
                    log.error("shard %d: the append failed unexpectedly", self.shard, exc_info=error)
                outcome = append_outcome(error, writer.phase is wal.guard.Phase.NEEDS_INIT)
                detail = (str(error) if isinstance(error, wal.WalError)
                          else type(error).__name__ if error else "cancelled")
                self._report(machine, core.AppendFailed(outcome, detail))

        self._writer_thread(writer.append, list(action.payloads), action.revision, done=done)

    def perform_read_settled_end(self, action: core.ReadSettledEnd) -> None:
        writer, machine = self._writer, self.machine
        assert writer is not None

        def done(f: asyncio.Future[Any]) -> None:
            error = None if f.cancelled() else f.exception()
            if f.cancelled() or error is not None:
                self._report(machine, core.EndReadFailed(core.EndPurpose.SETTLE, str(error or "cancelled")))
            else:
                self._report(machine, core.EndRead(core.EndPurpose.SETTLE, f.result()))

        self._writer_thread(writer.settled_end_offset, done=done)

    def _close_writer(self) -> None:
        """Close the producer only once no call runs on it: closing under a running
        commit_transaction would turn a commit that may still succeed into a crash or a hang."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        call = self._writer_call

        async def close() -> None:
            if call is not None and not call.done():
                bound_s = self.config.call_timeout_s * 2
                done, _ = await asyncio.wait({call}, timeout=bound_s)
                if not done:
                    log.warning("shard %d: a writer call is still running after %.1fs; its producer is left open "
                                "(the next leader's init_transactions settles its transaction)", self.shard, bound_s)
                    return
            await asyncio.to_thread(writer.close)

        self._closing.append(asyncio.create_task(close()))

    def _prepare_spare(self) -> None:
        """A standby keeps a connected writer that has not fenced anyone (`ShardWriter.prepare`):
        a takeover then fences in ~10 ms instead of ~65 ms, or ~0.5 s when a brand-new
        producer's first coordinator lookup races its connection."""
        if self._spare is not None or (self._spare_task is not None and not self._spare_task.done()):
            return

        async def prepare() -> None:
            spare = wal.ShardWriter(self.writer_config())
            try:
                await asyncio.to_thread(spare.prepare)
            except wal.WalError as exc:  # the takeover will connect by itself
                log.debug("shard %d: no spare writer: %s", self.shard, exc)
                await asyncio.to_thread(spare.close)
                return
            if self.machine.exited or self._spare is not None:
                await asyncio.to_thread(spare.close)
                return
            self._spare = spare

        self._spare_task = asyncio.create_task(prepare())

    # ---- the reader --------------------------------------------------------------------------------------

    def perform_fetch(self, action: core.Fetch) -> None:
        if action.upto is None and self._spare is None:
            self._prepare_spare()

        machine = self.machine

        def report(event: core.Event) -> None:
            self._report(machine, event)

        async def poll() -> None:
            try:
                reader = self._reader
                if reader is None or reader.position != action.from_offset:
                    await self._close_reader()
                    reader = self._reader = await asyncio.to_thread(self._open_reader, action.from_offset)
                    self._counted_rejections = 0
                timeout_s = FOLLOW_POLL_S if action.upto is None else CATCH_UP_POLL_S
                self._reader_call = asyncio.ensure_future(asyncio.to_thread(reader.poll_payloads, timeout_s))
                records = await self._reader_call
            except wal.OffsetOutOfRangeError as exc:
                await self._close_reader()  # librdkafka stops the partition: a new reader seeks again
                report(core.FetchOutOfRange(action.from_offset, exc.below_start, exc.log_start, exc.log_end))
                return
            except Exception as exc:  # the WAL's word or not: this reading cannot go on as it is
                log.log(logging.WARNING if isinstance(exc, (wal.WalError, errors.StoreError)) else logging.ERROR,
                        "shard %d: fetching failed: %s", self.shard, exc)
                await self._close_reader()
                report(core.FetchFailed(f"{type(exc).__name__}: {exc}"))
                return
            rejected = reader.stats.rejected
            if rejected > self._counted_rejections:
                self.metrics.w3_rejections.labels(shard=str(self.shard)).inc(rejected - self._counted_rejections)
                self._counted_rejections = rejected
            report(core.Fetched(action.from_offset, records, reader.position))

        self._spawn(poll())

    def _open_reader(self, position: int) -> wal.Replayer:
        return wal.Replayer(self.config.bootstrap_servers, self.config.topic, self.shard, position,
                            call_timeout_s=self.config.call_timeout_s, security=self.config.kafka_security)

    async def _close_reader(self) -> None:
        """Close the reader once no poll runs on it (bounded: a poll returns within its timeout)."""
        reader, self._reader = self._reader, None
        call, self._reader_call = self._reader_call, None
        if call is not None and not call.done():
            await asyncio.wait({call}, timeout=self.config.call_timeout_s)
        if reader is not None:
            await asyncio.to_thread(reader.close)

    async def _read_end(self, machine: core.ReplicaMachine, purpose: core.EndPurpose) -> None:
        """`machine`: the one that asked, captured when the action was performed: a task starts
        later, and a replica started over meanwhile has a machine that asked nothing."""
        try:
            end = await asyncio.to_thread(self.ends.high_watermark, self.config.topic, self.shard)
            event: core.Event = core.EndRead(purpose, end)
            self.end_offset = max(self.end_offset, end)
        except Exception as exc:
            event = core.EndReadFailed(purpose, f"{type(exc).__name__}: {exc}")
        self._report(machine, event)

    def perform_apply_replayed(self, action: core.ApplyReplayed) -> str | None:
        """Changes are built only for watchers: a bootstrap applies millions of effects that
        nobody watches (`Applied.changes`)."""
        try:
            applied = self.store.apply(list(action.records), action.checkpoint)
        except (StorageError, OSError) as exc:
            log.warning("shard %d: applying replayed records failed: %s", self.shard, exc)
            return f"{type(exc).__name__}: {exc}"
        self._after_apply(applied.changes if self.watchers else [])
        return None

    def perform_apply_committed(self, action: core.ApplyCommitted) -> str | None:
        """W5: a committed batch at the offsets its records were delivered at, with the new
        checkpoint and the assumed marker slot. A failure is reported, never raised: the batch
        is committed either way, and its answers follow."""
        try:
            failpoints.check("apply-after-commit")
            applied = self.store.apply(list(action.records), action.checkpoint, unverified=action.marker_slot)
            self._after_apply(applied.changes if self.watchers else [])
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _end_watches(self, why: str) -> None:
        """The state went back (a wipe) or jumped ahead (a snapshot): what it applies next would
        repeat or skip changes on the streams it feeds, so they end and are resumed."""
        for watcher in list(self.watchers):
            watcher.close(why)
        self.watchers.clear()

    def _after_apply(self, changes: list[Change]) -> None:
        applied_offset = self.store.applied_offset
        self.metrics.applied_offset.labels(shard=str(self.shard)).set(applied_offset)
        self.end_offset = max(self.end_offset, applied_offset)
        for change in changes:
            for watcher in list(self.watchers):
                watcher.offer(self.shard, change)
        if self.watchers:
            # The verified position (not past an assumed marker slot): every change below it was offered.
            now_s, revision = self.clock.monotonic(), self.store.read_revision
            for watcher in list(self.watchers):
                watcher.progress(self.shard, revision, now_s)
        self._applied.set()
        self._applied = asyncio.Event()

    # ---- snapshots ---------------------------------------------------------------------------------------

    async def _load_snapshot(self, machine: core.ReplicaMachine, action: core.LoadSnapshot) -> None:
        """`machine`: the one that asked (as `_read_end`)."""
        loaded = False
        try:
            found = None
            if self.config.snapshot_dir is not None:
                end = await asyncio.to_thread(self.ends.high_watermark, self.config.topic, self.shard)
                found = await restore.load_newest(self.config, self.store.applied_offset, end, action.at_least,
                                                  action.why, self.clock)
            if found is not None and (machine is not self.machine or machine.exited):
                shutil.rmtree(found[0], ignore_errors=True)  # nobody waits for it any more
            elif found is not None:
                self.store = restore.swap_in(self.store, found[0], self.config)
                self._end_watches(f"shard {self.shard}: the replica serving this watch loaded a snapshot "
                                  f"at revision {self.store.applied_offset}")
                self._after_apply([])
                loaded = True
        except Exception as exc:
            log.warning("shard %d: loading a snapshot failed: %s", self.shard, exc)
        self._report(machine, core.SnapshotDone(loaded))


def writer_config(config: ReplicaConfig) -> wal.WriterConfig:
    """The shard's writer: one transactional id per WAL partition, whoever writes (W4), also
    across deployments that share the topic."""
    return wal.WriterConfig(
        bootstrap_servers=config.bootstrap_servers, topic=config.topic, partition=config.shard,
        transactional_id=wal.shard_transactional_id(config.topic, config.shard),
        writer=wal.WriterIdentity(config.node_id, 0),
        transaction_timeout_ms=config.transaction_timeout_ms, call_timeout_s=config.call_timeout_s,
        max_batch_records=config.max_batch_records, max_batch_bytes=config.max_batch_bytes,
        max_record_bytes=config.max_record_bytes, security=config.kafka_security)
