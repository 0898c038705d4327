"""The commands whose code is in the server extra: `serve` (a store node) and `demo` (against the
dev cluster). Each imports that code only when it runs, so the base install still has the
commands, and without the extra they exit 1 saying what to install instead of a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from kvstore.cli.client_commands import export_security
from kvstore.cli.parser import parse_endpoints
from kvstore.output import EXIT_ERROR, EXIT_OK, Printer, one_line


def demo(args: argparse.Namespace, printer: Printer) -> int:
    """`kvstore demo failover`: exits 1 unless the takeover lost no acknowledged write and applied
    none twice, so a script (or CI) can run it as a check."""
    export_security(args)
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
        print(f"kvstore: demo failed: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    if printer.json:
        printer.record(result)
    else:
        printer.line(demo.report_table(result))
    ok = bool(result["ok"])  # acked_lost, duplicates and failed_but_applied 0, replicas equal
    return EXIT_OK if ok else EXIT_ERROR


def serve(argv: list[str]) -> int:
    """Run a server node. Imported only here: the server pulls in Kafka and LevelDB, which the
    client commands never need."""
    try:
        server = importlib.import_module("kvstore.server.main")
    except ImportError as exc:
        print(f"kvstore: cannot start the server: {exc}. A node needs the server extra: "
              "pip install 'kvstore[server]'", file=sys.stderr)
        return EXIT_ERROR
    try:
        rc = server.main(argv)
    except SystemExit as exc:  # the server's own argparse: keep main() returning an int
        rc = exc.code if isinstance(exc.code, int) else EXIT_ERROR if exc.code else EXIT_OK
    return rc if isinstance(rc, int) else EXIT_OK
