"""A simulated node's cross-shard transactions: drivers for its clients' Txns spanning shards,
resolvers for the prepares in doubt at the shards it leads. A shell of
`kvstore.core.txn_driver.TxnDriver`, as the real node's is: it performs each action as a peer
call to the node the group says leads the shard, and reports the answer, or an unknown outcome
when none came within the call timeout, as the driver's event. Nothing here decides anything.

A node's drivers die with it (they hold nothing durable): its prepares are then left to the
participants' resolvers, which is what T3 is about.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore import errors
from kvstore.core import txn
from kvstore.core.batch import Answer, Write
from kvstore.core.request_window import MemoryShard
from kvstore.core.role import Role
from kvstore.core.txn_driver import (
    DecideAnswered,
    DriverConfig,
    Finished,
    PrepareAnswered,
    Reply,
    ResolveAnswered,
    SendDecide,
    SendPrepare,
    SendResolve,
    Started,
    Tick,
    TxnDriver,
    TxnMutation,
)
from kvstore.v1 import kv_pb2

if TYPE_CHECKING:
    from tests.sim.node import Node

ClientReply = Callable[[Any], None]


class TxnShell:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.world = node.world
        t = self.world.timing
        self.config = DriverConfig(shard_count=self.world.shards, max_attempts=6, backoff_first_ms=20,
                                   backoff_max_ms=400, resolve_wait_ms=t.txn_resolve_wait_ms,
                                   mutations=self.world.txn_mutations)
        self.drivers: dict[str, tuple[TxnDriver, ClientReply | None]] = {}
        self._wake: dict[str, int] = {}

    def start(self) -> None:
        """The resolvers' round, every `txn_resolve_every_ms` while the node lives."""
        self.world.sched.at(self.world.timing.txn_resolve_every_ms, self._resolve_round, self.node)

    # ---- a client's Txn ---------------------------------------------------------------------------

    def begin(self, request: kv_pb2.TxnRequest, reply: ClientReply) -> None:
        world = self.world
        txn_id = f"{self.node.name}.{world.next_id()}"
        driver = TxnDriver.begin(self.config, txn_id, request, now_unix_ms=self._unix_ms(),
                                 deadline_ms=world.sched.now + world.timing.txn_deadline_ms)
        world.audit.counters["txn_begun"] += 1
        self.drivers[txn_id] = (driver, reply)
        self._step(txn_id, Started())

    # ---- resolvers -----------------------------------------------------------------------------------

    def kick(self, txn_ids: tuple[str, ...]) -> None:
        """A read waits on these transactions' locks (`ResolveNow`): resolve them now."""
        self._resolve_round(only=frozenset(txn_ids))

    def _resolve_round(self, only: frozenset[str] = frozenset()) -> None:
        world = self.world
        now_unix = self._unix_ms()
        for shard, replica in sorted(self.node.replicas.items()):
            if replica.role is not Role.LEADING:
                continue
            for prepared in replica.store.locks.prepared():
                if prepared.txn_id in self.drivers:
                    continue
                if only and prepared.txn_id not in only:
                    continue
                if not only and now_unix - prepared.leader_unix_ms < world.timing.txn_in_doubt_ms:
                    continue
                world.trace.log(f"{self.node.name} s{shard} resolves {prepared.txn_id}, in doubt since "
                                f"{prepared.leader_unix_ms}")
                world.audit.counters["txn_recoveries"] += 1
                driver = TxnDriver.recover(self.config, prepared.prepare, prepared_unix_ms=prepared.leader_unix_ms,
                                           deadline_ms=world.sched.now + world.timing.txn_deadline_ms,
                                           reason=f"in doubt at shard {shard}")
                self.drivers[prepared.txn_id] = (driver, None)
                self._step(prepared.txn_id, Started())
        if not only:
            world.sched.at(world.timing.txn_resolve_every_ms, self._resolve_round, self.node)

    # ---- the shell --------------------------------------------------------------------------------------

    def _step(self, txn_id: str, event: Any, driver_of_call: TxnDriver | None = None) -> None:
        """`event` for the driver of `txn_id`; an answer to a call of an earlier driver of the same
        txn id (a client's driver that finished, then a resolver's) is not this one's."""
        entry = self.drivers.get(txn_id)
        if entry is None or (driver_of_call is not None and entry[0] is not driver_of_call):
            return
        driver, reply = entry
        try:
            actions = driver.step(event, now_ms=self.world.sched.now)
        except AssertionError as exc:
            self.world.violation(f"{self.node.name} txn {txn_id}: the driver's check failed on "
                                 f"{type(event).__name__}: {exc}")
            self.drivers.pop(txn_id, None)
            return
        for action in actions:
            self._perform(txn_id, driver, reply, action)
        if txn_id in self.drivers:
            self._schedule_tick(txn_id, driver)

    def _perform(self, txn_id: str, driver: TxnDriver, reply: ClientReply | None, action: Any) -> None:
        world = self.world
        if isinstance(action, SendPrepare):
            request, shard = action.request, action.shard

            def prepare(store: MemoryShard) -> Write:
                return txn.prepare_write(txn_id, request, shard, world.shards, store)

            self._call(txn_id, driver, shard, prepare, lambda answer: PrepareAnswered(shard, answer))
        elif isinstance(action, SendDecide):
            decision, first_ms = action.decision, action.first_attempt_unix_ms
            second = TxnMutation.SECOND_DECISION in world.txn_mutations

            def decide(store: MemoryShard) -> Write:
                return txn.decision_write(decision, store, first_attempt_unix_ms=first_ms, second_decision=second)

            self._call(txn_id, driver, action.shard, decide, DecideAnswered)
        elif isinstance(action, SendResolve):
            resolve, shard = action.resolve, action.shard
            self._call(txn_id, driver, shard, lambda _store: txn.resolve_write(resolve),
                       lambda answer: ResolveAnswered(shard, answer))
        elif isinstance(action, Reply):
            assert reply is not None, "a resolver's driver has no client"
            reply(action.answer)
        else:
            assert isinstance(action, Finished)
            self.drivers.pop(txn_id, None)
            outcome = "unknown" if action.committed is None else "committed" if action.committed else "aborted"
            kind = "recovered" if driver.recovering is not None else "driven"
            world.audit.counters[f"txn_{kind}_{outcome}"] += 1
            if action.in_doubt:
                world.trace.log(f"{self.node.name} txn {txn_id} left in doubt: {action.in_doubt}")

    def _call(self, txn_id: str, driver: TxnDriver, shard: int, make: Callable[[MemoryShard], Write],
              event_of: Callable[[Any], Any]) -> None:
        """One peer call to the node the group says leads `shard` (any node if none is known),
        bounded by the call timeout: no answer in time is an unknown outcome."""
        world, node = self.world, self.node
        owner = node.owners[shard] if node.owners[shard] is not None else None
        peers = world.peers
        target = peers.get(owner) if owner is not None else None
        if target is None:
            target = peers[sorted(peers)[world.sched.between(0, len(peers) - 1)]]
        answered: list[bool] = []
        back = world.net.answer_to(node, from_brokers=False)

        def deliver(answer: Answer) -> None:
            if not answered:
                answered.append(True)
                self._step(txn_id, event_of(answer), driver)

        def at_target() -> None:
            target.handle_record(shard, make, lambda answer: back(lambda: deliver(answer)))

        def expire() -> None:
            if not answered:
                answered.append(True)
                self._step(txn_id, event_of(errors.UnknownOutcomeError(f"no answer from {target.name} in time")),
                           driver)

        world.net.send(at_target, target, once=True)
        world.sched.at(world.timing.txn_call_timeout_ms, expire, node)

    def _schedule_tick(self, txn_id: str, driver: TxnDriver) -> None:
        wake = driver.wake_at_ms()
        if wake is None:
            return
        at = max(int(wake) + (0 if wake == int(wake) else 1), self.world.sched.now)
        if self._wake.get(txn_id) == at:
            return
        self._wake[txn_id] = at

        def tick() -> None:
            if self._wake.get(txn_id) == at:
                del self._wake[txn_id]
                self._step(txn_id, Tick(), driver)

        self.world.sched.at(at - self.world.sched.now, tick, self.node)

    def _unix_ms(self) -> int:
        return self.world.sched.now + self.node.clock_skew_ms
