"""Reports how many simulated steps the session ran, and how fast (the CI budget, README): each
run is added to tests/session_report.py, and tests/conftest.py prints the total (under
pytest-xdist too, where the runs happen in worker processes)."""

from __future__ import annotations

import pytest

from tests import session_report
from tests.sim.harness import SimResult

SIM_RUNS = "sim_runs"


class RunRecord(list[SimResult]):
    """What a test hands its simulation results to: only the counts leave the process."""

    def append(self, result: SimResult) -> None:
        super().append(result)
        session_report.add(SIM_RUNS, [result.steps, result.wall_s, result.sim_ms])


@pytest.fixture
def record_run() -> RunRecord:
    return RunRecord()


def summary_line() -> str | None:
    runs = session_report.items(SIM_RUNS)
    if not runs:
        return None
    steps = sum(int(r[0]) for r in runs)
    wall = sum(float(r[1]) for r in runs)
    simulated = sum(int(r[2]) for r in runs) / 1000
    return (f"simulation: {len(runs)} runs, {steps:,} steps ({simulated:,.0f} simulated seconds) in {wall:.1f} s: "
            f"{steps / max(wall, 1e-9):,.0f} steps/s")
