"""Cross-shard transactions in the pipeline (docs/design.md §10, docs/pipeline.md): a snapshot
carries the transactions prepared at its cut, the change feed names each row's transaction, and
the audit checks atomicity (exit 1 when a transaction is applied without its decision).

A real node (two shards) drives a transaction whose driver stops right after its decision (a
failpoint), so its prepares are open when the snapshot is taken."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.dataset as pads
import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession

from kvstore.client import Client, Op, UnknownOutcome
from kvstore.core.state import prepare_id, resolve_id
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.pipeline.audit import TxnRecord, atomicity
from kvstore.storage import snapshot
from tests.conftest import unique
from tests.integration.store_process import StoreProcess
from tests.pipeline.conftest import NODE_SHARDS, cli_json
from tests.pipeline.test_audit import audit_cli, keys_of_shard
from wal.broker import LocalKafka
from wal.clients import PartitionEnds
from wal.record import WriterIdentity, encode


@pytest.fixture
def stopping_node(kafka: LocalKafka, tmp_path: Path) -> Iterator[StoreProcess]:
    store = StoreProcess(kafka.bootstrap_servers, tmp_path / "node", unique("pt").replace("-", ""),
                         shards=NODE_SHARDS)
    store.env["KVSTORE_FAILPOINTS"] = "txn-stop-after-decision=1"
    store.start()
    try:
        yield store
    finally:
        store.stop()


@pytest.mark.kafka
@pytest.mark.pipeline
def test_snapshot_feed_and_audit_of_a_transaction(stopping_node: StoreProcess, kafka: LocalKafka, tmp_path: Path,
                                                  spark: SparkSession, capsys: pytest.CaptureFixture[str]) -> None:
    node = stopping_node
    topic = f"{node.cluster}.wal"
    root = str(tmp_path / "snapshots")
    a, b = keys_of_shard(0, 1)[0], keys_of_shard(1, 1)[0]
    with Client([node.address], timeout_s=20, max_attempts=1) as client:
        client.put(a, "old")
        client.put(b, "old")
        with pytest.raises(UnknownOutcome):  # its driver stops after the decision: the prepares stay open
            client.txn([], [Op.put(a, "new"), Op.put(b, "new")], request_id="stopped")
    made = cli_json(capsys, "--endpoints", node.address, "--output", "json", "snapshot", "create", "--dir", root,
                    "--kafka", kafka.bootstrap_servers, "--topic", topic, "--master", "local[2]")
    manifest = snapshot.read_manifest(root, made["name"])
    assert manifest.format == 3
    open_txns = [{p.txn_id for p in snapshot.prepared(root, manifest.name, s)} for s in range(NODE_SHARDS)]
    assert open_txns[0] == open_txns[1] and len(open_txns[0]) == 1, open_txns
    assert [s.prepared for s in manifest.shards] == [1, 1]
    for s in range(NODE_SHARDS):  # a replica loaded from it keeps the locks: it checks against its manifest
        snapshot.verify_shard(root, manifest, s)
    (txn_id,) = open_txns[0]

    with Client([node.address], timeout_s=20) as client:
        assert client.get(b).value == b"new"  # the read waits, the prepare is resolved: committed
        assert client.get(a).value == b"new"

    code, report = audit_cli(capsys, node, kafka, root)
    assert code == 0 and report["ok"] is True, report["anomalies"]
    assert report["transactions"] == {"decided": 1, "committed": 1, "aborted": 0, "in_doubt": 0}

    feed = str(tmp_path / "changes")
    cli_json(capsys, "--endpoints", node.address, "--output", "json", "changes", "--to", feed,
             "--kafka", kafka.bootstrap_servers, "--topic", topic, "--master", "local[2]")
    rows = pads.dataset(feed, format="parquet", partitioning="hive").to_table().to_pylist()
    by_txn = sorted((r["key"], r["value"]) for r in rows if r["txn_id"] == txn_id)
    assert by_txn == sorted([(a.encode(), b"new"), (b.encode(), b"new")])
    assert all(r["txn_id"] is None for r in rows if r["value"] == b"old")

    # A transaction applied at a participant without any decision (records appended around the
    # guard): the audit from offset 0 flags it, and exits 1.
    end = PartitionEnds(kafka.bootstrap_servers, 10).high_watermark(topic, 1)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "enable.idempotence": True})
    rogue = WriterIdentity("rogue", 1 << 40)
    effect = pb.Effect(put=pb.PutEffect(key=b"stolen", value=b"1"))
    prepare = pb.WalEntry(request_id=prepare_id("evil"), prepare=pb.TxnPrepare(
        txn_id="evil", coordinator=0, participants=[0, 1], exclusive_keys=[b"stolen"]))
    resolve = pb.WalEntry(request_id=resolve_id("evil"), resolve=pb.TxnResolve(txn_id="evil", commit=True,
                                                                                  succeeded=True), effects=[effect])
    for i, entry in enumerate((prepare, resolve)):
        body, headers = encode(end + i, rogue, entry.SerializeToString())
        producer.produce(topic, body, partition=1, headers=headers)
    assert producer.flush(10) == 0
    code, report = audit_cli(capsys, node, kafka, str(tmp_path / "no-snapshots"))
    assert code == 1 and any("evil" in a and "no decision" in a for a in report["anomalies"]), report["anomalies"]


# ---- the rule, without Spark ---------------------------------------------------------------------------------


def rec(shard: int, offset: int, kind: str, txn: str = "t", commit: bool = False, succeeded: bool = False,
        participants: tuple[int, ...] = (0, 1), records: int = 1) -> TxnRecord:
    return TxnRecord(shard, offset, kind, txn, commit, succeeded, participants, records)


def test_atomicity_table() -> None:
    commit = [rec(0, 1, "prepare"), rec(1, 1, "prepare"), rec(0, 2, "decision", commit=True, succeeded=True),
              rec(0, 3, "resolve", commit=True, succeeded=True), rec(1, 2, "resolve", commit=True, succeeded=True)]
    assert atomicity(commit, {}, from_zero=True) == ([], [], {"decided": 1, "committed": 1, "aborted": 0,
                                                              "in_doubt": 0})
    # In doubt at the cut: a note.
    anomalies, notes, counts = atomicity(commit[:4], {}, from_zero=True)
    assert not anomalies and counts["in_doubt"] == 1 and "in doubt" in notes[0]
    # A participant resolved the other way; one resolved without its prepare.
    wrong = [*commit[:4], rec(1, 2, "resolve", commit=False)]
    assert "resolved it at 2 as abort" in atomicity(wrong, {}, from_zero=True)[0][0]
    orphan = [r for r in commit if (r.shard, r.kind) != (1, "prepare")]
    assert "without its prepare" in atomicity(orphan, {}, from_zero=True)[0][0]
    # ...unless the state the audit starts from had it prepared.
    assert atomicity(orphan, {1: {"t"}}, from_zero=False)[0] == []
    # Aborted, yet applied; two decisions; a hostile record of two kinds is skipped.
    aborted = [rec(0, 1, "prepare"), rec(0, 2, "decision"), rec(0, 3, "resolve", commit=True)]
    assert "was aborted" in atomicity(aborted, {}, from_zero=True)[0][0]
    twice = [*commit, rec(0, 9, "decision")]
    assert "2 decisions" in atomicity(twice, {}, from_zero=True)[0][0]
    assert atomicity([rec(0, 1, "resolve", commit=True, records=2)], {}, from_zero=True)[0] == []
    # Applied with no decision anywhere: an anomaly from offset 0, a note otherwise.
    lone = [rec(1, 1, "prepare", txn="x"), rec(1, 2, "resolve", txn="x", commit=True)]
    assert "no decision" in atomicity(lone, {}, from_zero=True)[0][0]
    assert atomicity(lone, {}, from_zero=False)[0] == [] and "not in the audited range" in atomicity(
        lone, {}, from_zero=False)[1][0]
