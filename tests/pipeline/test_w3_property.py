"""W3 is one rule: `wal.record` (every node's reader) and the Spark expression (`wal_source.judged`)
give every record the same verdict, whatever bytes its headers hold (issue 18).

Hypothesis draws records with hostile headers — trailing line ends, spaces, signs, leading zeros,
more than 19 digits, thousands of digits, non-ASCII digits, empty and null values, second headers
with the same key, keys that are not UTF-8 or hold a NUL byte — and bodies that agree or disagree
with them. They are appended to a real broker by a producer outside the guard (librdkafka's C API,
`tests.raw_producer`, the only way to write such keys), then judged three ways and compared record
by record: the replayer a node runs (`wal.Replayer`, one record per poll so that each verdict is
seen), `wal.record.judge` on what a plain consumer reads, and the Spark expression on a real Spark
session.

Deterministic by default (`derandomize`: a green run is not luck and a red one replays as it is);
W3_EXAMPLES sets how many examples (default 12, of up to 20 records each; ~6 s each, mostly the
Spark job), W3_RANDOM=1 explores with a fresh seed, which hypothesis prints when an example fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql import SparkSession

from tests.conftest import unique
from tests.pipeline.verdicts import end_offset, judge_verdicts, replayer_verdicts, spark_verdicts
from tests.raw_producer import RawHeaders, RawProducer
from wal.broker import LocalKafka
from wal.record import EXPECTED_OFFSET_HEADER, WriterIdentity, encode

pytestmark = [pytest.mark.kafka, pytest.mark.pipeline]

EXAMPLES = int(os.environ.get("W3_EXAMPLES", "12"))
KEY = EXPECTED_OFFSET_HEADER.encode()
Record = tuple[bytes | None, RawHeaders]


@pytest.fixture(scope="module")
def wal_topic(kafka: LocalKafka) -> str:
    name = unique("w3prop")
    kafka.create_topic(name, partitions=1)
    return name


@pytest.fixture(scope="module")
def producer(kafka: LocalKafka) -> Iterator[RawProducer]:
    with RawProducer(kafka.bootstrap_servers) as raw:
        yield raw


def _values(expected: int) -> st.SearchStrategy[bytes | None]:
    """Header values around `expected`: its canonical decimal, and everything a careless parser
    takes for it, or chokes on."""
    digits = str(expected).encode()
    return st.one_of(
        st.just(digits), st.just(digits),  # weighted: enough records reach ACCEPTED and MISMATCH
        st.sampled_from([digits + b"\n", digits + b"\r\n", digits + b"\r", b"\n" + digits, b" " + digits,
                         digits + b" ", b"\t" + digits, b"+" + digits, b"-" + digits, digits + b"\x00",
                         digits + "\u2028".encode(), digits + b".0", digits + b"e0", b"0x" + digits]),
        st.integers(1, 40).map(lambda n: b"0" * n + digits),  # leading zeros: still the offset
        st.integers(4_290, 5_000).map(lambda n: b"0" * n + digits),  # thousands of them
        st.integers(19, 30).map(lambda n: b"9" * n),  # past int64
        st.integers(4_290, 6_000).map(lambda n: b"1" * n),  # past Python's int() digit limit
        st.sampled_from([b"9223372036854775807", b"9223372036854775808", b"18446744073709551615",
                         b"18446744073709551616", b"0", b"00"]),
        st.sampled_from(["\u0661\u0662", "\uff11", "\u00b2", "\u0663" + str(expected), "\u09e7"]).map(str.encode),
        st.sampled_from([b"", None]),
        st.binary(max_size=8),
        st.text(alphabet="0123456789 \n\t+-", min_size=1, max_size=6).map(str.encode),
    )


_KEYS = st.one_of(
    st.just(KEY), st.just(KEY), st.just(KEY),
    st.sampled_from([KEY + b"\x00", KEY + b"\x00junk", KEY + b"\x00\xff", b"\x00" + KEY, KEY + b"\n", KEY + b" ",
                     KEY.upper(), KEY[:-1], b"", b"\xef\xbf\xbd", b"ok\xff", b"a\x00\xff", b"\xc0\x80",
                     b"\xed\xa0\x80", b"\xf4\x90\x80\x80", "\u00e9".encode(), "\U0001f600".encode()]),
    st.binary(max_size=6),
    st.text(max_size=6).map(str.encode),
)


@st.composite
def _record(draw: st.DrawFn, actual: int) -> Record:
    """One record that will land at `actual`: a body expecting `actual` (or a neighbour, or not a
    record at all) and headers drawn around what the body says."""
    expected = actual + draw(st.sampled_from([0, 0, 0, 1, -1]))
    body_kind = draw(st.sampled_from(["envelope", "envelope", "envelope", "garbage", "tombstone"]))
    if body_kind == "envelope" and expected >= 0:
        body: bytes | None = encode(expected, WriterIdentity(draw(st.sampled_from(["rogue", "r\u00e9"])), 3),
                                    draw(st.binary(max_size=4)))[0]
    elif body_kind == "tombstone":
        body = None
    else:
        body = draw(st.binary(max_size=12))
    said = max(0, expected + draw(st.sampled_from([0, 0, 0, 1])))  # what the header claims
    headers: list[tuple[bytes, bytes | None]] = []
    for _ in range(draw(st.integers(0, 3))):  # bounded: at most 3 headers
        key = draw(_KEYS)
        value = draw(_values(said)) if key.startswith(KEY[:4]) or draw(st.booleans()) else draw(st.binary(max_size=4))
        headers.append((key, value))
    return body, headers


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=os.environ.get("W3_RANDOM") != "1",
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_python_and_spark_judge_every_record_alike(kafka: LocalKafka, wal_topic: str, producer: RawProducer,
                                                   spark: SparkSession, data: st.DataObject) -> None:
    start = end_offset(kafka, wal_topic)
    count = data.draw(st.integers(1, 20), label="records")
    records = [data.draw(_record(start + i), label=f"record at {start + i}") for i in range(count)]
    for body, headers in records:
        producer.produce(wal_topic, 0, body, headers)
    producer.flush()
    end = start + count
    assert end_offset(kafka, wal_topic) == end, "a record went missing or landed elsewhere"

    replayed = replayer_verdicts(kafka, wal_topic, 0, start, end)
    judged = judge_verdicts(kafka, wal_topic, 0, start, end)
    sparked = spark_verdicts(spark, kafka, wal_topic, 0, start, end)
    assert replayed == judged == sparked, {o: (replayed.get(o), judged.get(o), sparked.get(o), records[o - start])
                                           for o in range(start, end)
                                           if not replayed.get(o) == judged.get(o) == sparked.get(o)}
