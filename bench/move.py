"""How long moving a shard takes: `kvstore move` of a shard holding N keys (1M by default).

Two store nodes of one cluster with one replica per shard (`--replication-factor 1`) and two shards,
so each node holds one. Shard 0 is loaded with N keys of 100-byte values (WriteBatch, 100 keys per
call), then moved to the node that does not hold it (`ClusterService.MoveShard`): the learner there
replays the shard's whole WAL (no snapshot directory: the worst case) and joins once caught up, then
the giver drops its copy. Measured: the time from the move's request until the shard map shows the
new node as the shard's only, caught-up replica and the old one's copy dropped, the learner's bytes
on disk (`kvstore_learner_bytes_total`), and writes/s during the load for scale.

    python bench/move.py --keys 1000000     # ~3 min on 2 cores
    python bench/move.py --keys 100000      # ~40 s
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from kvstore.client import Client
from kvstore.core.sharding import shard_of
from kvstore.v1 import kv_pb2
from wal.broker import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv as kvbench  # bench/kv.py: broker, node start, CPU counters
import peer  # bench/peer.py: processes(), log()
import scaling  # bench/scaling.py: placed(), leaders()

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
SHARDS, BATCH, VALUE_BYTES, CLIENTS = 2, 100, 100, 16


async def load(leader: str, keys: int) -> float:
    """N keys of shard 0 through WriteBatch (CLIENTS calls in flight); returns keys/s."""
    value = os.urandom(VALUE_BYTES)
    tag = uuid.uuid4().hex[:6]
    async with grpc.aio.insecure_channel(leader) as channel:
        call = channel.unary_unary("/kvstore.v1.KVService/WriteBatch")
        next_key = 0
        started = time.perf_counter()

        async def client() -> None:
            nonlocal next_key
            while next_key < keys:
                mutations = []
                while len(mutations) < BATCH and next_key < keys:
                    key = f"m/{tag}/{next_key}".encode()
                    next_key += 1
                    if shard_of(key, SHARDS) == 0:  # a key of shard 1 is skipped
                        mutations.append(kv_pb2.Mutation(key=key, value=value))
                if mutations:
                    part = kv_pb2.ShardMutations(shard=0, mutations=mutations)
                    await call(kv_pb2.WriteBatchRequest(shards=[part]).SerializeToString(), timeout=60)

        await asyncio.gather(*(client() for _ in range(CLIENTS)))
        return keys / (time.perf_counter() - started)


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.split("{", 1)[0].split(" ", 1)[0] == name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys tried for shard 0 (about half land there)")
    args = parser.parse_args(argv)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    cluster = f"mv{uuid.uuid4().hex[:8]}"
    extra = ("--replication-factor", "1", "--placement-grace-ms", "3000")
    with tempfile.TemporaryDirectory(prefix="bench-move-") as tmp_name, \
            kvbench.broker(Path(tmp_name) / "kafka") as (bootstrap, _broker_pid), peer.processes() as procs:
        tmp = Path(tmp_name)
        addresses, ports = [], []
        for n in (1, 2):
            ports.append(port := free_port())
            proc, address = kvbench.start_node(bootstrap, tmp / f"node-{n}", cluster, SHARDS, tmp / f"node-{n}.log",
                                               port, node_id=f"node-{n}", extra=extra)
            procs.append(proc)
            addresses.append(address)
        for proc, address in zip(procs, addresses, strict=True):
            kvbench.wait_serving(proc, address, scaling.START_TIMEOUT_S)
        held = scaling.placed(addresses, scaling.START_TIMEOUT_S)
        deadline = time.monotonic() + scaling.START_TIMEOUT_S
        while len(held) < 2 and time.monotonic() < deadline:  # settled before the second node counted
            time.sleep(1.0)
            held = scaling.placed(addresses, scaling.START_TIMEOUT_S)
        giver = next(node for node, shards in held.items() if 0 in shards)
        taker = next(f"node-{n}" for n in (1, 2) if f"node-{n}" != giver)
        leader = scaling.leaders(addresses, SHARDS, scaling.START_TIMEOUT_S)[0]
        peer.log(f"loading ~{args.keys // 2:,} keys into shard 0 on {giver}")
        keys_per_s = asyncio.run(load(leader, args.keys))
        with Client(addresses, timeout_s=60) as client:
            stored = sum(1 for _ in client.scan_all(prefix="m/", keys_only=True, consistency="stale"))
            peer.log(f"loaded {stored:,} keys ({keys_per_s:,.0f} tried keys/s); moving shard 0 {giver} -> {taker}")
            started = time.monotonic()
            changes = client.move_shard(0, taker)
            progress = client.wait_moves(changes, timeout_s=3600, poll_s=0.5)
            move_s = time.monotonic() - started
        taker_port = ports[int(taker.split("-")[1]) - 1]
        learner_bytes = metric(taker_port, "kvstore_learner_bytes_total")
        report: dict[str, Any] = {
            "bench": "move", "utc": stamp, "keys": stored, "value_bytes": VALUE_BYTES, "done": progress.done,
            "move_seconds": round(move_s, 1), "keys_per_s_moved": round(stored / move_s) if move_s else None,
            "learner_bytes": int(learner_bytes), "load_keys_per_s": round(keys_per_s),
            "machine": {"nproc": len(os.sched_getaffinity(0)), "loadavg_at_end": os.getloadavg()}}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"move-{stamp}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0 if progress.done else 1


if __name__ == "__main__":
    sys.exit(main())
