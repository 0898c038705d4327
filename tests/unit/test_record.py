"""`wal.record`: the envelope and the acceptance rule W3, without Kafka."""

from __future__ import annotations

import pytest

from wal.record import (
    EXPECTED_OFFSET_HEADER,
    AcceptedRecord,
    Headers,
    Verdict,
    WriterIdentity,
    accepts,
    encode,
    header_expected_offset,
    judge,
)
from wal.v1 import record_pb2

H = EXPECTED_OFFSET_HEADER
WRITER = WriterIdentity("node-1", term=3)


def _value(expected_offset: int, payload: bytes = b"payload", writer: WriterIdentity = WRITER) -> bytes:
    value, _ = encode(expected_offset, writer, payload)
    return value


# ---- encode / judge round trip ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("expected_offset", "writer", "payload"),
    [
        pytest.param(0, WRITER, b"payload", id="offset-0"),
        pytest.param(41, WRITER, b"payload", id="offset-41"),
        pytest.param(2**62, WRITER, b"x", id="huge-offset"),
        pytest.param(7, WRITER, b"", id="empty-payload"),
        pytest.param(7, WRITER, bytes(range(256)), id="binary-payload"),
        pytest.param(7, WriterIdentity("bench-4711"), b"p", id="default-term"),
        pytest.param(0, WriterIdentity(""), b"", id="all-defaults"),
        pytest.param(3, WriterIdentity("node-\u00e9", term=2**40), b"p", id="unicode-writer-big-term"),
    ],
)
def test_encode_then_judge_accepts_at_expected_offset(
    expected_offset: int, writer: WriterIdentity, payload: bytes
) -> None:
    value, headers = encode(expected_offset, writer, payload)
    assert headers == [(H, str(expected_offset).encode("ascii"))]
    assert header_expected_offset(headers) == expected_offset
    verdict, accepted = judge(expected_offset, value, headers, timestamp_ms=1234)
    assert verdict is Verdict.ACCEPTED
    assert accepted == AcceptedRecord(expected_offset, payload, writer, 1234)


def test_judge_timestamp_defaults_to_zero() -> None:
    value, headers = encode(5, WRITER, b"p")
    _, accepted = judge(5, value, headers)
    assert accepted is not None
    assert accepted.timestamp_ms == 0


def test_body_carries_the_expected_offset_too() -> None:
    value, _ = encode(99, WRITER, b"p")
    body = record_pb2.Record.FromString(value)
    assert (body.expected_offset, body.writer.id, body.writer.term, body.payload) == (99, "node-1", 3, b"p")


def test_encode_refuses_negative_offset() -> None:
    with pytest.raises(AssertionError):
        encode(-1, WRITER, b"p")


# ---- W3: accepted only at its expected offset -------------------------------------------------


@pytest.mark.parametrize(
    ("actual", "expected", "verdict"),
    [
        pytest.param(10, 10, Verdict.ACCEPTED, id="equal"),
        pytest.param(11, 10, Verdict.MISMATCH, id="landed-later"),
        pytest.param(9, 10, Verdict.MISMATCH, id="landed-earlier"),
        pytest.param(0, 1, Verdict.MISMATCH, id="offset-0-expected-1"),
        pytest.param(10**12, 10**12 + 1, Verdict.MISMATCH, id="large-off-by-one"),
    ],
)
def test_judge_w3(actual: int, expected: int, verdict: Verdict) -> None:
    value, headers = encode(expected, WRITER, b"p")
    got, accepted = judge(actual, value, headers)
    assert got is verdict
    assert (accepted is not None) is (verdict is Verdict.ACCEPTED)


# ---- malformed records: never accepted, whatever the offset -----------------------------------

MALFORMED = [
    pytest.param(_value(5), None, id="headers-None"),
    pytest.param(_value(5), [], id="headers-empty"),
    pytest.param(_value(5), [("other", b"5")], id="only-foreign-header"),
    pytest.param(_value(5), [(H.upper(), b"5")], id="header-name-case-differs"),
    pytest.param(_value(5), [(H, b"")], id="header-empty"),
    pytest.param(_value(5), [(H, None)], id="header-value-None"),
    pytest.param(_value(5), [(H, b"abc")], id="header-not-a-number"),
    pytest.param(_value(5), [(H, b"-5")], id="header-negative"),
    pytest.param(_value(5), [(H, b"+5")], id="header-plus-sign"),
    pytest.param(_value(5), [(H, b" 5")], id="header-leading-space"),
    pytest.param(_value(5), [(H, b"5 ")], id="header-trailing-space"),
    pytest.param(_value(5), [(H, b"5.0")], id="header-decimal-point"),
    pytest.param(_value(5), [(H, b"0x5")], id="header-hex"),
    pytest.param(_value(5), [(H, b"5_0")], id="header-underscore"),
    pytest.param(_value(5), [(H, b"\xff")], id="header-not-ascii"),
    pytest.param(_value(5), [(H, "\u0665".encode())], id="header-arabic-indic-digit"),
    pytest.param(_value(5), [(H, b"6")], id="header-and-body-disagree"),
    pytest.param(_value(6), [(H, b"5")], id="body-and-header-disagree"),
    pytest.param(_value(5), [(H, b"6"), (H, b"5")], id="first-header-wins-and-disagrees"),
    pytest.param(None, [(H, b"5")], id="value-None"),
    pytest.param(b"\xff\xff\xff\xff", [(H, b"5")], id="body-undecodable"),
    pytest.param(b"hello", [(H, b"5")], id="body-plain-text"),
    pytest.param(_value(5)[:-1], [(H, b"5")], id="body-truncated"),
]


@pytest.mark.parametrize(("value", "headers"), MALFORMED)
@pytest.mark.parametrize("offset", [5, 6], ids=["at-header-offset", "elsewhere"])
def test_judge_malformed(offset: int, value: bytes | None, headers: Headers | None) -> None:
    assert judge(offset, value, headers) == (Verdict.MALFORMED, None)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param(None, None, id="None"),
        pytest.param([], None, id="empty"),
        pytest.param([(H, b"0")], 0, id="zero"),
        pytest.param([(H, b"12345")], 12345, id="plain"),
        pytest.param([(H, b"007")], 7, id="leading-zeros"),
        pytest.param([("a", b"1"), (H, b"8"), ("b", b"2")], 8, id="among-other-headers"),
        pytest.param([(H, b"8"), (H, b"9")], 8, id="first-occurrence-wins"),
        pytest.param([(H, b"x"), (H, b"9")], None, id="first-occurrence-bad"),
        pytest.param([(H, b"-1")], None, id="negative"),
        pytest.param([(H, b"\xc3\xa9")], None, id="utf8-non-ascii"),
    ],
)
def test_header_expected_offset(headers: Headers | None, expected: int | None) -> None:
    assert header_expected_offset(headers) == expected


@pytest.mark.parametrize(
    ("actual", "expected", "accepted"),
    [
        pytest.param(0, 0, True, id="0==0"),
        pytest.param(5, 5, True, id="5==5"),
        pytest.param(2**63 - 1, 2**63 - 1, True, id="int64-max"),
        pytest.param(5, 6, False, id="5<6"),
        pytest.param(6, 5, False, id="6>5"),
        pytest.param(0, 1, False, id="0!=1"),
        pytest.param(-1, 0, False, id="unknown-offset-vs-0"),
    ],
)
def test_accepts(actual: int, expected: int, accepted: bool) -> None:
    assert accepts(actual, expected) is accepted


@pytest.mark.parametrize("offset", [0, 1, 127, 128, 16_383, 16_384, 2**31, 2**62])
@pytest.mark.parametrize("payload", [b"", b"x", bytes(range(256)) * 3], ids=["empty", "one", "768"])
@pytest.mark.parametrize(
    "writer", [WriterIdentity("", 0), WriterIdentity("node-1", 7), WriterIdentity("é" * 70, 2**40)],
    ids=["default", "plain", "long-unicode"])
def test_hand_written_envelope_is_byte_identical_to_protobuf(offset: int, payload: bytes,
                                                             writer: WriterIdentity) -> None:
    body, _ = encode(offset, writer, payload)
    reference = record_pb2.Record(expected_offset=offset, writer=record_pb2.Writer(id=writer.id, term=writer.term),
                                  payload=payload).SerializeToString()
    assert body == reference
