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
    serve ARGS...            (runs kvstore.server.main.main(ARGS))

The common options are accepted before or after the command. `--endpoints` defaults to
$KVSTORE_ENDPOINTS, else 127.0.0.1:50051. A secure cluster (docs/security.md): `--ca FILE`
(the CA of the nodes' certificates), `--token-file FILE` or `--token T` (a bearer token), `--cert
FILE --key FILE` (a client certificate: mutual TLS), each defaulting to $KVSTORE_CA,
$KVSTORE_TOKEN_FILE, $KVSTORE_TOKEN, $KVSTORE_CERT, $KVSTORE_KEY; any of them turns TLS on.

Txn syntax: see `TXN_SYNTAX` in `kvstore.cli.txn_syntax` (also `kvstore txn --help`).

Output: `table` (default) is for people; `json` prints one JSON object per line. Keys and
values are UTF-8 strings when they decode, else base64 with `"<field>_base64": true`.
A missing key is not an error: `get` prints "(not found)" (json: `"found": false`), exit 0.

Exit status (docs/cli.md; `kvstore.output`): 0 success (and Ctrl-C during `watch`); 1 a definite
failure (the store refused, or did nothing); 2 invalid arguments or a request the server refused
as invalid; 3 a write's outcome is unknown; 4 unreachable (no attempt reached any node: nothing
was sent); 130 Ctrl-C elsewhere. Errors are one line on stderr, never a traceback; with
`--output json`, one JSON object (`error_record`: reason, outcome, request id, first attempt).

Writes and unknown outcomes (W7): a write that may or may not have committed exits 3 with
"outcome unknown (retry with --request-id ID --first-attempt-unix-ms MS)"; running the same
command with those two options applies it at most once. If the store no longer remembers that
id it refuses the retry ("request id expired", exit 3): the write's outcome is then unknown for
good, and only reading the data tells. Any other error of a write (Ctrl-C aside) means it did
not happen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from kvstore.cli import client_commands, extra_commands, tools
from kvstore.cli.client_commands import error_name, error_record, exit_status, min_revisions
from kvstore.cli.output import ResultPrinter
from kvstore.cli.parser import (
    DEFAULT_ENDPOINT,
    ENDPOINTS_ENV,
    build_parser,
    parse_duration_ms,
    parse_endpoints,
    parse_shard_revision,
    serve_argv,
)
from kvstore.cli.registry import Handler
from kvstore.cli.txn_syntax import TXN_SYNTAX, TxnSyntaxError, parse_compare, parse_op, parse_txn
from kvstore.client import KvError
from kvstore.output import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, display, format_table, one_line

# The names scripts and tests imported from `kvstore.cli` when it was one module.
__all__ = [
    "DEFAULT_ENDPOINT",
    "ENDPOINTS_ENV",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "TXN_SYNTAX",
    "TxnSyntaxError",
    "build_parser",
    "display",
    "format_table",
    "main",
    "min_revisions",
    "parse_compare",
    "parse_duration_ms",
    "parse_endpoints",
    "parse_op",
    "parse_shard_revision",
    "parse_txn",
    "serve_argv",
]


def _run(args: argparse.Namespace, printer: ResultPrinter) -> int:
    """Hand the parsed command to the module of its group."""
    if args.command == "demo":
        return extra_commands.demo(args, printer)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is not None:  # a registered group's command (the pipeline's)
        client_commands.export_security(args)
        return handler(args, printer)
    return client_commands.run(args, printer)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvstore` command; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    rest = serve_argv(args_list)
    if rest is not None:
        return extra_commands.serve(rest)
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse already printed usage or help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("kvstore: error: a command is required", file=sys.stderr)
        return EXIT_USAGE
    printer = ResultPrinter(args.output, sys.stdout)
    if args.command == "completion":  # generated from the parser itself: never behind a new option
        sys.stdout.write(tools.completion(args.shell, parser))
        return EXIT_OK
    try:
        return _run(args, printer)
    except KvError as exc:
        if printer.json:  # one object a script can read: outcome, request id, reason
            print(json.dumps(error_record(exc), ensure_ascii=False, separators=(",", ":")), file=sys.stderr)
        else:
            print(f"kvstore: {error_name(exc)}: {one_line(str(exc))}", file=sys.stderr)
        return exit_status(exc)
    except KeyboardInterrupt:
        print("kvstore: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`kvstore scan | head`): not an error. Point stdout at devnull so
        # the interpreter's final flush does not complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
