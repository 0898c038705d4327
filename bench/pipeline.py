"""The Spark pipeline against its raw baselines, side by side in one run on one broker.

1. WAL read: Spark's Kafka source with W3 as a column expression (`kvstore.pipeline.wal_source`)
   against a raw read_committed confluent-kafka consumer and `wal.Replayer` (W3 in Python), over
   the same N committed records.
2. Snapshot: `snapshot_job.create` of N keys from the WAL alone, then an incremental one after
   N/10 more writes (built from the first plus the WAL since its cut).
3. Bootstrap of an empty replica, the node's own code path run in this process: the snapshot
   (`snapshot.load_into`, what `serve --snapshot-dir` runs) against the full WAL replay
   (`wal.Replayer` + `ShardStore.apply`, what a node without snapshots runs). Goal: >= 200k
   keys/s from a snapshot and >= 5x the replay.
4. Bulk load (`kvstore load`, local[2]) against the store's own batched Txn path (one Python
   client, Txns of 128 puts, as many in flight as the load's two running tasks keep), on a
   three-node dev cluster with its own broker; two rounds, alternating. Goal: >= 0.8x.

The WAL is filled with one single-put WalEntry per record (unique keys, 100-byte values, one in
ten with a request id) by guarded writers in batches of 1000. Spark runs local[2] with a 2 GiB
driver. Results: bench/results/pipeline-<profile>-<stamp>.json (and -latest-), the last stdout
line is one JSON summary.

    python bench/pipeline.py --quick     # 200k records, ~3 min on 2 cores
    python bench/pipeline.py             # 1M records
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

import wal
from kvstore import limits
from kvstore.core.sharding import shard_of
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.pipeline import snapshot_job, wal_source
from kvstore.pipeline.session import spark_session
from kvstore.pipeline.target import WalTarget
from kvstore.storage import snapshot
from kvstore.storage.shard_store import ShardStore
from wal import clients
from wal.broker import KAFKA_VERSION, LocalKafka

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
PROFILES = {"quick": 200_000, "full": 1_000_000}
SHARDS = 4
VALUE = b"v" * 100
BATCH = 1000
APPLY_CHUNK = 10_000


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def entry(i: int, now_ms: int) -> bytes:
    return pb.WalEntry(request_id=f"bench-{i}" if i % 10 == 0 else "",
                       effects=[pb.Effect(put=pb.PutEffect(key=b"k%09d" % i, value=VALUE))],
                       leader_unix_ms=now_ms).SerializeToString()


def fill(bootstrap: str, topic: str, first: int, count: int) -> float:
    """Append keys [first, first + count) to their shards' partitions; returns records/s."""
    by_shard: dict[int, list[int]] = {s: [] for s in range(SHARDS)}
    for i in range(first, first + count):
        by_shard[shard_of(b"k%09d" % i, SHARDS)].append(i)
    started = time.monotonic()

    def write(shard: int) -> None:
        config = wal.WriterConfig(bootstrap_servers=bootstrap, topic=topic, partition=shard,
                                  transactional_id=wal.shard_transactional_id(topic, shard),
                                  writer=wal.WriterIdentity("bench", 1), max_batch_records=limits.MAX_BATCH_RECORDS,
                                  max_batch_bytes=limits.MAX_BATCH_BYTES, max_record_bytes=limits.MAX_WAL_RECORD_BYTES)
        now_ms = int(time.time() * 1000)
        with wal.ShardWriter(config) as writer:
            ids = by_shard[shard]
            for start in range(0, len(ids), BATCH):
                writer.append([entry(i, now_ms) for i in ids[start:start + BATCH]])

    threads = [threading.Thread(target=write, args=(s,)) for s in range(SHARDS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return count / (time.monotonic() - started)


def raw_read(bootstrap: str, topic: str, ends: dict[int, int]) -> tuple[int, float]:
    consumer = Consumer(clients.consumer_config(bootstrap, "read_committed"))
    consumer.assign([TopicPartition(topic, s, 0) for s in range(SHARDS)])
    seen, done = 0, set()
    started = time.monotonic()
    while len(done) < SHARDS:
        for msg in consumer.consume(10_000, 1.0):
            if msg.error():
                continue
            seen += 1
            if msg.offset() + 1 >= ends[msg.partition()] - 1:
                done.add(msg.partition())
    elapsed = time.monotonic() - started
    consumer.close()
    return seen, elapsed


def replayer_read(bootstrap: str, topic: str) -> tuple[int, float]:
    started, accepted = time.monotonic(), 0
    for shard in range(SHARDS):
        replayer = wal.Replayer(bootstrap, topic, shard, 0)
        accepted += sum(1 for _ in replayer.read_to_end(600))
        replayer.close()
    return accepted, time.monotonic() - started


def replay_bootstrap(bootstrap: str, topic: str, base: Path) -> tuple[int, float]:
    """What a node without snapshots runs for an empty replica: replay and apply everything."""
    started, keys = time.monotonic(), 0
    for shard in range(SHARDS):
        store = ShardStore(base / f"replay-{shard}", topic=topic, shard=shard)
        replayer = wal.Replayer(bootstrap, topic, shard, 0)
        end = replayer.end_offset()
        chunk: list[tuple[int, bytes]] = []
        while replayer.position < end:
            for record in replayer.poll_once(0.5):
                chunk.append((record.offset, record.payload))
            if len(chunk) >= APPLY_CHUNK or (replayer.position >= end and chunk):
                store.apply(chunk, replayer.position)
                chunk = []
        keys += store.digest()[1]
        replayer.close()
        store.close()
    return keys, time.monotonic() - started


def snapshot_bootstrap(root: str, manifest: snapshot.Manifest, topic: str, base: Path) -> tuple[int, float]:
    started, keys = time.monotonic(), 0
    for shard in range(SHARDS):
        store = ShardStore(base / f"snap-{shard}", topic=topic, shard=shard)
        keys += snapshot.load_into(store, root, manifest).keys
        store.close()
    return keys, time.monotonic() - started


def shard_batches(keys: list[bytes], shards: int, size: int) -> list[list[bytes]]:
    """Keys cut into batches of one shard each, `size` at most, taken round-robin over the shards so
    that every leader has batches in flight (as the load's tasks do)."""
    by_shard: dict[int, list[bytes]] = {}
    for key in keys:
        by_shard.setdefault(shard_of(key, shards), []).append(key)
    per_shard = [[ks[i:i + size] for i in range(0, len(ks), size)] for ks in by_shard.values()]
    return [b for group in itertools.zip_longest(*per_shard) for b in group if b is not None]


def txn_baseline(endpoints: list[str], keys: list[bytes], shards: int, in_flight: int) -> float:
    """The store's own batched write path: Txns of MAX_TXN_OPS puts, `in_flight` at a time, from
    one Python client (what an application writing in bulk without Spark would do); keys/s."""
    import concurrent.futures

    from kvstore.client import Client, Op
    from kvstore.limits import MAX_TXN_OPS

    batches = shard_batches(keys, shards, MAX_TXN_OPS)
    started = time.monotonic()
    with Client(endpoints, timeout_s=60) as client, \
            concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        run = uuid.uuid4().hex[:8]  # fresh ids: a reused one would be answered as a replay, unapplied
        futures = [pool.submit(client.txn, [], [Op.put(k, VALUE) for k in batch], [], f"baseline-{run}-{n}")
                   for n, batch in enumerate(batches)]
        for future in futures:
            future.result()
    return len(keys) / (time.monotonic() - started)


def write_batch_baseline(endpoints: list[str], keys: list[bytes], batch_rows: int, in_flight: int) -> float:
    """The store's batch RPC from one Python client (`Client.put_many` of `batch_rows` keys of
    one shard each, `in_flight` at a time: what the load's tasks send, without Spark); keys/s."""
    import concurrent.futures

    from kvstore.client import Client

    batches = shard_batches(keys, SHARDS, batch_rows)
    started = time.monotonic()
    with Client(endpoints, timeout_s=60) as client, \
            concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        futures = [pool.submit(client.put_many, [(k, VALUE) for k in batch]) for batch in batches]
        for future in futures:
            future.result()
    return len(keys) / (time.monotonic() - started)


def bulk_load_section(rows: int, work: Path) -> dict[str, Any]:
    """`kvstore load` against the Txn and WriteBatch baselines on a three-node dev cluster (its own broker)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvstore.pipeline import load as bulk

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import failover  # the dev-cluster helpers of the failover bench

    args = argparse.Namespace(shards=SHARDS, session_timeout_ms=1500, keep_data=False)
    dataset = work / "load.parquet"
    pq.write_table(pa.table({"key": [f"load{i:09d}" for i in range(rows)], "value": [VALUE] * rows}), dataset)
    with failover.cluster(args) as (endpoints, _data_dir, info):
        from kvstore.client import Client

        with Client(endpoints, timeout_s=30) as client:
            topic = client.shard_map().topic
        target = WalTarget(info["kafka"], topic, SHARDS)
        spark = spark_session("local[2]", app_name="bench-pipeline-load", conf={"spark.driver.memory": "2g"})
        in_flight = 2 * bulk.IN_FLIGHT_BATCHES  # local[2]: two tasks at a time, each with IN_FLIGHT_BATCHES
        baseline = []
        batch_baseline = []
        loads = []
        for round_ in range(2):  # alternate, so a noisy neighbour hurts both
            keys = [b"txn%d-%09d" % (round_, i) for i in range(rows)]
            baseline.append(txn_baseline(endpoints, keys, SHARDS, in_flight))
            batch_keys = [b"wb%d-%09d" % (round_, i) for i in range(rows)]
            batch_baseline.append(write_batch_baseline(endpoints, batch_keys, bulk.DEFAULT_BATCH_ROWS, in_flight))
            result = bulk.load(spark, str(dataset) if round_ == 0 else str(_copy(dataset, work, round_)),
                               "parquet", target, endpoints)
            assert result.applied == rows, result
            loads.append(result.keys_per_s)
        spark.stop()
    best_load, best_txn, best_batch = max(loads), max(baseline), max(batch_baseline)
    return {"rows": rows, "load_keys_per_s": [round(x) for x in loads],
            "txn_baseline_keys_per_s": [round(x) for x in baseline], "txn_in_flight": in_flight,
            "write_batch_baseline_keys_per_s": [round(x) for x in batch_baseline],
            "load_vs_txn": round(best_load / best_txn, 2), "load_vs_write_batch": round(best_load / best_batch, 2)}


def _copy(dataset: Path, work: Path, round_: int) -> Path:
    """The same rows under other keys (a second load of the same keys would be all replays)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(dataset)
    renamed = table.set_column(0, "key", pc.binary_join_element_wise(pc.cast(table["key"], "string"),
                                                                     f"-r{round_}", ""))
    path = work / f"load-{round_}.parquet"
    pq.write_table(renamed, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{PROFILES['quick']} records instead of "
                                                             f"{PROFILES['full']}")
    parser.add_argument("--records", type=int, help="records (= keys) in the WAL")
    parser.add_argument("--load-rows", type=int, help="rows of the bulk-load comparison (default records / 2, "
                                                      "at most 300k)")
    parser.add_argument("--skip-load", action="store_true", help="leave out the bulk-load comparison")
    args = parser.parse_args(argv)
    profile = "quick" if args.quick else "full"
    n = args.records or PROFILES[profile]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    report: dict[str, Any] = {"bench": "pipeline", "profile": profile, "records": n, "shards": SHARDS,
                              "stamp": stamp, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                          "kafka": KAFKA_VERSION,
                                                          "load_avg_start": os.getloadavg()[0]}}
    wall = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-pipeline-"))
    try:
        with LocalKafka(work / "kafka", nodes=1, heap_mb=1024) as kafka:
            topic = "bench.wal"
            wal.ensure_wal_topic(kafka.bootstrap_servers, topic, SHARDS)
            log(f"filling {n} records")
            report["fill_records_per_s"] = round(fill(kafka.bootstrap_servers, topic, 0, n))
            ends = {s: clients.PartitionEnds(kafka.bootstrap_servers, 10).stable_offset(topic, s)
                    for s in range(SHARDS)}
            target = WalTarget(kafka.bootstrap_servers, topic, SHARDS)

            started = time.monotonic()
            spark = spark_session("local[2]", app_name="bench-pipeline", conf={"spark.driver.memory": "2g"})
            report["spark_session_start_s"] = round(time.monotonic() - started, 2)

            log("WAL read: Spark, raw consumer, wal.Replayer")
            started = time.monotonic()  # the first query of a session loads and JITs the Kafka source
            wal_source.judged(wal_source.read_wal(spark, kafka.bootstrap_servers, topic, {0: (0, 100)})).count()
            report["spark_first_query_s"] = round(time.monotonic() - started, 2)
            frame = wal_source.judged(wal_source.read_wal(spark, kafka.bootstrap_servers, topic,
                                                          {s: (0, e) for s, e in ends.items()}))
            spark_runs = []
            for _ in range(2):  # the first full read still warms the JIT up: report both
                started = time.monotonic()
                verdicts = {r["verdict"]: r["count"] for r in frame.groupBy("verdict").count().collect()}
                spark_runs.append(time.monotonic() - started)
            spark_s = spark_runs[-1]
            raw_n, raw_s = raw_read(kafka.bootstrap_servers, topic, ends)
            rep_n, rep_s = replayer_read(kafka.bootstrap_servers, topic)
            assert verdicts == {"accepted": n} and raw_n == n and rep_n == n, (verdicts, raw_n, rep_n)
            report["wal_read"] = {
                "spark_w3_records_per_s": round(n / spark_s), "spark_w3_first_run_records_per_s":
                round(n / spark_runs[0]), "raw_consumer_records_per_s": round(n / raw_s),
                "replayer_records_per_s": round(n / rep_s), "spark_vs_raw": round(raw_s / spark_s, 2)}

            log("snapshot of every key, then an incremental one")
            root = str(work / "snapshots")
            started = time.monotonic()
            manifest, _ = snapshot_job.create(spark, target, root)
            full_s = time.monotonic() - started
            fill(kafka.bootstrap_servers, topic, n, n // 10)
            started = time.monotonic()
            manifest2, _ = snapshot_job.create(spark, target, root)
            incr_s = time.monotonic() - started
            assert manifest2.base == manifest.name
            report["snapshot"] = {"keys": sum(s.keys for s in manifest.shards), "seconds": round(full_s, 1),
                                  "keys_per_s": round(n / full_s), "incremental_new_records": n // 10,
                                  "incremental_seconds": round(incr_s, 1),
                                  "incremental_keys": sum(s.keys for s in manifest2.shards)}
            spark.stop()

            log("bootstrap of an empty replica: snapshot vs full replay")
            keys_s, snap_s = snapshot_bootstrap(root, manifest2, topic, work / "boot")
            keys_r, replay_s = replay_bootstrap(kafka.bootstrap_servers, topic, work / "boot")
            assert keys_s == keys_r, (keys_s, keys_r)
            report["bootstrap"] = {"keys": keys_s, "snapshot_seconds": round(snap_s, 2),
                                   "snapshot_keys_per_s": round(keys_s / snap_s),
                                   "replay_seconds": round(replay_s, 2), "replay_keys_per_s": round(keys_r / replay_s),
                                   "speedup": round(replay_s / snap_s, 1)}
        if not args.skip_load:
            log("bulk load vs the store's batched Txn path, on three node processes")
            try:
                report["bulk_load"] = bulk_load_section(args.load_rows or min(n // 2, 300_000), work)
            except Exception as exc:  # recorded: the other sections' numbers still count
                report["bulk_load"] = {"error": repr(exc)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["wall_s"] = round(time.monotonic() - wall, 1)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for name in (f"pipeline-{profile}-{stamp}.json", f"pipeline-latest-{profile}.json"):
        (RESULTS_DIR / name).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
