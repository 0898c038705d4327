"""`kvstore.cli`: txn syntax, argument parsing, output formats and exit codes against a fake
client (no server), and a few commands end to end against the loopback fake of test_client."""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore import cli, limits
from kvstore.cli import TxnSyntaxError, client_commands, main, parse_compare, parse_op, parse_txn, serve_argv
from kvstore.client import (
    Client,
    Compare,
    DeleteResult,
    FenceResult,
    GetResult,
    InvalidArgument,
    KeyValue,
    MoveProgress,
    NodeInfo,
    Op,
    PlacementChange,
    PlacementLog,
    PlacementLogEntry,
    PreparedTxn,
    PutResult,
    ReadHeader,
    ReplicaInfo,
    RequestExpired,
    ScanPage,
    ShardInfo,
    ShardMap,
    ShardMove,
    TransactionInfo,
    TxnResolution,
    TxnResult,
    Unavailable,
    UnknownOutcome,
    Unreachable,
    WatchEvent,
)
from tests.unit.test_client import Failure, FakeCluster, key_on

# ============================================================================================
# Txn syntax

COMPARES = [
    ("version(k)=0", Compare(b"k", "version", "==", 0)),
    ("version(k) == 0", Compare(b"k", "version", "==", 0)),
    ("  version ( k ) != 3 ", Compare(b"k", "version", "!=", 3)),
    ("VERSION(k)>2", Compare(b"k", "version", ">", 2)),
    ("mod(k) > 12", Compare(b"k", "mod_revision", ">", 12)),
    ("mod_revision(k)<3", Compare(b"k", "mod_revision", "<", 3)),
    ("value(k)=x", Compare(b"k", "value", "==", b"x")),
    ("value(k) = hello world ", Compare(b"k", "value", "==", b"hello world")),
    ('value(k) != "a b "', Compare(b"k", "value", "!=", b"a b ")),
    ("value('a)b') = ''", Compare(b"a)b", "value", "==", b"")),
    (r'value("say \"hi\"")="x=y"', Compare(b'say "hi"', "value", "==", b"x=y")),
    ("value(k) < m", Compare(b"k", "value", "<", b"m")),
    ("value(ключ)=значение", Compare("ключ".encode(), "value", "==", "значение".encode())),
    ("exists(k)", Compare(b"k", "exists", "==", True)),
    ("!exists(k)", Compare(b"k", "exists", "==", False)),
    ("! exists(k)", Compare(b"k", "exists", "==", False)),
    ("exists(k)=false", Compare(b"k", "exists", "==", False)),
    ("exists(k) != true", Compare(b"k", "exists", "==", False)),
    ("exists(k) == 1", Compare(b"k", "exists", "==", True)),
    ("!exists(k) = false", Compare(b"k", "exists", "==", True)),
]


@pytest.mark.parametrize(("text", "expected"), COMPARES, ids=[c[0] for c in COMPARES])
def test_parse_compare(text: str, expected: Compare) -> None:
    assert parse_compare(text) == expected


BAD_COMPARES = [
    ("version(k)>=1", "operator"),
    ("version(k)=<1", "integer"),
    ("version(k)=x", "integer"),
    ("foo(k)=1", "unknown target"),
    ("version k = 0", "expected TARGET"),
    ("version(k)", "missing operator"),
    ("version()=0", "empty key"),
    ("version(k=0", "missing ')'"),
    ("value(k)=", "missing value"),
    ('value("k)=x', "unterminated quote"),
    ('value("k"x)=x', "expected ')'"),
    ("!version(k)=0", "only applies to exists"),
    ("exists(k)=maybe", "true or false"),
    ("exists(k) > true", "true or false"),
    ('value(k) = "a" b', "after the quoted value"),
]


@pytest.mark.parametrize(("text", "message"), BAD_COMPARES, ids=[c[0] for c in BAD_COMPARES])
def test_parse_compare_errors(text: str, message: str) -> None:
    with pytest.raises(TxnSyntaxError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        parse_compare(text)
    assert isinstance(info.value, InvalidArgument) and text in str(info.value)


OPS = [
    ("put k v", Op.put("k", "v")),
    ("PUT k v", Op.put("k", "v")),
    ('put "a b" "c d"', Op.put("a b", "c d")),
    ("put k ''", Op.put("k", "")),
    ("del k", Op.delete("k")),
    ("delete k", Op.delete("k")),
    ("get k", Op.get("k")),
    ("get #notacomment", Op.get("#notacomment")),
]


@pytest.mark.parametrize(("text", "expected"), OPS, ids=[o[0] for o in OPS])
def test_parse_op(text: str, expected: Op) -> None:
    assert parse_op(text) == expected


@pytest.mark.parametrize("text", ["", "put k", "put k v w", "get", "del a b", "frob k", 'put "k v'])
def test_parse_op_errors(text: str) -> None:
    with pytest.raises(TxnSyntaxError):
        parse_op(text)


def test_parse_txn() -> None:
    compares, success, failure = parse_txn(["version(k)=0"], ["put k v"], ["get k"])
    assert compares == [Compare.version("k", "==", 0)] and success == [Op.put("k", "v")] and failure == [Op.get("k")]
    with pytest.raises(TxnSyntaxError, match="at least one"):
        parse_txn([], [], [])


# ============================================================================================
# Arguments


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["serve"], []),
        (["serve", "--listen", "0.0.0.0:1", "--shards", "4"], ["--listen", "0.0.0.0:1", "--shards", "4"]),
        (["--endpoints", "x:1", "serve", "-h"], ["-h"]),
        (["--output=json", "-o", "table", "--timeout", "3", "serve", "a"], ["a"]),
        (["get", "serve"], None),
        (["put", "serve", "x"], None),
        ([], None),
        (["--help"], None),
    ],
)
def test_serve_argv(argv: list[str], expected: list[str] | None) -> None:
    assert serve_argv(argv) == expected


def test_common_options_before_or_after_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.ENDPOINTS_ENV, raising=False)
    parser = cli.build_parser()
    args = parser.parse_args(["get", "k"])
    assert (args.endpoints, args.timeout, args.output) == ("127.0.0.1:50051", 5.0, "table")
    args = parser.parse_args(["--endpoints", "a:1", "-o", "json", "get", "k"])
    assert (args.endpoints, args.output) == ("a:1", "json")
    args = parser.parse_args(["get", "k", "--endpoints", "b:2", "--timeout", "0.5", "--output", "json"])
    assert (args.endpoints, args.timeout, args.output) == ("b:2", 0.5, "json")
    args = parser.parse_args(["--endpoints", "a:1", "get", "--output", "json", "k"])
    assert (args.endpoints, args.output) == ("a:1", "json")  # the subcommand does not reset it


def test_endpoints_default_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.ENDPOINTS_ENV, "n1:1,n2:2")
    assert cli.build_parser().parse_args(["shards"]).endpoints == "n1:1,n2:2"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frob"],
        ["get"],
        ["get", "k", "--consistency", "eventual"],
        ["get", "k", "--min-revision", "-1"],
        ["--timeout", "0", "get", "k"],
        ["--timeout", "abc", "get", "k"],
        ["scan", "--limit", "x"],
        ["--output", "yaml", "shards"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["txn", "--help"]) == 0
    assert "version(KEY)" in capsys.readouterr().out


# ============================================================================================
# Commands against a fake client


class FakeWatch:
    def __init__(self, events: list[WatchEvent], then: BaseException | None) -> None:
        self.events, self.then, self.cancelled = events, then, False

    def __iter__(self) -> Iterator[WatchEvent]:
        yield from self.events
        if self.then is not None:
            raise self.then

    def cancel(self) -> None:
        self.cancelled = True


class FakeClient:
    """Records calls; answers with canned results or raises `error`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.error: Exception | None = None
        self.closed = False
        self.get_result = GetResult(b"k", True, KeyValue(b"k", b"v", 2, 11, 7), ReadHeader(0, 12, "n1:1"))
        self.pages: list[ScanPage] = []
        self.watch_obj = FakeWatch([], KeyboardInterrupt())
        self.endpoints: list[str] = []
        self.timeout = 0.0

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True

    def _record(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, args, kwargs))
        if self.error is not None:
            raise self.error

    def get(self, key: str, consistency: str = "linearizable", min_revision: int = 0) -> GetResult:
        self._record("get", key, consistency, min_revision)
        return self.get_result

    def put(self, key: str, value: str, request_id: str | None = None, *,
            first_attempt_unix_ms: int | None = None) -> PutResult:
        self._record("put", key, value, request_id, first_attempt_unix_ms=first_attempt_unix_ms)
        return PutResult(key.encode(), 1, 42, 3, False, request_id or "generated")

    def delete(self, key: str, request_id: str | None = None, *,
               first_attempt_unix_ms: int | None = None) -> DeleteResult:
        self._record("delete", key, request_id, first_attempt_unix_ms=first_attempt_unix_ms)
        return DeleteResult(key.encode(), 1, 43, True, False, request_id or "generated")

    def txn(self, compares: list[Compare], success: list[Op], failure: list[Op], request_id: str | None, *,
            first_attempt_unix_ms: int | None = None) -> TxnResult:
        self._record("txn", compares, success, failure, request_id, first_attempt_unix_ms=first_attempt_unix_ms)
        results = (PutResult(b"k", 0, 44, 1, False, "t"), DeleteResult(b"d", 0, 44, False, False, "t"),
                   GetResult(b"g", False, None, None))
        return TxnResult(True, 0, 44, False, results, request_id or "t")

    def scan_all(self, start: str, end: str, prefix: str, limit: int, consistency: str,
                 *, keys_only: bool, min_revisions: dict[int, int] | None = None) -> Iterator[KeyValue]:
        self._record("scan_all", start, end, prefix, limit, consistency, keys_only=keys_only,
                     min_revisions=min_revisions)
        for page in self.pages:
            yield from page.kvs

    def watch(self, key: str, prefix: str, start_revision: int,
              start_revisions: dict[int, int] | None = None) -> FakeWatch:
        self._record("watch", key, prefix, start_revision, start_revisions)
        return self.watch_obj

    def shard_map(self) -> ShardMap:
        self._record("shard_map")
        copies = (ReplicaInfo("n2", "n2:1", "learner", 5, 7), ReplicaInfo("n1", "n1:1", "replica", 10, 0))
        return ShardMap(2, "wal", "n1:1", (ShardInfo(0, "n1:1", 3, 10, 12, 2, 0, "n1", True, copies, ("n1", "n2")),
                                           ShardInfo(1, "n2:1", 0, 5, 5, 0, 0, "n2", False)),
                        (NodeInfo("n1", "n1:1", (0,), True), NodeInfo("n2", "n2:1", (), False)))

    def list_transactions(self, older_than_ms: int = 0) -> list[TransactionInfo]:
        self._record("list_transactions", older_than_ms)
        return [TransactionInfo(1, 7, 9, 65_000, "n2")]

    def prepared_transactions(self, older_than_ms: int = 0) -> tuple[list[PreparedTxn], list[str]]:
        self._record("prepared_transactions", older_than_ms)
        return [PreparedTxn("t1", 2, 0, (0, 2), 6_000, 41, "r-9", 3, "n1")], ["10.0.0.9:50051"]

    def resolve_transaction(self, txn_id: str) -> TxnResolution:
        self._record("resolve_transaction", txn_id)
        return TxnResolution(txn_id, "aborted" if txn_id == "t1" else "in doubt",
                             "" if txn_id == "t1" else "the coordinator did not answer", (0, 2))

    def fence(self, shard: int) -> FenceResult:
        self._record("fence", shard)
        return FenceResult(shard, 12, "n1")

    def placement_log(self, limit: int = 50) -> PlacementLog:
        self._record("placement_log", limit)
        return PlacementLog((PlacementLogEntry(7, 3, "drain", "n2 drained", "an operator drained it", 0),
                             PlacementLogEntry(8, 3, "step", "shard 1: add-learner on n3", "placed there by the rule",
                                               1795000000000)), 3, "n1", 2, {"undecodable": 1})

    def drain(self, node_id: str, *, undo: bool = False, force: bool = False,
              epoch: int | None = None) -> list[PlacementChange]:
        self._record("drain", node_id, undo=undo)
        return [] if undo else [PlacementChange(1, ("n2", "n1"), ("n3", "n1"))]

    def move_shard(self, shard: int, to_node: str = "", from_node: str = "", *,
                   unpin: bool = False, epoch: int | None = None) -> list[PlacementChange]:
        self._record("move_shard", shard, to_node, from_node, unpin=unpin)
        return [PlacementChange(shard, ("n1", "n2"), ("n1", to_node))]

    def wait_moves(self, changes: list[PlacementChange], *, timeout_s: float,
                   on_progress: Any = None) -> MoveProgress:
        self._record("wait_moves", changes, timeout_s=timeout_s)
        steps = [MoveProgress((ShardMove(c.shard, c.after, (c.after[1],), ((c.after[0], 40),), (c.before[0],)),))
                 for c in changes]
        steps.append(MoveProgress(tuple(ShardMove(c.shard, c.after, c.after, (), ()) for c in changes)))
        for step in steps if timeout_s > 1 else steps[:1]:
            on_progress(step)
        return steps[-1] if timeout_s > 1 else steps[0]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    client = FakeClient()

    def make(endpoints: list[str], timeout_s: float, security: object = None) -> FakeClient:
        client.endpoints, client.timeout = list(endpoints), timeout_s
        return client

    monkeypatch.setattr(client_commands, "make_client", make)
    return client


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines()]


def test_get_table(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["get", "k", "--endpoints", "a:1, b:2", "--timeout", "2"], capsys)
    assert rc == 0 and err == ""
    assert out.splitlines() == [
        "KEY  VALUE  VERSION  MOD_REVISION  CREATE_REVISION",
        "k    v      2        11            7",
    ]
    assert fake.endpoints == ["a:1", "b:2"] and fake.timeout == 2.0 and fake.closed
    assert fake.calls == [("get", ("k", "linearizable", None), {})]


def test_get_options_are_passed(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    run(["get", "k", "--consistency", "stale", "--min-revision", "9"], capsys)
    assert fake.calls == [("get", ("k", "stale", 9), {})]


def test_get_json(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["get", "k", "-o", "json"], capsys)
    assert rc == 0
    assert json_lines(out) == [{"key": "k", "found": True, "value": "v", "version": 2, "mod_revision": 11,
                                "create_revision": 7, "shard": 0, "applied_revision": 12, "served_by": "n1:1"}]


def test_get_not_found(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    fake.get_result = GetResult(b"k", False, None, ReadHeader(0, 12, "n1:1"))
    assert run(["get", "k"], capsys)[:2] == (0, "(not found)\n")
    rc, out, _ = run(["get", "k", "--output", "json"], capsys)
    assert rc == 0 and json_lines(out)[0]["found"] is False and "value" not in json_lines(out)[0]


def test_binary_values_are_base64_in_json_and_escaped_in_tables(
    fake: FakeClient, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.get_result = GetResult(b"k\xff", True, KeyValue(b"k\xff", b"\x00\x01\xfe", 1, 1, 1), None)
    record = json_lines(run(["get", "x", "-o", "json"], capsys)[1])[0]
    assert record["key_base64"] is True and base64.b64decode(record["key"]) == b"k\xff"
    assert record["value_base64"] is True and base64.b64decode(record["value"]) == b"\x00\x01\xfe"
    out = run(["get", "x"], capsys)[1]
    assert "k\\xff" in out and "\\x00\\x01\\xfe" in out and "\x00" not in out
    assert cli.display("a\nb\u200b".encode()) == "a\\nb\\u200b" and cli.display("ok ключ".encode()) == "ok ключ"


def test_utf8_values_are_text_in_json(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    fake.get_result = GetResult("ключ".encode(), True, KeyValue("ключ".encode(), "значение".encode(), 1, 1, 1), None)
    record = json_lines(run(["get", "ключ", "-o", "json"], capsys)[1])[0]
    assert record["key"] == "ключ" and record["value"] == "значение" and "value_base64" not in record


def test_put_and_del(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["put", "k", "v", "--request-id", "r1"], capsys)
    assert rc == 0 and out.splitlines()[1].split() == ["k", "1", "42", "3", "false"]
    assert fake.calls[-1] == ("put", ("k", "v", "r1"), {"first_attempt_unix_ms": None})
    rc, out, _ = run(["-o", "json", "del", "k"], capsys)
    assert rc == 0 and json_lines(out) == [{"key": "k", "shard": 1, "revision": 43, "deleted": True,
                                            "replayed": False, "request_id": "generated"}]
    assert fake.calls[-1] == ("delete", ("k", None), {"first_attempt_unix_ms": None})


def test_writes_pass_the_first_attempt_time_of_a_retry(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    """Finishing a write whose outcome was unknown: the id and first-attempt time it printed."""
    ms = ["--request-id", "r1", "--first-attempt-unix-ms", "1700000000123"]
    assert run(["put", "k", "v", *ms], capsys)[0] == 0
    assert fake.calls[-1] == ("put", ("k", "v", "r1"), {"first_attempt_unix_ms": 1_700_000_000_123})
    assert run(["del", "k", *ms], capsys)[0] == 0
    assert fake.calls[-1] == ("delete", ("k", "r1"), {"first_attempt_unix_ms": 1_700_000_000_123})
    assert run(["txn", "--then", "put k v", *ms], capsys)[0] == 0
    assert fake.calls[-1][1][3] == "r1" and fake.calls[-1][2] == {"first_attempt_unix_ms": 1_700_000_000_123}


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_bad_first_attempt_time_is_a_usage_error(
    value: str, fake: FakeClient, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["put", "k", "v", "--request-id", "r1", "--first-attempt-unix-ms", value], capsys)[0] == 2
    assert fake.calls == []


def test_first_attempt_time_needs_a_request_id(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["del", "k", "--first-attempt-unix-ms", "1700000000123"], capsys)
    assert (rc, out, fake.calls) == (2, "", []) and "give its --request-id too" in err


def test_txn_passes_parsed_arguments_and_prints(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["txn", "--if", "version(k)=0", "--if", "value(j) != x", "--then", "put k v",
                      "--then", "del d", "--else", "get g"], capsys)
    assert rc == 0
    (name, (compares, success, failure, rid), _), = fake.calls
    assert name == "txn" and rid is None
    assert compares == [Compare.version("k", "==", 0), Compare.value("j", "!=", "x")]
    assert success == [Op.put("k", "v"), Op.delete("d")] and failure == [Op.get("g")]
    lines = out.splitlines()
    assert lines[0].startswith("succeeded: true (ran --then)")
    assert [line.split()[:2] for line in lines[1:]] == [["OP", "KEY"], ["put", "k"], ["del", "d"], ["get", "g"]]
    record = json_lines(run(["txn", "--then", "put k v", "-o", "json"], capsys)[1])[0]
    assert record["succeeded"] is True and [r["op"] for r in record["results"]] == ["put", "delete", "get"]


def test_txn_syntax_error_exits_2_without_connecting(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["txn", "--if", "version(k)>=1", "--then", "put k v"], capsys)
    assert rc == 2 and out == "" and fake.calls == []
    assert err.startswith("kvstore: invalid argument: bad condition") and err.count("\n") == 1


def test_scan_limits_total_keys_and_pages(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    kvs = tuple(KeyValue(f"p{i}".encode(), b"x" * i, 1, i, i) for i in range(5))
    fake.pages = [ScanPage(kvs[:2], b"t", ()), ScanPage(kvs[2:], b"", ())]
    rc, out, _ = run(["scan", "--prefix", "p", "--limit", "3"], capsys)
    assert rc == 0
    assert out.splitlines() == ["KEY  VALUE  VERSION  MOD_REVISION", "p0          1        0",
                                "p1   x      1        1", "p2   xx     1        2"]
    assert fake.calls[-1] == ("scan_all", ("", "", "p", 3, "linearizable"), {"keys_only": False, "min_revisions": {}})
    rc, out, _ = run(["scan", "--start", "a", "--end", "z", "--keys-only", "-o", "json"], capsys)
    assert json_lines(out) == [{"key": f"p{i}"} for i in range(5)]
    assert fake.calls[-1] == ("scan_all", ("a", "z", "", 0, "linearizable"), {"keys_only": True, "min_revisions": {}})


def test_scan_min_revisions_name_their_shard(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, _ = run(["scan", "--prefix", "p", "--consistency", "stale", "--min-revision", "0:7",
                    "--min-revision", "2:40", "--min-revision", "0:9"], capsys)
    assert rc == 0
    assert fake.calls[-1] == ("scan_all", ("", "", "p", 0, "stale"), {"keys_only": False,
                                                                      "min_revisions": {0: 9, 2: 40}})


def test_scan_refuses_a_revision_without_its_shard(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(["scan", "--min-revision", "7"], capsys)
    assert rc == 2 and fake.calls == []
    assert "names its shard: SHARD:REV" in err and "Traceback" not in err


@pytest.mark.parametrize(("text", "pair"), [("0:7", (0, 7)), ("3:0", (3, 0)), (" 1 : 2 ", (1, 2))])
def test_parse_shard_revision(text: str, pair: tuple[int, int]) -> None:
    assert cli.parse_shard_revision(text) == pair


@pytest.mark.parametrize("text", ["7", "a:1", "1:b", "-1:3", "1:-3", "1:2:3"])
def test_parse_shard_revision_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_shard_revision(text)


def test_min_revisions_keeps_the_highest_per_shard() -> None:
    assert cli.min_revisions([(1, 5), (0, 3), (1, 2)]) == {0: 3, 1: 5}
    assert cli.min_revisions([]) == {}


def test_scan_large_limit_uses_server_max_page(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    run(["scan", "--limit", "5000"], capsys)
    assert fake.calls[-1][1][3] == 1000


def test_scan_prefix_and_range_conflict(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(["scan", "--prefix", "p", "--start", "a"], capsys)
    assert rc == 2 and "either --prefix or --start/--end" in err and fake.calls == []


def test_watch_prints_events_and_ctrl_c_exits_0(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    events = [WatchEvent("put", KeyValue(b"w", b"1", 1, 5, 5), 1),
              WatchEvent("delete", KeyValue(b"w", b"", 0, 6, 0), 1)]
    fake.watch_obj = FakeWatch(events, KeyboardInterrupt())
    rc, out, err = run(["watch", "--prefix", "w", "--from", "3", "-o", "json"], capsys)
    assert rc == 0 and err == "" and fake.watch_obj.cancelled
    assert fake.calls == [("watch", ("", "w", 3, None), {})]
    assert [(r["type"], r["key"], r["mod_revision"]) for r in json_lines(out)] == [("put", "w", 5), ("delete", "w", 6)]
    fake.watch_obj = FakeWatch(events, KeyboardInterrupt())
    rc, out, _ = run(["watch", "w"], capsys)
    lines = out.splitlines()
    assert rc == 0 and lines[0].split() == ["TYPE", "MOD_REVISION", "SHARD", "KEY", "VALUE"]
    assert lines[1].split() == ["PUT", "5", "1", "w", "1"] and lines[2].split() == ["DELETE", "6", "1", "w"]


def test_watch_error_after_events_exits_1(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    fake.watch_obj = FakeWatch([], Unavailable("node went away"))
    rc, _, err = run(["watch", "w"], capsys)
    assert rc == 1 and err == "kvstore: unavailable: node went away\n" and fake.watch_obj.cancelled


@pytest.mark.parametrize("argv", [["watch"], ["watch", "k", "--prefix", "p"]])
def test_watch_needs_key_or_prefix(argv: list[str], fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(argv, capsys)[0] == 2


def test_shards(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["shards"], capsys)
    lines = out.splitlines()
    assert rc == 0 and lines[0] == "topic: wal  shards: 2  served by: n1:1  placement epoch: 0  controller: -"
    assert lines[1].split() == ["SHARD", "LEADER", "NODE", "TERM", "APPLIED", "END", "LAG", "OPEN_TXN_MS",
                                "TARGET", "REPLICAS"]
    assert lines[2].split() == ["0", "n1:1", "n1", "3", "10", "12", "2", "0", "n1,n2", "n1:replica-", "n2:learner(lag",
                                "7)"]
    assert lines[3].split() == ["1", "n2:1", "n2", "(taking", "over)", "0", "5", "5", "0", "0", "-", "-"]
    assert lines[5].split() == ["NODE", "ADDRESS", "ZONE", "LEADS", "ROLE", "VERSION"]  # no pid: the API carries none
    assert lines[6].split() == ["n1", "n1:1", "-", "0", "leader-capable", "-"]
    assert lines[7].split() == ["n2", "n2:1", "-", "-", "read", "replica", "-"]
    (record,) = json_lines(run(["shards", "-o", "json"], capsys)[1])
    assert record["shard_count"] == 2 and record["shards"][0]["leader"] == "n1:1"
    assert record["shards"][1]["leader_ready"] is False
    assert record["shards"][0]["replicas"][0] == {"node_id": "n2", "address": "n2:1", "state": "learner",
                                                  "applied_offset": 5, "lag": 7, "caught_up": False,
                                                  "in_group": False}
    assert record["shards"][0]["placed_on"] == ["n1", "n2"]
    assert record["nodes"][1] == {"node_id": "n2", "address": "n2:1", "leads": [], "can_lead": False, "zone": "",
                                 "version": ""}


@pytest.mark.parametrize(("text", "ms"), [("500ms", 500), ("30s", 30_000), ("2m", 120_000), ("1h", 3_600_000),
                                          ("1.5", 1500), ("0", 0)])
def test_durations(text: str, ms: int) -> None:
    assert cli.parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "abc", "-1s", "5x"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_duration_ms(text)


def test_txn_list_and_fence(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["txn", "list", "--older-than", "1m"], capsys)
    assert rc == 0 and fake.calls[-1] == ("list_transactions", (60_000,), {})
    assert out.splitlines()[1].split() == ["1", "7", "9", "65000", "n2"]
    (record,) = json_lines(run(["txn", "list", "-o", "json"], capsys)[1])
    assert record == {"shard": 1, "first_offset": 7, "end_offset": 9, "age_ms": 65_000, "leader_id": "n2"}
    assert run(["txn", "list", "--then", "put a b"], capsys)[0] == 2
    rc, out, _ = run(["fence", "3"], capsys)
    assert rc == 0 and fake.calls[-1] == ("fence", (3,), {})
    assert out == "shard 3 fenced at offset 12; leader n1 told to check\n"
    assert run(["fence", "-1"], capsys)[0] == 2


def test_txn_list_in_doubt_and_resolve(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["txn", "list", "--in-doubt", "--older-than", "5s"], capsys)
    lines = out.splitlines()
    assert rc == 0 and fake.calls[-1] == ("prepared_transactions", (5_000,), {})
    assert lines[0].split()[:4] == ["TXN", "SHARD", "COORDINATOR", "PARTICIPANTS"]
    assert lines[1].split() == ["t1", "2", "0", "0,2", "6000", "3", "r-9", "n1"]
    assert "10.0.0.9:50051 did not answer" in lines[2]
    (record,) = json_lines(run(["txn", "list", "--in-doubt", "-o", "json"], capsys)[1])
    assert record["transactions"][0]["participants"] == [0, 2] and record["unreachable"] == ["10.0.0.9:50051"]
    rc, out, _ = run(["txn", "resolve", "t1"], capsys)
    assert rc == 0 and out == "transaction t1: aborted at shard(s) 0,2\n"
    rc, out, _ = run(["txn", "resolve", "t2"], capsys)
    assert rc == 1 and "in doubt" in out and "did not answer" in out
    assert run(["txn", "resolve"], capsys)[0] == 2
    assert run(["txn", "resolve", "t1", "--then", "put a b"], capsys)[0] == 2
    assert run(["txn", "--in-doubt", "--then", "put a b"], capsys)[0] == 2


def test_drain_prints_the_moves_and_follows_them_until_done(fake: FakeClient,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["drain", "n2"], capsys)
    lines = out.splitlines()
    assert rc == 0 and fake.calls[0] == ("drain", ("n2",), {"undo": False})
    assert lines[0].split() == ["SHARD", "FROM", "TO"] and lines[1].split() == ["1", "n2,n1", "n3,n1"]
    assert lines[2] == "1 of 1 shard moves left: shard 1 -> n3,n1: n3 learning (lag 40); n2 still holds a copy"
    assert lines[3] == "done: 1 shard moves"
    rc, out, _ = run(["drain", "n2", "--undo"], capsys)
    assert rc == 0 and out == "no shard moves\n" and fake.calls[-1] == ("drain", ("n2",), {"undo": True})
    (planned, step, done) = json_lines(run(["drain", "n2", "-o", "json"], capsys)[1])
    assert planned == {"changes": [{"shard": 1, "before": ["n2", "n1"], "after": ["n3", "n1"]}]}
    assert step["left"] == 1 and step["shards"][0]["learners"] == [{"node_id": "n3", "lag": 40}]
    assert done == {"done": True, "left": 0, "total": 1, "shards": []}


def test_move_waits_and_says_when_it_gave_up(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["move", "3", "--to", "n4", "--from", "n2", "--wait-timeout", "0.5"], capsys)
    assert rc == 1 and fake.calls[0] == ("move_shard", (3, "n4", "n2"), {"unpin": False})
    assert "not done after 0 s (1 of 1 shard moves left)" in err
    rc, out, _ = run(["move", "3", "--to", "n4", "--no-wait"], capsys)
    assert rc == 0 and fake.calls[-1][0] == "move_shard" and len(out.splitlines()) == 2


@pytest.mark.parametrize(
    ("error", "rc", "stderr"),
    [
        (Unavailable("failed to connect to all addresses", attempts=6), 1,
         "kvstore: unavailable: failed to connect to all addresses (after 6 attempts)\n"),
        (InvalidArgument("key is 5000 bytes;\nlimit MAX_KEY_BYTES is 4096"), 2,
         "kvstore: invalid argument: key is 5000 bytes; limit MAX_KEY_BYTES is 4096\n"),
        (Unreachable("no node reached, nothing was sent: failed to connect to all addresses", attempts=6), 4,
         "kvstore: unreachable, nothing was sent: no node reached, nothing was sent: failed to connect to all "
         "addresses (after 6 attempts)\n"),
        (UnknownOutcome("commit outcome unknown", request_id="abc"), 3,
         "kvstore: outcome unknown (retry with --request-id abc): commit outcome unknown\n"),
        (UnknownOutcome("Socket closed", request_id="abc", first_attempt_unix_ms=1_700_000_000_123, attempts=6), 3,
         "kvstore: outcome unknown (retry with --request-id abc --first-attempt-unix-ms 1700000000123): "
         "Socket closed (after 6 attempts)\n"),
        (RequestExpired("request id abc expired: ...; whether the original attempt committed is unknown",
                        request_id="abc", first_attempt_unix_ms=1_600_000_000_000), 3,
         "kvstore: request id expired, outcome unknown (check the data before writing again): request id abc "
         "expired: ...; whether the original attempt committed is unknown\n"),
    ],
)
def test_errors_are_one_line_on_stderr(
    error: Exception, rc: int, stderr: str, fake: FakeClient, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.error = error
    assert run(["put", "k", "v"], capsys) == (rc, "", stderr)


def test_ctrl_c_outside_watch_exits_130(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    fake.error = KeyboardInterrupt()
    assert run(["get", "k"], capsys) == (130, "", "kvstore: interrupted\n")


def test_serve_calls_the_server_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 3

    monkeypatch.setitem(sys.modules, "kvstore.server.main", types.SimpleNamespace(main=fake_main))
    assert main(["--endpoints", "x:1", "serve", "--listen", "127.0.0.1:0", "--help"]) == 3
    assert seen == [["--listen", "127.0.0.1:0", "--help"]]

    def exits(argv: list[str]) -> int:
        raise SystemExit(2)

    monkeypatch.setitem(sys.modules, "kvstore.server.main", types.SimpleNamespace(main=exits))
    assert main(["serve", "--bogus"]) == 2


# ============================================================================================
# End to end against the loopback fake cluster


@pytest.fixture
def fake_cluster() -> Iterator[FakeCluster]:
    fc = FakeCluster(nodes=2, shard_count=2)
    try:
        yield fc
    finally:
        fc.stop()


def test_cli_against_fake_cluster(fake_cluster: FakeCluster, capsys: pytest.CaptureFixture[str]) -> None:
    endpoints = ["--endpoints", fake_cluster.addresses[1]]
    k0 = key_on(0, 2).decode()
    rc, out, err = run(["put", k0, "hello", "-o", "json", *endpoints], capsys)
    assert (rc, err) == (0, "")
    put = json_lines(out)[0]
    assert put["version"] == 1 and fake_cluster.calls_to("Put")[0].node == fake_cluster.leaders[0]
    rc, out, _ = run(["get", k0, "-o", "json", *endpoints], capsys)
    assert json_lines(out)[0]["value"] == "hello"
    rc, out, _ = run(["txn", "--if", f"version({k0})=1", "--then", f"put {k0} bye", "-o", "json", *endpoints],
                     capsys)
    assert json_lines(out)[0]["succeeded"] is True
    rc, out, _ = run(["scan", "-o", "json", *endpoints], capsys)
    assert [(r["key"], r["value"]) for r in json_lines(out)] == [(k0, "bye")]
    rc, out, _ = run(["shards", *endpoints], capsys)
    assert rc == 0 and fake_cluster.addresses[0] in out


def test_cli_unknown_outcome_says_how_to_finish_the_write(
    fake_cluster: FakeCluster, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write happened but every answer was lost: the CLI prints the id and first-attempt time,
    and running the command again with them finishes it without applying it twice."""
    monkeypatch.setattr(client_commands, "make_client", lambda endpoints, timeout_s, security=None: Client(
        endpoints, timeout_s=timeout_s, max_attempts=2, backoff_s=0.001))
    k0, leader = key_on(0, 2).decode(), fake_cluster.leaders[0]
    lost = Failure(grpc.StatusCode.UNAVAILABLE, "Socket closed", apply_first=True)
    fake_cluster.fail(leader, "Put", lost, lost)
    rc, out, err = run(["put", k0, "v", "--endpoints", leader], capsys)
    hint = re.fullmatch(r"kvstore: outcome unknown \(retry with --request-id (\w+) --first-attempt-unix-ms (\d+)\): "
                        r"Socket closed \(after 2 attempts\)\n", err)
    assert rc == 3 and out == "" and hint is not None, err
    rc, out, err = run(["put", k0, "v", "--endpoints", leader, "--request-id", hint[1],
                        "--first-attempt-unix-ms", hint[2], "-o", "json"], capsys)
    (record,) = json_lines(out)
    assert (rc, err) == (0, "") and record["replayed"] is True and record["version"] == 1
    puts = fake_cluster.calls_to("Put")
    assert len(puts) == 3 and {(c.request.request_id, c.request.first_attempt_unix_ms) for c in puts} == {
        (hint[1], int(hint[2]))}
    # The same for a script: one JSON object on stderr with the outcome and what to retry with.
    fake_cluster.fail(leader, "Put", lost, lost)
    rc, out, err = run(["put", key_on(0, 2, "j").decode(), "v", "--endpoints", leader, "-o", "json"], capsys)
    error = json.loads(err)
    assert rc == 3 and out == "" and error["outcome"] == "unknown" and error["reason"] == "OUTCOME_UNKNOWN", error
    assert error["request_id"] and error["first_attempt_unix_ms"] > 0 and error["exit_status"] == 3, error
    assert error["attempts"] == 2 and error["code"] == "UNAVAILABLE", error


@pytest.mark.parametrize("command", [["get", "k"], ["put", "k", "v"], ["del", "k"], ["shards"]])
def test_cli_unreachable_cluster_exits_4_and_says_nothing_was_sent(
        command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listening: no attempt reached a server, so even a write is a definite failure."""
    from tests.unit.test_client import _free_address

    rc, out, err = run([*command, "--endpoints", _free_address(), "--timeout", "2"], capsys)
    assert rc == 4 and out == "" and err.startswith("kvstore: unreachable, nothing was sent: ") and err.count("\n") == 1
    assert "outcome unknown" not in err and "--request-id" not in err
    rc, out, err = run([*command, "--endpoints", _free_address(), "--timeout", "2", "-o", "json"], capsys)
    error = json.loads(err)
    assert rc == 4 and error["outcome"] == "none" and error["reason"] == "UNREACHABLE" and error["exit_status"] == 4


def test_demo_write_timeout_is_parsed() -> None:
    from kvstore.cli import build_parser

    args = build_parser().parse_args(["demo", "failover", "--write-timeout", "0.5"])
    assert args.write_timeout == 0.5
    assert build_parser().parse_args(["demo", "failover"]).write_timeout == 10.0


def test_watch_from_shard_revisions(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    fake.watch_obj = FakeWatch([], KeyboardInterrupt())
    rc, _out, err = run(["watch", "--prefix", "w", "--from-shard", "0:7", "--from-shard", "2:9"], capsys)
    assert rc == 0 and err == ""
    assert fake.calls == [("watch", ("", "w", None, {0: 7, 2: 9}), {})]
    rc, _out, err = run(["watch", "--prefix", "w", "--from-shard", "7"], capsys)
    assert rc == 2 and "SHARD:REV" in err


class _Stdin:
    """sys.stdin with a binary buffer, as a pipe gives it."""

    def __init__(self, data: bytes) -> None:
        self.buffer = io.BytesIO(data)
        self.buffer.isatty = lambda: False  # type: ignore[method-assign]


@pytest.mark.parametrize("argv", [["put", "k"], ["put", "k", "-"]], ids=["omitted", "dash"])
def test_put_reads_the_value_from_stdin(fake: FakeClient, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    payload = bytes(range(256)) * 4  # any bytes, newlines and NULs included
    monkeypatch.setattr(sys, "stdin", _Stdin(payload))
    assert run(argv, capsys)[0] == 0
    assert fake.calls[-1] == ("put", ("k", payload, None), {"first_attempt_unix_ms": None})


def test_put_reads_the_value_from_a_file(fake: FakeClient, capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    big = b"\x00v" * 1_500_000  # 3 MB: far above what an argument can carry, within no limit yet...
    path = tmp_path / "value.bin"
    path.write_bytes(big[: limits.MAX_VALUE_BYTES])
    assert run(["put", "k", "--value-file", str(path)], capsys)[0] == 0
    assert fake.calls[-1][1][1] == big[: limits.MAX_VALUE_BYTES]
    # ... above MAX_VALUE_BYTES it is refused before connecting, naming the limit.
    path.write_bytes(big)
    calls = len(fake.calls)
    rc, _, err = run(["put", "k", "--value-file", str(path)], capsys)
    assert rc == 2 and "MAX_VALUE_BYTES" in err and len(fake.calls) == calls
    rc, _, err = run(["put", "k", "--value-file", str(tmp_path / "missing")], capsys)
    assert rc == 2 and "missing" in err and "Traceback" not in err
    rc, _, err = run(["put", "k", "v", "--value-file", str(path)], capsys)
    assert rc == 2 and "not both" in err


def test_put_refuses_an_oversized_stdin_without_reading_it_all(
        fake: FakeClient, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    stdin = _Stdin(b"x" * (limits.MAX_VALUE_BYTES + 10))
    monkeypatch.setattr(sys, "stdin", stdin)
    rc, _, err = run(["put", "k"], capsys)
    assert rc == 2 and "MAX_VALUE_BYTES" in err and "standard input" in err
    assert stdin.buffer.tell() == limits.MAX_VALUE_BYTES + 1  # one byte past the limit, no more


def test_options_are_never_abbreviated(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    """A prefix must not be read as some option: `--to` was once taken for `--token`."""
    rc, _, err = run(["get", "k", "--outp", "json"], capsys)
    assert rc == 2 and "--outp" in err
    assert cli.build_parser().parse_args(["changes", "--to", "dir"]).to == "dir"


def test_placement_log(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["placement", "log", "--limit", "2"], capsys)
    lines = out.splitlines()
    assert rc == 0 and fake.calls[-1] == ("placement_log", (2,), {})
    assert lines[0] == "placement epoch 3, controller n1 (term 2)"
    assert lines[1] == "records skipped (hostile or broken): undecodable: 1"
    assert lines[2].split() == ["OFFSET", "EPOCH", "AT", "DECISION", "REASON"]
    assert lines[4].split()[:3] == ["8", "3", "2026-11-18"] and "add-learner on n3" in lines[4]
    (record,) = json_lines(run(["placement", "log", "-o", "json"], capsys)[1])
    assert record["epoch"] == 3 and record["skipped"] == {"undecodable": 1}
    assert record["entries"][0]["summary"] == "n2 drained"


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_is_generated_from_the_parser(shell: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["completion", shell], capsys)
    assert rc == 0
    for word in ("get", "put", "health", "drain", "audit", "consistency", "print-value-only", "endpoints"):
        assert word in out, (shell, word)


def test_bash_completion_completes_commands_and_their_options(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    script = tmp_path / "kvstore.bash"
    script.write_text(run(["completion", "bash"], capsys)[1])
    probe = ('source "$1"; COMP_WORDS=(kvstore he); COMP_CWORD=1; _kvstore; echo "${COMPREPLY[@]}"; '
             'COMP_WORDS=(kvstore get k --print); COMP_CWORD=3; _kvstore; echo "${COMPREPLY[@]}"')
    done = subprocess.run(["bash", "-c", probe, "-", str(script)], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["health", "--print-value-only"]


def test_health_status_is_read_from_the_standard_message() -> None:
    from kvstore.cli.tools import serving_status

    assert serving_status(b"\x08\x01") == "SERVING" and serving_status(b"\x08\x02") == "NOT_SERVING"
    assert serving_status(b"") == "UNKNOWN" and serving_status(b"\x12\x00") == "UNKNOWN"


def test_a_commands_own_options_come_before_the_global_ones_in_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["get", "--help"], capsys)
    assert rc == 0 and out.index("\n  --consistency") < out.index("global options") < out.index("\n  --endpoints")


def test_get_raw_value_and_file(fake: FakeClient, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, _ = run(["get", "k", "--hex"], capsys)
    assert rc == 0 and "6b" in out.split()  # the key as hex
    rc, out, _ = run(["get", "k", "--out", str(tmp_path / "v")], capsys)
    assert rc == 0 and "bytes in" in out and (tmp_path / "v").exists()


def test_an_unknown_batch_exits_3_and_says_so() -> None:
    from kvstore.cli.client_commands import error_record, exit_status
    from kvstore.client import BatchIncomplete

    unknown = BatchIncomplete("1 of 2 parts not committed", committed={}, errors={1: UnknownOutcome("lost")},
                              request_id="rid", first_attempt_unix_ms=1)
    definite = BatchIncomplete("1 of 2 parts not committed", committed={}, errors={1: Unavailable("busy")},
                               request_id="rid", first_attempt_unix_ms=1)
    assert exit_status(unknown) == 3 and error_record(unknown)["outcome"] == "unknown"
    assert exit_status(definite) == 1 and error_record(definite)["outcome"] == "none"
