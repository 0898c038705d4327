"""The WAL record envelope and the acceptance rule W3: the one definition every reader uses.

A record is accepted iff it is well formed and its actual offset equals its expected offset.
The expected offset travels twice: in the protobuf body (authoritative for Python readers) and
as ASCII decimal in the Kafka header `wal.expected_offset`, so that Spark SQL can apply the same
rule as a column expression without parsing protobuf. A record whose two copies disagree is
malformed, never accepted.
"""

from __future__ import annotations

import enum
import functools
from typing import NamedTuple

from google.protobuf.message import DecodeError

from wal.v1 import record_pb2

EXPECTED_OFFSET_HEADER = "wal.expected_offset"

# As confluent-kafka types them; values are bytes on the wire.
Headers = list[tuple[str, str | bytes | None]]
AnyHeaders = Headers | dict[str, str | bytes | None] | None


class WriterIdentity(NamedTuple):
    """Who writes: a free-form id and the caller's leadership term.

    This and AcceptedRecord are NamedTuples, not frozen dataclasses: replay builds one of each
    per record, and a frozen dataclass costs ~1 µs more to construct."""

    id: str
    term: int = 0


class AcceptedRecord(NamedTuple):
    """A record that passed W3, as readers see it."""

    offset: int
    payload: bytes
    writer: WriterIdentity
    timestamp_ms: int


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    MISMATCH = "mismatch"  # well formed, but landed somewhere else than it expected
    MALFORMED = "malformed"  # not a WAL record at all (foreign producer, corrupt bytes)


def encode(expected_offset: int, writer: WriterIdentity, payload: bytes) -> tuple[bytes, Headers]:
    """Build the Kafka value and headers for one record expected at `expected_offset`.

    The envelope is written by hand in protobuf's wire format (the writer's part cached): it is
    on the per-record hot path of every append, where building a message object per record cost
    more than the rest of the guard (bench/README.md). `tests/unit/test_record.py` holds it to
    the generated schema both ways.
    """
    assert expected_offset >= 0, f"expected offset must be non-negative: {expected_offset}"
    writer_field = _writer_field(writer)
    offset_field = b"\x08" + _varint(expected_offset) if expected_offset else b""
    body = b"".join((offset_field, writer_field, b"\x1a", _varint(len(payload)), payload)) if payload \
        else offset_field + writer_field
    headers: Headers = [(EXPECTED_OFFSET_HEADER, str(expected_offset).encode("ascii"))]
    return body, headers


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.lru_cache(maxsize=64)
def _writer_field(writer: WriterIdentity) -> bytes:
    """Field 2 (the Writer sub-message), tag and length included."""
    inner = record_pb2.Writer(id=writer.id, term=writer.term).SerializeToString()
    return b"\x12" + _varint(len(inner)) + inner


def header_expected_offset(headers: AnyHeaders) -> int | None:
    """The expected offset from the header, or None if absent or not a decimal integer."""
    pairs = headers.items() if isinstance(headers, dict) else (headers or ())
    for key, value in pairs:
        if key == EXPECTED_OFFSET_HEADER:
            if isinstance(value, bytes):  # bytes.isdigit() is ASCII digits only, and int() takes bytes
                return int(value) if value.isdigit() else None
            text = value or ""
            return int(text) if text.isascii() and text.isdigit() else None
    return None


def judge(
    offset: int, value: bytes | None, headers: AnyHeaders, timestamp_ms: int = 0
) -> tuple[Verdict, AcceptedRecord | None]:
    """Apply the acceptance rule W3 to one record read under read_committed."""
    expected_in_header = header_expected_offset(headers)
    if expected_in_header is None or value is None:
        return Verdict.MALFORMED, None
    try:
        body = record_pb2.Record.FromString(value)
    except DecodeError:
        return Verdict.MALFORMED, None
    if body.expected_offset != expected_in_header:
        return Verdict.MALFORMED, None
    if not accepts(offset, expected_in_header):
        return Verdict.MISMATCH, None
    writer = WriterIdentity(id=body.writer.id, term=body.writer.term)
    return Verdict.ACCEPTED, AcceptedRecord(offset, body.payload, writer, timestamp_ms)


def accepts(actual_offset: int, expected_offset: int) -> bool:
    """W3 itself. The Spark jobs express the same predicate in SQL; tests hold them together."""
    return actual_offset == expected_offset
