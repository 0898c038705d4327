"""The Grafana dashboard's panels (deploy/grafana/dashboards/kvstore.json), plotted from a real local run.

No Docker engine runs here, so instead of Prometheus + Grafana this script is both: it starts a
private single-node Kafka broker and three store nodes (`python -m kvstore.server`, 4 shards,
each with `--metrics-port`), scrapes every node's /metrics once a second while a client load runs,
and computes each dashboard panel from the scrapes the way its PromQL does (rates over a 5 s
window, `histogram_quantile` over summed bucket rates, counter resets of a restarted node handled,
the maximum of gauges), into bench/results/dashboard.png, with the raw scraped series in
bench/results/dashboard.json.

What happens during the run (the defaults), so that every panel has something to show:

- t = 0 .. --seconds: writers (`Client.put`, 100-byte values over 4096 keys) and readers
  (`Client.get`, linearizable and stale) in threads, one client each;
- at --kill-at: SIGKILL to the leader of shard 0 (its shards fail over: leader changes, lag on the
  replicas taking over); at --kill-at + --down-s the node is started again on the same ports, and
  the group gives it shards back (more leader changes, NOT_LEADER answers from the old leaders);
- at --inject-at: one foreign record (bytes that are no WAL entry) produced straight into shard
  1's WAL partition with a plain producer, as a misbehaving writer would: every replica of the
  shard skips it (W3 rejections), and the leader, whose read barrier sees a high watermark beyond
  its own writes, refuses with UNAVAILABLE until it re-bootstrapped;
- throughout: --bad-per-s Put requests with an empty key (INVALID_ARGUMENT), a misbehaving client,
  so the errors panel also shows a steady definite error.

Every process is stopped at the end, also on an error or Ctrl-C (nodes SIGTERM then SIGKILL, the
broker by wal.broker.LocalKafka). Panel titles come from the dashboard JSON; a title without a
computation here fails before anything starts. The last stdout line is one JSON summary.

    python bench/dashboard.py                    # ~2.5 min on 2 cores: broker and node start, 75 s of load
    python bench/dashboard.py --render bench/results/dashboard.json   # redo the summary and the plot
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import datetime
import itertools
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import Client, Consistency, KvError
from kvstore.v1 import kv_pb2, kv_pb2_grpc
from wal.broker import KAFKA_VERSION, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv as kvbench  # bench/kv.py: the private broker, wait_serving, stop_proc

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "kvstore.json"
NODES, SHARDS, CLUSTER = 3, 4, "dashbench"
SCRAPE_INTERVAL_S = 1.0
RATE_WINDOW_S = 5.0  # Grafana's $__rate_interval for a 1 s scrape interval is 4 s; one more for jitter
KEYS, VALUE_BYTES = 4096, 100
CALL_TIMEOUT_S = 5.0

Series = dict[str, Any]  # {"node", "name", "labels", "values": [float | None per scrape of that node]}
Curve = tuple[str, list[float]]  # (legend, value per grid point; NaN = no data)


# ---- the cluster -----------------------------------------------------------------------------------


class NodeProc:
    """One store node on fixed ports, so a restart keeps its address and its metrics endpoint."""

    def __init__(self, index: int, kafka: str, tmp: Path, session_timeout_ms: int) -> None:
        self.node_id = f"node-{index}"
        self.address = f"127.0.0.1:{free_port()}"
        self.metrics_port = free_port()
        self.log = tmp / f"{self.node_id}.log"
        self.cmd = [sys.executable, "-m", "kvstore.server", "--kafka", kafka, "--data-dir", str(tmp / self.node_id),
                    "--listen", self.address, "--cluster", CLUSTER, "--shards", str(SHARDS),
                    "--node-id", self.node_id, "--metrics-port", str(self.metrics_port),
                    "--session-timeout-ms", str(session_timeout_ms)]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            kvbench.stop_proc(self.proc)


@contextlib.contextmanager
def cluster(tmp: Path, session_timeout_ms: int) -> Iterator[tuple[str, list[NodeProc]]]:
    """Broker + nodes, every one stopped on the way out whatever happened."""
    with kvbench.broker(tmp) as (bootstrap, _):
        nodes = [NodeProc(i, bootstrap, tmp, session_timeout_ms) for i in range(1, NODES + 1)]
        try:
            for node in nodes:
                node.start()
            for node in nodes:
                assert node.proc is not None
                kvbench.wait_serving(node.proc, node.address, 180)
            yield bootstrap, nodes
        finally:
            for node in nodes:  # SIGTERM to all first: they drain in parallel
                if node.proc is not None and node.proc.poll() is None:
                    node.proc.terminate()
            for node in nodes:
                node.stop()


# ---- scraping ------------------------------------------------------------------------------------


class Scraper(threading.Thread):
    """GET every node's /metrics each SCRAPE_INTERVAL_S; a failed scrape (node down) records nothing."""

    def __init__(self, nodes: Sequence[NodeProc], t0: float) -> None:
        super().__init__(daemon=True, name="scraper")
        self.nodes, self.t0 = nodes, t0
        self.stop_event = threading.Event()
        self.times: dict[str, list[float]] = {n.node_id: [] for n in nodes}
        # (node, sample name, sorted labels) -> {scrape index: value}
        self.samples: dict[tuple[str, str, tuple[tuple[str, str], ...]], dict[int, float]] = {}
        self.failures: collections.Counter[str] = collections.Counter()

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.stop_event.is_set():
            for node in self.nodes:
                self.scrape(node)
            next_at += SCRAPE_INTERVAL_S
            self.stop_event.wait(max(0.0, next_at - time.monotonic()))

    def scrape(self, node: NodeProc) -> None:
        at = time.monotonic() - self.t0
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=0.8) as resp:
                text = resp.read().decode()
        except OSError:
            self.failures[node.node_id] += 1
            return
        index = len(self.times[node.node_id])
        self.times[node.node_id].append(round(at, 3))
        for family in text_string_to_metric_families(text):
            if not family.name.startswith("kvstore_"):
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (node.node_id, sample.name, tuple(sorted(sample.labels.items())))
                self.samples.setdefault(key, {})[index] = sample.value

    def series(self) -> list[Series]:
        out = []
        for (node, name, labels), values in sorted(self.samples.items()):
            n = len(self.times[node])
            out.append({"node": node, "name": name, "labels": dict(labels),
                        "values": [values.get(i) for i in range(n)]})
        return out


# ---- the load ------------------------------------------------------------------------------------


class Load:
    """Writers and readers in threads, one Client each; counts what the clients saw."""

    def __init__(self, endpoints: Sequence[str], writers: int, readers: int, bad_per_s: float) -> None:
        self.endpoints = list(endpoints)
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.ok: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.threads = [threading.Thread(target=self.writer, args=(i,), daemon=True) for i in range(writers)]
        self.threads += [threading.Thread(target=self.reader, args=(i,), daemon=True) for i in range(readers)]
        if bad_per_s > 0:
            self.threads.append(threading.Thread(target=self.bad_client, args=(bad_per_s,), daemon=True))

    def count(self, op: str, error: Exception | None) -> None:
        with self.lock:
            if error is None:
                self.ok[op] += 1
            else:
                self.errors[f"{op} {type(error).__name__}"] += 1

    def writer(self, seed: int) -> None:
        rng = random.Random(seed)
        value = os.urandom(VALUE_BYTES)
        with Client(self.endpoints, timeout_s=CALL_TIMEOUT_S) as client:
            while not self.stop_event.is_set():
                try:
                    client.put(f"k{rng.randrange(KEYS):05d}".encode(), value)
                    self.count("put", None)
                except KvError as exc:
                    self.count("put", exc)

    def reader(self, seed: int) -> None:
        rng = random.Random(1000 + seed)
        with Client(self.endpoints, timeout_s=CALL_TIMEOUT_S) as client:
            while not self.stop_event.is_set():
                consistency: Consistency = "stale" if rng.random() < 0.5 else "linearizable"
                try:
                    client.get(f"k{rng.randrange(KEYS):05d}".encode(), consistency)
                    self.count(f"get_{consistency}", None)
                except KvError as exc:
                    self.count(f"get_{consistency}", exc)

    def bad_client(self, per_s: float) -> None:
        """Empty keys, straight through a stub: the node answers INVALID_ARGUMENT."""
        with grpc.insecure_channel(self.endpoints[0]) as channel:
            stub = kv_pb2_grpc.KVServiceStub(channel)  # type: ignore[no-untyped-call]
            while not self.stop_event.wait(1 / per_s):
                try:
                    stub.Put(kv_pb2.PutRequest(key=b"", value=b"x"), timeout=CALL_TIMEOUT_S)
                    self.count("bad_put", None)
                except grpc.RpcError as exc:
                    with self.lock:
                        self.errors[f"bad_put {exc.code().name}"] += 1

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(CALL_TIMEOUT_S * 3)


def log_problems(log: Path, limit: int = 10) -> list[str]:
    """The node's error and critical log lines (JSON lines on stderr), the first `limit`."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):  # a traceback or a text-format line
            if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback"):
                found.append(line[:300])
            continue
        with contextlib.suppress(ValueError, AttributeError):
            entry = json.loads(line)
            if entry.get("level") in ("error", "critical"):
                found.append(f"{entry.get('level')}: {str(entry.get('msg'))[:300]}")
    return found[:limit]


def leader_of(endpoints: Sequence[str], shard: int) -> str:
    with Client(endpoints, timeout_s=10) as client:
        smap = client.shard_map()
    return next(s.leader_id for s in smap.shards if s.shard == shard)


def inject_foreign_record(bootstrap: str, shard: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(f"{CLUSTER}.wal", b"not a WAL entry", partition=shard)
    if producer.flush(10) != 0:
        raise RuntimeError("the foreign record was not delivered")


def run(args: argparse.Namespace) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp_name:
        tmp = Path(tmp_name)
        started = time.monotonic()
        print("# starting the broker and 3 nodes ...", file=sys.stderr, flush=True)
        with cluster(tmp, args.session_timeout_ms) as (bootstrap, nodes):
            print(f"# cluster up after {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
            endpoints = [n.address for n in nodes]
            t0 = time.monotonic() + args.lead_in_s
            scraper = Scraper(nodes, t0)
            scraper.start()
            time.sleep(args.lead_in_s)
            load = Load(endpoints, args.writers, args.readers, args.bad_per_s)
            load.start()

            def at(t: float) -> None:
                time.sleep(max(0.0, t0 + t - time.monotonic()))

            def event(what: str, **extra: Any) -> None:
                events.append({"t": round(time.monotonic() - t0, 2), "event": what, **extra})
                print(f"# t={events[-1]['t']:.1f}s {what} {extra}", file=sys.stderr, flush=True)

            try:
                plan: list[tuple[float, Callable[[], None]]] = []
                victim: list[NodeProc] = []

                def kill() -> None:
                    leader = leader_of(endpoints, 0)
                    node = next(n for n in nodes if n.node_id == leader)
                    node.kill()
                    victim.append(node)
                    event("SIGKILL", node=leader, reason="leader of shard 0")

                def restart() -> None:
                    victim[0].start()
                    event("restart", node=victim[0].node_id)

                def inject() -> None:
                    inject_foreign_record(bootstrap, 1)
                    event("foreign record", shard=1)

                if args.kill_at >= 0:
                    plan += [(args.kill_at, kill), (args.kill_at + args.down_s, restart)]
                if args.inject_at >= 0:
                    plan.append((args.inject_at, inject))
                for when, action in sorted(plan, key=lambda item: item[0]):
                    at(when)
                    action()
                at(args.seconds)
            finally:
                load.stop()
                event("load stopped")
            time.sleep(args.tail_s)
            scraper.stop_event.set()
            scraper.join(5)
            logs = {n.node_id: log_problems(n.log) for n in nodes}
    return {"events": events, "scrape_times": scraper.times, "series": scraper.series(),
            "scrape_failures": dict(scraper.failures), "client_ok": dict(load.ok),
            "client_errors": dict(load.errors), "node_log_errors": logs}


# ---- PromQL, as far as the panels need it ----------------------------------------------------------


class Data:
    """The scraped series on a common grid (one point per second), with PromQL-like operations."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.times: dict[str, list[float]] = report["scrape_times"]
        self.series: list[Series] = report["series"]
        end = max((ts[-1] for ts in self.times.values() if ts), default=0.0)
        start = min((ts[0] for ts in self.times.values() if ts), default=0.0)
        self.grid = [float(t) for t in range(math.ceil(start), math.floor(end) + 1)]

    def select(self, name: str, **match: str) -> list[Series]:
        return [s for s in self.series if s["name"] == name
                and all(s["labels"].get(k) == v for k, v in match.items())]

    def _points(self, s: Series, lo: float, hi: float) -> list[tuple[float, float]]:
        times = self.times[s["node"]]
        i, j = bisect.bisect_right(times, lo), bisect.bisect_right(times, hi)
        return [(times[k], s["values"][k]) for k in range(i, j) if s["values"][k] is not None]

    def increase(self, s: Series, window: float) -> list[float]:
        """Per grid point, the counter's increase over (t - window, t], resets (restarts) handled.
        Like Prometheus without its extrapolation: a window with one sample or none is no data."""
        out = []
        for t in self.grid:
            points = self._points(s, t - window, t)
            if len(points) < 2:
                out.append(math.nan)
                continue
            total = 0.0
            for (_, a), (_, b) in itertools.pairwise(points):
                total += b - a if b >= a else b
            out.append(total)
        return out

    def deltas(self, s: Series) -> list[float]:
        """Per grid point t, what the counter gained between scrapes that landed in (t - 1, t]
        (each gain counted once, at the later scrape; a reset counts its new value)."""
        out = [0.0] * len(self.grid)
        points = self._points(s, -math.inf, math.inf)
        for (_, a), (at, b) in itertools.pairwise(points):
            i = bisect.bisect_left(self.grid, at)
            if i < len(out):
                out[i] += b - a if b >= a else b
        return out

    def total(self, s: Series) -> float:
        """The counter's increase over the whole run, resets included."""
        return sum(self.deltas(s))

    def rate(self, s: Series, window: float = RATE_WINDOW_S) -> list[float]:
        out = []
        for t, inc in zip(self.grid, self.increase(s, window), strict=True):
            points = self._points(s, t - window, t)
            out.append(inc / (points[-1][0] - points[0][0]) if not math.isnan(inc) else math.nan)
        return out

    def gauge(self, s: Series) -> list[float]:
        """The latest value within 2 s of each grid point (a target that stopped answering is stale)."""
        out = []
        for t in self.grid:
            points = self._points(s, t - 2.0, t)
            out.append(points[-1][1] if points else math.nan)
        return out

    def by(self, series: list[Series], key: Callable[[Series], str], values: Callable[[Series], list[float]],
           combine: Callable[[list[float]], float] = sum) -> dict[str, list[float]]:
        """`sum by (...)` / `max by (...)`: NaN (no data) is left out, all-NaN stays NaN."""
        groups: dict[str, list[list[float]]] = collections.defaultdict(list)
        for s in series:
            groups[key(s)].append(values(s))
        out = {}
        for name, rows in sorted(groups.items()):
            column = [[v for v in col if not math.isnan(v)] for col in zip(*rows, strict=True)]
            out[name] = [combine(vs) if vs else math.nan for vs in column]
        return out

    def histogram_quantile(self, q: float, name: str, window: float = RATE_WINDOW_S) -> dict[str, list[float]]:
        """`histogram_quantile(q, sum by (le, shard) (rate(<name>_bucket[w])))`: linear within a bucket,
        the highest finite bound when the rank falls in +Inf (Prometheus's rules)."""
        by_shard: dict[str, dict[float, list[list[float]]]] = {}
        for s in self.select(f"{name}_bucket"):
            le = float(s["labels"]["le"])
            by_shard.setdefault(s["labels"]["shard"], {}).setdefault(le, []).append(self.rate(s, window))
        out = {}
        for shard, buckets in sorted(by_shard.items()):
            bounds = sorted(buckets)
            summed = {le: [sum(v for v in col if not math.isnan(v)) if any(not math.isnan(v) for v in col)
                           else math.nan for col in zip(*buckets[le], strict=True)] for le in bounds}
            curve = []
            for i in range(len(self.grid)):
                counts = [summed[le][i] for le in bounds]
                total = counts[-1]
                if math.isnan(total) or total <= 0:
                    curve.append(math.nan)
                    continue
                rank = q * total
                k = next(k for k, c in enumerate(counts) if c >= rank)
                if math.isinf(bounds[k]):
                    curve.append(bounds[-2])
                    continue
                lower, below = (bounds[k - 1], counts[k - 1]) if k > 0 else (0.0, 0.0)
                inside = counts[k] - below
                curve.append(lower + (bounds[k] - lower) * ((rank - below) / inside if inside > 0 else 1.0))
            out[shard] = curve
        return out


def node_shard(s: Series) -> str:
    return f"{s['node']} shard {s['labels'].get('shard', '')}"


def shard(s: Series) -> str:
    return f"shard {s['labels'].get('shard', '')}"


def requests_by_method(d: Data) -> list[Curve]:
    return list(d.by(d.select("kvstore_requests_total"), lambda s: s["labels"]["method"], d.rate).items())


def errors_by_reason(d: Data) -> list[Curve]:
    """By ErrorInfo reason where the node labels it (issue 13), else by status code only."""
    errors = [s for s in d.select("kvstore_requests_total") if s["labels"].get("code") != "OK"]

    def key(s: Series) -> str:
        labels = s["labels"]
        reason = labels.get("reason")
        return f"{labels['method']} {reason} ({labels['code']})" if reason else f"{labels['method']} {labels['code']}"
    return list(d.by(errors, key, d.rate).items())


def commit_latency(d: Data) -> list[Curve]:
    curves = []
    for q in (0.99, 0.5):
        for name, values in d.histogram_quantile(q, "kvstore_commit_latency_seconds").items():
            curves.append((f"p{round(q * 100)} shard {name}", [v * 1000 for v in values]))  # plotted in ms
    return curves


def batch_size(d: Data) -> list[Curve]:
    p99 = d.histogram_quantile(0.99, "kvstore_batch_records")
    curves = [(f"p99 shard {name}", values) for name, values in p99.items()]
    sums = d.by(d.select("kvstore_batch_records_sum"), shard, d.rate)
    counts = d.by(d.select("kvstore_batch_records_count"), shard, d.rate)
    for name in sums:
        curves.append((f"mean {name}", [a / b if b and not math.isnan(b) else math.nan
                                        for a, b in zip(sums[name], counts[name], strict=True)]))
    return curves


def lag(d: Data) -> list[Curve]:
    return list(d.by(d.select("kvstore_lag_records"), node_shard, d.gauge, max).items())


def open_txn_age(d: Data) -> list[Curve]:
    return list(d.by(d.select("kvstore_open_txn_age_seconds"), shard, d.gauge, max).items())


def leader_changes(d: Data) -> list[Curve]:
    return list(d.by(d.select("kvstore_leader_changes_total"), node_shard, d.deltas).items())


def w3_rejections(d: Data) -> list[Curve]:
    return list(d.by(d.select("kvstore_w3_rejections_total"), node_shard, d.rate).items())


def fencings_unknown_rebuilds(d: Data) -> list[Curve]:
    curves = []
    for metric, what in (("kvstore_fencings_total", "fenced"), ("kvstore_unknown_outcomes_total", "unknown outcome"),
                         ("kvstore_rebuilds_total", "rebuilt")):
        for name, values in d.by(d.select(metric), shard, d.deltas).items():
            curves.append((f"{what} {name}", values))
    return curves


def applied_offset(d: Data) -> list[Curve]:
    return list(d.by(d.select("kvstore_applied_offset"), node_shard, d.gauge, max).items())


# Dashboard panel title -> (computation, y label, bars). Bars: events per scrape, not a rate.
PANELS: dict[str, tuple[Callable[[Data], list[Curve]], str, bool]] = {
    "Requests/s by method": (requests_by_method, "requests/s", False),
    "Errors/s by reason": (errors_by_reason, "requests/s", False),
    "WAL commit latency (p50, p99) per shard": (commit_latency, "ms", False),
    "WAL batch size (records per committed batch)": (batch_size, "records", False),
    "Replica lag (records)": (lag, "records", False),
    "Open WAL transaction age": (open_txn_age, "s", False),
    "Leader changes": (leader_changes, "per scrape (1 s)", True),
    "W3 rejections/s": (w3_rejections, "records/s", False),
    "Fencings, unknown outcomes, rebuilds": (fencings_unknown_rebuilds, "per scrape (1 s)", True),
    "Applied offset per shard": (applied_offset, "offset", False),
}


def dashboard_titles() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    titles = [p["title"] for p in board["panels"] if p.get("type") != "row"]
    missing = [t for t in titles if t not in PANELS]
    extra = [t for t in PANELS if t not in titles]
    if missing or extra:
        raise SystemExit(f"bench/dashboard.py is out of step with {DASHBOARD.relative_to(REPO)}: "
                         f"no computation for {missing}, computations for no panel {extra}")
    return titles


# ---- the summary and the plot ------------------------------------------------------------------------


def counter_total(d: Data, name: str) -> float:
    """Summed over the series, each one's increase during the run (a whole-run `increase`)."""
    return sum(d.total(s) for s in d.select(name))


def whole_run_quantile(d: Data, q: float, name: str) -> float | None:
    span = d.grid[-1] - d.grid[0] + 1 if d.grid else 0
    curves = d.histogram_quantile(q, name, window=span + 2)
    last = [c[-1] for c in curves.values() if c and not math.isnan(c[-1])]
    return round(max(last), 4) if last else None


def nanmax(curves: list[Curve]) -> float | None:
    values = [v for _, c in curves for v in c if not math.isnan(v)]
    return max(values) if values else None


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    d = Data(report)
    errors: dict[str, float] = {}
    for s in d.select("kvstore_requests_total"):
        if s["labels"].get("code") != "OK":
            key = s["labels"].get("reason") or s["labels"]["code"]
            errors[key] = errors.get(key, 0) + d.total(s)
    requests = counter_total(d, "kvstore_requests_total")
    batch_sum = counter_total(d, "kvstore_batch_records_sum")
    batch_count = counter_total(d, "kvstore_batch_records_count")
    summary = {
        "requests": round(requests),
        "requests_per_s_max": round(nanmax(list(d.by(d.select("kvstore_requests_total"), lambda s: "all",
                                                       d.rate).items())) or 0, 1),
        "errors_by_code_or_reason": {k: round(v) for k, v in sorted(errors.items())},
        "commit_latency_p50_s_whole_run": whole_run_quantile(d, 0.5, "kvstore_commit_latency_seconds"),
        "commit_latency_p99_s_whole_run": whole_run_quantile(d, 0.99, "kvstore_commit_latency_seconds"),
        "batches": round(batch_count), "batch_records_mean": round(batch_sum / batch_count, 2) if batch_count else None,
        "lag_records_max": nanmax(lag(d)), "open_txn_age_s_max": nanmax(open_txn_age(d)),
        "leader_changes": round(counter_total(d, "kvstore_leader_changes_total")),
        "w3_rejections": round(counter_total(d, "kvstore_w3_rejections_total")),
        "fencings": round(counter_total(d, "kvstore_fencings_total")),
        "unknown_outcomes": round(counter_total(d, "kvstore_unknown_outcomes_total")),
        "rebuilds": round(counter_total(d, "kvstore_rebuilds_total")),
        "reason_label_present": any("reason" in s["labels"] for s in d.select("kvstore_requests_total")),
    }
    return summary


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = Data(report)
    titles = dashboard_titles()
    rows = math.ceil(len(titles) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(16, 3.3 * rows), sharex=True, squeeze=False)
    for ax, title in zip(axes.flat, titles, strict=False):
        compute, unit, bars = PANELS[title]
        curves = [(name, values) for name, values in compute(d) if any(not math.isnan(v) and v for v in values)]
        for name, values in curves:
            if bars:
                ax.step(d.grid, [0 if math.isnan(v) else v for v in values], where="mid", label=name, linewidth=1.2)
            else:
                ax.plot(d.grid, values, label=name, linewidth=1.1)
        if not curves:
            ax.text(0.5, 0.5, "no data (all zero)", transform=ax.transAxes, ha="center", va="center", color="gray")
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if "latency" in title or "batch size" in title:
            ax.set_yscale("log")
        for e in report["events"]:
            if e["event"] != "load stopped":
                ax.axvline(e["t"], color="red" if e["event"] == "SIGKILL" else "gray", linestyle="--", linewidth=0.8)
        if curves:
            ax.legend(fontsize=6, ncol=2 if len(curves) > 6 else 1, loc="upper left", framealpha=0.6)
    for ax in axes.flat[len(titles):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the load started", fontsize=8)
    marks = "; ".join(f"{e['event']} {e.get('node', '')}{'shard ' + str(e['shard']) if 'shard' in e else ''} "
                      f"at {e['t']:.0f}s" for e in report["events"])
    fig.suptitle(f"bench/dashboard.py at {report['utc']}: 3 nodes, {SHARDS} shards, one local broker, "
                 f"{report['machine']['nproc']} cores shared\n{marks} (dashed lines)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def render(path: Path) -> None:
    """The summary and the plot again, from a recorded run's JSON (the summary is written back)."""
    report = json.loads(path.read_text())
    report["summary"] = summarize(report)
    path.write_text(json.dumps(report, separators=(",", ":")) + "\n")
    plot(report, RESULTS_DIR / "dashboard.png")
    print(json.dumps(report["summary"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=75.0, help="load duration (default 75)")
    parser.add_argument("--kill-at", type=float, default=25.0, help="SIGKILL shard 0's leader at (s; -1: never)")
    parser.add_argument("--down-s", type=float, default=8.0, help="then restart it after (s)")
    parser.add_argument("--inject-at", type=float, default=50.0, help="foreign record into shard 1 at (s; -1: never)")
    parser.add_argument("--writers", type=int, default=12)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--bad-per-s", type=float, default=0.5, help="empty-key Puts per second (0: none)")
    parser.add_argument("--session-timeout-ms", type=int, default=1500)
    parser.add_argument("--lead-in-s", type=float, default=3.0, help="scraping before the load starts")
    parser.add_argument("--tail-s", type=float, default=5.0, help="scraping after the load stopped")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="only redo the summary (written back into the JSON) and the plot of a recorded run")
    args = parser.parse_args(argv)
    titles = dashboard_titles()  # fails before anything starts if the dashboard changed
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    if args.render:
        render(args.render)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through the finally blocks
    wall = time.monotonic()
    info = {"nproc": len(os.sched_getaffinity(0)), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "platform": platform.platform(), "kafka": KAFKA_VERSION}
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    recorded = run(args)
    report: dict[str, Any] = {
        "bench": "dashboard", "utc": stamp, "machine": info, "panels": titles,
        "settings": {k: v for k, v in vars(args).items() if k != "render"} | {
            "nodes": NODES, "shards": SHARDS, "scrape_interval_s": SCRAPE_INTERVAL_S, "rate_window_s": RATE_WINDOW_S,
            "keys": KEYS, "value_bytes": VALUE_BYTES},
        **recorded,
    }
    report["summary"] = summarize(report)
    report["wall_seconds"] = round(time.monotonic() - wall, 1)
    report["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    (RESULTS_DIR / "dashboard.json").write_text(json.dumps(report, separators=(",", ":")) + "\n")
    plot(report, RESULTS_DIR / "dashboard.png")
    print(json.dumps({"bench": "dashboard", "utc": stamp, **report["summary"],
                      "client_ok": report["client_ok"], "client_errors": report["client_errors"],
                      "wall_seconds": report["wall_seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
