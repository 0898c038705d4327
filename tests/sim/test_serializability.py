"""The bank's strict-serializability check (`tests.sim.checker.check_serializable`) on histories
small enough to read: the anomalies it exists for are caught, serial histories pass."""

from __future__ import annotations

from tests.sim.bank import BankKind, BankOp
from tests.sim.checker import check_serializable
from tests.sim.client import Outcome

A, B = b"acct-0", b"acct-1"


def transfer(name: str, invoke: int, complete: int, read: dict[bytes, int]) -> BankOp:
    return BankOp(0, BankKind.TRANSFER, name, (A, B), 1, invoke, complete, Outcome.OK, True,
                  read_versions=read, wrote_versions={k: v + 1 for k, v in read.items()})


def summed(invoke: int, complete: int, read: dict[bytes, int]) -> BankOp:
    return BankOp(1, BankKind.SUM, "", (A, B), 0, invoke, complete, Outcome.OK, None,
                  balances=dict.fromkeys(read, 0), read_versions=read)


def test_a_serial_history_passes() -> None:
    t1 = transfer("t1", 1, 2, {A: 0, B: 0})
    t2 = transfer("t2", 3, 4, {A: 1, B: 1})
    assert check_serializable([t1, summed(5, 6, {A: 2, B: 2}), t2]) is None
    assert check_serializable([t1, summed(2, 3, {A: 1, B: 1})]) is None  # concurrent with nothing after


def test_half_a_transfer_seen_is_a_cycle() -> None:
    t1 = transfer("t1", 1, 10, {A: 0, B: 0})
    torn = summed(2, 9, {A: 1, B: 0})  # saw t1's write of A, not of B
    why = check_serializable([t1, torn])
    assert why is not None and "t1" in why


def test_a_stale_read_after_an_acknowledged_transfer_is_a_cycle() -> None:
    t1 = transfer("t1", 1, 2, {A: 0, B: 0})
    stale = summed(3, 4, {A: 0, B: 0})  # invoked after t1 was acknowledged, read before it
    assert check_serializable([t1, stale]) is not None


def test_two_writers_of_one_version_are_a_lost_update() -> None:
    why = check_serializable([transfer("t1", 1, 3, {A: 0, B: 0}), transfer("t2", 2, 4, {A: 0, B: 0})])
    assert why is not None and "both wrote version 1" in why


def test_a_lost_answer_is_a_placeholder_in_the_chain() -> None:
    # t2's answer was lost (not OK): t3 read the versions it left; a sum between is placed by them.
    t1 = transfer("t1", 1, 2, {A: 0, B: 0})
    t3 = transfer("t3", 5, 6, {A: 2, B: 2})
    assert check_serializable([t1, summed(3, 4, {A: 1, B: 1}), t3]) is None
    # Invoked after t3 was acknowledged, yet it read the versions t3 overwrote.
    assert check_serializable([t1, summed(7, 8, {A: 2, B: 2}), t3]) is not None
