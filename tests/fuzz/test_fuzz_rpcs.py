"""Fuzzing every RPC of a real node (issue 13): random messages (hypothesis, from the descriptors)
and bytes that are not protobuf, sent as a plain gRPC client would.

For every case: the answer is a valid response or a clean gRPC error (never UNKNOWN, INTERNAL or
UNIMPLEMENTED, which a client must read as an unknown outcome for a write, W7), every error the
store produces carries its ErrorInfo, the node is still alive, and a request that was refused
(or only read) left every shard's state digest as it was. The one answer allowed without
ErrorInfo is gRPC's own RESOURCE_EXHAUSTED for a request larger than the node's receive cap, and a
request between MAX_REQUEST_BYTES and that cap must get the store's LIMIT_EXCEEDED
(tests/fuzz/contract.py). `make test` runs a sample (FUZZ_CASES per method and mode, default 15)
with a fixed seed; `make fuzz` runs >= 10^4 cases with a random one; both print the seed and the
tally (tests/fuzz/seeding.py, tests/fuzz/conftest.py).

Not fuzzed with valid arguments: ClusterService.FenceShard of an existing shard (an operator's
fence is an accepted admin action that churns leadership; tests/integration cover it). Its
malformed and out-of-range requests are fuzzed like every other call.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import strategies as st

from kvstore import limits
from kvstore.internal.v1 import peer_pb2
from kvstore.v1 import cluster_pb2, kv_pb2
from tests.conftest import unique
from tests.fuzz import contract, seeding, tally
from tests.fuzz.strategies import Sent, messages, not_protobuf, sized
from tests.integration.store_process import StoreProcess
from wal.broker import LocalKafka

pytestmark = pytest.mark.kafka

SHARDS = 4
TIMEOUT_S = 10.0
# How long a watch is read before the case counts it as open. A request above MAX_REQUEST_BYTES
# cannot open one and gets TIMEOUT_S instead: sending a megabyte or two on a busy machine may take
# longer than this, and the refusal must be seen, not read as an open watch.
WATCH_TIMEOUT_S = 0.3
WRITES = {"Put", "Delete", "Txn", "WriteBatch", "FenceShard"}  # an accepted one may change the state
METHODS: list[MethodDescriptor] = [
    *kv_pb2.DESCRIPTOR.services_by_name["KVService"].methods,
    *cluster_pb2.DESCRIPTOR.services_by_name["ClusterService"].methods,
    *peer_pb2.DESCRIPTOR.services_by_name["PeerService"].methods,
]


@pytest.fixture(scope="module")
def node(kafka: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    store = StoreProcess(kafka.bootstrap_servers, Path(tmp_path_factory.mktemp("fuzz")) / "node",
                         unique("fz").replace("-", ""), shards=SHARDS)
    store.start()
    try:
        yield store
    finally:
        store.stop()


def _digests(node: StoreProcess) -> list[tuple[bytes, int]]:
    return [(d.sha256, d.applied_offset) for d in
            (node.cluster_stub.ShardDigest(cluster_pb2.ShardDigestRequest(shard=s), timeout=TIMEOUT_S)
             for s in range(SHARDS))]


def _call(node: StoreProcess, method: MethodDescriptor, raw: bytes) -> tuple[grpc.StatusCode, grpc.RpcError | None]:
    assert node.channel is not None
    path = f"/{method.containing_service.full_name}/{method.name}"
    response_type = GetMessageClass(method.output_type)
    try:
        if method.server_streaming:
            stream = node.channel.unary_stream(path, response_deserializer=response_type.FromString)(
                raw, timeout=WATCH_TIMEOUT_S if len(raw) <= limits.MAX_REQUEST_BYTES else TIMEOUT_S)
            try:
                for i, item in enumerate(stream):
                    assert isinstance(item, response_type)
                    if i >= 1:
                        break
            finally:
                stream.cancel()
        else:
            reply = node.channel.unary_unary(path, response_deserializer=response_type.FromString)(
                raw, timeout=TIMEOUT_S)
            assert isinstance(reply, response_type)
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        if method.server_streaming and code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return grpc.StatusCode.OK, None  # the watch was open: it ran until we stopped reading
        return code, exc
    return grpc.StatusCode.OK, None


def _info(error: grpc.RpcError | None) -> contract.Info | None:
    """The ErrorInfo in an error's `grpc-status-details-bin` trailer; None if it has none."""
    status = rpc_status.from_call(error) if error is not None else None  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR) and detail.Unpack(info):
            return contract.Info(info.domain, info.reason, dict(info.metadata))
    return None


def _test_id(method: MethodDescriptor, mode: str) -> str:
    return f"{mode} {method.containing_service.name}.{method.name}"


def _check(node: StoreProcess, method: MethodDescriptor, raw: bytes, before: list[tuple[bytes, int]],
           mode: str) -> list[tuple[bytes, int]]:
    """One case: send, judge the answer, check the node and the state. Returns the new baseline."""
    tally.sent(_test_id(method, mode), raw, contract.zone_of(len(raw)).value)
    code, error = _call(node, method, raw)
    tally.record(f"{method.containing_service.name}.{method.name}", mode, code.name)
    assert node.proc is not None and node.proc.poll() is None, \
        f"the node died on {method.name} ({len(raw)} bytes) {raw[:64]!r}"
    tally.crashes_checked()
    wrong = contract.problem(len(raw), code, _info(error))
    assert wrong is None, f"{method.name}: {wrong} ({error.details() if error else ''}) for {raw[:96]!r}"
    after = _digests(node)
    if code != grpc.StatusCode.OK or method.name not in WRITES:
        # Refused, or only read: no shard's state digest may differ. (Checkpoints may move: a
        # leader's read-barrier probe or its takeover appends an empty entry, which is no change.)
        assert [d for d, _ in after] == [d for d, _ in before], \
            f"{method.name} ({code.name}) changed the state: {before} -> {after} for {raw[:96]!r}"
        tally.state_checked()
    return after


def structured(method: MethodDescriptor) -> st.SearchStrategy[Sent]:
    """What test_random_messages sends to `method` (tests/fuzz/test_seeding.py replays it)."""
    def defuse(message: Message) -> bytes:
        if method.name == "FenceShard" and isinstance(message, cluster_pb2.FenceShardRequest):
            message.shard = max(message.shard, SHARDS)  # see the module docstring
        return message.SerializeToString()

    return sized(messages(method.input_type).map(defuse))


def garbage(method: MethodDescriptor) -> st.SearchStrategy[Sent]:
    """What test_bytes_that_are_not_protobuf sends to `method`."""
    return sized(not_protobuf(method.input_type))


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.containing_service.name}.{m.name}")
def test_random_messages(node: StoreProcess, method: MethodDescriptor) -> None:
    baseline = [_digests(node)]

    def case(sent: Sent) -> None:
        baseline[0] = _check(node, method, sent.raw, baseline[0], "message")

    seeding.run_cases(_test_id(method, "message"), structured(method), case)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.containing_service.name}.{m.name}")
def test_bytes_that_are_not_protobuf(node: StoreProcess, method: MethodDescriptor) -> None:
    baseline = [_digests(node)]

    def case(sent: Sent) -> None:
        baseline[0] = _check(node, method, sent.raw, baseline[0], "bytes")

    seeding.run_cases(_test_id(method, "bytes"), garbage(method), case)
