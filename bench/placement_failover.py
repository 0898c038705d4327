"""How long placement takes to act (issue 33): the placement controller's failover, and a node's
death until its shards are re-replicated, next to a shard leader's failover in the same run.

Four store nodes of one cluster, 8 shards, R = 2, a grace period of 5 s and a session timeout of
1.5 s, each shard loaded with a few thousand keys (so that a learner has something to replay).
Rounds of two phases:

1. **Controller failover.** SIGKILL the placement controller's node; measured: the time until a
   surviving node's placement log names a new controller (a `controller_started` of a higher term),
   and, the baseline in the same run, until every shard the victim led has a new ready leader (the
   same detection: the membership or leadership group's session timeout). The victim restarts
   within the grace period, so nothing is re-placed.
2. **A node's death.** SIGKILL a node that is not the controller; measured: the time until its
   `node_gone` record (the grace period, plus up to a listing), and until placement has settled
   again without it (every shard held by exactly its targets, caught up and in the group), also
   counted from the end of the grace period. The node then restarts and rejoins (the time until
   settled again is reported as the join's).

    python bench/placement_failover.py              # 2 rounds, ~3 min on 2 cores
    python bench/placement_failover.py --rounds 1

Results: the table on stdout, one JSON object as the last line, and bench/results/placement_failover-<UTC>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kvstore.client import Client, ShardMap
from wal.broker import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv as kvbench  # bench/kv.py: broker, node start
import move  # bench/move.py: load()
import peer  # bench/peer.py: processes(), log()

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
NODES, SHARDS, RF, GRACE_MS, SESSION_MS = 4, 8, 2, 5000, 1500
START_TIMEOUT_S = 120.0
POLL_S = 0.05


def settled(smap: ShardMap, live: set[str]) -> bool:
    """Every shard held by exactly its targets, each a replica caught up and in the group, led."""
    if {n.node_id for n in smap.nodes} != live:
        return False
    for info in smap.shards:
        copies = {(r.node_id, r.state, r.in_group, r.caught_up) for r in info.replicas}
        if not info.leader_ready or len(info.placed_on) != min(RF, len(live)) or not set(info.placed_on) <= live \
                or copies != {(n, "replica", True, True) for n in info.placed_on}:
            return False
    return True


def wait(what: str, check: Any, timeout_s: float = START_TIMEOUT_S) -> float:
    """Poll `check` until true; the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if check():
                return time.monotonic() - started
        except Exception:  # a node away: ask again
            pass
        time.sleep(POLL_S)
    raise RuntimeError(f"{what}: not within {timeout_s} s")


class Cluster:
    def __init__(self, bootstrap: str, tmp: Path, procs: list[Any]) -> None:
        self.bootstrap, self.tmp, self.procs = bootstrap, tmp, procs
        self.name = f"pf{uuid.uuid4().hex[:8]}"
        self.ports = {f"node-{n}": free_port() for n in range(1, NODES + 1)}
        self.proc: dict[str, Any] = {}

    def address(self, node: str) -> str:
        return f"127.0.0.1:{self.ports[node]}"

    def start(self, node: str) -> None:
        extra = ("--replication-factor", str(RF), "--placement-grace-ms", str(GRACE_MS),
                 "--session-timeout-ms", str(SESSION_MS), "--listen", self.address(node))
        proc, _ = kvbench.start_node(self.bootstrap, self.tmp / node, self.name, SHARDS, self.tmp / f"{node}.log",
                                     node_id=node, extra=extra)
        self.procs.append(proc)
        self.proc[node] = proc

    def live(self) -> set[str]:
        return {node for node, proc in self.proc.items() if proc.poll() is None}

    def client(self, among: set[str] | None = None) -> Client:
        return Client([self.address(n) for n in sorted(among or self.live())], timeout_s=5, max_attempts=3)

    def smap(self) -> ShardMap:
        with self.client() as client:
            return client.shard_map(timeout_s=2)

    def kill(self, node: str) -> None:
        self.proc[node].send_signal(signal.SIGKILL)
        self.proc[node].wait(10)


def controller_phase(cluster: Cluster) -> dict[str, float]:
    smap = cluster.smap()
    victim = smap.controller
    with cluster.client() as client:
        term = client.placement_log(1).controller_term
    led = {info.shard for info in smap.shards if info.leader_id == victim}
    killed = time.monotonic()
    cluster.kill(victim)
    survivors = cluster.live()

    def new_office() -> bool:
        with cluster.client(survivors) as client:
            log = client.placement_log(1, timeout_s=1)
        return log.controller_term > term and log.controller != victim

    def new_leaders() -> bool:
        smap = cluster.smap()
        return all(smap.shards[s].leader_ready and smap.shards[s].leader_id != victim for s in led)

    # Both polled in one loop, each timed from the kill the first time it holds.
    seen: dict[str, float] = {}
    while len(seen) < 2:
        if time.monotonic() - killed > START_TIMEOUT_S:
            raise RuntimeError(f"after the controller's SIGKILL, only {sorted(seen)} within {START_TIMEOUT_S} s")
        for name, check in (("office", new_office), ("leaders", new_leaders)):
            try:
                if name not in seen and check():
                    seen[name] = time.monotonic() - killed
            except Exception:  # a node away: ask again
                pass
        time.sleep(POLL_S)
    office_s, leaders_s = seen["office"], seen["leaders"]
    cluster.start(victim)
    kvbench.wait_serving(cluster.proc[victim], cluster.address(victim), START_TIMEOUT_S)
    wait("settled after the controller's restart", lambda: settled(cluster.smap(), cluster.live()))
    return {"controller_failover_s": round(office_s, 2), "shard_leader_failover_s": round(leaders_s, 2),
            "shards_led_by_victim": len(led)}


def death_phase(cluster: Cluster) -> dict[str, float]:
    smap = cluster.smap()
    victim = next(n.node_id for n in smap.nodes if n.node_id != smap.controller)
    killed = time.monotonic()
    cluster.kill(victim)

    def gone() -> bool:
        with cluster.client() as client:
            return any(e.kind == "node_gone" and victim in e.summary for e in client.placement_log(20).entries)

    gone_s = wait("the node_gone record", gone)
    rereplicated_s = gone_s + wait("re-replicated", lambda: settled(cluster.smap(), cluster.live()))
    rejoined = time.monotonic()
    cluster.start(victim)
    kvbench.wait_serving(cluster.proc[victim], cluster.address(victim), START_TIMEOUT_S)
    wait("settled after the rejoin", lambda: settled(cluster.smap(), cluster.live()))
    return {"node_gone_s": round(gone_s, 2), "re_replicated_s": round(rereplicated_s, 2),
            "re_replicated_after_grace_s": round(rereplicated_s - GRACE_MS / 1000, 2),
            "rejoin_settled_s": round(time.monotonic() - rejoined, 2),
            "since_kill_s": round(time.monotonic() - killed, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keys", type=int, default=20_000, help="keys tried for shard 0 (loads one shard)")
    args = parser.parse_args(argv)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-placement-") as tmp_name, \
            kvbench.broker(Path(tmp_name) / "kafka") as (bootstrap, _broker_pid), peer.processes() as procs:
        cluster = Cluster(bootstrap, Path(tmp_name), procs)
        for node in cluster.ports:
            cluster.start(node)
        for node in cluster.ports:
            kvbench.wait_serving(cluster.proc[node], cluster.address(node), START_TIMEOUT_S)
        wait("settled", lambda: settled(cluster.smap(), cluster.live()))
        leader = cluster.smap().shards[0].leader
        peer.log(f"loading ~{args.keys // 2:,} keys into shard 0 (its learners have something to replay)")
        move.SHARDS = SHARDS
        asyncio.run(move.load(leader, args.keys))
        for i in range(args.rounds):
            peer.log(f"round {i + 1}: SIGKILL the controller")
            row = controller_phase(cluster)
            peer.log(f"round {i + 1}: SIGKILL a node, wait past the grace period ({GRACE_MS} ms)")
            row |= death_phase(cluster)
            peer.log(f"round {i + 1}: {row}")
            rounds.append(row)
    keys = rounds[0].keys()
    report: dict[str, Any] = {
        "bench": "placement_failover", "utc": stamp, "nodes": NODES, "shards": SHARDS, "replication_factor": RF,
        "grace_ms": GRACE_MS, "session_timeout_ms": SESSION_MS, "rounds": rounds,
        "median": {k: round(statistics.median(r[k] for r in rounds), 2) for k in keys},
        "machine": {"nproc": len(os.sched_getaffinity(0)), "loadavg_at_end": os.getloadavg()}}
    print("| measure | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " | median |")
    print("|---|" + "---:|" * (len(rounds) + 1))
    for k in keys:
        print(f"| {k} | " + " | ".join(str(r[k]) for r in rounds) + f" | {report['median'][k]} |")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"placement_failover-{stamp}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
