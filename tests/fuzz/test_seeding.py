"""The fuzz sample's machinery without a node: the seed rules, replay of the very same requests,
the size contract's verdicts, and padding that reaches both refusing zones (issue 18 item 9)."""

from __future__ import annotations

import collections

import grpc
import pytest
from hypothesis import strategies as st

from kvstore import limits
from kvstore.v1 import kv_pb2
from tests.fuzz import contract, seeding
from tests.fuzz.strategies import EDGE_SIZES, Sent, padded, sized
from tests.fuzz.test_fuzz_rpcs import METHODS, garbage, structured

BY_NAME = {m.name: m for m in METHODS}
MAX = limits.MAX_REQUEST_BYTES
CAP = limits.GRPC_MAX_MESSAGE_BYTES
Code = grpc.StatusCode
LIMIT = contract.Info("kvstore", "LIMIT_EXCEEDED", {"limit": "MAX_REQUEST_BYTES", "outcome": "none"})
OTHER = contract.Info("kvstore", "INVALID_ARGUMENT", {"outcome": "none"})


@pytest.mark.parametrize(("value", "seed"), [
    (None, seeding.DEFAULT_SEED), ("", seeding.DEFAULT_SEED), ("  ", seeding.DEFAULT_SEED),
    ("random", 424242), ("RANDOM", 424242), ("0", 0), ("17", 17), (" 17\n", 17), ("9" * 19, int("9" * 19)),
])
def test_seed_from_the_environment(value: str | None, seed: int) -> None:
    assert seeding.resolve_seed(value, lambda: 424242) == seed


@pytest.mark.parametrize("value", ["-1", "1e3", "0x10", "seed", "1 2", "١٢", "9" * 20])
def test_a_seed_that_is_not_one_is_refused_by_name(value: str) -> None:
    with pytest.raises(ValueError, match="FUZZ_SEED"):
        seeding.resolve_seed(value, lambda: 1)


@pytest.mark.parametrize(("value", "cases"), [(None, 15), ("", 15), ("400", 400), ("1", 1)])
def test_cases_from_the_environment(value: str | None, cases: int) -> None:
    assert seeding.resolve_cases(value) == cases


@pytest.mark.parametrize("value", ["0", "-3", "ten", "1.5"])
def test_cases_that_are_not_a_count_are_refused_by_name(value: str) -> None:
    with pytest.raises(ValueError, match="FUZZ_CASES"):
        seeding.resolve_cases(value)


def test_each_test_seed_depends_on_the_session_seed_and_the_test_only() -> None:
    assert seeding.case_seed(5, "message KVService.Put") == seeding.case_seed(5, "message KVService.Put")
    assert seeding.case_seed(5, "message KVService.Put") != seeding.case_seed(6, "message KVService.Put")
    assert seeding.case_seed(5, "message KVService.Put") != seeding.case_seed(5, "bytes KVService.Put")


def test_the_replay_line_names_the_seed_and_the_sample_size() -> None:
    line = seeding.replay_line(123, 15)
    assert line.startswith("fuzz seed 123;") and "FUZZ_SEED=123 FUZZ_CASES=15" in line and "tests/fuzz" in line


def _sent(test_id: str, strategy: st.SearchStrategy[Sent], session_seed: int, cases: int) -> list[bytes]:
    out: list[bytes] = []
    seeding.run_cases(test_id, strategy, lambda sent: out.append(sent.raw), session_seed=session_seed, cases=cases)
    return out


@pytest.mark.parametrize(("method", "mode"), [("WriteBatch", "message"), ("Txn", "message"), ("Put", "bytes"),
                                              ("Watch", "bytes")])
def test_one_seed_replays_the_same_requests(method: str, mode: str) -> None:
    """What the fuzz tests send, generated as they generate it: the same seed gives the same
    requests in the same order, another seed others. (The same is shown end to end by the input
    digests of two sample runs, tests/fuzz/tally.py; docs/development.md, "Fuzzing, and replaying a red run".)"""
    strategy = structured(BY_NAME[method]) if mode == "message" else garbage(BY_NAME[method])
    test_id = f"{mode} {method}"
    first = _sent(test_id, strategy, session_seed=99, cases=seeding.DEFAULT_CASES)
    assert len(first) == seeding.DEFAULT_CASES
    assert _sent(test_id, strategy, session_seed=99, cases=seeding.DEFAULT_CASES) == first
    assert _sent(test_id, strategy, session_seed=100, cases=seeding.DEFAULT_CASES) != first


def test_padding_reaches_both_refusing_zones_on_every_rpc() -> None:
    """With the sample's seed and size, over all RPCs and modes, requests land above
    MAX_REQUEST_BYTES and above the transport cap (the zones the contract distinguishes)."""
    zones: collections.Counter[contract.Zone] = collections.Counter()
    for method in METHODS:
        for mode, strategy in (("message", structured(method)), ("bytes", garbage(method))):
            for raw in _sent(f"{mode} {method.containing_service.name}.{method.name}", strategy,
                             session_seed=seeding.DEFAULT_SEED, cases=seeding.DEFAULT_CASES):
                zones[contract.zone_of(len(raw))] += 1
    assert zones[contract.Zone.STORE_REFUSES] >= 5 and zones[contract.Zone.TRANSPORT_REFUSES] >= 5, zones


@pytest.mark.parametrize("size", [*EDGE_SIZES, 2**21 - 1, 2**21, 2**21 + 5, 2**14 + 6, 200])
def test_padding_gives_the_exact_size_and_the_same_request(size: int) -> None:
    request = kv_pb2.PutRequest(key=b"k", value=b"v", request_id="r")
    raw = padded(request.SerializeToString(), size)
    assert len(raw) == size
    decoded = kv_pb2.PutRequest.FromString(raw)
    assert (decoded.key, decoded.value, decoded.request_id) == (b"k", b"v", "r")


def test_padding_never_shrinks() -> None:
    assert padded(b"x" * 50, 10) == b"x" * 50


def test_a_sent_request_prints_short() -> None:
    text = repr(Sent(b"v" * CAP))
    assert f"{CAP} bytes" in text and len(text) < 200


def test_sized_leaves_most_requests_alone() -> None:
    raws = _sent("sized", sized(st.binary(min_size=1, max_size=8)), session_seed=1, cases=200)
    assert len(raws) == 200
    assert 0 < sum(len(r) > 8 for r in raws) < len(raws) / 4, [len(r) for r in raws]


@pytest.mark.parametrize(("size", "code", "info", "ok"), [
    # Within MAX_REQUEST_BYTES: the store decides; every error has its ErrorInfo.
    (10, Code.OK, None, True),
    (MAX, Code.INVALID_ARGUMENT, OTHER, True),
    (MAX, Code.FAILED_PRECONDITION, contract.Info("kvstore", "NOT_LEADER"), True),
    (10, Code.INVALID_ARGUMENT, None, False),
    (10, Code.RESOURCE_EXHAUSTED, None, False),  # a full queue carries ErrorInfo too
    (10, Code.INVALID_ARGUMENT, contract.Info("other", "X"), False),
    (10, Code.INTERNAL, contract.Info("kvstore", "INTERNAL"), False),
    (10, Code.UNKNOWN, None, False),
    # Above MAX_REQUEST_BYTES, up to the cap: the store's LIMIT_EXCEEDED naming MAX_REQUEST_BYTES.
    (MAX + 1, Code.INVALID_ARGUMENT, LIMIT, True),
    (CAP, Code.INVALID_ARGUMENT, LIMIT, True),
    (MAX + 1, Code.OK, None, False),
    (MAX + 1, Code.INVALID_ARGUMENT, OTHER, False),
    (MAX + 1, Code.INVALID_ARGUMENT, contract.Info("kvstore", "LIMIT_EXCEEDED", {"limit": "MAX_VALUE_BYTES"}),
     False),
    (CAP, Code.RESOURCE_EXHAUSTED, None, False),  # the transport must not answer at the cap itself
    # Above the cap: gRPC's RESOURCE_EXHAUSTED without ErrorInfo, and nothing else.
    (CAP + 1, Code.RESOURCE_EXHAUSTED, None, True),
    (2_700_036, Code.RESOURCE_EXHAUSTED, None, True),
    (CAP + 1, Code.RESOURCE_EXHAUSTED, LIMIT, False),
    (CAP + 1, Code.INVALID_ARGUMENT, LIMIT, False),
    (CAP + 1, Code.OK, None, False),
    (CAP + 1, Code.UNAVAILABLE, None, False),
])
def test_the_size_contract(size: int, code: grpc.StatusCode, info: contract.Info | None, ok: bool) -> None:
    verdict = contract.problem(size, code, info)
    assert (verdict is None) == ok, verdict
