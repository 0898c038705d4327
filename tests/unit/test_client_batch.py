"""`Client.write_batch` / `put_many` and `BatchingWriter`, without a server.

The batch's retry loop is driven through the client's many-nodes seam (`_invoke_many`), with a
scripted node per address; the writer through a fake client. The real server is exercised in
tests/integration/test_write_batch.py.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from kvstore import limits
from kvstore.client import (
    BatchIncomplete,
    BatchingWriter,
    BatchResult,
    Client,
    InvalidArgument,
    KvError,
    NotLeader,
    Op,
    Overloaded,
    ShardWrite,
    UnknownOutcome,
)
from kvstore.core.sharding import shard_of
from kvstore.errors import LEADER_HINT_KEY, OUTCOME_KEY, OUTCOME_NONE, OUTCOME_UNKNOWN, SHARD_KEY
from kvstore.v1 import cluster_pb2, kv_pb2
from tests.unit.test_client import FakeRpcError, key_on
from tests.waiting import holds_for

SC = grpc.StatusCode
SHARDS = 4
LEADERS = {0: "n1:1", 1: "n2:1", 2: "n1:1", 3: "n3:1"}

Answer = Callable[[kv_pb2.ShardMutations], kv_pb2.ShardMutationsResult]


def ok(revision: int = 10, replayed: bool = False) -> Answer:
    def answer(part: kv_pb2.ShardMutations) -> kv_pb2.ShardMutationsResult:
        return kv_pb2.ShardMutationsResult(
            shard=part.shard, mutations=len(part.mutations),
            result=kv_pb2.WriteResult(shard=part.shard, revision=revision, replayed=replayed))
    return answer


def fails(code: grpc.StatusCode, message: str, **metadata: str) -> Answer:
    def answer(part: kv_pb2.ShardMutations) -> kv_pb2.ShardMutationsResult:
        return kv_pb2.ShardMutationsResult(
            shard=part.shard, error=kv_pb2.PartError(code=code.value[0], message=message, metadata=metadata))
    return answer


NOT_LEADER = fails(SC.FAILED_PRECONDITION, "not the leader", **{OUTCOME_KEY: OUTCOME_NONE, SHARD_KEY: "1",
                                                                 LEADER_HINT_KEY: "n3:1"})
UNKNOWN = fails(SC.UNKNOWN, "commit outcome unknown", **{OUTCOME_KEY: OUTCOME_UNKNOWN})
REFUSED = fails(SC.FAILED_PRECONDITION, "something definite", **{OUTCOME_KEY: OUTCOME_NONE})


class Nodes:
    """Replaces the client's seams: ShardMap from LEADERS; each WriteBatch call is answered per
    part by the next scripted answer for that shard (default: committed), or fails whole with a
    scripted `grpc.RpcError` for that node."""

    def __init__(self, client: Client, parts: dict[int, list[Answer]] | None = None,
                 calls: dict[str, list[BaseException]] | None = None) -> None:
        self.parts = parts or {}
        self.whole = calls or {}
        self.sent: list[tuple[str, kv_pb2.WriteBatchRequest]] = []
        self.slept: list[float] = []
        client._invoke = self._invoke  # type: ignore[method-assign]
        client._invoke_many = self._invoke_many  # type: ignore[method-assign]
        client._sleep = self.slept.append

    def _invoke(self, target: str, method: str, request: Message, timeout: float) -> Message:
        assert method == "ShardMap", method
        shards = [cluster_pb2.ShardInfo(shard=s, leader=LEADERS[s]) for s in range(SHARDS)]
        return cluster_pb2.ShardMapResponse(shard_count=SHARDS, served_by=target, shards=shards)

    def _invoke_many(self, calls: Sequence[tuple[str, Message]], method: str,
                     timeout: float) -> list[Message | grpc.RpcError]:
        assert method == "WriteBatch"
        out: list[Message | grpc.RpcError] = []
        for target, request in calls:
            assert isinstance(request, kv_pb2.WriteBatchRequest)
            self.sent.append((target, request))
            failures = self.whole.get(target)
            if failures:
                error = failures.pop(0)
                assert isinstance(error, grpc.RpcError)
                out.append(error)
                continue
            results = []
            for part in request.shards:
                script = self.parts.get(part.shard)
                results.append((script.pop(0) if script else ok())(part))
            out.append(kv_pb2.WriteBatchResponse(results=results))
        return out

    def sent_shards(self) -> list[tuple[str, list[int]]]:
        return [(target, [p.shard for p in request.shards]) for target, request in self.sent]

    def part_ids(self, shard: int) -> list[str]:
        return [p.request_id for _, request in self.sent for p in request.shards if p.shard == shard]


def keys(shard: int, n: int = 1) -> list[bytes]:
    return [key_on(shard, SHARDS, prefix=f"s{shard}-{i}-") for i in range(n)]


def every_shard_ops() -> list[Op]:
    return [Op.put(k, b"v") for s in range(SHARDS) for k in keys(s, 2)] + [Op.delete(keys(2)[0])]


def test_a_batch_is_split_by_shard_and_sent_once_per_leader() -> None:
    client = Client(["n1:1"])
    nodes = Nodes(client)
    result = client.write_batch(every_shard_ops(), request_id="b1")
    assert isinstance(result, BatchResult) and result.request_id == "b1"
    assert sorted(nodes.sent_shards()) == [("n1:1", [0, 2]), ("n2:1", [1]), ("n3:1", [3])]
    assert [(p.shard, p.mutations, p.request_id) for p in result.shards] == [
        (0, 2, "b1/0"), (1, 2, "b1/1"), (2, 3, "b1/2"), (3, 2, "b1/3")]
    assert result.mutations == 9 and result.revisions == {0: 10, 1: 10, 2: 10, 3: 10}
    part2 = next(p for _, r in nodes.sent for p in r.shards if p.shard == 2)
    assert [(m.key, m.delete) for m in part2.mutations] == [(k, False) for k in keys(2, 2)] + [(keys(2)[0], True)]
    assert part2.first_attempt_unix_ms > 0 and nodes.slept == []


def test_put_many_takes_a_mapping_or_pairs() -> None:
    client = Client(["n1:1"])
    Nodes(client)
    assert client.put_many({keys(0)[0]: b"1", keys(1)[0]: "2"}).mutations == 2
    assert client.put_many([(keys(3)[0], b"1")]).revisions == {3: 10}


def test_a_part_redirected_by_its_hint_is_resent_alone_at_once() -> None:
    client = Client(["n1:1"])
    nodes = Nodes(client, parts={1: [NOT_LEADER]})
    result = client.write_batch(every_shard_ops(), request_id="b")
    assert len(result.shards) == 4
    assert nodes.sent_shards()[-1] == ("n3:1", [1]) and len(nodes.sent) == 4
    assert nodes.part_ids(1) == ["b/1", "b/1"] and nodes.slept == []


def test_an_unknown_part_is_retried_with_its_id_and_its_replay_counts_as_committed() -> None:
    client = Client(["n1:1"])
    nodes = Nodes(client, parts={3: [UNKNOWN, ok(7, replayed=True)]})
    result = client.write_batch(every_shard_ops(), request_id="b")
    assert nodes.part_ids(3) == ["b/3", "b/3"] and nodes.part_ids(0) == ["b/0"]
    assert {p.shard: (p.revision, p.replayed) for p in result.shards}[3] == (7, True)
    first_ms = {p.first_attempt_unix_ms for _, r in nodes.sent for p in r.shards}
    assert len(first_ms) == 1, "every part and every attempt carries the batch's first-attempt time"


def test_a_definite_refusal_fails_only_its_part() -> None:
    client = Client(["n1:1"])
    Nodes(client, parts={2: [REFUSED]})
    with pytest.raises(BatchIncomplete) as caught:
        client.write_batch(every_shard_ops(), request_id="b")
    error = caught.value
    assert sorted(error.committed) == [0, 1, 3] and list(error.errors) == [2]
    assert not error.unknown and not isinstance(error.errors[2], UnknownOutcome)
    assert error.errors[2].request_id == "b/2" and error.request_id == "b" and error.first_attempt_unix_ms
    assert "1 of 4 parts not committed (shards [2])" in str(error)


def test_a_node_that_drops_the_call_leaves_its_parts_unknown_never_definite() -> None:
    client = Client(["n1:1"], max_attempts=3)
    dropped = [FakeRpcError(SC.UNAVAILABLE, "Socket closed") for _ in range(3)]
    nodes = Nodes(client, calls={"n1:1": dropped})
    with pytest.raises(BatchIncomplete) as caught:
        client.write_batch(every_shard_ops(), request_id="b")
    error = caught.value
    assert error.unknown and sorted(error.errors) == [0, 2] and sorted(error.committed) == [1, 3]
    assert all(isinstance(e, UnknownOutcome) for e in error.errors.values())
    assert nodes.part_ids(0) == ["b/0"] * 3 and len(nodes.slept) == 2


def test_an_unknown_part_later_refused_definitely_stays_unknown() -> None:
    client = Client(["n1:1"])
    Nodes(client, parts={1: [UNKNOWN, REFUSED]})
    with pytest.raises(BatchIncomplete) as caught:
        client.write_batch(every_shard_ops())
    assert caught.value.unknown and isinstance(caught.value.errors[1], UnknownOutcome)


def test_not_leader_without_a_hint_waits_and_asks_the_map_again() -> None:
    client = Client(["n1:1"])
    no_hint = fails(SC.FAILED_PRECONDITION, "no leader", **{OUTCOME_KEY: OUTCOME_NONE, SHARD_KEY: "0"})
    nodes = Nodes(client, parts={0: [no_hint]})
    client.write_batch([Op.put(keys(0)[0], b"v")])
    assert len(nodes.sent) == 2 and len(nodes.slept) == 1


@pytest.mark.parametrize(("ops", "request_id", "match"), [
    ([], None, "at least one put or delete"),
    ([Op.get("k")], None, "Op.put and Op.delete only"),
    ([Op.put("k", "v")], "x" * limits.MAX_REQUEST_ID_BYTES, "MAX_REQUEST_ID_BYTES"),
    ([Op.put(f"k{i}", "") for i in range(limits.MAX_BATCH_MUTATIONS * SHARDS + 50)], None, "MAX_BATCH_MUTATIONS"),
])
def test_what_cannot_succeed_is_refused_before_sending(ops: list[Op], request_id: str | None, match: str) -> None:
    client = Client(["n1:1"])
    nodes = Nodes(client)
    with pytest.raises(InvalidArgument, match=match):
        client.write_batch(ops, request_id=request_id)
    assert nodes.sent == []


# ============================================================================================
# BatchingWriter, over a fake client


class FakeClient:
    """`shard_map` and `write_batch`, recording each batch; `gate` holds calls until set."""

    def __init__(self, outcome: Callable[[list[Op]], BatchResult] | None = None) -> None:
        self.batches: list[list[Op]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.outcome = outcome

    def shard_map(self) -> Any:
        return type("Map", (), {"shard_count": SHARDS})()

    def write_batch(self, ops: list[Op], *, timeout_s: float) -> BatchResult:
        with self.lock:
            self.batches.append(list(ops))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            assert self.gate.wait(10)
            if self.outcome is not None:
                return self.outcome(ops)
            shards = sorted({shard_of(op.key, SHARDS) for op in ops})
            return BatchResult(tuple(ShardWrite(s, 100 + len(self.batches), sum(
                1 for op in ops if shard_of(op.key, SHARDS) == s), False, f"x/{s}") for s in shards), "x")
        finally:
            with self.lock:
                self.in_flight -= 1


def writer(fake: FakeClient, **kwargs: Any) -> BatchingWriter:
    return BatchingWriter(fake, **kwargs)  # type: ignore[arg-type]


def test_a_lone_write_is_sent_after_the_linger() -> None:
    fake = FakeClient()
    with writer(fake, linger_ms=50) as w:
        started = time.monotonic()
        result = w.put(keys(1)[0], b"v").result(timeout=5)
        waited = time.monotonic() - started
    assert result.shard == 1 and len(fake.batches) == 1
    assert 0.04 <= waited < 2.0


def test_a_full_batch_is_sent_without_waiting_for_the_linger() -> None:
    fake = FakeClient()
    with writer(fake, linger_ms=60_000, max_batch_mutations=10, max_buffered_mutations=100) as w:
        futures = [w.put(k, b"v") for k in keys(2, 10)]
        done, _ = concurrent.futures.wait(futures, timeout=5)
        assert len(done) == 10 and [len(b) for b in fake.batches] == [10]


def test_one_batch_per_shard_in_flight_keeps_the_order_and_the_next_one_fills_up() -> None:
    fake = FakeClient()
    fake.gate.clear()
    with writer(fake, linger_ms=1, max_in_flight=4) as w:
        first = w.put(keys(0)[0], b"1")
        deadline = time.monotonic() + 5
        while not fake.batches and time.monotonic() < deadline:
            time.sleep(0.005)
        later = [w.put(keys(0)[0], str(i).encode()) for i in range(2, 6)]
        holds_for(lambda: len(fake.batches) == 1, 0.05, interval_s=0.005,
                  what="one call while the shard's batch is in flight (several lingers)")
        fake.gate.set()
        assert [f.result(timeout=5).shard for f in [first, *later]] == [0] * 5
    assert [[op.value for op in b] for b in fake.batches] == [[b"1"], [b"2", b"3", b"4", b"5"]]
    assert fake.max_in_flight == 1


def test_shards_go_in_parallel_up_to_max_in_flight() -> None:
    fake = FakeClient()
    fake.gate.clear()

    def calls_become(n: int) -> None:
        deadline = time.monotonic() + 5
        while len(fake.batches) < n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(fake.batches) == n

    with writer(fake, linger_ms=1, max_in_flight=2) as w:
        futures = [w.put(keys(0)[0], b"v")]
        calls_become(1)
        futures.append(w.put(keys(1)[0], b"v"))  # another shard: a second call while the first waits
        calls_become(2)
        futures += [w.put(keys(2)[0], b"v"), w.put(keys(3)[0], b"v")]
        holds_for(lambda: len(fake.batches) == 2, 0.05, interval_s=0.005,
                  what="no third call while two are in flight (many lingers)")
        fake.gate.set()
        concurrent.futures.wait(futures, timeout=5)
    assert fake.max_in_flight == 2 and [f.result().shard for f in futures] == [0, 1, 2, 3]
    assert len(fake.batches) == 3, "the shards that waited go together in one call"


def test_a_full_buffer_makes_writers_wait_then_refuses_with_overloaded() -> None:
    fake = FakeClient()
    fake.gate.clear()
    w = writer(fake, linger_ms=1, max_batch_mutations=2, max_buffered_mutations=2, put_timeout_s=0.2)
    try:
        w.put(keys(0)[0], b"1")
        w.put(keys(0)[0], b"2")
        with pytest.raises(Overloaded, match="max_buffered_mutations"):
            w.put(keys(1)[0], b"3")
    finally:
        fake.gate.set()
        w.close()


def test_part_errors_reach_only_their_writes() -> None:
    unknown = UnknownOutcome("commit outcome unknown", request_id="x/1")

    def outcome(ops: list[Op]) -> BatchResult:
        raise BatchIncomplete("1 of 2 parts not committed", committed={0: ShardWrite(0, 5, 1, False, "x/0")},
                              errors={1: unknown}, request_id="x", first_attempt_unix_ms=1)

    fake = FakeClient(outcome)
    with writer(fake, linger_ms=20) as w:
        good, bad = w.put(keys(0)[0], b"v"), w.put(keys(1)[0], b"v")
        assert good.result(timeout=5).revision == 5
        assert bad.exception(timeout=5) is unknown


def test_an_unexpected_failure_is_an_unknown_outcome_for_every_write_of_the_call() -> None:
    def outcome(ops: list[Op]) -> BatchResult:
        raise RuntimeError("bug")

    with writer(FakeClient(outcome), linger_ms=1) as w:
        error = w.put(keys(0)[0], b"v").exception(timeout=5)
    assert isinstance(error, UnknownOutcome) and "bug" in str(error)


def test_flush_sends_without_lingering_and_close_answers_everything() -> None:
    fake = FakeClient()
    w = writer(fake, linger_ms=60_000)
    futures = [w.put(keys(s)[0], b"v") for s in range(SHARDS)]
    w.flush(timeout_s=5)
    assert all(f.done() for f in futures) and len(fake.batches) == 1
    late = w.put(keys(0)[0], b"late")
    w.close()
    assert late.result(timeout=0).shard == 0
    with pytest.raises(InvalidArgument, match="closed"):
        w.put(keys(0)[0], b"v")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_batch_mutations": 0}, "max_batch_mutations"),
    ({"max_batch_mutations": limits.MAX_BATCH_MUTATIONS + 1}, "MAX_BATCH_MUTATIONS"),
    ({"max_batch_bytes": limits.MAX_REQUEST_BYTES}, "max_batch_bytes"),
    ({"linger_ms": -1}, "linger_ms"),
    ({"max_buffered_mutations": 10, "max_batch_mutations": 20}, "max_buffered_mutations"),
])
def test_writer_settings_are_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        writer(FakeClient(), **kwargs)


def test_a_write_that_cannot_fit_is_refused_at_once() -> None:
    with writer(FakeClient(), max_batch_bytes=100) as w:
        with pytest.raises(InvalidArgument, match="max_batch_bytes"):
            w.put(keys(0)[0], b"x" * 200)
        with pytest.raises(InvalidArgument, match="keys are"):
            w.put(b"", b"v")


def test_errors_are_kv_errors() -> None:
    assert issubclass(BatchIncomplete, KvError) and not issubclass(NotLeader, BatchIncomplete)


def test_a_cancelled_future_does_not_keep_the_others_of_its_call_from_their_outcome() -> None:
    fake = FakeClient()
    fake.gate.clear()
    with writer(fake, linger_ms=1) as w:
        cancelled, other = w.put(keys(0)[0], b"1"), w.put(keys(0)[0], b"2")
        assert cancelled.cancel()  # the caller stops waiting; the write still goes
        fake.gate.set()
        assert other.result(timeout=5).shard == 0
        w.flush(timeout_s=5)
    assert [len(b) for b in fake.batches] == [2]


def test_a_call_the_runtime_loses_is_unknown_and_one_never_started_is_not() -> None:
    """The real `_invoke_many` over fake channels: a call whose `.future()` raises never started
    (the channel closed under the round: definite), one whose result raises something other than
    a status may have reached its node (unknown); the round's other calls keep what they committed."""
    client = Client(["n1:1"], max_attempts=1)
    nodes = Nodes(client)
    del client._invoke_many  # type: ignore[attr-defined]

    class Future:
        def __init__(self, request: kv_pb2.WriteBatchRequest, fail: BaseException | None) -> None:
            self.request, self.fail = request, fail

        def result(self) -> Message:
            if self.fail is not None:
                raise self.fail
            return kv_pb2.WriteBatchResponse(results=[ok()(p) for p in self.request.shards])

    class Stub:
        def __init__(self, target: str) -> None:
            self.target = target

        @property
        def WriteBatch(self) -> Any:
            stub = self

            class Method:
                @staticmethod
                def future(request: kv_pb2.WriteBatchRequest, timeout: float, metadata: Any) -> Future:
                    if stub.target == "n2:1":
                        raise ValueError("Cannot invoke RPC on closed channel!")
                    return Future(request, RuntimeError("lost") if stub.target == "n3:1" else None)
            return Method

    client._conn = lambda target: type("Conn", (), {"kv": Stub(target)})()  # type: ignore[method-assign]
    with pytest.raises(BatchIncomplete) as caught:
        client.write_batch(every_shard_ops(), request_id="b")
    error = caught.value
    assert sorted(error.committed) == [0, 2], "n1's parts committed in the same round"
    assert not isinstance(error.errors[1], UnknownOutcome) and "nothing was sent" in error.errors[1].message
    assert isinstance(error.errors[3], UnknownOutcome) and error.errors[3].request_id == "b/3"
    assert nodes.sent == []
