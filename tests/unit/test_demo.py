"""`kvstore.dev.demo` (and bench/failover.py's tables): how failed writes are classified (W7) and what
the verdict reports about them, against a fake client (no broker, no server)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest

from bench import failover as bench_failover
from kvstore.client import (
    Client,
    DeadlineExceeded,
    InvalidArgument,
    KeyValue,
    KvError,
    NodeInfo,
    NotLeader,
    Overloaded,
    PutResult,
    RequestExpired,
    ShardInfo,
    ShardMap,
    Unavailable,
    UnknownOutcome,
)
from kvstore.dev import demo

# ============================================================================================
# Classification


class _LaterUnknown(UnknownOutcome):
    """Stands for a future refinement of UnknownOutcome (say, an expired request id)."""


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        pytest.param(UnknownOutcome("commit outcome unknown", request_id="r"), "unknown", id="unknown-outcome"),
        pytest.param(DeadlineExceeded("deadline exceeded", request_id="r"), "unknown", id="deadline"),
        pytest.param(_LaterUnknown("expired", request_id="r"), "unknown", id="unknown-subclass"),
        pytest.param(RequestExpired("request id expired", request_id="r"), "unknown", id="request-expired"),
        pytest.param(Unavailable("bootstrapping"), "failed", id="unavailable"),
        pytest.param(NotLeader("not the leader"), "failed", id="not-leader"),
        pytest.param(Overloaded("queue full"), "failed", id="overloaded"),
        pytest.param(InvalidArgument("too big"), "failed", id="invalid"),
        pytest.param(KvError("something definite"), "failed", id="base"),
    ],
)
def test_outcome_of_classifies_unknown_and_definite_failures(error: KvError, outcome: str) -> None:
    assert demo.outcome_of(error) == outcome


def test_record_failure_keeps_key_shard_outcome_and_error() -> None:
    workload = demo.Workload(["fake:1"], 1, prefix="t")
    failure = workload.record_failure(b"t/0/0/0000001", 0, DeadlineExceeded("deadline exceeded", request_id="r"))
    assert failure.key == b"t/0/0/0000001" and failure.shard == 0 and failure.outcome == "unknown"
    assert failure.error.startswith("DeadlineExceeded: deadline exceeded")
    workload.record_failure(b"t/0/0/0000002", 0, Unavailable("no leader"))
    assert [f.outcome for f in workload.failures] == ["unknown", "failed"]
    assert workload.unknown_outcomes() == 1


# ============================================================================================
# A fake cluster: each put either commits or not, and answers or raises, as scripted


class FakeCluster:
    """key -> (value, version). `plan` maps a writer's write number to (error raised, whether the
    write was applied anyway); a write not in the plan commits and is acknowledged."""

    def __init__(self, plan: dict[int, tuple[KvError, bool]] | None = None) -> None:
        self.plan = plan or {}
        self.stored: dict[bytes, tuple[bytes, int]] = {}
        self.scan_failures: list[KvError] = []  # raised by the next scans, in order
        self.scans = 0

    def apply(self, key: bytes, value: bytes) -> None:
        _, version = self.stored.get(key, (b"", 0))
        self.stored[key] = (value, version + 1)

    def client(self, endpoints: Any = None, **_: Any) -> FakeClient:
        return FakeClient(self)


class FakeClient:
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def put(self, key: bytes, value: bytes, request_id: str | None = None, **_: Any) -> PutResult:
        n = int(key.rsplit(b"/", 1)[1])
        if n in self.cluster.plan:
            error, applied = self.cluster.plan[n]
            if applied:
                self.cluster.apply(key, value)
            raise error
        self.cluster.apply(key, value)
        return PutResult(key, 0, 100 + n, 1, False, request_id or "")

    def scan_all(self, *, prefix: bytes = b"", **_: Any) -> Iterator[KeyValue]:
        self.cluster.scans += 1
        if self.cluster.scan_failures:
            raise self.cluster.scan_failures.pop(0)
        for key, (value, version) in sorted(self.cluster.stored.items()):
            if key.startswith(prefix):
                yield KeyValue(key, value, version, 1, 1)


@pytest.fixture
def converged(monkeypatch: pytest.MonkeyPatch) -> None:
    """No replicas to compare: every shard's replicas are 'equal'."""
    monkeypatch.setattr(demo, "converge", lambda client, timeout_s: (True, {}))


def run_workload(monkeypatch: pytest.MonkeyPatch, cluster: FakeCluster, writes: int) -> demo.Workload:
    """One writer on one shard doing `writes` puts through the fake client, then stopped."""
    monkeypatch.setattr(demo, "Client", cluster.client)
    monkeypatch.setattr(demo, "MAX_KEYS_PER_WRITER", writes)
    workload = demo.Workload(["fake:1"], 1, writers_per_shard=1, prefix="t").start()
    deadline = time.monotonic() + 10
    while len(workload.acks) + len(workload.failures) < writes:
        assert time.monotonic() < deadline, "the fake writer did not finish"
        time.sleep(0.01)
    workload.stop()
    return workload


def fake_client(cluster: FakeCluster) -> Client:
    return cast(Client, FakeClient(cluster))


def key(n: int) -> bytes:
    return f"t/0/0/{n:07d}".encode()


# ============================================================================================
# The verdict


@pytest.mark.usefixtures("converged")
def test_verdict_counts_unknown_outcomes_and_a_failed_write_that_was_applied(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = FakeCluster({
        1: (UnknownOutcome("commit outcome unknown", request_id="r1"), True),  # unknown, went through
        2: (DeadlineExceeded("deadline exceeded", request_id="r2"), False),  # unknown, did not
        3: (Unavailable("leader changing"), False),  # failed, truly
        4: (Overloaded("queue full"), True),  # failed, yet applied: the client was lied to
    })
    workload = run_workload(monkeypatch, cluster, 6)
    assert [(f.key, f.outcome) for f in workload.failures] == [
        (key(1), "unknown"), (key(2), "unknown"), (key(3), "failed"), (key(4), "failed")]

    verdict = demo.verify(fake_client(cluster), workload, timeout_s=5)

    assert (verdict.acked, verdict.acked_lost, verdict.duplicates) == (2, 0, 0)
    assert verdict.failed == 4
    assert verdict.unknown_outcomes == 2 and verdict.unknown_applied == 1
    assert verdict.failed_but_applied == 1
    assert verdict.failed_applied_examples == [f"{key(4).decode()}: Overloaded: queue full"]
    assert not verdict.ok


@pytest.mark.usefixtures("converged")
def test_unknown_outcomes_applied_either_way_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = FakeCluster({
        0: (UnknownOutcome("commit outcome unknown", request_id="r0"), True),
        1: (UnknownOutcome("commit outcome unknown", request_id="r1"), False),
        2: (NotLeader("not the leader"), False),
    })
    workload = run_workload(monkeypatch, cluster, 4)
    verdict = demo.verify(fake_client(cluster), workload, timeout_s=5)
    assert (verdict.acked, verdict.failed, verdict.unknown_outcomes, verdict.unknown_applied) == (1, 3, 2, 1)
    assert verdict.failed_but_applied == 0 and verdict.failed_applied_examples == []
    assert verdict.ok


@pytest.mark.usefixtures("converged")
def test_verdict_still_reports_lost_and_duplicated_acknowledged_writes() -> None:
    cluster = FakeCluster()
    workload = demo.Workload(["fake:1"], 1, prefix="t")
    for n in range(3):
        workload.acks.append(demo.Ack(key(n), b"v", 0, n, 0.0))
    cluster.stored = {key(0): (b"v", 1), key(1): (b"v", 2)}  # key 2 lost, key 1 applied twice
    verdict = demo.verify(fake_client(cluster), workload, timeout_s=5)
    assert (verdict.acked, verdict.acked_lost, verdict.duplicates) == (3, 1, 1)
    assert verdict.lost_examples == [key(2).decode()]
    assert verdict.failed == verdict.failed_but_applied == verdict.unknown_outcomes == 0
    assert not verdict.ok


@pytest.mark.usefixtures("converged")
def test_the_read_back_is_retried_while_a_shard_has_no_leader() -> None:
    cluster = FakeCluster()
    cluster.stored = {key(0): (b"v", 1)}
    cluster.scan_failures = [Unavailable("between leaders")]
    workload = demo.Workload(["fake:1"], 1, prefix="t")
    workload.record_failure(key(0), 0, Unavailable("no leader"))
    verdict = demo.verify(fake_client(cluster), workload, timeout_s=5)
    assert cluster.scans == 2
    assert verdict.failed_but_applied == 1 and not verdict.ok


def test_replicas_unequal_fails_the_verdict() -> None:
    verdict = demo.Verdict(acked=1, acked_lost=0, duplicates=0, replicas_equal=False, replicas={},
                           lost_examples=[])
    assert not verdict.ok


# ============================================================================================
# Whom the demo kills


class MapOnlyClient:
    """Answers the shard map only: the demo must not get further than choosing its victim."""

    def __init__(self, smap: ShardMap) -> None:
        self.smap = smap

    def __enter__(self) -> MapOnlyClient:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def shard_map(self, **_: Any) -> ShardMap:
        return self.smap


def test_failover_asks_its_kill_first_and_refuses_before_any_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The victim is the shard's leader as the map names it (id and address, no pid); the demo's
    `kill` decides whether it may signal it, before a single write is sent."""
    smap = ShardMap(2, "wal", "a:1", (ShardInfo(0, "b:1", 3, 0, 0, 0, 0, "node-2", True),
                                      ShardInfo(1, "a:1", 2, 0, 0, 0, 0, "node-1", True)),
                    (NodeInfo("node-1", "a:1", (1,), True), NodeInfo("node-2", "b:1", (0,), True)))
    monkeypatch.setattr(demo, "Client", lambda *_, **__: MapOnlyClient(smap))
    started: list[demo.Workload] = []
    monkeypatch.setattr(demo.Workload, "start", lambda self: started.append(self) or self)
    asked: list[tuple[NodeInfo, int]] = []

    def refuse(node: NodeInfo, sig: int) -> str:
        asked.append((node, sig))
        raise RuntimeError("not a node the dev cluster started")

    with pytest.raises(RuntimeError, match="not a node the dev cluster started"):
        demo.failover(["a:1"], kill=refuse, shard=0, quiet=True)
    assert asked == [(NodeInfo("node-2", "b:1", (0,), True), 0)] and started == []


# ============================================================================================
# The demo's output


def demo_result(verdict: demo.Verdict) -> dict[str, Any]:
    """What `demo.failover` returns around a verdict."""
    return {"mode": "sigkill", "shard": 0, "killed": "node-1", "new_leader": "node-2", "new_term": 7,
            "takeover_ms": 1700, **verdict.summary(), "unavailable_ms_max": 1800,
            "unavailable_ms_by_shard": {"0": 1800}, "replicas": {}, "duration_s": 8.0}


def lying_verdict() -> demo.Verdict:
    return demo.Verdict(acked=10, acked_lost=0, duplicates=0, replicas_equal=True, replicas={}, lost_examples=[],
                        failed=5, failed_but_applied=1, unknown_outcomes=3, unknown_applied=2,
                        failed_applied_examples=["t/0/0/0000004: Overloaded: queue full"])


def test_summary_carries_the_new_fields_and_is_json() -> None:
    summary = lying_verdict().summary()
    assert json.loads(json.dumps(summary)) == summary
    assert {k: summary[k] for k in ("failed", "failed_but_applied", "unknown_outcomes", "unknown_applied", "ok")} \
        == {"failed": 5, "failed_but_applied": 1, "unknown_outcomes": 3, "unknown_applied": 2, "ok": False}
    assert summary["failed_applied_examples"] == ["t/0/0/0000004: Overloaded: queue full"]
    assert "replicas" not in summary


def test_report_table_shows_the_new_fields_and_the_examples() -> None:
    text = demo.report_table(demo_result(lying_verdict()))
    rows = {line[:20].strip(): line[20:] for line in text.splitlines()}
    assert rows["failed_but_applied"] == "1"
    assert rows["unknown_outcomes"] == "3"
    assert rows["unknown_applied"] == "2"
    assert rows["ok"] == "false"
    assert rows["failed but applied"] == "t/0/0/0000004: Overloaded: queue full"


def test_report_table_of_a_clean_run() -> None:
    verdict = demo.Verdict(acked=10, acked_lost=0, duplicates=0, replicas_equal=True, replicas={},
                           lost_examples=[])
    text = demo.report_table(demo_result(verdict))
    assert "failed but applied" not in text
    assert text.splitlines()[-1] == f"{'ok':<20}true"


# ============================================================================================
# bench/failover.py: per-run rows, summary


def bench_run(mode: str, **fields: Any) -> dict[str, Any]:
    verdict = demo.Verdict(acked=100, acked_lost=0, duplicates=0, replicas_equal=True, replicas={},
                           lost_examples=[], **fields)
    run = demo_result(verdict)
    run.pop("replicas")
    run.update(mode=mode, victim_shards=[0], timeline={"shards": {"0": {"assigned_ms": 1500}}})
    return run


def test_bench_summary_sums_the_new_fields() -> None:
    runs = [bench_run("sigkill", failed=3, failed_but_applied=1, unknown_outcomes=2, unknown_applied=1),
            bench_run("sigkill", failed=1, unknown_outcomes=1, unknown_applied=1),
            bench_run("clean", failed=2, unknown_outcomes=0)]
    sigkill, clean = bench_failover.summarize(runs, "sigkill"), bench_failover.summarize(runs, "clean")
    assert (sigkill["failed"], sigkill["failed_but_applied"], sigkill["unknown_outcomes"],
            sigkill["unknown_applied"]) == (4, 1, 3, 2)
    assert (clean["failed"], clean["failed_but_applied"], clean["unknown_outcomes"], clean["unknown_applied"]) \
        == (2, 0, 0, 0)


def test_bench_table_has_the_new_columns(capsys: pytest.CaptureFixture[str]) -> None:
    runs = [bench_run("sigkill", failed=3, failed_but_applied=1, unknown_outcomes=2, unknown_applied=1)]
    bench_failover.print_table(runs, {"sigkill": bench_failover.summarize(runs, "sigkill")})
    header, row, summary = capsys.readouterr().out.splitlines()
    columns = header.split()
    assert columns[columns.index("dup") + 1:columns.index("equal")] == ["fail", "f_app", "unk", "u_app"]
    cells = row.split()
    assert cells[columns.index("fail"):columns.index("equal")] == ["3", "1", "2", "1"]
    assert "failed 3 (failed but applied 1, unknown outcome 2 of which applied 1)" in summary
