"""`kvstore.core.cut` and `kvstore.core.recent_writes`: a read of several shards that is one cut; pure.

The cut's rounds as a table; the index that validates a part, against a brute-force model on
random writes; and a read-only cross-shard Txn read optimistically over memory replicas, with a
transaction resolved between two of its parts' reads (the anomaly the validation exists for)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvstore import errors
from kvstore.core import txn
from kvstore.core.cut import Answer, Cut, CutConfig, GiveUp, ReadParts, ValidateParts
from kvstore.core.evaluate import evaluate_put
from kvstore.core.recent_writes import RecentWrites
from kvstore.core.request_window import MemoryShard
from kvstore.core.txn_driver import DriverConfig, Phase, TxnDriver, TxnMutation
from kvstore.core.txn_events import (
    Finished,
    PartRead,
    ReadAnswered,
    Reply,
    SendPrepare,
    SendRead,
    SendValidate,
    Started,
    Tick,
    ValidateAnswered,
)
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.v1 import kv_pb2 as kv
from tests.unit.test_txn import NOW_MS, SHARDS, A, B, C, cluster, drive, get_op, put_op, value

# ---- the cut --------------------------------------------------------------------------------------------


def test_a_cut_reads_validates_and_answers() -> None:
    cut = Cut([2, 0, 1])
    assert cut.start() == ReadParts(1)
    assert cut.read({0: 5, 1: 7, 2: 9}) == ValidateParts({0: 5, 1: 7, 2: 9})
    assert cut.validated([]) == Answer(1) and cut.done


def test_a_change_reads_again_then_gives_up() -> None:
    cut = Cut([0, 1], CutConfig(max_rounds=2))
    cut.start()
    cut.read({0: 1, 1: 1})
    assert cut.validated([1]) == ReadParts(2)
    cut.read({0: 2, 1: 3})
    action = cut.validated([0])
    assert isinstance(action, GiveUp) and isinstance(action.error, errors.UnavailableError)
    assert action.error.definite and "[0]" in str(action.error)


def test_one_shard_is_one_instant_and_the_mutation_skips_validation() -> None:
    one = Cut([3])
    one.start()
    assert one.read({3: 4}) == Answer(1)
    mutated = Cut([0, 1], CutConfig(skip_validation=True))
    mutated.start()
    assert mutated.read({0: 1, 1: 1}) == Answer(1)


def test_a_cut_refuses_events_out_of_order() -> None:
    cut = Cut([0, 1])
    with pytest.raises(AssertionError):
        cut.validated([])
    cut.start()
    with pytest.raises(AssertionError):
        cut.read({0: 1})  # a part missing
    with pytest.raises(AssertionError):
        cut.start()


# ---- the index ------------------------------------------------------------------------------------------


def test_recent_writes_answers_for_keys_and_spans() -> None:
    recent = RecentWrites(floor=10)
    recent.note([b"b", b"d", b"b"], [10, 11, 12])
    assert recent.unchanged_since(13, keys=[b"b", b"d"], span=(b"a", None))
    assert not recent.unchanged_since(12, keys=[b"b"])
    assert recent.unchanged_since(12, keys=[b"d"]) and not recent.unchanged_since(11, keys=[b"d"])
    assert not recent.unchanged_since(12, span=(b"a", b"c")) and recent.unchanged_since(12, span=(b"c", b"z"))
    assert not recent.unchanged_since(9, keys=[b"x"])  # below the floor: nothing known
    recent.reset(20)
    assert len(recent) == 0 and not recent.unchanged_since(19) and recent.unchanged_since(20, span=(b"", None))


def test_recent_writes_never_answers_lower_than_a_revision_noted_before() -> None:
    """One apply's effects may come in another order than their revisions (a decision's
    effects by record id); noted at the highest revision seen so far, a walk back from the newest
    write can stop at the first one older than the question."""
    recent = RecentWrites(floor=0)
    recent.note([b"a", b"b", b"c"], [5, 3, 4])
    assert not recent.unchanged_since(5, span=(b"b", b"c")) and not recent.unchanged_since(5, keys=[b"c"])
    recent.note([b"d"], [6])
    assert recent.unchanged_since(6, span=(b"a", b"d")) and not recent.unchanged_since(6, span=(b"d", None))


def test_a_read_while_a_leaders_marker_slot_is_assumed_is_at_the_slot() -> None:
    """The slot after a leader's own batch is assumed to hold its commit marker. A record that
    a writer outside the guard put there is applied at the slot after the rewind: a read taken
    before claims only what lies below the slot, so the validation still sees that record."""
    store = MemoryShard()
    entry = evaluate_put(kv.PutRequest(key=b"y", value=b"1"), store.get, 0, 0).entry
    store.apply([(0, entry.SerializeToString())], 2, unverified=1)
    read_at_revision = store.read_revision
    assert read_at_revision == 1 and store.applied_offset == 2
    assert store.rewind_unverified() and store.read_revision == 1
    foreign = evaluate_put(kv.PutRequest(key=b"y", value=b"2"), store.get, 0, 1).entry
    store.apply([(1, foreign.SerializeToString())], 3)
    assert not store.recent.unchanged_since(read_at_revision, keys=[b"y"])
    assert not store.recent.unchanged_since(read_at_revision, span=(b"", None))
    store.restarted()
    assert store.recent.floor == store.read_revision == 3


@pytest.mark.parametrize("seed", range(20))
def test_recent_writes_equals_a_full_history(seed: int) -> None:
    """Against the whole history of writes: the index never says unchanged when something
    changed, and says so whenever it knows (at or above its floor)."""
    rng = random.Random(seed)
    recent = RecentWrites(floor=0, capacity=rng.choice([4, 16, 1000]))
    history: list[tuple[bytes, int]] = []
    for revision in range(200):
        keys = [bytes([rng.randrange(97, 97 + 20)]) for _ in range(rng.randint(1, 3))]
        recent.note(keys, [revision] * len(keys))
        history += [(k, revision) for k in keys]
        since = rng.randrange(0, revision + 2)
        asked = [bytes([rng.randrange(97, 97 + 20)]) for _ in range(rng.randint(0, 3))]
        lo = bytes([rng.randrange(97, 97 + 20)])
        hi = None if rng.random() < 0.3 else bytes([rng.randrange(ord(lo), 97 + 21)])
        changed = any(r >= since and (k in asked or (lo <= k and (hi is None or k < hi))) for k, r in history)
        answer = recent.unchanged_since(since, keys=asked, span=(lo, hi))
        if changed:
            assert not answer
        elif since >= recent.floor:
            assert answer


# ---- a read-only cross-shard Txn --------------------------------------------------------------------------

CONFIG = DriverConfig(shard_count=SHARDS, max_attempts=3, backoff_first_ms=10, backoff_max_ms=40, cut_rounds=2)
SUM = kv.TxnRequest(request_id="sum-1", success=[get_op(A), get_op(B), get_op(C)])


def read_at(shards: list[Any], shard: int, request: kv.TxnRequest = SUM) -> PartRead:
    store = shards[shard].store
    return PartRead(txn.evaluate_read_part(request, shard, SHARDS, store.get), store.read_revision)


def test_a_read_only_txn_needs_no_record_when_its_reads_are_a_cut() -> None:
    shards = cluster(A=b"1", B=b"2", C=b"3")
    ends = [s.store.applied_offset for s in shards]
    d = TxnDriver.begin(CONFIG, "r1", SUM, now_unix_ms=NOW_MS, deadline_ms=1_000)
    assert d.phase is Phase.READING
    reads = d.step(Started(), now_ms=0)
    assert [type(a).__name__ for a in reads] == ["SendRead"] * 3  # every participant, the coordinator too
    out: list[Any] = []
    for action in reads:
        assert isinstance(action, SendRead)
        out = d.step(ReadAnswered(action.shard, read_at(shards, action.shard)), now_ms=1)
    assert [type(a).__name__ for a in out] == ["SendValidate"] * 3
    for action in out:
        assert isinstance(action, SendValidate)
        store = shards[action.shard].store
        done = d.step(ValidateAnswered(action.shard, store.recent.unchanged_since(action.revision, keys=action.keys)),
                      now_ms=2)
    reply = done[0]
    assert isinstance(reply, Reply) and isinstance(reply.answer, kv.TxnResponse)
    assert [r.get.kv.value for r in reply.answer.results] == [b"1", b"2", b"3"]
    assert not reply.answer.result.HasField("revision") and reply.answer.result.shard == 0
    assert isinstance(done[1], Finished) and [s.store.applied_offset for s in shards] == ends  # nothing appended


def test_a_transaction_resolved_between_two_reads_is_caught_and_read_again() -> None:
    """The anomaly: shard 2 is read, a transfer then commits and resolves everywhere, shard 0 is
    read: the reads alone show half of it. The validation at shard 2 sees the resolve's write."""
    shards = cluster(A=b"5", C=b"5")
    d = TxnDriver.begin(CONFIG, "r1", SUM, now_unix_ms=NOW_MS, deadline_ms=1_000)
    d.step(Started(), now_ms=0)
    d.step(ReadAnswered(2, read_at(shards, 2)), now_ms=1)  # C = 5
    move = kv.TxnRequest(request_id="move", success=[put_op(A, b"0"), put_op(C, b"10")])
    decided, _ = drive(shards, move, "m1")  # A 5 -> 0, C 5 -> 10: the sum stays 10
    assert isinstance(decided, pb.TxnDecided) and decided.commit
    d.step(ReadAnswered(1, read_at(shards, 1)), now_ms=2)
    validates = d.step(ReadAnswered(0, read_at(shards, 0)), now_ms=3)  # A = 0: with C = 5 the sum is 5
    changed = []
    for action in validates:
        assert isinstance(action, SendValidate)
        ok = shards[action.shard].store.recent.unchanged_since(action.revision, keys=action.keys)
        changed += [] if ok else [action.shard]
        out = d.step(ValidateAnswered(action.shard, ok), now_ms=4)
    assert changed == [2] and [type(a).__name__ for a in out] == ["SendRead"] * 3  # read again
    for action in out:
        out2 = d.step(ReadAnswered(action.shard, read_at(shards, action.shard)), now_ms=5)
    for action in out2:
        store = shards[action.shard].store
        final = d.step(ValidateAnswered(action.shard, store.recent.unchanged_since(action.revision, keys=action.keys)),
                       now_ms=6)
    reply = final[0]
    assert isinstance(reply, Reply) and isinstance(reply.answer, kv.TxnResponse)
    assert sum(int(r.get.kv.value or b"0") for r in reply.answer.results) == 10


def test_a_read_that_keeps_changing_takes_locks_instead() -> None:
    d = TxnDriver.begin(CONFIG, "r1", SUM, now_unix_ms=NOW_MS, deadline_ms=1_000)
    out = d.step(Started(), now_ms=0)
    vote = pb.TxnVote(compares_held=True)
    for _round in range(CONFIG.cut_rounds):
        for action in out:
            out2 = d.step(ReadAnswered(action.shard, PartRead(vote, 1)), now_ms=1)
        out = []
        for action in out2:
            out = d.step(ValidateAnswered(action.shard, action.shard != 1), now_ms=2) or out
    assert d.phase is Phase.PREPARING and [type(a).__name__ for a in out] == ["SendPrepare", "SendPrepare"]
    assert all(isinstance(a, SendPrepare) and a.shard in (1, 2) for a in out)


def test_a_read_only_txn_refuses_the_invalid_ends_at_its_deadline_and_falls_back_to_locks() -> None:
    d = TxnDriver.begin(CONFIG, "r1", SUM, now_unix_ms=NOW_MS, deadline_ms=50)
    d.step(Started(), now_ms=0)
    out = d.step(ReadAnswered(0, errors.InvalidRequestError("bad")), now_ms=1)
    assert isinstance(out[0], Reply) and isinstance(out[0].answer, errors.InvalidRequestError) and d.finished
    d = TxnDriver.begin(CONFIG, "r2", SUM, now_unix_ms=NOW_MS, deadline_ms=50)
    d.step(Started(), now_ms=0)
    assert d.wake_at_ms() == 50
    out = d.step(Tick(), now_ms=50)
    assert isinstance(out[0], Reply) and isinstance(out[0].answer, errors.DeadlineError) and d.finished
    d = TxnDriver.begin(CONFIG, "r3", SUM, now_unix_ms=NOW_MS, deadline_ms=1_000)
    d.step(Started(), now_ms=0)
    for attempt_at in (1, 20, 60):
        out = d.step(ReadAnswered(2, errors.UnavailableError("no leader")), now_ms=attempt_at)
        if d.phase is not Phase.READING:
            break
        assert [type(a).__name__ for a in d.step(Tick(), now_ms=attempt_at + 45)] == ["SendRead"]
    # A part that cannot be read optimistically (here: no leader; or a node of an older release):
    # the locking path, which retries and answers on its own terms.
    assert d.phase is Phase.PREPARING and [type(a).__name__ for a in out] == ["SendPrepare", "SendPrepare"]


def test_the_mutation_answers_unvalidated() -> None:
    config = DriverConfig(shard_count=SHARDS, mutations=frozenset({TxnMutation.SCAN_WITHOUT_CUT}))
    d = TxnDriver.begin(config, "r1", SUM, now_unix_ms=NOW_MS, deadline_ms=1_000)
    out = d.step(Started(), now_ms=0)
    vote = pb.TxnVote(compares_held=True, success=pb.TxnBranch(op_indices=[0], results=kv.TxnResponse(
        results=[kv.TxnOpResult(get=kv.GetResponse())]).SerializeToString()))
    votes = {i: pb.TxnVote(compares_held=True, success=pb.TxnBranch(op_indices=[i], results=vote.success.results))
             for i in range(SHARDS)}
    for action in out:
        final = d.step(ReadAnswered(action.shard, PartRead(votes[action.shard], 1)), now_ms=1)
    assert isinstance(final[0], Reply) and isinstance(final[0].answer, kv.TxnResponse)


def test_read_only_and_part_keys() -> None:
    assert txn.read_only(SUM) and not txn.read_only(kv.TxnRequest(failure=[put_op(A, b"1")]))
    with_compare = kv.TxnRequest(compares=[kv.Compare(key=B, target=kv.Compare.TARGET_VERSION, version=1)],
                                 success=[get_op(B), get_op(A)], failure=[get_op(B)])
    assert txn.part_keys(txn.part_of(with_compare, 1, SHARDS)) == (B,)
    assert value(cluster(A=b"1"), A) == b"1"


def test_a_read_only_answer_too_large_is_refused() -> None:
    big = kv.TxnResponse(results=[kv.TxnOpResult(get=kv.GetResponse(found=True, kv=kv.KeyValue(
        value=b"v" * (700 * 1024))))]).SerializeToString()
    d = TxnDriver.begin(CONFIG, "r1", SUM, now_unix_ms=NOW_MS, deadline_ms=1_000)
    out = d.step(Started(), now_ms=0)
    for action in out:
        vote = pb.TxnVote(compares_held=True, success=pb.TxnBranch(op_indices=[action.shard], results=big))
        final = d.step(ReadAnswered(action.shard, PartRead(vote, 1)), now_ms=1)
    for action in final:
        done = d.step(ValidateAnswered(action.shard, True), now_ms=2)
    assert isinstance(done[0], Reply) and isinstance(done[0].answer, errors.InvalidRequestError)
    assert d.step(ReadAnswered(0, PartRead(pb.TxnVote(), 1)), now_ms=3) == []  # finished: late answers ignored
