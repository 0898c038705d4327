"""`kvstore wal truncate` against a real broker and real Spark (issue 18, items 3 and 4): it
verifies the newest snapshot whole before it deletes anything, and it never deletes what a
registered reader (a change feed) still needs unless forced.

The WAL here is written by guarded writers (no node): the snapshot, the feed and the truncation
only read it. The marker-slot rule (item 2) with real nodes is tests/pipeline/test_marker_slot.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from kvstore import cli
from kvstore.pipeline import changes
from kvstore.pipeline.truncate import kept_below_cut
from tests.conftest import unique
from tests.pipeline.conftest import cli_json
from tests.pipeline.test_changes import append, entry
from wal import Reader, ReaderRegistry
from wal.broker import LocalKafka
from wal.clients import PartitionEnds

pytestmark = [pytest.mark.kafka, pytest.mark.pipeline]

SHARDS = 2


class Wal:
    def __init__(self, kafka: LocalKafka, tmp_path: Path) -> None:
        self.kafka = kafka
        self.topic = unique("trunc")
        kafka.create_topic(self.topic, partitions=SHARDS)
        self.snapshots = str(tmp_path / "snapshots")
        self.ends = PartitionEnds(kafka.bootstrap_servers, 20.0)
        self.written: list[bytes] = []  # every key put, once each

    @property
    def args(self) -> list[str]:
        return ["--kafka", self.kafka.bootstrap_servers, "--topic", self.topic]

    def put(self, *keys: str, request_ids: bool = True) -> None:
        """Put `keys` as store entries, dealt to the shards in turn, one guarded batch per shard.
        With request ids, as the store's clients send them (a snapshot whose request-id table is
        empty cannot be built upon today: snapshot_job reads its empty requests/ directory)."""
        for shard in range(SHARDS):
            mine = [k for i, k in enumerate(keys) if i % SHARDS == shard]
            if mine:
                append(self.kafka.bootstrap_servers, self.topic, shard, [
                    entry(("put", k.encode(), b"v"), request_id=f"rid-{k}" if request_ids else "",
                          leader_ms=1_700_000_000_000) for k in mine])
                self.written.extend(k.encode() for k in mine)

    def log_start(self, shard: int) -> int:
        return self.ends.log_start(self.topic, shard)

    def end(self, shard: int) -> int:
        return self.ends.settled_end(self.topic, shard, 20.0)

    def snapshot(self, capsys: pytest.CaptureFixture[str]) -> dict[int, int]:
        created = cli_json(capsys, "--output", "json", "snapshot", "create", "--dir", self.snapshots,
                           "--master", "local[2]", *self.args)
        return {s["shard"]: s["offset"] for s in created["shards"]}

    def truncate(self, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
        status = cli.main(["--output", "json", "wal", "truncate", "--dir", self.snapshots, *self.args, *extra])
        out, err = capsys.readouterr()
        return status, out, err

    def feed(self, capsys: pytest.CaptureFixture[str], to: Path) -> tuple[int, str, str]:
        status = cli.main(["--output", "json", "changes", "--to", str(to), "--master", "local[2]", *self.args])
        out, err = capsys.readouterr()
        return status, out, err


def last_json(out: str) -> dict[str, Any]:
    import json

    record: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return record


# ---- item 3: the snapshot is verified whole before anything is deleted ---------------------------------


def test_a_damaged_snapshot_is_refused_and_nothing_is_deleted(kafka: LocalKafka, tmp_path: Path,
                                                              spark: SparkSession,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    wal = Wal(kafka, tmp_path)
    wal.put(*(f"k{i}" for i in range(20)))
    cuts = wal.snapshot(capsys)
    (name,) = [p.name for p in Path(wal.snapshots).iterdir()]
    requests = Path(wal.snapshots) / name / "requests" / "shard=0"
    assert list(requests.glob("*.parquet")), "the snapshot holds shard 0's request ids"

    # requests/ of shard 0 gone: the keys and their digest still match, the request-id table does not.
    saved = tmp_path / "saved-requests"
    shutil.move(requests, saved)
    for extra in ((), ("--dry-run",), ("--force",)):
        status, out, err = wal.truncate(capsys, *extra)
        assert status == 1, out
        assert f"snapshot {name} failed verification at shard 0" in err and "request ids" in err, err
        assert "nothing was deleted" in err
        assert [wal.log_start(s) for s in range(SHARDS)] == [0, 0]
    shutil.move(saved, requests)

    # A keys/ file of shard 1 altered: it no longer reads as Parquet.
    (keys_file, *_) = sorted((Path(wal.snapshots) / name / "keys" / "shard=1").glob("*.parquet"))
    original = keys_file.read_bytes()
    keys_file.write_bytes(original[: len(original) // 2])
    status, _, err = wal.truncate(capsys)
    assert status == 1 and "failed verification at shard 1" in err, err
    assert [wal.log_start(s) for s in range(SHARDS)] == [0, 0]
    keys_file.write_bytes(original)

    # Whole again: verified per shard (progress on stderr), then deleted below cut - 1.
    status, out, err = wal.truncate(capsys)
    assert status == 0, err
    result = last_json(out)
    assert [(s["shard"], s["verified"], s["log_start_after"]) for s in result["shards"]] == [
        (s, True, kept_below_cut(cuts[s])) for s in range(SHARDS)]
    assert "verifying snapshot" in err and "shard 1: verified" in err
    assert [wal.log_start(s) for s in range(SHARDS)] == [kept_below_cut(cuts[s]) for s in range(SHARDS)]


# ---- item 4: truncation knows who still reads --------------------------------------------------------


def test_a_change_feed_holds_truncation_back_until_forced(kafka: LocalKafka, tmp_path: Path, spark: SparkSession,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    wal = Wal(kafka, tmp_path)
    to = tmp_path / "feed"
    name = changes.reader_name(str(to / changes.CHECKPOINT_DIR))
    registry = ReaderRegistry(kafka.bootstrap_servers, wal.topic, timeout_s=20)

    wal.put("a", "b", "c", "d")
    status, out, err = wal.feed(capsys, to)
    assert status == 0 and last_json(out)["rows"] == 4, err
    # Registered with the end of its last committed batch: where its next batch starts.
    read_to = {s: wal.end(s) for s in range(SHARDS)}
    (registered,) = registry.list().readers
    assert (registered.name, registered.kind, registered.where) == (name, "change-feed", str(to))
    assert dict(registered.positions) == read_to

    wal.put("e", "f", "g", "h")  # written after the feed's run: not read yet
    listed = cli_json(capsys, "--output", "json", "wal", "readers", *wal.args)
    (shown,) = listed["readers"]
    assert shown["name"] == name and shown["kind"] == "change-feed"
    assert [(s["shard"], s["position"], s["lag"], s["broken"]) for s in shown["shards"]] == [
        (s, read_to[s], wal.end(s) - read_to[s], False) for s in range(SHARDS)]
    assert all(s["lag"] > 0 for s in shown["shards"])

    # Truncation stops at the feed's position and names it; the snapshot alone would allow more.
    cuts = wal.snapshot(capsys)
    assert all(kept_below_cut(cuts[s]) > read_to[s] for s in range(SHARDS))
    status, out, err = wal.truncate(capsys)
    assert status == 0, err
    result = last_json(out)
    for s in result["shards"]:
        assert s["log_start_after"] == read_to[s["shard"]] and s["cut_allows"] == kept_below_cut(cuts[s["shard"]])
        assert s["held_by"] == [{"reader": name, "position": read_to[s["shard"]], "kind": "change-feed",
                                 "where": str(to)}]
    assert [wal.log_start(s) for s in range(SHARDS)] == [read_to[s] for s in range(SHARDS)]
    status = cli.main(["wal", "truncate", "--dir", wal.snapshots, "--dry-run", *wal.args])  # the table says it too
    out, _ = capsys.readouterr()
    assert status == 0 and f"reader {name} (change-feed, {to}) still needs it from {read_to[0]}" in out, out

    # The feed goes on without a gap, and moves its position to where it stopped.
    status, out, err = wal.feed(capsys, to)
    assert status == 0 and last_json(out)["rows"] == 4, err
    table = changes.read_table(spark, str(to)).collect()
    assert sorted(bytes(r["key"]) for r in table) == sorted(wal.written)  # every put once, none missing
    (registered,) = registry.list().readers
    assert dict(registered.positions) == {s: wal.end(s) for s in range(SHARDS)}
    status, out, err = wal.truncate(capsys)  # now nothing holds it back
    assert status == 0 and all(not s["held_by"] and s["log_start_after"] == kept_below_cut(cuts[s["shard"]])
                               for s in last_json(out)["shards"]), out

    # --force deletes past a feed that has not read yet, says so loudly, and the feed then fails.
    wal.put("i", "j", "k", "l")
    cuts = wal.snapshot(capsys)
    behind = dict(registry.list().readers[0].positions)
    status, out, err = wal.truncate(capsys, "--force")
    assert status == 0, err
    result = last_json(out)
    assert result["force"] is True
    for s in result["shards"]:
        assert s["log_start_after"] == kept_below_cut(cuts[s["shard"]]) > behind[s["shard"]]
        assert [h["reader"] for h in s["overridden"]] == [name] and s["held_by"] == []
    assert "WARNING: --force" in err and name in err and "will fail" in err
    status, out, err = wal.feed(capsys, to)
    assert status == 1, out
    assert "lost rows" in err and "new --to" in err, err  # WalGapError, as before the registry

    # The broken feed is shown as such and holds nothing back; removing it says what it means.
    (shown,) = cli_json(capsys, "--output", "json", "wal", "readers", *wal.args)["readers"]
    assert all(s["broken"] for s in shown["shards"])
    status = cli.main(["--output", "json", "wal", "readers", "remove", name, *wal.args])
    out, err = capsys.readouterr()
    assert status == 0 and last_json(out) == {"removed": name, "topic": wal.topic}
    assert "may delete records it still needed" in err
    assert registry.list().readers == ()
    status = cli.main(["wal", "readers", "remove", name, *wal.args])  # gone: a second removal is refused
    assert status == 1 and "no reader" in capsys.readouterr().err
    registry.close()


def test_a_reader_below_the_log_start_is_reported_broken_not_blocking(kafka: LocalKafka, tmp_path: Path,
                                                                      spark: SparkSession,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    wal = Wal(kafka, tmp_path)
    wal.put("a", "b", "c", "d")
    first = wal.snapshot(capsys)
    assert wal.truncate(capsys)[0] == 0
    with ReaderRegistry(kafka.bootstrap_servers, wal.topic, timeout_s=20) as registry:
        registry.record(Reader("lost", "job", "/somewhere", {0: 0, 1: 0}, 1))  # below the new log start
        registry.record(Reader("ahead", "job", "/elsewhere", {0: 10_000}, 1))  # beyond the cut: holds nothing
        wal.put("e", "f", "g", "h")
        cuts = wal.snapshot(capsys)
        status, out, err = wal.truncate(capsys)
        assert status == 0, err
        for s in last_json(out)["shards"]:
            assert s["held_by"] == [] and [h["reader"] for h in s["broken_readers"]] == ["lost"]
            assert s["log_start_before"] == kept_below_cut(first[s["shard"]])
            assert s["log_start_after"] == kept_below_cut(cuts[s["shard"]])
        assert sorted(last_json(out)["readers"]) == ["ahead", "lost"]
