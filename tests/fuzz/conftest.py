"""Says the fuzz seed and how to replay it when the fuzz tests are collected and in every fuzz
failure, and hands the process's fuzz tally to the session's summary: tests/conftest.py, the one
conftest the pytest-xdist controller loads, prints it with the tallies of every worker
(tests/fuzz/tally.py `report`, `enough_cases`)."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests import session_report
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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Hand this process's tally to the session's summary (tests/conftest.py prints it, checks
    FUZZ_MIN_CASES and writes FUZZ_REPORT: under pytest-xdist that is the controller, which runs
    no test)."""
    if tally.cases:
        session_report.add(tally.SESSION_REPORT_NAME, tally.summary())
