"""Each reader's verdict on each record of a range (W3): a node's replayer, `wal.record.judge`, Spark.

For tests that hold them together record by record (tests/pipeline/test_w3_property.py,
tests/pipeline/test_hostile_records.py).
"""

from __future__ import annotations

import operator
from typing import Any

from confluent_kafka import Consumer, TopicPartition
from pyspark.sql import SparkSession

from kvstore.pipeline import wal_source
from tests.waiting import NotYet, wait_until
from wal import clients
from wal.broker import LocalKafka
from wal.record import Verdict, judge
from wal.replayer import Replayer

_HEADERS = operator.methodcaller("headers")


def end_offset(kafka: LocalKafka, topic: str, partition: int = 0) -> int:
    ends = clients.PartitionEnds(kafka.bootstrap_servers, 10.0)
    try:
        return ends.high_watermark(topic, partition)
    finally:
        ends.close()


def replayer_verdicts(kafka: LocalKafka, topic: str, partition: int, start: int, end: int) -> dict[int, str]:
    """What a node's reader decides of each record: one record per poll, the verdict read off the
    replayer's counters (rejected records yield nothing)."""
    out: dict[int, str] = {}
    with Replayer(kafka.bootstrap_servers, topic, partition, start, max_poll_records=1) as replayer:
        def read() -> bool:
            while replayer.position < end:  # bounded: the caller's wait bounds the polls
                before = (replayer.stats.accepted, replayer.stats.rejected_mismatch, replayer.stats.rejected_malformed)
                position = replayer.position
                replayer.poll_once(0.2)
                after = (replayer.stats.accepted, replayer.stats.rejected_mismatch, replayer.stats.rejected_malformed)
                if after == before:
                    raise NotYet(f"at {replayer.position} of {end}")
                assert replayer.position == position + 1, "one record per poll"
                kind = [Verdict.ACCEPTED, Verdict.MISMATCH, Verdict.MALFORMED][
                    [a - b for a, b in zip(after, before, strict=True)].index(1)]
                out[position] = kind.value
            return True

        wait_until(read, 60, interval_s=0.01, what=f"the replayer to judge [{start}, {end})")
    return out


def judge_verdicts(kafka: LocalKafka, topic: str, partition: int, start: int, end: int) -> dict[int, str]:
    """`judge` on what a plain consumer reads; a message whose headers do not decode is judged
    without them, as the replayer does (`Replayer._headers_of`). `headers()` is called from C
    (operator.methodcaller), never from Python bytecode: only the former turns confluent-kafka's
    pending decode error into a SystemError at once; a specialised call from bytecode returns
    the poisoned list and the error surfaces later, anywhere (seen: a segfault here)."""
    consumer = Consumer(clients.consumer_config(kafka.bootstrap_servers, "read_committed"))
    consumer.assign([TopicPartition(topic, partition, start)])
    out: dict[int, str] = {}

    def read() -> bool:
        for msg in consumer.consume(100, 0.2):
            offset = msg.offset()
            if msg.error() or offset is None or offset >= end:
                continue
            try:
                headers: Any = _HEADERS(msg)  # called from C: see above
            except SystemError:
                headers = None
            out[offset] = judge(offset, msg.value(), headers)[0].value
        if len(out) < end - start:
            raise NotYet(f"{len(out)} of {end - start}")
        return True

    try:
        wait_until(read, 60, interval_s=0.01, what=f"a consumer to read [{start}, {end})")
    finally:
        consumer.close()
    return out


def spark_verdicts(spark: SparkSession, kafka: LocalKafka, topic: str, partition: int, start: int,
                   end: int) -> dict[int, str]:
    raw = wal_source.read_wal(spark, kafka.bootstrap_servers, topic, {partition: (start, end)})
    rows = wal_source.judged(raw).collect()
    return {r.offset: r.verdict for r in rows}
