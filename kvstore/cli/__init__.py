"""The `kvstore` command: a thin shell over `kvstore.client` for people and scripts.

    kvstore [--endpoints A,B] [--timeout S] [--output table|json] COMMAND ...

    get KEY [--consistency linearizable|leader-local|stale] [--min-revision REV]
    put KEY [VALUE | - | --value-file PATH] [--request-id ID [--first-attempt-unix-ms MS]]
                             (no VALUE or `-`: the value is read from standard input)
    del KEY [--request-id ID [--first-attempt-unix-ms MS]]
    txn [--if COND]... [--then OP]... [--else OP]... [--request-id ID [--first-attempt-unix-ms MS]]
    scan [--prefix P | --start S [--end E]] [--limit N] [--keys-only] [--consistency C]
         [--min-revision SHARD:REV]...
    watch [KEY | --prefix P] [--from REV]
    shards
    serve ARGS...            (runs kvstore.server.app.main(ARGS))

The common options are accepted before or after the command. `--endpoints` defaults to
$KVSTORE_ENDPOINTS, else 127.0.0.1:50051. A secure cluster (README "Security"): `--ca FILE`
(the CA of the nodes' certificates), `--token-file FILE` or `--token T` (a bearer token), `--cert
FILE --key FILE` (a client certificate: mutual TLS), each defaulting to $KVSTORE_CA,
$KVSTORE_TOKEN_FILE, $KVSTORE_TOKEN, $KVSTORE_CERT, $KVSTORE_KEY; any of them turns TLS on.

Txn syntax: see `TXN_SYNTAX` below (also `kvstore txn --help`).

Output: `table` (default) is for people; `json` prints one JSON object per line. Keys and
values are UTF-8 strings when they decode, else base64 with `"<field>_base64": true`.
A missing key is not an error: `get` prints "(not found)" (json: `"found": false`), exit 0.

Exit status: 0 success (and Ctrl-C during `watch`); 2 invalid arguments or a request the
server refused as invalid; 1 any other error (unavailable, deadline, ...); 130 Ctrl-C elsewhere.
Errors are one line on stderr, never a traceback.

Writes and unknown outcomes (W7): a write that may or may not have committed exits 1 with
"outcome unknown (retry with --request-id ID --first-attempt-unix-ms MS)"; running the same
command with those two options applies it at most once. If the store no longer remembers that
id it refuses the retry ("request id expired", exit 1): the write's outcome is then unknown for
good, and only reading the data tells. Any other error of a write (Ctrl-C aside) means it did
not happen.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import importlib
import json
import os
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from kvstore import limits
from kvstore.client import (
    CONSISTENCIES,
    Client,
    ClientSecurity,
    Compare,
    CompareOp,
    Consistency,
    DeleteResult,
    FenceResult,
    GetResult,
    InvalidArgument,
    KeyValue,
    KvError,
    Op,
    PutResult,
    RequestExpired,
    ShardMap,
    TransactionInfo,
    TxnResult,
    WatchEvent,
)
from kvstore.limits import MAX_SCAN_LIMIT

DEFAULT_ENDPOINT = "127.0.0.1:50051"
ENDPOINTS_ENV = "KVSTORE_ENDPOINTS"
DEV_DATA_DIR_ENV = "KVSTORE_DEV_DATA_DIR"
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_GLOBAL_VALUE_OPTIONS = ("--endpoints", "--timeout", "--output", "--ca", "--cert", "--key", "--token", "--token-file")

TXN_SYNTAX = """\
Txn syntax (one `--if` per compare, one `--then`/`--else` per operation; all must hold):

    COND := version(KEY) OP INT        OP is one of = == != > <
          | mod_revision(KEY) OP INT   (alias: mod)
          | value(KEY) OP VALUE        (bytewise comparison)
          | exists(KEY) | !exists(KEY) | exists(KEY) = true|false
    OP   := put KEY VALUE | del KEY | delete KEY | get KEY     (shell-quoted words)

A KEY inside parentheses or a VALUE after the operator may be quoted ("a b" or 'a)b'); an
unquoted VALUE is the rest of the condition, trimmed. Example:

    kvstore txn --if 'version(lock)=0' --then 'put lock me' --else 'get lock'
"""


class TxnSyntaxError(InvalidArgument):
    """A `--if`/`--then`/`--else` argument that does not parse; the message shows the grammar."""


# --------------------------------------------------------------------------------------------
# Txn syntax


_COMPARE_TARGETS = {"version": "version", "value": "value", "mod_revision": "mod_revision", "mod": "mod_revision",
                    "exists": "exists"}
_CMP_OPERATORS: tuple[tuple[str, CompareOp], ...] = (("==", "=="), ("!=", "!="), ("=", "=="), (">", ">"), ("<", "<"))
_COND_HELP = "expected TARGET(KEY) OP OPERAND, TARGET one of version, value, mod_revision, exists; OP one of = != > <"


def _read_quoted(text: str, i: int) -> tuple[str, int]:
    """A quoted string starting at text[i] (' or "); backslash escapes the quote and itself."""
    quote, out, j = text[i], [], i + 1
    while j < len(text):
        c = text[j]
        if c == "\\" and j + 1 < len(text) and text[j + 1] in (quote, "\\"):
            out.append(text[j + 1])
            j += 2
            continue
        if c == quote:
            return "".join(out), j + 1
        out.append(c)
        j += 1
    raise TxnSyntaxError(f"unterminated quote in {text!r}")


def _skip_spaces(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def parse_compare(text: str) -> Compare:
    """`version(k)=0`, `value("a b") != x`, `!exists(k)`, `mod(k) < 12` -> a `Compare`."""
    i = _skip_spaces(text, 0)
    negate = text.startswith("!", i)
    if negate:
        i = _skip_spaces(text, i + 1)
    open_paren = text.find("(", i)
    if open_paren < 0:
        raise TxnSyntaxError(f"bad condition {text!r}: {_COND_HELP}")
    name = text[i:open_paren].strip().lower()
    target = _COMPARE_TARGETS.get(name)
    if target is None:
        raise TxnSyntaxError(f"bad condition {text!r}: unknown target {name!r}; {_COND_HELP}")
    if negate and target != "exists":
        raise TxnSyntaxError(f"bad condition {text!r}: '!' only applies to exists(KEY)")
    i = _skip_spaces(text, open_paren + 1)
    if i < len(text) and text[i] in "\"'":
        key, i = _read_quoted(text, i)
        i = _skip_spaces(text, i)
        if not text.startswith(")", i):
            raise TxnSyntaxError(f"bad condition {text!r}: expected ')' after the quoted key")
    else:
        close = text.find(")", i)
        if close < 0:
            raise TxnSyntaxError(f"bad condition {text!r}: missing ')'")
        key, i = text[i:close].strip(), close
    if not key:
        raise TxnSyntaxError(f"bad condition {text!r}: empty key")
    i = _skip_spaces(text, i + 1)
    rest = text[i:]
    if target == "exists":
        if not rest:
            return Compare.exists(key, not negate)
        op, operand = _split_operator(text, rest)
        flag = {"true": True, "1": True, "false": False, "0": False}.get(operand.strip().lower())
        if op not in ("==", "!=") or flag is None:
            raise TxnSyntaxError(f"bad condition {text!r}: exists(KEY) compares with = or != to true or false")
        return Compare.exists(key, (flag == (op == "==")) != negate)
    if not rest:
        raise TxnSyntaxError(f"bad condition {text!r}: missing operator and operand; {_COND_HELP}")
    op, operand = _split_operator(text, rest)
    if target == "value":
        return Compare.value(key, op, _operand_text(text, operand))
    try:
        number = int(operand.strip())
    except ValueError:
        raise TxnSyntaxError(f"bad condition {text!r}: {target} needs an integer, got {operand.strip()!r}") from None
    return Compare.version(key, op, number) if target == "version" else Compare.mod_revision(key, op, number)


def _split_operator(text: str, rest: str) -> tuple[CompareOp, str]:
    for token, op in _CMP_OPERATORS:
        if rest.startswith(token):
            after = rest[len(token):]
            if after.startswith("="):  # ">=", "<=", "===": not in the proto, say so plainly
                break
            return op, after
    raise TxnSyntaxError(f"bad condition {text!r}: operator must be one of = == != > <")


def _operand_text(text: str, operand: str) -> str:
    stripped = operand.strip()
    if stripped[:1] in ("'", '"'):
        value, end = _read_quoted(stripped, 0)
        if stripped[end:].strip():
            raise TxnSyntaxError(f"bad condition {text!r}: text after the quoted value")
        return value
    if not stripped:
        raise TxnSyntaxError(f"bad condition {text!r}: missing value (use \"\" for the empty value)")
    return stripped


def parse_op(text: str) -> Op:
    """`put k v`, `del k`, `get k` (shell-quoted words) -> an `Op`."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise TxnSyntaxError(f"bad operation {text!r}: {exc}") from None
    if not words:
        raise TxnSyntaxError("empty operation; expected put KEY VALUE, del KEY or get KEY")
    verb, args = words[0].lower(), words[1:]
    if verb == "put" and len(args) == 2:
        return Op.put(args[0], args[1])
    if verb in ("del", "delete") and len(args) == 1:
        return Op.delete(args[0])
    if verb == "get" and len(args) == 1:
        return Op.get(args[0])
    raise TxnSyntaxError(f"bad operation {text!r}: expected put KEY VALUE, del KEY or get KEY")


def parse_txn(
    compares: Sequence[str], success: Sequence[str], failure: Sequence[str]
) -> tuple[list[Compare], list[Op], list[Op]]:
    """The `--if`/`--then`/`--else` arguments of `kvstore txn`, parsed."""
    if not (compares or success or failure):
        raise TxnSyntaxError("txn needs at least one --if, --then or --else")
    return [parse_compare(c) for c in compares], [parse_op(o) for o in success], [parse_op(o) for o in failure]


# --------------------------------------------------------------------------------------------
# Output


def bytes_field(name: str, data: bytes) -> dict[str, Any]:
    """JSON for bytes: the UTF-8 text when it decodes, else base64 plus a `<name>_base64` flag."""
    try:
        return {name: data.decode("utf-8")}
    except UnicodeDecodeError:
        return {name: base64.b64encode(data).decode("ascii"), f"{name}_base64": True}


def display(data: bytes | None) -> str:
    """Bytes for a table cell: text when printable, escapes otherwise (one cell, one line)."""
    if data is None:
        return ""
    text = data.decode("utf-8", "surrogateescape")
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if "\udc80" <= ch <= "\udcff":  # a byte that is not UTF-8
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1])  # \n, \x00, \u200b
    return "".join(out)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def kv_record(kv: KeyValue) -> dict[str, Any]:
    return {**bytes_field("key", kv.key), **bytes_field("value", kv.value), "version": kv.version,
            "mod_revision": kv.mod_revision, "create_revision": kv.create_revision}


def get_record(result: GetResult) -> dict[str, Any]:
    record: dict[str, Any] = {**bytes_field("key", result.key), "found": result.found}
    if result.kv is not None:
        record.update(kv_record(result.kv))
    if result.header is not None:
        record.update(shard=result.header.shard, applied_revision=result.header.applied_revision,
                      served_by=result.header.served_by)
    return record


def put_record(result: PutResult) -> dict[str, Any]:
    return {**bytes_field("key", result.key), "shard": result.shard, "revision": result.revision,
            "version": result.version, "replayed": result.replayed, "request_id": result.request_id}


def delete_record(result: DeleteResult) -> dict[str, Any]:
    return {**bytes_field("key", result.key), "shard": result.shard, "revision": result.revision,
            "deleted": result.deleted, "replayed": result.replayed, "request_id": result.request_id}


def txn_record(result: TxnResult) -> dict[str, Any]:
    ops: list[dict[str, Any]] = []
    for r in result.results:
        if isinstance(r, PutResult):
            ops.append({"op": "put", **bytes_field("key", r.key), "version": r.version})
        elif isinstance(r, DeleteResult):
            ops.append({"op": "delete", **bytes_field("key", r.key), "deleted": r.deleted})
        else:
            get = get_record(r)
            ops.append({"op": "get", **get})
    return {"succeeded": result.succeeded, "shard": result.shard, "revision": result.revision,
            "replayed": result.replayed, "request_id": result.request_id, "results": ops}


def event_record(event: WatchEvent) -> dict[str, Any]:
    return {"type": event.type, "shard": event.shard, **kv_record(event.kv)}


def shard_map_record(smap: ShardMap) -> dict[str, Any]:
    return {"shard_count": smap.shard_count, "topic": smap.topic, "served_by": smap.served_by,
            "shards": [{"shard": s.shard, "leader": s.leader, "leader_id": s.leader_id, "leader_ready": s.leader_ready,
                        "term": s.term, "applied_offset": s.applied_offset, "end_offset": s.end_offset, "lag": s.lag,
                        "open_txn_age_ms": s.open_txn_age_ms}
                       for s in smap.shards],
            "nodes": [{"node_id": n.node_id, "address": n.address, "leads": list(n.leads), "can_lead": n.can_lead}
                      for n in smap.nodes]}


class Printer:
    """Writes results in the chosen format; json is one object per line, flushed (for pipes)."""

    def __init__(self, output: str, out: TextIO) -> None:
        self.json = output == "json"
        self.out = out

    def line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def record(self, record: dict[str, Any]) -> None:
        self.line(json.dumps(record, ensure_ascii=False, separators=(",", ":")))

    def get(self, result: GetResult) -> None:
        if self.json:
            self.record(get_record(result))
        elif result.kv is None:
            self.line("(not found)")
        else:
            kv = result.kv
            self.line(format_table(["KEY", "VALUE", "VERSION", "MOD_REVISION", "CREATE_REVISION"],
                                   [[display(kv.key), display(kv.value), kv.version, kv.mod_revision,
                                     kv.create_revision]]))

    def put(self, result: PutResult) -> None:
        if self.json:
            self.record(put_record(result))
        else:
            self.line(format_table(["KEY", "SHARD", "REVISION", "VERSION", "REPLAYED"],
                                   [[display(result.key), result.shard, result.revision, result.version,
                                     _yes(result.replayed)]]))

    def delete(self, result: DeleteResult) -> None:
        if self.json:
            self.record(delete_record(result))
        else:
            self.line(format_table(["KEY", "SHARD", "REVISION", "DELETED", "REPLAYED"],
                                   [[display(result.key), result.shard, result.revision, _yes(result.deleted),
                                     _yes(result.replayed)]]))

    def txn(self, result: TxnResult) -> None:
        if self.json:
            self.record(txn_record(result))
            return
        branch = "then" if result.succeeded else "else"
        self.line(f"succeeded: {_yes(result.succeeded)} (ran --{branch})  shard: {result.shard}  "
                  f"revision: {result.revision}  replayed: {_yes(result.replayed)}")
        rows: list[list[object]] = []
        for r in result.results:
            if isinstance(r, PutResult):
                rows.append(["put", display(r.key), f"version={r.version}"])
            elif isinstance(r, DeleteResult):
                rows.append(["del", display(r.key), f"deleted={_yes(r.deleted)}"])
            elif r.kv is None:
                rows.append(["get", display(r.key), "(not found)"])
            else:
                rows.append(["get", display(r.key), f"{display(r.kv.value)} (version={r.kv.version})"])
        if rows:
            self.line(format_table(["OP", "KEY", "RESULT"], rows))

    def kvs(self, kvs: Iterable[KeyValue], keys_only: bool) -> None:
        if self.json:
            for kv in kvs:
                self.record(bytes_field("key", kv.key) if keys_only else kv_record(kv))
            return
        if keys_only:
            rows: list[list[object]] = [[display(kv.key)] for kv in kvs]
            self.line(format_table(["KEY"], rows))
        else:
            rows = [[display(kv.key), display(kv.value), kv.version, kv.mod_revision] for kv in kvs]
            self.line(format_table(["KEY", "VALUE", "VERSION", "MOD_REVISION"], rows))

    def event_header(self) -> None:
        if not self.json:
            self.line(_event_line("TYPE", "MOD_REVISION", "SHARD", "KEY", "VALUE"))

    def event(self, event: WatchEvent) -> None:
        if self.json:
            self.record(event_record(event))
        else:
            value = display(event.kv.value) if event.type == "put" else ""
            self.line(_event_line(event.type.upper(), str(event.kv.mod_revision), str(event.shard),
                                  display(event.kv.key), value))

    def shard_map(self, smap: ShardMap) -> None:
        if self.json:
            self.record(shard_map_record(smap))
            return
        self.line(f"topic: {smap.topic}  shards: {smap.shard_count}  served by: {smap.served_by}")
        self.line(format_table(
            ["SHARD", "LEADER", "NODE", "TERM", "APPLIED", "END", "LAG", "OPEN_TXN_MS"],
            [[s.shard, s.leader or "-", _leader_node(s.leader_id, s.leader_ready), s.term, s.applied_offset,
              s.end_offset, s.lag, s.open_txn_age_ms]
             for s in smap.shards]))
        if smap.nodes:
            self.line("")
            self.line(format_table(
                ["NODE", "ADDRESS", "LEADS", "ROLE"],
                [[n.node_id, n.address, ",".join(map(str, n.leads)) or "-",
                  "leader-capable" if n.can_lead else "read replica"] for n in smap.nodes]))

    def transactions(self, txns: list[TransactionInfo]) -> None:
        if self.json:
            for t in txns:
                self.record(dataclasses.asdict(t))
            return
        if not txns:
            self.line("(no open transaction)")
            return
        self.line(format_table(["SHARD", "FIRST_OFFSET", "END", "AGE_MS", "LEADER"],
                               [[t.shard, t.first_offset, t.end_offset, t.age_ms, t.leader_id or "-"] for t in txns]))

    def fenced(self, result: FenceResult) -> None:
        if self.json:
            self.record(dataclasses.asdict(result))
            return
        told = f"; leader {result.notified} told to check" if result.notified else "; no leader was reachable"
        self.line(f"shard {result.shard} fenced at offset {result.end_offset}{told}")


def _leader_node(node_id: str, ready: bool) -> str:
    if not node_id:
        return "-"
    return node_id if ready else f"{node_id} (taking over)"


def _event_line(kind: str, rev: str, shard: str, key: str, value: str) -> str:
    # A watch is a stream: fixed widths instead of a table measured over all rows.
    return f"{kind:<7} {rev:>12} {shard:>5}  {key}  {value}".rstrip()


def _yes(flag: bool) -> str:
    return "true" if flag else "false"


# --------------------------------------------------------------------------------------------
# Arguments


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
    return value


def _add_common(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """The options every command takes. On subcommands they default to SUPPRESS, so that a value
    given before the command is not overwritten by the subcommand's default."""
    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--endpoints", default=default(os.environ.get(ENDPOINTS_ENV) or DEFAULT_ENDPOINT),
                        help=f"comma-separated host:port list (default: ${ENDPOINTS_ENV} or {DEFAULT_ENDPOINT})")
    parser.add_argument("--timeout", type=_positive_float, default=default(5.0), metavar="SECONDS",
                        help="deadline of each request, retries included (default: 5)")
    parser.add_argument("--output", "-o", choices=("table", "json"), default=default("table"),
                        help="table for people, json for scripts: one object per line (default: table)")
    # Security (README "Security"): None = the KVSTORE_* variable; any of them turns TLS on.
    parser.add_argument("--ca", dest="tls_ca", default=default(None), metavar="FILE",
                        help="CA certificate (PEM) of the nodes: TLS (default: $KVSTORE_CA)")
    parser.add_argument("--cert", dest="tls_cert", default=default(None), metavar="FILE",
                        help="client certificate (PEM) for mutual TLS; its role is in it (default: $KVSTORE_CERT)")
    parser.add_argument("--key", dest="tls_key", default=default(None), metavar="FILE",
                        help="the client certificate's key (default: $KVSTORE_KEY)")
    parser.add_argument("--token", default=default(None),
                        help="bearer token, sent over TLS only (default: $KVSTORE_TOKEN; visible to `ps`: prefer "
                             "--token-file)")
    parser.add_argument("--token-file", default=default(None), metavar="FILE",
                        help="file holding the bearer token (default: $KVSTORE_TOKEN_FILE)")


class _Parser(argparse.ArgumentParser):
    """No abbreviated options, in this parser and every subcommand's (they are built with its
    class): a prefix can become ambiguous, or worse mean another option, as soon as an option is
    added (`changes --to` read as `--token` once the TLS options came)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvstore", description="Client for the kvstore sharded key-value store.",
        epilog="Txn syntax: `kvstore txn --help`. With --output json every result is one JSON object per line; "
        "bytes that are not UTF-8 are base64 with a <field>_base64 flag. Exit status: 0 ok, 2 invalid arguments, "
        "1 other errors.",
    )
    _add_common(parser, defaults=True)
    common = _Parser(add_help=False)
    _add_common(common, defaults=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def idempotency(p: argparse.ArgumentParser) -> None:
        p.add_argument("--request-id", help="idempotency key (default: a fresh one, reused on retries); to finish "
                       "a write whose outcome was unknown, give the id it printed")
        p.add_argument("--first-attempt-unix-ms", type=_positive_int, default=None, metavar="MS",
                       help="with --request-id: when that request was first attempted, as printed with it "
                       "(default: now, right only for a new id)")

    def consistency(p: argparse.ArgumentParser) -> None:
        p.add_argument("--consistency", choices=CONSISTENCIES, default="linearizable",
                       help="linearizable (leader + read barrier), leader-local, or stale (any node)")

    p = sub.add_parser("get", parents=[common], help="read one key")
    p.add_argument("key")
    consistency(p)
    p.add_argument("--min-revision", type=_non_negative_int, default=None, metavar="REV",
                   help="with --consistency stale: wait until the node applied this revision")

    p = sub.add_parser("put", parents=[common], help="write one key",
                       description="Write one key. The value is the argument; `-` or no argument reads it "
                                   "from standard input, --value-file from a file (any bytes, up to "
                                   f"MAX_VALUE_BYTES = {limits.MAX_VALUE_BYTES}).")
    p.add_argument("key")
    p.add_argument("value", nargs="?", help="the value; `-` or omitted: read it from standard input")
    p.add_argument("--value-file", metavar="PATH", help="read the value from this file (bytes, as they are)")
    idempotency(p)

    p = sub.add_parser("del", aliases=["delete"], parents=[common], help="delete one key")
    p.add_argument("key")
    idempotency(p)

    p = sub.add_parser(
        "txn", parents=[common], help="atomic compare-and-write within one shard; `txn list`: open WAL transactions",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=TXN_SYNTAX,
    )
    p.add_argument("action", nargs="?", choices=["list"], default=None,
                   help="`list`: shards whose WAL transaction is open (see --older-than) instead of a Txn")
    p.add_argument("--older-than", type=parse_duration_ms, default=0, metavar="DURATION",
                   help="with `list`: only transactions open at least this long (e.g. 500ms, 30s, 2m)")
    p.add_argument("--if", dest="compares", action="append", default=[], metavar="COND",
                   help="a compare, e.g. 'version(k)=0', 'value(k)!=x', '!exists(k)' (all must hold)")
    p.add_argument("--then", dest="success", action="append", default=[], metavar="OP",
                   help="run when every compare holds: 'put K V', 'del K' or 'get K'")
    p.add_argument("--else", dest="failure", action="append", default=[], metavar="OP",
                   help="run otherwise")
    idempotency(p)

    p = sub.add_parser("scan", parents=[common], help="list keys in order, across shards")
    p.add_argument("--prefix", default="")
    p.add_argument("--start", default="", help="first key (inclusive)")
    p.add_argument("--end", default="", help="end key (exclusive; default: end of the key space)")
    p.add_argument("--limit", type=_non_negative_int, default=0, help="at most this many keys (default 0 = all)")
    p.add_argument("--keys-only", action="store_true")
    consistency(p)
    p.add_argument("--min-revision", dest="min_revisions", type=parse_shard_revision, action="append", default=[],
                   metavar="SHARD:REV", help="with --consistency stale: read SHARD only once the node applied its "
                   "revision REV (a revision belongs to one shard; repeat for several shards)")

    p = sub.add_parser("watch", parents=[common], help="print changes until Ctrl-C")
    p.add_argument("key", nargs="?", default="")
    p.add_argument("--prefix", default="")
    p.add_argument("--from", dest="start_revision", type=_non_negative_int, default=None, metavar="REV",
                   help="first deliver the history at revisions >= REV of the key's shard (with --prefix over "
                        "several shards only 0, all history, names no shard; default: from now on)")
    p.add_argument("--from-shard", dest="start_revisions", type=parse_shard_revision, action="append", default=[],
                   metavar="SHARD:REV", help="with --prefix: SHARD's history from its revision REV (repeat per "
                                             "shard; shards not named: from now on)")

    sub.add_parser("shards", parents=[common], help="show the shard map: leaders, terms, lag, nodes")

    p = sub.add_parser("fence", parents=[common],
                       help="force-terminate a shard's WAL transaction (fresh init_transactions on its id)")
    p.add_argument("shard", type=_non_negative_int)

    p = sub.add_parser("demo", parents=[common], help="demos against the running local cluster (`make up`)")
    p.add_argument("scenario", choices=["failover"])
    p.add_argument("--data-dir", default=os.environ.get(DEV_DATA_DIR_ENV) or ".data", metavar="DIR",
                   help=f"the dev cluster's data dir (default: ${DEV_DATA_DIR_ENV} or .data, as `make up`): the "
                   "demo kills only a node that cluster recorded as its own child")
    p.add_argument("--clean", action="store_true", help="stop the leader with SIGTERM (handover) instead of SIGKILL")
    p.add_argument("--shard", type=_non_negative_int, default=0, help="whose leader to stop (default 0)")
    p.add_argument("--warmup", type=float, default=3.0, metavar="S", help="seconds of writes before (default 3)")
    p.add_argument("--after", type=float, default=5.0, metavar="S", help="seconds of writes after the takeover")
    p.add_argument("--writers-per-shard", type=_non_negative_int, default=2)
    p.add_argument("--write-timeout", type=float, default=10.0, metavar="S",
                   help="deadline of one put, retries included (default 10); below the takeover time writes "
                        "fail during it, which failed_but_applied then checks")
    from kvstore.pipeline import commands as pipeline_commands  # argparse only: no pyspark import

    pipeline_commands.register(sub, common)
    sub.add_parser("serve", add_help=False, help="run a server node (all further arguments go to the server)")
    return parser


def serve_argv(argv: Sequence[str]) -> list[str] | None:
    """The server's arguments when the command is `serve`, else None.

    `serve` is split off before argparse: its arguments belong to `kvstore.server.app`, whose options
    this parser does not know (argparse's REMAINDER would still choke on a leading `--option`).
    """
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in _GLOBAL_VALUE_OPTIONS or token == "-o":
            i += 2
        elif token.split("=", 1)[0] in _GLOBAL_VALUE_OPTIONS:
            i += 1
        else:
            break
    if i < len(argv) and argv[i] == "serve":
        return list(argv[i + 1:])
    return None


def put_value(value: str | None, value_file: str | None, stdin: BinaryIO) -> str | bytes:
    """The value of `kvstore put`: the argument, else standard input (no argument or `-`), else
    --value-file. Reads at most one byte past MAX_VALUE_BYTES, so a huge input is refused at once
    with the limit's name instead of being loaded (or sent) whole."""
    if value_file is not None and value not in (None, "-"):
        raise InvalidArgument("give the value either as an argument or with --value-file, not both")
    if value_file is None and value not in (None, "-"):
        assert value is not None
        return value
    limit = limits.MAX_VALUE_BYTES
    if value_file is not None:
        try:
            with open(value_file, "rb") as source:
                data = source.read(limit + 1)
        except OSError as exc:
            raise InvalidArgument(f"--value-file {value_file}: {exc.strerror or exc}") from exc
        where = value_file
    else:
        if stdin.isatty():
            print("kvstore: reading the value from standard input (end it with Ctrl-D)", file=sys.stderr)
        data = stdin.read(limit + 1)
        where = "standard input"
    if len(data) > limit:
        raise InvalidArgument(f"the value from {where} has more than {limit} bytes; limit MAX_VALUE_BYTES is {limit}")
    return data


def parse_endpoints(text: str) -> list[str]:
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    if not endpoints:
        raise InvalidArgument("--endpoints is empty")
    return endpoints


# --------------------------------------------------------------------------------------------
# Commands


def make_client(endpoints: Sequence[str], timeout_s: float, security: ClientSecurity | None = None) -> Client:
    """The client factory (a seam: tests swap it for a fake)."""
    return Client(endpoints, timeout_s=timeout_s, security=security)


def security_of(args: argparse.Namespace) -> ClientSecurity:
    """TLS and credentials: the flags over the KVSTORE_* environment."""
    return ClientSecurity.from_env(ca=getattr(args, "tls_ca", None), cert=getattr(args, "tls_cert", None),
                                   key=getattr(args, "tls_key", None), token=getattr(args, "token", None),
                                   token_file=getattr(args, "token_file", None))


def _export_security(args: argparse.Namespace) -> None:
    """The flags as KVSTORE_* variables, for commands whose code opens its own connections from
    the environment (the demo's clients, the pipeline's Spark executors)."""
    os.environ.update(security_of(args).environ())


def _run(args: argparse.Namespace, printer: Printer) -> int:
    command: str = args.command
    if command == "demo":
        return _demo(args, printer)
    if getattr(args, "pipeline", None):
        return _pipeline(args, printer)
    if command == "txn" and args.action == "list":
        if args.compares or args.success or args.failure:
            raise InvalidArgument("`txn list` takes no --if/--then/--else")
        command = "txn-list"
    elif command == "txn":  # parse before connecting: a syntax error needs no cluster
        compares, success, failure = parse_txn(args.compares, args.success, args.failure)
    if getattr(args, "first_attempt_unix_ms", None) is not None and not args.request_id:
        raise InvalidArgument("--first-attempt-unix-ms retries an earlier write: give its --request-id too")
    if command == "scan" and args.prefix and (args.start or args.end):
        raise InvalidArgument("scan takes either --prefix or --start/--end, not both")
    if command == "watch" and bool(args.key) == bool(args.prefix):
        raise InvalidArgument("watch takes exactly one of KEY or --prefix")
    if command == "put":  # read before connecting: a value that is too large needs no cluster
        value = put_value(args.value, args.value_file, sys.stdin.buffer)
    endpoints = parse_endpoints(args.endpoints)
    with make_client(endpoints, args.timeout, security=security_of(args)) as client:
        if command == "get":
            printer.get(client.get(args.key, _consistency(args.consistency), args.min_revision))
        elif command == "put":
            printer.put(client.put(args.key, value, args.request_id,
                                   first_attempt_unix_ms=args.first_attempt_unix_ms))
        elif command in ("del", "delete"):
            printer.delete(client.delete(args.key, args.request_id, first_attempt_unix_ms=args.first_attempt_unix_ms))
        elif command == "txn":
            printer.txn(client.txn(compares, success, failure, args.request_id,
                                   first_attempt_unix_ms=args.first_attempt_unix_ms))
        elif command == "scan":
            printer.kvs(_scan(client, args), args.keys_only)
        elif command == "watch":
            return _watch(client, args, printer)
        elif command == "shards":
            printer.shard_map(client.shard_map())
        elif command == "txn-list":
            printer.transactions(client.list_transactions(args.older_than))
        elif command == "fence":
            printer.fenced(client.fence(args.shard))
        else:  # pragma: no cover - argparse only lets known commands through
            raise InvalidArgument(f"unknown command {command!r}")
    return EXIT_OK


def _demo(args: argparse.Namespace, printer: Printer) -> int:
    _export_security(args)
    try:
        from kvstore.dev import demo  # the demo's threads and checks are not needed by other commands
        from kvstore.dev.children import dev_cluster_kill
    except ImportError as exc:
        print(f"kvstore: the demo needs the server extra (pip install 'kvstore[server]'): {exc}", file=sys.stderr)
        return EXIT_ERROR

    try:
        result = demo.failover(parse_endpoints(args.endpoints), kill=dev_cluster_kill(Path(args.data_dir)),
                               clean=args.clean, shard=args.shard,
                               warmup_s=args.warmup, after_s=args.after,
                               writers_per_shard=max(1, args.writers_per_shard),
                               write_timeout_s=args.write_timeout if args.write_timeout > 0 else 10.0)
    except (RuntimeError, TimeoutError, ValueError, ProcessLookupError, PermissionError) as exc:
        print(f"kvstore: demo failed: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    if printer.json:
        printer.record(result)
    else:
        printer.line(demo.report_table(result))
    ok = bool(result["ok"])  # acked_lost, duplicates and failed_but_applied 0, replicas equal
    return EXIT_OK if ok else EXIT_ERROR


def _pipeline(args: argparse.Namespace, printer: Printer) -> int:
    from kvstore.pipeline import commands
    from kvstore.pipeline.errors import PipelineError

    _export_security(args)
    try:
        return commands.run(args, printer)
    except PipelineError as exc:
        print(f"kvstore: {args.command}: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        # A Spark job that failed (its Java stack trace is already in Spark's log on stderr), or
        # py4j after PySpark's own Ctrl-C handler cancelled the jobs: one line, not a traceback.
        if not type(exc).__module__.startswith(("py4j", "pyspark")):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"kvstore: {args.command}: Spark failed: {_one_line(first)[:500]}", file=sys.stderr)
        return EXIT_ERROR


_DURATION_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


def parse_duration_ms(text: str) -> int:
    """'500ms', '30s', '2m', '1h', or a plain number of seconds -> milliseconds."""
    raw = text.strip().lower()
    for unit in ("ms", "s", "m", "h"):
        if raw.endswith(unit):
            number, scale = raw[: -len(unit)], _DURATION_UNITS_MS[unit]
            break
    else:
        number, scale = raw, 1000
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 500ms, 30s, 2m)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a duration cannot be negative: {text!r}")
    return int(value * scale)


def _consistency(text: str) -> Consistency:
    if text == "leader-local":
        return "leader-local"
    if text == "stale":
        return "stale"
    return "linearizable"


def parse_shard_revision(text: str) -> tuple[int, int]:
    """'SHARD:REV' -> (shard, revision). A bare revision is refused: a scan or prefix watch spans
    shards, and a revision is an offset of one shard's WAL, meaningless on the others."""
    shard, sep, revision = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(
            f"a revision across shards names its shard: SHARD:REV, not {text!r} (a revision is an offset of one "
            f"shard's WAL; `kvstore put` prints the shard and revision of a write)")
    try:
        pair = int(shard), int(revision)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not SHARD:REV (two integers): {text!r}") from None
    if min(pair) < 0:
        raise argparse.ArgumentTypeError(f"shard and revision must not be negative: {text!r}")
    return pair


def min_revisions(pairs: Iterable[tuple[int, int]]) -> dict[int, int]:
    """Per shard the highest revision given (a later write of a shard implies the earlier ones)."""
    out: dict[int, int] = {}
    for shard, revision in pairs:
        out[shard] = max(revision, out.get(shard, revision))
    return out


def _scan(client: Client, args: argparse.Namespace) -> Iterable[KeyValue]:
    """At most --limit keys (0 = all), fetched in pages no larger than the server allows."""
    page_size = min(args.limit, MAX_SCAN_LIMIT) if args.limit else 0
    kvs = client.scan_all(args.start, args.end, args.prefix, page_size, _consistency(args.consistency),
                          keys_only=args.keys_only, min_revisions=min_revisions(args.min_revisions))
    for n, kv in enumerate(kvs, start=1):
        yield kv
        if args.limit and n >= args.limit:
            return


def _watch(client: Client, args: argparse.Namespace, printer: Printer) -> int:
    watch = client.watch(args.key, args.prefix, args.start_revision,
                         start_revisions=dict(args.start_revisions) or None)
    printer.event_header()
    try:
        for event in watch:
            printer.event(event)
    except KeyboardInterrupt:
        return EXIT_OK  # the normal way to stop watching
    finally:
        watch.cancel()
    return EXIT_OK


def _serve(argv: list[str]) -> int:
    """Run a server node. Imported only here: the server pulls in Kafka and LevelDB, which the
    client commands never need."""
    try:
        server = importlib.import_module("kvstore.server.app")
    except ImportError as exc:
        print(f"kvstore: cannot start the server: {exc}. A node needs the server extra: "
              "pip install 'kvstore[server]'", file=sys.stderr)
        return EXIT_ERROR
    try:
        rc = server.main(argv)
    except SystemExit as exc:  # the server's own argparse: keep main() returning an int
        rc = exc.code if isinstance(exc.code, int) else EXIT_ERROR if exc.code else EXIT_OK
    return rc if isinstance(rc, int) else EXIT_OK


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvstore` command; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    rest = serve_argv(args_list)
    if rest is not None:
        return _serve(rest)
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse already printed usage or help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("kvstore: error: a command is required", file=sys.stderr)
        return EXIT_USAGE
    printer = Printer(args.output, sys.stdout)
    try:
        return _run(args, printer)
    except InvalidArgument as exc:
        print(f"kvstore: invalid argument: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KvError as exc:
        print(f"kvstore: {_error_name(exc)}: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("kvstore: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`kvstore scan | head`): not an error. Point stdout at devnull so
        # the interpreter's final flush does not complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


_ERROR_NAMES: dict[str, str] = {
    "NotLeader": "not leader", "Unavailable": "unavailable", "UnknownOutcome": "outcome unknown",
    "Overloaded": "overloaded", "DeadlineExceeded": "deadline exceeded", "Cancelled": "cancelled",
    "RequestExpired": "request id expired, outcome unknown", "Unauthenticated": "unauthenticated",
    "PermissionDenied": "permission denied",
}


def _error_name(exc: KvError) -> str:
    name = _ERROR_NAMES.get(type(exc).__name__, "error")
    if isinstance(exc, RequestExpired):
        # Retrying is refused again; only reading the data can tell what happened.
        return f"{name} (check the data before writing again)"
    if exc.request_id and type(exc).__name__ in ("UnknownOutcome", "DeadlineExceeded"):
        # Say how to finish the job safely: the same id (and first-attempt time, so the store
        # can tell a retry it no longer remembers) makes a retry apply at most once.
        first = f" --first-attempt-unix-ms {exc.first_attempt_unix_ms}" if exc.first_attempt_unix_ms else ""
        name += f" (retry with --request-id {exc.request_id}{first})"
    return name


if __name__ == "__main__":
    sys.exit(main())
