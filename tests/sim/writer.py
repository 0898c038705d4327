"""The single-writer guard's I/O shell against the simulated broker.

Why: the guard (`wal.guard.Guard`) is the real code under test; this module is to it what
`wal.writer.ShardWriter._drive` is with librdkafka: it performs the guard's actions
(init_transactions, the settled end, produce, commit, abort) as messages to the broker model
and feeds back what came back, as events. It decides nothing. Every call has librdkafka's
bound (`Timing.call_timeout_ms`): an answer that does not come in time is a retriable timeout
for the guard, while the request itself may still land later, which is the point.

A batch goes out in one to `Timing.produce_chunks` produce requests (librdkafka splits large
batches), the first carrying AddPartitionsToTxn, each with its own sequence number. An abort
of a transaction that never sent a record stays local, as librdkafka's does.

The teeth test's broken leader (`World.check_w2` False) is made here, in the shell: it reports
every record as delivered at its expected offset, so the guard's W2 comparison never sees a
mismatch and commits whatever landed wherever it landed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tests.sim.kafka import BrokerError, ProduceRequest
from tests.sim.scheduler import Actor
from tests.sim.world import LeaderCommit, World
from wal import record
from wal.clients import shard_transactional_id
from wal.errors import ErrorClass, WalError, classify
from wal.guard import (
    Aborted,
    AbortTransaction,
    Action,
    Append,
    AppendResult,
    BeginAndProduce,
    CloseProducer,
    Committed,
    CommitTransaction,
    Complete,
    Delivered,
    EndOffsetRead,
    Event,
    Fail,
    Failed,
    Fence,
    Guard,
    Initialized,
    InitTransactions,
    Op,
    ReadEndOffset,
)
from wal.record import Headers

TOPIC = "sim.wal"
PLACEMENT_TXN_ID = f"{TOPIC}.placement"  # the one controller's transactional id (W4 for the placement log)

Result = int | AppendResult | WalError
Reply = Callable[[Callable[[], Event]], None]


class _Producer:
    """One librdkafka producer instance: its id and epoch once initialised."""

    def __init__(self, instance: int) -> None:
        self.instance = instance
        self.pid = -1
        self.epoch = -1
        self.added = False  # a record of the current transaction was sent (AddPartitionsToTxn)


class SimWriter:
    """One leadership's writer for one shard (the real replica also opens one per leadership), or
    for the placement log (`shard`: its partition, `txn_id`: the controller's transactional id)."""

    def __init__(self, world: World, node: Actor, shard: int, txn_id: str | None = None) -> None:
        self.world = world
        self.node = node
        self.shard = shard
        self.txn_id = txn_id if txn_id is not None else shard_transactional_id(TOPIC, shard)
        self.guard = Guard(retry_limit=world.timing.retry_limit)
        self.identity = record.WriterIdentity(node.name, 0)
        self.closed = False
        self._producer: _Producer | None = None
        self._token = 0
        self._done: Callable[[Result], None] | None = None
        self._payloads: Sequence[bytes] = ()

    @property
    def busy(self) -> bool:
        return self._done is not None

    def fence(self, done: Callable[[Result], None]) -> None:
        """Take the shard: fence older writers (W4) and learn the upcoming offset (W6)."""
        self._start(Fence(), done)

    def append(self, payloads: Sequence[bytes], expected_offset: int, done: Callable[[Result], None]) -> None:
        self._payloads = payloads
        self._start(Append(len(payloads), expected_offset), done)

    def close(self) -> None:
        """Drop the producer; answers still travelling to it are ignored from now on."""
        self.closed = True
        self._token += 1
        self._producer = None
        self._done = None

    # ---- the drive loop (wal.writer.ShardWriter._drive, asynchronously) ---------------------------

    def _start(self, request: Fence | Append, done: Callable[[Result], None]) -> None:
        assert not self.closed and self._done is None, "one request at a time"
        self._done = done
        self._run(self.guard.step(request))

    def _run(self, actions: list[Action]) -> None:
        for index, action in enumerate(actions):
            if isinstance(action, Complete):
                self._finish(action.result)
                return
            if isinstance(action, Fail):
                self._finish(action.error)
                return
            if isinstance(action, CloseProducer):
                self._producer = None
                continue
            assert index == len(actions) - 1, f"I/O action {action!r} must be the guard's last action"
            self._perform(action)
            return
        raise AssertionError("the guard ended a request without Complete or Fail")

    def _finish(self, result: Result) -> None:
        done, self._done = self._done, None
        assert done is not None
        if isinstance(result, AppendResult):
            self.world.audit.leader_commits.append(
                LeaderCommit(self.node.name, self.shard, result.offsets, tuple(self._payloads)))
        self._payloads = ()
        done(result)

    def _expect(self, timeout: Failed) -> Reply:
        """A fresh call: its answer (or `timeout` after the call bound, whichever is first) goes
        to the guard; anything arriving later is dropped, like a librdkafka call that returned."""
        self._token += 1
        token = self._token

        def reply(event: Callable[[], Event]) -> None:
            if token != self._token or self.closed:
                return
            self._token += 1
            self._run(self.guard.step(event()))

        self.world.sched.at(self.world.timing.call_timeout_ms, lambda: reply(lambda: timeout), self.node)
        return reply

    def _perform(self, action: Action) -> None:
        if isinstance(action, InitTransactions):
            self._init(action.fresh_producer)
        elif isinstance(action, ReadEndOffset):
            self._settled_end()
        elif isinstance(action, BeginAndProduce):
            self._produce(action)
        elif isinstance(action, CommitTransaction):
            self._end_txn(commit=True)
        elif isinstance(action, AbortTransaction):
            self._end_txn(commit=False)
        else:
            raise AssertionError(f"unknown action {action!r}")

    # ---- the calls ------------------------------------------------------------------------------

    def _init(self, fresh: bool) -> None:
        if fresh or self._producer is None:
            self._producer = _Producer(self.world.next_id())
        producer = self._producer
        reply = self._expect(Failed(Op.INIT, ErrorClass.RETRIABLE, "_TIMED_OUT: init_transactions"))
        net, broker = self.world.net, self.world.broker
        back = net.answer_to(self.node)

        def at_broker() -> None:
            result = broker.init_producer_id(self.txn_id, self.shard)
            back(lambda: reply(lambda: self._initialized(producer, result)))

        net.send(at_broker, None, sender=self.node)

    def _initialized(self, producer: _Producer, result: tuple[int, int] | BrokerError) -> Event:
        if isinstance(result, BrokerError):
            return _failed(Op.INIT, result)
        producer.pid, producer.epoch = result
        producer.added = False
        return Initialized()

    def _settled_end(self) -> None:
        """The high watermark at a moment no transaction is open (LSO == HW), as
        `wal.clients.PartitionEnds.settled_end` reads it; asks again while they differ."""
        reply = self._expect(Failed(Op.END_OFFSET, ErrorClass.RETRIABLE, "_TIMED_OUT: a transaction stays open"))
        token = self._token
        world = self.world

        def ask() -> None:
            back = world.net.answer_to(self.node)

            def at_broker() -> None:
                lso, hw = world.broker.ends(self.shard)
                back(lambda: answer(lso, hw))

            world.net.send(at_broker, None, sender=self.node)

        def answer(lso: int, hw: int) -> None:
            if token != self._token or self.closed:
                return
            if lso == hw:
                reply(lambda: EndOffsetRead(hw))
            else:
                world.sched.at(world.timing.settle_poll_ms, ask, self.node)

        ask()

    def _produce(self, action: BeginAndProduce) -> None:
        producer = self._producer
        assert producer is not None and producer.pid >= 0, "produce before init"
        assert len(self._payloads) == action.count
        records: list[tuple[bytes, Headers]] = [
            record.encode(action.first_offset + index, self.identity, payload)
            for index, payload in enumerate(self._payloads)]
        parts = self.world.sched.between(1, min(action.count, self.world.timing.produce_chunks))
        size = -(-len(records) // parts)
        chunks = [tuple(records[i:i + size]) for i in range(0, len(records), size)]
        reply = self._expect(Failed(Op.PRODUCE, ErrorClass.RETRIABLE, "_TIMED_OUT: flush"))
        token = self._token
        delivered: list[int] = []  # offsets, in record order
        delivered_chunks: list[int] = []  # chunks answered, in order (a duplicate answer is ignored)
        world, node = self.world, self.node

        def send(index: int) -> None:
            req = ProduceRequest(self.txn_id, self.shard, producer.pid, producer.epoch, world.next_id(),
                                 first_in_txn=not producer.added, records=chunks[index])
            producer.added = True
            back = world.net.answer_to(node)

            def at_broker() -> None:
                result = world.broker.produce(req)
                back(lambda: answer(index, result))

            world.net.send(at_broker, None, sender=self.node)

        def answer(index: int, result: tuple[int, ...] | BrokerError) -> None:
            if token != self._token or self.closed or index != len(delivered_chunks):
                return  # a late or duplicated answer
            if isinstance(result, BrokerError):
                reply(lambda: _failed(Op.PRODUCE, result))
                return
            delivered_chunks.append(index)
            delivered.extend(result)
            if index + 1 < len(chunks):
                send(index + 1)
            elif world.check_w2:
                reply(lambda: Delivered(tuple(delivered)))
            else:  # the broken leader: believes every record landed where it expected
                reply(lambda: Delivered(tuple(range(action.first_offset, action.first_offset + action.count))))

        send(0)

    def _end_txn(self, *, commit: bool) -> None:
        producer = self._producer
        assert producer is not None and producer.pid >= 0
        op = Op.COMMIT if commit else Op.ABORT
        world = self.world
        if not commit and not producer.added:
            producer.added = False
            self._run(self.guard.step(Aborted()))  # nothing was sent: librdkafka aborts locally
            return
        if commit and world.broker.refuse_rate and world.sched.chance(world.broker.refuse_rate):
            # librdkafka refused before sending EndTxn (e.g. a flush error): nothing left the client.
            self._run(self.guard.step(Failed(op, ErrorClass.ABORTABLE, "Failed to flush all outstanding messages",
                                             before_end_txn=True)))
            return
        reply = self._expect(Failed(op, ErrorClass.RETRIABLE, f"_TIMED_OUT: {op.value}_transaction"))
        pid, epoch = producer.pid, producer.epoch
        back = world.net.answer_to(self.node)

        def at_broker() -> None:
            result = world.broker.end_txn(self.txn_id, pid, epoch, commit)
            back(lambda: reply(lambda: self._ended(producer, op, result)))

        world.net.send(at_broker, None, end_txn=True, sender=self.node)

    def _ended(self, producer: _Producer, op: Op, result: int | BrokerError) -> Event:
        if isinstance(result, BrokerError):
            return _failed(op, result)
        producer.epoch = result  # KIP-890: the epoch of the next transaction
        producer.added = False
        return Committed() if op is Op.COMMIT else Aborted()


def _failed(op: Op, error: BrokerError) -> Failed:
    """A broker error as the guard sees it, classified by the real `wal.errors.classify`."""
    error_class = classify(error.name, fatal=error.fatal, retriable=error.retriable,
                           txn_requires_abort=error.abortable)
    return Failed(op, error_class, error.name)

