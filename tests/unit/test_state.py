"""`kvstore.core.state`: the pure state machine (key transition, key encoding, batch apply), without Kafka."""

from __future__ import annotations

import random
from collections.abc import Collection

import pytest

from kvstore.core.state import Applied, ChangeType, KeyState, RequestRecord, apply_entries, next_key_state
from kvstore.internal.v1 import wal_entry_pb2 as pb


def put(key: bytes, value: bytes = b"v") -> pb.Effect:
    return pb.Effect(put=pb.PutEffect(key=key, value=value))


def delete(key: bytes) -> pb.Effect:
    return pb.Effect(delete=pb.DeleteEffect(key=key))


def entry(*effects: pb.Effect, rid: str = "", response: bytes = b"", ms: int = 0) -> bytes:
    return pb.WalEntry(request_id=rid, effects=effects, response=response, leader_unix_ms=ms).SerializeToString()


def run(
    records: list[tuple[int, bytes]], state: dict[bytes, KeyState] | None = None, seen: Collection[str] = ()
) -> Applied:
    state = state or {}
    return apply_entries(state.get, seen.__contains__, records)


# ---- next_key_state -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "effect", "revision", "expected"),
    [
        pytest.param(None, put(b"k", b"a"), 7, KeyState(b"a", 1, 7, 7), id="put-missing"),
        pytest.param(None, put(b"k", b""), 0, KeyState(b"", 1, 0, 0), id="put-missing-empty-value-rev-0"),
        pytest.param(KeyState(b"a", 1, 7, 7), put(b"k", b"b"), 9, KeyState(b"b", 2, 9, 7), id="put-existing"),
        pytest.param(KeyState(b"a", 41, 50, 3), put(b"k", b"a"), 60, KeyState(b"a", 42, 60, 3), id="put-same-value"),
        pytest.param(KeyState(b"a", 3, 8, 2), delete(b"k"), 9, None, id="delete-existing"),
        pytest.param(None, delete(b"k"), 9, None, id="delete-missing"),
    ],
)
def test_next_key_state(old: KeyState | None, effect: pb.Effect, revision: int, expected: KeyState | None) -> None:
    assert next_key_state(old, effect, revision) == expected


def test_next_key_state_refuses_effect_without_kind() -> None:
    with pytest.raises(AssertionError, match="without a kind"):
        next_key_state(None, pb.Effect(), 3)


# ---- KeyState encoding --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state",
    [
        pytest.param(KeyState(b"", 1, 0, 0), id="empty-value"),
        pytest.param(KeyState(b"hello", 3, 12, 4), id="plain"),
        pytest.param(KeyState(bytes(range(256)), 2, 5, 1), id="binary"),
        pytest.param(KeyState(b"\x00" * 24, 1, 1, 1), id="value-looks-like-header"),
        pytest.param(KeyState(b"x", 2**63 - 1, 2**62, 2**40), id="huge-numbers"),
    ],
)
def test_key_state_round_trip(state: KeyState) -> None:
    raw = state.encode()
    assert len(raw) == 24 + len(state.value)
    assert KeyState.decode(raw) == state


def test_key_state_decode_refuses_truncated() -> None:
    with pytest.raises(AssertionError, match="truncated"):
        KeyState.decode(KeyState(b"", 1, 2, 3).encode()[:23])


# ---- apply_entries ------------------------------------------------------------------------------

OLD = KeyState(b"old", 2, 4, 1)
GARBAGE = b"\xff\xff\xff\xff\x0f"  # an invalid varint tag: protobuf refuses it


@pytest.mark.parametrize(
    ("records", "state", "seen", "writes", "duplicates", "malformed"),
    [
        pytest.param([(5, entry(put(b"k", b"a")))], {}, set(), {b"k": KeyState(b"a", 1, 5, 5)}, 0, 0, id="put"),
        pytest.param([(5, entry(put(b"k", b"a")))], {b"k": OLD}, set(), {b"k": KeyState(b"a", 3, 5, 1)}, 0, 0,
                     id="put-existing"),
        pytest.param([(5, entry(delete(b"k")))], {b"k": OLD}, set(), {b"k": None}, 0, 0, id="delete"),
        pytest.param([(5, entry(delete(b"k")))], {}, set(), {b"k": None}, 0, 0, id="delete-missing"),
        pytest.param([(5, entry(put(b"a"), put(b"b", b"B")))], {}, set(),
                     {b"a": KeyState(b"v", 1, 5, 5), b"b": KeyState(b"B", 1, 5, 5)}, 0, 0, id="two-keys-one-entry"),
        pytest.param([(5, entry(put(b"k", b"1"), put(b"k", b"2")))], {}, set(), {b"k": KeyState(b"2", 2, 5, 5)}, 0, 0,
                     id="same-key-twice-one-entry"),
        pytest.param([(5, entry(put(b"k", b"1"))), (6, entry(put(b"k", b"2")))], {b"k": OLD}, set(),
                     {b"k": KeyState(b"2", 4, 6, 1)}, 0, 0, id="overlay-put-put"),
        pytest.param([(5, entry(delete(b"k"))), (8, entry(put(b"k", b"n")))], {b"k": OLD}, set(),
                     {b"k": KeyState(b"n", 1, 8, 8)}, 0, 0, id="overlay-delete-then-put-recreates"),
        pytest.param([(5, entry(put(b"k", b"n"))), (6, entry(delete(b"k")))], {}, set(), {b"k": None}, 0, 0,
                     id="overlay-put-then-delete"),
        pytest.param([(5, entry(put(b"k", b"1"), rid="r")), (6, entry(put(b"k", b"2"), rid="r"))], {}, set(),
                     {b"k": KeyState(b"1", 1, 5, 5)}, 1, 0, id="dedup-within-call"),
        pytest.param([(5, entry(put(b"k", b"1"), rid="r"))], {b"k": OLD}, {"r"}, {}, 1, 0, id="dedup-already-seen"),
        pytest.param([(5, entry(put(b"k", b"1"), rid="r")), (6, entry(put(b"j"), rid="s"))], {}, {"r"},
                     {b"j": KeyState(b"v", 1, 6, 6)}, 1, 0, id="dedup-only-the-seen-one"),
        pytest.param([(5, entry(put(b"k", b"1"))), (6, entry(put(b"k", b"2")))], {}, {""},
                     {b"k": KeyState(b"2", 2, 6, 5)}, 0, 0, id="no-request-id-never-dedups"),
        pytest.param([(5, GARBAGE)], {}, set(), {}, 0, 1, id="garbage"),
        pytest.param([(5, entry(pb.Effect()))], {}, set(), {}, 0, 1, id="effect-without-kind"),
        pytest.param([(5, entry(put(b"k"), pb.Effect(), rid="r"))], {}, set(), {}, 0, 1,
                     id="kindless-effect-poisons-whole-entry"),
        pytest.param([(5, GARBAGE), (6, entry(put(b"k"))), (7, entry(pb.Effect()))], {}, set(),
                     {b"k": KeyState(b"v", 1, 6, 6)}, 0, 2, id="malformed-around-good"),
        pytest.param([(5, b"")], {}, set(), {}, 0, 0, id="empty-payload-is-empty-entry"),
        pytest.param([], {b"k": OLD}, set(), {}, 0, 0, id="no-records"),
    ],
)
def test_apply_entries(
    records: list[tuple[int, bytes]],
    state: dict[bytes, KeyState],
    seen: set[str],
    writes: dict[bytes, KeyState | None],
    duplicates: int,
    malformed: int,
) -> None:
    before = dict(state)
    out = run(records, state, seen)
    assert (out.writes, out.duplicates, out.malformed) == (writes, duplicates, malformed)
    assert state == before  # pure: the lookup's state is never touched


def test_apply_entries_changes_and_requests() -> None:
    out = run(
        [
            (3, entry(put(b"a", b"1"), delete(b"b"), rid="r1", response=b"\x00resp1")),
            (4, GARBAGE),
            (7, entry(put(b"a", b"2"))),
            (9, entry(put(b"c"), rid="r1", response=b"dup")),
            (10, entry(delete(b"a"), rid="r2")),
        ],
        {b"b": OLD},
    )
    assert [(c.type, c.key, c.state, c.revision) for c in out.changes] == [
        (ChangeType.PUT, b"a", KeyState(b"1", 1, 3, 3), 3),
        (ChangeType.DELETE, b"b", None, 3),
        (ChangeType.PUT, b"a", KeyState(b"2", 2, 7, 3), 7),
        (ChangeType.DELETE, b"a", None, 10),
    ]
    assert out.requests == [RequestRecord("r1", 3, b"\x00resp1"), RequestRecord("r2", 10, b"")]
    assert (out.duplicates, out.malformed) == (1, 1)


@pytest.mark.parametrize(
    ("ms", "recorded_ms"),
    [pytest.param(1_700_000_000_123, 1_700_000_000_123, id="stamped"), pytest.param(0, 0, id="old-entry"),
     pytest.param(-5, 0, id="negative-is-unknown")],
)
def test_request_record_keeps_the_leader_time(ms: int, recorded_ms: int) -> None:
    out = run([(4, entry(put(b"k"), rid="r", response=b"a", ms=ms))])
    assert out.requests == [RequestRecord("r", 4, b"a", recorded_ms)]


def test_leader_times_are_reported_in_order_between_dedup_and_request() -> None:
    """Every well-formed entry with a time reports it (duplicates and id-less ones too), after its
    own duplicate check and before its request: the order a bounded table evicts in."""
    events: list[object] = []

    def seen(request_id: str) -> bool:
        events.append(("seen", request_id))
        return request_id == "old" or any(e == ("request", request_id) for e in events)

    apply_entries(
        {}.get, seen,
        [
            (1, entry(put(b"a"), rid="r1", ms=100)),
            (2, entry(put(b"b"), ms=110)),
            (3, GARBAGE),
            (4, entry(put(b"c"), rid="old", ms=120)),
            (5, entry(put(b"d"), rid="r2")),  # no time: nothing to report
            (6, entry(put(b"e"), rid="r1", ms=130)),
        ],
        on_request=lambda r: events.append(("request", r.request_id)),
        on_leader_time=lambda ms: events.append(("time", ms)),
    )
    assert events == [
        ("seen", "r1"), ("time", 100), ("request", "r1"),
        ("time", 110),
        ("seen", "old"), ("time", 120),
        ("seen", "r2"), ("request", "r2"),
        ("seen", "r1"), ("time", 130),
    ]


@pytest.mark.parametrize(
    "offsets",
    [pytest.param([3, 3], id="repeated"), pytest.param([4, 3], id="backwards"), pytest.param([0, 2, 1], id="late")],
)
def test_apply_entries_refuses_records_out_of_order(offsets: list[int]) -> None:
    with pytest.raises(AssertionError, match="out of order"):
        run([(offset, entry(put(b"k"))) for offset in offsets])


# ---- determinism: however the records are batched, the state is the same ------------------------


def _random_records(rng: random.Random) -> list[tuple[int, bytes]]:
    keys = [b"", b"a", b"b", b"\xff", b"a\x00"]
    records, offset = [], rng.randrange(3)
    for _ in range(rng.randrange(1, 40)):
        offset += rng.randrange(1, 4)
        if rng.random() < 0.07:
            payload = rng.choice([GARBAGE, entry(pb.Effect()), entry(put(b"a"), pb.Effect(), rid="r0")])
        else:
            effects = [
                put(key, rng.randbytes(rng.randrange(4))) if rng.random() < 0.7 else delete(key)
                for key in rng.choices(keys, k=rng.randrange(4))
            ]
            rid = rng.choice(["", "", "r0", "r1", "r2", "r3", "r4", "r5"])
            ms = rng.choice([0, rng.randrange(1_000, 2_000)])
            payload = entry(*effects, rid=rid, response=rid.encode(), ms=ms)
        records.append((offset, payload))
    return records


def _apply_in_chunks(records: list[tuple[int, bytes]], cuts: list[int]) -> tuple[dict, dict, list, int, int]:
    """Simulate the store as dicts: apply each chunk, then persist its writes and request ids."""
    state: dict[bytes, KeyState] = {}
    requests: dict[str, RequestRecord] = {}
    changes, duplicates, malformed = [], 0, 0
    for lo, hi in zip([0, *cuts], [*cuts, len(records)], strict=True):
        out = apply_entries(state.get, requests.__contains__, records[lo:hi])
        for key, new in out.writes.items():
            if new is None:
                state.pop(key, None)
            else:
                state[key] = new
        requests.update((r.request_id, r) for r in out.requests)
        changes += out.changes
        duplicates += out.duplicates
        malformed += out.malformed
    return state, requests, changes, duplicates, malformed


@pytest.mark.parametrize("seed", range(300))
def test_batching_does_not_change_the_outcome(seed: int) -> None:
    rng = random.Random(seed)
    records = _random_records(rng)
    n = len(records)
    at_once = _apply_in_chunks(records, [])
    assert _apply_in_chunks(records, list(range(1, n))) == at_once  # one record at a time
    for _ in range(3):
        assert _apply_in_chunks(records, sorted(rng.sample(range(1, n), rng.randrange(n)))) == at_once
    state, requests = at_once[:2]
    offsets = {offset for offset, _ in records}
    for key_state in state.values():
        assert key_state.create_revision <= key_state.mod_revision
        assert {key_state.create_revision, key_state.mod_revision} <= offsets
    assert len({r.revision for r in requests.values()}) == len(requests)
