"""The `kvstore` command's arguments: the options every command takes, each command's own, and the
types that check them, so that a wrong argument exits 2 with usage before anything connects.

The pipeline's commands are added through `kvstore.cli.registry`, and `serve` is split off before
argparse runs (`serve_argv`): its arguments belong to the server.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

import kvstore
from kvstore import limits
from kvstore.cli.registry import register_all
from kvstore.cli.txn_syntax import TXN_SYNTAX
from kvstore.client import CONSISTENCIES, InvalidArgument

DEFAULT_ENDPOINT = "127.0.0.1:50051"
ENDPOINTS_ENV = "KVSTORE_ENDPOINTS"
DEV_DATA_DIR_ENV = "KVSTORE_DEV_DATA_DIR"
# The common options that take a value: `serve_argv` skips them (and their values) to find the command.
_GLOBAL_VALUE_OPTIONS = ("--endpoints", "--timeout", "--output", "--ca", "--cert", "--key", "--token", "--token-file")


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

    # On a command, in a group of their own: its help lists the command's own options first.
    group: Any = parser if defaults else parser.add_argument_group(
        "global options", "accepted before or after the command")

    group.add_argument("--endpoints", default=default(os.environ.get(ENDPOINTS_ENV) or DEFAULT_ENDPOINT),
                        help=f"comma-separated host:port list (default: ${ENDPOINTS_ENV} or {DEFAULT_ENDPOINT})")
    group.add_argument("--timeout", type=_positive_float, default=default(5.0), metavar="SECONDS",
                        help="deadline of each request, retries included (default: 5)")
    group.add_argument("--output", "-o", choices=("table", "json"), default=default("table"),
                        help="table for people, json for scripts: one object per line (default: table)")
    # Security (docs/security.md): None = the KVSTORE_* variable; any of them turns TLS on.
    group.add_argument("--ca", dest="tls_ca", default=default(None), metavar="FILE",
                        help="CA certificate (PEM) of the nodes: TLS (default: $KVSTORE_CA)")
    group.add_argument("--cert", dest="tls_cert", default=default(None), metavar="FILE",
                        help="client certificate (PEM) for mutual TLS; its role is in it (default: $KVSTORE_CERT)")
    group.add_argument("--key", dest="tls_key", default=default(None), metavar="FILE",
                        help="the client certificate's key (default: $KVSTORE_KEY)")
    group.add_argument("--token", default=default(None),
                        help="bearer token, sent over TLS only (default: $KVSTORE_TOKEN; visible to `ps`: prefer "
                             "--token-file)")
    group.add_argument("--token-file", default=default(None), metavar="FILE",
                        help="file holding the bearer token (default: $KVSTORE_TOKEN_FILE)")


class _Parser(argparse.ArgumentParser):
    """No abbreviated options, in this parser and every subcommand's (they are built with its
    class): a prefix can become ambiguous, or worse mean another option, as soon as an option is
    added (`changes --to` read as `--token` once the TLS options came)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; built per run, since the defaults read the environment."""
    parser = _Parser(
        prog="kvstore", description="Client for the kvstore sharded key-value store.",
        epilog="Txn syntax: `kvstore txn --help`. With --output json every result is one JSON object per line; "
        "bytes that are not UTF-8 are base64 with a <field>_base64 flag; an error is one JSON object on stderr. "
        "Exit status: 0 ok, 1 failed (nothing happened), 2 invalid arguments, 3 a write's outcome unknown (retry "
        "with the --request-id it prints), 4 no node reached (nothing was sent), 130 interrupted (docs/cli.md).",
    )
    _add_common(parser, defaults=True)
    parser.add_argument("--version", action="version", version=f"kvstore {kvstore.__version__}",
                        help="print the installed kvstore version and exit")
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
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--print-value-only", action="store_true",
                       help="write only the value's bytes to stdout, as they are (nothing for a missing key)")
    shown.add_argument("--out", metavar="FILE", default=None,
                       help="write the value's bytes to FILE (binary values round-trip: put --value-file)")
    shown.add_argument("--hex", action="store_true", help="show the key and the value as hex")

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
        "txn", parents=[common],
        help="atomic compare-and-write over keys of any shards; `txn list [--in-doubt]`, `txn resolve TXN`",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=TXN_SYNTAX,
    )
    p.add_argument("action", nargs="?", choices=["list", "resolve"], default=None,
                   help="`list`: shards whose WAL transaction is open (with --in-doubt: prepared cross-shard "
                        "transactions); `resolve TXN`: end a prepared cross-shard transaction now (its decision, "
                        "or abort if there is none) instead of a Txn")
    p.add_argument("txn_id", nargs="?", default="", metavar="TXN", help="with `resolve`: the transaction's id")
    p.add_argument("--in-doubt", action="store_true",
                   help="with `list`: cross-shard transactions prepared and not resolved, at every shard's leader")
    p.add_argument("--older-than", type=parse_duration_ms, default=0, metavar="DURATION",
                   help="with `list`: only transactions open (prepared) at least this long (e.g. 500ms, 30s, 2m)")
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
    sub.add_parser("health", parents=[common], help="ask each endpoint whether it serves (grpc.health.v1); exit 0 "
                   "if all do, 4 if none answered, else 1")
    p = sub.add_parser("completion", help="print a shell completion script: eval \"$(kvstore completion bash)\"")
    p.add_argument("shell", choices=["bash", "zsh", "fish"])

    p = sub.add_parser("fence", parents=[common],
                       help="force-terminate a shard's WAL transaction (fresh init_transactions on its id)")
    p.add_argument("shard", type=_non_negative_int)

    p = sub.add_parser("drain", parents=[common], help="move every shard off a node before it is removed, with "
                       "progress until done (docs/operations.md, \"Placement\")")
    p.add_argument("node", help="the node id")
    p.add_argument("--undo", action="store_true", help="let the node hold shards again")
    p.add_argument("--force", action="store_true", help="drain although a shard is left with fewer than R nodes "
                   "able to hold it (refused otherwise, naming the shards)")
    _epoch_flag(p)
    _wait_flags(p)

    p = sub.add_parser("move", parents=[common], help="move one replica of a shard to a node, with progress until "
                       "done (pins the shard; --unpin returns it to the placement rule)")
    p.add_argument("shard", type=_non_negative_int)
    p.add_argument("--to", dest="to_node", default="", metavar="NODE", help="the node to hold a replica")
    p.add_argument("--from", dest="from_node", default="", metavar="NODE",
                   help="the replica that gives way (default: the shard's last replica)")
    p.add_argument("--unpin", action="store_true", help="drop the shard's pin: the placement rule decides again")
    _epoch_flag(p)
    _wait_flags(p)

    p = sub.add_parser("placement", parents=[common], help="the placement log: its recent decisions with their "
                       "reasons, the epoch and the controller")
    p.add_argument("what", choices=["log"])
    p.add_argument("--limit", type=_non_negative_int, default=50, help="the newest N decisions (default 50, at most "
                   "1000)")

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
    register_all(sub, common)  # the pipeline's commands: argparse only, no pyspark import
    sub.add_parser("serve", add_help=False, help="run a server node (all further arguments go to the server)")
    return parser


def _epoch_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epoch", type=_non_negative_int, default=None, metavar="N",
                   help="the placement epoch you decided from (`kvstore shards` shows it); refused if the placement "
                        "moved since (default: the epoch now)")


def _wait_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-wait", action="store_true", help="print the changes to expect and return at once")
    p.add_argument("--wait-timeout", type=float, default=600.0, metavar="S",
                   help="give up waiting after S seconds (exit 1; the moves go on; default 600)")


def serve_argv(argv: Sequence[str]) -> list[str] | None:
    """The server's arguments when the command is `serve`, else None.

    `serve` is split off before argparse: its arguments belong to `kvstore.server.main`, whose options
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



def parse_endpoints(text: str) -> list[str]:
    """The `--endpoints` list, refused here when empty so that the error names the option."""
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    if not endpoints:
        raise InvalidArgument("--endpoints is empty")
    return endpoints


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

