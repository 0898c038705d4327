"""`AsyncClient.write_batch`/`put_many`, the operators' calls and `AsyncBatchingWriter`, without
a server: each batch scenario of tests/unit/test_client_batch.py runs on both clients over the
same scripted nodes and must send the same calls and end the same way (they drive one
`BatchRounds`); each operator call sends the same request and reads the same result; the writer
keeps `BatchingWriter`'s rules. Real nodes: tests/integration/test_client_aio.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from kvstore.client import (
    BatchIncomplete,
    BatchResult,
    Client,
    InvalidArgument,
    KvError,
    Op,
    Overloaded,
    ShardWrite,
    Unavailable,
    UnknownOutcome,
)
from kvstore.client.aio import AsyncBatchingWriter, AsyncClient
from kvstore.core.sharding import shard_of
from kvstore.errors import OUTCOME_KEY, OUTCOME_NONE, SHARD_KEY
from kvstore.v1 import cluster_pb2
from tests.unit.test_client import FakeRpcError, Scripted
from tests.unit.test_client_aio import AsyncScripted
from tests.unit.test_client_batch import NOT_LEADER, REFUSED, SHARDS, UNKNOWN, Nodes, every_shard_ops, fails, keys, ok

SC = grpc.StatusCode


def async_nodes(client: AsyncClient, **kwargs: Any) -> Nodes:
    """`Nodes`' scripted answers behind the asynchronous client's seams."""
    nodes = Nodes(SimpleNamespace(), **kwargs)  # type: ignore[arg-type]

    async def invoke(target: str, method: str, request: Message, timeout: float) -> Message:
        return nodes._invoke(target, method, request, timeout)

    async def invoke_many(calls: Sequence[tuple[str, Message]], method: str,
                          timeout: float) -> list[Message | grpc.RpcError]:
        return nodes._invoke_many(calls, method, timeout)

    async def sleep(attempt: int, deadline: float, error: object = None) -> None:
        nodes.slept.append(attempt)

    client._invoke = invoke  # type: ignore[method-assign]
    client._invoke_many = invoke_many  # type: ignore[method-assign]
    client._sleep_backoff = sleep  # type: ignore[method-assign]
    return nodes


def view(ended: BatchResult | BatchIncomplete) -> tuple[object, ...]:
    """How a batch ended, comparable across the clients."""
    if isinstance(ended, BatchIncomplete):
        return ("incomplete", sorted(ended.committed), {s: (type(err).__name__, err.request_id, err.attempts)
                                                        for s, err in sorted(ended.errors.items())},
                ended.unknown, str(ended))
    return ("ok", [(p.shard, p.revision, p.replayed, p.request_id, p.mutations) for p in ended.shards],
            ended.request_id)


NO_HINT = fails(SC.FAILED_PRECONDITION, "no leader", **{OUTCOME_KEY: OUTCOME_NONE, SHARD_KEY: "0"})
# name -> (the scripted nodes' arguments, made afresh per client: answers are consumed; max_attempts)
SCENARIOS: dict[str, tuple[Callable[[], dict[str, Any]], int]] = {
    "every part committed": (dict, 6),
    "a part redirected by its hint": (lambda: {"parts": {1: [NOT_LEADER]}}, 6),
    "an unknown part replayed": (lambda: {"parts": {3: [UNKNOWN, ok(7, replayed=True)]}}, 6),
    "a definite refusal": (lambda: {"parts": {2: [REFUSED]}}, 6),
    "a node dropping every call": (lambda: {"calls": {"n1:1": [FakeRpcError(SC.UNAVAILABLE, "Socket closed")
                                                               for _ in range(3)]}}, 3),
    "unknown, then refused": (lambda: {"parts": {1: [UNKNOWN, REFUSED]}}, 6),
    "not leader without a hint": (lambda: {"parts": {0: [NO_HINT]}}, 6),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_batch_sends_the_same_calls_and_ends_the_same_way_on_both_clients(scenario: str) -> None:
    script, max_attempts = SCENARIOS[scenario]
    sync_client = Client(["n1:1"], max_attempts=max_attempts)
    sync_nodes = Nodes(sync_client, **script())
    try:
        sync_end = view(sync_client.write_batch(every_shard_ops(), request_id="b"))
    except BatchIncomplete as incomplete:
        sync_end = view(incomplete)

    async def scenario_aio() -> tuple[tuple[object, ...], Nodes]:
        async with AsyncClient(["n1:1"], max_attempts=max_attempts) as client:
            nodes = async_nodes(client, **script())
            try:
                return view(await client.write_batch(every_shard_ops(), request_id="b")), nodes
            except BatchIncomplete as incomplete:
                return view(incomplete), nodes

    aio_end, aio_nodes = asyncio.run(scenario_aio())
    assert aio_end == sync_end
    assert aio_nodes.sent_shards() == sync_nodes.sent_shards()
    assert [[p.request_id for p in r.shards] for _, r in aio_nodes.sent] == \
        [[p.request_id for p in r.shards] for _, r in sync_nodes.sent]
    assert len(aio_nodes.slept) == len(sync_nodes.slept)


def test_put_many_and_the_checks_before_sending() -> None:
    async def scenario() -> None:
        async with AsyncClient(["n1:1"]) as client:
            nodes = async_nodes(client)
            assert (await client.put_many({keys(0)[0]: b"1", keys(1)[0]: "2"})).mutations == 2
            assert (await client.put_many([(keys(3)[0], b"1")])).revisions == {3: 10}
            sent = len(nodes.sent)
            with pytest.raises(InvalidArgument, match="at least one put or delete"):
                await client.write_batch([])
            with pytest.raises(InvalidArgument, match=r"Op\.put and Op\.delete only"):
                await client.write_batch([Op.get("k")])
            assert len(nodes.sent) == sent
    asyncio.run(scenario())


def test_a_batch_without_a_shard_map_is_refused_with_nothing_sent() -> None:
    async def scenario() -> None:
        async with AsyncClient(["n1:1"], timeout_s=0.5) as client:
            async def no_map(target: str, method: str, request: Message, timeout: float) -> Message:
                raise FakeRpcError(SC.UNAVAILABLE, "connection refused")
            client._invoke = no_map  # type: ignore[method-assign]
            with pytest.raises(KvError, match="nothing was sent") as info:
                await client.write_batch([Op.put("k", "v")], request_id="b")
            assert info.value.request_id == "b" and not isinstance(info.value, UnknownOutcome)
    asyncio.run(scenario())


# ---- the operators' calls: the same request, the same result ----------------------------------

PLACED = cluster_pb2.PlacementChange(shard=1, before=["n1", "n2"], after=["n1", "n3"])
ADMIN: list[tuple[str, tuple[Any, ...], dict[str, Any], Message]] = [
    ("list_transactions", (100,), {}, cluster_pb2.ListTransactionsResponse(transactions=[
        cluster_pb2.TransactionInfo(shard=1, first_offset=5, end_offset=9, age_ms=300, leader_id="n1")])),
    ("prepared_transactions", (0,), {}, cluster_pb2.ListPreparedTransactionsResponse(
        transactions=[cluster_pb2.PreparedTransaction(txn_id="t1", shard=2, coordinator=0, participants=[0, 2],
                                                      age_ms=40, revision=8, request_id="r", locked_keys=3,
                                                      leader_id="n2")], unreachable=["n4"])),
    ("resolve_transaction", ("t1",), {}, cluster_pb2.ResolveTransactionResponse(
        txn_id="t1", outcome="committed", detail="by its decision", shards=[0, 2])),
    ("fence", (3,), {}, cluster_pb2.FenceShardResponse(shard=3, end_offset=77, notified="n2")),
    ("placement_log", (5,), {}, cluster_pb2.PlacementLogResponse(
        entries=[cluster_pb2.PlacementLogEntry(offset=1, epoch=2, kind="drain", summary="drain n2", reason="op",
                                               at_ms=9)], epoch=2, controller="n1", controller_term=4,
        skipped={"malformed": 1})),
    ("drain", ("n2",), {"epoch": 4, "force": True}, cluster_pb2.DrainResponse(changes=[PLACED])),
    ("move_shard", (1, "n3"), {"epoch": 4}, cluster_pb2.MoveShardResponse(changes=[PLACED])),
]


@pytest.mark.parametrize(("name", "args", "kwargs", "response"), ADMIN, ids=[a[0] for a in ADMIN])
def test_an_operator_call_sends_the_same_request_and_reads_the_same_result(
        name: str, args: tuple[Any, ...], kwargs: dict[str, Any], response: Message) -> None:
    sync_client = Client(["n1:1"])
    sync_script = Scripted(sync_client, 4, {}, [response])
    expected = getattr(sync_client, name)(*args, **kwargs)

    async def scenario() -> tuple[Any, AsyncScripted]:
        async with AsyncClient(["n1:1"]) as client:
            script = AsyncScripted(client, 4, {}, [response])
            return await getattr(client, name)(*args, **kwargs), script

    got, aio_script = asyncio.run(scenario())
    assert got == expected
    sent = [(a.method, a.request) for a in sync_script.attempts if a.method != "ShardMap"]
    assert [(a.method, a.request) for a in aio_script.attempts if a.method != "ShardMap"] == sent


def test_operator_calls_refuse_bad_arguments_alike_and_need_a_placement_epoch() -> None:
    bad: list[tuple[str, tuple[Any, ...], dict[str, Any], str]] = [
        ("list_transactions", (-1,), {}, "older_than_ms"), ("prepared_transactions", (-1,), {}, "older_than_ms"),
        ("resolve_transaction", ("",), {}, "txn id"), ("fence", (-1,), {}, "shard must be"),
        ("placement_log", (-1,), {}, "limit"), ("drain", ("",), {}, "node id"),
        ("move_shard", (0,), {}, "either a node to move to or unpin"),
        ("move_shard", (0, "n2"), {"unpin": True}, "either a node to move to or unpin")]

    async def scenario() -> None:
        async with AsyncClient(["n1:1"]) as client:
            script = AsyncScripted(client, 4, {}, [])
            for name, args, kwargs, match in bad:
                with pytest.raises(InvalidArgument, match=match):
                    await getattr(client, name)(*args, **kwargs)
            assert script.attempts == []
            with pytest.raises(Unavailable, match="no placement yet"):  # the scripted map has epoch 0
                await client.drain("n2")
    asyncio.run(scenario())
    sync_client = Client(["n1:1"])
    Scripted(sync_client, 4, {}, [])
    for name, args, kwargs, match in bad:
        with pytest.raises(InvalidArgument, match=match):
            getattr(sync_client, name)(*args, **kwargs)


def test_wait_moves_polls_until_done() -> None:
    from kvstore.client.moves import PlacementChange

    async def scenario() -> None:
        async with AsyncClient(["n1:1"]) as client:
            maps = [
                cluster_pb2.ShardMapResponse(shard_count=2, shards=[cluster_pb2.ShardInfo(shard=1, replicas=[
                    cluster_pb2.ReplicaInfo(node_id="n3", state=cluster_pb2.REPLICA_STATE_LEARNER, lag=5)])]),
                cluster_pb2.ShardMapResponse(shard_count=2, shards=[cluster_pb2.ShardInfo(shard=1, replicas=[
                    cluster_pb2.ReplicaInfo(node_id="n3", state=cluster_pb2.REPLICA_STATE_REPLICA, in_group=True)])]),
            ]

            async def invoke(target: str, method: str, request: Message, timeout: float) -> Message:
                assert method == "ShardMap"
                return maps.pop(0) if len(maps) > 1 else maps[0]

            client._invoke = invoke  # type: ignore[method-assign]
            seen: list[bool] = []
            done = await client.wait_moves([PlacementChange(1, ("n1",), ("n3",))], timeout_s=5, poll_s=0.01,
                                           on_progress=lambda p: seen.append(p.done))
            assert done.done and seen == [False, True]
    asyncio.run(scenario())


# ---- AsyncBatchingWriter, over a fake asynchronous client -------------------------------------


class FakeAsyncClient:
    """`shard_map` and `write_batch`, recording each batch; `gate` holds calls until set."""

    def __init__(self, outcome: Callable[[list[Op]], BatchResult] | None = None) -> None:
        self.batches: list[list[Op]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.in_flight = 0
        self.max_in_flight = 0
        self.outcome = outcome

    async def shard_map(self) -> Any:
        return SimpleNamespace(shard_count=SHARDS)

    async def write_batch(self, ops: list[Op], *, timeout_s: float) -> BatchResult:
        self.batches.append(list(ops))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.wait_for(self.gate.wait(), 10)
            if self.outcome is not None:
                return self.outcome(ops)
            shards = sorted({shard_of(op.key, SHARDS) for op in ops})
            return BatchResult(tuple(ShardWrite(s, 100 + len(self.batches), sum(
                1 for op in ops if shard_of(op.key, SHARDS) == s), False, f"x/{s}") for s in shards), "x")
        finally:
            self.in_flight -= 1


def writer(fake: FakeAsyncClient, **kwargs: Any) -> AsyncBatchingWriter:
    return AsyncBatchingWriter(fake, **kwargs)  # type: ignore[arg-type]


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def test_the_writer_lingers_then_fills_whole_batches() -> None:
    async def scenario() -> None:
        fake = FakeAsyncClient()
        async with writer(fake, linger_ms=50) as w:
            started = time.monotonic()
            result = await (await w.put(keys(1)[0], b"v"))
            assert result.shard == 1 and 0.04 <= time.monotonic() - started < 2.0
        fake = FakeAsyncClient()
        async with writer(fake, linger_ms=60_000, max_batch_mutations=10, max_buffered_mutations=100) as w:
            futures = [await w.put(k, b"v") for k in keys(2, 10)]
            await asyncio.wait_for(asyncio.gather(*futures), 5)
            assert [len(b) for b in fake.batches] == [10] and w.batches == 1 and w.mutations == 10
    asyncio.run(scenario())


def test_one_batch_per_shard_in_flight_keeps_the_order() -> None:
    async def scenario() -> None:
        fake = FakeAsyncClient()
        fake.gate.clear()
        async with writer(fake, linger_ms=1, max_in_flight=4) as w:
            first = await w.put(keys(0)[0], b"1")
            await until(lambda: len(fake.batches) == 1)
            later = [await w.put(keys(0)[0], str(i).encode()) for i in range(2, 6)]
            await asyncio.sleep(0.05)  # many lingers: the shard's next batch waits for the first
            assert len(fake.batches) == 1
            fake.gate.set()
            assert [(await f).shard for f in [first, *later]] == [0] * 5
        assert [[op.value for op in b] for b in fake.batches] == [[b"1"], [b"2", b"3", b"4", b"5"]]
        assert fake.max_in_flight == 1
    asyncio.run(scenario())


def test_shards_go_in_parallel_up_to_max_in_flight() -> None:
    async def scenario() -> None:
        fake = FakeAsyncClient()
        fake.gate.clear()
        async with writer(fake, linger_ms=1, max_in_flight=2) as w:
            futures = [await w.put(keys(0)[0], b"v")]
            await until(lambda: len(fake.batches) == 1)
            futures.append(await w.put(keys(1)[0], b"v"))
            await until(lambda: len(fake.batches) == 2)
            futures += [await w.put(keys(2)[0], b"v"), await w.put(keys(3)[0], b"v")]
            await asyncio.sleep(0.05)
            assert len(fake.batches) == 2, "no third call while two are in flight"
            fake.gate.set()
            assert [(await f).shard for f in futures] == [0, 1, 2, 3]
        assert fake.max_in_flight == 2 and len(fake.batches) == 3
    asyncio.run(scenario())


def test_a_full_writer_makes_writers_wait_then_refuses_with_overloaded() -> None:
    async def scenario() -> None:
        fake = FakeAsyncClient()
        fake.gate.clear()
        w = writer(fake, linger_ms=1, max_batch_mutations=2, max_buffered_mutations=2, put_timeout_s=1.0)
        first = [await w.put(keys(0)[0], b"1"), await w.put(keys(0)[0], b"2")]
        with pytest.raises(Overloaded, match="max_buffered_mutations"):
            await w.put(keys(1)[0], b"3")
        waiting = asyncio.ensure_future(w.put(keys(1)[0], b"4"))  # waits for room ...
        await asyncio.sleep(0.05)
        assert not waiting.done()
        fake.gate.set()  # ... which the answer frees
        assert (await (await waiting)).shard == 1 and all(f.done() for f in first)
        await w.close()
    asyncio.run(scenario())


def test_each_write_gets_its_part_outcome_and_a_failure_is_unknown() -> None:
    unknown = UnknownOutcome("commit outcome unknown", request_id="x/1")

    def incomplete(ops: list[Op]) -> BatchResult:
        raise BatchIncomplete("1 of 2 parts not committed", committed={0: ShardWrite(0, 5, 1, False, "x/0")},
                              errors={1: unknown}, request_id="x", first_attempt_unix_ms=1)

    def bug(ops: list[Op]) -> BatchResult:
        raise RuntimeError("bug")

    async def scenario() -> None:
        async with writer(FakeAsyncClient(incomplete), linger_ms=20) as w:
            good, bad = await w.put(keys(0)[0], b"v"), await w.put(keys(1)[0], b"v")
            assert (await good).revision == 5
            with pytest.raises(UnknownOutcome) as info:
                await bad
            assert info.value is unknown
        async with writer(FakeAsyncClient(bug), linger_ms=1) as w:
            with pytest.raises(UnknownOutcome, match="bug"):
                await (await w.put(keys(0)[0], b"v"))
    asyncio.run(scenario())


def test_flush_close_and_a_cancelled_future() -> None:
    async def scenario() -> None:
        fake = FakeAsyncClient()
        w = writer(fake, linger_ms=60_000)
        futures = [await w.put(keys(s)[0], b"v") for s in range(SHARDS)]
        futures[0].cancel()  # the caller stops waiting; the write still goes
        await w.flush(timeout_s=5)
        assert all(f.done() for f in futures) and len(fake.batches) == 1 and len(fake.batches[0]) == SHARDS
        late = await w.put(keys(0)[0], b"late")
        await w.close()
        assert (await late).shard == 0
        with pytest.raises(InvalidArgument, match="closed"):
            await w.put(keys(0)[0], b"v")
        await w.close()  # twice: nothing more to do
    asyncio.run(scenario())


def test_writer_settings_and_writes_that_cannot_fit_are_refused_at_once() -> None:
    with pytest.raises(InvalidArgument, match="max_batch_mutations"):
        writer(FakeAsyncClient(), max_batch_mutations=0)

    async def scenario() -> None:
        async with writer(FakeAsyncClient(), max_batch_bytes=100) as w:
            with pytest.raises(InvalidArgument, match="max_batch_bytes"):
                await w.put(keys(0)[0], b"x" * 200)
            with pytest.raises(InvalidArgument, match="keys are"):
                await w.delete(b"")
    asyncio.run(scenario())


# ---- what the review found: lost calls, a part's attempts, cancelled futures, a stopped sender ------


class LostOnce:
    """A node's stub whose first WriteBatch call fails without a gRPC status (`exc`), then
    commits every part."""

    def __init__(self, exc: BaseException) -> None:
        self.exc: BaseException | None = exc
        self.calls = 0

    async def WriteBatch(self, request: Any, timeout: float, metadata: Any) -> Message:
        self.calls += 1
        if self.exc is not None:
            exc, self.exc = self.exc, None
            raise exc
        from kvstore.v1 import kv_pb2
        return kv_pb2.WriteBatchResponse(results=[ok(3)(part) for part in request.shards])


@pytest.mark.parametrize("exc", [RuntimeError("Channel is closed"), asyncio.CancelledError()],
                         ids=["runtime error", "cancelled by its channel"])
def test_a_call_lost_without_a_status_is_unknown_and_retried_never_an_escaping_exception(exc: BaseException) -> None:
    async def scenario() -> None:
        async with AsyncClient(["n1:1"], max_attempts=3) as client:
            async_nodes(client)  # the shard map and the sleeps; the calls below go through the real _invoke_many
            del client._invoke_many  # type: ignore[attr-defined]
            lost, fine = LostOnce(exc), LostOnce(RuntimeError("unused"))
            fine.exc = None
            client._channels.get = lambda target: SimpleNamespace(kv=lost if target == "n1:1" else fine)  # type: ignore[method-assign]
            result = await client.write_batch(every_shard_ops(), request_id="b")
            assert sorted(p.shard for p in result.shards) == [0, 1, 2, 3]
            assert lost.calls == 2 and fine.calls == 2, "the lost call retried; the others committed in round 1"
    asyncio.run(scenario())


def test_a_definite_refusal_then_no_connection_is_unavailable_as_for_a_put() -> None:
    """A part's attempts add up as a Put's (`AttemptLog`): a node refused the first definitely,
    the second never connected, so the part was reached and is not `Unreachable`."""
    from kvstore.client import Unreachable
    from kvstore.v1 import kv_pb2

    async def scenario() -> KvError:
        async with AsyncClient(["n1:1"], max_attempts=2) as client:
            async_nodes(client)
            rounds = 0

            async def refused_then_unconnected(calls: Sequence[tuple[str, Message]], method: str,
                                               timeout: float) -> list[Message | grpc.RpcError]:
                nonlocal rounds
                rounds += 1
                if rounds == 1:
                    _, request = calls[0]
                    assert isinstance(request, kv_pb2.WriteBatchRequest)
                    return [kv_pb2.WriteBatchResponse(results=[NO_HINT(p) for p in request.shards])]
                return [FakeRpcError(SC.UNAVAILABLE, "failed to connect to all addresses")]

            client._invoke_many = refused_then_unconnected  # type: ignore[method-assign]
            with pytest.raises(BatchIncomplete) as info:
                await client.write_batch([Op.put(keys(0)[0], b"v")], request_id="b")
            assert rounds == 2
            return info.value.errors[0]

    error = asyncio.run(scenario())
    assert not isinstance(error, Unreachable | UnknownOutcome) and error.request_id == "b/0", error
    assert error.attempts == 2


def test_a_writer_whose_sender_stops_fails_its_buffered_writes_and_takes_no_more() -> None:
    async def scenario() -> None:
        fake = FakeAsyncClient()
        w = writer(fake, linger_ms=60_000)
        buffered = await w.put(keys(0)[0], b"v")
        assert w._sender is not None
        w._sender.cancel()
        with pytest.raises(KvError, match="never sent"):
            await buffered
        assert fake.batches == []
        with pytest.raises(InvalidArgument, match="closed"):
            await w.put(keys(0)[0], b"v")
        await w.close()
    asyncio.run(scenario())
