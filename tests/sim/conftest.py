"""Reports how many simulated steps the session ran, and how fast (the CI budget, README)."""

from __future__ import annotations

import pytest

from tests.sim.harness import SimResult

_RESULTS: list[SimResult] = []


@pytest.fixture
def record_run() -> list[SimResult]:
    """Tests append their `SimResult`s here so the session summary can add them up."""
    return _RESULTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _RESULTS:
        return
    steps = sum(r.steps for r in _RESULTS)
    wall = sum(r.wall_s for r in _RESULTS)
    simulated = sum(r.sim_ms for r in _RESULTS) / 1000
    terminalreporter.write_line(
        f"simulation: {len(_RESULTS)} runs, {steps:,} steps ({simulated:,.0f} simulated seconds) in {wall:.1f} s: "
        f"{steps / max(wall, 1e-9):,.0f} steps/s")
