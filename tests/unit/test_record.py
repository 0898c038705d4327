"""`wal.record`: the envelope and the acceptance rule W3, without Kafka."""

from __future__ import annotations

import random
from typing import Any

import pytest

from wal.record import (
    EXPECTED_OFFSET_HEADER,
    AcceptedRecord,
    Headers,
    Judged,
    Verdict,
    WriterIdentity,
    accepts,
    encode,
    header_expected_offset,
    judge,
    judge_batch,
    parse_offset,
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
        pytest.param([(H, b"12\n")], None, id="trailing-newline"),
        pytest.param([(H, b"12\r\n")], None, id="trailing-crlf"),
        pytest.param([(H, b"\n12")], None, id="leading-newline"),
        pytest.param([(H, b"9" * 5_000)], None, id="5000-digits"),
        pytest.param([(H, b"0" * 5_000 + b"12")], 12, id="5000-leading-zeros"),
        pytest.param([(H, b"0" * 5_000)], 0, id="5000-zeros"),
        pytest.param([(H, b"9223372036854775807")], 2**63 - 1, id="int64-max"),
        pytest.param([(H, b"09223372036854775807")], 2**63 - 1, id="int64-max-leading-zero"),
        pytest.param([(H, b"9223372036854775808")], None, id="int64-max+1"),
        pytest.param([(H, b"10000000000000000000")], None, id="20-digits"),
        pytest.param([(H, "12")], 12, id="str-value"),
        pytest.param([(H, "\u0661\u0662")], None, id="str-arabic-indic"),
        pytest.param({H: b"12"}, 12, id="dict"),
        pytest.param([(H, b"12"), ("other\ufffd", b"")], None, id="a-key-with-U+FFFD-after"),
        pytest.param([("\ufffd", b""), (H, b"12")], None, id="a-key-with-U+FFFD-before"),
        pytest.param([(H, b"12"), (None, b"")], None, id="a-key-that-is-not-text"),
    ],
)
def test_header_expected_offset(headers: Headers | None, expected: int | None) -> None:
    assert header_expected_offset(headers) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(b"0", 0), (b"7", 7), (b"007", 7), (b"", None), (None, None), (b"1" * 18, int("1" * 18)),
     (b"9" * 19, None), (b"1" * 19, int("1" * 19)), (b"1" * 4_301, None), (b"0" * 4_301 + b"1", 1),
     (b" 1", None), (b"1 ", None), (b"+1", None), (b"1\n", None), ("\uff11", None), ("42", 42)],
    ids=repr,
)
def test_parse_offset(raw: bytes | str | None, expected: int | None) -> None:
    assert parse_offset(raw) == expected


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


# ---- judge_batch: the bulk judge says what judge says, record by record -----------------------


def _rogue_values(rng: random.Random, offset: int, payload: bytes) -> list[tuple[bytes | None, Any]]:
    """(value, headers) pairs at `offset` that are not what a writer sends: each must be judged
    by judge_batch exactly as by judge, whatever the records around it."""
    good, headers = encode(offset, WRITER, payload)
    other_writer, _ = encode(offset, WriterIdentity("node-2", 9), payload)
    pb = record_pb2.Record(expected_offset=offset, writer=record_pb2.Writer(id=WRITER.id, term=WRITER.term),
                           payload=payload).SerializeToString()
    head = good[: len(good) - len(payload)]  # everything up to the payload
    length_at = head.rindex(b"\x1a") + 1 if payload else len(good)  # where the payload's length is
    return [
        (good, headers),
        (other_writer, headers),
        (good + b"\x20\x01", headers),  # an unknown field after the payload
        (good + b"\x1a\x01x", headers),  # the payload twice: the last one counts
        (good[:-1], headers) if payload else (good + b"\x00", headers),  # truncated / a stray byte
        (good[:length_at] + b"\x80" + good[length_at:], headers),  # a varint that never ends
        # A non-minimal payload length (same value, one byte longer): still the same record.
        (head[:length_at] + bytes([(len(payload) & 0x7F) | 0x80, len(payload) >> 7]) + payload, headers)
        if 0 < len(payload) < 128 else (good, headers),
        (b"\x08" + good[1:2] + good, headers),  # the offset twice (the later one counts)
        (pb[::-1], headers),
        (b"", headers),
        (None, headers),
        (good, [(EXPECTED_OFFSET_HEADER, str(offset + 1).encode())]),
        (good, [(EXPECTED_OFFSET_HEADER, b"0" + str(offset).encode())]),  # leading zero: the same number
        (good, [("other", b"1"), (EXPECTED_OFFSET_HEADER, str(offset).encode())]),
        (good, {EXPECTED_OFFSET_HEADER: str(offset).encode()}),
        (good, [(EXPECTED_OFFSET_HEADER, str(offset))]),  # a str value, as a dict or a test may pass
        (good, [(EXPECTED_OFFSET_HEADER, None)]),
        (good, None),
        # Issue 18: what once wedged a reader or split the readers.
        (good, [(EXPECTED_OFFSET_HEADER, b"9" * 5_000)]),  # int() refuses > 4,300 digits
        (good, [(EXPECTED_OFFSET_HEADER, b"0" * 5_000 + str(offset).encode())]),  # the same number
        (good, [(EXPECTED_OFFSET_HEADER, str(offset).encode() + b"\n")]),
        (good, [(EXPECTED_OFFSET_HEADER, str(offset).encode()), ("bad\ufffd", b"")]),
        (good, [(EXPECTED_OFFSET_HEADER, str(offset).encode()), (None, b"")]),
        (good, [(EXPECTED_OFFSET_HEADER, b"9223372036854775808")]),
        (good, [(EXPECTED_OFFSET_HEADER, str(offset).encode()), (EXPECTED_OFFSET_HEADER, b"x")]),
        (bytes(rng.randrange(256) for _ in range(rng.randrange(12))), headers),
        (bytearray_flip(rng, good), headers),
    ]


def bytearray_flip(rng: random.Random, value: bytes) -> bytes:
    flipped = bytearray(value)
    if flipped:
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
    return bytes(flipped)


def _judge_each(offsets: list[int], values: list[bytes | None], headers: list[Any]) -> list[tuple[Verdict, Any]]:
    return [judge(offset, value, h) for offset, value, h in zip(offsets, values, headers, strict=True)]


def _assert_batch_agrees(offsets: list[int], values: list[bytes | None], headers: list[Any]) -> None:
    expected = _judge_each(offsets, values, headers)
    got = judge_batch(offsets, values, headers)
    accepted = [i for i, (verdict, _) in enumerate(expected) if verdict is Verdict.ACCEPTED]
    assert got.accepted == accepted
    assert got.payloads == [expected[i][1].payload for i in accepted]
    assert got.writers == [expected[i][1].writer for i in accepted]
    assert got.mismatch == sum(verdict is Verdict.MISMATCH for verdict, _ in expected)
    assert got.malformed == sum(verdict is Verdict.MALFORMED for verdict, _ in expected)
    # Record by record too: the verdict of record i, with every record before it in the batch
    # (the fast path depends on the records before: the writer it has seen).
    for i in range(len(offsets)):
        before, upto = judge_batch(offsets[:i], values[:i], headers[:i]), judge_batch(
            offsets[: i + 1], values[: i + 1], headers[: i + 1])
        verdict = (Verdict.ACCEPTED if len(upto.accepted) > len(before.accepted) else
                   Verdict.MISMATCH if upto.mismatch > before.mismatch else Verdict.MALFORMED)
        assert verdict is expected[i][0], (i, offsets[i], values[i], headers[i])


@pytest.mark.parametrize("seed", range(60))
def test_judge_batch_agrees_with_judge(seed: int) -> None:
    rng = random.Random(seed)
    base = rng.choice([0, 1, 120, 16_370, 2**21 - 5, 2**35, rng.randrange(2**40)])
    offsets: list[int] = []
    values: list[bytes | None] = []
    headers: list[Any] = []
    offset = base
    for _ in range(rng.randrange(1, 30)):
        payload = rng.choice([b"", b"p", rng.randbytes(rng.choice([1, 127, 128, 300, 16_383, 16_384]))])
        expected = offset if rng.random() < 0.8 else offset + rng.choice([-1, 1, 7])
        if expected < 0:
            expected = 0
        if rng.random() < 0.75:
            writer = rng.choice([WRITER, WRITER, WriterIdentity("node-2", 9), WriterIdentity("")])
            value, record_headers = encode(expected, writer, payload)
            records = [(value, record_headers)]
        else:
            records = [rng.choice(_rogue_values(rng, expected, payload))]
        for value, record_headers in records:
            offsets.append(offset)
            values.append(value)
            headers.append(record_headers)
            offset += rng.choice([1, 1, 1, 2])  # markers leave gaps
    _assert_batch_agrees(offsets, values, headers)


@pytest.mark.parametrize("payload_size", [0, 1, 127, 128, 16_383, 16_384, 2**21 - 1, 2**21])
@pytest.mark.parametrize("start", [0, 126, 16_382, 2**21 - 2, 2**56])
def test_judge_batch_fast_path_boundaries(start: int, payload_size: int) -> None:
    """Varint boundaries of the offset and of the payload's length, accepted and mismatched."""
    payload = b"x" * payload_size
    offsets = [start, start + 1, start + 2, start + 3]
    encoded = [encode(o, WRITER, payload) for o in (start, start + 1, start + 3, start + 3)]
    _assert_batch_agrees(offsets, [v for v, _ in encoded], [h for _, h in encoded])


def test_judge_batch_of_nothing() -> None:
    assert judge_batch([], [], []) == Judged([], [], [], 0, 0)


def test_judge_batch_parses_one_record_per_writer_with_protobuf(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of judge_batch: a writer's records after its first are read without protobuf
    (and the tests above compare both paths with judge)."""
    parsed: list[bytes] = []
    real = record_pb2.Record

    class Counting:
        @staticmethod
        def FromString(value: bytes) -> record_pb2.Record:
            parsed.append(value)
            return real.FromString(value)

    monkeypatch.setattr("wal.record.record_pb2.Record", Counting)
    other = WriterIdentity("node-2", 9)
    writers = [WRITER] * 200 + [other] * 100 + [WRITER] * 100
    encoded = [encode(offset, writer, b"p%d" % offset) for offset, writer in enumerate(writers, start=100)]
    got = judge_batch(list(range(100, 500)), [v for v, _ in encoded], [h for _, h in encoded])
    assert len(got.accepted) == 400 and got.writers == writers
    assert len(parsed) == 3  # the first record of each run of a writer
