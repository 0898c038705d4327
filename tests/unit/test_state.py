"""`kvstore.core.state`: the pure state machine (key transition, key encoding, batch apply), without Kafka."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection

import pytest

from kvstore.core.entries import decode_canonical, decode_entry, decode_fields
from kvstore.core.state import (
    Applied,
    ChangeType,
    KeyState,
    Lookup,
    RequestRecord,
    RequestSeen,
    apply_effects,
    apply_entries,
    next_key_state,
)
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


# ---- the replay fast path: plain-value decoding and apply_entries against the protobuf reference --


def _reference_fields(payload: bytes) -> tuple[str, list[tuple[bytes, bytes | None]], bytes, int, int] | None:
    """What protobuf makes of a payload (`decode_entry`), as plain values; a request kind outside
    the enum is kept as unspecified."""
    decoded = decode_entry(payload)
    if decoded is None:
        return None
    effects = [(f.put.key, f.put.value) if f.WhichOneof("kind") == "put" else (f.delete.key, None)
               for f in decoded.effects]
    kind = decoded.request_kind if decoded.request_kind in (1, 2, 3, 4, 5, 6, 7) else 0
    return decoded.request_id, effects, decoded.response, decoded.leader_unix_ms, kind


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _random_entry(rng: random.Random) -> pb.WalEntry:
    sizes = [0, 0, 1, 8, 127, 128, 300, 16_384]
    effects = []
    for _ in range(rng.choice([0, 1, 1, 1, 2, 5])):
        key = rng.randbytes(rng.choice(sizes[:6]))
        if rng.random() < 0.7:
            effects.append(put(key, rng.randbytes(rng.choice(sizes))))
        else:
            effects.append(delete(key))
    rid = rng.choice(["", "", "r1", "0f" * 16, "x" * 127, "x" * 128, "é-id", "\u0665"])
    ms = rng.choice([0, 0, 1, 127, 128, 1_700_000_000_123, 2**62, 2**63 - 1, -1, -(2**63)])
    kind = rng.choice([0, 0, 1, 2, 3, 4, 5, 127, 128, 2**31 - 1, -1])  # past the enum too: open enums keep them
    return pb.WalEntry(request_id=rid, effects=effects, response=rng.randbytes(rng.choice(sizes[:7])),
                       leader_unix_ms=ms, request_kind=kind)  # type: ignore[arg-type]


def _by_hand(entry: pb.WalEntry, rng: random.Random) -> bytes:
    """The entry in another valid wire shape than the serializer's: fields out of order, empty
    fields written out, non-minimal lengths, an effect's fields reversed."""
    def length(n: int) -> bytes:
        return _varint(n) if rng.random() < 0.7 else bytes([(n & 0x7F) | 0x80]) + _varint(n >> 7)

    def field(number: int, data: bytes) -> bytes:
        return _varint(number << 3 | 2) + length(len(data)) + data

    parts = []
    for effect in entry.effects:
        kind = effect.WhichOneof("kind")
        inner = [field(1, (effect.put if kind == "put" else effect.delete).key)]
        if kind == "put":
            inner.append(field(2, effect.put.value))
        if rng.random() < 0.3:
            inner.reverse()
        parts.append(field(2, field(1 if kind == "put" else 2, b"".join(inner))))
    parts += [field(1, entry.request_id.encode()), field(3, entry.response), b"\x20" + _varint(entry.leader_unix_ms),
              b"\x28" + _varint(entry.request_kind)]
    if rng.random() < 0.5:
        rng.shuffle(parts)
    return b"".join(parts)


def _mutations(rng: random.Random, payload: bytes, other: bytes) -> list[bytes]:
    flipped = bytearray(payload or b"\x00")
    flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
    cut = rng.randrange(len(payload) + 1)
    return [
        bytes(flipped),
        payload[:cut],
        payload[:cut] + bytes([rng.randrange(256)]) + payload[cut:],
        payload + other,  # two entries merged: protobuf's last-one-wins and concatenation
        payload + b"\x28\x01",  # an unknown varint field
        payload + _field(6, b"unknown"),
        payload + b"\x12\x00",  # an effect without a kind
        payload + _field(2, _field(1, _field(1, b"k")) + _field(2, _field(1, b"k"))),  # put and delete at once
        payload + _field(2, _field(1, _field(1, b"k") + _field(1, b"j"))),  # a put's key twice
        payload + _field(2, _field(1, _field(3, b"?"))),  # an unknown field inside a put
        _field(1, b"\xff\xfe") + payload,  # a request id that is not UTF-8
        _field(1, "é".encode()) + payload,
        payload + b"\x20" + _varint(-7),  # a negative time, ten bytes long
        payload + b"\x20\xff",  # a time that never ends
        payload + b"\x28\x02",  # a request kind after everything
        payload + b"\x28\x82\x00",  # a kind in two bytes (non-minimal): 2
        payload + b"\x28" + _varint(2**32 + 1),  # protobuf truncates an enum to 32 bits: 1
        payload + b"\x28" + _varint(-1),  # a negative kind, ten bytes long
        payload + b"\x28\xff",  # a kind that never ends
        payload + b"\x28\x01\x28\x03",  # twice: the later one counts
        payload + b"\x1a\x05ab",  # a response longer than what is left
        rng.randbytes(rng.randrange(20)),
    ]


@pytest.mark.parametrize("seed", range(200))
def test_decode_fields_reads_every_payload_as_protobuf_does(seed: int) -> None:
    rng = random.Random(seed)
    entry, other = _random_entry(rng), _random_entry(rng)
    canonical = entry.SerializeToString()
    payloads = [canonical, _by_hand(entry, rng), *_mutations(rng, canonical, other.SerializeToString())]
    for payload in payloads:
        assert decode_fields(payload) == _reference_fields(payload), payload


def test_canonical_entries_take_the_fast_path() -> None:
    """What the leader writes is read without protobuf (the tests above hold both paths equal)."""
    for seed in range(50):
        entry = _random_entry(random.Random(seed))
        if all(ord(c) < 128 for c in entry.request_id) and entry.leader_unix_ms >= 0 and 0 <= entry.request_kind < 128:
            assert decode_canonical(entry.SerializeToString()) == _reference_fields(entry.SerializeToString())


def _reference_apply_entries(lookup: Lookup, request_seen: RequestSeen, records: list[tuple[int, bytes]],
                             on_request: Callable[[RequestRecord], None] | None = None,
                             on_leader_time: Callable[[int], None] | None = None, prepared: object = None,
                             decided: object = None) -> Applied:
    """apply_entries as it was before the replay fast path (protobuf objects, `apply_effects`),
    kept as the reference the fast one must equal (over records without transactions: those are
    tests/unit/test_txn.py's)."""
    out = Applied()
    seen_here: set[str] = set()
    for offset, payload in records:
        entry = decode_entry(payload)
        if entry is None:
            out.malformed += 1
            continue
        request_id = entry.request_id
        seen = request_id in seen_here if on_request is None else False
        duplicate = bool(request_id) and (seen or request_seen(request_id))
        leader_ms = entry.leader_unix_ms if entry.leader_unix_ms > 0 else 0
        if on_leader_time is not None and leader_ms > 0:
            on_leader_time(leader_ms)
        if duplicate:
            out.duplicates += 1
            continue
        for key, new_state in apply_effects(entry.effects, offset,
                                            lambda k: out.writes[k] if k in out.writes else lookup(k)):
            out.writes[key] = new_state
            out.changed[0].append(key)
            out.changed[1].append(new_state)
            out.changed[2].append(offset)
        if request_id:
            seen_here.add(request_id)
            request = RequestRecord(request_id, offset, bytes(entry.response), leader_ms,
                                    entry.request_kind if entry.request_kind in (1, 2, 3, 4) else 0)
            out.requests.append(request)
            if on_request is not None:
                on_request(request)
    return out


def _replay_records(rng: random.Random) -> list[tuple[int, bytes]]:
    """Entries as a leader writes them and otherwise: repeated keys, deletes, multi-effect
    entries, request ids (repeated: retries), leader times (also lagging, unknown, negative),
    malformed and unusual-but-valid payloads."""
    keys = [b"", b"a", b"b", b"\xff", b"a\x00", b"long" * 40]
    records, offset, clock_ms = [], rng.randrange(3), 1_000
    for _ in range(rng.randrange(1, 60)):
        offset += rng.randrange(1, 4)
        clock_ms += rng.randrange(0, 400)
        effects = [put(key, rng.randbytes(rng.choice([0, 3, 200]))) if rng.random() < 0.7 else delete(key)
                   for key in rng.choices(keys, k=rng.choice([0, 1, 1, 1, 2, 4]))]
        rid = rng.choice(["", "", "r0", "r1", "r2", "r3", "r4", "é5"])
        ms = rng.choice([clock_ms, clock_ms, clock_ms - rng.randrange(1_000), 0, -3])
        wal_entry = pb.WalEntry(request_id=rid, effects=effects, response=rid.encode(), leader_unix_ms=ms)
        roll = rng.random()
        if roll < 0.06:  # not an entry: garbage, an effect without a kind, a request id that is not UTF-8
            payload = rng.choice([GARBAGE, b"\x12\x00", b"\x0a\x02\xff\xfe"])
        elif roll < 0.15:
            payload = _by_hand(wal_entry, rng)
        else:
            payload = wal_entry.SerializeToString()
        records.append((offset, payload))
    return records


def _observed(apply: Callable[..., Applied], records: list[tuple[int, bytes]], state: dict[bytes, KeyState],
              seen: set[str], with_table: bool) -> tuple[object, ...]:
    """Everything an apply produces and every callback it makes, in order."""
    events: list[object] = []
    table: dict[str, RequestRecord] = {}

    def request_seen(rid: str) -> bool:
        events.append(("seen", rid))
        return rid in seen or rid in table

    def on_request(request: RequestRecord) -> None:
        events.append(("request", request))
        table[request.request_id] = request

    out = apply(state.get, request_seen, records, on_request=on_request if with_table else None,
                on_leader_time=(lambda ms: events.append(("time", ms))) if with_table else None)
    return (list(out.writes.items()), out.changes, out.requests, out.duplicates, out.malformed, events)


@pytest.mark.parametrize("seed", range(300))
def test_apply_entries_equals_the_protobuf_reference(seed: int) -> None:
    rng = random.Random(seed)
    records = _replay_records(rng)
    state = {b"a": KeyState(b"old", 3, 1, 0), b"\xff": KeyState(b"", 1, 2, 2)}
    seen = {"r3"}
    for with_table in (False, True):
        expected = _observed(_reference_apply_entries, records, state, seen, with_table)
        assert _observed(apply_entries, records, state, seen, with_table) == expected


@pytest.mark.parametrize("seed", range(150))
def test_request_window_evicts_at_the_same_record_as_the_reference(seed: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The bounded request table (`MemoryShard`, the model of ShardStore) forgets the same ids at
    the same records with the fast apply as with the reference, however the records are cut."""
    from kvstore.core import delta, request_window

    rng = random.Random(seed)
    records = _replay_records(rng)
    limit, horizon = rng.randrange(1, 5), rng.choice([50, 300, 10_000])
    n = len(records)
    cuts = sorted(rng.sample(range(1, n), rng.randrange(n))) if n > 1 else []

    def run() -> tuple[object, ...]:
        shard = request_window.MemoryShard(max_request_ids=limit, request_id_horizon_ms=horizon)
        outcomes = []
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            applied = shard.apply(records[lo:hi], records[hi - 1][0] + 1)
            outcomes.append((list(applied.writes.items()), applied.changes, applied.requests, applied.duplicates,
                             applied.malformed, list(shard.requests.items()), shard.evicted_through_ms))
        return tuple(outcomes), dict(shard.keys)

    fast = run()
    monkeypatch.setattr(delta, "apply_entries", _reference_apply_entries)
    assert fast == run()
