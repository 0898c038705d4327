"""`kvstore load` against a real broker, real node processes and real Spark: every row applied
exactly once (version 1: a second apply would show version 2), also across a leader SIGKILL and
a rerun of the same file, and bad input refused before anything is written."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from kvstore import cli, limits
from kvstore.client import Client, KeyValue, Op
from kvstore.core.sharding import shard_of
from kvstore.pipeline import load
from kvstore.pipeline.target import WalTarget
from tests.conftest import unique
from tests.integration.store_process import StoreProcess
from tests.waiting import NotYet, wait_until
from wal.broker import LocalKafka
from wal.clients import PartitionEnds

pytestmark = [pytest.mark.kafka, pytest.mark.pipeline]

SHARDS = 2
SESSION_TIMEOUT_MS = 1500


class Cluster:
    """Three nodes, two shards: every shard has a leader and two standbys to take over."""

    def __init__(self, kafka: LocalKafka, base: Path) -> None:
        self.kafka = kafka
        self.name = unique("ld").replace("-", "")
        self.nodes = [StoreProcess(kafka.bootstrap_servers, base / f"n{i}", self.name, shards=SHARDS,
                                   node_id=f"n{i}", extra_args=("--session-timeout-ms", str(SESSION_TIMEOUT_MS)))
                      for i in range(1, 4)]

    @property
    def endpoints(self) -> list[str]:
        return [n.address for n in self.nodes]

    @property
    def target(self) -> WalTarget:
        return WalTarget(self.kafka.bootstrap_servers, f"{self.name}.wal", SHARDS)

    def client(self) -> Client:
        return Client(self.endpoints, timeout_s=20, max_attempts=100, max_backoff_s=0.2)

    def leader(self, shard: int, timeout_s: float = 60.0) -> StoreProcess:
        with self.client() as client:
            def settled() -> StoreProcess:
                smap = client.shard_map(timeout_s=10)
                info = smap.shards[shard]
                if not (all(s.leader_ready for s in smap.shards) and info.leader_id):
                    raise NotYet(smap)
                return next(n for n in self.nodes if n.node_id == info.leader_id)

            return wait_until(settled, timeout_s, interval_s=0.2, what=f"a settled leader of shard {shard}")


@pytest.fixture(scope="module")
def cluster(kafka: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(kafka, tmp_path_factory.mktemp("load-cluster"))
    try:
        with concurrent.futures.ThreadPoolExecutor(len(c.nodes)) as pool:  # in parallel: seconds saved
            for started in [pool.submit(node.start, 90) for node in c.nodes]:
                started.result()
        c.leader(0)
        yield c
    finally:
        for node in c.nodes:
            node.stop()


def stored(cluster: Cluster, prefix: bytes) -> dict[bytes, KeyValue]:
    with cluster.client() as client:
        return {kv.key: kv for kv in client.scan_all(prefix=prefix, limit=limits.MAX_SCAN_LIMIT)}


def assert_loaded_once(cluster: Cluster, prefix: bytes, expected: dict[bytes, bytes]) -> None:
    """Exactly the expected keys, each with its value at version 1."""
    found = stored(cluster, prefix)
    assert sorted(found) == sorted(expected)
    wrong = [(k, kv.value, kv.version) for k, kv in found.items() if kv.value != expected[k] or kv.version != 1]
    assert not wrong, f"{len(wrong)} keys wrong (value or version), e.g. {wrong[:3]}"


# ---- pure parts ------------------------------------------------------------------------------


def test_cut_dedupe_and_ids_are_deterministic() -> None:
    rows: list[load.Row] = [(b"a", b"1", False), (b"a", b"2", False), (b"b", None, True), (b"c", b"x" * 10, False)]
    assert list(load.last_per_key(rows)) == [(b"a", b"2", False), (b"b", None, True), (b"c", b"x" * 10, False)]
    big = [(f"k{i:04d}".encode(), b"v" * 10_000, False) for i in range(300)]
    batches = list(load.cut_batches(big, load.DEFAULT_BATCH_ROWS))
    assert len(batches) > 1, "cut by bytes: 300 rows of 10 kB do not fit one batch"
    assert all(sum(load.op_bytes(r) for r in b) <= load.BATCH_BYTES_BUDGET for b in batches)
    assert sum(map(len, batches)) == 300
    assert [len(b) for b in load.cut_batches(big[:10], 4)] == [4, 4, 2]
    first = load.request_id(SHARDS, 0, batches[0])
    assert first == load.request_id(SHARDS, 0, list(batches[0]))  # a function of the rows alone
    assert len({first, load.request_id(SHARDS, 1, batches[0]), load.request_id(3, 0, batches[0]),
                load.request_id(SHARDS, 0, [(b"a", b"1", False)]), load.request_id(SHARDS, 0, [(b"a", None, True)]),
                load.request_id(SHARDS, 0, [(b"a", b"", False)])}) == 6
    assert len(f"{first}/{SHARDS - 1}".encode()) <= limits.MAX_REQUEST_ID_BYTES  # as a part's id


class _Counter:
    def add(self, n: int) -> None:
        raise AssertionError("a failed task must not count rows as written")


def test_a_task_that_cannot_write_fails_naming_the_batch_and_its_outcome() -> None:
    plan = load.TaskPlan(("127.0.0.1:9",), SHARDS, 8, {0: 0, 1: 0}, 1, in_flight=2, batch_deadline_s=0.6,
                         call_timeout_s=0.3)
    batch = pa.RecordBatch.from_pydict({"shard": pa.array([0, 0], pa.int32()), "key": [b"a", b"b"],
                                        "value": [b"1", None], "delete": [False, True]})
    started = time.monotonic()
    with pytest.raises(load.LoadTaskError) as caught:
        list(load.write_partition(plan, _Counter(), iter([batch])))
    assert time.monotonic() - started < 10  # bounded by the batch deadline
    text = str(caught.value)
    assert "shard 0: batch load2-" in text and "(2 rows, keys 'a'..'b'): gave up after 1 s" in text  # 0.6 s, rounded
    assert "Rerunning the same load is safe" in text
    # The driver lifts the message out of Spark's wrapping.
    wrapped = f"org.apache.spark.SparkException: Job aborted\nTraceback (most recent call last):\n  ...\n{text}\n\tat x"
    assert load._spark_message(RuntimeError(wrapped)).startswith("shard 0: batch load2-")


# ---- loads against the cluster ---------------------------------------------------------------


def test_parquet_load_via_cli_applies_every_row_once_and_a_rerun_changes_nothing(
        cluster: Cluster, spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Binary keys and values, duplicate keys (the later row wins), deletes of existing keys."""
    doomed = [b"p/del/%03d" % i for i in range(50)]
    with cluster.client() as client:
        for shard in range(SHARDS):
            client.txn(success=[Op.put(k, b"to be deleted") for k in doomed if shard_of(k, SHARDS) == shard])
    keys = [b"p/%05d" % i for i in range(3000)]
    rows = [(k, b"\xff\x00v" + k, False) for k in keys]
    rows += [(keys[i * 7], b"later-%d" % i, False) for i in range(100)]
    rows += [(k, None, True) for k in doomed]
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"key": pa.array([r[0] for r in rows], pa.binary()),
                             "value": pa.array([r[1] for r in rows], pa.binary()),
                             "delete": pa.array([r[2] for r in rows], pa.bool_())}), path)
    expected = {k: b"\xff\x00v" + k for k in keys} | {keys[i * 7]: b"later-%d" % i for i in range(100)}
    argv = ["--endpoints", ",".join(cluster.endpoints), "--output", "json", "load", str(path),
            "--kafka", cluster.kafka.bootstrap_servers]

    assert cli.main(argv) == 0
    out = capsys.readouterr()
    result = json.loads(out.out.strip().splitlines()[-1])
    assert result["rows"] == 3150 and result["duplicates"] == 100
    assert result["applied"] == 3050 and result["replayed"] == 0
    assert result["seconds"] > 0 and result["keys_per_s"] > 0
    assert "kvstore load: writing 3150 rows to 2 shards" in out.err
    assert_loaded_once(cluster, b"p/", expected)

    # The same file again (table output): every batch is recognised, nothing applied.
    assert cli.main([a for a in argv if a not in ("--output", "json")]) == 0
    again = capsys.readouterr().out.strip().splitlines()[-1]
    assert again.startswith(f"loaded {path}: 3150 rows, 0 applied, 3050 replayed (already loaded), 100 superseded")
    assert_loaded_once(cluster, b"p/", expected)
    print(f"parquet load: {result['keys_per_s']} keys/s; rerun: {again}")


def test_csv_and_json_loads(cluster: Cluster, spark: SparkSession, tmp_path: Path) -> None:
    csv = tmp_path / "data.csv"
    lines = ["key,value,delete"] + [f"c/{i:04d},v{i}," for i in range(1000)]
    lines += ['"c/with,comma","x,""y""",false', "c/empty,,", "c/0001,later,", "c/never,,true", "c/0002,,TRUE"]
    csv.write_text("\n".join(lines) + "\n")
    expected = {f"c/{i:04d}".encode(): f"v{i}".encode() for i in range(1000)}
    expected |= {b"c/with,comma": b'x,"y"', b"c/empty": b"", b"c/0001": b"later"}
    del expected[b"c/0002"]
    result = load.load(spark, str(csv), "csv", cluster.target, cluster.endpoints)
    assert (result.rows, result.applied, result.replayed, result.duplicates) == (1005, 1003, 0, 2)
    assert result.tasks == SHARDS * load.TASKS_PER_SHARD  # one (shard, part) per task, none idle
    assert_loaded_once(cluster, b"c/", expected)

    # JSON lines in a directory of two files: the later file's row of a key wins, and so does
    # the later line within a file.
    data = tmp_path / "json"
    data.mkdir()
    first = [{"key": f"j/{i:04d}", "value": f"v{i}"} for i in range(800)]
    first += [{"key": "j/twice", "value": "first"}, {"key": "j/twice", "value": "second"},
              {"key": "j/dup", "value": "from part 0"}, {"key": "j/\u00e9t\u00e9", "value": "\u00e9"}]
    second = [{"key": "j/dup", "value": "from part 1"}, {"key": "j/0005", "delete": True}]
    (data / "part-00000.json").write_text("".join(json.dumps(r) + "\n" for r in first))
    (data / "part-00001.json").write_text("".join(json.dumps(r) + "\n" for r in second))
    result = load.load(spark, str(data), "json", cluster.target, cluster.endpoints)
    assert (result.rows, result.applied, result.duplicates) == (806, 803, 3)
    want = {f"j/{i:04d}".encode(): f"v{i}".encode() for i in range(800) if i != 5}
    want |= {b"j/twice": b"second", b"j/dup": b"from part 1", "j/\u00e9t\u00e9".encode(): "\u00e9".encode()}
    assert_loaded_once(cluster, b"j/", want)


@pytest.mark.parametrize("case", ["no key column", "null key", "long key", "null value", "bad delete",
                                  "numeric value", "not parquet", "missing file"])
def test_bad_input_is_refused_before_anything_is_written(cluster: Cluster, spark: SparkSession, tmp_path: Path,
                                                         case: str) -> None:
    good = [f"bad/{i}" for i in range(20)]
    path, fmt, message = _bad_dataset(tmp_path, case, good)
    with pytest.raises(load.LoadError) as caught:
        load.load(spark, str(path), fmt, cluster.target, cluster.endpoints)
    assert message in str(caught.value)
    assert "Traceback" not in str(caught.value) and len(str(caught.value)) < 600
    assert stored(cluster, b"bad/") == {}


def _bad_dataset(tmp_path: Path, case: str, good: list[str]) -> tuple[Path, str, str]:
    parquet = tmp_path / "bad.parquet"
    if case == "no key column":
        pq.write_table(pa.table({"k": good, "value": good}), parquet)
        return parquet, "parquet", "no 'key' column (columns found: k, value)"
    if case == "null key":
        path = tmp_path / "bad.json"
        path.write_text("".join(json.dumps({"key": k, "value": "v"}) + "\n" for k in good)
                        + '{"key": null, "value": "v"}\n')
        return path, "json", "1 row with a null key"
    if case == "long key":
        pq.write_table(pa.table({"key": [*good, "bad/" + "k" * limits.MAX_KEY_BYTES], "value": [*good, "v"]}), parquet)
        return parquet, "parquet", f"1 row with a key over MAX_KEY_BYTES={limits.MAX_KEY_BYTES} bytes"
    if case == "null value":
        pq.write_table(pa.table({"key": [*good, "bad/x"], "value": [*good, None]}), parquet)
        return parquet, "parquet", "1 row with a null value but delete not true (first key: 'bad/x')"
    if case == "bad delete":
        path = tmp_path / "bad.csv"
        path.write_text("key,value,delete\n" + "".join(f"{k},v,false\n" for k in good) + "bad/y,v,maybe\n")
        return path, "csv", "1 row with a delete that is not a boolean (first key: 'bad/y')"
    if case == "numeric value":
        path = tmp_path / "bad.json"
        path.write_text("".join(json.dumps({"key": k, "value": 1}) + "\n" for k in good))
        return path, "json", "column 'value' is bigint; it must be string or binary"
    if case == "not parquet":
        parquet.write_bytes(b"this is not a parquet file at all" * 10)
        return parquet, "parquet", f"cannot read {parquet} as parquet"
    assert case == "missing file"
    return tmp_path / "nowhere.parquet", "parquet", "no such file or directory"


def test_a_wal_that_does_not_match_the_cluster_is_refused(cluster: Cluster, spark: SparkSession,
                                                          tmp_path: Path) -> None:
    path = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"key": ["bad/1"], "value": ["v"]}), path)
    other = WalTarget(cluster.kafka.bootstrap_servers, cluster.target.topic, SHARDS + 1)
    with pytest.raises(load.LoadError, match="has 2 shards"):
        load.load(spark, str(path), "parquet", other, cluster.endpoints)


def test_cli_refuses_bad_input_with_exit_1(cluster: Cluster, spark: SparkSession, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--endpoints", ",".join(cluster.endpoints), "load", "--kafka", cluster.kafka.bootstrap_servers]
    assert cli.main([*base, str(tmp_path / "x.txt")]) == 1
    assert "give --format parquet, csv or json" in capsys.readouterr().err
    assert cli.main([*base, str(tmp_path / "x.csv"), "--batch-rows", str(limits.MAX_BATCH_MUTATIONS + 1)]) == 1
    assert f"--batch-rows must be between 1 and {limits.MAX_BATCH_MUTATIONS}" in capsys.readouterr().err


# Last in the module: it kills a node of the module's cluster.
def test_leader_sigkill_mid_load_applies_every_row_exactly_once(cluster: Cluster, spark: SparkSession,
                                                                tmp_path: Path) -> None:
    shard = 0
    keys = [f"f/{i:05d}" for i in range(1200)]
    path = tmp_path / "failover.parquet"
    pq.write_table(pa.table({"key": keys, "value": [f"value of {k}" for k in keys]}), path)
    victim = cluster.leader(shard)
    ends = PartitionEnds(cluster.kafka.bootstrap_servers, 10)
    start = ends.high_watermark(cluster.target.topic, shard)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:  # small batches, so that the load outlasts the failover
            outcome["result"] = load.load(spark, str(path), "parquet", cluster.target, cluster.endpoints,
                                          batch_rows=2, in_flight=4)
        except BaseException as exc:
            outcome["error"] = exc

    loader = threading.Thread(target=run)
    loader.start()

    def writing() -> int:
        assert loader.is_alive(), f"the load ended before the kill: {outcome}"
        end = ends.high_watermark(cluster.target.topic, shard)
        if end < start + 40:
            raise NotYet(f"high watermark {end}")
        return end

    wait_until(writing, 60, what=f"the load to write shard {shard} (40 offsets past {start})")
    assert loader.is_alive()
    victim.stop(signal.SIGKILL)
    killed_at = ends.high_watermark(cluster.target.topic, shard)
    loader.join(120)
    assert not loader.is_alive() and "error" not in outcome, outcome.get("error")
    result: load.LoadResult = outcome["result"]
    assert result.rows == 1200 and result.applied == 1200 and result.replayed == 0 and result.duplicates == 0
    assert ends.high_watermark(cluster.target.topic, shard) > killed_at  # a new leader took the rest
    assert cluster.leader(shard).node_id != victim.node_id
    assert_loaded_once(cluster, b"f/", {k.encode(): f"value of {k}".encode() for k in keys})
    assert sum(1 for k in keys if shard_of(k.encode(), SHARDS) == shard) > 500  # ~300 batches, ~20 before the kill
    print(f"failover load: {result.keys_per_s:.0f} keys/s, {result.unknown_attempts} unknown outcomes retried, "
          f"{result.applied_on_retry} rows applied by an attempt whose answer was lost")
