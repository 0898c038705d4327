"""A simulated node's cross-shard transactions: drivers for its clients' Txns spanning shards,
resolvers for the prepares in doubt at the shards it leads, finishers for the decisions its
coordinator shards still hold, and the forgetting of decisions every participant resolved. A
shell of `kvstore.core.txn_driver.TxnDriver`, as the real node's is (`kvstore.server.txns`): it
performs each action as a peer call to the node the group says leads the shard, and reports the
answer, or an unknown outcome when none came within the call timeout, as the driver's event.
Nothing here decides anything.

A node's drivers die with it (they hold nothing durable): its prepares are then left to the
participants' resolvers and its decisions to the coordinator's finishers, which is what T3 is
about.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore import errors
from kvstore.core import txn
from kvstore.core.batch import Answer
from kvstore.core.replica.writes import DecideTxn, ForgetTxns, PrepareTxn, ResolveTxn, WriteRequest
from kvstore.core.request_window import MemoryShard
from kvstore.core.role import Role
from kvstore.core.txn_driver import DriverConfig, Mode, TxnDriver, TxnMutation
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
    SendResolve,
    SendValidate,
    Started,
    Tick,
    ValidateAnswered,
)
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.v1 import kv_pb2

if TYPE_CHECKING:
    from tests.sim.node import Node

ClientReply = Callable[[Any], None]
MAX_FORGET_IDS = 64  # decisions one forget record names
MAX_BACKGROUND = 32  # resolvers and finishers a node runs at once (its clients' drivers are not counted)


class TxnShell:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.world = node.world
        self.config = DriverConfig(shard_count=self.world.shards, max_attempts=6, backoff_first_ms=20,
                                   backoff_max_ms=400, mutations=self.world.txn_mutations)
        self.drivers: dict[str, tuple[TxnDriver, ClientReply | None]] = {}
        self._wake: dict[str, int] = {}
        self.forgets: dict[int, set[str]] = {}  # coordinator shard -> decisions resolved everywhere
        self._forgetting: set[int] = set()  # shards with a forget record in flight
        # Prepares whose read barrier is out before their recovery, and when it was asked: a barrier
        # of a replica closed meanwhile never answers, so a check older than a call's timeout is over.
        self._checking: dict[str, int] = {}

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

    # ---- resolvers, finishers, forgetting ----------------------------------------------------------------

    def kick(self, txn_ids: tuple[str, ...]) -> None:
        """A read waits on these transactions' locks (`ResolveNow`): resolve them now."""
        self._resolve_round(only=frozenset(txn_ids))

    def note_forget(self, shard: int, txn_id: str) -> None:
        """A driver learned that every other participant resolved `txn_id` (coordinator `shard`)."""
        self.forgets.setdefault(shard, set()).add(txn_id)

    def _background(self) -> int:
        return sum(1 for driver, reply in self.drivers.values() if reply is None)

    def _resolve_round(self, only: frozenset[str] = frozenset()) -> None:
        world = self.world
        now_unix = self._unix_ms()
        for shard, replica in sorted(self.node.replicas.items()):
            if replica.role is not Role.LEADING:
                self.forgets.pop(shard, None)
                continue
            for prepared in replica.store.locks.prepared():
                asked = self._checking.get(prepared.txn_id)
                if asked is not None and world.sched.now - asked > world.timing.txn_call_timeout_ms:
                    del self._checking[prepared.txn_id]
                if prepared.txn_id in self.drivers or prepared.txn_id in self._checking:
                    continue
                if self._background() + len(self._checking) >= MAX_BACKGROUND:
                    continue
                if only and prepared.txn_id not in only:
                    continue
                if not only and now_unix - prepared.leader_unix_ms < world.timing.txn_in_doubt_ms:
                    continue
                self._check_then_recover(shard, prepared.txn_id)
            if only or TxnMutation.DECISION_IN_REQUEST_TABLE in self.config.mutations:
                continue  # (the mutation: decisions live in the request-id table, nothing finishes them)
            for decided in replica.store.decided():
                if decided.txn_id in self.drivers or self._background() >= MAX_BACKGROUND:
                    continue
                if now_unix - decided.leader_unix_ms < world.timing.txn_finish_after_ms:
                    continue
                world.audit.counters["txn_finishes"] += 1
                driver = TxnDriver.finish(self.config, decided.decision, decided.decided(), now_unix_ms=now_unix,
                                          deadline_ms=world.sched.now + world.timing.txn_deadline_ms,
                                          also_here=replica.store.locks.prepared_txn(decided.txn_id) is not None)
                self.drivers[decided.txn_id] = (driver, None)
                self._step(decided.txn_id, Started())
            self._forget(shard, replica.store)
        if not only:
            world.sched.at(world.timing.txn_resolve_every_ms, self._resolve_round, self.node)

    def _check_then_recover(self, shard: int, txn_id: str) -> None:
        """A recovery starts only once a read barrier showed this replica leads the shard and has
        the prepare still in doubt (not from a stale view: a paused leader waking up would abort
        a transaction that was resolved and forgotten meanwhile); its start is that moment."""
        world = self.world
        replica = self.node.replicas[shard]
        self._checking[txn_id] = asked = world.sched.now

        def checked(refused: errors.StoreError | None) -> None:
            if self._checking.get(txn_id) == asked:
                del self._checking[txn_id]
            prepared = replica.store.locks.prepared_txn(txn_id)
            if refused is not None or prepared is None or replica.role is not Role.LEADING \
                    or self.node.replicas.get(shard) is not replica or txn_id in self.drivers:
                return
            world.trace.log(f"{self.node.name} s{shard} resolves {txn_id}, in doubt since {prepared.leader_unix_ms}")
            world.audit.counters["txn_recoveries"] += 1
            driver = TxnDriver.recover(self.config, prepared.prepare, at_shard=shard, now_unix_ms=self._unix_ms(),
                                       deadline_ms=world.sched.now + world.timing.txn_deadline_ms,
                                       reason=f"in doubt at shard {shard}")
            self.drivers[txn_id] = (driver, None)
            self._step(txn_id, Started())

        replica.barrier(checked)

    def _forget(self, shard: int, store: MemoryShard) -> None:
        """One forget record for decisions resolved everywhere, one at a time per shard."""
        pending = self.forgets.get(shard)
        if not pending or shard in self._forgetting:
            return
        ids = sorted(pending)[:MAX_FORGET_IDS]
        self._forgetting.add(shard)
        replica = self.node.replicas[shard]

        def answered(answer: Answer) -> None:
            self._forgetting.discard(shard)
            if isinstance(answer, wal_entry_pb2.TxnForget):
                self.world.audit.counters["txn_forgets"] += 1
                left = self.forgets.get(shard)
                if left is not None:
                    left.difference_update(ids)

        replica.write(ForgetTxns(tuple(ids)), None, answered)

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
            prepare_action = action

            a = prepare_action
            prepare = PrepareTxn(a.txn_id, a.request, a.shard, world.shards, started_unix_ms=a.started_unix_ms,
                                 first_attempt_unix_ms=a.first_attempt_unix_ms)

            shard = action.shard
            self._call(txn_id, driver, shard, prepare, lambda answer: PrepareAnswered(shard, answer))
        elif isinstance(action, SendDecide):
            decide, started = action.decide, action.started_unix_ms
            second = TxnMutation.SECOND_DECISION in world.txn_mutations
            table_only = TxnMutation.DECISION_IN_REQUEST_TABLE in world.txn_mutations

            decide_write = DecideTxn(decide, world.shards, started_unix_ms=started, second_decision=second,
                                     request_table_only=table_only)

            self._call(txn_id, driver, action.shard, decide_write, DecideAnswered)
        elif isinstance(action, SendResolve):
            resolve, target = action.resolve, action.shard
            self._call(txn_id, driver, target, ResolveTxn(resolve),
                       lambda answer: ResolveAnswered(target, answer))
        elif isinstance(action, SendRead):
            read_action = action

            def read_part(store: MemoryShard) -> object:
                try:
                    vote = txn.evaluate_read_part(read_action.request, read_action.shard, world.shards, store.get)
                except (errors.StoreError, ValueError) as exc:
                    return exc if isinstance(exc, errors.StoreError) else errors.InvalidRequestError(str(exc))
                return PartRead(vote, store.read_revision)

            keys = txn.part_keys(txn.part_of(action.request, action.shard, world.shards))
            self._read(txn_id, driver, action.shard, keys, read_part,
                       functools.partial(ReadAnswered, action.shard))
        elif isinstance(action, SendValidate):
            since, checked = action.revision, action.keys
            self._read(txn_id, driver, action.shard, checked,
                       lambda store: store.recent.unchanged_since(since, keys=checked),
                       functools.partial(ValidateAnswered, action.shard))
        elif isinstance(action, Reply):
            assert reply is not None, "a resolver's driver has no client"
            reply(action.answer)
        elif isinstance(action, Forget):
            self._tell_forget(action.shard, action.txn_id)
        else:
            assert isinstance(action, Finished)
            self.drivers.pop(txn_id, None)
            outcome = "unknown" if action.committed is None else "committed" if action.committed else "aborted"
            kind = {Mode.CLIENT: "driven", Mode.RECOVER: "recovered", Mode.FINISH: "finished"}[driver.mode]
            world.audit.counters[f"txn_{kind}_{outcome}"] += 1
            if action.in_doubt:
                world.trace.log(f"{self.node.name} txn {txn_id} left in doubt: {action.in_doubt}")

    def _tell_forget(self, shard: int, txn_id: str) -> None:
        """The `Forget` hint, to the node the group says leads the coordinator shard (lost if
        there is none: the finishers resolve the decision again)."""
        world = self.world
        owner = self.node.owners[shard]
        target = world.peers.get(owner) if owner is not None else None
        if target is None:
            return
        world.net.send(lambda: target.txns.note_forget(shard, txn_id), target, once=True)

    def _call(self, txn_id: str, driver: TxnDriver, shard: int, write: WriteRequest,
              event_of: Callable[[Any], Any]) -> None:
        """One peer call to the node the group says leads `shard` (any node if none is known),
        bounded by the call timeout: no answer in time is an unknown outcome."""
        self._peer_call(txn_id, driver, shard, event_of,
                        lambda target, answer: target.handle_record(shard, write, answer))

    def _read(self, txn_id: str, driver: TxnDriver, shard: int, keys: tuple[bytes, ...],
              read: Callable[[MemoryShard], object], event_of: Callable[[Any], Any]) -> None:
        """One peer read of `shard` at the node the group says leads it (`Node.handle_read`)."""
        self._peer_call(txn_id, driver, shard, event_of,
                        lambda target, answer: target.handle_read(shard, keys, None, read, answer))

    def _peer_call(self, txn_id: str, driver: TxnDriver, shard: int, event_of: Callable[[Any], Any],
                   at: Callable[[Node, Callable[[Any], None]], None]) -> None:
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
            at(target, lambda answer: back(lambda: deliver(answer)))

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
