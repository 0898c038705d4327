"""`kvstore audit`: a healthy cluster passes; rogue records and an altered replica are flagged.

The integration tests run a real broker, a real node process and the real Spark session, and go
through the CLI; the planning and report rules are also tested on their own, without Spark.
"""

from __future__ import annotations

import json
from pathlib import Path

import plyvel
import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession

from kvstore import cli
from kvstore.client import Client, Op
from kvstore.core.sharding import shard_of
from kvstore.core.state import KeyState
from kvstore.pipeline.audit import (
    MISMATCH,
    FoldPoint,
    NodeDigest,
    ShardStats,
    Start,
    build_report,
    digest_points,
    plan_start,
    render,
)
from kvstore.storage import snapshot
from tests.integration.store_process import StoreProcess
from tests.pipeline.conftest import NODE_SHARDS
from wal.broker import LocalKafka
from wal.clients import PartitionEnds
from wal.record import WriterIdentity, encode

SHARDS = NODE_SHARDS


def audit_cli(capsys: pytest.CaptureFixture[str], node: StoreProcess, kafka: LocalKafka,
              root: str) -> tuple[int, dict[str, object]]:
    code = cli.main(["--endpoints", node.address, "--output", "json", "audit", "--dir", root,
                     "--kafka", kafka.bootstrap_servers, "--topic", f"{node.cluster}.wal", "--master", "local[2]"])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines, captured.err
    report: dict[str, object] = json.loads(lines[-1])
    return code, report


def snapshot_cli(capsys: pytest.CaptureFixture[str], node: StoreProcess, kafka: LocalKafka, root: str) -> str:
    code = cli.main(["--endpoints", node.address, "--output", "json", "snapshot", "create", "--dir", root,
                     "--kafka", kafka.bootstrap_servers, "--topic", f"{node.cluster}.wal", "--master", "local[2]"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return str(json.loads(captured.out.strip().splitlines()[-1])["name"])


def keys_of_shard(shard: int, count: int, prefix: str = "k") -> list[str]:
    out: list[str] = []
    i = 0
    while len(out) < count:
        key = f"{prefix}{i:04d}"
        if shard_of(key.encode(), SHARDS) == shard:
            out.append(key)
        i += 1
    return out


def shards_of(report: dict[str, object]) -> list[dict[str, object]]:
    shards = report["shards"]
    assert isinstance(shards, list)
    return shards


# ---- against a real cluster -------------------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.pipeline
def test_healthy_cluster_with_a_snapshot_passes(node: StoreProcess, kafka: LocalKafka, tmp_path: Path,
                                               spark: SparkSession, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "snaps")
    with Client([node.address], timeout_s=20) as client:
        for i in range(20):
            client.put(f"k{i:02d}", f"v{i}", request_id=f"rid-{i}")
        client.txn([], [Op.put("t1", "a"), Op.put("t3", "b")], [])
        client.delete("k19")
    name = snapshot_cli(capsys, node, kafka, root)
    with Client([node.address], timeout_s=20) as client:
        for i in range(5):
            client.put(f"after{i}", "x")  # the replica is past the snapshot: compared at its own offset

    code, report = audit_cli(capsys, node, kafka, root)
    assert code == 0 and report["ok"] is True, report["anomalies"]
    assert report["snapshot"] == name
    # The placement log, folded by the same apply the nodes use: one member, every shard's copy on it.
    placement = report["placement"]
    assert placement["members"] == [node.node_id] and placement["controller"] == node.node_id
    assert placement["skipped"] == {} and placement["epoch"] >= 2
    assert placement["copies"] == {str(s): {node.node_id: "replica"} for s in range(SHARDS)}
    # The snapshot has no base: it is recomputed from the empty state at offset 0.
    assert report["start"] == {"from": None, "offsets": {str(s): 0 for s in range(SHARDS)}}
    for shard in shards_of(report):
        assert (shard["rejected"], shard["malformed"], shard["malformed_entries"], shard["term_regressions"],
                shard["duplicate_request_ids"]) == (0, 0, 0, 0, 0)
        assert shard["accepted"] > 0
        assert shard["digest_snapshot"] is not None and shard["digest_wal"] == shard["digest_snapshot"]
        nodes = shard["digest_nodes"]
        assert isinstance(nodes, list) and len(nodes) == 1
        assert nodes[0]["equal"] is True and nodes[0]["digest"] == nodes[0]["expected"]
        assert nodes[0]["applied_offset"] == shard["cut"]  # the only node leads: it is at the end
        assert int(str(shard["cut"])) > int(str(shard["snapshot_cut"]))


@pytest.mark.kafka
@pytest.mark.pipeline
def test_rogue_and_garbage_records_are_flagged(node: StoreProcess, kafka: LocalKafka, tmp_path: Path,
                                               spark: SparkSession, capsys: pytest.CaptureFixture[str]) -> None:
    topic = f"{node.cluster}.wal"
    mine = keys_of_shard(0, 8)
    with Client([node.address], timeout_s=20) as client:
        for key in mine[:5]:
            client.put(key, "v")
        client.put(keys_of_shard(1, 1)[0], "v")
    end = PartitionEnds(kafka.bootstrap_servers, 10).high_watermark(topic, 0)

    offsets: list[int] = []
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "enable.idempotence": True})

    def produce(value: bytes, headers: list[tuple[str, str | bytes | None]] | None) -> int:
        producer.produce(topic, value, partition=0, headers=headers,
                         on_delivery=lambda err, msg: offsets.append(-1 if err else msg.offset()))
        assert producer.flush(10) == 0
        return offsets[-1]

    garbage = produce(b"not a WAL record", None)
    # The high watermark read above may still be short of the leader's last transaction markers
    # (written after its commit answered; a loaded CI run saw two land after it): the slots below
    # are taken from where the records really landed.
    assert garbage >= end
    body, headers = encode(garbage, WriterIdentity("rogue", 99), b"x")  # expects the slot the garbage took
    mismatch = produce(body, headers)
    body, headers = encode(mismatch + 1, WriterIdentity("rogue", 0), b"\xff\xff not an entry")
    fits = produce(body, headers)
    assert garbage < mismatch and fits == mismatch + 1, (garbage, mismatch, fits)
    with Client([node.address], timeout_s=30) as client:
        for key in mine[5:]:  # the leader's first batch lands past the rogue records: W2 aborts, retried
            client.put(key, "after")

    code, report = audit_cli(capsys, node, kafka, str(tmp_path / "no-snapshots"))
    assert code == 1 and report["ok"] is False
    assert report["snapshot"] is None
    zero, one = shards_of(report)
    assert (zero["rejected"], zero["rejected_offsets"]) == (1, [mismatch])  # the aborted batch never shows
    assert (zero["malformed"], zero["malformed_offsets"]) == (1, [garbage])
    assert (zero["malformed_entries"], zero["malformed_entry_offsets"]) == (1, [fits])
    assert (zero["term_regressions"], zero["term_regression_offsets"]) == (1, [fits])
    assert zero["accepted"] == 5 + 3 + 1  # the leader's 8 entries and the rogue one that fits
    assert (one["rejected"], one["malformed"], one["malformed_entries"], one["term_regressions"]) == (0, 0, 0, 0)
    anomalies = report["anomalies"]
    assert isinstance(anomalies, list) and any(str(mismatch) in a for a in anomalies)
    # The replicas skipped what W3 rejects, like the fold: still equal.
    for shard in (zero, one):
        nodes = shard["digest_nodes"]
        assert isinstance(nodes, list) and [n["equal"] for n in nodes] == [True]
    assert zero["digest_nodes"][0]["applied_offset"] > fits  # type: ignore[index]


@pytest.mark.kafka
@pytest.mark.pipeline
def test_replica_altered_behind_its_back_is_flagged(node: StoreProcess, kafka: LocalKafka, tmp_path: Path,
                                                    spark: SparkSession,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    victim = keys_of_shard(0, 1)[0]
    with Client([node.address], timeout_s=20) as client:
        for i in range(10):
            client.put(f"k{i}", "v")
        client.put(victim, "honest")
    node.stop()
    db = plyvel.DB(str(node.data_dir / "shard-0"))
    try:  # the value only: version, revisions and the checkpoint stay, so nothing looks suspect
        state = KeyState.decode(db.get(b"d" + victim.encode()))
        db.put(b"d" + victim.encode(), state._replace(value=b"forged").encode(), sync=True)
    finally:
        db.close()
    node.start()
    with Client([node.address], timeout_s=20) as client:
        assert client.get(victim).kv.value == b"forged"  # type: ignore[union-attr]

    code, report = audit_cli(capsys, node, kafka, str(tmp_path / "no-snapshots"))
    assert code == 1 and report["ok"] is False
    zero, one = shards_of(report)
    assert (zero["rejected"], zero["malformed"]) == (0, 0)
    [altered] = zero["digest_nodes"]  # type: ignore[misc]
    assert altered["equal"] is False and altered["digest"] != altered["expected"]
    assert altered["keys"] == altered["expected_keys"]
    assert [n["equal"] for n in one["digest_nodes"]] == [True]  # type: ignore[attr-defined]
    assert any(node.address in a for a in report["anomalies"])  # type: ignore[attr-defined]


# ---- the rules on their own -------------------------------------------------------------------------


def _manifest(name: str, offsets: list[int], base: str | None = None, digest: str = "d") -> snapshot.Manifest:
    return snapshot.Manifest(
        name=name, topic="t.wal", shard_count=len(offsets), created_unix_ms=0, base=base, max_request_ids=1,
        request_id_horizon_ms=1,
        shards=tuple(snapshot.ShardSnapshot(shard=s, offset=o, keys=1, digest=f"{digest}{s}", requests=0,
                                            evicted_through_ms=0) for s, o in enumerate(offsets)))


def test_plan_start_prefers_the_base_then_offset_zero_then_the_newest() -> None:
    base = _manifest("snap-1", [10, 20])
    newest = _manifest("snap-2", [30, 40], base="snap-1")
    whole = {0: (0, 50), 1: (0, 50)}
    assert plan_start(None, None, None, whole) == Start(None, recompute=False)
    assert plan_start(newest, base, None, whole) == Start(base, recompute=True)
    assert plan_start(newest, base, None, {0: (10, 50), 1: (20, 50)}) == Start(base, recompute=True)
    # The base is gone but the WAL is whole: replay from 0.
    assert plan_start(newest, None, "missing", whole) == Start(None, recompute=True)
    # Truncated above the base on shard 0 only (`wal truncate` to the newest's cut).
    start = plan_start(newest, base, None, {0: (30, 50), 1: (20, 50)})
    assert start.manifest is newest and not start.recompute
    assert "not verifiable" in start.why_not[0] and "truncated above 10" in start.why_not[0]
    assert "not recomputed" in start.why_not[1]
    no_base = _manifest("snap-3", [30, 40])
    start = plan_start(no_base, None, None, {0: (5, 50), 1: (5, 50)})
    assert start.manifest is no_base and "has no base" in start.why_not[0]


def test_report_rules() -> None:
    newest = _manifest("snap-2", [30, 40], base="snap-1", digest="s")
    start = Start(_manifest("snap-1", [10, 20], digest="b"), recompute=True)
    cuts = {0: 50, 1: 60}
    nodes = [NodeDigest("n1", "a:1", 0, 50, "w0@50", 1), NodeDigest("n2", "a:2", 0, 5, "x", 1),
             NodeDigest("n1", "a:1", 1, 45, "tampered", 1)]
    assert digest_points(2, start, newest, cuts, nodes) == {0: [10, 30, 50], 1: [20, 40, 45]}

    def point(offset: int, digest: str, records: int = 4) -> FoldPoint:
        return FoldPoint(offset, digest, 1, records, 0, 0)

    folds = {0: {10: point(10, "b0"), 30: point(30, "s0"), 50: point(50, "w0@50")},
             1: {20: point(20, "b1"), 40: point(40, "different"), 45: point(45, "w1@45"), 60: point(60, "w1@60")}}
    stats = {0: ShardStats(accepted=4), 1: ShardStats(accepted=4, rejected=2, offsets={MISMATCH: [33, 34]})}
    report = build_report(2, newest, start, cuts, folds, stats, nodes, [])
    assert report["ok"] is False
    zero, one = report["shards"]
    assert zero["anomalies"] == [] and zero["digest_wal"] == zero["digest_snapshot"] == "s0"
    assert [(n["node"], n["equal"]) for n in zero["digest_nodes"]] == [("n1", True), ("n2", None)]
    assert "below the audit's start 10" in zero["digest_nodes"][1]["note"]
    assert one["digest_wal"] == "different" and one["digest_snapshot"] == "s1"
    assert one["rejected_offsets"] == [33, 34] and one["malformed_offsets"] == []
    assert [n["equal"] for n in one["digest_nodes"]] == [False]
    assert len(one["anomalies"]) == 3  # rejected records, snapshot differs, replica differs
    assert report["anomalies"] == one["anomalies"]
    table = render(report)  # for people: the same findings
    assert "DIFFERENT" in table and "33, 34" in table and table.endswith("3 anomalies")

    # A start the WAL cannot recompute the snapshot from is said, not flagged.
    why = {0: "not verifiable: truncated", 1: "not recomputed"}
    start = Start(newest, recompute=False, why_not=why)
    folds = {0: {30: point(30, "s0"), 50: point(50, "w0@50")}, 1: {40: point(40, "s1"), 60: point(60, "w1@60")}}
    report = build_report(2, newest, start, cuts, folds, {0: ShardStats(accepted=4), 1: ShardStats(accepted=4)},
                          [], [])
    assert report["ok"] is True and report["anomalies"] == []
    assert [s["digest_wal"] for s in report["shards"]] == [None, None]
    assert report["shards"][0]["digest_wal_note"] == why[0]
    # ... but a start snapshot whose files do not give its manifest's digest is flagged.
    folds[1][40] = point(40, "rotten")
    report = build_report(2, newest, start, cuts, folds, {0: ShardStats(accepted=4), 1: ShardStats(accepted=4)},
                          [], [])
    assert report["ok"] is False and "files do not reproduce" in report["anomalies"][0]
