"""`kvstore.core.role.RoleMachine`: a shard's leadership, report by report (no Kafka, no asyncio).

Scenarios are lists of (report, expected result, expected role afterwards), in the style of
tests/unit/test_guard.py; the append-error table is checked row by row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvstore import errors
from kvstore.core.role import (
    APPEND_DECISIONS,
    BROKEN,
    NEEDS_SNAPSHOT,
    REBUILDING,
    AppendOutcome,
    Next,
    Role,
    RoleMachine,
)

Step = tuple[Callable[[RoleMachine], Any], Any, Role]
F, FE, C, L, SD, ST = (Role.FOLLOWER, Role.FENCING, Role.CATCHING_UP, Role.LEADING, Role.STEPPING_DOWN,
                       Role.STOPPED)


def run(steps: list[Step], machine: RoleMachine | None = None) -> RoleMachine:
    m = machine or RoleMachine(shard=3)
    for number, (report, expected, role) in enumerate(steps):
        result = report(m)
        if expected is not ...:
            got = result.then if hasattr(result, "then") else result
            assert got == expected, f"step {number}: {got!r}, expected {expected!r}"
        assert m.role is role, f"step {number}: role {m.role}, expected {role}"
    return m


def leading_at(end: int = 10) -> RoleMachine:
    return run([(lambda m: m.set_lead(True), None, F), (lambda m: m.begin_fencing(), None, FE),
                (lambda m: m.fenced(end), True, C), (lambda m: m.replayed_to(end), True, L)])


SCENARIOS: dict[str, tuple[Callable[[], RoleMachine], list[Step]]] = {
    "take over, commit two batches": (leading_at, [
        (lambda m: m.batch_started(10, 3), None, L),
        (lambda m: m.batch_committed((10, 11, 12), 14), None, L),
        (lambda m: m.batch_started(14, 1), None, L),
        (lambda m: m.batch_committed((14,), 16), None, L),
    ]),
    "resigned while fencing": (lambda: run([(lambda m: m.set_lead(True), None, F),
                                            (lambda m: m.begin_fencing(), None, FE)]), [
        (lambda m: m.set_lead(False), None, FE),
        (lambda m: m.fenced(10), False, SD),
        (lambda m: m.stepped_down(), None, F),
    ]),
    "resigned while catching up": (lambda: run([(lambda m: m.set_lead(True), None, F),
                                                (lambda m: m.begin_fencing(), None, FE),
                                                (lambda m: m.fenced(4), True, C)]), [
        (lambda m: m.set_lead(False), None, C),
        (lambda m: m.replayed_to(4), False, SD),
        (lambda m: m.stepped_down(), None, F),
    ]),
    "aborted batch: learn the end again and lead on": (leading_at, [
        (lambda m: m.batch_started(10, 2), None, L),
        (lambda m: m.batch_failed(AppendOutcome.ABORTED), Next.SETTLE, C),
        (lambda m: m.replayed_to(15), True, L),
        (lambda m: m.batch_started(15, 1), None, L),
    ]),
    "unknown outcome: fence again, with a term from the new end": (leading_at, [
        (lambda m: m.batch_started(10, 2), None, L),
        (lambda m: m.batch_failed(AppendOutcome.UNKNOWN), Next.REFENCE, FE),
        (lambda m: m.fenced(13), True, C),
        (lambda m: m.term, 14, C),
        (lambda m: m.replayed_to(13), True, L),
    ]),
    "a re-fence after a newer leader wrote takes a term above its (sim seed 16)": (leading_at, [
        (lambda m: m.batch_started(10, 1), None, L),
        (lambda m: m.batch_failed(AppendOutcome.UNKNOWN), Next.REFENCE, FE),
        (lambda m: m.fenced(617), True, C),  # someone fenced in at 607 (term 608) and wrote meanwhile
        (lambda m: m.term, 618, C),
    ]),
    "fenced: step down": (leading_at, [
        (lambda m: m.batch_started(10, 1), None, L),
        (lambda m: m.batch_failed(AppendOutcome.FENCED), Next.STEP_DOWN, SD),
        (lambda m: m.stepped_down(), None, F),
        (lambda m: m.upcoming, None, F),
    ]),
    "an abort while resigning steps down instead of resyncing": (leading_at, [
        (lambda m: m.batch_started(10, 1), None, L),
        (lambda m: m.set_lead(False), None, L),
        (lambda m: m.batch_failed(AppendOutcome.ABORTED), Next.STEP_DOWN, SD),
    ]),
    "resync fails: step down": (leading_at, [
        (lambda m: m.batch_started(10, 1), None, L),
        (lambda m: m.batch_failed(AppendOutcome.UNKNOWN), Next.REFENCE, FE),
        (lambda m: m.resync_failed(), None, SD),
        (lambda m: m.stepped_down(), None, F),
    ]),
    "apply failure: give the shard up until rebuilt": (leading_at, [
        (lambda m: m.batch_started(10, 1), None, L),
        (lambda m: m.batch_committed((10,), 12), None, L),
        (lambda m: m.apply_failed("disk full"), None, SD),
        (lambda m: m.stepped_down(), None, F),
        (lambda m: m.set_lead(True), "disk full", F),
        (lambda m: m.want_lead, False, F),
    ]),
    "stop while leading": (leading_at, [
        (lambda m: m.stop(), None, L),
        (lambda m: m.may_start_batch(), False, L),
        (lambda m: m.step_down(), None, SD),
        (lambda m: m.stepped_down(), None, ST),
    ]),
    "a re-fence cut short does not carry its term into the next leadership (sim seed 1055)": (leading_at, [
        (lambda m: m.batch_started(10, 1), None, L),
        (lambda m: m.batch_failed(AppendOutcome.UNKNOWN), Next.REFENCE, FE),
        (lambda m: m.set_lead(False), None, FE),
        (lambda m: m.fenced(30), False, SD),
        (lambda m: m.stepped_down(), None, F),
        (lambda m: m.set_lead(True), None, F),
        (lambda m: m.begin_fencing(), None, FE),
        (lambda m: m.fenced(60), True, C),
        (lambda m: m.term, 61, C),
    ]),
    "next leadership takes a new term": (leading_at, [
        (lambda m: m.batch_failed(AppendOutcome.FENCED), Next.STEP_DOWN, SD),
        (lambda m: m.stepped_down(), None, F),
        (lambda m: m.begin_fencing(), None, FE),
        (lambda m: m.fenced(20), True, C),
        (lambda m: m.term, 21, C),
    ]),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name: str) -> None:
    start, steps = SCENARIOS[name]
    run(steps, start())


@pytest.mark.parametrize("outcome", list(AppendOutcome))
def test_append_decision_table(outcome: AppendOutcome) -> None:
    """Definite answers only where nothing can have committed (W7); unknown -> re-fence before
    the next batch; fenced -> step down; abort -> learn the end again and keep leading, after a
    fence of its own when the writer retired its producer (never one hidden in the next append)."""
    decision = APPEND_DECISIONS[outcome]
    expected_unknown = outcome in (AppendOutcome.UNKNOWN, AppendOutcome.UNKNOWN_FENCED, AppendOutcome.CRASHED,
                                   AppendOutcome.CANCELLED)
    assert decision.unknown == expected_unknown
    error = decision.error(3, "why")
    assert error.definite == (not expected_unknown)
    assert isinstance(error, errors.UnknownOutcomeError if expected_unknown else errors.UnavailableError)
    assert str(error).startswith("shard 3: ") and str(error).endswith("(why)")
    expected_next = {AppendOutcome.ABORTED: Next.SETTLE, AppendOutcome.ABORTED_RETIRED: Next.REFENCE,
                     AppendOutcome.UNKNOWN: Next.REFENCE}.get(outcome, Next.STEP_DOWN)
    assert decision.then is expected_next
    assert decision.fencing == (outcome in (AppendOutcome.FENCED, AppendOutcome.UNKNOWN_FENCED))
    m = leading_at()
    m.batch_started(10, 1)
    m.batch_failed(outcome)
    assert m.upcoming is None and m.written_end is None, "after any failed append the end must be read again (W2)"
    assert m.barrier(10).wait_for is None, "no read is served while the upcoming offset is unknown"


INVALID: list[tuple[str, Callable[[RoleMachine], Any]]] = [
    ("fence without being asked to lead", lambda m: m.begin_fencing()),
    ("caught up while following", lambda m: m.replayed_to(3)),
    ("batch while following", lambda m: m.batch_started(0, 1)),
    ("fenced while following", lambda m: m.fenced(3)),
]


@pytest.mark.parametrize(("name", "report"), INVALID, ids=[n for n, _ in INVALID])
def test_impossible_reports_are_bugs(name: str, report: Callable[[RoleMachine], Any]) -> None:
    with pytest.raises(AssertionError):
        report(RoleMachine(3))


def test_w1_and_w2_paired_checks() -> None:
    m = leading_at(10)
    with pytest.raises(AssertionError, match="W1"):
        m.batch_started(11, 1)
    m.batch_started(10, 2)
    with pytest.raises(AssertionError, match="W2"):
        m.batch_committed((10, 12), 13)
    with pytest.raises(AssertionError, match="one batch"):
        m.batch_started(10, 1)


BARRIER = [
    # upcoming, in flight (records), high watermark -> wait_for (None: stale, probe)
    ("all applied", None, 10, 10),
    ("below our writes", None, 7, 7),
    ("someone wrote beyond us", None, 11, None),
    ("our batch in flight covers it", 2, 13, 13),
    ("beyond even our batch in flight", 2, 14, None),
]


@pytest.mark.parametrize(("in_flight", "high_watermark", "wait_for"), [b[1:] for b in BARRIER],
                         ids=[b[0] for b in BARRIER])
def test_barrier(in_flight: int | None, high_watermark: int, wait_for: int | None) -> None:
    m = leading_at(10)
    if in_flight:
        m.batch_started(10, in_flight)
    verdict = m.barrier(high_watermark)
    assert verdict.wait_for == wait_for
    assert verdict.probe == (wait_for is None)


REFUSALS = [
    # role reached, asked to lead, stopping -> refusal type (None: take it)
    ("leading", True, False, L, None),
    ("taking over", True, False, C, "UnavailableError"),
    ("fencing", True, False, FE, "UnavailableError"),
    ("follower", False, False, F, "NotLeaderError"),
    ("leading but resigning", False, False, L, "NotLeaderError"),
    ("leading but stopping", True, True, L, "NotLeaderError"),
]


@pytest.mark.parametrize(("want", "stopping", "role", "expected"), [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_write_refusal(want: bool, stopping: bool, role: Role, expected: str | None) -> None:
    m = RoleMachine(3)
    m.set_lead(True)
    if role is not F:
        m.begin_fencing()
        if role is not FE:
            m.fenced(0)
            if role is L:
                m.replayed_to(0)
    m.set_lead(want)
    if stopping:
        m.stop()
    refusal = m.write_refusal("n2:1")
    assert (None if refusal is None else type(refusal).__name__) == expected
    if isinstance(refusal, errors.NotLeaderError):
        assert refusal.leader_hint == "n2:1"


def test_reasons_not_to_lead_clear_one_by_one() -> None:
    m = RoleMachine(3)
    m.mark_unable(BROKEN, "apply failed")
    m.mark_unable(NEEDS_SNAPSHOT, "truncated")
    assert m.set_lead(True) == "apply failed; truncated" and not m.want_lead
    m.mark_unable(REBUILDING, "rebuilding")
    assert not m.clear_unable(BROKEN)
    assert not m.clear_unable(NEEDS_SNAPSHOT)
    assert not m.clear_unable(NEEDS_SNAPSHOT), "clearing a reason that is not there says nothing"
    assert m.clear_unable(REBUILDING), "the last reason cleared: the node may ask to lead again"
    assert m.set_lead(True) is None and m.want_lead



def test_append_outcome_reads_the_wal_errors() -> None:
    """Every driver maps its writer's errors here (it was the node's, and the simulation
    imported it from the server)."""
    import wal.errors as w
    from kvstore.core.role import append_outcome

    assert append_outcome(w.UnknownOutcomeError("t"), False) is AppendOutcome.UNKNOWN
    assert append_outcome(w.UnknownOutcomeError("t", fenced=True), False) is AppendOutcome.UNKNOWN_FENCED
    assert append_outcome(w.FencedError("f"), False) is AppendOutcome.FENCED
    assert append_outcome(w.WriterFatalError("x"), True) is AppendOutcome.WRITER_FATAL
    assert append_outcome(w.BatchAbortedError("a"), False) is AppendOutcome.ABORTED
    assert append_outcome(w.BatchAbortedError("a"), True) is AppendOutcome.ABORTED_RETIRED
    assert append_outcome(RuntimeError("bug"), False) is AppendOutcome.CRASHED
    assert append_outcome(None, False) is AppendOutcome.CRASHED  # cancelled: may have committed
