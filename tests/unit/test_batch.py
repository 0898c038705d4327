"""`kvstore.core.batch`: admission, in-batch dedupe, the overlay, sizing and carry-over; pure.

Each case is a table row: the committed state and request table, the writes in queue order, and
the exact plan expected (records, who is answered now / after commit / carried, with what)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvstore import errors, limits
from kvstore.core.batch import BatchLimits, Plan, Write, admit, plan_batch, probe_write, replayed, write_of
from kvstore.core.entries import decode_entry
from kvstore.core.evaluate import Evaluation, evaluate_delete, evaluate_mutations, evaluate_put, evaluate_txn
from kvstore.core.state import KeyState, RequestRecord, apply_entries
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.v1 import kv_pb2 as kv

SHARD, REV = 1, 100
NOW_MS = 1_800_000_000_000
WIDE = BatchLimits(max_records=1000, max_bytes=1 << 20, max_record_bytes=1 << 20)


@dataclasses.dataclass
class Table:
    """A request table as the planner sees it (LevelDB in a node)."""

    rows: dict[str, RequestRecord] = dataclasses.field(default_factory=dict)
    evicted_through_ms: int = 0

    def request(self, request_id: str) -> RequestRecord | None:
        return self.rows.get(request_id)


def put(key: bytes, value: bytes = b"v", rid: str = "", first_ms: int = NOW_MS) -> Write:
    req = kv.PutRequest(key=key, value=value, request_id=rid)
    return Write(rid, lambda lookup, rev: evaluate_put(req, lookup, SHARD, rev), kv.PutResponse, first_ms,
                 pb.REQUEST_KIND_PUT)


def delete(key: bytes, rid: str = "") -> Write:
    req = kv.DeleteRequest(key=key, request_id=rid)
    return Write(rid, lambda lookup, rev: evaluate_delete(req, lookup, SHARD, rev), kv.DeleteResponse, NOW_MS,
                 pb.REQUEST_KIND_DELETE)


def cas(key: bytes, version: int, value: bytes, rid: str = "") -> Write:
    req = kv.TxnRequest(request_id=rid,
                        compares=[kv.Compare(key=key, target=kv.Compare.TARGET_VERSION, op=kv.Compare.OP_EQUAL,
                                             version=version)],
                        success=[kv.TxnOp(put=kv.PutRequest(key=key, value=value))])
    return Write(rid, lambda lookup, rev: evaluate_txn(req, lookup, SHARD, rev), kv.TxnResponse, NOW_MS)


def get_only(key: bytes, rid: str = "") -> Write:
    req = kv.TxnRequest(request_id=rid, success=[kv.TxnOp(get=kv.GetRequest(key=key))])
    return Write(rid, lambda lookup, rev: evaluate_txn(req, lookup, SHARD, rev), kv.TxnResponse, NOW_MS)


def committed(rid: str, revision: int = 7, version: int = 3, kind: int = pb.REQUEST_KIND_PUT) -> RequestRecord:
    answer = kv.PutResponse(result=kv.WriteResult(shard=SHARD, revision=revision), version=version)
    return RequestRecord(rid, revision, answer.SerializeToString(), NOW_MS - 1000, kind)


def plan(writes: list[Write], state: dict[bytes, KeyState] | None = None, table: Table | None = None,
         batch_limits: BatchLimits = WIDE) -> Plan:
    state = state or {}
    return plan_batch(writes, REV, state.get, table or Table(), NOW_MS, batch_limits)


def kinds(p: Plan) -> tuple[list[tuple[int, str]], list[int], list[int]]:
    """(now: index and answer type name, after_commit indices, carry) for compact table rows."""
    return ([(i, type(a).__name__) for i, a in p.now], [i for i, _ in p.after_commit], p.carry)


# ---- admission ---------------------------------------------------------------------------------------

ADMIT_CASES = [
    # id, table, in progress, first attempt -> expected answer type (None = queue it)
    ("no request id: always queued", "", Table({"a": committed("a")}), {"a"}, NOW_MS, None),
    ("new id", "a", Table(), set(), NOW_MS, None),
    ("committed before: replayed", "a", Table({"a": committed("a")}), set(), NOW_MS, "PutResponse"),
    ("committed and in progress: the table wins", "a", Table({"a": committed("a")}), {"a"}, NOW_MS, "PutResponse"),
    ("in progress here: unknown for now", "a", Table(), {"a"}, NOW_MS, "UnknownOutcomeError"),
    ("beyond the horizon", "a", Table(), set(), NOW_MS - limits.REQUEST_ID_HORIZON_MS - 1, "RequestExpiredError"),
    ("may be a forgotten id", "a", Table(evicted_through_ms=NOW_MS - 5), set(), NOW_MS - 10,
     "RequestExpiredError"),
    ("after the forgotten ones plus skew", "a", Table(evicted_through_ms=NOW_MS - limits.MAX_CLOCK_SKEW_MS - 10),
     set(), NOW_MS - 5, None),
]


@pytest.mark.parametrize(("rid", "table", "in_progress", "first_ms", "expected"),
                         [c[1:] for c in ADMIT_CASES], ids=[c[0] for c in ADMIT_CASES])
def test_admit(rid: str, table: Table, in_progress: set[str], first_ms: int, expected: str | None) -> None:
    answer = admit(put(b"k", rid=rid, first_ms=first_ms), table, in_progress, NOW_MS)
    assert (None if answer is None else type(answer).__name__) == expected
    if isinstance(answer, errors.StoreError):
        assert answer.definite == (expected != "UnknownOutcomeError")


def test_a_replay_is_the_recorded_answer_marked_replayed() -> None:
    answer = admit(put(b"k", rid="a"), Table({"a": committed("a", revision=7, version=3)}), set(), NOW_MS)
    assert isinstance(answer, kv.PutResponse)
    assert (answer.result.revision, answer.version, answer.result.replayed) == (7, 3, True)
    again = replayed(put(b"k", rid="a"), committed("a"))
    assert isinstance(again, kv.PutResponse) and again.result.replayed


# ---- planning -------------------------------------------------------------------------------------------

PLAN_CASES = [
    # name, writes, committed state, table, limits -> (now, after_commit, carry), records
    ("one put", [put(b"a")], None, None, WIDE, ([], [0], []), 1),
    ("a replay is answered now, not written", [put(b"a", rid="r")], None, Table({"r": committed("r")}), WIDE,
     ([(0, "PutResponse")], [], []), 0),
    ("second attempt in the batch shares the first's record", [put(b"a", rid="r"), put(b"a", rid="r")], None,
     None, WIDE, ([], [0, 1], []), 1),
    ("an expired retry is refused, the rest written", [put(b"a", rid="old", first_ms=1), put(b"b")], None, None,
     WIDE, ([(0, "RequestExpiredError")], [1], []), 1),
    ("read-only txn: no record, answered after a barrier", [get_only(b"a")], None, None, WIDE, ([], [0], []), 0),
    ("count bound: the rest carried in order", [put(b"a"), put(b"b"), put(b"c")], None, None,
     BatchLimits(2, 1 << 20, 1 << 20), ([], [0, 1], [2]), 2),
    ("byte bound: carried", [put(b"a", b"x" * 60), put(b"b", b"x" * 60)], None, None,
     BatchLimits(10, 100, 1 << 20), ([], [0], [1]), 1),
    ("a record above the record limit is refused alone", [put(b"a", b"x" * 200), put(b"b")], None, None,
     BatchLimits(10, 1 << 20, 100), ([(0, "InvalidRequestError")], [1], []), 1),
    ("the first record is taken even if it alone passes the batch bytes", [put(b"a", b"x" * 200)], None, None,
     BatchLimits(10, 100, 1 << 20), ([], [0], []), 1),
]


@pytest.mark.parametrize(("writes", "state", "table", "batch_limits", "expected", "records"),
                         [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_plan(writes: list[Write], state: dict[bytes, KeyState] | None, table: Table | None,
              batch_limits: BatchLimits, expected: tuple[list[tuple[int, str]], list[int], list[int]],
              records: int) -> None:
    p = plan(writes, state, table, batch_limits)
    assert kinds(p) == expected
    assert len(p.payloads) == records


def test_records_land_at_consecutive_expected_offsets_and_see_the_overlay() -> None:
    """W1: the i-th record's revision is REV + i; a later write sees the earlier ones' effects."""
    p = plan([put(b"a", b"1"), cas(b"a", 1, b"2"), put(b"b"), delete(b"a"), cas(b"a", 0, b"3")])
    responses = [r for _, r in p.after_commit]
    assert [r.result.revision for r in responses] == [REV, REV + 1, REV + 2, REV + 3, REV + 4]
    assert isinstance(responses[1], kv.TxnResponse) and responses[1].succeeded  # saw version 1 in the overlay
    assert isinstance(responses[3], kv.DeleteResponse) and responses[3].deleted
    assert isinstance(responses[4], kv.TxnResponse) and responses[4].succeeded  # deleted: version 0 again
    assert p.upcoming_if_committed == REV + 5 + 1  # the commit marker takes one offset


def test_the_plan_agrees_with_the_state_machine() -> None:
    """What the leader predicted (versions in its answers) is what every replica applies."""
    state = {b"a": KeyState(b"0", 4, 50, 10)}
    p = plan([put(b"a", rid="1"), cas(b"a", 5, b"x", rid="2"), put(b"c", rid="3"), put(b"a", rid="4")], state)
    applied = apply_entries(state.get, lambda rid: False, list(enumerate(p.payloads, start=REV)))
    assert applied.writes[b"a"] == KeyState(b"v", 7, REV + 3, 10)
    last = p.after_commit[3][1]
    assert isinstance(last, kv.PutResponse) and last.version == 7
    entries = [decode_entry(payload) for payload in p.payloads]
    assert all(e is not None and e.leader_unix_ms == NOW_MS for e in entries)


def test_an_evaluation_error_is_a_definite_refusal() -> None:
    def bad(lookup: object, rev: int) -> Evaluation:
        raise ValueError("compare op 9 is not supported")

    p = plan([Write("x", bad, kv.TxnResponse), put(b"a")])
    assert kinds(p) == ([(0, "InvalidRequestError")], [1], [])
    assert "compare op 9" in str(p.now[0][1])


def test_every_write_is_answered_or_carried_exactly_once() -> None:
    """The paired assertion inside plan_batch, on a mixed queue with every kind of answer."""
    writes = [put(b"a", rid="r"), put(b"b", rid="done"), put(b"a", rid="r"), get_only(b"a"),
              put(b"c", b"x" * 300, rid="big"), put(b"d", rid="old", first_ms=1), put(b"e"), put(b"f")]
    p = plan(writes, table=Table({"done": committed("done")}), batch_limits=BatchLimits(2, 1 << 20, 200))
    indices = sorted([i for i, _ in p.now] + [i for i, _ in p.after_commit] + p.carry)
    assert indices == list(range(len(writes)))
    assert kinds(p) == ([(1, "PutResponse"), (4, "InvalidRequestError"), (5, "RequestExpiredError")],
                        [0, 2, 3, 6], [7])


def test_the_probe_is_an_empty_entry_without_a_request_id() -> None:
    p = plan([probe_write()])
    assert len(p.payloads) == 1 and p.after_commit and not p.now
    entry = decode_entry(p.payloads[0])
    assert entry is not None and not entry.effects and entry.request_id == ""


# --------------------------------------------------------------------------------------------
# WriteBatch parts: one record per part, effects in order, no lookups, replayed like any write


def mutations(rid: str, *muts: tuple[bytes, bytes | None]) -> kv.ShardMutations:
    """A part of shard SHARD: (key, value) puts, (key, None) deletes."""
    part = kv.ShardMutations(shard=SHARD, request_id=rid, first_attempt_unix_ms=NOW_MS)
    for key, value in muts:
        part.mutations.add(key=key, value=value or b"", delete=value is None)
    return part


def test_a_part_is_one_record_whose_effects_apply_in_order() -> None:
    part = mutations("p1", (b"a", b"1"), (b"b", b"2"), (b"a", b"3"), (b"c", None))
    state = {b"c": KeyState(b"old", 2, 5, 4)}
    p = plan([write_of(part, SHARD)], state)
    assert len(p.payloads) == 1 and p.now == [] and p.carry == []
    [(index, answer)] = p.after_commit
    assert index == 0 and isinstance(answer, kv.ShardMutationsResult)
    assert (answer.shard, answer.result.revision, answer.mutations, answer.result.replayed) == (SHARD, REV, 4, False)
    entry = decode_entry(p.payloads[0])
    assert entry is not None and entry.request_id == "p1" and entry.leader_unix_ms == NOW_MS
    applied = apply_entries(state.get, lambda _rid: False, [(REV, p.payloads[0])])
    assert applied.writes == {b"a": KeyState(b"3", 2, REV, REV), b"b": KeyState(b"2", 1, REV, REV), b"c": None}
    assert kv.ShardMutationsResult.FromString(applied.requests[0].response) == answer


def test_a_part_never_looks_up_the_state() -> None:
    def lookup(key: bytes) -> KeyState | None:
        raise AssertionError(f"looked up {key!r}")

    evaluation = evaluate_mutations(mutations("p", (b"a", b"1"), (b"b", None)), SHARD, REV)
    assert evaluation.entry is not None and len(evaluation.entry.effects) == 2
    write_of(mutations("p", (b"a", b"1")), SHARD).build(lookup, REV)


def test_a_part_seen_before_is_answered_with_its_recorded_result_marked_replayed() -> None:
    original = kv.ShardMutationsResult(shard=SHARD, result=kv.WriteResult(shard=SHARD, revision=7), mutations=2)
    table = Table({"p1": RequestRecord("p1", 7, original.SerializeToString(), NOW_MS - 1000)})
    p = plan([write_of(mutations("p1", (b"a", b"1"), (b"b", b"2")), SHARD)], table=table)
    [(_, answer)] = p.now
    assert isinstance(answer, kv.ShardMutationsResult) and p.payloads == []
    assert (answer.result.revision, answer.result.replayed, answer.mutations) == (7, True, 2)


def test_parts_share_a_batch_with_single_writes_and_see_them() -> None:
    p = plan([put(b"a", b"1"), write_of(mutations("p", (b"a", b"2")), SHARD), put(b"a", b"3")])
    assert [i for i, _ in p.after_commit] == [0, 1, 2] and len(p.payloads) == 3
    last = p.after_commit[2][1]
    assert isinstance(last, kv.PutResponse) and last.version == 3 and last.result.revision == REV + 2


def test_the_overlay_is_folded_only_for_keys_a_later_write_reads() -> None:
    looked_up: list[bytes] = []

    def lookup(key: bytes) -> KeyState | None:
        looked_up.append(key)
        return KeyState(b"old", 4, 3, 1) if key == b"a" else None

    part = mutations("p", (b"a", b"1"), (b"b", b"2"), (b"a", None), (b"a", b"3"))
    p = plan_batch([write_of(part, SHARD), put(b"a", b"4"), put(b"c", b"5")], REV, lookup, Table(), NOW_MS, WIDE)
    assert looked_up == [b"a", b"c"], "b is never read after the part: never looked up"
    last_a = p.after_commit[1][1]
    assert isinstance(last_a, kv.PutResponse) and last_a.version == 2, "deleted then put (1) by the part, then 2"
    applied = apply_entries(lookup, lambda _rid: False, list(enumerate(p.payloads, REV)))
    assert applied.writes[b"a"] == KeyState(b"4", 2, REV + 1, REV)


@pytest.mark.parametrize(("request_", "response_type"), [
    (kv.PutRequest(key=b"a", value=b"1", request_id="p", first_attempt_unix_ms=NOW_MS), kv.PutResponse),
    (kv.DeleteRequest(key=b"a", request_id="d", first_attempt_unix_ms=NOW_MS), kv.DeleteResponse),
    (kv.TxnRequest(success=[kv.TxnOp(put=kv.PutRequest(key=b"a", value=b"1"))], request_id="t",
                   first_attempt_unix_ms=NOW_MS), kv.TxnResponse),
    (mutations("m", (b"a", b"1")), kv.ShardMutationsResult),
])
def test_write_of_every_request_kind(request_: Any, response_type: type[Any]) -> None:
    write = write_of(request_, SHARD)
    assert (write.request_id, write.response_type, write.first_attempt_unix_ms) == (
        request_.request_id, response_type, NOW_MS)
    assert write.kind == KINDS[response_type]
    [payload] = plan([write]).payloads  # the kind travels in the entry, with the request id
    assert pb.WalEntry.FromString(payload).request_kind == write.kind
    evaluation = write.build(lambda _key: None, REV)
    assert isinstance(evaluation.response, response_type) and evaluation.entry is not None
    assert evaluation.entry.request_id == request_.request_id and evaluation.response.result.revision == REV


KINDS = {kv.PutResponse: pb.REQUEST_KIND_PUT, kv.DeleteResponse: pb.REQUEST_KIND_DELETE,
         kv.TxnResponse: pb.REQUEST_KIND_TXN, kv.ShardMutationsResult: pb.REQUEST_KIND_WRITE_BATCH_PART}
_REQUESTS_OF_EVERY_KIND = {
    pb.REQUEST_KIND_PUT: kv.PutRequest(key=b"a", value=b"1", request_id="x", first_attempt_unix_ms=NOW_MS),
    pb.REQUEST_KIND_DELETE: kv.DeleteRequest(key=b"a", request_id="x", first_attempt_unix_ms=NOW_MS),
    pb.REQUEST_KIND_TXN: kv.TxnRequest(success=[kv.TxnOp(put=kv.PutRequest(key=b"a", value=b"1"))], request_id="x",
                                       first_attempt_unix_ms=NOW_MS),
    pb.REQUEST_KIND_WRITE_BATCH_PART: mutations("x", (b"a", b"1")),
}


@pytest.mark.parametrize("first", sorted(_REQUESTS_OF_EVERY_KIND))
@pytest.mark.parametrize("retry", sorted(_REQUESTS_OF_EVERY_KIND))
def test_an_id_is_answered_only_for_its_own_kind_of_request(first: int, retry: int) -> None:
    """Issue 18: a request id reused by another kind of request is refused for every kind (a
    Delete retried with a Put's id must not get the Put's answer: its bytes parse as one)."""
    original = write_of(_REQUESTS_OF_EVERY_KIND[first], SHARD)
    [payload] = plan([original]).payloads
    applied = apply_entries(lambda _key: None, lambda _rid: False, [(REV, payload)])
    [record] = applied.requests
    assert record.kind == first
    answer = admit(write_of(_REQUESTS_OF_EVERY_KIND[retry], SHARD), Table({"x": record}), (), NOW_MS)
    if first == retry:
        assert isinstance(answer, original.response_type) and answer.result.replayed
    else:
        assert isinstance(answer, errors.InvalidRequestError) and answer.definite, answer
        assert "already used by" in str(answer) and answer.field == "request_id"


def test_an_id_recorded_without_a_kind_is_judged_by_its_answer_as_before() -> None:
    """Entries written before WalEntry.request_kind: the recorded answer's shape decides, which
    tells a WriteBatch part from the rest, not a Put from a Delete (documented)."""
    legacy = committed("x", kind=pb.REQUEST_KIND_UNSPECIFIED)
    assert isinstance(admit(delete(b"a", rid="x"), Table({"x": legacy}), (), NOW_MS), kv.DeleteResponse)
    refused = admit(write_of(mutations("x", (b"a", b"1")), SHARD), Table({"x": legacy}), (), NOW_MS)
    assert isinstance(refused, errors.InvalidRequestError)


@pytest.mark.parametrize(("recorded", "again"), [
    (kv.PutResponse(result=kv.WriteResult(shard=SHARD, revision=7), version=1),
     write_of(mutations("x", (b"a", b"1")), SHARD)),
    (kv.ShardMutationsResult(shard=2, result=kv.WriteResult(shard=2, revision=7), mutations=3),
     write_of(kv.PutRequest(key=b"a", value=b"1", request_id="x", first_attempt_unix_ms=NOW_MS), SHARD)),
])
def test_an_id_reused_by_another_kind_of_request_is_refused_not_replayed_as_garbage(recorded: Any,
                                                                                   again: Write) -> None:
    table = Table({"x": RequestRecord("x", 7, recorded.SerializeToString(), NOW_MS - 1000)})  # no kind
    answer = admit(again, table, (), NOW_MS)
    assert isinstance(answer, errors.InvalidRequestError) and answer.definite
    assert "already used by another kind of request" in str(answer)
