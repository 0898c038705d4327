"""A node's cross-shard transactions (docs/design.md §10): the shell of
`kvstore.core.txn_driver.TxnDriver`, for the Txns its clients send and for the prepares in
doubt at the shards it leads.

Each driver action becomes one call: to this node's own replica when it leads the shard, else to
the shard leader's `PeerService` (`PrepareTxn`, `DecideTxn`, `ResolveTxn`), which appends the
record there or refuses, never forwarding again. Every call is bounded (`TXN_CALL_TIMEOUT_S`); a
call with no answer is reported to the driver as an unknown outcome, a peer's refusal as the
error it was (`kvstore.errors.from_status`). The driver decides everything else.

A driver runs in a task of its own, shielded from its client: a client that gives up does not
cut a transaction off between its decision and its resolves. The resolvers (`_resolve_loop`)
look at the prepared table of every shard this node leads every `TXN_RESOLVE_EVERY_S`; a prepare
older than `TXN_IN_DOUBT_AFTER_MS` gets a recovery driver (abort unless decided, then resolve
everywhere). An operator's `kvstore txn resolve` starts the same recovery at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from kvstore import errors
from kvstore.core import txn
from kvstore.core.batch import Write
from kvstore.core.txn_driver import (
    DecideAnswered,
    DriverConfig,
    Finished,
    Phase,
    PrepareAnswered,
    Reply,
    ResolveAnswered,
    SendDecide,
    SendPrepare,
    SendResolve,
    Started,
    Tick,
    TxnDriver,
)
from kvstore.internal.v1 import peer_pb2
from kvstore.server import failpoints
from kvstore.server.clock import process_clock
from kvstore.v1 import cluster_pb2, kv_pb2

if TYPE_CHECKING:
    from kvstore.server.node import Node
    from kvstore.server.peers import Peers
    from kvstore.storage.shard_store import ShardStore

log = logging.getLogger("kvstore.txn")

TXN_CALL_TIMEOUT_S = 5.0  # one record's call to a shard's leader (its batch and commit included)
TXN_BUDGET_S = 10.0  # a driver's time for its prepares, when the client's deadline is not shorter
TXN_RESOLVE_EVERY_S = 1.0  # how often the resolvers look for prepares in doubt
MAX_DRIVERS = 1_000  # transactions this node drives at once (its clients' and its resolvers')
TXN_ID_BYTES = 16  # an attempt's id: random, never repeated


class Transactions:
    def __init__(self, node: Node, peers: Peers) -> None:
        self.node = node
        self.peers = peers
        self.config = DriverConfig(shard_count=node.config.shards)
        self._running: dict[str, asyncio.Task[Any]] = {}
        self._resolver: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._resolver = asyncio.create_task(self._resolve_loop(), name="txn-resolver")

    async def stop(self) -> None:
        """Stop the resolvers; drivers still running finish (each is bounded)."""
        if self._resolver is not None:
            self._resolver.cancel()
            await asyncio.gather(self._resolver, return_exceptions=True)
        running = list(self._running.values())
        if running:
            await asyncio.wait(running, timeout=TXN_CALL_TIMEOUT_S * 2)

    # ---- a client's Txn ---------------------------------------------------------------------------------

    async def run(self, request: kv_pb2.TxnRequest, remaining_s: float | None) -> kv_pb2.TxnResponse:
        """Drive `request` (validated, spanning shards) to its answer; raises the StoreError the
        driver answered with."""
        if len(self._running) >= MAX_DRIVERS:
            raise errors.OverloadedError(f"{len(self._running)} cross-shard transactions running here (limit "
                                         f"MAX_DRIVERS {MAX_DRIVERS}); back off")
        budget_s = TXN_BUDGET_S if remaining_s is None else max(0.0, min(TXN_BUDGET_S, remaining_s))
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

    # ---- resolvers ---------------------------------------------------------------------------------------

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(TXN_RESOLVE_EVERY_S)
            try:
                self.resolve_in_doubt()
            except Exception:  # a resolver must outlive whatever one round met
                log.exception("resolving prepared transactions failed")

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
                if prepared.txn_id in self._running or len(self._running) >= MAX_DRIVERS:
                    continue
                driver = TxnDriver.recover(self.config, prepared.prepare, prepared_unix_ms=prepared.leader_unix_ms,
                                           deadline_ms=_now_ms() + TXN_BUDGET_S * 1000,
                                           reason=f"in doubt at shard {shard} for {age_ms} ms"
                                                  + (" (an operator)" if only else ""))
                log.warning("resolving transaction %s, prepared at shard %d %d ms ago", prepared.txn_id, shard,
                            age_ms, extra={"event": "txn_resolve", "txn_id": prepared.txn_id, "shard": shard})
                self._launch(prepared.txn_id, driver, None)
                started.append(prepared.txn_id)
        self.node.metrics.txn_in_doubt_age.set(oldest_ms / 1000)
        return started

    async def force(self, txn_id: str) -> cluster_pb2.ResolveTransactionResponse:
        """Resolve `txn_id` now at the shards this node leads that hold its prepare (an
        operator's `kvstore txn resolve`): the coordinator's decision, or abort if there is none.
        Waits for the outcome (bounded)."""
        shards = [s for s, replica in sorted(self.node.replicas.items())
                  if self.node.leads(s) and replica.store.locks.prepared_txn(txn_id) is not None]
        if not shards:
            return cluster_pb2.ResolveTransactionResponse(txn_id=txn_id, outcome="not prepared")
        if txn_id not in self._running:
            self.resolve_in_doubt(only=txn_id)
        task = self._running.get(txn_id)
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

    async def record(self, shard: int, make: Callable[[ShardStore], Write], size: int) -> Any:
        """Append a transaction's record at this node's replica of `shard` (its leader), or
        raise the refusal (NotLeaderError, a conflict...): never forwarded from here."""
        replica = self.node.replica(shard)
        return await replica.write(make(replica.store), size)

    def prepare_write(self, request: peer_pb2.PrepareTxnRequest) -> Callable[[ShardStore], Write]:
        return lambda store: txn.prepare_write(request.txn_id, request.txn, request.shard, self.node.config.shards,
                                               store)

    @staticmethod
    def decide_write(request: peer_pb2.DecideTxnRequest) -> Callable[[ShardStore], Write]:
        return lambda store: txn.decision_write(request.decision, store,
                                                first_attempt_unix_ms=request.first_attempt_unix_ms)

    @staticmethod
    def resolve_write(request: peer_pb2.ResolveTxnRequest) -> Callable[[ShardStore], Write]:
        return lambda _store: txn.resolve_write(request.resolve)

    # ---- the shell ------------------------------------------------------------------------------------------

    def _launch(self, txn_id: str, driver: TxnDriver,
                answered: asyncio.Future[kv_pb2.TxnResponse | errors.StoreError] | None) -> None:
        task = asyncio.create_task(self._drive(driver, answered), name=f"txn-{txn_id}")
        self._running[txn_id] = task
        task.add_done_callback(lambda _t: self._running.pop(txn_id, None))

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
                    else:
                        call = asyncio.create_task(self._call(action, events))
                        calls.add(call)
                        call.add_done_callback(calls.discard)
                if driver.finished:
                    break
                wake = driver.wake_at_ms()
                timeout_s = None if wake is None else max(0.0, (wake - _now_ms()) / 1000)
                try:
                    event = await asyncio.wait_for(events.get(), timeout_s)
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
        if driver.recovering is not None:
            outcome = "unknown" if finished is None or finished.committed is None else (
                "committed" if finished.committed else "aborted")
            self.node.metrics.txn_recoveries.labels(outcome=outcome).inc()
            if finished is not None and finished.in_doubt:
                log.warning("transaction %s stays in doubt: %s", driver.txn_id, finished.in_doubt,
                            extra={"event": "txn_in_doubt", "txn_id": driver.txn_id})
        return finished

    async def _call(self, action: SendPrepare | SendDecide | SendResolve, events: asyncio.Queue[Any]) -> None:
        if isinstance(action, SendPrepare):
            request: Any = peer_pb2.PrepareTxnRequest(txn_id=action.txn_id, shard=action.shard, txn=action.request)
            answer = await self._record(action.shard, "PrepareTxn", request, self.prepare_write(request), "vote")
            events.put_nowait(PrepareAnswered(action.shard, answer))
        elif isinstance(action, SendDecide):
            request = peer_pb2.DecideTxnRequest(decision=action.decision,
                                                first_attempt_unix_ms=action.first_attempt_unix_ms)
            answer = await self._record(action.shard, "DecideTxn", request, self.decide_write(request), "decided")
            events.put_nowait(DecideAnswered(answer))
        else:
            request = peer_pb2.ResolveTxnRequest(shard=action.shard, resolve=action.resolve)
            answer = await self._record(action.shard, "ResolveTxn", request, self.resolve_write(request), "resolve")
            events.put_nowait(ResolveAnswered(action.shard, answer))

    async def _record(self, shard: int, method: str, request: Any, make: Callable[[ShardStore], Write],
                      field: str) -> Any:
        """One record at `shard`: here if this node leads it, else at its leader (whose answer
        carries it in `field`); the answer or the error, as the driver takes it."""
        try:
            if self.node.leads(shard):
                return await asyncio.wait_for(self.record(shard, make, request.ByteSize()), TXN_CALL_TIMEOUT_S)
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
    if isinstance(answer, kv_pb2.TxnResponse):
        return "committed"
    return "aborted" if answer.definite else "unknown"


__all__ = ["MAX_DRIVERS", "TXN_CALL_TIMEOUT_S", "Transactions"]
