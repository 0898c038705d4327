"""The change feed against a real broker and real Spark: its rows are what the Python replayer
accepts (rogue records absent), it is exactly once across runs, and truncation is never silent."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from confluent_kafka import Producer
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from kvstore import cli
from kvstore.core.entries import decode_entry
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.pipeline import changes
from kvstore.pipeline.target import WalTarget
from tests.conftest import unique
from tests.integration.helpers import WAL_BOUNDS, writer
from wal import Replayer, ShardWriter, WriterConfig, WriterIdentity, delete_below, shard_transactional_id
from wal.broker import LocalKafka
from wal.record import EXPECTED_OFFSET_HEADER, encode

pytestmark = [pytest.mark.kafka, pytest.mark.pipeline]

Row = tuple[Any, ...]  # CHANGES_COLUMNS, with the timestamp as Unix ms


def entry(*effects: tuple[str, bytes, bytes | None], request_id: str = "", leader_ms: int = 0) -> bytes:
    out = wal_entry_pb2.WalEntry(request_id=request_id, leader_unix_ms=leader_ms)
    for op, key, value in effects:
        if op == "put":
            out.effects.add(put=wal_entry_pb2.PutEffect(key=key, value=value or b""))
        else:
            out.effects.add(delete=wal_entry_pb2.DeleteEffect(key=key))
    return out.SerializeToString()


def shard_writer(bootstrap: str, topic: str, shard: int) -> ShardWriter:
    if shard == 0:
        return writer(bootstrap, topic, name="leader")
    return ShardWriter(WriterConfig(bootstrap_servers=bootstrap, topic=topic, partition=shard,
                                    transactional_id=shard_transactional_id(f"test.{topic}", shard),
                                    writer=WriterIdentity(f"leader-{shard}", 3), **WAL_BOUNDS))


def append(bootstrap: str, topic: str, shard: int, payloads: Sequence[bytes]) -> int:
    """Append one batch with a guarded writer of its own; returns the upcoming offset."""
    w = shard_writer(bootstrap, topic, shard)
    try:
        return w.append(list(payloads)).upcoming_offset
    finally:
        w.close()


def end_offset(bootstrap: str, topic: str, shard: int) -> int:
    with Replayer(bootstrap, topic, shard, 0) as replayer:
        return replayer.end_offset()


def python_rows(bootstrap: str, topic: str, shards: Iterable[int]) -> list[Row]:
    """What the store itself would apply, effect by effect: wal.Replayer (W3) + decode_entry."""
    rows: list[Row] = []
    for shard in shards:
        with Replayer(bootstrap, topic, shard, 0) as replayer:
            for record in replayer.read_to_end(30.0):
                decoded = decode_entry(record.payload)
                if decoded is None:
                    continue
                for i, effect in enumerate(decoded.effects):
                    kind = effect.WhichOneof("kind")
                    key = effect.put.key if kind == "put" else effect.delete.key
                    value = effect.put.value if kind == "put" else None
                    # The decoder describes a record's first kind of these (one, unless hostile).
                    first = next((k for k in ("prepare", "decision", "resolve", "forget") if decoded.HasField(k)), None)
                    txn_id = getattr(decoded, str(first)).txn_id if first in ("decision", "resolve") else None
                    rows.append((shard, record.offset, i, record.offset, key, value, kind,
                                 decoded.request_id or None, record.writer.id, record.writer.term,
                                 record.timestamp_ms, decoded.leader_unix_ms, txn_id))
    return sorted(rows)


def spark_rows(frame: DataFrame) -> list[Row]:
    cols = [F.unix_millis(F.col(c)).alias(c) if c == "timestamp" else F.col(c) for c in changes.CHANGES_COLUMNS]
    return sorted(tuple(bytes(v) if isinstance(v, bytearray) else v for v in r) for r in frame.select(*cols).collect())


def rogue_records(bootstrap: str, topic: str, upcoming: int) -> int:
    """A mismatch, a malformed record, and one W3 accepts whose payload is not a WalEntry, from
    a producer outside the guard; returns the upcoming offset after them."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    rogue = WriterIdentity("rogue", 9)

    def send(expected: int, payload: bytes) -> None:
        value, headers = encode(expected, rogue, payload)
        producer.produce(topic, value, partition=0, headers=headers)

    send(upcoming + 100, entry(("put", b"mismatch", b"x")))          # lands at upcoming: mismatch
    producer.produce(topic, b"\xff\xfe", partition=0,                 # malformed envelope
                     headers=[(EXPECTED_OFFSET_HEADER, str(upcoming + 1).encode())])
    send(upcoming + 2, b"\xff\xff garbage")                           # accepted, not a WalEntry
    bad_effect = wal_entry_pb2.WalEntry(request_id="no-kind")
    bad_effect.effects.add()                                          # an effect without a kind
    send(upcoming + 3, bad_effect.SerializeToString())
    assert producer.flush(10) == 0
    return upcoming + 4


def run_cli(capsys: pytest.CaptureFixture[str], kafka: LocalKafka, topic: str, to: Path,
            *extra: str) -> tuple[int, str, str]:
    status = cli.main(["changes", "--to", str(to), "--kafka", kafka.bootstrap_servers, "--topic", topic,
                       "--output", "json", *extra])
    out, err = capsys.readouterr()
    return status, out, err


def last_json(out: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return record


def test_rows_are_the_accepted_effects(kafka: LocalKafka, spark: SparkSession) -> None:
    bootstrap, topic = kafka.bootstrap_servers, unique("changes")
    kafka.create_topic(topic, partitions=2)
    upcoming = append(bootstrap, topic, 0, [
        entry(("put", b"a", b"1"), ("put", b"b", b""), request_id="r1", leader_ms=1_700_000_000_000),
        entry(("delete", b"a", None)),
        entry(),                                                      # no effects: no rows
    ])
    upcoming = rogue_records(bootstrap, topic, upcoming)
    append(bootstrap, topic, 0, [entry(("put", b"c", b"3"), request_id="r2")])
    append(bootstrap, topic, 1, [entry(("put", b"z", b"9"), ("delete", b"y", None))])
    target = WalTarget(bootstrap, topic, 2)
    ends = {s: end_offset(bootstrap, topic, s) for s in (0, 1)}

    frame = changes.read_changes(spark, target, {s: (0, e) for s, e in ends.items()})
    assert tuple(frame.columns) == changes.CHANGES_COLUMNS
    assert [(f.name, f.dataType) for f in frame.schema.fields] == \
        [(f.name, f.dataType) for f in changes.CHANGES_SCHEMA.fields]
    rows = spark_rows(frame)
    assert rows == python_rows(bootstrap, topic, (0, 1))
    by_key = {(r[0], r[4], r[6]): r for r in rows}
    assert by_key[(0, b"a", "put")][5] == b"1" and by_key[(0, b"a", "put")][7] == "r1"
    assert by_key[(0, b"a", "put")][11] == 1_700_000_000_000
    assert by_key[(0, b"b", "put")][5] == b"" and by_key[(0, b"b", "put")][2] == 1
    assert by_key[(0, b"a", "delete")][5] is None and by_key[(0, b"a", "delete")][7] is None
    assert by_key[(0, b"a", "delete")][3] == 1  # revision: the record's offset
    assert by_key[(1, b"y", "delete")][8:10] == ("leader-1", 3)
    assert {r[8] for r in rows} == {"leader", "leader-1"}  # nothing from the rogue producer
    assert len(rows) == 6


def test_feed_is_exactly_once_across_runs(kafka: LocalKafka, topic: str, spark: SparkSession, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    bootstrap = kafka.bootstrap_servers
    to = tmp_path / "feed"
    append(bootstrap, topic, 0, [entry(("put", f"k{i}".encode(), b"v")) for i in range(5)])
    status, out, _ = run_cli(capsys, kafka, topic, to)
    assert status == 0 and last_json(out) == {"rows": 5, "to": str(to)}

    append(bootstrap, topic, 0, [entry(("put", b"k0", b"w"), ("delete", b"k1", None))])
    rogue_records(bootstrap, topic, end_offset(bootstrap, topic, 0))
    append(bootstrap, topic, 0, [entry(("put", b"k9", b"v"))])
    status, out, _ = run_cli(capsys, kafka, topic, to)
    assert status == 0 and last_json(out) == {"rows": 3, "to": str(to)}
    status, out, _ = run_cli(capsys, kafka, topic, to)  # nothing new
    assert status == 0 and last_json(out) == {"rows": 0, "to": str(to)}

    table = changes.read_table(spark, str(to))
    rows = spark_rows(table)
    assert rows == python_rows(bootstrap, topic, (0,))
    assert len({(r[0], r[1], r[2]) for r in rows}) == len(rows) == 8
    (part, *_) = (to / "shard=0").glob("*.parquet")
    assert str(pq.read_schema(part).field("timestamp").type) == "timestamp[us, tz=UTC]"  # not legacy INT96

    # A feed whose checkpoint is gone, or a checkpoint whose table is gone, would silently miss rows.
    status, _, err = run_cli(capsys, kafka, topic, to, "--checkpoint", str(tmp_path / "other-checkpoint"))
    assert status == 1 and "already holds a change feed" in err, err
    status, _, err = run_cli(capsys, kafka, topic, tmp_path / "new-table", "--checkpoint", str(to / "_checkpoint"))
    assert status == 1 and "is missing" in err, err


def test_truncation_below_an_unread_offset_is_refused(kafka: LocalKafka, topic: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    bootstrap = kafka.bootstrap_servers
    to = tmp_path / "feed"
    append(bootstrap, topic, 0, [entry(("put", b"a", b"1"))])
    status, out, _ = run_cli(capsys, kafka, topic, to)
    assert status == 0 and last_json(out)["rows"] == 1
    append(bootstrap, topic, 0, [entry(("put", b"b", b"2"))])          # at 2: the feed has read up to it
    cut = append(bootstrap, topic, 0, [entry(("put", b"c", b"3"))]) - 2  # c at 4, its marker at 5
    assert delete_below(bootstrap, topic, {0: cut}) == {0: cut}        # b is gone unread

    status, out, err = run_cli(capsys, kafka, topic, to)
    assert status == 1, out
    assert "lost rows" in err and "new --to" in err, err

    fresh = tmp_path / "fresh"
    status, out, err = run_cli(capsys, kafka, topic, fresh)
    assert status == 0, err
    assert last_json(out) == {"rows": 1, "to": str(fresh), "first_offsets": {"0": cut}}
    assert "history before it is gone" in err



def test_follow_appends_until_ctrl_c(kafka: LocalKafka, topic: str, spark: SparkSession, tmp_path: Path) -> None:
    bootstrap = kafka.bootstrap_servers
    to = tmp_path / "feed"
    append(bootstrap, topic, 0, [entry(("put", b"a", b"1")), entry(("put", b"b", b"2"))])
    notices: list[str] = []
    batches = threading.Semaphore(0)

    def notice(text: str) -> None:
        notices.append(text)
        if text.startswith("batch "):
            batches.release()

    def operator() -> None:
        try:
            if batches.acquire(timeout=60):
                append(bootstrap, topic, 0, [entry(("delete", b"a", None))])
                batches.acquire(timeout=60)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C

    helper = threading.Thread(target=operator, daemon=True)
    helper.start()
    run = changes.run_feed(spark, WalTarget(bootstrap, topic, 1), str(to), follow=True, interval_s=0.5,
                           notice=notice)
    helper.join(10)
    assert run.rows == 3, notices
    assert spark_rows(changes.read_table(spark, str(to))) == python_rows(bootstrap, topic, (0,))
