"""A seed's replica traces, printed, parsed back and replayed through the machine alone.

Why: every event a driver steps into a replica machine is plain data (docs/design.md §5.1), so
what a simulated replica lived through can be read as text and stepped again without the
cluster around it (`kvstore.core.replica.trace`). Here the simulation records every event of
every replica, and each trace that started from an empty store (and loaded no snapshot, which
is not in the trace) must replay to the very same actions, step by step.
"""

from __future__ import annotations

from kvstore.core.replica import SnapshotDone, trace
from tests.sim.harness import Simulation, config_for


def test_a_printed_trace_replays_through_the_machine_alone() -> None:
    sim = Simulation(config_for(5, 6_000, bank_clients=1))
    sim.world.replica_traces = []
    result = sim.run()
    assert result.ok, result.report("test_a_printed_trace_replays_through_the_machine_alone")
    replayable = [t for t in sim.world.replica_traces if t.empty_at_start and not any(
        isinstance(s.event, SnapshotDone) and s.event.loaded for s in t.steps)]
    assert len(replayable) >= 2, [len(t.steps) for t in sim.world.replica_traces]
    seen: set[str] = set()
    for recorded in replayable:
        text = trace.dumps(recorded.steps)
        steps = trace.loads(text)
        assert [s.event for s in steps] == [s.event for s in recorded.steps]
        assert trace.dumps(steps) == text  # printing is a function of the trace alone
        assert trace.replay(steps, recorded.config, sim.world.new_disk) is None, recorded.name
        seen |= {type(s.event).__name__ for s in steps}
    # Not vacuous: the traces cover following, taking over, group commit and its answers.
    assert {"WriteArrived", "Appended", "CommitApplied", "Fenced", "Fetched", "Replayed", "Rewound"} <= seen, seen


def test_a_replay_that_differs_says_where() -> None:
    sim = Simulation(config_for(5, 2_000, bank_clients=0))
    sim.world.replica_traces = []
    sim.run()
    recorded = next(t for t in sim.world.replica_traces if t.empty_at_start and len(t.steps) > 3)
    steps = trace.loads(trace.dumps(recorded.steps))
    steps[1] = trace.Step(steps[1].now_ms, steps[1].unix_ms, steps[1].event, "[]")
    assert "step 1" in (trace.replay(steps, recorded.config, sim.world.new_disk) or "")
