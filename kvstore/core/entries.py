"""A WAL entry's payload, decoded: what an accepted record of the store holds, or None when it
holds nothing a replica may apply (counted, never applied). Every reader of the WAL decodes
through here (the replicas' apply, the watches, the simulation's checker, the Spark jobs' fold),
so a hostile payload is judged alike everywhere."""

from __future__ import annotations

import functools

from kvstore.internal.v1 import wal_entry_pb2

# WalEntry.request_kind values a replica keeps; anything else (a hostile or future value) is kept
# as unspecified, identically on every replica and in the Spark jobs.
KNOWN_REQUEST_KINDS = frozenset(wal_entry_pb2.RequestKind.values()) - {wal_entry_pb2.REQUEST_KIND_UNSPECIFIED}


def request_kind(raw: int) -> int:
    """A WalEntry's request_kind as the request-id table keeps it: a known kind, else 0."""
    return raw if raw in KNOWN_REQUEST_KINDS else wal_entry_pb2.REQUEST_KIND_UNSPECIFIED


def decode_entry(payload: bytes) -> wal_entry_pb2.WalEntry | None:
    """The entry in an accepted WAL record, or None if it is not one (counted, never applied)."""
    try:
        entry = wal_entry_pb2.WalEntry.FromString(payload)
    except Exception:
        return None
    for effect in entry.effects:  # bounded by the entry
        if effect.WhichOneof("kind") is None:
            return None
    return entry


# A WalEntry's fields as plain values (`decode_fields`): request_id, effects, response,
# leader_unix_ms, request_kind (`request_kind`: known or 0); an effect is (key, value), value None
# for a delete. A plain tuple: one is built per record replayed, and a NamedTuple costs ~0.2 µs more.
Decoded = tuple[str, list[tuple[bytes, bytes | None]], bytes, int, int]


def decode_fields(payload: bytes) -> Decoded | None:
    """`decode_entry`, as plain values: what `apply_entries` applies. None if not an entry.

    The protobuf objects of `decode_entry` (the entry, each effect, its put or delete) and
    reading their fields cost ~2.7 µs a record (measured on the bench's Put entries; ~1.3 µs
    here), the largest part of a replay once W3 is cheap. The leader writes canonical protobuf
    (fields in number order, each once, defaults left out), which `decode_canonical` reads
    directly; whatever it does not recognise goes through `decode_entry`. Both give the same
    values for every payload (tests/unit/test_state.py holds them together on canonical,
    unusual and broken payloads).
    """
    decoded = decode_canonical(payload)
    return decoded if decoded is not None else _decode_protobuf(payload)


def _decode_protobuf(payload: bytes) -> Decoded | None:
    """`decode_fields` through protobuf (`decode_entry`): for every payload of unusual shape."""
    entry = decode_entry(payload)
    return None if entry is None else fields_of(entry)


def fields_of(entry: wal_entry_pb2.WalEntry) -> Decoded:
    effects: list[tuple[bytes, bytes | None]] = []
    for effect in entry.effects:  # bounded by the entry
        if effect.WhichOneof("kind") == "put":
            effects.append((effect.put.key, effect.put.value))
        else:
            effects.append((effect.delete.key, None))
    return entry.request_id, effects, entry.response, entry.leader_unix_ms, request_kind(entry.request_kind)


_NOT_A_VARINT = 1 << 63  # above any varint `_varint_at` reads: as a length it overruns every bound


def _varint_at(data: bytes, at: int, end: int) -> tuple[int, int]:
    """(value, position after it) of the varint at `at`, of at most 9 bytes (< 2^63, so never a
    negative int64) and within `end`; (_NOT_A_VARINT, at) if it is anything else."""
    value = shift = 0
    for position in range(at, min(at + 9, end)):  # bounded: 9 bytes
        byte = data[position]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position + 1
        shift += 7
    return _NOT_A_VARINT, at


_NO_TAIL = (_NOT_A_VARINT, 0)


@functools.lru_cache(maxsize=256)
def _tail(raw: bytes) -> tuple[int, int]:
    """(leader_unix_ms, request_kind) of an entry's last bytes after field 4's tag: one varint
    of at most 9 bytes, then optionally field 5 (tag 0x28) with a one-byte varint, and nothing
    else; _NO_TAIL for any other shape (protobuf decides then). Cached: a leader stamps every
    entry of a batch with the same time (and mostly the same kind), and reading the six bytes one
    by one cost ~1.2 µs a record (a cache hit ~0.1)."""
    value, end = _varint_at(raw, 0, len(raw))
    if end == len(raw):
        return value, 0
    if end and end + 2 == len(raw) and raw[end] == 0x28 and raw[end + 1] < 0x80:
        return value, request_kind(raw[end + 1])
    return _NO_TAIL


def decode_canonical(p: bytes) -> Decoded | None:
    """A WalEntry in the shape its serializer writes, or None when the payload has any other
    shape (then protobuf decides, `decode_fields`). Recognised, field by field in number order:
    1 request_id (ASCII only: protobuf's UTF-8 check stays protobuf's), 2 effects (each exactly
    one of put {1 key, 2 value} / delete {1 key}, every length exactly filling its parent),
    3 response, 4 leader_unix_ms (positive, < 2^63), 5 request_kind (one byte: 0-127; more
    bytes are protobuf's to read, which truncates an enum to 32 bits); each at most once, effects
    consecutive, nothing after. What it recognises, protobuf reads the same way: these are the only fields
    there are, and every byte is accounted for. Written for speed (one-byte lengths inline, an
    index past the end caught once), as it runs for every record replayed."""
    n = len(p)
    i = 0
    request_id = ""
    effects: list[tuple[bytes, bytes | None]] = []
    response = b""
    leader_ms = 0
    kind = 0
    try:
        if n and p[0] == 0x0A:  # 1: request_id
            length = p[1]
            if length < 0x80:
                i = 2
            else:
                length, i = _varint_at(p, 1, n)
            end = i + length
            if end > n:
                return None
            raw = p[i:end]
            if not raw.isascii():
                return None
            request_id = raw.decode("ascii")
            i = end
        while i < n and p[i] == 0x12:  # 2: effects; bounded: every turn moves i forward
            length = p[i + 1]
            if length < 0x80:
                j = i + 2
            else:
                length, j = _varint_at(p, i + 1, n)
            end = j + length
            if end > n or length == 0:
                return None  # an effect without a kind (length 0) is protobuf's to refuse
            tag = p[j]  # put (1) or delete (2), filling the effect
            length = p[j + 1]
            if length < 0x80:
                k = j + 2
            else:
                length, k = _varint_at(p, j + 1, end)
            if k + length != end:
                return None
            key = b""
            if k < end and p[k] == 0x0A:
                length = p[k + 1]
                if length < 0x80:
                    k += 2
                else:
                    length, k = _varint_at(p, k + 1, end)
                if k + length > end:
                    return None
                key = p[k:k + length]
                k += length
            if tag == 0x0A:  # put
                value = b""
                if k < end and p[k] == 0x12:
                    length = p[k + 1]
                    if length < 0x80:
                        k += 2
                    else:
                        length, k = _varint_at(p, k + 1, end)
                    if k + length > end:
                        return None
                    value = p[k:k + length]
                    k += length
                if k != end:
                    return None
                effects.append((key, value))
            elif tag == 0x12 and k == end:  # delete
                effects.append((key, None))
            else:
                return None
            i = end
        if i < n and p[i] == 0x1A:  # 3: response
            length = p[i + 1]
            if length < 0x80:
                i += 2
            else:
                length, i = _varint_at(p, i + 1, n)
            end = i + length
            if end > n:
                return None
            response = p[i:end]
            i = end
        if i < n and p[i] == 0x20:  # 4: leader_unix_ms, then maybe 5: request_kind, ending the payload
            leader_ms, kind = _tail(p[i + 1:])
            if leader_ms == _NOT_A_VARINT:
                return None
            i = n
        elif i + 2 == n and p[i] == 0x28 and p[i + 1] < 0x80:  # 5 alone (no leader time)
            kind = request_kind(p[i + 1])
            i = n
    except Exception:  # a length or tag past the end (IndexError), or anything odd: protobuf decides
        return None
    if i != n:
        return None
    return request_id, effects, response, leader_ms, kind
