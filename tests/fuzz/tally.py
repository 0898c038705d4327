"""What a fuzz run did, counted across its tests and printed at the end (tests/fuzz/conftest.py):
cases by method, mode and answer, requests by size zone, how many times the node's liveness and
the state digests were checked, and a digest of every request sent. A failed check fails its test
at once, so a green run means zero crashes and zero state changes; the tally says how many cases
that zero stands for, and the input digests show that two runs with one seed sent the same bytes."""

from __future__ import annotations

import collections
import hashlib
import json
import os
from pathlib import Path

from tests.fuzz import seeding

cases: collections.Counter[tuple[str, str, str]] = collections.Counter()
zones: collections.Counter[str] = collections.Counter()
checks = {"alive": 0, "state": 0}
# Per test ("<mode> <Service.Method>"): sha256 over its requests in the order sent, each prefixed
# by its length, so a different order, split or byte changes it.
_inputs: dict[str, hashlib._Hash] = {}


def record(method: str, mode: str, code: str) -> None:
    cases[(method, mode, code)] += 1


def sent(test_id: str, raw: bytes, zone: str) -> None:
    digest = _inputs.setdefault(test_id, hashlib.sha256())
    digest.update(len(raw).to_bytes(8, "big"))
    digest.update(raw)
    zones[zone] += 1


def crashes_checked() -> None:
    checks["alive"] += 1


def state_checked() -> None:
    checks["state"] += 1


def inputs() -> dict[str, str]:
    """Each test's input digest (hex), by test."""
    return {test_id: digest.hexdigest() for test_id, digest in sorted(_inputs.items())}


def inputs_digest() -> str:
    """One digest over every test's input digest: equal for two runs that sent the same requests
    to the same tests."""
    return hashlib.sha256(json.dumps(inputs(), sort_keys=True).encode()).hexdigest()


def summary() -> dict[str, object]:
    by_code: collections.Counter[str] = collections.Counter()
    by_method: collections.Counter[str] = collections.Counter()
    for (method, _mode, code), n in cases.items():
        by_code[code] += n
        by_method[method] += n
    return {"seed": seeding.SESSION_SEED, "cases_per_test": seeding.CASES,
            "cases": sum(cases.values()), "methods": len(by_method), "by_code": dict(by_code.most_common()),
            "by_method": dict(sorted(by_method.items())), "by_size": dict(zones.most_common()),
            "alive_checks": checks["alive"], "state_checks": checks["state"],
            "inputs_sha256": inputs_digest(), "inputs_by_test": inputs()}


def write(path: str | None = None) -> None:
    target = path or os.environ.get("FUZZ_REPORT")
    if target:
        Path(target).write_text(json.dumps(summary(), indent=2) + "\n")
