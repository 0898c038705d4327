"""The broker and group models hold the semantics the simulation relies on (docs/design.md §4, §6).

If the model were wrong, the simulation would test the protocol against a Kafka that does not
exist; these are its table tests."""

from __future__ import annotations

import pytest

from tests.sim.group import GroupCoordinator
from tests.sim.kafka import (
    INVALID_TXN_STATE,
    PRODUCER_FENCED,
    TRANSACTION_ABORTABLE,
    Broker,
    BrokerError,
    FetchResult,
    KafkaVariant,
    ProduceRequest,
)
from tests.sim.scheduler import Scheduler
from wal.record import Headers

TXN = "t.shard-0"
HEADERS: Headers = [("wal.expected_offset", b"0")]
REC = (b"v", HEADERS)
KAFKA_4 = KafkaVariant()


def broker(variant: KafkaVariant = KAFKA_4, txn_timeout_ms: int = 10_000) -> tuple[Scheduler, Broker]:
    sched = Scheduler(1)
    return sched, Broker(sched, 1, variant, txn_timeout_ms=txn_timeout_ms, marker_delay_ms=(5, 5))


def settle(sched: Scheduler, ms: int = 20) -> None:
    """Run the broker's own events (marker writes, ticks) for `ms`."""
    until = sched.now + ms
    while sched._heap and sched._heap[0][0] <= until:
        sched.step()
    sched.now = max(sched.now, until)


class Producer:
    """A transactional producer, by hand: what tests.sim.writer does with messages. Sequence
    numbers are unique across instances, as the simulation's are."""

    instances = 0

    def __init__(self, b: Broker) -> None:
        self.b = b
        result = b.init_producer_id(TXN, 0)
        assert not isinstance(result, BrokerError)
        self.pid, self.epoch = result
        Producer.instances += 1
        self.seq = Producer.instances * 1_000
        self.in_txn = False

    def produce(self, n: int = 1, *, seq: int | None = None) -> tuple[int, ...] | BrokerError:
        if seq is None:
            self.seq += 1
            seq = self.seq
        first = not self.in_txn
        self.in_txn = True
        return self.b.produce(ProduceRequest(TXN, 0, self.pid, self.epoch, seq, first, (REC,) * n))

    def end(self, commit: bool, epoch: int | None = None) -> int | BrokerError:
        result = self.b.end_txn(TXN, self.pid, self.epoch if epoch is None else epoch, commit)
        if not isinstance(result, BrokerError):
            self.epoch = result
            self.in_txn = False
        return result


def visible(b: Broker, upto: int | None = None) -> FetchResult:
    got: list[FetchResult] = []
    b.fetch(0, 0, upto, 1_000, 0, got.append)
    return got[0]


def test_records_take_offsets_at_once_but_are_visible_only_after_the_commit_marker() -> None:
    sched, b = broker()
    p = Producer(b)
    assert p.produce(2) == (0, 1)
    assert b.ends(0) == (0, 2)  # LSO 0, HW 2: open transaction
    assert visible(b).records == ()
    assert not isinstance(p.end(commit=True), BrokerError)
    assert b.ends(0) == (0, 2)  # answered, marker not written yet
    settle(sched)
    assert b.ends(0) == (3, 3)  # the marker took offset 2 (W1: k+n+1)
    result = visible(b)
    assert [r[0] for r in result.records] == [0, 1] and result.next_position == 3


def test_aborted_records_stay_invisible_and_the_abort_marker_takes_an_offset() -> None:
    sched, b = broker()
    p = Producer(b)
    p.produce(2)
    p.end(commit=False)
    settle(sched)
    assert b.ends(0) == (3, 3)
    assert visible(b) == FetchResult((), 3)


def test_init_transactions_fences_the_old_producer_and_aborts_its_open_transaction() -> None:
    _, b = broker()
    old = Producer(b)
    old.produce(1)
    new = Producer(b)
    assert new.epoch > old.epoch
    assert b.ends(0) == (2, 2)  # the old transaction was aborted: its marker is at 1
    assert old.produce(1) == PRODUCER_FENCED
    assert old.end(commit=True) == PRODUCER_FENCED
    assert visible(b).records == ()


def test_init_transactions_completes_a_commit_whose_markers_are_pending() -> None:
    _, b = broker()
    old = Producer(b)
    old.produce(1)
    old.end(commit=True)
    Producer(b)  # before the marker delay passed
    assert [r[0] for r in visible(b).records] == [0]


def test_a_duplicated_produce_appends_nothing() -> None:
    _, b = broker()
    p = Producer(b)
    assert p.produce(2, seq=7) == (0, 1)
    assert p.produce(2, seq=7) == (0, 1)
    assert b.ends(0)[1] == 2
    assert b.stats.duplicate_produces == 1


def test_kip890_refuses_a_late_end_txn_of_an_earlier_transaction_but_answers_its_retry() -> None:
    sched, b = broker()
    p = Producer(b)
    p.produce(1)
    first_epoch = p.epoch
    p.end(commit=True)
    assert p.epoch == first_epoch + 1  # an epoch per transaction
    settle(sched)
    assert b.end_txn(TXN, p.pid, first_epoch, True) == p.epoch  # a retry of the commit that succeeded
    p.produce(1)
    assert b.end_txn(TXN, p.pid, first_epoch, False) == PRODUCER_FENCED  # a late abort of the first one
    assert p.end(commit=True) == p.epoch
    settle(sched)
    assert [r[0] for r in visible(b).records] == [0, 2]


def test_without_kip890_a_late_end_txn_lands_on_the_next_transaction() -> None:
    sched, b = broker(KafkaVariant(kip890=False))
    p = Producer(b)
    p.produce(1)
    epoch = p.epoch
    p.end(commit=True)
    assert p.epoch == epoch
    settle(sched)
    p.produce(1)  # the next transaction
    assert b.end_txn(TXN, p.pid, epoch, False) == epoch  # the late abort of... the next transaction
    settle(sched)
    assert p.end(commit=True) == INVALID_TXN_STATE  # the producer's own commit finds it aborted
    assert [r[0] for r in visible(b).records] == [0]


def test_kip890_part1_refuses_a_produce_outside_a_transaction() -> None:
    _, b = broker()
    p = Producer(b)
    p.in_txn = True  # a later produce of a transaction the broker does not know
    assert p.produce(1) == TRANSACTION_ABORTABLE


def test_without_fencing_a_zombie_commits_the_new_holders_transaction() -> None:
    sched, b = broker(KafkaVariant(fencing=False))
    zombie = Producer(b)
    zombie.produce(1)  # offset 0
    leader = Producer(b)  # aborts the zombie's transaction (marker 1) but fences nobody
    leader.produce(1)  # offset 2
    assert zombie.end(commit=True) == zombie.epoch  # "committed"
    settle(sched)
    assert [r[0] for r in visible(b).records] == [2]  # the zombie's record is gone, the leader's committed


def test_the_transaction_timeout_aborts_and_fences_a_stalled_producer() -> None:
    sched, b = broker(txn_timeout_ms=100)
    p = Producer(b)
    p.produce(1)
    settle(sched, 300)
    assert b.stats.txn_timeouts == 1
    assert b.ends(0) == (2, 2)
    assert p.end(commit=True) == PRODUCER_FENCED


def test_read_committed_stops_at_the_lso_and_at_the_bound() -> None:
    sched, b = broker()
    p = Producer(b)
    p.produce(1)
    p.end(commit=True)
    settle(sched)
    p.produce(1)  # open at 2
    b.produce_foreign(0, b"x", [])  # 3, non-transactional, behind the open transaction
    assert visible(b) == FetchResult(((0, b"v", HEADERS),), 2)
    assert visible(b, upto=1) == FetchResult(((0, b"v", HEADERS),), 1)


def test_a_fetch_with_nothing_to_read_waits_for_the_lso_to_move() -> None:
    _, b = broker()
    got: list[FetchResult] = []
    b.fetch(0, 0, None, 10, 500, got.append)
    assert got == []
    empty: Headers = []
    b.produce_foreign(0, b"x", empty)
    assert got == [FetchResult(((0, b"x", empty),), 1)]


# ---- the group --------------------------------------------------------------------------------------


def group(shards: int = 2) -> tuple[Scheduler, GroupCoordinator]:
    sched = Scheduler(1)
    return sched, GroupCoordinator(sched, shards, session_timeout_ms=1_000, revoke_timeout_ms=2_000)


def test_a_silent_member_keeps_its_shards_until_its_session_expires() -> None:
    sched, g = group()
    assert g.heartbeat("a", frozenset(), join=True).assigned == frozenset({0, 1})
    g.heartbeat("b", frozenset(), join=True)
    settle(sched, 900)  # "a" went silent; "b" keeps heartbeating
    assert g.heartbeat("b", frozenset(), join=False).assigned in (frozenset(), frozenset({0}), frozenset({1}))
    settle(sched, 600)
    assert g.heartbeat("b", frozenset(), join=False).assigned == frozenset({0, 1})
    zombie = g.heartbeat("a", frozenset({0, 1}), join=False)
    assert not zombie.known  # the zombie learns only now that it was expelled


def test_rebalancing_revokes_first_and_moves_once_released() -> None:
    _, g = group()
    g.heartbeat("a", frozenset(), join=True)
    answer = g.heartbeat("b", frozenset(), join=True)
    assert answer.assigned == frozenset()  # nothing moves before the owner released it
    revoked = g.heartbeat("a", frozenset({0, 1}), join=False)
    assert len(revoked.assigned) == 1
    released = (set(range(2)) - revoked.assigned).pop()
    g.heartbeat("a", frozenset(revoked.assigned), join=False)  # a's replica stopped leading it
    assert g.heartbeat("b", frozenset(), join=False).assigned == frozenset({released})


def test_a_member_back_within_its_session_keeps_its_shards() -> None:
    sched, g = group()
    g.heartbeat("a", frozenset(), join=True)
    settle(sched, 500)
    assert g.heartbeat("a", frozenset(), join=True).assigned == frozenset({0, 1})  # restarted, static id


@pytest.mark.parametrize("variant", [KafkaVariant(), KafkaVariant(kip890=False)])
def test_markers_of_a_committed_transaction_come_after_its_records(variant: KafkaVariant) -> None:
    sched, b = broker(variant)
    p = Producer(b)
    p.produce(3)
    p.end(commit=True)
    settle(sched)
    log = b.partitions[0].log
    assert [e.control for e in log] == [False, False, False, True]
    assert all(e.committed for e in log)
