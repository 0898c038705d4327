"""The package rules of docs/development.md, "Packages", held by reading every import (module level and inside
functions) of every module: who may import what, so a base install stays grpcio + protobuf, the
core stays pure, and the log stays ignorant of the store."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli.registry import COMMAND_GROUPS

ROOT = Path(__file__).resolve().parents[2]

# What the pure core may import from the standard library: nothing that does I/O, reads a clock,
# draws random numbers or schedules anything. Add a module here only if that stays true.
CORE_STDLIB = {"__future__", "abc", "bisect", "collections", "copy", "dataclasses", "enum", "functools", "hashlib",
               "json",
               "heapq", "itertools", "math", "operator", "re", "struct", "typing", "zlib"}
CORE_KVSTORE = ("kvstore.core", "kvstore.v1", "kvstore.internal.v1", "kvstore.errors", "kvstore.limits")
# The log's pure rules the core shares instead of restating them (each checked pure below).
CORE_WAL = ("wal.offsets", "wal.errors")

HEAVY = ("confluent_kafka", "plyvel", "pyarrow", "pyspark", "pandas", "prometheus_client", "grpc_health",
         "grpc_reflection")


def _sources(package: str) -> list[Path]:
    path = ROOT / package
    files = [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
    return [f for f in files if "_pb2" not in f.name]


def _imports(path: Path, *, module_level_only: bool = False) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in `path`; relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            yield node.lineno, module
            if module in ("kvstore", "wal"):  # `from kvstore import errors` imports kvstore.errors
                for alias in node.names:
                    yield node.lineno, f"{module}.{alias.name}"


def _module_level_closure(module: str) -> dict[str, str]:
    """Every module that importing `module` imports (its packages too), following module-level
    imports through this repository's files, each with the module that first imported it."""
    seen: dict[str, str] = {}
    pending = [(module, "(registered)")]
    while pending:
        name, importer = pending.pop()
        if name in seen:
            continue
        seen[name] = importer
        parent = name.rpartition(".")[0]
        if parent:  # a package's __init__ runs before its modules
            pending.append((parent, importer))
        base = ROOT.joinpath(*name.split("."))
        path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
        if path is not None:
            pending += [(imported, name) for _, imported in _imports(path, module_level_only=True)]
    return seen


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _violations(package: str, forbidden: tuple[str, ...], *, module_level_only: bool = False) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {module}"
            for path in _sources(package) for line, module in _imports(path, module_level_only=module_level_only)
            if _within(module, forbidden)]


def test_the_sources_are_where_the_rules_expect_them() -> None:
    for package in ("wal", "kvstore/core", "kvstore/storage", "kvstore/server", "kvstore/client", "kvstore/cli",
                    "kvstore/dev", "kvstore/pipeline", "kvstore/errors.py", "kvstore/limits.py", "kvstore/output.py"):
        assert _sources(package), f"{package} has no sources: update this test and docs/development.md 'Packages'"


def test_the_core_is_pure() -> None:
    """No I/O, no clock, no Kafka, LevelDB or gRPC calls: the standard library's pure modules,
    the generated messages and the shared errors and limits."""
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in _sources("kvstore/core") for line, module in _imports(path)
             if module.split(".")[0] not in CORE_STDLIB and not _within(module, CORE_KVSTORE + CORE_WAL)
             and module not in ("kvstore", "collections.abc")]
    assert not wrong, "kvstore.core must stay pure (docs/development.md 'Packages'):\n" + "\n".join(wrong)


@pytest.mark.parametrize("module", CORE_WAL)
def test_what_the_core_takes_from_the_log_is_pure_and_loads_no_kafka_client(module: str) -> None:
    """`import wal.offsets` runs wal/__init__ first: it must stay lazy (no librdkafka), and the
    module itself must import nothing but the pure standard library."""
    import subprocess
    import sys

    path = ROOT / (module.replace(".", "/") + ".py")
    wrong = [m for _, m in _imports(path) if m.split(".")[0] not in CORE_STDLIB]
    assert not wrong, f"{module} is shared with the pure core and must stay pure: {wrong}"
    probe = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", f"import {module} loaded {loaded.stdout.strip()}"


def test_the_log_knows_nothing_of_the_store() -> None:
    assert not _violations("wal", ("kvstore",))


@pytest.mark.parametrize("package", ["kvstore/client", "kvstore/errors.py", "kvstore/limits.py", "kvstore/output.py"])
def test_the_base_install_needs_only_grpcio_and_protobuf(package: str) -> None:
    forbidden = ("wal", "kvstore.server", "kvstore.storage", "kvstore.internal", "kvstore.cli", "kvstore.dev",
                 "kvstore.pipeline", *HEAVY)
    assert not _violations(package, forbidden)


def test_shared_modules_import_no_other_kvstore_module() -> None:
    wrong = [v for package in ("kvstore/errors.py", "kvstore/limits.py", "kvstore/output.py")
             for v in _violations(package, ("kvstore",))]
    assert not wrong


def test_the_output_helpers_need_only_the_standard_library() -> None:
    """kvstore.output is what the CLI and the pipeline's commands both print with: nothing of
    either, and nothing a base install lacks."""
    wrong = [f"kvstore/output.py:{line} imports {module}" for line, module in _imports(ROOT / "kvstore" / "output.py")
             if module.split(".")[0] not in sys.stdlib_module_names]
    assert not wrong


def test_the_cli_imports_anything_beyond_the_client_only_where_a_command_needs_it() -> None:
    forbidden = ("wal", "kvstore.server", "kvstore.storage", "kvstore.pipeline", "kvstore.dev", "kvstore.internal",
                 *HEAVY)
    assert not _violations("kvstore/cli", forbidden, module_level_only=True)


def test_a_node_never_imports_client_side_or_spark_code() -> None:
    forbidden = ("kvstore.client", "kvstore.cli", "kvstore.dev", "kvstore.pipeline", "pyspark", "pandas")
    assert not _violations("kvstore/server", forbidden)


def test_the_pipeline_never_reaches_into_a_node() -> None:
    """The pipeline reads and writes the replicas' formats through kvstore.storage, the package
    a node uses for them too; a node's internals (kvstore.server) are none of its business."""
    assert not _violations("kvstore/pipeline", ("kvstore.server",))


def test_storage_is_shared_by_the_node_and_the_pipeline_and_knows_neither() -> None:
    assert not _violations("kvstore/storage", ("kvstore.server", "kvstore.pipeline", "kvstore.client", "kvstore.cli",
                                               "kvstore.dev", "pyspark", "confluent_kafka", "grpc"))


def test_dev_tooling_and_the_pipeline_are_leaves() -> None:
    """Only the CLI reaches the dev tools (inside the commands that need them) and the pipeline
    (through its command registry, below)."""
    wrong = [v for package in ("wal", "kvstore/core", "kvstore/storage", "kvstore/server", "kvstore/client",
                               "kvstore/errors.py", "kvstore/limits.py", "kvstore/output.py")
             for v in _violations(package, ("kvstore.dev", "kvstore.pipeline"))]
    wrong += _violations("kvstore/dev", ("kvstore.pipeline",))
    assert not wrong


def test_the_cli_and_the_pipeline_never_import_each_other() -> None:
    """The pipeline prints with kvstore.output, never with the CLI; the CLI names the pipeline's
    commands only in `kvstore.cli.registry` (a "module:function" string), imported when it builds
    its parser, so it imports no pipeline module anywhere."""
    wrong = _violations("kvstore/pipeline", ("kvstore.cli",)) + _violations("kvstore/cli", ("kvstore.pipeline",))
    assert not wrong


@pytest.mark.parametrize("entry", COMMAND_GROUPS)
def test_a_registered_command_group_imports_no_job_at_parse_time(entry: str) -> None:
    """`kvstore --help` imports every registered group: what that runs (module-level imports,
    followed through the repository) is base-install code only. The jobs (pyspark, the node's
    storage, the WAL's Kafka clients) are imported inside the handlers, when a command runs."""
    module, _, function = entry.partition(":")
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    assert path.is_file() and f"def {function}(" in path.read_text(), f"{entry}: no such function"
    forbidden = ("wal", "kvstore.server", "kvstore.storage", "kvstore.internal", "kvstore.dev", "kvstore.cli", *HEAVY)
    wrong = [f"{name} (imported by {importer})" for name, importer in sorted(_module_level_closure(module).items())
             if _within(name, forbidden)]
    assert not wrong, f"{entry} pulls in more than the base install at parse time:\n" + "\n".join(wrong)
