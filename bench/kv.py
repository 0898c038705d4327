"""Store throughput and latency (Put, Get at 3 consistency levels, Txn compare-and-set) next to its limits.

A store number alone says little on a small machine where broker, server and load generator share the
cores, so every run also measures, on the same machine and broker, what the store could reach at best:
the serving limit (an empty grpc.aio KV server in its own process, same client and load), the apply
limit (raw plyvel write batches, and the store's ShardStore.apply on real WAL entries) and the replay
limit (N records in a WAL partition read back by wal.Replayer, by a raw read_committed consumer, and by
a node bootstrapping from an empty data dir). Load: one asyncio process, one coroutine per client
(concurrency = requests in flight), a few grpc.aio channels per target; empty-server and store series
alternate so a noisy neighbour hurts both. CPU of server, broker, load generator and whole machine is
sampled per series to show who the bottleneck is. The last stdout line is one JSON summary object.

    python bench/kv.py --quick      # < 4 min on 2 cores, including broker start
    python bench/kv.py              # full run, ~12 min
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import confluent_kafka
import grpc
import grpc.aio
import plyvel
from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from google.protobuf.internal import api_implementation
from grpc_health.v1 import health_pb2, health_pb2_grpc

import wal
from kvstore import limits
from kvstore.core.evaluate import evaluate_put
from kvstore.core.sharding import shard_of
from kvstore.storage.shard_store import ShardStore
from kvstore.v1 import kv_pb2, kv_pb2_grpc
from wal import clients
from wal.broker import KAFKA_VERSION, LocalKafka, free_port
from wal.replayer import REPLAY_FETCH

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR, MARKDOWN = REPO / "bench" / "results", REPO / "bench" / "kv_results.md"
CLIENTS, VALUE_SIZES, SHARDS = (1, 16, 64, 256), (100, 1024), 4
PLAN = [("empty", "put"), ("empty", "get"), ("store", "put"), ("store", "get_linearizable"),
        ("store", "get_leader_local"), ("store", "get_stale"), ("store", "txn")]
CONSISTENCY = {"get": kv_pb2.CONSISTENCY_LINEARIZABLE, "get_linearizable": kv_pb2.CONSISTENCY_LINEARIZABLE,
               "get_leader_local": kv_pb2.CONSISTENCY_LEADER_LOCAL, "get_stale": kv_pb2.CONSISTENCY_STALE}
CHANNELS = 4  # per target: 256 clients = 64 streams per HTTP/2 connection
SEED_KEYS = 256  # per value size, read by the Get series
RPC_TIMEOUT_S = 10.0
MAX_OPS_PER_SERIES = 300_000  # with the time window, bounds every client loop
APPLY_BATCHES = (16, 1000)  # ~ a store batch at 64 clients over 4 shards; MAX_BATCH_RECORDS
WRITE_BATCH = 10_000  # records per WAL transaction when filling the replay topic
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"seconds": 2.0, "warmup": 0.4, "global_warmup": 3.0, "replay_records": 50_000,
              "replay_rounds": 2, "node_rounds": 2, "apply_records": 100_000, "apply_seconds": 0.8},
    "full": {"seconds": 8.0, "warmup": 2.0, "global_warmup": 10.0, "replay_records": 200_000,
             "replay_rounds": 3, "node_rounds": 2, "apply_records": 500_000, "apply_seconds": 4.0},
}
CLK_TCK = os.sysconf("SC_CLK_TCK")
WAL_METRICS = ("kvstore_commit_latency_seconds_sum", "kvstore_commit_latency_seconds_count",
               "kvstore_batch_records_sum")
Row = dict[str, Any]
Proc = subprocess.Popen[bytes]


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest rank: with fewer than 1000 samples p99.9 is simply the worst one, which is honest."""
    return sorted_values[max(1, math.ceil(q / 100 * len(sorted_values))) - 1] if sorted_values else None


def counters(pids: dict[str, int | None], metrics_port: int | None) -> dict[str, float]:
    """Monotonic counters read at both ends of a window: CPU seconds per process (all threads: gRPC,
    librdkafka, JVM), of the whole machine (neighbours included: this box may be shared), and the
    node's WAL commit histograms (summed over shards), which show batch sizes and commit times."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError, TypeError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    out["machine"] = (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK
    if metrics_port:  # a missing scrape leaves the WAL columns empty, it does not fail the series
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                                                  timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if (name := line.split("{", 1)[0]) in WAL_METRICS:
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class EmptyKV(kv_pb2_grpc.KVServiceServicer):
    """The serving limit: gRPC + protobuf + asyncio and nothing else."""

    async def Put(self, request: kv_pb2.PutRequest, context: Any) -> kv_pb2.PutResponse:
        return kv_pb2.PutResponse()

    async def Get(self, request: kv_pb2.GetRequest, context: Any) -> kv_pb2.GetResponse:
        return kv_pb2.GetResponse()


async def serve_empty(address: str, servicer: kv_pb2_grpc.KVServiceServicer | None = None) -> None:
    """Runs in its own process like the store, so it does not share the load generator's GIL."""
    server = grpc.aio.server()
    kv_pb2_grpc.add_KVServiceServicer_to_server(servicer or EmptyKV(), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(address)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await server.start()
    await stop.wait()
    await server.stop(1)


def start_node(kafka: str, data_dir: Path, cluster: str, shards: int, log: Path,
               metrics_port: int = 0, node_id: str = "node-1", extra: tuple[str, ...] = ()) -> tuple[Proc, str]:
    """A store node exactly as an operator starts it (`python -m kvstore.server`). Nodes of one
    cluster need distinct `node_id`s: the id is the node's static member id in the leadership group."""
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "kvstore.server", "--kafka", kafka, "--data-dir", str(data_dir),
           "--listen", address, "--cluster", cluster, "--shards", str(shards), "--log-format", "text",
           "--metrics-port", str(metrics_port), "--node-id", node_id, *extra]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc, address


def wait_serving(proc: Proc, address: str, timeout_s: float) -> None:
    """Until health says SERVING (every shard bootstrapped), as tests/integration/store_process.py."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                reply = health.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVService"), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.02)
    raise RuntimeError(f"node {address} not SERVING after {timeout_s}s (exit code {proc.poll()})")


def stop_proc(proc: Proc) -> None:
    """SIGTERM (a node finishes its batch in flight), SIGKILL if it hangs."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def log_problems(log: Path) -> list[str]:
    """Warnings and errors the node logged: a benchmark that hides server errors is worthless."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]


def seed_key(size: int, j: int) -> bytes:
    return f"seed/{size}/{j}".encode()


def caller(op: str, stub: Any, client: int, value: bytes, tag: str) -> Callable[[int], Awaitable[bool]]:
    """Client `client`'s request n; returns False for a wrong answer (key not found, CAS lost)."""
    if op == "put":
        async def put(n: int) -> bool:
            key = f"{tag}/{client}/{n % 16}".encode()  # crc32 spreads these over the shards
            await stub.Put(kv_pb2.PutRequest(key=key, value=value), timeout=RPC_TIMEOUT_S)
            return True
        return put
    if op == "txn":
        key, version = f"{tag}/{client}".encode(), 0  # a fresh key per client and series: version 0
        compare = kv_pb2.Compare(key=key, target=kv_pb2.Compare.TARGET_VERSION, op=kv_pb2.Compare.OP_EQUAL)
        request = kv_pb2.TxnRequest(compares=[compare], success=[kv_pb2.TxnOp(put=kv_pb2.PutRequest(
            key=key, value=value))], failure=[kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=key))])

        async def txn(n: int) -> bool:
            nonlocal version
            request.compares[0].version = version
            resp = await stub.Txn(request, timeout=RPC_TIMEOUT_S)
            result = resp.results[0]  # a lost CAS answers the current version: resync
            version = result.put.version if resp.succeeded else result.get.kv.version
            return bool(resp.succeeded)
        return txn
    read, size = kv_pb2.ReadOptions(consistency=CONSISTENCY[op]), len(value)

    async def get(n: int) -> bool:
        key = seed_key(size, (client * 31 + n) % SEED_KEYS)
        return bool((await stub.Get(kv_pb2.GetRequest(key=key, read=read), timeout=RPC_TIMEOUT_S)).found)
    return get


async def run_series(stubs: list[Any], target: str, op: str, size: int, clients_n: int, seconds: float,
                     warmup: float, pids: dict[str, int | None], metrics_port: int | None) -> Row:
    """`clients_n` coroutines in a closed loop; only requests started inside the window count."""
    latencies: list[float] = []
    value, errors, first_errors = os.urandom(size), collections.Counter[str](), list[str]()
    wrong, start = 0, time.perf_counter()
    window_start, window_end = start + warmup, start + warmup + seconds
    tag = f"{op}/{size}/{clients_n}/{uuid.uuid4().hex[:6]}"

    async def client(i: int) -> None:
        nonlocal wrong
        call = caller(op, stubs[i % len(stubs)], i, value, tag)
        for n in range(math.ceil(MAX_OPS_PER_SERIES / clients_n)):
            started = time.perf_counter()
            if started >= window_end:
                return
            try:
                ok = await call(n)
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] += 1
                if len(first_errors) < 5:
                    first_errors.append(f"{exc.code().name}: {exc.details()}")
                await asyncio.sleep(0.01)  # never spin on a failing server
                continue
            if started >= window_start:
                latencies.append(time.perf_counter() - started)
                wrong += not ok

    async def sample() -> Row:
        await asyncio.sleep(max(0.0, window_start - time.perf_counter()))
        before, t0 = await asyncio.to_thread(counters, pids, metrics_port), time.perf_counter()
        await asyncio.sleep(max(0.0, window_end - time.perf_counter()))
        after, wall = await asyncio.to_thread(counters, pids, metrics_port), time.perf_counter() - t0
        delta = {k: after[k] - v for k, v in before.items() if k in after}
        out: Row = {"cpu_percent": {k: round(100 * delta[k] / wall, 1) if k in delta else None
                                    for k in (*pids, "machine")}}
        if batches := delta.get("kvstore_commit_latency_seconds_count"):  # store writes only
            out.update(wal_batches=int(batches), mean_batch_records=round(
                delta["kvstore_batch_records_sum"] / batches, 1), mean_commit_ms=round(
                1000 * delta["kvstore_commit_latency_seconds_sum"] / batches, 2))
        return out

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(client(i) for i in range(clients_n)))
    values = sorted(latencies)
    ms = {f"{name}_ms": None if (p := percentile(values, q)) is None else round(p * 1000, 3)
          for name, q in (("p50", 50), ("p99", 99), ("p999", 99.9))}
    return {"target": target, "op": op, "value_bytes": size, "clients": clients_n, "ops": len(values),
            "ops_per_s": round(len(values) / seconds, 1), **ms, "errors": dict(errors),
            "first_errors": first_errors, "wrong_answers": wrong, **(await sampler)}


async def load_phase(addresses: dict[str, str], pids: dict[str, dict[str, int | None]],
                     metrics_ports: dict[str, int | None], profile: dict[str, Any]) -> list[Row]:
    """Seed the Get keys, warm both targets, then every (value size, clients) point along PLAN."""
    options = [("grpc.use_local_subchannel_pool", 1)]  # else all channels share one connection
    channels = {t: [grpc.aio.insecure_channel(a, options=options) for _ in range(CHANNELS)]
                for t, a in addresses.items()}
    try:
        for chans in channels.values():
            await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in chans)), 30)
        stubs = {t: [kv_pb2_grpc.KVServiceStub(c) for c in chans] for t, chans in channels.items()}  # type: ignore[no-untyped-call]
        seeds = [(size, j) for size in VALUE_SIZES for j in range(SEED_KEYS)]
        assert {shard_of(seed_key(*s), SHARDS) for s in seeds} == set(range(SHARDS)), "seeds miss a shard"
        await asyncio.gather(*(stubs["store"][j % CHANNELS].Put(kv_pb2.PutRequest(
            key=seed_key(size, j), value=os.urandom(size)), timeout=RPC_TIMEOUT_S) for size, j in seeds))
        for target in addresses:  # JIT the broker, fill gRPC's pools: not measured
            await run_series(stubs[target], target, "put", 100, 16, profile["global_warmup"], 0, pids[target],
                             metrics_ports[target])
        results: list[Row] = []
        for size in VALUE_SIZES:
            for clients_n in CLIENTS:
                for target, op in PLAN:
                    results.append(row := await run_series(stubs[target], target, op, size, clients_n,
                                                           profile["seconds"], profile["warmup"], pids[target],
                                                           metrics_ports[target]))
                    print(f"# {target:5} {op:16} {size:>5} B {clients_n:>3} clients {row['ops_per_s']:>8,.0f}/s "
                          f"p99 {row['p99_ms']} ms errors {row['errors']} cpu {row['cpu_percent']} "
                          f"batch {row.get('mean_batch_records')} commit {row.get('mean_commit_ms')} ms",
                          file=sys.stderr, flush=True)
        return results
    finally:
        for chans in channels.values():
            for channel in chans:
                await channel.close()


def run_load(bootstrap: str, tmp: Path, profile: dict[str, Any], broker_pid: int | None,
             run_id: str) -> tuple[list[Row], Row]:
    """A 4-shard node and the empty server, both up for the whole load phase, always stopped."""
    procs: list[Proc] = []
    try:
        started = time.perf_counter()
        metrics_port = free_port()
        node, node_address = start_node(bootstrap, tmp / "node", f"kvb{run_id}", SHARDS, tmp / "node.log",
                                        metrics_port)
        empty_address = f"127.0.0.1:{free_port()}"
        procs += [node, subprocess.Popen([sys.executable, __file__, "--serve-empty", empty_address], cwd=REPO)]
        wait_serving(node, node_address, 120)
        node_start_s = time.perf_counter() - started
        pids = {t: {"server": p.pid, "broker": broker_pid, "loadgen": os.getpid()}
                for t, p in (("store", node), ("empty", procs[1]))}
        results = asyncio.run(load_phase({"empty": empty_address, "store": node_address}, pids,
                                         {"empty": None, "store": metrics_port}, profile))
    finally:
        for proc in reversed(procs):
            stop_proc(proc)
    problems = log_problems(tmp / "node.log")
    return results, {"start_to_serving_s": round(node_start_s, 3), "log_problems": len(problems),
                     "first_log_problems": problems[:5]}


def scattered_key(i: int) -> bytes:
    """Distinct keys in no particular order (store keys are not appended in sorted order)."""
    return b"%08x" % ((i * 2654435761) & 0xFFFFFFFF)


def wal_entry(key: bytes, value: bytes, revision: int) -> bytes:
    """A WAL payload exactly as the leader builds it for a Put (effects + stored response)."""
    entry = evaluate_put(kv_pb2.PutRequest(key=key, value=value), lambda _: None, 0, revision).entry
    assert entry is not None
    return entry.SerializeToString()


def apply_phase(tmp: Path, profile: dict[str, Any]) -> list[Row]:
    """Raw plyvel WriteBatch vs ShardStore.apply (decode, transition, request table, checkpoint)."""
    rows: list[Row] = []
    for size in VALUE_SIZES:
        value = os.urandom(size)
        for batch in APPLY_BATCHES:
            for kind in ("plyvel", "store_apply"):
                path = tmp / f"{kind}-{size}-{batch}"
                path.parent.mkdir(parents=True, exist_ok=True)
                db = plyvel.DB(str(path), create_if_missing=True) if kind == "plyvel" else None
                store = ShardStore(path, topic="bench", shard=0) if db is None else None
                busy, n, deadline = 0.0, 0, time.perf_counter() + profile["apply_seconds"]
                while n < profile["apply_records"] and time.perf_counter() < deadline:
                    ids = range(n, n + batch)  # building payloads is the leader's cost, not apply's
                    records = [(i, wal_entry(scattered_key(i), value, i)) for i in ids] if store else []
                    started = time.perf_counter()
                    if store is not None:
                        store.apply(records, n + batch)
                    elif db is not None:
                        with db.write_batch() as wb:
                            for i in ids:
                                wb.put(b"d" + scattered_key(i), value)
                    busy, n = busy + time.perf_counter() - started, n + batch
                (db or store).close()  # type: ignore[union-attr]
                rows.append({"kind": kind, "value_bytes": size, "batch": batch, "records": n,
                             "records_per_s": round(n / busy, 1)})
    return rows


def fill_topic(bootstrap: str, cluster: str, records: int, value: bytes) -> int:
    """`records` Put entries into shard 0 through the guarded writer, in big batches; returns the end."""
    topic = f"{cluster}.wal"
    writer = wal.ShardWriter(wal.WriterConfig(bootstrap, topic, 0, wal.shard_transactional_id(topic, 0),
                                              wal.WriterIdentity("bench"), max_batch_records=WRITE_BATCH,
                                              max_batch_bytes=64 << 20, max_record_bytes=limits.MAX_WAL_RECORD_BYTES))
    try:
        upcoming = writer.fence()
        for first in range(0, records, WRITE_BATCH):
            payloads = [wal_entry(scattered_key(i), value, upcoming + i - first)
                        for i in range(first, min(records, first + WRITE_BATCH))]
            upcoming = writer.append(payloads, upcoming).upcoming_offset
        return upcoming
    finally:
        writer.close()


def read_back(bootstrap: str, topic: str, end: int, records: int, replayer: bool) -> Row:
    """Read the partition to its end: through wal.Replayer (read_committed + acceptance rule W3, the
    store's replay path) or through a raw consumer with the same settings and no per-record work."""
    started, first, count, deadline = time.perf_counter(), 0.0, 0, time.monotonic() + 120
    if replayer:
        with wal.Replayer(bootstrap, topic, 0, 0) as reader:
            for _ in reader.read_to_end(timeout_s=120):
                count += 1
                first = first or time.perf_counter()
    else:
        # The replayer's own fetch settings (REPLAY_FETCH: no 1 s queue backoff), so the baseline
        # is the consumer at its best, not one that stalls in some rounds.
        consumer = Consumer(clients.consumer_config(bootstrap, "read_committed", REPLAY_FETCH))
        position = 0
        consumer.assign([TopicPartition(topic, 0, 0)])
        try:
            while position < end and time.monotonic() < deadline:
                for msg in consumer.consume(5000, timeout=0.5):
                    if (err := msg.error()) is None:
                        count, position = count + 1, (msg.offset() or 0) + 1
                        first = first or time.perf_counter()
                    elif err.code() == KafkaError._PARTITION_EOF:
                        position = max(position, msg.offset() or 0)
        finally:
            consumer.close()
    seconds = time.perf_counter() - started
    assert count == records, f"read {count} of {records} records"
    return {"reader": "wal.Replayer" if replayer else "raw consumer", "records": count,
            "seconds": round(seconds, 3), "first_record_s": round(first - started, 3),
            "records_per_s": round(count / seconds, 1)}


_LEADING = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*shard 0: leading at offset (\d+)", re.M)


def node_bootstrap(bootstrap: str, cluster: str, tmp: Path, end: int) -> Row:
    """A 1-shard node with an empty data dir on `cluster`: time to 'leading' (from its log: ms resolution,
    health is refreshed only every 0.2 s) and to SERVING. Includes interpreter start and fencing."""
    log, started_wall, started = tmp / f"{cluster}.log", time.time(), time.perf_counter()
    proc, address = start_node(bootstrap, tmp / f"{cluster}-data", cluster, 1, log)
    try:
        wait_serving(proc, address, 180)
        serving_s = time.perf_counter() - started
    finally:
        stop_proc(proc)
    match = _LEADING.search(text := log.read_text(errors="replace"))
    assert match and int(match.group(2)) == end, f"node did not lead at offset {end}: {text[-2000:]}"
    leading = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return {"cluster": cluster, "end_offset": end, "to_leading_s": round(leading - started_wall, 3),
            "to_serving_s": round(serving_s, 3), "log_problems": log_problems(log)[:5]}


def replay_phase(bootstrap: str, tmp: Path, profile: dict[str, Any], run_id: str) -> Row:
    """Fill one partition, read it back both ways in alternating rounds, then time node bootstraps:
    node rate = records / (time to leading with the full WAL - time to leading with an empty WAL)."""
    records, full, empty = profile["replay_records"], f"rpf{run_id}", f"rpe{run_id}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(f"{c}.wal", 1) for c in (full, empty)]).values():
        future.result(30)
    started = time.perf_counter()
    end = fill_topic(bootstrap, full, records, os.urandom(VALUE_SIZES[0]))
    write_s = time.perf_counter() - started
    reads = [read_back(bootstrap, f"{full}.wal", end, records, replayer)
             for _ in range(profile["replay_rounds"]) for replayer in (True, False)]
    nodes = [node_bootstrap(bootstrap, cluster, tmp / f"r{n}", at)
             for n in range(profile["node_rounds"]) for cluster, at in ((empty, 0), (full, end))]
    best = {r: max(x["records_per_s"] for x in reads if x["reader"] == r) for r in ("wal.Replayer", "raw consumer")}
    extra = (min(x["to_leading_s"] for x in nodes if x["end_offset"])
             - min(x["to_leading_s"] for x in nodes if not x["end_offset"]))
    return {"records": records, "value_bytes": VALUE_SIZES[0], "end_offset": end, "write_s": round(write_s, 3),
            "reads": reads, "node_starts": nodes, "replayer_records_per_s": best["wal.Replayer"],
            "raw_consumer_records_per_s": best["raw consumer"], "node_bootstrap_extra_s": round(extra, 3),
            "node_bootstrap_records_per_s": round(records / extra, 1) if extra > 0 else None}


def plot(results: list[Row], path: Path, title: str) -> None:
    """Throughput and p99 against clients, log-log; one line per op/consistency/value size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ("black", "grey", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")  # along PLAN
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5))
    series: dict[tuple[int, int], list[Row]] = collections.defaultdict(list)
    for row in results:
        series[PLAN.index((row["target"], row["op"])), row["value_bytes"]].append(row)
    for (plan, size), rows in sorted(series.items()):
        target, op = PLAN[plan]
        name = f"{'empty server' if target == 'empty' else 'store'} {op} {'1 KiB' if size > 100 else '100 B'}"
        style = {"color": colors[plan], "linestyle": "-" if size == 100 else "--", "linewidth": 1.6,
                 "marker": "s" if target == "empty" else "o", "label": name}
        for ax, key in zip(axes, ("ops_per_s", "p99_ms"), strict=True):
            ax.plot([r["clients"] for r in rows], [r[key] for r in rows], **style)
    for ax, ylabel in zip(axes, ("throughput (requests/s)", "p99 latency (ms)"), strict=True):
        ax.set(xscale="log", yscale="log", xlabel="concurrent clients (requests in flight)", ylabel=ylabel)
        ax.set_xticks(CLIENTS, [str(c) for c in CLIENTS])
        ax.grid(True, which="both", alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=7, fontsize=8.5)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.12, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    def cell(v: Any) -> str:
        big = (isinstance(v, float) and v >= 100) or (isinstance(v, int) and v >= 10_000)
        return f"{v:,.0f}" if big else str(v)
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(map(cell, row)) + " |" for row in rows), ""]


def markdown(r: Row) -> str:
    """Tables for bench/README.md; an `## Analysis` section already in the file is kept (written by hand)."""
    m, rp = r["machine"], r["replay"]
    ratio, rate = r["put_64_clients_vs_empty_server_ratio"], r["replay_records_per_s"]
    cpu_keys = ("server", "broker", "loadgen", "machine")
    lines = [f"# kvstore benchmark: `bench/kv.py --{r['profile']}` at {r['utc']}", "",
             f"{m['nproc']} cores ({m['platform']}), load average at start {m['loadavg_at_start']}; Python "
             f"{m['python']}, grpcio {m['grpc']} (protobuf {m['protobuf_impl']}), confluent-kafka "
             f"{m['confluent_kafka']} / librdkafka {m['librdkafka']}, Kafka {m['kafka']} (one local KRaft node); "
             f"one store node, {SHARDS} shards. Windows of {r['series_seconds']} s after {r['warmup_seconds']} s "
             "warm-up; a p99.9 of fewer than 1000 samples is the maximum.", "", "## Expectations", "",
             f"- Put at 64 clients >= 0.5x the empty server's QPS: **{'held' if ratio >= 0.5 else 'did not hold'}** "
             f"({ratio} with 100 B values, {r['put_64_clients_vs_empty_server_ratio_1KiB']} with 1 KiB).",
             f"- Replay >= 200k records/s: **{'held' if rate >= 200_000 else 'did not hold'}** ({rate:,.0f}/s, "
             f"{r['replay_source']}; wal.Replayer {rp['replayer_records_per_s']:,.0f}/s; raw read_committed "
             f"consumer {rp['raw_consumer_records_per_s']:,.0f}/s; {rp['records']:,} records, 100 B values).", "",
             "## Throughput and latency", "",
             "CPU: percent of one core (200 = the whole machine) used by the server / broker / load generator / "
             "the whole machine (neighbours included) during the window. WAL batch: mean records per WAL "
             "transaction and mean append+commit time, from the node's metrics (store writes only).", ""]
    lines += table(("target", "op", "value B", "clients", "req/s", "p50 ms", "p99 ms", "p99.9 ms", "errors", "CPU",
                    "WAL batch / commit ms"),
                   ((x["target"], x["op"], x["value_bytes"], x["clients"], x["ops_per_s"], x["p50_ms"], x["p99_ms"],
                     x["p999_ms"], sum(x["errors"].values()) + (x["wrong_answers"] if x["target"] == "store" else 0),
                     "/".join("-" if x["cpu_percent"].get(k) is None else f"{x['cpu_percent'][k]:.0f}"
                              for k in cpu_keys),
                     f"{x['mean_batch_records']} / {x['mean_commit_ms']}" if "wal_batches" in x else "")
                    for x in r["results"]))
    lines += ["## Apply limit (LevelDB in one process: no gRPC, no Kafka)", ""]
    lines += table(("writer", "value B", "records per batch", "records/s"),
                   ((a["kind"], a["value_bytes"], a["batch"], a["records_per_s"]) for a in r["apply"]))
    lines += [f"## Replay ({rp['records']:,} records of 100 B values, one partition, written in {rp['write_s']} s "
              f"in transactions of {WRITE_BATCH:,})", ""]
    lines += table(("reader", "records", "seconds", "first record after s", "records/s"),
                   ((x["reader"], x["records"], x["seconds"], x["first_record_s"], x["records_per_s"])
                    for x in rp["reads"]))
    lines += table(("node start, 1 shard, empty data dir", "WAL end offset", "to leading s", "to SERVING s"),
                   ((n["cluster"], n["end_offset"], n["to_leading_s"], n["to_serving_s"]) for n in rp["node_starts"]))
    lines += [f"Node bootstrap: {rp['node_bootstrap_extra_s']} s more than with an empty WAL = "
              f"{rp['node_bootstrap_records_per_s'] or 0:,.0f} records/s.", ""]
    old = MARKDOWN.read_text() if MARKDOWN.exists() else ""
    return "\n".join(lines) + (old[old.index("## Analysis"):] if "## Analysis" in old else "")


@contextlib.contextmanager
def broker(tmp: Path) -> Iterator[tuple[str, int | None]]:
    """A private single-node broker (its pid for CPU accounting), always stopped."""
    kafka = LocalKafka(data_dir=tmp / "kafka", nodes=1)
    try:
        kafka.start()
        yield kafka.bootstrap_servers, kafka._procs[0].pid
    finally:
        kafka.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 s windows, 50k replay records (< 4 min)")
    parser.add_argument("--serve-empty", metavar="HOST:PORT", help=argparse.SUPPRESS)
    parser.add_argument("--render", metavar="JSON", type=Path,
                        help="only redo the markdown and the plot of a recorded run (bench/results/kv-*.json)")
    args = parser.parse_args(argv)
    if args.serve_empty:
        asyncio.run(serve_empty(args.serve_empty))
        return 0
    if args.render:
        render(json.loads(args.render.read_text()))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through the finally blocks
    profile_name = "quick" if args.quick else "full"
    profile, run_id, wall = PROFILES[profile_name], uuid.uuid4().hex[:8], time.monotonic()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    info = {"nproc": len(os.sched_getaffinity(0)), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "platform": platform.platform(), "grpc": grpc.__version__,
            "protobuf_impl": api_implementation.Type(), "plyvel": plyvel.__version__,
            "confluent_kafka": importlib.metadata.version("confluent-kafka"),
            "librdkafka": confluent_kafka.libversion()[0], "kafka": KAFKA_VERSION}
    with tempfile.TemporaryDirectory(prefix="bench-kv-") as tmp_name:
        tmp = Path(tmp_name)
        apply = apply_phase(tmp / "apply", profile)
        with broker(tmp) as (bootstrap, broker_pid):
            print(f"# apply done, broker up after {time.monotonic() - wall:.0f}s", file=sys.stderr, flush=True)
            results, node = run_load(bootstrap, tmp, profile, broker_pid, run_id)
            replay = replay_phase(bootstrap, tmp, profile, run_id)
    put64 = {(r["target"], r["value_bytes"]): r["ops_per_s"] for r in results
             if r["op"] == "put" and r["clients"] == 64}
    ratios = [round(put64["store", s] / put64["empty", s], 3) if put64["empty", s] else 0.0 for s in VALUE_SIZES]
    summary = {"bench": "kv", "profile": profile_name, "utc": stamp,
               "put_64_clients_vs_empty_server_ratio": ratios[0],
               "put_64_clients_vs_empty_server_ratio_1KiB": ratios[1],
               "put_64_clients_per_s": put64["store", 100], "empty_server_put_64_clients_per_s": put64["empty", 100],
               "replay_records_per_s": replay["node_bootstrap_records_per_s"] or replay["replayer_records_per_s"],
               "replay_source": "node bootstrap" if replay["node_bootstrap_records_per_s"] else "wal.Replayer",
               "replayer_records_per_s": replay["replayer_records_per_s"],
               "raw_consumer_records_per_s": replay["raw_consumer_records_per_s"],
               "rpc_errors": sum(sum(r["errors"].values()) for r in results),
               "wrong_answers": sum(r["wrong_answers"] for r in results if r["target"] == "store"),
               "node_log_problems": node["log_problems"], "wall_seconds": round(time.monotonic() - wall, 1)}
    report = {**summary, "series_seconds": profile["seconds"], "warmup_seconds": profile["warmup"],
              "machine": info, "node": node, "results": results, "apply": apply, "replay": replay}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for name in (f"kv-{profile_name}-{stamp}.json", f"kv-latest-{profile_name}.json"):
        (RESULTS_DIR / name).write_text(json.dumps(report, indent=2) + "\n")
    render(report)
    print(json.dumps(summary))
    return 0


def render(report: dict[str, Any]) -> None:
    """The markdown tables, then the plot: the tables do not need matplotlib (the `bench` extra)."""
    MARKDOWN.write_text(markdown(report))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"# no plot: matplotlib is missing (pip install -e '.[bench]', or `make bench-quick`); "
              f"then: python bench/kv.py --render bench/results/kv-latest-{report['profile']}.json", file=sys.stderr)
        return
    plot(report["results"], RESULTS_DIR / f"kv-{report['profile']}.png",
         f"bench/kv.py --{report['profile']} at {report['utc']}: {report['machine']['nproc']} cores shared by "
         f"broker, store ({SHARDS} shards) and load generator")


if __name__ == "__main__":
    sys.exit(main())
