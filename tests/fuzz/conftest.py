"""Says the fuzz seed and how to replay it when the fuzz tests are collected and in every fuzz
failure, prints the fuzz tally (tests/fuzz/tally.py) after the session, writes it as JSON when
FUZZ_REPORT names a file, and fails the session when FUZZ_MIN_CASES is set and fewer cases ran
(`make fuzz` sets both: a campaign that quietly ran fewer cases than it promises is a failure)."""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

from tests.fuzz import seeding, tally


def _fuzz(nodeid: str) -> bool:
    return nodeid.startswith("tests/fuzz/test_fuzz_rpcs.py")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and any(_fuzz(item.nodeid) for item in items):
        reporter.write_line(seeding.replay_line(seeding.SESSION_SEED, seeding.CASES))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                                           pytest.TestReport]:
    report = yield
    if report.failed and _fuzz(item.nodeid):
        report.sections.append(("fuzz seed", seeding.replay_line(seeding.SESSION_SEED, seeding.CASES)))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    summary = tally.summary()
    if not summary["cases"]:
        return
    failed = any(_fuzz(report.nodeid) for report in terminalreporter.stats.get("failed", []))
    terminalreporter.write_sep("-", "fuzz")
    terminalreporter.write_line(
        f"{summary['cases']} cases over {summary['methods']} RPCs; answers {summary['by_code']}; "
        f"requests by size {summary['by_size']}; "
        f"node alive after each of {summary['alive_checks']}, state unchanged after each of "
        f"{summary['state_checks']} refused or read-only cases"
        + ("" if not failed else "; SOME CHECK FAILED (see above)"))
    if not failed:
        terminalreporter.write_line("0 crashes, 0 state changes")
    terminalreporter.write_line(f"inputs sha256 {str(summary['inputs_sha256'])[:16]}; "
                                + seeding.replay_line(seeding.SESSION_SEED, seeding.CASES))
    tally.write()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    wanted = int(os.environ.get("FUZZ_MIN_CASES", "0"))
    ran = int(tally.summary()["cases"])  # type: ignore[call-overload]
    if wanted and ran < wanted and session.exitstatus == 0:
        print(f"\nfuzz: only {ran} cases ran, fewer than FUZZ_MIN_CASES={wanted}")
        session.exitstatus = 1
