"""Snapshots built by Spark from the WAL equal the live replicas (digest, keys, request ids)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from kvstore import cli, errors
from kvstore.client import Client, InvalidArgument, Op
from kvstore.core.batch import admit, write_of
from kvstore.core.sharding import shard_of
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.storage import snapshot
from kvstore.storage.shard_store import ShardStore
from kvstore.v1 import cluster_pb2, kv_pb2
from tests.integration.store_process import StoreProcess
from tests.pipeline.conftest import NODE_SHARDS, cli_json
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.pipeline]

SHARDS = NODE_SHARDS


def digests(node: StoreProcess) -> dict[int, tuple[int, str, int]]:
    out = {}
    for shard in range(SHARDS):
        d = node.cluster_stub.ShardDigest(cluster_pb2.ShardDigestRequest(shard=shard), timeout=10)
        out[shard] = (d.applied_offset, d.sha256, d.keys)
    return out


def snapshot_keys(root: str, name: str, shard: int) -> dict[bytes, tuple[bytes, int, int, int]]:
    return {k: (s.value, s.version, s.mod_revision, s.create_revision)
            for batch in snapshot.key_states(root, name, shard) for k, s in batch}


def test_snapshot_equals_the_live_state_and_builds_on_the_previous_one(
        node: StoreProcess, kafka: LocalKafka, tmp_path: Path, spark: SparkSession,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "snaps")
    common = ["--endpoints", node.address, "--output", "json"]
    wal_args = ["--kafka", kafka.bootstrap_servers, "--topic", f"{node.cluster}.wal", "--master", "local[2]"]
    with Client([node.address], timeout_s=20) as client:
        for i in range(200):
            client.put(f"k{i:03d}", f"v{i}")
        for i in range(0, 200, 3):
            client.put(f"k{i:03d}", f"w{i}")  # version 2
        for i in range(0, 200, 7):
            client.delete(f"k{i:03d}")
        client.put("once", "1", request_id="rid-before-the-cut")
        client.txn([], [Op.put("t1", "a"), Op.put("t3", "b")], [])  # both on shard 1

    first = cli_json(capsys, *common, "snapshot", "create", "--dir", root, *wal_args)
    assert first["created"] is True
    name = str(first["name"])
    manifest = snapshot.read_manifest(root, name)
    assert manifest.base is None and manifest.shard_count == SHARDS
    live = digests(node)
    for s in manifest.shards:
        applied, sha, keys = live[s.shard]
        assert (s.offset, s.digest, s.keys) == (applied, sha, keys), f"shard {s.shard}"
    assert sum(s.keys for s in manifest.shards) == 200 - len(range(0, 200, 7)) + 3
    assert sum(s.requests for s in manifest.shards) >= 1  # rid-before-the-cut (the client's ids too)
    with Client([node.address], timeout_s=20) as client:
        scanned = {kv.key: (kv.value, kv.version, kv.mod_revision, kv.create_revision) for kv in client.scan_all()}
    in_snapshot = {k: v for s in range(SHARDS) for k, v in snapshot_keys(root, name, s).items()}
    assert in_snapshot == scanned
    request_ids = {r.request_id for s in range(SHARDS) for batch in snapshot.requests(root, name, s) for r in batch}
    assert "rid-before-the-cut" in request_ids
    # The request kinds travel in the snapshot: a replica loaded from it refuses a Delete retried
    # with the Put's id (issue 18), as the live replica does, instead of answering with the Put's result.
    once = shard_of(b"once", SHARDS)
    loaded = ShardStore(tmp_path / "loaded", topic=f"{node.cluster}.wal", shard=once)
    try:
        snapshot.load_into(loaded, root, manifest)
        assert loaded.request("rid-before-the-cut").kind == pb.REQUEST_KIND_PUT  # type: ignore[union-attr]
        delete = kv_pb2.DeleteRequest(key=b"once", request_id="rid-before-the-cut",
                                      first_attempt_unix_ms=int(time.time() * 1000))
        refused = admit(write_of(delete, once), loaded, (), int(time.time() * 1000))
        assert isinstance(refused, errors.InvalidRequestError) and "already used by a Put" in str(refused)
    finally:
        loaded.close()
    with Client([node.address], timeout_s=20) as client, pytest.raises(InvalidArgument, match="already used by a Put"):
        client.delete("once", request_id="rid-before-the-cut")

    # Nothing new: no second copy.
    again = cli_json(capsys, *common, "snapshot", "create", "--dir", root, *wal_args)
    assert again["created"] is False and again["name"] == name

    with Client([node.address], timeout_s=20) as client:
        for i in range(150, 260):
            client.put(f"k{i:03d}", f"x{i}")
    second = cli_json(capsys, *common, "snapshot", "create", "--dir", root, *wal_args)
    assert second["created"] is True
    manifest2 = snapshot.read_manifest(root, str(second["name"]))
    assert manifest2.base == name  # built from the first plus the WAL since its cut
    live = digests(node)
    for s in manifest2.shards:
        assert (s.offset, s.digest, s.keys) == live[s.shard]

    listed = cli_json(capsys, *common, "snapshot", "list", "--dir", root)
    assert [s["name"] for s in listed["snapshots"]] == [manifest2.name, name]  # type: ignore[index,union-attr]

    # A newest snapshot that no longer matches its own manifest is never built upon.
    path = tmp_path / "snaps" / manifest2.name / snapshot.MANIFEST
    path.write_text(path.read_text().replace(manifest2.shards[0].digest, "0" * 64))
    with Client([node.address], timeout_s=20) as client:
        client.put("one-more", "x")
    assert cli.main([*common, "snapshot", "create", "--dir", root, *wal_args]) == 1
    assert "does not reproduce its own manifest" in capsys.readouterr().err
    assert [m.name for m, _ in snapshot.list_snapshots(root)] == [manifest2.name, name]  # nothing written

    # Nor one that lost its request-id table (issue 18): its keys still match, its ids do not.
    path.write_text(manifest2.to_json())
    assert manifest2.shard(once).requests >= 1
    for lost in (tmp_path / "snaps" / manifest2.name / "requests" / f"shard={once}").rglob("*.parquet"):
        lost.unlink()
    assert cli.main([*common, "snapshot", "create", "--dir", root, *wal_args]) == 1
    err = capsys.readouterr().err
    assert "does not reproduce its own manifest" in err and "request ids" in err, err
    assert [m.name for m, _ in snapshot.list_snapshots(root)] == [manifest2.name, name]


def test_a_snapshot_builds_on_a_base_without_request_ids(
        node: StoreProcess, kafka: LocalKafka, tmp_path: Path, spark: SparkSession,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A base whose request-id table is empty (Spark wrote `requests/` with no file but _SUCCESS)
    is read with the format's schema, not inferred (it has no file to infer from)."""
    root = str(tmp_path / "snaps")
    common = ["--endpoints", node.address, "--output", "json"]
    wal_args = ["--kafka", kafka.bootstrap_servers, "--topic", f"{node.cluster}.wal", "--master", "local[2]"]
    for i in range(5):  # no request ids: the raw stub, not the client (which always sends one)
        node.kv.Put(kv_pb2.PutRequest(key=f"plain{i}".encode(), value=b"v"), timeout=20)
    first = cli_json(capsys, *common, "snapshot", "create", "--dir", root, *wal_args)
    assert sum(s["requests"] for s in first["shards"]) == 0  # type: ignore[attr-defined]
    node.kv.Put(kv_pb2.PutRequest(key=b"plain-after", value=b"v"), timeout=20)
    second = cli_json(capsys, *common, "snapshot", "create", "--dir", root, *wal_args)
    assert second["created"] is True and second["name"] != first["name"]
    live = digests(node)
    for s in snapshot.read_manifest(root, str(second["name"])).shards:
        assert (s.offset, s.digest, s.keys) == live[s.shard]
