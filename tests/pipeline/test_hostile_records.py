"""Hostile records in a running cluster's WAL: nobody wedges, and everybody agrees on each one (issue 18).

A producer outside the guard (librdkafka's C API: it can write header keys that are not UTF-8)
appends to shard 1's partition of a running two-node cluster: a 5,000-digit header (once made
`int()` raise in every reader of the shard, forever), a header `"e\\n"` at offset e (once accepted by
the Spark jobs and refused by the nodes), a key that is not UTF-8 beside a valid header (once made
confluent-kafka's `headers()` fail), a key with a NUL byte, leading zeros, a body that disagrees
with its header, a record expecting another offset, garbage, and rogue entries that fit. Then:

- the shard's leader and follower keep serving writes (the leader's next batch hits W2 and is
  retried by the client), and both replicas end equal;
- every reader gives every record the same verdict: a node's replayer, Spark's expression, the
  audit's per-offset report, the snapshot (its digest is the nodes'), the change feed (rows exactly
  for the accepted entries), and the nodes' W3 rejection counters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from kvstore import cli
from kvstore.client import Client
from kvstore.core.sharding import shard_of
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.pipeline.changes import read_table
from kvstore.v1 import cluster_pb2
from tests.conftest import unique
from tests.integration.store_process import StoreProcess
from tests.pipeline.conftest import cli_json
from tests.pipeline.verdicts import end_offset, replayer_verdicts, spark_verdicts
from tests.raw_producer import RawProducer
from tests.waiting import NotYet, wait_until
from wal.broker import LocalKafka
from wal.record import EXPECTED_OFFSET_HEADER, WriterIdentity, encode

pytestmark = [pytest.mark.kafka, pytest.mark.pipeline, pytest.mark.slow]

SHARDS = 2
SHARD = 1
KEY = EXPECTED_OFFSET_HEADER.encode()


def keys_of(shard: int, count: int, prefix: str) -> list[str]:
    out: list[str] = []
    i = 0
    while len(out) < count:  # bounded: about one key in SHARDS lands in each shard
        key = f"{prefix}{i:04d}"
        if shard_of(key.encode(), SHARDS) == shard:
            out.append(key)
        i += 1
    return out


def entry(key: bytes) -> bytes:
    """A WalEntry that puts `key`: what a rogue writer that knows the format would append."""
    put = wal_entry_pb2.Effect(put=wal_entry_pb2.PutEffect(key=key, value=b"rogue"))
    return wal_entry_pb2.WalEntry(effects=[put]).SerializeToString()


@pytest.fixture
def cluster(kafka: LocalKafka, tmp_path: Path) -> Iterator[list[StoreProcess]]:
    name = unique("hostile").replace("-", "")
    nodes = [StoreProcess(kafka.bootstrap_servers, tmp_path / node_id, name, shards=SHARDS, node_id=node_id,
                          metrics=True) for node_id in ("n1", "n2")]
    try:
        for node in nodes:
            node.start()
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def digests(node: StoreProcess) -> tuple[int, str]:
    reply = node.cluster_stub.ShardDigest(cluster_pb2.ShardDigestRequest(shard=SHARD), timeout=10)
    return reply.applied_offset, reply.sha256


def equal(nodes: list[StoreProcess]) -> tuple[int, str]:
    """Shard 1's (applied offset, digest), once every node has the same."""
    seen = {digests(node) for node in nodes}
    if len(seen) != 1:
        raise NotYet(seen)
    return seen.pop()


def test_hostile_records_are_judged_alike_and_wedge_nobody(
        cluster: list[StoreProcess], kafka: LocalKafka, tmp_path: Path, spark: SparkSession,
        capsys: pytest.CaptureFixture[str]) -> None:
    topic = f"{cluster[0].cluster}.wal"
    addresses = [node.address for node in cluster]
    before, after = keys_of(SHARD, 10, "before"), keys_of(SHARD, 30, "after")
    nul, zeros, many_zeros = (key.encode() for key in keys_of(SHARD, 3, "rogue"))  # served by shard 1 too
    with Client(addresses, timeout_s=30, max_attempts=100, max_backoff_s=0.2) as client:
        for key in before:
            client.put(key, "v")
    wait_until(lambda: equal(cluster), 60, interval_s=0.2, what="the replicas to agree before the hostile records")

    e = end_offset(kafka, topic, SHARD)

    def fits(at: int, payload: bytes = b"x") -> bytes:
        return encode(at, WriterIdentity("rogue", 1), payload)[0]

    hostile: list[tuple[str, bytes | None, list[tuple[bytes, bytes | None]]]] = [
        ("5,000 digits", fits(e), [(KEY, b"9" * 5_000)]),
        ("a line end after the offset", fits(e + 1), [(KEY, str(e + 1).encode() + b"\n")]),
        ("a key that is not UTF-8", fits(e + 2), [(KEY, str(e + 2).encode()), (b"bad\xff", b"v")]),
        ("a NUL in our key: read up to it", fits(e + 3, entry(nul)), [(KEY + b"\x00x", str(e + 3).encode())]),
        ("leading zeros", fits(e + 4, entry(zeros)), [(KEY, b"000" + str(e + 4).encode())]),
        ("4,500 leading zeros", fits(e + 5, entry(many_zeros)), [(KEY, b"0" * 4_500 + str(e + 5).encode())]),
        ("body and header disagree", fits(e + 1), [(KEY, str(e + 6).encode())]),
        ("expects another offset", fits(e + 99), [(KEY, str(e + 99).encode())]),
        ("garbage body", b"\xff\xfe\xfd", [(KEY, str(e + 8).encode())]),
        ("a space", fits(e + 9), [(KEY, b" " + str(e + 9).encode())]),
        ("U+FFFD in a key", fits(e + 10), [(KEY, str(e + 10).encode()), ("\ufffd".encode(), b"")]),
        ("not an entry, but fits", fits(e + 11, b"\xff not an entry"), [(KEY, str(e + 11).encode())]),
    ]
    with RawProducer(kafka.bootstrap_servers) as producer:
        for _, body, headers in hostile:
            producer.produce(topic, SHARD, body, headers)
        producer.flush()
    end = e + len(hostile)
    assert end_offset(kafka, topic, SHARD) == end, "the hostile records did not land where planned"
    want = {e + i: v for i, v in enumerate(["malformed", "malformed", "malformed", "accepted", "accepted",
                                            "accepted", "malformed", "mismatch", "malformed", "malformed",
                                            "malformed", "accepted"])}

    # The shard keeps serving: the leader's next batch lands past the hostile records (W2 aborts
    # it, the leader reads the partition again, the client retries), and so do all after it.
    with Client(addresses, timeout_s=30, max_attempts=100, max_backoff_s=0.2) as client:
        for key in after:
            assert client.put(key, "after").revision > end
        assert client.get(after[-1]).kv.value == b"after"  # type: ignore[union-attr]
        for rogue in (nul, zeros, many_zeros):
            assert client.get(rogue.decode()).kv.value == b"rogue"  # type: ignore[union-attr]

    applied, sha = wait_until(lambda: equal(cluster), 60, interval_s=0.2,
                              what="leader and follower of shard 1 to agree")

    # Record by record: a node's reader and Spark's expression.
    python = replayer_verdicts(kafka, topic, SHARD, e, end)
    assert python == want
    assert spark_verdicts(spark, kafka, topic, SHARD, e, end) == want
    # The nodes skipped exactly what W3 rejects: each read every hostile record once.
    rejected = sum(1 for verdict in want.values() if verdict != "accepted")
    for node in cluster:
        assert node.metric("kvstore_w3_rejections_total", shard=str(SHARD)) == rejected, node.node_id

    # The snapshot folded the same records: its digest is the replicas'.
    common = ["--endpoints", cluster[0].address, "--output", "json"]
    wal = ["--kafka", kafka.bootstrap_servers, "--topic", topic]
    snapshots = str(tmp_path / "snapshots")
    created = cli_json(capsys, *common, "snapshot", "create", "--dir", snapshots, "--master", "local[2]", *wal)
    [shard_meta] = [s for s in created["shards"] if s["shard"] == SHARD]
    assert (shard_meta["offset"], shard_meta["digest"]) == (applied, sha)

    # The audit reports each rejected record at its offset, and finds the replicas equal to the WAL.
    code = cli.main([*common, "audit", "--dir", snapshots, "--master", "local[2]", *wal])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1  # the rejections are anomalies
    [shard_report] = [s for s in report["shards"] if s["shard"] == SHARD]
    assert shard_report["malformed_offsets"] == [o for o, v in want.items() if v == "malformed"]
    assert shard_report["rejected_offsets"] == [o for o, v in want.items() if v == "mismatch"]
    assert shard_report["malformed_entry_offsets"] == [e + 11]  # accepted, but not a WalEntry
    assert [n["equal"] for n in shard_report["digest_nodes"]] == [True, True]

    # The change feed: rows exactly for the accepted entries among them.
    feed = str(tmp_path / "feed")
    cli_json(capsys, *common, "changes", "--to", feed, "--master", "local[2]", *wal)
    rows = (read_table(spark, feed).where((F.col("shard") == SHARD) & F.col("offset").between(e, end - 1))
            .select("offset", "key").collect())
    assert sorted((r.offset, r.key) for r in rows) == [(e + 3, nul), (e + 4, zeros), (e + 5, many_zeros)]
