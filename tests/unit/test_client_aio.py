"""`kvstore.client.aio.AsyncClient` against scripted attempts: the synchronous client's policy,
awaited (routing, redirects, unknown outcomes, unreachable, a cross-shard Txn's fresh id), and
the DEBUG log of every retry and redirect. Real nodes: tests/integration/test_client_aio.py."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from kvstore.client import Compare, InvalidArgument, Op, TxnAborted, UnknownOutcome, Unreachable
from kvstore.client.aio import AsyncClient
from kvstore.errors import DOMAIN, OUTCOME_NONE, STATUS_DETAILS_KEY, Reason
from kvstore.v1 import cluster_pb2, kv_pb2
from tests.unit.test_client import DEFINITE, HINT, REFUSED, Attempt, FakeRpcError, _free_address, put_ok

SC = grpc.StatusCode


class AsyncScripted:
    """Replaces `AsyncClient._invoke` (and its sleeps): ShardMap from a fixed map, every other
    method from a script of outcomes, as tests/unit/test_client.py's `Scripted`."""

    def __init__(self, client: AsyncClient, shard_count: int, leaders: dict[int, str], script: list[Any]) -> None:
        self.shard_count, self.leaders, self.script = shard_count, leaders, list(script)
        self.attempts: list[Attempt] = []
        self.slept: list[float] = []
        client._invoke = self  # type: ignore[method-assign]

        async def sleep(attempt: int, deadline: float, error: object = None) -> None:
            self.slept.append(attempt)
        client._sleep_backoff = sleep  # type: ignore[method-assign]

    async def __call__(self, target: str, method: str, request: Message, timeout: float) -> Message:
        sent = type(request)()
        sent.CopyFrom(request)  # as sent: a Txn tried again under a fresh id reuses its request object
        self.attempts.append(Attempt(target, method, sent, timeout))
        if method == "ShardMap":
            shards = [cluster_pb2.ShardInfo(shard=s, leader=self.leaders.get(s, "")) for s in range(self.shard_count)]
            return cluster_pb2.ShardMapResponse(shard_count=self.shard_count, served_by=target, shards=shards)
        outcome = self.script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        assert isinstance(outcome, Message)
        return outcome

    def calls(self, method: str) -> list[Attempt]:
        return [a for a in self.attempts if a.method == method]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_put_and_get_go_to_the_leader_with_the_same_results_as_the_synchronous_client() -> None:
    async def scenario() -> None:
        async with AsyncClient(["n1:1", "n2:2"]) as client:
            s = AsyncScripted(client, 1, {0: "n2:2"}, [put_ok(revision=7),
                                                        kv_pb2.GetResponse(found=True, kv=kv_pb2.KeyValue(
                                                            key=b"k", value=b"v", mod_revision=7, version=1))])
            put = await client.put("k", "v")
            got = await client.get("k")
            assert put.revision == 7 and put.request_id and not put.replayed
            assert got.found and got.value == b"v" and got.kv is not None and got.kv.mod_revision == 7
            assert [a.target for a in s.attempts if a.method != "ShardMap"] == ["n2:2", "n2:2"]
    run(scenario())


def test_a_not_leader_hint_redirects_at_once_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with AsyncClient(["n1:1"]) as client:
            s = AsyncScripted(client, 1, {}, [FakeRpcError(SC.FAILED_PRECONDITION, "not leader",
                                                           tuple(HINT.items()) + DEFINITE), put_ok()])
            with caplog.at_level(logging.DEBUG, logger="kvstore.client"):
                await client.put("k", "v")
            assert [a.target for a in s.calls("Put")] == ["n1:1", HINT["kvstore-leader-hint"]] and not s.slept
    run(scenario())
    assert any("redirected to the leader" in r.getMessage() for r in caplog.records)
    assert any("Put attempt 1 at n1:1 failed" in r.getMessage() for r in caplog.records)


def test_an_unknown_attempt_keeps_the_call_unknown_with_the_id_to_retry_with() -> None:
    async def scenario() -> None:
        async with AsyncClient(["n1:1", "n2:2"], max_attempts=3) as client:
            s = AsyncScripted(client, 1, {}, [FakeRpcError(SC.UNAVAILABLE, "Socket closed"), REFUSED,
                                              FakeRpcError(SC.UNAVAILABLE, "busy", DEFINITE)])
            with pytest.raises(UnknownOutcome) as info:
                await client.put("k", "v")
            (rid,) = {a.request.request_id for a in s.calls("Put")}  # type: ignore[attr-defined]
            assert info.value.request_id == rid and info.value.first_attempt_unix_ms and info.value.attempts == 3
    run(scenario())


def test_a_call_that_reached_no_server_is_unreachable_over_real_channels() -> None:
    async def scenario() -> None:
        async with AsyncClient([_free_address(), _free_address()], max_attempts=3, backoff_s=0.01) as client:
            with pytest.raises(Unreachable) as info:
                await client.put("k", "v", timeout_s=3)
            assert info.value.request_id and info.value.attempts == 3
            with pytest.raises(Unreachable):
                await client.get("k", timeout_s=3)
    run(scenario())


def test_an_aborted_cross_shard_txn_is_tried_again_under_a_fresh_id_only_when_the_client_chose_it() -> None:
    ok = kv_pb2.TxnResponse(succeeded=True, result=kv_pb2.WriteResult(shard=0, revision=3))

    async def scenario() -> None:
        async with AsyncClient(["n1:1"]) as client:
            s = AsyncScripted(client, 2, {0: "n1:1", 1: "n1:1"}, [txn_aborted(), ok])
            result = await client.txn([Compare.version("a", "==", 0)], [Op.put("a", "1"), Op.put("b", "2")])
            ids = [a.request.request_id for a in s.calls("Txn")]  # type: ignore[attr-defined]
            assert result.succeeded and len(set(ids)) == 2 and result.request_id == ids[-1]
            s.script = [txn_aborted()]
            with pytest.raises(TxnAborted):
                await client.txn([], [Op.put("a", "1")], request_id="mine")
    run(scenario())


def txn_aborted() -> FakeRpcError:
    from google.rpc import error_details_pb2, status_pb2

    info = error_details_pb2.ErrorInfo(reason=Reason.TXN_ABORTED.value, domain=DOMAIN,
                                       metadata={"outcome": OUTCOME_NONE})
    status = status_pb2.Status(code=SC.ABORTED.value[0], message="aborted")
    status.details.add().Pack(info)
    return FakeRpcError(SC.ABORTED, "aborted", ((STATUS_DETAILS_KEY, status.SerializeToString()),))


def test_the_same_argument_checks_as_the_synchronous_client() -> None:
    with pytest.raises(InvalidArgument):
        AsyncClient([])
    with pytest.raises(InvalidArgument):
        AsyncClient(["n1:1"], attempt_timeout_s=0)

    async def scenario() -> None:
        async with AsyncClient(["n1:1"]) as client:
            with pytest.raises(InvalidArgument):
                await client.watch()  # neither key nor prefix
            with pytest.raises(InvalidArgument):
                await client.put("k", "v", timeout_s=0)
    run(scenario())


def test_an_evicted_channel_keeps_its_calls_for_a_grace_and_closes_at_once_on_close() -> None:
    """A grpc.aio channel evicted for another is closed with a grace (calls in flight on it are not
    cancelled); `close()` does not wait for that grace."""
    import time

    from kvstore.client.aio import AioChannels

    async def scenario() -> None:
        channels = AioChannels(1, None, evicted_grace_s=30)
        first = channels.get(_free_address())
        call = first.kv.Get(kv_pb2.GetRequest(key=b"k"), timeout=0.5, wait_for_ready=True)
        channels.get(_free_address())  # evicts the first while its call waits for a connection
        await asyncio.sleep(0.1)
        assert not call.done(), "the evicted channel's call was cancelled at once"
        started = time.monotonic()
        await channels.close()
        assert time.monotonic() - started < 5, "close waited for the evicted channel's grace"
        assert call.done()
    run(scenario())
