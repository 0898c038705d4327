"""Hypothesis strategies for any protobuf message, built from its descriptor, and for bytes that
are not one: what a fuzz campaign sends to a node.

Values lean towards the store's edges (empty, at and one past every documented limit, unknown
enum numbers, negative and huge integers) and towards a few real keys, so that random requests
reach the code behind validation as well as validation itself. Whole requests lean towards the
edges of the size contract (tests/fuzz/contract.py): about one in five is padded to exactly
MAX_REQUEST_BYTES, one byte more, the transport cap or one byte more, so a sample of a few hundred
cases reaches both refusing zones, not only when enough big values happen to meet. Each test's
first case, hypothesis's simplest, is one of them: its request padded to exactly MAX_REQUEST_BYTES.
"""

from __future__ import annotations

import hashlib
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from kvstore import limits

MAX_DEPTH = 3
MAX_REPEATED = 4

_KEYS = [b"a", b"b", b"fuzz/1", b"fuzz/2", b"\x00", b"\xff" * 3]
_LENGTHS = [0, 1, limits.MAX_KEY_BYTES, limits.MAX_KEY_BYTES + 1, limits.MAX_REQUEST_ID_BYTES + 1]
_BIG_LENGTHS = [limits.MAX_VALUE_BYTES, limits.MAX_VALUE_BYTES + 1]

_blobs = st.one_of(
    st.sampled_from(_KEYS),
    st.binary(max_size=48),
    st.sampled_from(_LENGTHS).map(lambda n: b"k" * n),
    # Rare (a tenth of the blobs): values at the size limits, which cost a megabyte each to send.
    st.integers(0, 9).flatmap(lambda roll: st.sampled_from(_BIG_LENGTHS).map(lambda n: b"v" * n) if roll == 0
                              else st.just(b"")),
)
_texts = st.one_of(st.text(max_size=24), st.sampled_from(["", "r1", "x" * (limits.MAX_REQUEST_ID_BYTES + 1)]))


# The sizes a padded request gets: the last one the store takes, the first it refuses itself, the
# last one gRPC lets through to it and the first one gRPC refuses.
EDGE_SIZES = [limits.MAX_REQUEST_BYTES, limits.MAX_REQUEST_BYTES + 1,
              limits.GRPC_MAX_MESSAGE_BYTES, limits.GRPC_MAX_MESSAGE_BYTES + 1]
PAD_FIELD = 536_870_911  # the largest field number protobuf allows; no message of the API uses it
# One roll in PAD_ONE_IN pads a request (each costs one to two megabytes to send). Hypothesis draws
# the roll's simplest value, 0, more often than the others: about one request in five is padded.
PAD_ONE_IN = 10


class Sent:
    """One request's bytes. A failure's traceback shows each frame's arguments: this shows a
    request by its size, digest and first bytes, where the bytes' own repr would bury the report
    under megabytes of padding. The seed (tests/fuzz/seeding.py) is what replays it."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def __repr__(self) -> str:
        return (f"Sent({len(self.raw)} bytes, sha256 {hashlib.sha256(self.raw).hexdigest()[:16]}, "
                f"starting {self.raw[:48]!r})")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def padded(raw: bytes, size: int) -> bytes:
    """`raw` followed by an unknown length-delimited field (PAD_FIELD) that makes it exactly `size`
    bytes; `raw` itself if it is that long already. A parser keeps an unknown field and ignores
    it, so the padded bytes decode to the same request (or fail to, for bytes that are not one):
    only the size changes."""
    if len(raw) >= size:
        return raw
    tag = _varint(PAD_FIELD << 3 | 2)
    for prefix in (b"", _varint(PAD_FIELD << 3 | 0) + b"\x00"):  # the second avoids a length-varint boundary
        for width in range(1, 6):
            length = size - len(raw) - len(prefix) - len(tag) - width
            if length >= 0 and len(_varint(length)) == width:
                return raw + prefix + tag + _varint(length) + b"\x00" * length
    raise ValueError(f"cannot pad {len(raw)} bytes to {size}")  # only when size is within a few bytes of raw


def sized(requests: st.SearchStrategy[bytes]) -> st.SearchStrategy[Sent]:
    """`requests`, some padded to one of EDGE_SIZES (roll 0 of PAD_ONE_IN)."""
    return st.tuples(requests, st.integers(0, PAD_ONE_IN - 1), st.sampled_from(EDGE_SIZES)).map(
        lambda args: Sent(padded(args[0], args[2]) if args[1] == 0 else args[0]))


def _ints(bits: int, signed: bool) -> st.SearchStrategy[int]:
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)
    edges = [v for v in (0, 1, 3, 4, 1023, 1024, high, low, -1) if low <= v <= high]
    return st.one_of(st.sampled_from(edges), st.integers(low, high), st.integers(0, 8))


_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_BYTES: _blobs,
    FieldDescriptor.TYPE_STRING: _texts,
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_INT32: _ints(32, True),
    FieldDescriptor.TYPE_SINT32: _ints(32, True),
    FieldDescriptor.TYPE_SFIXED32: _ints(32, True),
    FieldDescriptor.TYPE_INT64: _ints(64, True),
    FieldDescriptor.TYPE_SINT64: _ints(64, True),
    FieldDescriptor.TYPE_SFIXED64: _ints(64, True),
    FieldDescriptor.TYPE_UINT32: _ints(32, False),
    FieldDescriptor.TYPE_FIXED32: _ints(32, False),
    FieldDescriptor.TYPE_UINT64: _ints(64, False),
    FieldDescriptor.TYPE_FIXED64: _ints(64, False),
    FieldDescriptor.TYPE_DOUBLE: st.floats(allow_nan=True),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32, allow_nan=True),
}


def _field(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any] | None:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name
            key, value = _field(entry["key"], depth + 1), _field(entry["value"], depth + 1)
            return st.dictionaries(key, value, max_size=3) if key is not None and value is not None else None
        if depth >= MAX_DEPTH:
            return None
        return messages(field.message_type, depth + 1)
    if field.type == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-3, 64))  # open enums: unknown numbers too
    return _SCALARS.get(field.type)


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Random messages of `descriptor`: any subset of its fields set, oneofs included."""
    cls = GetMessageClass(descriptor)
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        value = _field(field, depth)
        if value is None:
            continue
        is_map = field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry
        if field.is_repeated and not is_map:
            value = st.lists(value, max_size=MAX_REPEATED)
        optional[field.name] = value

    def build(values: dict[str, Any]) -> Message:
        message = cls()
        for name, value in values.items():
            target = getattr(message, name)
            field = descriptor.fields_by_name[name]
            if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
                target.update(value)
            elif field.is_repeated:
                (target.extend if field.type != FieldDescriptor.TYPE_MESSAGE else _add_all(target))(value)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                target.CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return st.fixed_dictionaries({}, optional=optional).map(build)


def _add_all(container: Any) -> Any:
    def add(values: list[Message]) -> None:
        for value in values:
            container.add().CopyFrom(value)
    return add


def not_protobuf(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """Bytes that are (mostly) not a valid encoding of `descriptor`: random bytes, and valid
    encodings truncated, bit-flipped or with garbage spliced in."""

    def mutate(args: tuple[bytes, int, int, bytes]) -> bytes:
        raw, where, how, junk = args
        if not raw:
            return junk or b"\xff"
        i = where % len(raw)
        if how == 0:
            return raw[:i]  # truncated
        if how == 1:
            return raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1:]  # a byte flipped
        return raw[:i] + junk + raw[i:]  # garbage inserted

    encoded = messages(descriptor).map(lambda m: m.SerializeToString())
    return st.one_of(
        st.binary(min_size=1, max_size=64),
        st.sampled_from([b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x08" * 11, b"\x0a\x05ab", b"\x07"]),
        st.tuples(encoded, st.integers(0, 10_000), st.integers(0, 2), st.binary(max_size=8)).map(mutate),
    )
