"""Where a node's CPU goes under load: py-spy flame graphs of one store node, per load.

(Named cpu_profile, not profile: bench/ is put on sys.path by the benchmarks, and a `profile` module
there would shadow the standard library's, which cProfile imports.)

One node (4 shards, its own single-node Kafka) is driven by bench/peer.py's load generator (the same
raw-bytes closed loop, 64 clients by default) with one load at a time; while it runs, py-spy samples the
node process twice: once into an SVG flame graph (`bench/results/profile-<load>.svg`, open it in a
browser) and once into collapsed stacks, from which the self time per function and the share of a few
named parts of the request path (gRPC and asyncio, protobuf, LevelDB, the WAL writer, metrics, ...) are
summed into `bench/results/profile-latest.json`. Only the node's Python threads are sampled (librdkafka's
own threads are native and not shown); idle time (a thread waiting) is left out.

    python bench/cpu_profile.py                    # put, get, wbatch at 64 clients, 15 s each (~2 min)
    python bench/cpu_profile.py --loads put --seconds 30
    python bench/cpu_profile.py --loads replay     # a node's bootstrap from 200k WAL records, start to leading

py-spy comes with the bench extra (`pip install -e '.[bench]'`); it reads the node's memory, which
needs ptrace rights (root, or kernel.yama.ptrace_scope = 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient, NewTopic

from wal.broker import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv as kvbench  # bench/kv.py: node start, broker
import peer  # bench/peer.py: the load generator

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
START_TIMEOUT_S = 120
NATIVE: list[str] = []  # ["--native"]: also C and Cython frames (gRPC core, protobuf upb), set by --native
# Parts of the request path, by the file a sampled frame's function lives in (first match wins, checked
# from the innermost frame out): what each costs is the sum of the self time of its functions.
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("protobuf (build, parse, serialize)", ("(google/protobuf", "_pb2.py")),
    ("LevelDB (plyvel)", ("(plyvel",)),
    ("metrics (prometheus_client)", ("(prometheus_client",)),
    ("Kafka client (confluent_kafka)", ("(confluent_kafka",)),
    ("WAL writer, replayer and guard (wal/)", ("(wal/",)),
    ("store core (kvstore/core)", ("(kvstore/core/",)),
    ("replica and storage (kvstore/server)", ("(kvstore/server/",)),
    ("gRPC (grpc/_cython, grpc/aio)", ("(grpc/",)),
    ("asyncio event loop", ("(asyncio/",)),
    ("threads and futures (concurrent, threading)", ("(concurrent/", "(threading.py", "(queue.py")),
)


def pyspy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy is missing: pip install -e '.[bench]'")
    return found


def record(pid: int, seconds: float, out: Path, fmt: str) -> subprocess.Popen[bytes]:
    """py-spy sampling `pid` for `seconds` into `out` (`flamegraph` SVG or `raw` collapsed stacks)."""
    return subprocess.Popen([pyspy(), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "250",
                             "--gil", *NATIVE, "--format", fmt, "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def summarize(collapsed: Path, top: int = 25) -> dict[str, Any]:
    """Self time per function and per part of the path, from py-spy's collapsed stacks."""
    self_samples: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()  # the store's own functions, callees included
    parts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        self_samples[frames[-1]] += count
        parts[_part_of(frames)] += count
        for frame in set(frames):
            if "(kvstore/" in frame or "(wal/" in frame:
                inclusive[frame] += count
    share = (lambda n: round(100.0 * n / total, 1)) if total else (lambda n: 0.0)
    return {"samples": total,
            "parts_percent": {name: share(n) for name, n in parts.most_common()},
            "top_self_percent": [[frame, share(n)] for frame, n in self_samples.most_common(top)],
            "store_inclusive_percent": [[frame, share(n)] for frame, n in inclusive.most_common(top)]}


def _part_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, needles in PARTS:
            if any(needle in frame for needle in needles):
                return name
    return "other"


def profile_replay(records: int, out_dir: Path) -> dict[str, Any]:
    """A one-shard node started under py-spy on a WAL of `records` Put entries (bench/kv.py's
    fill), sampled from its start until it leads at the WAL's end, then stopped (SIGINT to its
    process group: the node stops cleanly and py-spy writes what it sampled)."""
    found: dict[str, Any] = {"records": records}
    with tempfile.TemporaryDirectory(prefix="bench-profile-replay-") as tmp_name, \
            kvbench.broker(Path(tmp_name) / "kafka") as (bootstrap, _broker_pid):
        tmp, cluster = Path(tmp_name), f"prr{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        for future in admin.create_topics([NewTopic(f"{cluster}.wal", 1)]).values():
            future.result(30)
        end = kvbench.fill_topic(bootstrap, cluster, records, os.urandom(100))
        for fmt, suffix in (("flamegraph", "svg"), ("raw", "txt")):
            log_path = tmp / f"node-{fmt}.log"
            cmd = [pyspy(), "record", "--gil", "--rate", "250", "--format", fmt, "--output",
                   str(out_dir / f"profile-replay.{suffix}"), "--", sys.executable, "-m", "kvstore.server",
                   "--kafka", bootstrap, "--data-dir", str(tmp / f"data-{fmt}"), "--listen",
                   f"127.0.0.1:{free_port()}", "--cluster", cluster, "--shards", "1", "--log-format", "text",
                   "--node-id", f"replay-{fmt}"]
            started = time.monotonic()
            with open(log_path, "wb") as log:
                spy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                       env={**os.environ, "PYTHONPATH": str(REPO)})
            try:
                while f"leading at offset {end} " not in log_path.read_text(errors="replace"):
                    if spy.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                        raise SystemExit(f"the node did not lead at {end}: {log_path.read_text()[-2000:]}")
                    time.sleep(0.05)
                found[f"to_leading_s_{fmt}"] = round(time.monotonic() - started, 2)
            finally:
                os.killpg(spy.pid, signal.SIGINT)
                try:
                    spy.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(spy.pid, signal.SIGKILL)
                    spy.wait(10)
        found.update(summarize(out_dir / "profile-replay.txt"))
    peer.log(f"replay: {found['to_leading_s_flamegraph']} s to leading; parts {found['parts_percent']}")
    return found


async def drive(target: peer.Target, load: str, clients: int, seconds: float) -> dict[str, Any]:
    row = await peer.run_series(target, load, clients, seconds, 0.0)
    return {k: row[k] for k in ("ops_per_s", "keys_per_s", "p99_ms", "errors", "wrong_answers", "cpu_percent")}


async def profile_loads(target: peer.Target, node_pid: int, loads: list[str], clients: int, seconds: float,
                        out_dir: Path) -> dict[str, Any]:
    await target.open()
    try:
        await peer.seed(target)
        for warm in ("put", "get", "wbatch"):
            await peer.run_series(target, warm, 16, 2.0, 0.0)
        found: dict[str, Any] = {}
        for load in loads:
            per_load: dict[str, Any] = {}
            for fmt, suffix in (("flamegraph", "svg"), ("raw", "txt")):
                out = out_dir / f"profile-{load}.{suffix}"
                spy = record(node_pid, seconds, out, fmt)
                await asyncio.sleep(0.5)  # py-spy attached before the window opens
                run = await drive(target, load, clients, seconds - 1.0)
                _, err = await asyncio.to_thread(spy.communicate)
                if spy.returncode != 0:
                    raise SystemExit(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-500:]}")
                per_load[f"run_{fmt}"] = run
            per_load.update(summarize(out_dir / f"profile-{load}.txt"))
            peer.log(f"{load}: {per_load['run_raw']['ops_per_s']:,.0f}/s; parts {per_load['parts_percent']}")
            found[load] = per_load
        return found
    finally:
        await target.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loads", default="put,get,wbatch,replay",
                        help="comma-separated, of " + ", ".join((*peer.OPS, "replay")))
    parser.add_argument("--replay-records", type=int, default=200_000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0, help="per load and recording")
    parser.add_argument("--native", action="store_true", help="also sample C/Cython frames (slower sampling)")
    parser.add_argument("--keep-stacks", action="store_true",
                        help="keep the collapsed stacks (bench/results/profile-<load>.txt) for your own queries")
    args = parser.parse_args(argv)
    if args.native:
        NATIVE.append("--native")
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    if unknown := [x for x in loads if x not in (*peer.OPS, "replay")]:
        raise SystemExit(f"unknown loads {unknown}; choose from {peer.OPS} and replay")
    served = [x for x in loads if x != "replay"]
    pyspy()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    found: dict[str, Any] = {}
    if served:
        with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp_name, \
                kvbench.broker(Path(tmp_name)) as (bootstrap, broker_pid), peer.processes() as procs:
            tmp = Path(tmp_name)
            metrics_port = free_port()
            node, address = kvbench.start_node(bootstrap, tmp / "node", f"prof{uuid.uuid4().hex[:8]}",
                                               peer.SHARDS, tmp / "node.log", metrics_port)
            procs.append(node)
            kvbench.wait_serving(node, address, START_TIMEOUT_S)
            target = peer.Target("store", address, peer.Codec("store", None),
                                 {"server": node.pid, "broker": broker_pid, "loadgen": os.getpid()}, metrics_port)
            found.update(asyncio.run(profile_loads(target, node.pid, served, args.clients, args.seconds,
                                                   RESULTS_DIR)))
    if "replay" in loads:
        found["replay"] = profile_replay(args.replay_records, RESULTS_DIR)
    for value in found.values():
        value.update(utc=stamp, clients=args.clients, seconds=args.seconds)
    latest = RESULTS_DIR / "profile-latest.json"
    earlier = json.loads(latest.read_text()).get("loads", {}) if latest.exists() else {}
    report = {"bench": "profile", "utc": stamp, "wall_seconds": round(time.monotonic() - started, 1),
              "machine": {"nproc": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg()},
              "loads": {**earlier, **found}}  # loads not run this time keep their last results (and utc)
    latest.write_text(json.dumps(report, indent=2) + "\n")
    if not args.keep_stacks:
        for load in loads:
            (RESULTS_DIR / f"profile-{load}.txt").unlink(missing_ok=True)  # the summary keeps what matters
    print(json.dumps({load: {"ops_per_s": v["run_raw"]["ops_per_s"] if "run_raw" in v else None,
                             "parts_percent": v["parts_percent"]} for load, v in found.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
