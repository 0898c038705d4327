"""Group commit: a leader's queue of writes, the batch in flight, and the answers after it.

Invariants kept here (docs/design.md §4 "Group commit", §5.1):

* *One batch in flight.* A batch starts only with none in flight, none committing and the
  writer idle (`RoleMachine.may_start_batch` and `batch_started` assert it again). A lone
  write lingers `linger_ms` for company; writes carried over from a full batch go first.
  A lone `patient` write (a resolve or a forget: no client waits on it) lingers
  `patient_linger_ms`, so that the next transaction's prepare shares its Kafka transaction
  rather than queueing behind it; any other write ends that wait at once (it has company), and
  neither a parked write nor a linearizable read in flight (`waiters`: it may be about to wait
  on a lock the resolve releases) ever waits for it.
* *Answered only after the commit* (W5): a batch's answers leave right after its
  `ApplyCommitted`, in one list, and before the machine's bookkeeping at `CommitApplied`.
  Refusals and replays (`Plan.now`) are definite and given at once.
* *W6 before planning*: a leader plans only from a state exactly at its upcoming offset.
* *An id at most once in progress* (W7): a request id queued or committing here (`in_progress`)
  makes a second attempt "unknown for now", never a definite refusal while the first may commit.
* *Bounds*: at most `max_pending` writes queued or parked, the carry at most one batch, every
  write answered exactly once (served, refused, or forgotten when its client is gone).
"""

from __future__ import annotations

import collections
import dataclasses

from kvstore import errors
from kvstore.core.batch import RequestTable, Write, admit, plan_batch, probe_write
from kvstore.core.evaluate import Response
from kvstore.core.replica.actions import Append, ApplyCommitted, Reply
from kvstore.core.replica.config import Mutation, StateView
from kvstore.core.replica.context import Context
from kvstore.core.replica.events import Appended
from kvstore.core.role import RoleMachine
from wal.offsets import batch_end


@dataclasses.dataclass
class Pending:
    ticket: int | None  # None: the leader's own probe
    write: Write
    size: int
    lock_wait_until_ms: float | None = None  # set when it first met a lock: refused after this


@dataclasses.dataclass
class Batch:
    revision: int
    payloads: tuple[bytes, ...]
    answers: list[tuple[int | None, Response]]  # given after the commit (W5)
    ids: list[str]  # the request ids it carries (in progress until it ends)


class _Forgetful:
    """`Mutation.SKIP_REQUEST_DEDUPE`'s request table: it remembers no id."""

    def __init__(self, view: StateView) -> None:
        self._view = view

    def request(self, request_id: str) -> None:
        return None

    @property
    def evicted_through_ms(self) -> int:
        return self._view.evicted_through_ms


class GroupCommit:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.in_flight: Batch | None = None  # its Append is out
        self.committing: tuple[Batch, Appended] | None = None  # answered; CommitApplied next
        self.queue: collections.deque[Pending] = collections.deque()
        # Requests a full batch left over: first in the next one, their order kept. Bounded by one batch.
        self.carry: collections.deque[Pending] = collections.deque()
        # Writes that met a lock of a prepared transaction: back to the queue's front after every
        # apply (which may have released it), refused at their `lock_wait_until_ms`. Bounded by
        # max_pending with the queue.
        self.parked: list[Pending] = []
        self.linger_until_ms: float | None = None
        self.patient_linger = False  # the linger running is `patient_linger_ms`'s
        self.in_progress: set[str] = set()  # request ids with an attempt queued or committing here
        self.probing = False

    @property
    def busy(self) -> bool:
        """A batch in flight, or committed and not yet bookkept."""
        return self.in_flight is not None or self.committing is not None

    @property
    def pending(self) -> int:
        return len(self.queue) + len(self.carry) + len(self.parked)

    # ---- arrivals ------------------------------------------------------------------------------

    def arrive(self, ticket: int, write: Write, size: int) -> None:
        """A write this leader takes (the leadership check passed): admitted, or answered now."""
        ctx = self.ctx
        if not ctx.broken(Mutation.SKIP_REQUEST_DEDUPE):
            answer = admit(write, ctx.view, self.in_progress, ctx.unix_ms, **ctx.horizon())
            if answer is not None:
                ctx.answer(ticket, answer)
                return
        if len(self.queue) + len(self.parked) >= ctx.config.max_pending:
            ctx.answer(ticket, errors.OverloadedError(
                f"shard {ctx.shard}: {ctx.config.max_pending} writes pending (limit MAX_PENDING_WRITES_PER_SHARD); "
                "back off"))
            return
        if write.request_id:
            self.in_progress.add(write.request_id)
        self.queue.append(Pending(ticket, write, size))

    def gone(self, ticket: int) -> bool:
        """Not written if still queued (its id is free again); True if it was."""
        for line in (self.queue, self.carry, self.parked):
            for pending in line:
                if pending.ticket == ticket:
                    line.remove(pending)
                    self._release_id(pending.write.request_id)
                    return True
        return False

    def probe(self) -> None:
        """Queue the leader's probe, an empty entry (one at a time)."""
        if self.probing:
            return
        self.probing = True
        self.queue.append(Pending(None, probe_write(), 0))

    # ---- time ---------------------------------------------------------------------------------

    def linger_over(self, now: float) -> bool:
        if self.linger_until_ms is not None and now >= self.linger_until_ms:
            self.linger_until_ms = None
            self.patient_linger = False
            return True
        return False

    def refuse_late_parked(self, now: float) -> None:
        if not self.parked:
            return
        late = [p for p in self.parked if p.lock_wait_until_ms is not None and now >= p.lock_wait_until_ms]
        if late:
            self.parked = [p for p in self.parked if p not in late]
            for pending in late:
                self._answer_pending(pending, errors.TxnConflictError(
                    f"shard {self.ctx.shard}: a key of this write stayed locked by a prepared cross-shard transaction "
                    f"for {self.ctx.config.lock_wait_ms:.0f} ms; nothing was done: retry"))

    def wake_times(self) -> list[float]:
        times = [self.linger_until_ms] if self.linger_until_ms is not None else []
        times.extend(p.lock_wait_until_ms for p in self.parked if p.lock_wait_until_ms is not None)
        return times

    # ---- batches ------------------------------------------------------------------------------

    def maybe_start(self, role: RoleMachine, *, lingered: bool = False,
                    waiters: bool = False) -> list[tuple[int, Response]] | None:
        """One batch in flight; the next starts once it is done. A lone write waits `linger_ms`
        for company first (requests carried over or already queued together go at once); a lone
        patient write waits `patient_linger_ms`, unless something may wait on a lock (`waiters`:
        a linearizable read in flight; a parked write counts too). Returns the answers of
        read-only Txns planned (they go through a barrier), or None when nothing was planned.
        The caller checks the writer is idle."""
        config = self.ctx.config
        if self.busy or not role.may_start_batch() or not (self.queue or self.carry):
            return None
        if not lingered and len(self.queue) < config.batch_limits.max_records:
            patient = (len(self.queue) == 1 and self.queue[0].write.patient and not self.carry and not waiters
                       and not self.parked)
            if self.linger_until_ms is not None and (patient or not self.patient_linger):
                return None  # lingering: writes arriving meanwhile join the batch
            if self.linger_until_ms is None and not self.carry:
                linger_ms = config.patient_linger_ms if patient else config.linger_ms if len(self.queue) == 1 else 0
                if linger_ms > 0:
                    self.linger_until_ms = self.ctx.now_ms + linger_ms
                    self.patient_linger = patient
                    return None
        self.linger_until_ms = None
        self.patient_linger = False
        return self._start(role)

    def _start(self, role: RoleMachine) -> list[tuple[int, Response]]:
        ctx = self.ctx
        bounds = ctx.config.batch_limits
        upcoming = role.upcoming
        assert upcoming is not None
        # W6, paired with RoleMachine.replayed_to: a leader plans only from a state exactly at
        # its upcoming offset.
        assert ctx.applied() == upcoming, \
            f"shard {ctx.shard}: planning at {upcoming} from a state at {ctx.applied()} (W6)"
        taken = [self.carry.popleft() for _ in range(min(len(self.carry), bounds.max_records))]
        size = sum(p.size for p in taken)
        while self.queue and len(taken) < bounds.max_records and size < bounds.max_bytes:
            pending = self.queue.popleft()
            taken.append(pending)
            size += pending.size
        table: RequestTable = ctx.view
        if ctx.broken(Mutation.SKIP_REQUEST_DEDUPE):
            table = _Forgetful(ctx.view)
        plan = plan_batch([p.write for p in taken], upcoming, ctx.view.get, table, ctx.unix_ms, bounds,
                          locks=ctx.view.locks, **ctx.horizon())
        for index, answer in plan.now:  # refusals and replays: definite, independent of the append
            pending = taken[index]
            if self._parks(pending, answer):
                continue
            self._answer_pending(pending, answer)
        for index in reversed(plan.carry):
            self.carry.appendleft(taken[index])
        answers = [(taken[index].ticket, response) for index, response in plan.after_commit]
        batch = Batch(plan.revision, tuple(plan.payloads), answers,
                      [taken[index].write.request_id for index, _ in plan.after_commit])
        if any(taken[index].ticket is None for index, _ in plan.after_commit):
            self.probing = False  # the probe is planned: another may be queued
        if plan.payloads:
            role.batch_started(plan.revision, len(plan.payloads))
            assert batch_end(plan.revision, len(plan.payloads)) == plan.upcoming_if_committed
            self.in_flight = batch
            if ctx.broken(Mutation.ANSWER_BEFORE_COMMIT):
                for ticket, response in answers:
                    ctx.answer(ticket, response)
            ctx.emit(Append(plan.revision, batch.payloads))
            return []
        self._release_ids(batch)
        read_only: list[tuple[int, Response]] = []
        for ticket, response in answers:
            assert ticket is not None, "the probe is a record: it is appended, never read through a barrier"
            read_only.append((ticket, response))
        return read_only

    def appended(self, event: Appended) -> None:
        """The batch committed: apply it, then answer it, in one list (W5); the bookkeeping
        waits for `CommitApplied` so that nothing raising there turns a commit into a failure."""
        ctx = self.ctx
        batch = self.in_flight
        assert batch is not None, "Appended without a batch in flight"
        assert len(event.offsets) == len(batch.payloads), (event, len(batch.payloads))
        self.in_flight = None
        self.committing = (batch, event)
        ctx.emit(ApplyCommitted(tuple(zip(event.offsets, batch.payloads, strict=True)), event.upcoming,
                                event.marker_slot))
        if not ctx.broken(Mutation.ANSWER_BEFORE_COMMIT):
            for ticket, response in batch.answers:
                ctx.answer(ticket, response)
        self._release_ids(batch)

    def commit_applied(self) -> Appended:
        assert self.committing is not None, "CommitApplied without a committed batch"
        _batch, appended = self.committing
        self.committing = None
        return appended

    def failed(self, error: errors.StoreError) -> None:
        """The batch did not commit, or may have: its clients hear `error` (APPEND_DECISIONS)."""
        batch = self.in_flight
        assert batch is not None, "AppendFailed without a batch in flight"
        self.in_flight = None
        if not self.ctx.broken(Mutation.ANSWER_BEFORE_COMMIT):
            for ticket, _ in batch.answers:
                self.ctx.answer(ticket, error)
        self._release_ids(batch)

    def unpark(self) -> None:
        """An apply may have released the locks parked writes met: they go first again."""
        if self.parked:
            self.queue.extendleft(reversed(self.parked))
            self.parked = []

    def refuse_all(self, error: errors.StoreError) -> None:
        """Leadership over: nothing queued was written, a retry anywhere is safe."""
        for line in (self.carry, self.queue):
            while line:
                self._answer_pending(line.popleft(), error)
        parked, self.parked = self.parked, []
        for pending in parked:
            self._answer_pending(pending, error)

    def forget_linger(self) -> None:
        self.linger_until_ms = None
        self.patient_linger = False
        self.probing = False

    # ---- answers and request ids ------------------------------------------------------------------

    def _parks(self, pending: Pending, answer: Reply) -> bool:
        """Whether a write refused on a lock waits instead (`lock_wait_ms`): parked until the
        next apply, as long as its wait lasts. A same-request conflict is not waited on: the
        earlier attempt's outcome decides, and this one says so at once."""
        ctx = self.ctx
        if (not isinstance(answer, errors.TxnConflictError) or answer.same_request or pending.ticket is None
                or ctx.config.lock_wait_ms <= 0):
            return False
        if pending.lock_wait_until_ms is None:
            pending.lock_wait_until_ms = ctx.now_ms + ctx.config.lock_wait_ms
        elif ctx.now_ms >= pending.lock_wait_until_ms:
            return False
        self.parked.append(pending)
        return True

    def _answer_pending(self, pending: Pending, answer: Reply) -> None:
        self._release_id(pending.write.request_id)
        if pending.ticket is None:
            self.probing = False
        self.ctx.answer(pending.ticket, answer)

    def _release_id(self, request_id: str) -> None:
        self.in_progress.discard(request_id)

    def _release_ids(self, batch: Batch) -> None:
        for request_id in batch.ids:
            self._release_id(request_id)
