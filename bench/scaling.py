"""How the store scales on this machine: throughput against shards (1, 4, 16) and against nodes (1, 3).

Each configuration gets its own single-node Kafka and fresh store nodes (`python -m kvstore.server`, as
an operator starts them). The load generator is bench/peer.py's (raw bytes, closed loop, 64 clients by
default), but every client writes keys of one shard and sends them to that shard's leader (from
`ClusterService.ShardMap`), so with 3 nodes each node serves the shards it leads and nothing is redirected.
Two loads: `put` (one key per request) and `wbatch` (WriteBatch of 100 puts of one shard). CPU seconds of
every node and of the broker are sampled per series, with the WAL transactions the nodes committed, so
the per-shard costs (node CPU per write and per WAL transaction, broker CPU per WAL transaction) that
the estimate in bench/README.md ("How it scales") is built from are measured here, not guessed.

    python bench/scaling.py --quick   # ~4 min: shards 1/4/16 on one node, nodes 1/3 with 4 shards
    python bench/scaling.py           # longer windows
    python bench/scaling.py --placement --quick   # 10 shards on 1, 3 and 5 nodes with R = 1 and 2 (~6 min)

`--placement` (issue 20, docs/design.md §9): each shard on R of the nodes. Per configuration, besides
throughput: every node's CPU while it runs (the nodes that hold a shard apply its writes, the others
hold nothing of it), its shards, and its data directory's size after the load, against R/N.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from kvstore.core.sharding import shard_of
from kvstore.v1 import cluster_pb2, cluster_pb2_grpc, kv_pb2
from wal.broker import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv as kvbench  # bench/kv.py: broker, node start, CPU counters
import peer  # bench/peer.py: processes(), log()

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
LOADS = ("put", "wbatch")
BATCH, VALUE_BYTES, RPC_TIMEOUT_S, START_TIMEOUT_S = 100, 100, 10.0, 180
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"clients": 64, "seconds": 4.0, "warmup": 1.0},
    "full": {"clients": 64, "seconds": 10.0, "warmup": 2.0},
}
# (label, nodes, shards)
CONFIGS = (("1 node, 1 shard", 1, 1), ("1 node, 4 shards", 1, 4), ("1 node, 16 shards", 1, 16),
           ("3 nodes, 4 shards", 3, 4))
# --placement: (label, nodes, shards, replication factor). R = 3 on 3 nodes is the default cluster.
PLACEMENT_SHARDS = 10
PLACEMENT_CONFIGS = (("1 node, R 1", 1, PLACEMENT_SHARDS, 1), ("3 nodes, R 1", 3, PLACEMENT_SHARDS, 1),
                     ("3 nodes, R 2", 3, PLACEMENT_SHARDS, 2), ("5 nodes, R 1", 5, PLACEMENT_SHARDS, 1),
                     ("5 nodes, R 2", 5, PLACEMENT_SHARDS, 2))
PLACEMENT_GRACE_MS = 3000  # short: the first nodes' extra copies are dropped soon after the start
Row = dict[str, Any]


def keys_of(shard: int, shards: int, tag: str, n: int) -> list[bytes]:
    out: list[bytes] = []
    j = 0
    while len(out) < n:
        if shard_of(key := f"s/{tag}/{j}".encode(), shards) == shard:
            out.append(key)
        j += 1
    return out


def leaders(addresses: list[str], shards: int, timeout_s: float) -> dict[int, str]:
    """Every shard's leader address, once every shard has one (the group settled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with grpc.insecure_channel(addresses[0]) as channel, contextlib.suppress(grpc.RpcError):
            stub: Any = cluster_pb2_grpc.ClusterServiceStub(channel)  # type: ignore[no-untyped-call]
            smap = stub.ShardMap(cluster_pb2.ShardMapRequest(), timeout=5)
            found = {s.shard: s.leader for s in smap.shards if s.leader}
            if len(found) == shards and set(found.values()) <= set(addresses):
                return found
        time.sleep(0.5)
    raise RuntimeError(f"not every shard of {shards} had a leader within {timeout_s} s")


async def run_series(load: str, leader_of: dict[int, str], shards: int, clients: int, seconds: float,
                     warmup: float, pids: dict[str, int | None], metrics_ports: list[int]) -> Row:
    """Closed loop: client i writes keys of shard i % shards to that shard's leader."""
    tag, value = uuid.uuid4().hex[:8], os.urandom(VALUE_BYTES)
    channels = {address: grpc.aio.insecure_channel(address) for address in set(leader_of.values())}
    method = "/kvstore.v1.KVService/Put" if load == "put" else "/kvstore.v1.KVService/WriteBatch"
    calls = {address: channel.unary_unary(method) for address, channel in channels.items()}
    start = time.perf_counter()
    window_start, window_end = start + warmup, start + warmup + seconds
    done, errors = 0, collections.Counter[str]()

    def requests(client: int) -> list[bytes]:
        shard = client % shards
        keys = keys_of(shard, shards, f"{tag}/{client}", BATCH if load == "wbatch" else 16)
        if load == "put":
            return [kv_pb2.PutRequest(key=k, value=value).SerializeToString() for k in keys]
        part = kv_pb2.ShardMutations(shard=shard, mutations=[kv_pb2.Mutation(key=k, value=value) for k in keys])
        return [kv_pb2.WriteBatchRequest(shards=[part]).SerializeToString()]

    async def client(i: int) -> None:
        nonlocal done
        call, bodies, n = calls[leader_of[i % shards]], requests(i), 0
        while (started := time.perf_counter()) < window_end:
            try:
                await call(bodies[n % len(bodies)], timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] += 1
                await asyncio.sleep(0.01)
                continue
            n += 1
            if started >= window_start:
                done += 1

    async def counters() -> dict[str, float]:
        total: dict[str, float] = {}
        for port in metrics_ports:
            for k, v in (await asyncio.to_thread(kvbench.counters, {}, port)).items():
                if k != "machine":
                    total[k] = total.get(k, 0.0) + v
        cpu = await asyncio.to_thread(kvbench.counters, pids, None)
        return {**total, **cpu}

    async def sample() -> dict[str, float]:
        await asyncio.sleep(max(0.0, window_start - time.perf_counter()))
        before, t0 = await counters(), time.perf_counter()
        await asyncio.sleep(max(0.0, window_end - time.perf_counter()))
        after = await counters()
        wall = time.perf_counter() - t0
        return {k: (after[k] - v) / (wall if k in (*pids, "machine") else 1.0) for k, v in before.items()
                if k in after}

    try:
        sampler = asyncio.ensure_future(sample())
        await asyncio.gather(*(client(i) for i in range(clients)))
        delta = await sampler
    finally:
        for channel in channels.values():
            await channel.close()
    per_s = done / seconds
    writes_per_s = per_s * (BATCH if load == "wbatch" else 1)
    txns = delta.get("kvstore_commit_latency_seconds_count", 0.0)
    nodes_cpu = sum(v for k, v in delta.items() if k.startswith("node"))
    row: Row = {"load": load, "requests_per_s": round(per_s, 1), "keys_per_s": round(writes_per_s, 1),
                "errors": dict(errors), "cpu_cores": {k: round(v, 2) for k, v in delta.items()
                                                       if k in (*pids, "machine")},
                "wal_txns_per_s": round(txns / seconds, 1)}
    if txns:
        row["records_per_txn"] = round(delta["kvstore_batch_records_sum"] / txns, 1)
        row["mean_commit_ms"] = round(1000 * delta["kvstore_commit_latency_seconds_sum"] / txns, 2)
        row["node_cpu_ms_per_txn"] = round(1000 * nodes_cpu / (txns / seconds), 3)
        row["broker_cpu_ms_per_txn"] = round(1000 * delta.get("broker", 0.0) / (txns / seconds), 3)
    if writes_per_s:
        row["node_cpu_us_per_key"] = round(1e6 * nodes_cpu / writes_per_s, 1)
        row["broker_cpu_us_per_key"] = round(1e6 * delta.get("broker", 0.0) / writes_per_s, 1)
    return row


def placed(addresses: list[str], timeout_s: float) -> dict[str, list[int]]:
    """Once every shard is held by exactly its placed nodes (no learner, no extra copy): node id ->
    the shards it holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with grpc.insecure_channel(addresses[0]) as channel, contextlib.suppress(grpc.RpcError):
            stub: Any = cluster_pb2_grpc.ClusterServiceStub(channel)  # type: ignore[no-untyped-call]
            smap = stub.ShardMap(cluster_pb2.ShardMapRequest(), timeout=5)
            if len(smap.nodes) == len(addresses) and all(
                    s.placed_on and {(r.node_id, r.state, r.in_group) for r in s.replicas} ==
                    {(n, cluster_pb2.REPLICA_STATE_REPLICA, True) for n in s.placed_on} for s in smap.shards):
                held: dict[str, list[int]] = collections.defaultdict(list)
                for s in smap.shards:
                    for node in s.placed_on:
                        held[node].append(s.shard)
                return dict(held)
        time.sleep(0.5)
    raise RuntimeError(f"placement did not settle within {timeout_s} s")


def run_config(label: str, nodes: int, shards: int, profile: dict[str, Any], tmp: Path, rf: int | None = None) -> Row:
    cluster = f"sc{uuid.uuid4().hex[:8]}"
    extra = ("--replication-factor", str(rf), "--placement-grace-ms", str(PLACEMENT_GRACE_MS)) if rf else ()
    with kvbench.broker(tmp / "kafka") as (bootstrap, broker_pid), peer.processes() as procs:
        ports, addresses, pids = [], [], {"broker": broker_pid}
        for n in range(nodes):
            ports.append(metrics_port := free_port())
            proc, address = kvbench.start_node(bootstrap, tmp / f"node-{n + 1}", cluster, shards,
                                               tmp / f"node-{n + 1}.log", metrics_port, node_id=f"node-{n + 1}",
                                               extra=extra)
            procs.append(proc)
            addresses.append(address)
            pids[f"node-{n + 1}"] = proc.pid
        for proc, address in zip(procs, addresses, strict=True):
            kvbench.wait_serving(proc, address, START_TIMEOUT_S)
        held = placed(addresses, START_TIMEOUT_S) if rf else {}
        leader_of = leaders(addresses, shards, START_TIMEOUT_S)
        peer.log(f"{label}: leaders {collections.Counter(leader_of.values())}")
        rows = []
        for load in LOADS:
            asyncio.run(run_series(load, leader_of, shards, 16, 1.0, 0.0, pids, ports))  # warm
            row = asyncio.run(run_series(load, leader_of, shards, profile["clients"], profile["seconds"],
                                         profile["warmup"], pids, ports))
            peer.log(f"{label}: {load} {row['keys_per_s']:,.0f} keys/s ({row['requests_per_s']:,.0f} req/s) "
                     f"txn {row.get('records_per_txn')} rec / {row.get('mean_commit_ms')} ms; cpu {row['cpu_cores']}")
            rows.append(row)
        disk = {f"node-{n + 1}": kvbench_dir_bytes(tmp / f"node-{n + 1}") for n in range(nodes)}
    result: Row = {"config": label, "nodes": nodes, "shards": shards, "rows": rows}
    if rf:
        result.update(replication_factor=rf, held={k: sorted(v) for k, v in sorted(held.items())}, disk_bytes=disk)
    return result


def kvbench_dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 s windows")
    parser.add_argument("--only", metavar="TEXT", help="only the configurations whose label contains TEXT")
    parser.add_argument("--placement", action="store_true", help="10 shards on 1, 3, 5 nodes with R = 1 and 2")
    args = parser.parse_args(argv)
    profile_name = ("placement-" if args.placement else "") + ("quick" if args.quick else "full")
    profile, wall = PROFILES["quick" if args.quick else "full"], time.monotonic()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    configs = []
    todo = PLACEMENT_CONFIGS if args.placement else tuple((*c, None) for c in CONFIGS)
    for label, nodes, shards, rf in todo:
        if args.only and args.only not in label:
            continue
        with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
            configs.append(run_config(label, nodes, shards, profile, Path(tmp), rf))
    report = {"bench": "scaling", "profile": profile_name, "utc": stamp, "clients": profile["clients"],
              "seconds": profile["seconds"], "batch": BATCH, "value_bytes": VALUE_BYTES,
              "machine": {"nproc": len(os.sched_getaffinity(0)), "loadavg_at_end": os.getloadavg()},
              "wall_seconds": round(time.monotonic() - wall, 1), "configs": configs}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for name in (f"scaling-{profile_name}-{stamp}.json", f"scaling-latest-{profile_name}.json"):
        (RESULTS_DIR / name).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    if args.placement:
        print(placement_markdown(report))
    print(json.dumps({c["config"]: {r["load"]: r["keys_per_s"] for r in c["rows"]} for c in configs}))
    return 0


def markdown(report: Row) -> str:
    out = ["| configuration | load | keys/s | requests/s | records per WAL txn | commit ms | node CPU us/key "
           "| broker CPU us/key | node CPU ms/txn | broker CPU ms/txn | cores: nodes + broker (machine) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for config in report["configs"]:
        for r in config["rows"]:
            cores = r["cpu_cores"]
            nodes = sum(v for k, v in cores.items() if k.startswith("node"))
            out.append(f"| {config['config']} | {r['load']} | {r['keys_per_s']:,.0f} | {r['requests_per_s']:,.0f} | "
                       f"{r.get('records_per_txn', '-')} | {r.get('mean_commit_ms', '-')} | "
                       f"{r.get('node_cpu_us_per_key', '-')} | {r.get('broker_cpu_us_per_key', '-')} | "
                       f"{r.get('node_cpu_ms_per_txn', '-')} | {r.get('broker_cpu_ms_per_txn', '-')} | "
                       f"{nodes:.2f} + {cores.get('broker', 0):.2f} ({cores.get('machine', 0):.2f}) |")
    return "\n".join(out)


def placement_markdown(report: Row) -> str:
    """Per configuration and node: shards held, data directory, CPU during the WriteBatch load."""
    out = ["| configuration | R/N | node | shards held | data dir MB after the load | CPU cores (wbatch) |",
           "|---|---:|---|---:|---:|---:|"]
    for config in report["configs"]:
        wbatch = next(r for r in config["rows"] if r["load"] == "wbatch")
        share = min(config["replication_factor"], config["nodes"]) / config["nodes"]
        for node, size in config["disk_bytes"].items():
            out.append(f"| {config['config']} | {share:.2f} | {node} | {len(config['held'].get(node, []))} | "
                       f"{size / 1e6:.1f} | {wbatch['cpu_cores'].get(node, 0):.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
