"""The placement controller's shell (kvstore.server.controller) on an in-memory log: a writer that
fences by epoch (W4) and appends only at the expected offset (W2), and a reader folding the same
records. The second review's findings about the shell, each red without its fix."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

import wal
from kvstore.core.placement_controller import Drain, NodeReport
from kvstore.core.placement_log import PlacementState, Settings
from kvstore.internal.v1 import placement_pb2
from kvstore.server import controller as shell_module
from kvstore.server.controller import ControllerShell
from kvstore.server.metrics import Metrics
from wal.guard import AppendResult


class Log:
    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.epoch = 0
        self.in_flight = 0
        self.overlapping = 0
        self.slow_s = 0.0


class Writer:
    def __init__(self, log: Log) -> None:
        self.log = log
        self.epoch: int | None = None
        self.upcoming_offset: int | None = None
        self.identity: Any = None

    def fence(self) -> int:
        self.log.epoch += 1
        self.epoch = self.log.epoch
        self.upcoming_offset = len(self.log.records)
        return self.upcoming_offset

    def append(self, payloads: Sequence[bytes], expected: int | None) -> AppendResult:
        self.log.in_flight += 1
        self.log.overlapping += self.log.in_flight > 1
        try:
            time.sleep(self.log.slow_s)
            if self.epoch != self.log.epoch:
                raise wal.FencedError("fenced by a newer writer")
            if expected != len(self.log.records):
                raise wal.OffsetMismatchError("mismatch", expected=expected or -1, actual=len(self.log.records))
            self.log.records.extend(payloads)
            self.upcoming_offset = len(self.log.records)
            return AppendResult(tuple(range(expected, self.upcoming_offset)), self.upcoming_offset)
        finally:
            self.log.in_flight -= 1

    def close(self) -> None:
        pass


class Reader:
    def __init__(self, log: Log) -> None:
        self.log = log
        self.state = PlacementState()
        self.lock = threading.Lock()

    def catch_up(self) -> None:
        while self.state.position < len(self.log.records):
            self.state.apply(self.state.position, self.log.records[self.state.position])

    async def read_to(self, offset: int, timeout_s: float) -> bool:
        self.catch_up()
        return self.state.position >= offset


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Log:
    the_log = Log()
    monkeypatch.setattr(wal, "ShardWriter", lambda config: Writer(the_log))
    clock = [0]
    monkeypatch.setattr(shell_module, "_now_ms", lambda: clock[0])
    monkeypatch.setattr(shell_module, "RETRY_S", 0.0)  # the rounds below take no real time
    the_log.clock = clock  # type: ignore[attr-defined]
    return the_log


def new_shell(log: Log, node: str = "a") -> tuple[ControllerShell, Reader]:
    reader = Reader(log)
    shell = ControllerShell(node_id=node, address=f"{node}:1", settings=Settings(4, 2, 4000, 2),
                            reader=reader, bootstrap_servers="x", wal_topic="t.wal", security=None,  # type: ignore[arg-type]
                            metrics=Metrics())
    return shell, reader


async def rounds(log: Log, shell: ControllerShell, reader: Reader, nodes: list[str], count: int) -> None:
    for _ in range(count):
        log.clock[0] += 500  # type: ignore[attr-defined]
        now = log.clock[0]  # type: ignore[attr-defined]
        await shell.step(True, nodes, [NodeReport(n, "", {}, now) for n in nodes])
        reader.catch_up()


def test_another_controllers_start_in_the_log_makes_the_sitting_one_take_office_again(log: Log) -> None:
    """N1: a ControllerStarted of a higher term (a split brain the group has not settled, a hostile
    writer) made every plan a record the fold skips: nothing appended, the office kept, placement
    frozen. Now the shell starts over with a fresh fence and a higher term, and goes on placing."""
    async def main() -> None:
        shell, reader = new_shell(log)
        await rounds(log, shell, reader, ["a", "b", "c"], 12)
        log.epoch += 1  # the other writer fenced ours
        log.records.append(placement_pb2.PlacementRecord(controller_started=placement_pb2.ControllerStarted(
            node_id="x", address="x:1", term=7)).SerializeToString())
        reader.catch_up()
        await rounds(log, shell, reader, ["a", "b"], 30)  # c dies: gone after the grace period (4 s)
        assert reader.state.controller is not None and reader.state.controller.node_id == "a"
        assert reader.state.controller.term > 7
        assert "c" not in reader.state.nodes

    asyncio.run(main())


def test_a_request_whose_caller_gives_up_finishes_under_the_lock(log: Log) -> None:
    """N2: a caller's deadline cancelled a request inside its append: the lock was released with
    the office kept, and the next round appended on the same writer while the first ran."""
    async def main() -> None:
        shell, reader = new_shell(log)
        await rounds(log, shell, reader, ["a", "b", "c"], 10)
        log.slow_s = 0.5
        request = asyncio.create_task(shell.request(Drain("c", reader.state.epoch)))
        await asyncio.sleep(0.1)
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        await rounds(log, shell, reader, ["a", "b", "c", "d"], 2)
        await asyncio.sleep(0.6)
        reader.catch_up()
        assert log.overlapping == 0
        assert "c" in reader.state.drained  # the request itself was recorded, once

    asyncio.run(main())
