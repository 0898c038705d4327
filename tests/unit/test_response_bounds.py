"""Every response that gathers values stays within MAX_RESPONSE_BYTES, below gRPC's send cap
(kvstore.limits): where a scan page stops and whether it says "more" (`kvstore.core.reads`), the
merge of this node's shards with the pages other nodes served (never a key skipped or repeated
across pages, always progress), and the refusal of a Txn whose answer would not fit
(`kvstore.core.evaluate`, `kvstore.core.batch`: definite, nothing queued). Pure: table cases, and
a property over random shard contents paged to the end as the server and the client do it."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import errors, limits
from kvstore.core.batch import BatchLimits, Write, plan_batch
from kvstore.core.evaluate import evaluate_put, evaluate_txn
from kvstore.core.reads import Page, field_bytes, kv_bytes, merge_pages, page_budget_bytes, take_page
from kvstore.core.state import KeyState, RequestRecord
from kvstore.v1 import kv_pb2 as kv

SHARD, REV = 1, 100
NOW_MS = 1_800_000_000_000
WIDE = BatchLimits(max_records=1000, max_bytes=16 << 20, max_record_bytes=1_000_000 - 1024)
BIG = limits.MAX_VALUE_BYTES


def row(key: str | bytes, size: int = 1) -> kv.KeyValue:
    return kv.KeyValue(key=key.encode() if isinstance(key, str) else key, value=b"v" * size, version=1,
                       mod_revision=7, create_revision=7)


def keys(page: Page) -> list[bytes]:
    return [r.key for r in page.kvs]


# ---- the limits tie together ---------------------------------------------------------------------

def test_the_budget_holds_one_key_value_and_stays_below_the_send_cap_with_one_more() -> None:
    largest = kv.KeyValue(key=b"k" * limits.MAX_KEY_BYTES, value=b"v" * limits.MAX_VALUE_BYTES,
                          version=2**63 - 1, mod_revision=2**63 - 1, create_revision=2**63 - 1)
    in_txn = kv.TxnOpResult(get=kv.GetResponse(found=True, kv=largest))
    assert field_bytes(in_txn.ByteSize()) <= limits.MAX_KEY_VALUE_BYTES
    assert kv_bytes(largest) <= limits.MAX_KEY_VALUE_BYTES <= limits.MAX_RESPONSE_BYTES
    assert limits.MAX_RESPONSE_BYTES + limits.MAX_KEY_VALUE_BYTES < limits.GRPC_MAX_MESSAGE_BYTES


# value lengths whose KeyValue is 127/128 and 16 383/16 384 bytes: the length varint grows there
@pytest.mark.parametrize("value_bytes", [0, 1, 125, 126, 16_380, 16_381, 2_097_148, BIG])
def test_kv_bytes_is_what_protobuf_encodes(value_bytes: int) -> None:
    kv_ = kv.KeyValue(value=b"v" * value_bytes)
    assert kv_bytes(kv_) == kv.ScanResponse(kvs=[kv_]).ByteSize()


def test_a_page_s_kvs_are_counted_exactly() -> None:
    page = [row("a", 10), row("b", 300), row("c" * 200, 70_000)]
    assert sum(kv_bytes(r) for r in page) == kv.ScanResponse(kvs=page).ByteSize()


# ---- one source: where a page stops ------------------------------------------------------------

SMALL = kv_bytes(row("k00", 10))  # every row(f"k{i:02d}", 10) has this size


@pytest.mark.parametrize(
    ("sizes", "limit", "budget", "taken", "more"),
    [
        pytest.param([], 10, 1000, 0, False, id="empty"),
        pytest.param([10, 10, 10], 10, 1000, 3, False, id="all-fit"),
        pytest.param([10, 10, 10], 3, 1000, 3, False, id="exactly-limit-nothing-after"),
        pytest.param([10, 10, 10, 10], 3, 1000, 3, True, id="limit-cuts"),
        pytest.param([10, 10, 10], 10, 3 * SMALL, 3, False, id="exactly-budget"),
        pytest.param([10, 10, 10], 10, 3 * SMALL - 1, 2, True, id="one-byte-short-cuts"),
        pytest.param([5_000, 10], 10, 100, 1, True, id="first-row-always-even-above-budget"),
        pytest.param([5_000], 10, 100, 1, False, id="first-row-alone-above-budget-is-the-end"),
        pytest.param([10, 5_000, 10], 10, 1000, 1, True, id="a-large-row-ends-the-page-before-it"),
        pytest.param([10, 10], 1, 0, 1, True, id="zero-budget-still-progresses"),
    ],
)
def test_take_page(sizes: list[int], limit: int, budget: int, taken: int, more: bool) -> None:
    rows = [row(f"k{i:02d}", size) for i, size in enumerate(sizes)]
    page = take_page(rows, limit, budget)
    assert keys(page) == [r.key for r in rows[:taken]]
    assert page.more is more
    assert page.next_page_token() == (rows[taken - 1].key + b"\x00" if more else b"")


def test_take_page_reads_at_most_one_row_past_the_page() -> None:
    read: list[bytes] = []

    def lazily() -> Iterator[kv.KeyValue]:
        for i in range(1_000_000):
            read.append(f"k{i:07d}".encode())
            yield row(read[-1], 100_000)

    page = take_page(lazily(), 1000, 350_000)
    assert len(page.kvs) == 3 and page.more
    assert len(read) == 4


def test_the_issue_case_three_large_values_limit_three() -> None:
    """Three 900 000-byte values, limit 3: 2 700 071 bytes before; now a page of one that says more."""
    rows = [row(f"big/{i}", BIG) for i in range(3)]
    budget = page_budget_bytes([kv.ReadHeader(shard=s, applied_revision=10**6, served_by="node-1") for s in range(4)])
    page = take_page(rows, 3, budget)
    assert keys(page) == [b"big/0"] and page.more
    response = kv.ScanResponse(kvs=page.kvs, next_page_token=page.next_page_token(),
                               headers=[kv.ReadHeader(shard=s, applied_revision=10**6, served_by="node-1")
                                        for s in range(4)])
    assert response.ByteSize() <= limits.MAX_RESPONSE_BYTES


def test_the_page_budget_leaves_room_for_headers_and_the_longest_token() -> None:
    headers = [kv.ReadHeader(shard=s, applied_revision=2**62, served_by="n" * 40) for s in range(1024)]
    budget = page_budget_bytes(headers)
    rows = [row(b"k" * limits.MAX_KEY_BYTES + bytes([i]), 90_000) for i in range(30)]
    page = take_page(rows, 1000, budget)
    response = kv.ScanResponse(kvs=page.kvs, headers=headers, next_page_token=rows[0].key + b"\x00" * 2)
    assert page.more and response.ByteSize() <= limits.MAX_RESPONSE_BYTES
    assert page_budget_bytes(headers, budget_bytes=10) == 0


# ---- several sources: the merge never skips or repeats a key -------------------------------------

@pytest.mark.parametrize(
    ("streams", "parts", "limit", "budget", "expected", "more"),
    [
        pytest.param([["a", "c"], ["b", "d"]], [], 10, 10_000, ["a", "b", "c", "d"], False, id="streams-merged"),
        pytest.param([["a", "c"], ["b", "d"]], [], 3, 10_000, ["a", "b", "c"], True, id="streams-limit"),
        pytest.param([["b", "c", "e"]], [(["a", "d"], False)], 10, 10_000, ["a", "b", "c", "d", "e"], False,
                     id="complete-part"),
        # The part stopped at "b" (its own bytes or limit): "c", "d" of this node's shards are
        # after its frontier, and its unseen keys could lie between: stop at "b".
        pytest.param([["c", "d"]], [(["a", "b"], True)], 10, 10_000, ["a", "b"], True, id="frontier-cuts-streams"),
        pytest.param([["a", "c"]], [(["b"], True), (["bb", "z"], True)], 10, 10_000, ["a", "b"], True,
                     id="smallest-frontier-wins"),
        pytest.param([[]], [(["m"], True)], 10, 10_000, ["m"], True, id="only-a-part"),
        pytest.param([[], []], [], 10, 10_000, [], False, id="nothing"),
        pytest.param([["a"]], [([], False)], 10, 10_000, ["a"], False, id="empty-part"),
    ],
)
def test_merge_pages(streams: list[list[str]], parts: list[tuple[list[str], bool]], limit: int, budget: int,
                     expected: list[str], more: bool) -> None:
    page = merge_pages([[row(k) for k in s] for s in streams], [Page([row(k) for k in p], m) for p, m in parts],
                       limit, budget)
    assert keys(page) == [k.encode() for k in expected]
    assert page.more is more


def test_a_part_cut_by_bytes_holds_back_this_node_s_small_keys() -> None:
    """The case counts alone got right and bytes break: the other leader's part stopped after one
    large value; this node's small keys after it must wait, or the next page (after the last key
    returned) would skip the part's unseen keys."""
    part = take_page([row("b1", BIG), row("b2", BIG)], 1000, limits.MAX_RESPONSE_BYTES)
    assert keys(part) == [b"b1"] and part.more
    local = [row(f"c{i}") for i in range(10)] + [row("a0")]
    local.sort(key=lambda r: r.key)
    page = merge_pages([local], [part], 1000, limits.MAX_RESPONSE_BYTES)
    assert keys(page) == [b"a0", b"b1"] and page.more


def test_a_part_that_says_more_must_hold_a_key() -> None:
    with pytest.raises(AssertionError):
        Page([], more=True)


Shards = list[list[tuple[bytes, int]]]


@st.composite
def clusters(draw: st.DrawFn) -> tuple[Shards, list[list[int]], int, int]:
    """Shards of distinct keys with value sizes, split among nodes (the first is the gatherer),
    a limit and a byte budget."""
    all_keys = draw(st.lists(st.binary(min_size=1, max_size=4), unique=True, max_size=40))
    shard_count = draw(st.integers(1, 5))
    shards: Shards = [[] for _ in range(shard_count)]
    for key in all_keys:
        shards[draw(st.integers(0, shard_count - 1))].append((key, draw(st.sampled_from([0, 1, 30, 200, 900]))))
    for shard in shards:
        shard.sort()
    owner = [draw(st.integers(0, 2)) for _ in range(shard_count)]
    nodes = [[s for s in range(shard_count) if owner[s] == n] for n in range(3)]
    return shards, nodes, draw(st.integers(1, 6)), draw(st.integers(0, 1_500))


def _serve(shards: Shards, served: list[int], parts: list[Page], start: bytes, limit: int, budget: int) -> Page:
    """What a node answers: its shards from `start`, read lazily, merged with `parts`."""
    streams = [(row(k, size) for k, size in shards[s] if k >= start) for s in served]
    return merge_pages(streams, parts, limit, budget)


@settings(max_examples=400, deadline=None)
@given(clusters())
def test_paging_through_a_gathered_scan_returns_every_key_once_in_order(
        cluster: tuple[Shards, list[list[int]], int, int]) -> None:
    shards, nodes, limit, budget = cluster
    gatherer, *others = nodes
    expected = sorted(k for shard in shards for k, _ in shard)
    seen: list[bytes] = []
    token = b""
    for _ in range(len(expected) + 1):
        # The other leaders serve their shards (ScanShards, no forwarding), the gatherer merges.
        parts = [_serve(shards, served, [], token, limit, budget) for served in others if served]
        page = _serve(shards, gatherer, parts, token, limit, budget)
        assert len(page.kvs) <= limit
        if len(page.kvs) > 1:
            assert sum(kv_bytes(r) for r in page.kvs) <= budget
        assert page.kvs or not page.more
        seen += keys(page)
        if not page.more:
            break
        assert page.next_page_token() > token  # progress
        token = page.next_page_token()
    else:
        raise AssertionError("paging did not end")
    assert seen == expected


# ---- a Txn whose answer would not fit is refused, nothing queued ---------------------------------

def _state(*big_keys: bytes) -> dict[bytes, KeyState]:
    return {key: KeyState(b"v" * BIG, 1, 7, 7) for key in big_keys}


def _txn(*ops: kv.TxnOp, rid: str = "", failure: tuple[kv.TxnOp, ...] = (),
         compares: tuple[kv.Compare, ...] = ()) -> kv.TxnRequest:
    return kv.TxnRequest(request_id=rid, compares=compares, success=ops, failure=failure)


def get(key: bytes) -> kv.TxnOp:
    return kv.TxnOp(get=kv.GetRequest(key=key))


def put(key: bytes, value: bytes = b"x") -> kv.TxnOp:
    return kv.TxnOp(put=kv.PutRequest(key=key, value=value))


ABSENT = kv.Compare(key=b"nope", target=kv.Compare.TARGET_EXISTS, op=kv.Compare.OP_EQUAL, exists=True)


@pytest.mark.parametrize(
    ("request_", "refused", "field"),
    [
        pytest.param(_txn(get(b"a")), False, "", id="one-large-get-fits"),
        pytest.param(_txn(get(b"a"), get(b"b")), True, "success", id="two-large-gets-read-only"),
        pytest.param(_txn(put(b"n"), get(b"a"), get(b"b"), rid="r1"), True, "success", id="two-large-gets-writing"),
        pytest.param(_txn(*(get(b"a") for _ in range(limits.MAX_TXN_OPS))), True, "success", id="the-same-key-128x"),
        pytest.param(_txn(get(b"a"), get(b"b"), compares=(ABSENT,), failure=(get(b"a"),)), False, "",
                     id="the-large-branch-not-taken"),
        pytest.param(_txn(put(b"n"), compares=(ABSENT,), failure=(get(b"a"), get(b"b"))), True, "failure",
                     id="the-failure-branch-reads-too-much"),
        pytest.param(_txn(get(b"missing"), get(b"also-missing")), False, "", id="missing-keys-are-small"),
    ],
)
def test_evaluate_txn_refuses_an_answer_above_the_budget(request_: kv.TxnRequest, refused: bool, field: str) -> None:
    lookup = _state(b"a", b"b").get
    if not refused:
        evaluation = evaluate_txn(request_, lookup, SHARD, REV)
        assert evaluation.response.ByteSize() <= limits.MAX_RESPONSE_BYTES
        return
    with pytest.raises(errors.InvalidRequestError) as caught:
        evaluate_txn(request_, lookup, SHARD, REV)
    refusal = caught.value
    assert refusal.limit == "MAX_RESPONSE_BYTES" and refusal.field == field
    assert refusal.reason is errors.Reason.LIMIT_EXCEEDED and refusal.definite
    assert "MAX_RESPONSE_BYTES" in str(refusal)
    code, _, trailers = errors.to_status(refusal, request_id=request_.request_id)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert (errors.OUTCOME_KEY, errors.OUTCOME_NONE) in trailers


def test_the_refusal_stops_reading_at_the_budget() -> None:
    """128 gets of a large value would build a 115 MB answer: it stops after the second."""
    looked: list[bytes] = []
    state = _state(b"a")

    def lookup(key: bytes) -> KeyState | None:
        looked.append(key)
        return state.get(key)

    with pytest.raises(errors.InvalidRequestError, match="after 2 of its 128 success operations"):
        evaluate_txn(_txn(*(get(b"a") for _ in range(limits.MAX_TXN_OPS))), lookup, SHARD, REV)
    assert len(looked) == 2


@pytest.mark.parametrize("budget", [100, 500, 5_000])
def test_the_whole_answer_counts_not_only_the_results(budget: int) -> None:
    """At an exact edge: the largest budget refused is one byte below the answer's size."""
    request_ = _txn(get(b"k"), put(b"p"), rid="r")
    state = {b"k": KeyState(b"v" * (budget // 2), 1, 7, 7)}
    size = evaluate_txn(request_, state.get, SHARD, REV, max_response_bytes=10**9).response.ByteSize()
    assert evaluate_txn(request_, state.get, SHARD, REV, max_response_bytes=size).response.ByteSize() == size
    with pytest.raises(errors.InvalidRequestError):
        evaluate_txn(request_, state.get, SHARD, REV, max_response_bytes=size - 1)


class Table:
    evicted_through_ms = 0

    def request(self, request_id: str) -> RequestRecord | None:
        return None


def _write_put(key: bytes) -> Write:
    req = kv.PutRequest(key=key, value=b"v")
    return Write("", lambda lookup, rev: evaluate_put(req, lookup, SHARD, rev), kv.PutResponse, NOW_MS)


def _write_txn(req: kv.TxnRequest) -> Write:
    return Write(req.request_id, lambda lookup, rev: evaluate_txn(req, lookup, SHARD, rev), kv.TxnResponse, NOW_MS)


@pytest.mark.parametrize("oversized", [
    pytest.param(_txn(get(b"a"), get(b"b")), id="read-only"),
    pytest.param(_txn(get(b"a"), get(b"b"), rid="ro-with-id"), id="read-only-with-id"),
    pytest.param(_txn(put(b"n"), get(b"a"), get(b"b"), rid="w"), id="writing"),
])
def test_plan_refuses_the_oversized_txn_now_and_queues_nothing_of_it(oversized: kv.TxnRequest) -> None:
    writes = [_write_put(b"before"), _write_txn(oversized), _write_put(b"after")]
    plan = plan_batch(writes, REV, _state(b"a", b"b").get, Table(), NOW_MS, WIDE)
    assert [i for i, _ in plan.now] == [1]
    refusal = plan.now[0][1]
    assert isinstance(refusal, errors.InvalidRequestError) and refusal.limit == "MAX_RESPONSE_BYTES"
    assert [i for i, _ in plan.after_commit] == [0, 2] and not plan.carry
    assert len(plan.payloads) == 2  # the two puts, at consecutive revisions: nothing of the Txn
    assert [r.result.revision for _, r in plan.after_commit] == [REV, REV + 1]  # type: ignore[union-attr]


def test_a_writing_txn_above_the_record_limit_names_it() -> None:
    """Below MAX_RESPONSE_BYTES but too large for one WAL record with its stored answer."""
    small = BatchLimits(max_records=1000, max_bytes=1 << 20, max_record_bytes=2_000)
    state = {b"k": KeyState(b"v" * 3_000, 1, 7, 7)}
    plan = plan_batch([_write_txn(_txn(put(b"n"), get(b"k"), rid="w"))], REV, state.get, Table(), NOW_MS, small)
    (index, refusal), = plan.now
    assert index == 0 and not plan.payloads
    assert isinstance(refusal, errors.InvalidRequestError) and refusal.limit == "max_record_bytes"
