"""The commands that are calls of `kvstore.client`: get, put, del, txn (and `txn list`), scan,
watch, shards, fence, drain, move. They need the base install only.

Everything that can be refused without the cluster (Txn syntax, conflicting options, a value too
large) is checked before connecting, so a mistake costs no round trip and says what was wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from typing import BinaryIO

from kvstore import limits
from kvstore.cli import tools
from kvstore.cli.output import ResultPrinter
from kvstore.cli.parser import parse_endpoints
from kvstore.cli.txn_syntax import parse_txn
from kvstore.client import (
    BatchIncomplete,
    Client,
    ClientSecurity,
    Consistency,
    InvalidArgument,
    KeyValue,
    KvError,
    PlacementChange,
    RequestExpired,
    UnknownOutcome,
    Unreachable,
)
from kvstore.limits import MAX_SCAN_LIMIT
from kvstore.output import EXIT_ERROR, EXIT_OK, EXIT_UNKNOWN, EXIT_UNREACHABLE, EXIT_USAGE, one_line


def make_client(endpoints: Sequence[str], timeout_s: float, security: ClientSecurity | None = None) -> Client:
    """The client factory (a seam: tests swap it for a fake)."""
    return Client(endpoints, timeout_s=timeout_s, security=security)


def security_of(args: argparse.Namespace) -> ClientSecurity:
    """TLS and credentials: the flags over the KVSTORE_* environment."""
    return ClientSecurity.from_env(ca=getattr(args, "tls_ca", None), cert=getattr(args, "tls_cert", None),
                                   key=getattr(args, "tls_key", None), token=getattr(args, "token", None),
                                   token_file=getattr(args, "token_file", None))


def export_security(args: argparse.Namespace) -> None:
    """The flags as KVSTORE_* variables, for commands whose code opens its own connections from
    the environment (the demo's clients, the pipeline's Spark executors)."""
    os.environ.update(security_of(args).environ())


def run(args: argparse.Namespace, printer: ResultPrinter) -> int:
    """Run the client command `args.command` on a client of its own, closed when it is done."""
    command: str = args.command
    if command == "txn" and args.action in ("list", "resolve"):
        if args.compares or args.success or args.failure:
            raise InvalidArgument(f"`txn {args.action}` takes no --if/--then/--else")
        if args.action == "resolve" and not args.txn_id:
            raise InvalidArgument("`txn resolve` needs the transaction's id (see `txn list --in-doubt`)")
        command = "txn-list" if args.action == "list" else "txn-resolve"
    elif command == "txn" and (args.txn_id or args.in_doubt):
        raise InvalidArgument("a transaction id and --in-doubt go with `txn list` / `txn resolve`")
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
    if command == "health":  # each endpoint on its own, not through a client that retries elsewhere
        return tools.health(endpoints, security_of(args), args.timeout, printer)
    with make_client(endpoints, args.timeout, security=security_of(args)) as client:
        if command == "get":
            _get(client, args, printer)
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
        elif command == "txn-list" and args.in_doubt:
            printer.prepared(*client.prepared_transactions(args.older_than))
        elif command == "txn-list":
            printer.transactions(client.list_transactions(args.older_than))
        elif command == "txn-resolve":
            resolution = client.resolve_transaction(args.txn_id)
            printer.resolution(resolution)
            return EXIT_OK if resolution.outcome in ("committed", "aborted", "not prepared") else EXIT_ERROR
        elif command == "fence":
            printer.fenced(client.fence(args.shard))
        elif command == "drain":
            return _follow(client, client.drain(args.node, undo=args.undo, force=args.force, epoch=args.epoch),
                           args, printer)
        elif command == "move":
            return _follow(client, client.move_shard(args.shard, args.to_node, args.from_node, unpin=args.unpin,
                                                     epoch=args.epoch), args, printer)
        elif command == "placement":
            printer.placement_log(client.placement_log(args.limit))
        else:  # pragma: no cover - argparse only lets known commands through
            raise InvalidArgument(f"unknown command {command!r}")
    return EXIT_OK


def _follow(client: Client, changes: list[PlacementChange], args: argparse.Namespace, printer: ResultPrinter) -> int:
    """Print the changes a drain or move asked for, then (unless --no-wait) its progress until
    done; exit 1 if --wait-timeout passed first (the moves go on)."""
    printer.placement_changes(changes)
    if args.no_wait or not changes:
        return EXIT_OK
    result = client.wait_moves(changes, timeout_s=args.wait_timeout, on_progress=printer.move_progress)
    if result.done:
        return EXIT_OK
    print(f"kvstore: not done after {args.wait_timeout:.0f} s ({len(result.left)} of {len(changes)} shard moves "
          "left); the moves go on: `kvstore shards` shows them", file=sys.stderr)
    return EXIT_ERROR


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



def _consistency(text: str) -> Consistency:
    if text == "leader-local":
        return "leader-local"
    if text == "stale":
        return "stale"
    return "linearizable"


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


def _get(client: Client, args: argparse.Namespace, printer: ResultPrinter) -> None:
    """`get`, its value shown (as text or hex), written raw to stdout (`--print-value-only`,
    nothing for a missing key, as etcdctl's) or to a file (`--out`): binary values round-trip."""
    result = client.get(args.key, _consistency(args.consistency), args.min_revision)
    if args.print_value_only:
        if result.kv is not None:
            sys.stdout.buffer.write(result.kv.value)
            sys.stdout.buffer.flush()
        return
    if args.out is not None and result.kv is not None:
        with open(args.out, "wb") as out:
            out.write(result.kv.value)
    printer.get(result, hex_bytes=args.hex, value_in=args.out if result.kv is not None else None)


def _watch(client: Client, args: argparse.Namespace, printer: ResultPrinter) -> int:
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


_ERROR_NAMES: dict[str, str] = {
    "NotLeader": "not leader", "Unavailable": "unavailable", "UnknownOutcome": "outcome unknown",
    "Unreachable": "unreachable, nothing was sent", "InvalidArgument": "invalid argument",
    "Overloaded": "overloaded", "DeadlineExceeded": "deadline exceeded", "Cancelled": "cancelled",
    "RequestExpired": "request id expired, outcome unknown", "Unauthenticated": "unauthenticated",
    "PermissionDenied": "permission denied",
}


def error_name(exc: KvError) -> str:
    """How a failed call is named on stderr; for a write whose outcome is unknown, with the
    options that finish it safely (`kvstore.cli`'s docstring: "Writes and unknown outcomes")."""
    name = _by_class(exc, _ERROR_NAMES, "error")
    if isinstance(exc, RequestExpired):
        # Retrying is refused again; only reading the data can tell what happened.
        return f"{name} (check the data before writing again)"
    if exc.request_id and isinstance(exc, UnknownOutcome):
        # Say how to finish the job safely: the same id (and first-attempt time, so the store
        # can tell a retry it no longer remembers) makes a retry apply at most once.
        first = f" --first-attempt-unix-ms {exc.first_attempt_unix_ms}" if exc.first_attempt_unix_ms else ""
        name += f" (retry with --request-id {exc.request_id}{first})"
    return name


def _by_class(exc: KvError, table: dict[str, str], default: str) -> str:
    """The entry of the error's class, else of its nearest base (CrossShardTxn: InvalidArgument's)."""
    return next((table[c.__name__] for c in type(exc).__mro__ if c.__name__ in table), default)


def exit_status(exc: KvError) -> int:
    """The exit status of a failed call (kvstore.output): an unknown outcome, no node reached,
    invalid, or any other definite failure."""
    if isinstance(exc, InvalidArgument):
        return EXIT_USAGE
    if isinstance(exc, UnknownOutcome | RequestExpired) or (isinstance(exc, BatchIncomplete) and exc.unknown):
        return EXIT_UNKNOWN
    if isinstance(exc, Unreachable):
        return EXIT_UNREACHABLE
    return EXIT_ERROR


# A reason for the errors the client decides itself (the server's ErrorInfo reason otherwise).
_CLIENT_REASONS: dict[str, str] = {
    "Unreachable": "UNREACHABLE", "UnknownOutcome": "OUTCOME_UNKNOWN", "DeadlineExceeded": "DEADLINE_EXCEEDED",
    "Cancelled": "CANCELLED", "Unavailable": "UNAVAILABLE", "InvalidArgument": "INVALID_ARGUMENT",
    "RequestExpired": "REQUEST_ID_EXPIRED",
}


def error_record(exc: KvError) -> dict[str, object]:
    """A failed call as one JSON object (stderr under `--output json`), so a script reads the
    outcome and the request id to retry with instead of scraping a sentence."""
    status = exit_status(exc)
    return {"error": one_line(str(exc)), "kind": _by_class(exc, _ERROR_NAMES, "error"),
            "reason": exc.reason or _by_class(exc, _CLIENT_REASONS, ""),
            "code": exc.code.name if exc.code is not None else "",
            "outcome": "unknown" if status == EXIT_UNKNOWN else "none",
            "request_id": exc.request_id or "", "first_attempt_unix_ms": exc.first_attempt_unix_ms or 0,
            "attempts": exc.attempts, "target": exc.target or "", "exit_status": status}
