"""Cross-shard transactions in the pipeline (docs/design.md §10, docs/pipeline.md): a snapshot
carries the transactions prepared at its cut and the coordinators' decision tables, the change
feed names each row's transaction, and the audit checks atomicity (exit 1 when a transaction is
applied without its decision).

A real node (two shards) drives a transaction whose driver stops right after its decision (a
failpoint), so the participant's prepare is open and the coordinator holds the decision when the
snapshot is taken."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.dataset as pads
import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from kvstore.client import Client, Op, UnknownOutcome
from kvstore.core.state import decision_id, prepare_id, resolve_id
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.pipeline.audit import TxnRecord, atomicity
from kvstore.pipeline.session import ENTRY_UDF
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
    assert manifest.format == 4
    # The coordinator (shard 0, the lowest) prepares nothing: it applied its part with the decision,
    # which its decision table keeps until shard 1 resolved it; shard 1's prepare is open.
    open_txns = [{p.txn_id for p in snapshot.prepared(root, manifest.name, s)} for s in range(NODE_SHARDS)]
    decided = [{d.txn_id for d in snapshot.decided(root, manifest.name, s)} for s in range(NODE_SHARDS)]
    assert open_txns[0] == decided[1] == set() and len(open_txns[1]) == 1, (open_txns, decided)
    assert decided[0] == open_txns[1], (open_txns, decided)
    assert [s.prepared for s in manifest.shards] == [0, 1] and [s.decided for s in manifest.shards] == [1, 0]
    for s in range(NODE_SHARDS):  # a replica loaded from it keeps locks and decisions: checked against its manifest
        snapshot.verify_shard(root, manifest, s)
    (txn_id,) = open_txns[1]

    with Client([node.address], timeout_s=20) as client:
        assert client.get(b).value == b"new"  # the read waits, the prepare is resolved: committed
        assert client.get(a).value == b"new"

    code, report = audit_cli(capsys, node, kafka, root)
    assert code == 0 and report["ok"] is True, report["anomalies"]
    counts = dict(report["transactions"])
    assert counts.pop("forgotten") in (0, 1)  # the coordinator forgets it in its own time
    assert counts == {"decided": 1, "committed": 1, "aborted": 0, "in_doubt": 0}

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


@pytest.mark.pipeline
def test_the_jvm_decoder_names_each_kind_of_transaction_record(spark: SparkSession) -> None:
    """The audit and the change feed read transaction records through the JVM decoder: each kind,
    a forget's txn ids (it has no txn id of its own), and how many kinds a hostile entry holds."""
    effect = pb.Effect(put=pb.PutEffect(key=b"k", value=b"v"))
    entries = {
        "prepare": pb.WalEntry(request_id=prepare_id("p"), prepare=pb.TxnPrepare(txn_id="p", coordinator=0,
                                                                                 participants=[0, 1])),
        "decision": pb.WalEntry(request_id=decision_id("d"), effects=[effect], decision=pb.TxnDecision(
            txn_id="d", commit=True, succeeded=True, participants=[0, 2], kept=True)),
        "resolve": pb.WalEntry(request_id=resolve_id("r"), resolve=pb.TxnResolve(txn_id="r", commit=True,
                                                                                 coordinator=1)),
        "forget": pb.WalEntry(forget=pb.TxnForget(txn_ids=["a", "b"])),
        "two": pb.WalEntry(resolve=pb.TxnResolve(txn_id="x"), forget=pb.TxnForget(txn_ids=["y"])),
    }
    frame = spark.createDataFrame([(name, e.SerializeToString()) for name, e in entries.items()],
                                  "name string, payload binary")
    rows = {r["name"]: r for r in frame.select("name", F.call_function(ENTRY_UDF, F.col("payload")).alias("entry"))
            .select("name", "entry.txn", F.size("entry.effects").alias("effects")).collect()}

    def txn(name: str) -> tuple[object, ...]:
        t = rows[name]["txn"]
        return (t["kind"], t["txn_id"], t["commit"], t["participants"], t["records"], list(t["txn_ids"]))

    assert txn("prepare") == ("prepare", "p", None, [0, 1], 1, [])
    assert txn("decision") == ("decision", "d", True, [0, 2], 1, []) and rows["decision"]["effects"] == 1
    assert txn("resolve") == ("resolve", "r", True, [], 1, []) and rows["resolve"]["txn"]["coordinator"] == 1
    assert txn("forget") == ("forget", None, None, [], 1, ["a", "b"])
    assert txn("two") == ("resolve", "x", False, [], 2, [])  # the first kind described; two: skipped by the rule


# ---- the rule, without Spark ---------------------------------------------------------------------------------


def rec(shard: int, offset: int, kind: str, txn: str = "t", commit: bool = False, succeeded: bool = False,
        participants: tuple[int, ...] = (0, 1), records: int = 1, effects: int = 0,
        txn_ids: tuple[str, ...] = ()) -> TxnRecord:
    return TxnRecord(shard, offset, kind, txn, commit, succeeded, participants, records, effects, txn_ids)


NONE = {"decided": 0, "committed": 0, "aborted": 0, "in_doubt": 0, "forgotten": 0}


def test_atomicity_table() -> None:
    """A transaction of a release before the decision table: the coordinator prepared and resolves."""
    commit = [rec(0, 1, "prepare"), rec(1, 1, "prepare"), rec(0, 2, "decision", commit=True, succeeded=True),
              rec(0, 3, "resolve", commit=True, succeeded=True), rec(1, 2, "resolve", commit=True, succeeded=True)]
    assert atomicity(commit, {}, from_zero=True) == ([], [], NONE | {"decided": 1, "committed": 1})
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



def test_atomicity_of_the_decision_table_protocol() -> None:
    """The coordinator applies its part with the commit decision and resolves nothing; only the
    other participants do. A forget is a record of its own kind, never taken for a resolve."""
    ok = NONE | {"decided": 1, "committed": 1}
    decision = rec(0, 5, "decision", commit=True, succeeded=True, participants=(0, 1, 2), effects=2)
    parts = [rec(1, 1, "prepare"), rec(2, 1, "prepare"), decision,
             rec(1, 2, "resolve", commit=True, succeeded=True), rec(2, 2, "resolve", commit=True, succeeded=True)]
    assert atomicity(parts, {}, from_zero=True) == ([], [], ok)
    # Every other participant resolved: the coordinator forgets the decision.
    forget = rec(0, 6, "forget", txn="", txn_ids=("t", "unknown"))
    assert atomicity([*parts, forget], {}, from_zero=True) == ([], [], ok | {"forgotten": 1})
    # A participant that has not resolved: in doubt, and a forget before it is a note, not a resolve.
    anomalies, notes, counts = atomicity([*parts[:4], forget], {}, from_zero=True)
    assert not anomalies and counts == ok | {"in_doubt": 1, "forgotten": 1}
    assert any("forgotten at shard 0 offset 6, but shard(s) [2]" in n for n in notes), notes
    # The trap: a record of any other kind (a forget naming the txn, a kind from the future) at a
    # participant is not its resolve.
    for other in (rec(2, 2, "forget", txn="t", commit=True, succeeded=True), rec(2, 2, "future", commit=True)):
        anomalies, notes, counts = atomicity([*parts[:4], other], {}, from_zero=True)
        assert not anomalies and counts["in_doubt"] == 1, (other, anomalies, counts)
    # A participant committing what the coordinator aborted is still caught.
    aborted = [rec(1, 1, "prepare"), rec(0, 2, "decision"), rec(1, 2, "resolve", commit=True)]
    assert "was aborted" in atomicity(aborted, {}, from_zero=True)[0][0]
    anomalies, notes, counts = atomicity(aborted[:2], {}, from_zero=True)
    assert not anomalies and counts == NONE | {"decided": 1, "aborted": 1, "in_doubt": 1} and "in doubt" in notes[0]
    # Decisions the apply rule skips are no decisions: an abort carrying effects, one participant.
    assert atomicity([rec(0, 1, "decision", effects=1), rec(0, 2, "decision", participants=(0,))], {},
                     from_zero=True)[2] == NONE
    # A coordinator that prepared (a record of an older release, seen here or in the start's
    # state) must resolve it too.
    old = [rec(1, 1, "prepare"), decision, rec(1, 2, "resolve", commit=True, succeeded=True),
           rec(2, 2, "resolve", commit=True, succeeded=True)]
    assert atomicity(old, {0: {"t"}, 2: {"t"}}, from_zero=False)[2]["in_doubt"] == 1
    assert atomicity([rec(0, 1, "prepare"), *old], {2: {"t"}}, from_zero=False)[2]["in_doubt"] == 1
    assert atomicity([*old, rec(0, 6, "resolve", commit=True, succeeded=True)], {0: {"t"}, 2: {"t"}},
                     from_zero=False) == ([], [], ok)
