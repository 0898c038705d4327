"""What a fuzz run did, counted across its tests and printed at the end (tests/fuzz/conftest.py):
cases by method, mode and answer, and how many times the node's liveness and the state digests
were checked. A failed check fails its test at once, so a green run means zero crashes and zero
state changes; the tally says how many cases that zero stands for."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

cases: collections.Counter[tuple[str, str, str]] = collections.Counter()
checks = {"alive": 0, "state": 0}


def record(method: str, mode: str, code: str) -> None:
    cases[(method, mode, code)] += 1


def crashes_checked() -> None:
    checks["alive"] += 1


def state_checked() -> None:
    checks["state"] += 1


def summary() -> dict[str, object]:
    by_code: collections.Counter[str] = collections.Counter()
    by_method: collections.Counter[str] = collections.Counter()
    for (method, _mode, code), n in cases.items():
        by_code[code] += n
        by_method[method] += n
    return {"cases": sum(cases.values()), "methods": len(by_method), "by_code": dict(by_code.most_common()),
            "by_method": dict(sorted(by_method.items())), "alive_checks": checks["alive"],
            "state_checks": checks["state"]}


def write(path: str | None = None) -> None:
    target = path or os.environ.get("FUZZ_REPORT")
    if target:
        Path(target).write_text(json.dumps(summary(), indent=2) + "\n")
