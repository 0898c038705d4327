"""`kvstore.core.evaluate`: leader-side evaluation of Put/Delete/Txn into WAL entries and responses; pure."""

from __future__ import annotations

import random

import pytest

from kvstore.core.evaluate import Evaluation, compare_holds, evaluate_delete, evaluate_put, evaluate_txn, key_value
from kvstore.core.state import ChangeType, KeyState, apply_entries
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.v1 import kv_pb2 as kv

C = kv.Compare
SHARD, REV = 3, 42
PRESENT = KeyState(b"v", version=3, mod_revision=10, create_revision=5)
OPERAND = {C.TARGET_VERSION: "version", C.TARGET_MOD_REVISION: "mod_revision", C.TARGET_VALUE: "value",
           C.TARGET_EXISTS: "exists"}
NAMES = {C.TARGET_VERSION: "version", C.TARGET_MOD_REVISION: "mod_rev", C.TARGET_VALUE: "value",
         C.TARGET_EXISTS: "exists", C.OP_EQUAL: "eq", C.OP_NOT_EQUAL: "ne", C.OP_GREATER: "gt", C.OP_LESS: "lt"}


def cmp(target: int, op: int, operand: int | bytes | bool | None = None, key: bytes = b"k") -> kv.Compare:
    c = C(key=key, target=target, op=op)
    if operand is not None:
        setattr(c, OPERAND[target], operand)
    return c


def put(key: bytes, value: bytes = b"x") -> kv.TxnOp:
    return kv.TxnOp(put=kv.PutRequest(key=key, value=value))


def delete(key: bytes) -> kv.TxnOp:
    return kv.TxnOp(delete=kv.DeleteRequest(key=key))


def get(key: bytes) -> kv.TxnOp:
    return kv.TxnOp(get=kv.GetRequest(key=key))


# ---- compare_holds ------------------------------------------------------------------------------


def case(target: int, op: int, operand: int | bytes | bool, present: bool, expected: bool) -> object:
    return pytest.param(cmp(target, op, operand), PRESENT if present else None, expected,
                        id=f"{NAMES[target]}-{NAMES[op]}-{operand!r}-{'present' if present else 'missing'}")


V, M, VAL, EX = C.TARGET_VERSION, C.TARGET_MOD_REVISION, C.TARGET_VALUE, C.TARGET_EXISTS
EQ, NE, GT, LT = C.OP_EQUAL, C.OP_NOT_EQUAL, C.OP_GREATER, C.OP_LESS


@pytest.mark.parametrize(
    ("compare", "state", "expected"),
    [
        # VERSION: PRESENT has version 3; a missing key has version 0.
        case(V, EQ, 3, True, True), case(V, EQ, 2, True, False), case(V, NE, 3, True, False),
        case(V, NE, 2, True, True), case(V, GT, 2, True, True), case(V, GT, 3, True, False),
        case(V, LT, 4, True, True), case(V, LT, 3, True, False),
        case(V, EQ, 0, False, True), case(V, EQ, 1, False, False), case(V, NE, 0, False, False),
        case(V, NE, 1, False, True), case(V, GT, 0, False, False), case(V, GT, -1, False, True),
        case(V, LT, 1, False, True), case(V, LT, 0, False, False),
        # MOD_REVISION: PRESENT has mod_revision 10; a missing key has 0.
        case(M, EQ, 10, True, True), case(M, EQ, 9, True, False), case(M, NE, 10, True, False),
        case(M, NE, 9, True, True), case(M, GT, 9, True, True), case(M, GT, 10, True, False),
        case(M, LT, 11, True, True), case(M, LT, 10, True, False),
        case(M, EQ, 0, False, True), case(M, EQ, 10, False, False), case(M, NE, 0, False, False),
        case(M, NE, 10, False, True), case(M, GT, 0, False, False), case(M, LT, 1, False, True),
        # VALUE: PRESENT has b"v" (byte order); on a missing key only NOT_EQUAL holds, whatever the operand.
        case(VAL, EQ, b"v", True, True), case(VAL, EQ, b"w", True, False), case(VAL, NE, b"v", True, False),
        case(VAL, NE, b"w", True, True), case(VAL, GT, b"u", True, True), case(VAL, GT, b"v", True, False),
        case(VAL, LT, b"w", True, True), case(VAL, LT, b"v", True, False), case(VAL, LT, b"v\x00", True, True),
        case(VAL, EQ, b"", False, False), case(VAL, EQ, b"v", False, False), case(VAL, NE, b"", False, True),
        case(VAL, NE, b"v", False, True), case(VAL, GT, b"", False, False), case(VAL, LT, b"z", False, False),
        # EXISTS: compared as 1/0.
        case(EX, EQ, True, True, True), case(EX, EQ, False, True, False), case(EX, NE, False, True, True),
        case(EX, NE, True, True, False), case(EX, GT, False, True, True), case(EX, LT, True, True, False),
        case(EX, EQ, False, False, True), case(EX, EQ, True, False, False), case(EX, NE, True, False, True),
        case(EX, NE, False, False, False), case(EX, GT, False, False, False), case(EX, LT, True, False, True),
    ],
)
def test_compare_holds(compare: kv.Compare, state: KeyState | None, expected: bool) -> None:
    assert compare_holds(compare, state) is expected


@pytest.mark.parametrize(
    ("compare", "state"),
    [
        pytest.param(C(key=b"k", target=V), PRESENT, id="version-no-op-present"),
        pytest.param(C(key=b"k", target=V), None, id="version-no-op-missing"),
        pytest.param(C(key=b"k", target=M), None, id="mod_rev-no-op-missing"),
        pytest.param(C(key=b"k", target=EX), None, id="exists-no-op-missing"),
        pytest.param(C(key=b"k", target=VAL), PRESENT, id="value-no-op-present"),
        pytest.param(C(key=b"k", target=VAL), None, id="value-no-op-missing"),
        pytest.param(C(key=b"k", op=EQ), PRESENT, id="no-target-present"),
        pytest.param(C(key=b"k", op=EQ), None, id="no-target-missing"),
        pytest.param(C(key=b"k"), None, id="nothing"),
    ],
)
def test_compare_holds_refuses_unspecified(compare: kv.Compare, state: KeyState | None) -> None:
    with pytest.raises(ValueError, match="not supported"):
        compare_holds(compare, state)


# ---- evaluate_put / evaluate_delete -------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "request_id", "version"),
    [
        pytest.param({}, "r1", 1, id="new-key"),
        pytest.param({b"k": PRESENT}, "r1", 4, id="existing-key"),
        pytest.param({b"k": PRESENT}, "", 4, id="no-request-id"),
        pytest.param({b"other": PRESENT}, "r1", 1, id="other-key-present"),
    ],
)
def test_evaluate_put(state: dict[bytes, KeyState], request_id: str, version: int) -> None:
    ev = evaluate_put(kv.PutRequest(key=b"k", value=b"new", request_id=request_id), state.get, SHARD, REV)
    assert ev.entry is not None
    assert ev.entry.request_id == request_id
    assert list(ev.entry.effects) == [pb.Effect(put=pb.PutEffect(key=b"k", value=b"new"))]
    assert ev.response == kv.PutResponse(result=kv.WriteResult(shard=SHARD, revision=REV), version=version)
    assert kv.PutResponse.FromString(ev.entry.response) == ev.response


@pytest.mark.parametrize(
    ("state", "request_id", "deleted"),
    [
        pytest.param({b"k": PRESENT}, "r1", True, id="existing-key"),
        pytest.param({}, "r1", False, id="missing-key-still-an-effect"),
        pytest.param({b"other": PRESENT}, "", False, id="other-key-no-request-id"),
    ],
)
def test_evaluate_delete(state: dict[bytes, KeyState], request_id: str, deleted: bool) -> None:
    ev = evaluate_delete(kv.DeleteRequest(key=b"k", request_id=request_id), state.get, SHARD, REV)
    assert ev.entry is not None
    assert ev.entry.request_id == request_id
    assert list(ev.entry.effects) == [pb.Effect(delete=pb.DeleteEffect(key=b"k"))]
    assert ev.response == kv.DeleteResponse(result=kv.WriteResult(shard=SHARD, revision=REV), deleted=deleted)
    assert kv.DeleteResponse.FromString(ev.entry.response) == ev.response


# ---- evaluate_txn -------------------------------------------------------------------------------


def txn(compares: list[kv.Compare] | tuple[()] = (), success: list[kv.TxnOp] | tuple[()] = (),
        failure: list[kv.TxnOp] | tuple[()] = (), request_id: str = "t1") -> Evaluation:
    req = kv.TxnRequest(compares=compares, success=success, failure=failure, request_id=request_id)
    return evaluate_txn(req, {b"k": PRESENT}.get, SHARD, REV)


def put_result(version: int) -> kv.TxnOpResult:
    return kv.TxnOpResult(put=kv.PutResponse(result=kv.WriteResult(shard=SHARD, revision=REV), version=version))


def delete_result(deleted: bool) -> kv.TxnOpResult:
    return kv.TxnOpResult(delete=kv.DeleteResponse(result=kv.WriteResult(shard=SHARD, revision=REV), deleted=deleted))


def get_result(key: bytes, state: KeyState | None) -> kv.TxnOpResult:
    if state is None:
        return kv.TxnOpResult(get=kv.GetResponse(found=False))
    return kv.TxnOpResult(get=kv.GetResponse(found=True, kv=key_value(key, state)))


@pytest.mark.parametrize(
    ("compares", "succeeded"),
    [
        pytest.param([], True, id="no-compares"),
        pytest.param([cmp(V, EQ, 3)], True, id="version-holds"),
        pytest.param([cmp(V, EQ, 2)], False, id="version-fails"),
        pytest.param([cmp(V, EQ, 3), cmp(EX, EQ, False, key=b"m")], True, id="all-hold"),
        pytest.param([cmp(V, EQ, 3), cmp(EX, EQ, True, key=b"m")], False, id="one-of-two-fails"),
    ],
)
def test_evaluate_txn_branch(compares: list[kv.Compare], succeeded: bool) -> None:
    ev = txn(compares, success=[put(b"k", b"yes")], failure=[put(b"m", b"no")])
    key, value, version = (b"k", b"yes", 4) if succeeded else (b"m", b"no", 1)
    assert ev.response == kv.TxnResponse(succeeded=succeeded, results=[put_result(version)],
                                         result=kv.WriteResult(shard=SHARD, revision=REV))
    assert ev.entry is not None
    assert ev.entry.request_id == "t1"
    assert list(ev.entry.effects) == [pb.Effect(put=pb.PutEffect(key=key, value=value))]
    assert kv.TxnResponse.FromString(ev.entry.response) == ev.response


@pytest.mark.parametrize(
    ("ops", "results", "effects"),
    [
        pytest.param([put(b"k", b"new"), get(b"k")], [put_result(4), get_result(b"k", PRESENT)], 1,
                     id="get-after-put-sees-old-state"),
        pytest.param([put(b"m"), get(b"m")], [put_result(1), get_result(b"m", None)], 1,
                     id="get-after-put-of-missing-not-found"),
        pytest.param([delete(b"k"), get(b"k")], [delete_result(True), get_result(b"k", PRESENT)], 1,
                     id="get-after-delete-still-found"),
        pytest.param([put(b"k"), put(b"k")], [put_result(4), put_result(5)], 2, id="two-puts-existing-n+1-n+2"),
        pytest.param([put(b"m"), put(b"m")], [put_result(1), put_result(2)], 2, id="two-puts-missing-1-2"),
        pytest.param([delete(b"k"), put(b"k")], [delete_result(True), put_result(1)], 2, id="delete-then-put"),
        pytest.param([put(b"m"), delete(b"m")], [put_result(1), delete_result(True)], 2, id="put-then-delete"),
        pytest.param([delete(b"k"), delete(b"k")], [delete_result(True), delete_result(False)], 2,
                     id="delete-twice"),
        pytest.param([delete(b"m")], [delete_result(False)], 1, id="delete-missing-still-an-effect"),
        pytest.param([put(b"k"), put(b"m"), put(b"k")], [put_result(4), put_result(1), put_result(5)], 3,
                     id="interleaved-keys"),
    ],
)
def test_evaluate_txn_ops(ops: list[kv.TxnOp], results: list[kv.TxnOpResult], effects: int) -> None:
    ev = txn(success=ops)
    assert ev.response == kv.TxnResponse(succeeded=True, results=results,
                                         result=kv.WriteResult(shard=SHARD, revision=REV))
    assert ev.entry is not None and len(ev.entry.effects) == effects
    assert kv.TxnResponse.FromString(ev.entry.response) == ev.response


def test_evaluate_txn_entry_ignores_inner_request_id() -> None:
    ev = txn(success=[kv.TxnOp(put=kv.PutRequest(key=b"k", request_id="inner"))], request_id="outer")
    assert ev.entry is not None and ev.entry.request_id == "outer"


@pytest.mark.parametrize(
    ("compares", "success", "failure", "results"),
    [
        pytest.param([], [get(b"k"), get(b"m")], [put(b"k")],
                     [get_result(b"k", PRESENT), get_result(b"m", None)], id="success-only-gets"),
        pytest.param([cmp(EX, EQ, False)], [put(b"k")], [get(b"k")], [get_result(b"k", PRESENT)],
                     id="failure-only-gets"),
        pytest.param([cmp(EX, EQ, True)], [], [put(b"k")], [], id="empty-success-branch"),
    ],
)
def test_evaluate_txn_without_writes(compares: list[kv.Compare], success: list[kv.TxnOp], failure: list[kv.TxnOp],
                                     results: list[kv.TxnOpResult]) -> None:
    """The taken branch writes nothing but the other could have: with a request id the outcome
    is recorded (an entry without effects, at REV) so that a late attempt of the same id replays
    it; without one, nothing is recorded."""
    ev = txn(compares, success, failure)
    assert ev.entry is not None and list(ev.entry.effects) == [] and ev.entry.request_id == "t1"
    assert kv.TxnResponse.FromString(ev.entry.response) == ev.response
    assert ev.response.result == kv.WriteResult(shard=SHARD, revision=REV)
    assert list(ev.response.results) == results
    anonymous = txn(compares, success, failure, request_id="")
    assert anonymous.entry is None
    assert anonymous.response.result == kv.WriteResult(shard=SHARD)
    assert not anonymous.response.result.HasField("revision")  # unset: 0 would be a real offset
    assert list(anonymous.response.results) == results


def test_a_txn_of_only_gets_records_nothing() -> None:
    ev = txn([cmp(EX, EQ, False)], [get(b"k")], [get(b"m")])
    assert ev.entry is None and not ev.response.result.HasField("revision")


@pytest.mark.parametrize(
    ("compares", "success", "failure"),
    [
        pytest.param([], [kv.TxnOp()], [], id="success-only-op"),
        pytest.param([], [put(b"k"), kv.TxnOp()], [], id="after-a-put"),
        pytest.param([cmp(EX, EQ, False)], [], [kv.TxnOp()], id="in-failure-branch"),
    ],
)
def test_evaluate_txn_refuses_op_without_kind(compares: list[kv.Compare], success: list[kv.TxnOp],
                                              failure: list[kv.TxnOp]) -> None:
    with pytest.raises(ValueError, match="put, delete or get"):
        txn(compares, success, failure)


# ---- consistency: what the response promises is what apply_entries does -------------------------

KEYS = [b"a", b"b", b"c"]


def random_state(rng: random.Random) -> dict[bytes, KeyState]:
    state = {}
    for key in KEYS:
        if rng.random() < 0.6:
            version, created = rng.randint(1, 5), rng.randint(0, 20)
            state[key] = KeyState(bytes([rng.randint(97, 99)]), version, created + rng.randint(0, 20), created)
    return state


def random_compare(rng: random.Random) -> kv.Compare:
    target = rng.choice([V, M, VAL, EX])
    op = rng.choice([EQ, NE] if target in (VAL, EX) else [EQ, NE, GT, LT])
    operand = {V: lambda: rng.randint(0, 5), M: lambda: rng.randint(0, 40),
               VAL: lambda: bytes([rng.randint(97, 99)]), EX: lambda: rng.random() < 0.5}[target]()
    return cmp(target, op, operand, key=rng.choice(KEYS))


def random_ops(rng: random.Random) -> list[kv.TxnOp]:
    ops = []
    for _ in range(rng.randint(0, 6)):
        kind, key = rng.choice(["put", "delete", "get"]), rng.choice(KEYS)
        ops.append(put(key, bytes([rng.randint(97, 99)])) if kind == "put" else delete(key) if kind == "delete"
                   else get(key))
    return ops


@pytest.mark.parametrize("seed", range(300))
def test_apply_matches_promised_versions(seed: int) -> None:
    rng = random.Random(seed)
    state = random_state(rng)
    revision = rng.randint(41, 100)
    req = kv.TxnRequest(compares=[random_compare(rng) for _ in range(rng.randint(0, 3))], success=random_ops(rng),
                        failure=random_ops(rng), request_id=f"r{seed}")
    ev = evaluate_txn(req, state.get, SHARD, revision)
    ops = req.success if ev.response.succeeded else req.failure
    assert ev.response.succeeded == all(compare_holds(c, state.get(c.key)) for c in req.compares)
    writes = [(op, res) for op, res in zip(ops, ev.response.results, strict=True) if op.WhichOneof("op") != "get"]
    if not writes and not any(op.WhichOneof("op") != "get" for op in (*req.success, *req.failure)):
        assert ev.entry is None and ev.response.result.revision == 0
        return
    assert ev.entry is not None and ev.response.result.revision == revision
    applied = apply_entries(state.get, lambda _: False, [(revision, ev.entry.SerializeToString())])
    assert [r.response for r in applied.requests] == [ev.entry.response]
    assert len(applied.changes) == len(writes)
    current = dict(state)
    for (op, res), change in zip(writes, applied.changes, strict=True):
        kind = op.WhichOneof("op")
        key = getattr(op, kind).key
        assert change.key == key and change.revision == revision
        if kind == "put":
            assert change.type is ChangeType.PUT and change.state is not None
            assert change.state.version == res.put.version and change.state.value == op.put.value
            assert change.state.mod_revision == revision
            current[key] = change.state
        else:
            assert change.type is ChangeType.DELETE and res.delete.deleted == (key in current)
            current.pop(key, None)
    for op, res in zip(ops, ev.response.results, strict=True):
        if op.WhichOneof("op") == "get":  # gets see the state before the txn
            assert res == get_result(op.get.key, state.get(op.get.key))
    written = {getattr(op, op.WhichOneof("op")).key for op, _ in writes}
    assert applied.writes == {k: current.get(k) for k in written}
