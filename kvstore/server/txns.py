"""A node's cross-shard transactions (docs/design.md §10): the shell of
`kvstore.core.txn_driver.TxnDriver`, for the Txns its clients send, the prepares in doubt at
the shards it leads, and the decisions its coordinator shards still hold.

Each driver action becomes one call: to this node's own replica when it leads the shard, else to
the shard leader's `PeerService` (`PrepareTxn`, `DecideTxn`, `ResolveTxn`), which appends the
record there or refuses, never forwarding again. Every call is bounded (`TXN_CALL_TIMEOUT_S`); a
call with no answer is reported to the driver as an unknown outcome, a peer's refusal as the
error it was (`kvstore.errors.from_status`). The driver decides everything else.

A driver runs in a task of its own, shielded from its client: a client that gives up does not
cut a transaction off between its decision and its resolves. Every `TXN_RESOLVE_EVERY_S`, for the
shards this node leads, the background round (`_resolve_loop`):

* starts a recovery for every prepare older than `txn_in_doubt_ms` (abort unless decided, then
  resolve everywhere);
* starts a finish for every decision its coordinator shards have held longer than
  `txn_finish_after_ms` (resolve it again everywhere: a driver died, or a participant was away);
* appends a forget record for the decisions every other participant resolved (a driver's or a
  finisher's `Forget`, from here or a peer's `ForgetTxns`).

Recoveries and finishers are bounded by `MAX_BACKGROUND`, apart from the clients' `MAX_DRIVERS`,
so a load of client transactions never starves them. An operator's `kvstore txn resolve` starts
the same recovery or finish at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc

from kvstore import errors
from kvstore.core import txn
from kvstore.core.replica.writes import DecideTxn, ForgetTxns, PrepareTxn, ResolveTxn, WriteRequest
from kvstore.core.txn import Decide
from kvstore.core.txn_driver import DriverConfig, Mode, Phase, TxnDriver
from kvstore.core.txn_events import (
    DecideAnswered,
    Finished,
    Forget,
    PartRead,
    PrepareAnswered,
    ReadAnswered,
    Reply,
    ResolveAnswered,
    SendDecide,
    SendPrepare,
    SendRead,
    SendValidate,
    Started,
    Tick,
    ValidateAnswered,
)
from kvstore.internal.v1 import peer_pb2
from kvstore.server import failpoints
from kvstore.server.clock import process_clock
from kvstore.v1 import cluster_pb2, kv_pb2

if TYPE_CHECKING:
    from kvstore.server.node import Node
    from kvstore.server.peers import Peers

log = logging.getLogger("kvstore.txn")

TXN_CALL_TIMEOUT_S = 5.0  # one record's call to a shard's leader (its batch and commit included)
TXN_BUDGET_S = 10.0  # a driver's time for its prepares, when the client's deadline is not shorter
TXN_ANSWER_MARGIN_S = 1.0  # of the client's deadline, left for the decision and the answer
TXN_RESOLVE_EVERY_S = 1.0  # how often the background round looks for prepares in doubt and old decisions
MAX_DRIVERS = 1_000  # client transactions this node drives at once
MAX_BACKGROUND = 200  # recoveries and finishes this node runs at once (apart from MAX_DRIVERS)
MAX_FORGET_IDS = 1_000  # decisions one forget record names
MAX_FORGET_RECORDS = 4  # forget records a shard appends per round
MAX_FORGET_PENDING = 100_000  # decisions a shard waits to forget (hints past it are dropped: finishers redo them)
TXN_ID_BYTES = 16  # an attempt's id: random, never repeated


class Transactions:
    def __init__(self, node: Node, peers: Peers) -> None:
        self.node = node
        self.peers = peers
        self.config = DriverConfig(shard_count=node.config.shards)
        self._running: dict[str, asyncio.Task[Any]] = {}  # clients' drivers, by txn id
        self._background: dict[str, asyncio.Task[Any]] = {}  # recoveries and finishes, by txn id
        self._forgets: dict[int, set[str]] = {}  # coordinator shard -> decisions resolved everywhere
        self._hints: set[asyncio.Task[Any]] = set()  # ForgetTxns calls in flight (bounded by the drivers)
        self._resolver: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._resolver = asyncio.create_task(self._resolve_loop(), name="txn-resolver")

    async def stop(self) -> None:
        """Stop the background round; drivers still running finish (each is bounded)."""
        if self._resolver is not None:
            self._resolver.cancel()
            await asyncio.gather(self._resolver, return_exceptions=True)
        running = [*self._running.values(), *self._background.values(), *self._hints]
        if running:
            await asyncio.wait(running, timeout=TXN_CALL_TIMEOUT_S * 2)

    # ---- a client's Txn ---------------------------------------------------------------------------------

    async def run(self, request: kv_pb2.TxnRequest, remaining_s: float | None) -> kv_pb2.TxnResponse:
        """Drive `request` (validated, spanning shards) to its answer; raises the StoreError the
        driver answered with."""
        if len(self._running) >= MAX_DRIVERS:
            raise errors.OverloadedError(f"{len(self._running)} cross-shard transactions running here (limit "
                                         f"MAX_DRIVERS {MAX_DRIVERS}); nothing of this attempt was done: back off")
        # The prepares' budget leaves the decision and the answer room within the client's deadline.
        budget_s = TXN_BUDGET_S if remaining_s is None else max(0.0, min(
            TXN_BUDGET_S, max(remaining_s / 2, remaining_s - TXN_ANSWER_MARGIN_S)))
        txn_id = secrets.token_hex(TXN_ID_BYTES)
        driver = TxnDriver.begin(self.config, txn_id, request, now_unix_ms=_unix_ms(),
                                 deadline_ms=_now_ms() + budget_s * 1000)
        answered: asyncio.Future[kv_pb2.TxnResponse | errors.StoreError] = asyncio.get_running_loop().create_future()
        self._launch(txn_id, driver, answered)
        answer = await asyncio.shield(answered)
        self.node.metrics.txns.labels(outcome=_outcome(answer)).inc()
        if isinstance(answer, errors.StoreError):
            raise answer
        return answer

    # ---- the background round ------------------------------------------------------------------------------

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(TXN_RESOLVE_EVERY_S)
            try:
                self.resolve_in_doubt()
                self.finish_decisions()
                self._forget_resolved()
            except Exception:  # the round must outlive whatever one round met
                log.exception("resolving cross-shard transactions failed")

    def resolve_in_doubt(self, *, older_than_ms: int | None = None, only: str = "") -> list[str]:
        """Start a recovery for every prepare older than `older_than_ms` at the shards this node
        leads (`only`: that txn id alone; default age: the node's `txn_in_doubt_ms`); the txn ids
        started. Also sets the in-doubt gauge."""
        if older_than_ms is None:
            older_than_ms = self.node.config.txn_in_doubt_ms
        now = _unix_ms()
        started: list[str] = []
        oldest_ms = 0
        for shard, replica in sorted(self.node.replicas.items()):
            if not self.node.leads(shard):
                continue
            for prepared in replica.store.locks.prepared():
                age_ms = max(0, now - prepared.leader_unix_ms) if prepared.leader_unix_ms else 0
                oldest_ms = max(oldest_ms, age_ms)
                if (only and prepared.txn_id != only) or (not only and age_ms < older_than_ms):
                    continue
                if not self._may_start(prepared.txn_id):
                    continue
                reason = f"in doubt at shard {shard} for {age_ms} ms" + (" (an operator)" if only else "")
                self._start_background(prepared.txn_id, self._recover(shard, prepared.txn_id, reason))
                started.append(prepared.txn_id)
        self.node.metrics.txn_in_doubt_age.set(oldest_ms / 1000)
        return started

    async def _recover(self, shard: int, txn_id: str, reason: str) -> Finished | None:
        """A recovery, once a read barrier showed that this node leads `shard` and still holds
        the prepare in doubt: a stale view (a node paused while it led, waking up) would abort a
        transaction that was resolved everywhere and forgotten meanwhile. The recovery's start,
        which the coordinator judges its abort by, is that moment."""
        replica = self.node.replica(shard)
        try:
            await asyncio.wait_for(replica.barrier(), TXN_CALL_TIMEOUT_S)
        except (errors.StoreError, TimeoutError) as exc:
            log.info("transaction %s at shard %d: not resolved now (%s)", txn_id, shard, exc)
            return None
        prepared = replica.store.locks.prepared_txn(txn_id)
        if prepared is None or not self.node.leads(shard):
            return None
        log.warning("resolving transaction %s: %s", txn_id, reason,
                    extra={"event": "txn_resolve", "txn_id": txn_id, "shard": shard})
        driver = TxnDriver.recover(self.config, prepared.prepare, at_shard=shard, now_unix_ms=_unix_ms(),
                                   deadline_ms=_now_ms() + TXN_BUDGET_S * 1000, reason=reason)
        return await self._drive(driver, None)

    def finish_decisions(self, *, older_than_ms: int | None = None, only: str = "") -> list[str]:
        """Start a finish for every decision the coordinator shards this node leads have held
        longer than `older_than_ms` (default the node's `txn_finish_after_ms`; `only`: that txn id alone):
        its participants resolve it again (a replay where they did), then it is forgotten. Also
        sets the pending-decisions gauge."""
        if older_than_ms is None:
            older_than_ms = self.node.config.txn_finish_after_ms
        now = _unix_ms()
        started: list[str] = []
        pending = 0
        for shard, replica in sorted(self.node.replicas.items()):
            if not self.node.leads(shard):
                self._forgets.pop(shard, None)  # hints for a shard led elsewhere now: its leader's finishers redo them
                continue
            store = replica.store
            for decided in store.decided():
                pending += 1
                age_ms = max(0, now - decided.leader_unix_ms) if decided.leader_unix_ms else older_than_ms
                if (only and decided.txn_id != only) or (not only and age_ms < older_than_ms):
                    continue
                if not self._may_start(decided.txn_id):
                    continue
                driver = TxnDriver.finish(self.config, decided.decision, decided.decided(), now_unix_ms=now,
                                          deadline_ms=_now_ms() + TXN_BUDGET_S * 1000,
                                          also_here=store.locks.prepared_txn(decided.txn_id) is not None)
                log.info("finishing transaction %s, decided %s at shard %d %d ms ago", decided.txn_id,
                         "commit" if decided.decision.commit else "abort", shard, age_ms,
                         extra={"event": "txn_finish", "txn_id": decided.txn_id, "shard": shard})
                self._launch(decided.txn_id, driver, None)
                started.append(decided.txn_id)
        self.node.metrics.txn_decisions_pending.set(pending)
        return started

    def _may_start(self, txn_id: str) -> bool:
        return txn_id not in self._running and txn_id not in self._background and \
            len(self._background) < MAX_BACKGROUND

    def note_forget(self, shard: int, txn_ids: list[str]) -> None:
        """Decisions of coordinator `shard` every other participant resolved (a driver's `Forget`,
        here or from a peer): forgotten by the next round's record, if this node leads it then."""
        if shard not in self.node.replicas or not self.node.leads(shard):
            return
        pending = self._forgets.setdefault(shard, set())
        for txn_id in txn_ids:
            if len(pending) >= MAX_FORGET_PENDING:
                break
            pending.add(txn_id)

    def _forget_resolved(self) -> None:
        for shard in sorted(self._forgets):
            pending = self._forgets[shard]
            if not pending or not self.node.leads(shard):
                continue
            ids = sorted(pending)[:MAX_FORGET_IDS * MAX_FORGET_RECORDS]
            pending.difference_update(ids)  # a failed record: its decisions are finished again later
            for at in range(0, len(ids), MAX_FORGET_IDS):
                chunk = ids[at:at + MAX_FORGET_IDS]
                task = asyncio.create_task(self._forget_record(shard, chunk), name=f"txn-forget-{shard}")
                self._hints.add(task)
                task.add_done_callback(self._hints.discard)

    async def _forget_record(self, shard: int, txn_ids: list[str]) -> None:
        try:
            replica = self.node.replica(shard)
            await asyncio.wait_for(replica.write(ForgetTxns(tuple(txn_ids)), 16 * len(txn_ids)),
                                   TXN_CALL_TIMEOUT_S)
        except (errors.StoreError, TimeoutError) as exc:
            log.info("shard %d: forgetting %d resolved decisions failed (%s); the finishers resolve them again",
                     shard, len(txn_ids), exc)

    def _tell_forget(self, shard: int, txn_id: str) -> None:
        """A `Forget` hint, to this node or the coordinator's leader (lost if none is known or the
        call fails: the coordinator's finishers resolve the decision again, later)."""
        if self.node.leads(shard):
            self.note_forget(shard, [txn_id])
            return
        leader = self.node.leader_address(shard)
        if not leader or leader == self.node.address or len(self._hints) >= MAX_DRIVERS:
            return

        async def hint() -> None:
            try:
                await self.peers.peer(leader).ForgetTxns(peer_pb2.ForgetTxnsRequest(shard=shard, txn_ids=[txn_id]),
                                                         timeout=TXN_CALL_TIMEOUT_S)
            except grpc.RpcError as exc:
                log.debug("ForgetTxns to %s failed: %s", leader, exc)

        task = asyncio.create_task(hint(), name=f"txn-forget-hint-{txn_id}")
        self._hints.add(task)
        task.add_done_callback(self._hints.discard)

    async def force(self, txn_id: str) -> cluster_pb2.ResolveTransactionResponse:
        """Resolve `txn_id` now at the shards this node leads that hold its prepare or its
        decision (an operator's `kvstore txn resolve`): the coordinator's recorded decision, or an
        abort recorded as the decision when there is none. Waits for the outcome (bounded)."""
        prepared = [s for s, replica in sorted(self.node.replicas.items())
                    if self.node.leads(s) and replica.store.locks.prepared_txn(txn_id) is not None]
        decided = [s for s, replica in sorted(self.node.replicas.items())
                   if self.node.leads(s) and replica.store.decided_txn(txn_id) is not None]
        shards = sorted({*prepared, *decided})
        if not shards:
            return cluster_pb2.ResolveTransactionResponse(txn_id=txn_id, outcome="not prepared")
        if txn_id not in self._running and txn_id not in self._background:
            if prepared:
                self.resolve_in_doubt(only=txn_id)
            else:
                self.finish_decisions(only=txn_id)
        task = self._running.get(txn_id) or self._background.get(txn_id)
        finished: Finished | None = None
        if task is not None:
            try:
                finished = await asyncio.wait_for(asyncio.shield(task), TXN_BUDGET_S + TXN_CALL_TIMEOUT_S)
            except TimeoutError:
                finished = None
        if finished is None or finished.committed is None:
            detail = finished.in_doubt if finished is not None else "no outcome within the bound"
            return cluster_pb2.ResolveTransactionResponse(txn_id=txn_id, outcome="in doubt", detail=detail,
                                                          shards=shards)
        return cluster_pb2.ResolveTransactionResponse(
            txn_id=txn_id, outcome="committed" if finished.committed else "aborted", shards=shards)

    def prepared(self, older_than_ms: int = 0) -> list[peer_pb2.PreparedTxnInfo]:
        """The prepared transactions of the shards this node leads (`kvstore txn list`)."""
        now = _unix_ms()
        out: list[peer_pb2.PreparedTxnInfo] = []
        for shard, replica in sorted(self.node.replicas.items()):
            if not self.node.leads(shard):
                continue
            for p in replica.store.locks.prepared():
                if p.leader_unix_ms and now - p.leader_unix_ms < older_than_ms:
                    continue
                out.append(peer_pb2.PreparedTxnInfo(
                    txn_id=p.txn_id, shard=shard, coordinator=p.prepare.coordinator,
                    participants=p.prepare.participants, prepared_unix_ms=p.leader_unix_ms, revision=p.revision,
                    request_id=p.prepare.request_id,
                    locked_keys=len(p.prepare.shared_keys) + len(p.prepare.exclusive_keys)))
        return out

    # ---- the records, here (a peer's call or this node's own driver) -------------------------------------

    async def record(self, shard: int, write: WriteRequest, size: int) -> Any:
        """Append a transaction's record at this node's replica of `shard` (its leader), or
        raise the refusal (NotLeaderError, a conflict...): never forwarded from here."""
        return await self.node.replica(shard).write(write, size)

    def prepare_write(self, request: peer_pb2.PrepareTxnRequest) -> WriteRequest:
        return PrepareTxn(request.txn_id, request.txn, request.shard, self.node.config.shards,
                          started_unix_ms=request.started_unix_ms, first_attempt_unix_ms=request.first_attempt_unix_ms)

    def decide_write(self, request: peer_pb2.DecideTxnWithPartRequest) -> WriteRequest:
        decide = Decide(request.decision, request.first_attempt_unix_ms,
                        request.txn if request.decision.commit else None,
                        {v.shard: v.vote for v in request.votes})
        return DecideTxn(decide, self.node.config.shards, started_unix_ms=request.started_unix_ms)

    @staticmethod
    def resolve_write(request: peer_pb2.ResolveTxnRequest) -> WriteRequest:
        return ResolveTxn(request.resolve)

    # ---- the shell ------------------------------------------------------------------------------------------

    def _start_background(self, txn_id: str, work: Coroutine[Any, Any, Finished | None]) -> None:
        task = asyncio.create_task(work, name=f"txn-background-{txn_id}")
        self._background[txn_id] = task
        task.add_done_callback(lambda _t: self._background.pop(txn_id, None))

    def _launch(self, txn_id: str, driver: TxnDriver,
                answered: asyncio.Future[kv_pb2.TxnResponse | errors.StoreError] | None) -> None:
        table = self._running if driver.mode is Mode.CLIENT else self._background
        task = asyncio.create_task(self._drive(driver, answered), name=f"txn-{driver.mode.value}-{txn_id}")
        table[txn_id] = task
        task.add_done_callback(lambda _t: table.pop(txn_id, None))

    async def _drive(self, driver: TxnDriver,
                     answered: asyncio.Future[kv_pb2.TxnResponse | errors.StoreError] | None) -> Finished | None:
        events: asyncio.Queue[Any] = asyncio.Queue()
        calls: set[asyncio.Task[None]] = set()
        finished: Finished | None = None
        try:
            pending = driver.step(Started(), now_ms=_now_ms())
            while True:
                for action in pending:
                    if isinstance(action, Reply):
                        if answered is not None and not answered.done():
                            answered.set_result(action.answer)
                    elif isinstance(action, Finished):
                        finished = action
                    elif isinstance(action, Forget):
                        self._tell_forget(action.shard, action.txn_id)
                    else:
                        call = asyncio.create_task(self._call(action, events))
                        calls.add(call)
                        call.add_done_callback(calls.discard)
                if driver.finished:
                    break
                wake = driver.wake_at_ms()
                timeout_s = None if wake is None else max(0.0, (wake - _now_ms()) / 1000)
                try:
                    async with asyncio.timeout(timeout_s):  # no task per wait, as wait_for would make
                        event = await events.get()
                except TimeoutError:
                    event = Tick()
                pending = driver.step(event, now_ms=_now_ms())
                if isinstance(event, DecideAnswered) and driver.phase is Phase.RESOLVING:
                    failpoints.check("txn-stop-after-decision")
        except failpoints.FailpointError:
            log.warning("transaction %s: stopped after its decision (failpoint)", driver.txn_id)
        except Exception as exc:  # a driver's check failed: the client's outcome is unknown
            log.exception("transaction %s: the driver failed", driver.txn_id)
            if answered is not None and not answered.done():
                answered.set_result(errors.InternalError(f"transaction {driver.txn_id}: {exc}"))
        finally:
            for call in calls:
                call.cancel()
            if answered is not None and not answered.done():
                answered.set_result(errors.UnknownOutcomeError(f"transaction {driver.txn_id} stopped"))
        if driver.mode is not Mode.CLIENT:
            outcome = "unknown" if finished is None or finished.committed is None else (
                "committed" if finished.committed else "aborted")
            metric = self.node.metrics.txn_recoveries if driver.mode is Mode.RECOVER else self.node.metrics.txn_finishes
            metric.labels(outcome=outcome).inc()
            if finished is not None and finished.in_doubt:
                log.warning("transaction %s stays in doubt: %s", driver.txn_id, finished.in_doubt,
                            extra={"event": "txn_in_doubt", "txn_id": driver.txn_id})
        return finished

    # ---- reads that must be one cut (kvstore.core.cut): a read-only Txn's parts, their validation ---------

    async def read_part(self, shard: int, request: kv_pb2.TxnRequest) -> PartRead:
        """A read-only Txn's part at this node's leader of `shard`: after the read barrier and the
        wait for exclusive locks on its keys (T4), its vote and the revision it was read at."""
        replica = self.node.replica(shard)
        shards = self.node.config.shards
        epoch = await replica.barrier(txn.part_keys(txn.part_of(request, shard, shards)))
        try:
            vote = txn.evaluate_read_part(request, shard, shards, replica.store.get)
        except ValueError as exc:  # a condition the validator could not see (e.g. an unknown compare op)
            raise errors.InvalidRequestError(str(exc)) from exc
        replica.unchanged_since(epoch)  # no await since the barrier: the vote and revision are one state
        return PartRead(vote, replica.store.read_revision)

    async def validate(self, shard: int, since: int, keys: tuple[bytes, ...],
                       span: tuple[bytes, bytes | None] | None = None) -> bool:
        """Whether nothing at or after revision `since` wrote `keys` or any key in `span` at
        `shard` (this node's leader of it, after the read barrier and the lock wait)."""
        replica = self.node.replica(shard)
        epoch = await replica.barrier(keys, span)
        unchanged = replica.store.recent.unchanged_since(since, keys=keys, span=span)
        replica.unchanged_since(epoch)
        return unchanged

    async def _call(self, action: Any, events: asyncio.Queue[Any]) -> None:
        request: Any
        if isinstance(action, SendRead):
            request = peer_pb2.ReadTxnPartRequest(shard=action.shard, txn=action.request)
            read = await self._ask(action.shard, "ReadTxnPart", request,
                                   lambda: self.read_part(action.shard, action.request))
            if isinstance(read, peer_pb2.ReadTxnPartResponse):
                read = PartRead(read.vote, read.revision)
            events.put_nowait(ReadAnswered(action.shard, read))
            return
        if isinstance(action, SendValidate):
            request = peer_pb2.ValidateReadsRequest(shard=action.shard, since_revision=action.revision,
                                                    keys=action.keys)
            checked = await self._ask(action.shard, "ValidateReads", request,
                                      lambda: self.validate(action.shard, action.revision, action.keys))
            if isinstance(checked, peer_pb2.ValidateReadsResponse):
                checked = checked.unchanged
            events.put_nowait(ValidateAnswered(action.shard, checked))
            return
        if isinstance(action, SendPrepare):
            request = peer_pb2.PrepareTxnRequest(txn_id=action.txn_id, shard=action.shard, txn=action.request,
                                                 started_unix_ms=action.started_unix_ms,
                                                 first_attempt_unix_ms=action.first_attempt_unix_ms)
            answer = await self._record(action.shard, "PrepareTxn", request, self.prepare_write(request), "vote")
            events.put_nowait(PrepareAnswered(action.shard, answer))
        elif isinstance(action, SendDecide):
            decide = action.decide
            request = peer_pb2.DecideTxnWithPartRequest(
                decision=decide.decision, first_attempt_unix_ms=decide.first_attempt_unix_ms,
                txn=decide.request, started_unix_ms=action.started_unix_ms,
                votes=[peer_pb2.ShardVote(shard=shard, vote=vote) for shard, vote in sorted(decide.votes.items())])
            answer = await self._record(action.shard, "DecideTxnWithPart", request, self.decide_write(request),
                                        "decided")
            events.put_nowait(DecideAnswered(answer))
        else:
            request = peer_pb2.ResolveTxnRequest(shard=action.shard, resolve=action.resolve)
            answer = await self._record(action.shard, "ResolveTxn", request, self.resolve_write(request), "resolve")
            events.put_nowait(ResolveAnswered(action.shard, answer))

    async def _ask(self, shard: int, method: str, request: Any, here: Callable[[], Awaitable[Any]]) -> Any:
        """One read at `shard`: here if this node leads it, else at its leader's `method`; the
        answer (a peer's response message) or the error, as the driver takes it."""
        try:
            if self.node.leads(shard):
                async with asyncio.timeout(TXN_CALL_TIMEOUT_S):
                    return await here()
            leader = self.node.leader_address(shard)
            if not leader or leader == self.node.address:
                return errors.UnavailableError(f"shard {shard} has no leader known right now")
            return await getattr(self.peers.peer(leader), method)(request, timeout=TXN_CALL_TIMEOUT_S)
        except errors.StoreError as refused:
            return refused
        except TimeoutError:
            return errors.UnavailableError(f"shard {shard}: {method} got no answer in {TXN_CALL_TIMEOUT_S} s")
        except grpc.aio.AioRpcError as exc:
            return errors.from_status(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))

    async def _record(self, shard: int, method: str, request: Any, write: WriteRequest, field: str) -> Any:
        """One record at `shard`: here if this node leads it, else at its leader (whose answer
        carries it in `field`); the answer or the error, as the driver takes it."""
        try:
            if self.node.leads(shard):
                async with asyncio.timeout(TXN_CALL_TIMEOUT_S):
                    return await self.record(shard, write, request.ByteSize())
            leader = self.node.leader_address(shard)
            if not leader or leader == self.node.address:
                return errors.UnavailableError(f"shard {shard} has no leader known right now")
            stub = self.peers.peer(leader)
            reply = await getattr(stub, method)(request, timeout=TXN_CALL_TIMEOUT_S)
            return getattr(reply, field)
        except errors.StoreError as refused:
            return refused
        except TimeoutError:
            return errors.UnknownOutcomeError(f"shard {shard}: {method} got no answer in {TXN_CALL_TIMEOUT_S} s")
        except grpc.aio.AioRpcError as exc:
            return errors.from_status(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))


def _now_ms() -> float:
    return time.monotonic() * 1000


_CLOCK = process_clock()  # the node's replicas stamp their entries with the same clock (kvstore.server.node)


def _unix_ms() -> int:
    return _CLOCK.unix_ms()


def _outcome(answer: kv_pb2.TxnResponse | errors.StoreError) -> str:
    """The metric's outcome: an expired request is unknown (an earlier attempt may have
    committed), not aborted, though this attempt did nothing."""
    if isinstance(answer, kv_pb2.TxnResponse):
        return "committed"
    if isinstance(answer, errors.RequestExpiredError):
        return "unknown"
    return "aborted" if answer.definite else "unknown"


__all__ = ["MAX_DRIVERS", "TXN_CALL_TIMEOUT_S", "Transactions"]
