"""The WAL as a Spark DataFrame, judged by W3 as one column expression.

Every job reads the WAL through here: Spark's Kafka source under `read_committed` (aborted
records and commit markers never appear; without it Spark returns aborted records) with headers,
decoded in the JVM (`kv_decode_record`, `kv_decode_entry`: see `kvstore.pipeline.session`), and
judged by `verdict`, the SQL twin of `wal.record.judge` (tests/pipeline/test_wal_source.py holds
the two together on the same records, rogue ones included).

Spark 4 runs ANSI SQL, where a plain `cast` of a bad string fails the whole job. A WAL may hold
anything a foreign producer wrote, so nothing here may throw on data: the header is checked as
bytes and parsed with `try_cast` (`header_expected_offset`), the first matching header is taken
with `try_element_at`, and bytes that do not parse decode to NULL. Such records are *malformed*,
i.e. rejected and counted, never a failed job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from kvstore.pipeline.session import ENTRY_UDF, RECORD_UDF
from wal.clients import ClientSecurity, java_security_settings
from wal.record import EXPECTED_OFFSET_HEADER, MAX_OFFSET

MAX_OFFSET_DIGITS = len(str(MAX_OFFSET))

ACCEPTED = "accepted"
MISMATCH = "mismatch"
MALFORMED = "malformed"

# The columns `judged` yields, in order.
JUDGED_COLUMNS = ("shard", "offset", "timestamp_ms", "verdict", "expected_offset", "writer_id", "writer_term",
                  "payload")


def kafka_options(bootstrap_servers: str, extra: Mapping[str, str] | None = None,
                  security: ClientSecurity | None = None) -> dict[str, str]:
    """Source options every job uses. `security` logs Spark's Kafka clients (driver and
    executors) in as the pipeline's principal, with the same settings librdkafka gets
    (`wal.clients`), in the Java client's form. `extra` passes further `kafka.*` client settings
    through, as Spark's Kafka source takes them."""
    options = {
        "kafka.bootstrap.servers": bootstrap_servers,
        "kafka.isolation.level": "read_committed",
        "includeHeaders": "true",
        # Larger fetches than the Java client's defaults (500 records per poll, 1 MiB per
        # partition): measured 2.4 s -> 1.7 s for 200k records (bench/pipeline.py).
        "kafka.max.poll.records": "10000",
        "kafka.max.partition.fetch.bytes": str(8 * 1024 * 1024),
        "kafka.fetch.max.bytes": str(64 * 1024 * 1024),
    }
    login = java_security_settings(security or ClientSecurity())
    options.update({f"kafka.{key}": value for key, value in login.items()})
    options.update(extra or {})
    return options


def read_wal(spark: SparkSession, bootstrap_servers: str, topic: str, ranges: Mapping[int, tuple[int, int]],
             *, kafka_extra: Mapping[str, str] | None = None, security: ClientSecurity | None = None) -> DataFrame:
    """Batch read of [start, end) per shard (partition). Offsets are Kafka's: `end` exclusive,
    `start` at or above the log start (else Spark fails the job for lost data, as it should)."""
    assert ranges, "no shard to read"
    for shard, (start, end) in ranges.items():
        assert 0 <= start <= end, f"shard {shard}: bad range [{start}, {end})"
    starting = {topic: {str(s): start for s, (start, _) in ranges.items()}}
    ending = {topic: {str(s): end for s, (_, end) in ranges.items()}}
    return (spark.read.format("kafka").options(**kafka_options(bootstrap_servers, kafka_extra, security))
            .option("assign", json.dumps({topic: sorted(ranges)}))
            .option("startingOffsets", json.dumps(starting))
            .option("endingOffsets", json.dumps(ending))
            .load())


def header_expected_offset() -> Column:
    """The `wal.expected_offset` header as a bigint, NULL when the record is malformed by it:
    `wal.record.header_expected_offset`'s rule (its module docstring), step for step.

    - A key counts up to its first NUL byte (Python readers get keys as C strings from
      librdkafka), and a key holding U+FFFD makes the record malformed (the JVM's Kafka client
      decodes a key that is not UTF-8 with U+FFFD; Python readers cannot decode it at all).
    - The first header with our key counts. Its value is checked as bytes, through `hex`, to be
      ASCII digits only: no regex end anchor that also matches before a final line terminator
      (Java's `$` does), no cast that trims whitespace (Spark's does).
    - Leading zeros are dropped and more than 19 significant digits refused before the cast;
      `try_cast` then refuses what is above 2^63 - 1.
    """
    headers = F.coalesce(F.col("headers"), F.array())

    def key(header: Column) -> Column:
        return F.substring_index(header["key"], "\u0000", 1)

    unreadable = F.exists(headers, lambda h: key(h).contains("\ufffd"))
    first = F.try_element_at(F.filter(headers, lambda h: key(h) == F.lit(EXPECTED_OFFSET_HEADER)), F.lit(1))
    value = first["value"]
    digits = F.hex(value).rlike(r"\A(3[0-9])+\z")  # 0x30-0x39, one or more, nothing else
    significant = F.regexp_replace(value.cast("string"), r"\A0+", "")
    offset = (F.when(significant == F.lit(""), F.lit(0).cast("bigint"))
              .when(F.length(significant) <= F.lit(MAX_OFFSET_DIGITS), significant.try_cast("bigint")))
    return F.when(~unreadable & digits, offset).otherwise(F.lit(None).cast("bigint"))


def w3_accepts(actual: Column, expected: Column) -> Column:
    """W3 itself (`wal.record.accepts`): a record counts iff it landed where it expected."""
    return actual == expected


def judged(raw: DataFrame) -> DataFrame:
    """Kafka rows -> one row per record with its W3 verdict and decoded envelope."""
    body = F.call_function(RECORD_UDF, F.col("value"))
    staged = raw.select(
        F.col("partition").alias("shard"),
        F.col("offset"),
        (F.unix_millis(F.col("timestamp"))).alias("timestamp_ms"),
        header_expected_offset().alias("expected_offset"),
        body.alias("body"),
    )
    expected, body_col = F.col("expected_offset"), F.col("body")
    verdict = (F.when(expected.isNull() | body_col.isNull() | (body_col["expected_offset"] != expected),
                      F.lit(MALFORMED))
               .when(w3_accepts(F.col("offset"), expected), F.lit(ACCEPTED))
               .otherwise(F.lit(MISMATCH)))
    return staged.select(
        "shard", "offset", "timestamp_ms", verdict.alias("verdict"), "expected_offset",
        body_col["writer_id"].alias("writer_id"), body_col["writer_term"].alias("writer_term"),
        body_col["payload"].alias("payload"),
    )


def accepted(judged_frame: DataFrame) -> DataFrame:
    return judged_frame.where(F.col("verdict") == ACCEPTED)


def entries(accepted_frame: DataFrame) -> DataFrame:
    """Accepted records with their store entry decoded (`entry` NULL: not a WalEntry, which the
    store counts as malformed and skips, `kvstore.core.entries.decode_entry`)."""
    return accepted_frame.withColumn("entry", F.call_function(ENTRY_UDF, F.col("payload")))
