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
from typing import Any

import pytest

from tests import session_report
from tests.fuzz import seeding

SESSION_REPORT_NAME = "fuzz_tally"  # each process's summary() in tests/session_report.py

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


def session_total() -> dict[str, Any] | None:
    """The session's tally, over every process that ran fuzz tests."""
    return session_report.merged_fuzz(session_report.items(SESSION_REPORT_NAME))


def report(terminalreporter: pytest.TerminalReporter, failed: bool) -> None:
    """The session's tally after its tests (`failed`: some fuzz test failed); FUZZ_REPORT names
    a file for it as JSON."""
    total = session_total()
    if total is None:
        return
    terminalreporter.write_sep("-", "fuzz")
    terminalreporter.write_line(
        f"{total['cases']} cases over {total['methods']} RPCs; answers {total['by_code']}; "
        f"requests by size {total['by_size']}; "
        f"node alive after each of {total['alive_checks']}, state unchanged after each of "
        f"{total['state_checks']} refused or read-only cases"
        + ("" if not failed else "; SOME CHECK FAILED (see above)"))
    if not failed:
        terminalreporter.write_line("0 crashes, 0 state changes")
    terminalreporter.write_line(f"inputs sha256 {str(total['inputs_sha256'])[:16]}; "
                                + seeding.replay_line(seeding.SESSION_SEED, seeding.CASES))
    target = os.environ.get("FUZZ_REPORT")
    if target:
        Path(target).write_text(json.dumps(total, indent=2) + "\n")


def enough_cases(session: pytest.Session) -> None:
    """A campaign that quietly ran fewer cases than it promises (FUZZ_MIN_CASES) fails."""
    wanted = int(os.environ.get("FUZZ_MIN_CASES", "0"))
    total = session_total()
    ran = int(total["cases"]) if total is not None else 0
    if wanted and ran < wanted and session.exitstatus == 0:
        print(f"\nfuzz: only {ran} cases ran, fewer than FUZZ_MIN_CASES={wanted}")
        session.exitstatus = 1
