"""Prints the fuzz tally (tests/fuzz/tally.py) after the session, writes it as JSON when
FUZZ_REPORT names a file, and fails the session when FUZZ_MIN_CASES is set and fewer cases ran
(`make fuzz` sets both: a campaign that quietly ran fewer cases than it promises is a failure)."""

from __future__ import annotations

import os

import pytest

from tests.fuzz import tally


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    summary = tally.summary()
    if not summary["cases"]:
        return
    failed = any(report.nodeid.startswith("tests/fuzz/") for report in terminalreporter.stats.get("failed", []))
    terminalreporter.write_sep("-", "fuzz")
    terminalreporter.write_line(
        f"{summary['cases']} cases over {summary['methods']} RPCs; answers {summary['by_code']}; "
        f"node alive after each of {summary['alive_checks']}, state unchanged after each of "
        f"{summary['state_checks']} refused or read-only cases"
        + ("" if not failed else "; SOME CHECK FAILED (see above)"))
    if not failed:
        terminalreporter.write_line("0 crashes, 0 state changes")
    tally.write()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    wanted = int(os.environ.get("FUZZ_MIN_CASES", "0"))
    ran = int(tally.summary()["cases"])  # type: ignore[call-overload]
    if wanted and ran < wanted and session.exitstatus == 0:
        print(f"\nfuzz: only {ran} cases ran, fewer than FUZZ_MIN_CASES={wanted}")
        session.exitstatus = 1
