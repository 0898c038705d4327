"""The read barrier: how a leader clears a linearizable read (docs/design.md §5, §5.1).

Invariants kept here:

* *One query out.* Reads arriving while a round's high-watermark query is out wait for the next
  round (`next_round`): a read waits for a query sent after it arrived, never one sent before.
* *The high watermark, never the LSO*, judged by `RoleMachine.barrier`: beyond everything this
  leader wrote means another writer exists: refuse and probe (the machine queues the probe).
  Otherwise serve once everything below it is applied (`waiters`, each bounded by
  `barrier_timeout_ms`), and only once the apply is reported: a read told at `Appended` could
  find a state whose apply then failed (issue 22's campaign).
* *T4.* A read whose keys or span a prepared cross-shard transaction locks exclusively waits
  for the apply that releases it (`locked_reads`), asks for a resolve after `read_kick_ms` and
  is refused after `read_lock_wait_ms`.
* Every read is answered exactly once: served, refused, or dropped when its client is gone.
"""

from __future__ import annotations

import dataclasses

from kvstore import errors
from kvstore.core.evaluate import Response
from kvstore.core.replica.actions import READY, ReadEnd, ResolveNow
from kvstore.core.replica.config import Mutation
from kvstore.core.replica.context import Context
from kvstore.core.replica.events import EndPurpose
from kvstore.core.role import Role, RoleMachine


@dataclasses.dataclass
class BarrierRead:
    ticket: int
    response: Response | None  # a read-only Txn's answer, given once the barrier passed; None: READY
    keys: tuple[bytes, ...] = ()  # what a READY read will read (`ReadArrived`)
    span: tuple[bytes, bytes | None] | None = None


@dataclasses.dataclass
class LockedRead:
    """A read past its barrier that meets a prepared transaction's exclusive lock (T4)."""

    read: BarrierRead
    kick_at_ms: float | None  # when to ask for its holders to be resolved (None: asked)
    deadline_ms: float


@dataclasses.dataclass
class Waiter:
    read: BarrierRead
    offset: int  # served once everything below it is applied
    deadline_ms: float


class Barrier:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        # Reads waiting for the next high-watermark query, the round whose query is out, reads
        # waiting for the replica to apply what their round read.
        self.next_round: list[BarrierRead] = []
        self.round: list[BarrierRead] = []
        self.round_out = False
        self.waiters: list[Waiter] = []
        self.locked_reads: list[LockedRead] = []  # bounded by the reads admitted, each by its deadline

    def arrive(self, read: BarrierRead) -> None:
        self.next_round.append(read)

    def send(self) -> None:
        """Leading: the next round's query goes out once the last one's answer came."""
        if self.next_round and not self.round_out:
            self.round, self.next_round, self.round_out = self.next_round, [], True
            self.ctx.emit(ReadEnd(EndPurpose.BARRIER))

    def answered(self, end: int | None, failure: str, role: RoleMachine) -> bool:
        """The round's end came (None: it could not be read). True: probe the log (the leader's
        view is stale: the probe, an empty entry at our upcoming offset, settles it: if the log
        moved, W2 aborts it and we learn the log again; if we were fenced, we step down)."""
        ctx = self.ctx
        assert self.round_out, "a barrier's end arrived with no query out"
        reads, self.round, self.round_out = self.round, [], False
        probe = False
        if end is None:
            refusal: errors.StoreError = errors.UnavailableError(
                f"shard {ctx.shard}: read barrier failed: {failure}")
        elif role.role is not Role.LEADING:
            refusal = errors.UnavailableError(f"shard {ctx.shard}: leadership moving; retry")
        else:
            verdict = role.barrier(end)
            if verdict.wait_for is not None:
                applied = ctx.applied()
                for read in reads:
                    if applied >= verdict.wait_for:
                        self.serve(read)
                    else:
                        self.waiters.append(Waiter(read, verdict.wait_for, ctx.now_ms + ctx.config.barrier_timeout_ms))
                return False
            probe = True
            refusal = errors.UnavailableError(verdict.why)
        for read in reads:
            ctx.answer(read.ticket, refusal)
        return probe

    def serve(self, read: BarrierRead) -> None:
        """A read whose barrier passed: READY (or a read-only Txn's answer), unless a key it
        reads is exclusively locked by a prepared transaction, which may be decided already:
        then it waits for the resolve (T4). A read-only Txn met the locks when it was planned."""
        ctx = self.ctx
        if read.response is None and not ctx.broken(Mutation.SKIP_READ_LOCK_WAIT) and self._holders(read):
            self.locked_reads.append(LockedRead(read, ctx.now_ms + ctx.config.read_kick_ms,
                                                ctx.now_ms + ctx.config.read_lock_wait_ms))
            return
        ctx.answer(read.ticket, read.response or READY)

    def _holders(self, read: BarrierRead) -> set[str]:
        """The prepared transactions holding an exclusive lock on what `read` reads."""
        locks = self.ctx.view.locks
        if not locks.has_locks():
            return set()
        holders = {txn_id for key in read.keys for txn_id, exclusive in locks.lock_holders(key).items()
                   if exclusive}
        if read.span is not None:
            start, end = read.span
            holders |= {p.txn_id for p in locks.prepared() if any(
                start <= key and (end is None or key < end) for key in p.prepare.exclusive_keys)}
        return holders

    def tick(self, now: float) -> None:
        """Locked reads past their kick or their wait, then waiters past their timeout."""
        ctx = self.ctx
        if self.locked_reads:
            self._locked_reads_tick(now)
        expired = [w for w in self.waiters if now >= w.deadline_ms]
        if expired:
            self.waiters = [w for w in self.waiters if now < w.deadline_ms]
            for waiter in expired:
                ctx.answer(waiter.read.ticket, errors.UnavailableError(
                    f"shard {ctx.shard}: applied {ctx.applied()}, waited for {waiter.offset}"))

    def _locked_reads_tick(self, now: float) -> None:
        ctx = self.ctx
        kick: set[str] = set()
        waiting: list[LockedRead] = []
        for locked in self.locked_reads:
            if now >= locked.deadline_ms:
                holders = sorted(self._holders(locked.read))
                ctx.answer(locked.read.ticket, errors.UnavailableError(
                    f"shard {ctx.shard}: what this read reads is locked by the prepared cross-shard "
                    f"transaction(s) {holders[:3]} for {ctx.config.read_lock_wait_ms:.0f} ms; nothing was read: "
                    "retry"))
                continue
            if locked.kick_at_ms is not None and now >= locked.kick_at_ms:
                locked.kick_at_ms = None
                kick |= self._holders(locked.read)
            waiting.append(locked)
        self.locked_reads = waiting
        if kick:
            ctx.emit(ResolveNow(tuple(sorted(kick))))

    def applied_to(self, checkpoint: int) -> None:
        """Everything below `checkpoint` is applied (and reported so): locked reads whose locks the
        apply released, and waiters for it, are served."""
        if self.locked_reads:  # the apply may have released their locks
            locked, self.locked_reads = self.locked_reads, []
            for waiting in locked:
                if self._holders(waiting.read):
                    self.locked_reads.append(waiting)
                else:
                    self.ctx.answer(waiting.read.ticket, READY)
        ready = [w for w in self.waiters if checkpoint >= w.offset]
        if ready:
            self.waiters = [w for w in self.waiters if checkpoint < w.offset]
            for waiter in ready:
                self.serve(waiter.read)

    def gone(self, ticket: int) -> None:
        self.next_round = [r for r in self.next_round if r.ticket != ticket]
        self.waiters = [w for w in self.waiters if w.read.ticket != ticket]
        self.locked_reads = [r for r in self.locked_reads if r.read.ticket != ticket]

    def refuse_all(self, error: errors.StoreError) -> None:
        """Leadership over: every read waiting is refused; a query still out finds no reads."""
        reads = [*self.next_round, *self.round, *(w.read for w in self.waiters), *(r.read for r in self.locked_reads)]
        self.next_round, self.round, self.waiters = [], [], []
        self.locked_reads = []
        for read in reads:
            self.ctx.answer(read.ticket, error)

    def wake_times(self) -> list[float]:
        times = [w.deadline_ms for w in self.waiters]
        for locked in self.locked_reads:
            times.append(locked.deadline_ms if locked.kick_at_ms is None else min(locked.kick_at_ms,
                                                                                 locked.deadline_ms))
        return times
