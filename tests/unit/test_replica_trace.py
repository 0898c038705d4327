"""`kvstore.core.replica.trace` and `writes`: a machine's run printed, parsed back and replayed
through the machine alone, with every kind of write as data (the simulation replays its seeds'
traces the same way: tests/sim/test_trace.py)."""

from __future__ import annotations

import pytest

from kvstore import errors
from kvstore.core import replica as core
from kvstore.core.replica import trace
from kvstore.core.replica.performers import perform_all
from kvstore.core.request_window import MemoryShard
from kvstore.core.role import AppendOutcome
from kvstore.core.txn import Decide
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.v1 import kv_pb2
from tests.unit.test_replica_machine import CONFIG, UNIX_MS


def _record(script: list[tuple[core.Event, float]]) -> list[trace.Step]:
    """Step a machine over a `MemoryShard` as a driver would, recording each step."""
    store = MemoryShard()
    machine, performers = core.ReplicaMachine(CONFIG, store), trace.StorePerformers(store)
    steps = []
    for event, now in script:
        out = machine.step(event, now_ms=now, unix_ms=UNIX_MS + int(now))
        steps.append(trace.Step(now, UNIX_MS + int(now), event, trace.actions_text(out)))
        perform_all(performers, out)
    return steps


TXN = kv_pb2.TxnRequest(success=[kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=b"t", value=b"v"))])
WRITES: list[core.WriteRequest] = [
    core.ClientRequest(kv_pb2.PutRequest(key=b"k", value=b"v", request_id="r", first_attempt_unix_ms=UNIX_MS), 0),
    core.PrepareTxn("t1", TXN, 0, 2, started_unix_ms=UNIX_MS, first_attempt_unix_ms=UNIX_MS),
    core.DecideTxn(Decide(wal_entry_pb2.TxnDecision(txn_id="t1", commit=False, request_id="c", participants=[0, 1]),
                          UNIX_MS, votes={1: wal_entry_pb2.TxnVote()}), 2, started_unix_ms=UNIX_MS),
    core.ResolveTxn(wal_entry_pb2.TxnResolve(txn_id="t1", commit=False)),
    core.ForgetTxns(("t1",)),
]


def _script() -> list[tuple[core.Event, float]]:
    script: list[tuple[core.Event, float]] = [
        (core.Started(), 0), (core.Rewound(), 0), (core.SnapshotDone(False), 0),
        (core.EndRead(core.EndPurpose.FOLLOW, 0), 0), (core.LeadChanged(True), 1), (core.Fetched(0, (), 0), 1),
        (core.Fenced(0), 2), (core.Rewound(), 2),
    ]
    for ticket, write in enumerate(WRITES, 1):
        script.append((core.WriteArrived(ticket, write, 10), 10 * ticket))
    script += [(core.Tick(), 100), (core.ReadArrived(9, "", (b"k",), (b"a", None)), 101),
               (core.AppendFailed(AppendOutcome.ABORTED, "W2"), 102)]
    return script


def test_every_kind_of_write_prints_parses_and_replays() -> None:
    steps = _record(_script())
    text = trace.dumps(steps)
    parsed = trace.loads(text)
    assert [s.event for s in parsed] == [s.event for s in steps]
    assert trace.dumps(parsed) == text
    assert trace.replay(parsed, CONFIG, MemoryShard) is None
    assert "Append" in text and "UnavailableError" in text  # the batch, and its failed answer


def test_a_replay_that_differs_says_where_and_errors_are_never_parsed() -> None:
    steps = trace.loads(trace.dumps(_record(_script())))
    steps[3] = trace.Step(steps[3].now_ms, steps[3].unix_ms, steps[3].event, "[]")
    assert (trace.replay(steps, CONFIG, MemoryShard) or "").startswith("step 3")
    with pytest.raises(AssertionError):
        trace.decode(trace.encode(errors.UnavailableError("x")))
    with pytest.raises(AssertionError):
        trace.encode(object())
    assert trace.decode(trace.encode([b"x", True, None, 1.5])) == [b"x", True, None, 1.5]
