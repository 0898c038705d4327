"""The store's state machine: pure, deterministic, shared by every replayer of the WAL.

`apply_entries` is the one apply function (rqlite's lesson): leader apply after commit, bootstrap,
followers and the Spark jobs all compute the next state with it, so they cannot disagree. It
takes the state it needs through a lookup function and returns the writes; LevelDB is the
caller's business (`kvstore.server.storage`).

A WAL entry carries effects only. Conditions are evaluated by the leader before the entry is
appended (`kvstore.core.evaluate`), using `next_key_state`, the same transition this module applies.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvstore.internal.v1 import wal_entry_pb2

_KEY_HEADER = struct.Struct(">qqq")  # version, mod_revision, create_revision


class KeyState(NamedTuple):
    """A live key: its value, how many writes since it was created, and where they were.

    A NamedTuple, not a frozen dataclass: one is built per record replayed, and a frozen
    dataclass costs ~1 µs more to construct (bench/README.md, replay)."""

    value: bytes
    version: int
    mod_revision: int
    create_revision: int

    def encode(self) -> bytes:
        return _KEY_HEADER.pack(self.version, self.mod_revision, self.create_revision) + self.value

    @staticmethod
    def decode(raw: bytes) -> KeyState:
        assert len(raw) >= _KEY_HEADER.size, f"key state of {len(raw)} bytes is truncated"
        version, mod_revision, create_revision = _KEY_HEADER.unpack_from(raw)
        return KeyState(raw[_KEY_HEADER.size:], version, mod_revision, create_revision)


class ChangeType(enum.Enum):
    PUT = "put"
    DELETE = "delete"


class Change(NamedTuple):
    """One applied effect, as Watch streams and the change feed show it (a NamedTuple, like KeyState)."""

    type: ChangeType
    key: bytes
    state: KeyState | None  # None for deletes
    revision: int


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRecord:
    """What the request-id table keeps: where the request committed, what was answered, and the
    leader's clock when it built the entry (0: an entry written before WalEntry.leader_unix_ms
    existed), by which every replica forgets the id at the same entry (`kvstore.server.storage`)."""

    request_id: str
    revision: int
    response: bytes
    leader_unix_ms: int = 0


@dataclasses.dataclass
class Applied:
    """The outcome of applying accepted entries: writes to make, in one batch with the checkpoint."""

    writes: dict[bytes, KeyState | None] = dataclasses.field(default_factory=dict)
    changes: list[Change] = dataclasses.field(default_factory=list)
    requests: list[RequestRecord] = dataclasses.field(default_factory=list)
    duplicates: int = 0  # entries skipped because their request id was already applied
    malformed: int = 0  # accepted WAL records whose payload is not a WalEntry


Lookup = Callable[[bytes], KeyState | None]
RequestSeen = Callable[[str], bool]


def next_key_state(old: KeyState | None, effect: wal_entry_pb2.Effect, revision: int) -> KeyState | None:
    """The one transition of a key. Deleting a missing key is a no-op that still counts."""
    kind = effect.WhichOneof("kind")
    if kind == "put":
        if old is None:
            return KeyState(effect.put.value, 1, revision, revision)
        return KeyState(effect.put.value, old.version + 1, revision, old.create_revision)
    assert kind == "delete", f"effect without a kind at revision {revision}"
    return None


def effect_key(effect: wal_entry_pb2.Effect) -> bytes:
    kind = effect.WhichOneof("kind")
    return bytes(effect.put.key if kind == "put" else effect.delete.key)


def apply_effects(effects: Sequence[wal_entry_pb2.Effect], revision: int,
                  lookup: Lookup) -> list[tuple[bytes, KeyState | None]]:
    """One entry's effects at `revision`, in order (a later effect on a key sees the earlier one):
    each key's new state. The one next-state function: replay (`apply_entries`), the leader's
    batch overlay (`kvstore.core.batch`) and the simulation all go through it."""
    out: list[tuple[bytes, KeyState | None]] = []
    local: dict[bytes, KeyState | None] = {}
    for effect in effects:  # a plain loop: this runs once per record replayed
        key = effect_key(effect)
        new_state = next_key_state(local[key] if key in local else lookup(key), effect, revision)
        local[key] = new_state
        out.append((key, new_state))
    return out


def decode_entry(payload: bytes) -> wal_entry_pb2.WalEntry | None:
    """The entry in an accepted WAL record, or None if it is not one (counted, never applied)."""
    try:
        entry = wal_entry_pb2.WalEntry.FromString(payload)
    except Exception:
        return None
    for effect in entry.effects:  # a plain loop: this runs once per record replayed
        if effect.WhichOneof("kind") is None:
            return None
    return entry


def apply_entries(
    lookup: Lookup,
    request_seen: RequestSeen,
    records: Sequence[tuple[int, bytes]],
    on_request: Callable[[RequestRecord], None] | None = None,
    on_leader_time: Callable[[int], None] | None = None,
) -> Applied:
    """Apply accepted WAL records (offset, payload) in offset order; pure.

    Later records see the writes of earlier ones (an overlay over `lookup`), so a batch gives
    the same state as applying its records one at a time. A request id is applied at most once
    per shard: a repeat (a client retry whose first attempt did commit) has no effect.

    With `on_request`, the caller keeps the request table itself (it is told of every request
    as it is applied, and `request_seen` must answer for those too): that lets a bounded table
    evict at the exact same record whether records arrive one at a time or in one batch.

    With `on_leader_time`, it is told the leader time (> 0) of every well-formed entry that has
    one, duplicates and entries without a request id included, in order: after the entry's
    duplicate check (an id is never forgotten from under its own retry) and before its request
    reaches `on_request`. That is the clock by which a bounded table forgets ids by age.
    """
    out = Applied()
    writes, changes = out.writes, out.changes
    seen_here: set[str] = set()
    previous = -1
    for offset, payload in records:
        assert offset > previous, f"records out of order: {offset} after {previous}"
        previous = offset
        entry = decode_entry(payload)
        if entry is None:
            out.malformed += 1
            continue
        request_id = entry.request_id
        seen = request_id in seen_here if on_request is None else False
        duplicate = bool(request_id) and (seen or request_seen(request_id))
        # 0 = unknown: written before the field existed; a negative time is nonsense, and a
        # bounded table must treat it as unknown rather than as very old (inline: hot loop).
        leader_ms = entry.leader_unix_ms if entry.leader_unix_ms > 0 else 0
        if on_leader_time is not None and leader_ms > 0:
            on_leader_time(leader_ms)
        if duplicate:
            out.duplicates += 1
            continue
        for key, new_state in apply_effects(entry.effects, offset,
                                            lambda k: writes[k] if k in writes else lookup(k)):
            writes[key] = new_state
            changes.append(Change(ChangeType.PUT if new_state is not None else ChangeType.DELETE,
                                  key, new_state, offset))
        if request_id:
            seen_here.add(request_id)
            request = RequestRecord(request_id, offset, bytes(entry.response), leader_ms)
            out.requests.append(request)
            if on_request is not None:
                on_request(request)
    return out
