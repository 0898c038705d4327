"""Shared fixtures: a real local Kafka broker (never librdkafka's mock cluster); how `make test`
spreads the suite over pytest-xdist workers, and the session's summary from all of them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import session_report
from tests.fuzz import tally as fuzz_tally
from tests.sim.conftest import summary_line as sim_summary_line
from wal.broker import QUICK_JVM_FLAGS, LocalKafka


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """One KRaft node shared by the session; tests use their own topics."""
    broker = LocalKafka(tmp_path_factory.mktemp("kafka"), nodes=1, jvm_flags=QUICK_JVM_FLAGS)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def own_kafka(tmp_path: Path) -> Iterator[LocalKafka]:
    """A broker of the test's own, for tests that restart or kill it."""
    broker = LocalKafka(tmp_path / "kafka", nodes=1, jvm_flags=QUICK_JVM_FLAGS)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def topic(kafka: LocalKafka) -> str:
    name = unique("wal")
    kafka.create_topic(name, partitions=1)
    return name


REPORT_KEY = "session_report"  # workeroutput's key for tests/session_report.py


# ---- pytest-xdist: `make test` runs the suite in worker processes (docs/development.md) -------------

# Files whose tests share one worker, in file order, besides keeping each file's module fixtures
# (a broker, a node, a Spark session) built once: these start three brokers or five nodes, run a
# campaign or Spark jobs, and two of them at once on two cores starve each other's processes for
# seconds (sessions expire, leaders move) that their assertions do not budget for.
HEAVY = "heavy"
HEAVY_FILES = (
    "tests/robustness/test_campaign.py",
    "tests/integration/test_three_brokers.py",
    "tests/integration/test_placement.py",
    "tests/integration/test_cluster.py",
    "tests/integration/test_kafka_security.py",
    "tests/integration/test_make_up.py",
    "tests/integration/test_make_up_secure.py",
    "tests/integration/test_packaging.py",
)
PROCESS_DIRS = ("tests/integration/", "tests/pipeline/", "tests/fuzz/", "tests/robustness/")


def work_unit(nodeid: str) -> str:
    """The unit a pytest-xdist worker is handed whole: the heavy group, the Spark group, one file
    with processes (its module fixtures built once), or a single pure test."""
    path = nodeid.split("::", 1)[0]
    if path in HEAVY_FILES:
        return HEAVY
    if path.startswith("tests/pipeline/"):
        return "spark"
    if path.startswith(PROCESS_DIRS):
        return path
    return nodeid


def _first_handed_out(nodeid: str) -> int:
    """Units go out in collection order: the longest first, the pure tests last to fill in."""
    unit = work_unit(nodeid)
    return 0 if unit == HEAVY else 1 if unit == "spark" else 2 if unit != nodeid else 3


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config.option, "loadgroup", False):  # a worker under `--dist loadgroup`: its collection is the order
        items.sort(key=lambda item: _first_handed_out(item.nodeid))  # stable: file order within each


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, in the controller
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` with `work_unit` as the groups. Not xdist_group marks: pytest-xdist 3.8
    puts the group in `item._nodeid`, which pytest 9 no longer reads, so marks group nothing."""
    if config.getvalue("dist") != "loadgroup":
        return None  # xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # keep `_first_handed_out`'s order, not the units' sizes
    return WorkUnits(config, log)


@pytest.hookimpl(trylast=True)  # after the conftests that add to the session's report
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: ship the tallies to the controller
        workeroutput[REPORT_KEY] = session_report.shipped()
        return
    fuzz_tally.enough_cases(session)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: the controller, as a worker finishes
def pytest_testnodedown(node: Any, error: Any) -> None:
    payload = getattr(node, "workeroutput", {}).get(REPORT_KEY)
    if payload:
        session_report.received(payload)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    failed = {report.nodeid.split("::", 1)[0] for report in terminalreporter.stats.get("failed", [])}
    fuzz_tally.report(terminalreporter, failed=any(path.startswith("tests/fuzz/") for path in failed))
    line = sim_summary_line()
    if line is not None:
        terminalreporter.write_line(line)
