"""Command groups the `kvstore` command offers but does not own: their code lives in a package of
its own (an extra), which registers its subcommands here instead of being imported by the CLI.

The CLI names each group by a "module:function" string and imports it only while building its
parser, so `kvstore.cli` never imports such a package at module level, and such a package never
imports `kvstore.cli`. A registration module must stay importable on the base install (grpcio and
protobuf, no pyspark): it only defines argparse subcommands and imports its jobs when one runs.
`tests/unit/test_layering.py` reads each module named here and holds that.

The contract of a registration function, `register(sub, common)`: `sub` is the CLI's subparsers
action and `common` the parser of the options every command takes (to pass as a parent). Each
runnable subcommand sets the default `handler`, a `Handler`: it gets the parsed arguments and the
CLI's printer and returns the exit status. Before it runs, the CLI exports its TLS and token flags
as KVSTORE_* variables, for the connections such a command opens on its own (Spark executors).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from kvstore.output import Printer

Handler = Callable[[argparse.Namespace, Printer], int]

# The pipeline's commands: snapshot, wal truncate, wal readers, audit, load, changes.
COMMAND_GROUPS: tuple[str, ...] = ("kvstore.pipeline.commands:register",)


def register_all(sub: Any, common: argparse.ArgumentParser) -> None:
    """Let every group add its subcommands. An import error is not caught: a registration module
    is part of the base install, so failing to import it is a bug to see, not an extra to name."""
    for entry in COMMAND_GROUPS:
        module_name, _, function = entry.partition(":")
        register: Callable[[Any, argparse.ArgumentParser], None] = getattr(
            importlib.import_module(module_name), function)
        register(sub, common)
