"""The pipeline's commands in the `kvstore` CLI: snapshot, wal truncate, wal readers, audit, load, changes.

Registered through `kvstore.cli.registry` (this module never imports the CLI, nor the CLI this
one at module level); each command's work lives in the module named after it, imported only
when that command runs (pyspark takes a second to import, and the base install has none, yet
`kvstore --help` lists these commands and each says which extra it needs). Every command takes
`--output table|json`; with json its last line is one JSON object (the job's result), whatever
Spark printed before it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.output import EXIT_ERROR, Printer, one_line
from kvstore.pipeline.errors import PipelineError
from kvstore.pipeline.target import (
    KAFKA_ENV,
    SASL_MECHANISM_ENV,
    SECURITY_PROTOCOL_ENV,
    USERNAME_ENV,
    WalTarget,
    ask_cluster,
    kafka_security,
    resolve,
)

# command name -> "module:function"; the function takes (args, target, printer) and returns an exit status.
_HANDLERS = {
    "snapshot-create": "kvstore.pipeline.snapshot_job:create_command",
    "snapshot-list": "kvstore.pipeline.snapshot_job:list_command",
    "wal-truncate": "kvstore.pipeline.truncate:command",
    "wal-readers": "kvstore.pipeline.readers:command",
    "audit": "kvstore.pipeline.audit:command",
    "load": "kvstore.pipeline.load:command",
    "changes": "kvstore.pipeline.changes:command",
}


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the pipeline's subcommands to the CLI's subparsers (`kvstore.cli.registry`'s contract):
    argparse only, so that `kvstore --help` works without pyspark."""
    wal_opts = argparse.ArgumentParser(add_help=False)
    wal_opts.add_argument("--kafka", default=None, help=f"Kafka bootstrap servers (default ${KAFKA_ENV}, else what a "
                          "node at --endpoints says it uses)")
    wal_opts.add_argument("--topic", default=None,
                          help="WAL topic (default: asked from a node at --endpoints, else <--cluster>.wal)")
    wal_opts.add_argument("--cluster", default=None, help="cluster name, to derive the topic when no node answers")
    wal_opts.add_argument("--kafka-username", default=None,
                          help=f"the pipeline's Kafka principal (default ${USERNAME_ENV}; SASL/SCRAM-SHA-512)")
    wal_opts.add_argument("--kafka-password-file", default=None,
                          help="a file holding its password (default $KVSTORE_KAFKA_PASSWORD_FILE, or the password "
                               "itself in $KVSTORE_KAFKA_PASSWORD)")
    wal_opts.add_argument("--kafka-security-protocol", default=None,
                          help="default $KVSTORE_KAFKA_SECURITY_PROTOCOL, else PLAINTEXT (SASL_PLAINTEXT with a user)")
    wal_opts.add_argument("--kafka-sasl-mechanism", default=None,
                          help="default $KVSTORE_KAFKA_SASL_MECHANISM, else SCRAM-SHA-512")
    spark_opts = argparse.ArgumentParser(add_help=False)
    spark_opts.add_argument("--master", default=None,
                            help="Spark master: local[*] (default, or $KVSTORE_SPARK_MASTER), spark://HOST:7077, "
                                 "k8s://..., yarn")
    spark_opts.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                            help="a Spark setting, as spark-submit takes it (repeatable)")
    parents = [common, wal_opts]

    snap = sub.add_parser("snapshot", parents=[common], help="per-shard snapshots of the store built from the WAL")
    snap_sub = snap.add_subparsers(dest="snapshot_action", metavar="ACTION", required=True)
    p = snap_sub.add_parser("create", parents=[*parents, spark_opts],
                            help="snapshot every shard as of its committed end (from the newest snapshot + WAL)")
    p.add_argument("--dir", required=True, help="snapshot directory (a local path or a Hadoop URI)")
    p.set_defaults(pipeline="snapshot-create", handler=run)
    p = snap_sub.add_parser("list", parents=[common], help="the snapshots in a directory, newest first")
    p.add_argument("--dir", required=True)
    p.set_defaults(pipeline="snapshot-list", handler=run)

    wal = sub.add_parser("wal", parents=[common], help="operate on the WAL topic")
    wal_sub = wal.add_subparsers(dest="wal_action", metavar="ACTION", required=True)
    p = wal_sub.add_parser("truncate", parents=parents,
                           help="verify the newest snapshot, then delete WAL records below its cut - 1, per shard, "
                                "never past a registered reader's position")
    p.add_argument("--dir", required=True, help="the snapshot directory")
    p.add_argument("--dry-run", action="store_true", help="verify and say what would be deleted, delete nothing")
    p.add_argument("--force", action="store_true",
                   help="delete below the cut even where a registered reader still needs the records (it will fail)")
    p.add_argument("--scratch-dir", default=None,
                   help="where the snapshot is loaded to be verified, one shard at a time (default: the system's "
                        "temporary directory; it needs room for the largest shard)")
    p.set_defaults(pipeline="wal-truncate", handler=run)
    p = wal_sub.add_parser("readers", parents=parents,
                           help="the readers that still need the WAL (change feeds, ...), with positions and lag; "
                                "`readers remove NAME` deregisters an abandoned one")
    p.add_argument("readers_action", nargs="?", choices=("list", "remove"), default="list", metavar="list|remove",
                   help="list (default) or remove")
    p.add_argument("name", nargs="?", default=None, help="with remove: the reader's name, as listed")
    p.set_defaults(pipeline="wal-readers", handler=run)

    p = sub.add_parser("audit", parents=[*parents, spark_opts],
                       help="check the WAL (W3), the newest snapshot and every live replica; exit 1 on an anomaly")
    p.add_argument("--dir", required=True, help="the snapshot directory")
    p.set_defaults(pipeline="audit", handler=run)

    p = sub.add_parser("load", parents=[*parents, spark_opts],
                       help="bulk-load a dataset (Parquet, CSV or JSON lines) through the shard leaders")
    p.add_argument("file", help="the dataset: a file or directory, local path or Hadoop URI")
    p.add_argument("--format", choices=("parquet", "csv", "json"), default=None,
                   help="default: from the file name's extension")
    p.add_argument("--batch-rows", type=int, default=None, help="rows per write to a leader")
    p.set_defaults(pipeline="load", handler=run)

    p = sub.add_parser("changes", parents=[*parents, spark_opts],
                       help="the accepted operations as a Parquet table, exactly once (Structured Streaming)")
    p.add_argument("--to", required=True, help="output directory (local path or Hadoop URI)")
    p.add_argument("--follow", action="store_true", help="keep running and append new operations as they commit")
    p.add_argument("--checkpoint", default=None, help="streaming checkpoint (default <--to>/_checkpoint)")
    p.add_argument("--interval", type=float, default=5.0, metavar="S", help="with --follow: seconds between batches")
    p.set_defaults(pipeline="changes", handler=run)


def run(args: argparse.Namespace, printer: Printer) -> int:
    """Run the pipeline command `args.pipeline` (the CLI's handler of every command here). A job
    that refused or failed is one line on stderr and exit 1, never a traceback: the CLI's rule."""
    try:
        return _run(args, printer)
    except PipelineError as exc:
        print(f"kvstore: {args.command}: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        # A Spark job that failed (its Java stack trace is already in Spark's log on stderr), or
        # py4j after PySpark's own Ctrl-C handler cancelled the jobs: one line, not a traceback.
        if not type(exc).__module__.startswith(("py4j", "pyspark")):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"kvstore: {args.command}: Spark failed: {one_line(first)[:500]}", file=sys.stderr)
        return EXIT_ERROR


def _run(args: argparse.Namespace, printer: Printer) -> int:
    name: str = args.pipeline
    module_name, _, function = _HANDLERS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PipelineError(f"`kvstore {name}` needs the spark extra: pip install 'kvstore[spark]' ({exc})") from exc
    handler: Callable[..., int] = getattr(module, function)
    target: WalTarget | None = None
    if hasattr(args, "kafka"):  # commands that read or write the WAL
        endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
        # One shard map tells the topic, the brokers and their security mode (never a credential:
        # the login is this shell's, KVSTORE_KAFKA_USERNAME and its password file).
        needs = args.topic is None or not (args.kafka or os.environ.get(KAFKA_ENV)) or not (
            args.kafka_security_protocol or os.environ.get(SECURITY_PROTOCOL_ENV))
        told = ask_cluster(endpoints, args.timeout) if needs else None
        security = kafka_security(
            args.kafka_security_protocol or os.environ.get(SECURITY_PROTOCOL_ENV) or (told.security_protocol
                                                                                       if told else None),
            args.kafka_sasl_mechanism or os.environ.get(SASL_MECHANISM_ENV) or (told.sasl_mechanism if told else None),
            args.kafka_username, args.kafka_password_file)
        target = resolve(args.kafka, args.topic, args.cluster, told, args.timeout, security)
    return handler(args, target, printer)


def stderr_progress(command: str) -> Callable[[str], None]:
    """A job's phases as lines on stderr while it runs (stdout keeps its result alone, for a
    script), each with the seconds since the command started."""
    import time

    started = time.monotonic()

    def say(text: str) -> None:
        print(f"kvstore {command}: {time.monotonic() - started:5.1f}s {text}", file=sys.stderr, flush=True)

    return say


def spark_for(args: argparse.Namespace, app_name: str) -> Any:
    """The session for a command's `--master` and `--conf`."""
    from kvstore.pipeline.session import parse_conf, spark_session

    try:
        conf = parse_conf(args.conf)
    except ValueError as exc:
        raise PipelineError(str(exc)) from exc
    return spark_session(args.master, app_name=app_name, conf=conf)


def local_path(uri: str) -> Path | None:
    """The local path of a `file://` URI or a plain path; None for other schemes (s3a://, ...)."""
    if uri.startswith("file://"):
        return Path(uri[len("file://"):])
    if "://" in uri:
        return None
    return Path(os.path.abspath(uri))
