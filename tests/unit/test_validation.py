"""`kvstore.core.validation`: request checks against `kvstore.limits`; pure."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from kvstore import limits
from kvstore.core.sharding import shard_of
from kvstore.core.validation import (
    check_delete,
    check_key,
    check_put,
    check_request_id,
    check_size,
    check_txn,
    check_value,
    check_write_batch,
    prefix_end,
    scan_bounds,
)
from kvstore.errors import InvalidRequestError
from kvstore.v1 import kv_pb2 as kv

C = kv.Compare
SHARDS = 4


def keys_in(shard: int, n: int = 3, shard_count: int = SHARDS) -> list[bytes]:
    """The first n keys k0, k1, ... that live in `shard`."""
    candidates = (f"k{i}".encode() for i in itertools.count())
    return list(itertools.islice((k for k in candidates if shard_of(k, shard_count) == shard), n))


# ---- single-field limits ------------------------------------------------------------------------

LIMITS: list[tuple[str, Callable[[Any], None], Callable[[int], Any], str]] = [
    ("key", check_key, lambda n: b"k" * n, "MAX_KEY_BYTES"),
    ("value", check_value, lambda n: b"v" * n, "MAX_VALUE_BYTES"),
    ("request_id", check_request_id, lambda n: "r" * n, "MAX_REQUEST_ID_BYTES"),
    ("size", check_size, lambda n: n, "MAX_REQUEST_BYTES"),
]


@pytest.mark.parametrize(
    ("check", "make", "name", "delta"),
    [pytest.param(check, make, name, delta, id=f"{what}-limit{delta:+d}")
     for what, check, make, name in LIMITS for delta in (-1, 0)],
)
def test_limit_accepted(check: Callable[[Any], None], make: Callable[[int], Any], name: str, delta: int) -> None:
    check(make(getattr(limits, name) + delta))


@pytest.mark.parametrize(
    ("check", "make", "name", "delta"),
    [pytest.param(check, make, name, delta, id=f"{what}-limit+{delta}")
     for what, check, make, name in LIMITS for delta in (1, 1000)],
)
def test_limit_refused(check: Callable[[Any], None], make: Callable[[int], Any], name: str, delta: int) -> None:
    limit = getattr(limits, name)
    with pytest.raises(InvalidRequestError, match=rf"has {limit + delta} bytes; limit {name} is {limit}$"):
        check(make(limit + delta))


@pytest.mark.parametrize(
    ("check", "arg"),
    [
        pytest.param(check_key, b"k", id="key-1-byte"),
        pytest.param(check_value, b"", id="value-empty"),
        pytest.param(check_request_id, "", id="request_id-empty"),
        pytest.param(check_request_id, "é" * (limits.MAX_REQUEST_ID_BYTES // 2), id="request_id-multibyte-at-limit"),
        pytest.param(check_size, 0, id="size-0"),
    ],
)
def test_small_accepted(check: Callable[[Any], None], arg: Any) -> None:
    check(arg)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(lambda: check_key(b""), "^key must not be empty$", id="key-empty"),
        pytest.param(lambda: check_key(b"", "compare key"), "^compare key must not be empty$", id="key-empty-named"),
        pytest.param(lambda: check_key(b"k" * 5000, "Txn key"), "^Txn key has 5000 bytes; limit MAX_KEY_BYTES",
                     id="key-too-long-named"),
        pytest.param(lambda: check_request_id("é" * (limits.MAX_REQUEST_ID_BYTES // 2) + "x"),
                     "has 129 bytes; limit MAX_REQUEST_ID_BYTES", id="request_id-counts-utf8-bytes"),
    ],
)
def test_small_refused(call: Callable[[], None], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        call()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(lambda: check_put(kv.PutRequest(key=b"k", value=b"v", request_id="r")), None, id="put-ok"),
        pytest.param(lambda: check_put(kv.PutRequest(value=b"v")), "key must not be empty", id="put-no-key"),
        pytest.param(lambda: check_put(kv.PutRequest(key=b"k", value=b"v" * (limits.MAX_VALUE_BYTES + 1))),
                     "MAX_VALUE_BYTES", id="put-long-value"),
        pytest.param(lambda: check_put(kv.PutRequest(key=b"k", request_id="r" * 129)), "MAX_REQUEST_ID_BYTES",
                     id="put-long-request-id"),
        pytest.param(lambda: check_delete(kv.DeleteRequest(key=b"k", request_id="r")), None, id="delete-ok"),
        pytest.param(lambda: check_delete(kv.DeleteRequest(key=b"k" * 4097)), "MAX_KEY_BYTES", id="delete-long-key"),
        pytest.param(lambda: check_delete(kv.DeleteRequest(key=b"k", request_id="r" * 129)), "MAX_REQUEST_ID_BYTES",
                     id="delete-long-request-id"),
    ],
)
def test_check_put_delete(call: Callable[[], None], match: str | None) -> None:
    if match is None:
        call()
    else:
        with pytest.raises(InvalidRequestError, match=match):
            call()


# ---- check_txn ----------------------------------------------------------------------------------

K0, K0b, K0c = keys_in(0)
K1 = keys_in(1, 1)[0]


def put(key: bytes, value: bytes = b"x") -> kv.TxnOp:
    return kv.TxnOp(put=kv.PutRequest(key=key, value=value))


def delete(key: bytes) -> kv.TxnOp:
    return kv.TxnOp(delete=kv.DeleteRequest(key=key))


def get(key: bytes) -> kv.TxnOp:
    return kv.TxnOp(get=kv.GetRequest(key=key))


def ver(key: bytes, op: int = C.OP_EQUAL) -> kv.Compare:
    return C(key=key, target=C.TARGET_VERSION, op=op, version=1)


def spread(n: int) -> kv.TxnRequest:
    """n compares+operations on one key, spread over compares, success and failure."""
    a, b = n // 3, n // 3
    return kv.TxnRequest(compares=[ver(K0)] * a, success=[put(K0)] * b, failure=[get(K0)] * (n - a - b))


@pytest.mark.parametrize(
    ("req", "match"),
    [
        pytest.param(kv.TxnRequest(), "at least one compare or operation", id="empty"),
        pytest.param(kv.TxnRequest(request_id="r"), "at least one compare or operation", id="empty-with-id"),
        pytest.param(spread(limits.MAX_TXN_OPS + 1), f"Txn has {limits.MAX_TXN_OPS + 1} compares\\+operations; "
                     f"limit MAX_TXN_OPS is {limits.MAX_TXN_OPS}", id="too-many-ops"),
        pytest.param(kv.TxnRequest(success=[put(K0)] * (limits.MAX_TXN_OPS + 1)), "MAX_TXN_OPS",
                     id="too-many-success-ops"),
        pytest.param(kv.TxnRequest(compares=[C(key=K0, op=C.OP_EQUAL)]), "needs a target and an op", id="no-target"),
        pytest.param(kv.TxnRequest(compares=[C(key=K0, target=C.TARGET_VERSION)]), "needs a target and an op",
                     id="no-op"),
        pytest.param(kv.TxnRequest(compares=[C(key=K0, target=C.TARGET_EXISTS, op=C.OP_GREATER)]),
                     "only == and !=", id="exists-greater"),
        pytest.param(kv.TxnRequest(compares=[C(key=K0, target=C.TARGET_EXISTS, op=C.OP_LESS)]),
                     "only == and !=", id="exists-less"),
        pytest.param(kv.TxnRequest(compares=[C(key=K0, target=C.TARGET_VALUE, op=C.OP_GREATER)]),
                     "only == and !=", id="value-greater"),
        pytest.param(kv.TxnRequest(compares=[C(key=K0, target=C.TARGET_VALUE, op=C.OP_LESS)]),
                     "only == and !=", id="value-less"),
        pytest.param(kv.TxnRequest(compares=[ver(b"")]), "compare key must not be empty", id="empty-compare-key"),
        pytest.param(kv.TxnRequest(success=[put(b"")]), "Txn key must not be empty", id="empty-put-key"),
        pytest.param(kv.TxnRequest(failure=[get(b"")]), "Txn key must not be empty", id="empty-get-key"),
        pytest.param(kv.TxnRequest(success=[delete(b"k" * (limits.MAX_KEY_BYTES + 1))]), "MAX_KEY_BYTES",
                     id="long-delete-key"),
        pytest.param(kv.TxnRequest(success=[put(K0, b"v" * (limits.MAX_VALUE_BYTES + 1))]), "MAX_VALUE_BYTES",
                     id="long-value"),
        pytest.param(kv.TxnRequest(success=[put(K0)], request_id="r" * (limits.MAX_REQUEST_ID_BYTES + 1)),
                     "MAX_REQUEST_ID_BYTES", id="long-request-id"),
        pytest.param(kv.TxnRequest(success=[kv.TxnOp()]), "must be a put, delete or get", id="op-without-kind"),
        pytest.param(kv.TxnRequest(success=[put(K0, b"v" * 600_000), put(K0, b"v" * 600_000)]),
                     "MAX_REQUEST_BYTES", id="request-too-big"),
    ],
)
def test_check_txn_refused(req: kv.TxnRequest, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        check_txn(req, SHARDS)


@pytest.mark.parametrize(
    ("req", "shard_count", "shard"),
    [
        # Cross-shard Txns (docs/design.md §10): their participants, ascending.
        pytest.param(kv.TxnRequest(compares=[ver(K1)], success=[put(K0)]), SHARDS, (0, 1),
                     id="compare-and-put-cross-shard"),
        pytest.param(kv.TxnRequest(success=[put(K0)], failure=[delete(K1)]), SHARDS, (0, 1),
                     id="success-and-failure-cross-shard"),
        pytest.param(kv.TxnRequest(success=[get(K0), get(K1)]), SHARDS, (0, 1), id="gets-cross-shard"),
        *(pytest.param(kv.TxnRequest(compares=[ver(a)], success=[put(b), get(a)], failure=[delete(c)]), SHARDS, s,
                       id=f"all-keys-in-shard-{s}") for s in range(SHARDS) for a, b, c in [keys_in(s)]),
        pytest.param(kv.TxnRequest(compares=[ver(K0)]), SHARDS, 0, id="compare-only"),
        pytest.param(kv.TxnRequest(failure=[get(K1)]), SHARDS, 1, id="failure-get-only"),
        pytest.param(kv.TxnRequest(compares=[ver(K0)], success=[put(K1)]), 1, 0, id="one-shard-cluster"),
        pytest.param(spread(limits.MAX_TXN_OPS), SHARDS, 0, id="exactly-max-ops"),
        pytest.param(kv.TxnRequest(compares=[ver(K0, C.OP_GREATER), ver(K0b, C.OP_LESS)], success=[put(K0c)]),
                     SHARDS, 0, id="version-greater-less"),
        pytest.param(kv.TxnRequest(compares=[C(key=K0, target=C.TARGET_MOD_REVISION, op=C.OP_GREATER)]), SHARDS, 0,
                     id="mod-revision-greater"),
        pytest.param(kv.TxnRequest(compares=[C(key=K0, target=C.TARGET_VALUE, op=C.OP_NOT_EQUAL, value=b"v"),
                                             C(key=K0, target=C.TARGET_EXISTS, op=C.OP_EQUAL, exists=True)]),
                     SHARDS, 0, id="value-ne-exists-eq"),
        pytest.param(kv.TxnRequest(success=[put(K0, b"v" * limits.MAX_VALUE_BYTES)],
                                   request_id="r" * limits.MAX_REQUEST_ID_BYTES), SHARDS, 0,
                     id="at-value-and-id-limits"),
    ],
)
def test_check_txn_accepted(req: kv.TxnRequest, shard_count: int, shard: int | tuple[int, ...]) -> None:
    assert check_txn(req, shard_count) == (shard if isinstance(shard, tuple) else (shard,))


# ---- scan_bounds / prefix_end -------------------------------------------------------------------

D, MAX = limits.DEFAULT_SCAN_LIMIT, limits.MAX_SCAN_LIMIT


@pytest.mark.parametrize(
    ("req", "expected"),
    [
        pytest.param(kv.ScanRequest(prefix=b"ab"), (b"ab", b"ac", D), id="prefix"),
        pytest.param(kv.ScanRequest(prefix=b"a\xff"), (b"a\xff", b"b", D), id="prefix-ending-ff"),
        pytest.param(kv.ScanRequest(prefix=b"\xff\xff"), (b"\xff\xff", None, D), id="prefix-all-ff-unbounded"),
        pytest.param(kv.ScanRequest(start=b"a", end=b"c"), (b"a", b"c", D), id="start-end"),
        pytest.param(kv.ScanRequest(start=b"a", end=b"a\x00"), (b"a", b"a\x00", D), id="smallest-range"),
        pytest.param(kv.ScanRequest(start=b"a"), (b"a", None, D), id="start-only"),
        pytest.param(kv.ScanRequest(end=b"c"), (b"", b"c", D), id="end-only"),
        pytest.param(kv.ScanRequest(), (b"", None, D), id="everything"),
        pytest.param(kv.ScanRequest(prefix=b"p", limit=1), (b"p", b"q", 1), id="limit-1"),
        pytest.param(kv.ScanRequest(limit=MAX), (b"", None, MAX), id="limit-max"),
        pytest.param(kv.ScanRequest(limit=0), (b"", None, D), id="limit-0-default"),
    ],
)
def test_scan_bounds(req: kv.ScanRequest, expected: tuple[bytes, bytes | None, int]) -> None:
    assert scan_bounds(req) == expected


@pytest.mark.parametrize(
    ("req", "match"),
    [
        pytest.param(kv.ScanRequest(prefix=b"p", start=b"a"), "either prefix or start/end", id="prefix-and-start"),
        pytest.param(kv.ScanRequest(prefix=b"p", end=b"z"), "either prefix or start/end", id="prefix-and-end"),
        pytest.param(kv.ScanRequest(limit=MAX + 1), f"scan limit {MAX + 1} exceeds MAX_SCAN_LIMIT {MAX}",
                     id="limit-max+1"),
        pytest.param(kv.ScanRequest(start=b"b", end=b"b"), "end must be greater than start", id="end-equals-start"),
        pytest.param(kv.ScanRequest(start=b"b", end=b"a"), "end must be greater than start", id="end-before-start"),
        pytest.param(kv.ScanRequest(start=b"ab", end=b"a"), "end must be greater than start", id="end-prefix-of-start"),
    ],
)
def test_scan_bounds_refused(req: kv.ScanRequest, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        scan_bounds(req)


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        pytest.param(b"a", b"b", id="a"),
        pytest.param(b"a\xff", b"b", id="a-ff"),
        pytest.param(b"\xff\xff", None, id="ff-ff"),
        pytest.param(b"ab", b"ac", id="ab"),
        pytest.param(b"\x00", b"\x01", id="00"),
        pytest.param(b"a\xfe", b"a\xff", id="a-fe"),
        pytest.param(b"a\xff\xff\xff", b"b", id="a-ff-ff-ff"),
        pytest.param(b"\xfe\xff", b"\xff", id="fe-ff"),
        pytest.param(b"", None, id="empty"),
    ],
)
def test_prefix_end(prefix: bytes, expected: bytes | None) -> None:
    assert prefix_end(prefix) == expected
    if expected is not None:  # every key with the prefix sorts below it, and the prefix itself is not past it
        assert prefix < expected and prefix + b"\xff" * 8 < expected


# --------------------------------------------------------------------------------------------
# WriteBatch: every part checked; one broken part refuses the whole call


def part(shard: int, keys: list[bytes], rid: str = "r", value: bytes = b"v", delete: bool = False) -> kv.ShardMutations:
    return kv.ShardMutations(shard=shard, request_id=rid,
                             mutations=[kv.Mutation(key=k, value=b"" if delete else value, delete=delete)
                                        for k in keys])


def batch(*parts: kv.ShardMutations) -> kv.WriteBatchRequest:
    return kv.WriteBatchRequest(shards=list(parts))


def test_write_batch_accepted() -> None:
    check_write_batch(batch(part(0, keys_in(0)), part(2, keys_in(2), delete=True)), SHARDS)
    many = list(itertools.islice((k for k in (f"m{i}".encode() for i in itertools.count())
                                  if shard_of(k, SHARDS) == 1), limits.MAX_BATCH_MUTATIONS))
    check_write_batch(batch(part(1, many, value=b"")), SHARDS)


@pytest.mark.parametrize(("request_", "match"), [
    (batch(), "at least one part"),
    (batch(part(4, keys_in(0))), "shard 4 does not exist; the cluster has 4 shards"),
    (batch(part(0, keys_in(0)), part(0, keys_in(0))), "shard 0 has two parts"),
    (batch(part(0, [])), "no mutations"),
    (batch(part(0, keys_in(1))), r"belongs to shard 1, not to shard 0"),
    (batch(part(0, [b""])), "mutation key must not be empty"),
    (batch(part(0, keys_in(0), rid="x" * (limits.MAX_REQUEST_ID_BYTES + 1))), "MAX_REQUEST_ID_BYTES"),
    (batch(part(0, [b"k" * (limits.MAX_KEY_BYTES + 1)])), "MAX_KEY_BYTES"),
    (batch(part(0, keys_in(0, 1), value=b"x" * (limits.MAX_VALUE_BYTES + 1))), "MAX_VALUE_BYTES"),
    (batch(part(0, keys_in(0, 1), value=b"x" * 600_000), part(1, keys_in(1, 1), value=b"x" * 600_000)),
     "MAX_REQUEST_BYTES"),
    (batch(kv.ShardMutations(shard=0, mutations=[kv.Mutation(key=keys_in(0, 1)[0], value=b"v", delete=True)])),
     "a delete carries no value"),
])
def test_write_batch_refused(request_: kv.WriteBatchRequest, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        check_write_batch(request_, SHARDS)


def test_write_batch_part_over_the_mutation_limit_is_refused_naming_it() -> None:
    keys = list(itertools.islice((k for k in (f"m{i}".encode() for i in itertools.count())
                                  if shard_of(k, SHARDS) == 3), limits.MAX_BATCH_MUTATIONS + 1))
    with pytest.raises(InvalidRequestError, match="MAX_BATCH_MUTATIONS"):
        check_write_batch(batch(part(3, keys, value=b"")), SHARDS)


def test_the_stores_transaction_ids_are_reserved() -> None:
    with pytest.raises(InvalidRequestError, match="reserved"):
        check_request_id("kvstore.txn/d/abc")
    check_request_id("kvstore.txn")  # only the prefix with its slash
