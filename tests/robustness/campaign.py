"""One robustness campaign (docs/robustness.md): the cluster of `cluster.SoakCluster`, every
workload at once, the faults of `nemesis.plan(seed)`, then every check, the JSON report and the
timeline.

Workloads: single-key registers (linearizability, the project's checker), the bank over
cross-shard transactions, fresh-key writers (the demo's: nothing acknowledged lost, nothing
applied twice, nothing reported failed applied), a bulk load through the batch RPC, and watchers
of the writers' keys.

Checks, after the faults are undone and the workloads stopped: linearizable; every bank sum and
the final one equal the total, no account written more often than transfers allowed; no
acknowledged write lost; no request id applied twice; no write reported failed that was applied
(W7); every replica of every shard equal; nothing left prepared; watch streams without gaps or
repeats; `kvstore audit` clean. A failed campaign keeps everything under its directory: every
process's log, the registers' history, the brokers' data (the WAL) and the nodes' LevelDBs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.client import Client, KeyValue
from kvstore.core.sharding import shard_of
from kvstore.dev import demo
from tests.integration.bank import Bank
from tests.integration.registers import Registers
from tests.robustness import nemesis, report
from tests.robustness.cluster import BROKERS, NODES, SoakCluster
from tests.robustness.net import machine_lock, require_root
from tests.robustness.workloads import CLIENT_MAX_BACKOFF_S, BulkLoad, ReadBack, Recorder, Watchers
from tests.waiting import wait_until

log = logging.getLogger("soak")

REGISTER_KEYS = 4  # per `clients`: three threads on four keys (the checker's search grows with overlap)
REGISTER_ROTATE_S = 20.0
ACCOUNTS = 8
WRITES_PREFIX = "fresh"
BULK_PREFIX = "bulk"
PROGRESS_EVERY_S = 10.0
SETTLE_TIMEOUT_S = 240.0


@dataclasses.dataclass(frozen=True)
class Settings:
    duration_s: float
    seed: int
    out: Path
    shards: int = 3  # each on 3 of the 5 nodes; more shards cost CPU the 2 cores of CI do not have
    disk_mb: int = 512
    faults: bool = True  # False: the same run without any fault, the baseline of its figures
    clients: int = 1  # a multiplier of the workloads' client threads (writers, registers, transfers)
    snapshot: bool | None = None  # None: when the campaign is long enough (nemesis.SNAPSHOT_MIN_DURATION_S)
    audit: bool = True
    keep: bool = False  # keep the WAL and the nodes' data even when every check passed


def accounts(shards: int) -> list[bytes]:
    """ACCOUNTS account keys or more, every shard holding one (transfers cross every shard)."""
    keys: list[bytes] = []
    covered: set[int] = set()
    i = 0
    while len(keys) < ACCOUNTS or len(covered) < shards:
        key = f"acct-{i}".encode()
        if len(keys) < ACCOUNTS or shard_of(key, shards) not in covered:
            keys.append(key)
            covered.add(shard_of(key, shards))
        i += 1
    return keys


def _logging(out: Path) -> None:
    handler = logging.FileHandler(out / "campaign.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("soak: %(message)s"))
    for name in ("soak",):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.handlers = [handler, console]
        logger.propagate = False


def run(settings: Settings) -> dict[str, Any]:
    """Run the campaign; returns the report (also written to `out`/report.json). SIGTERM (and
    SIGINT, which a shell's background job ignores) ends it early: the report of what ran, the
    cluster stopped and kept, the namespaces and disks removed."""
    require_root()
    signal.signal(signal.SIGTERM, _interrupted)
    with machine_lock():
        return _run(settings)


def _interrupted(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run(settings: Settings) -> dict[str, Any]:
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    earlier = _clear_earlier_run(out)
    _logging(out)
    if earlier:
        log.info("removed an earlier run's %s from %s", ", ".join(earlier), out)
    episodes = nemesis.plan(settings.seed, settings.duration_s, snapshot=settings.snapshot) if settings.faults else []
    log.info("seed %d, %.0f s, %d fault episodes planned, output in %s", settings.seed, settings.duration_s,
             len(episodes), out)
    cluster = SoakCluster(out, shards=settings.shards, disk_mb=settings.disk_mb)
    anomalies: dict[str, list[str]] = {}
    checks: dict[str, str] = {}
    extra: dict[str, Any] = {}
    recorder: Recorder | None = None
    done: list[nemesis.Done] = []
    registers: Registers | None = None
    faults: nemesis.Nemesis | None = None
    try:
        log.info("starting 3 brokers and 5 nodes in their own network namespaces")
        cluster.start()
        recorder = Recorder(started=time.monotonic())
        endpoints = cluster.endpoints
        register_threads = 3 * settings.clients
        registers = Registers(endpoints, [f"reg-{i}".encode() for i in range(REGISTER_KEYS * settings.clients)],
                              threads=register_threads,
                              seed=settings.seed, rotate_s=REGISTER_ROTATE_S, observe=recorder.observe,
                              max_backoff_s=CLIENT_MAX_BACKOFF_S)
        bank = Bank(endpoints, accounts(settings.shards), observe=recorder.observe, seed=settings.seed,
                    sum_pause_s=0.5, max_backoff_s=CLIENT_MAX_BACKOFF_S)
        bank.open_accounts()
        writes = demo.Workload(endpoints, settings.shards, writers_per_shard=2 * settings.clients, prefix=WRITES_PREFIX,
                               observe=recorder.observe, max_backoff_s=CLIENT_MAX_BACKOFF_S)
        watchers = Watchers(endpoints, f"{WRITES_PREFIX}/".encode(), settings.shards).start()
        reads = ReadBack(endpoints, writes, observe=recorder.observe, threads=2 * settings.clients,
                         seed=settings.seed)
        bulk = BulkLoad(endpoints, BULK_PREFIX, observe=recorder.observe)
        registers.start()
        bank.start(transferers=min(4, 2 + settings.clients), summers=1)
        writes.start()
        reads.start()
        bulk.start()
        faults = nemesis.Nemesis(cluster, episodes, recorder.started, out).start()
        _progress(recorder, settings.duration_s, faults)
        log.info("the campaign's time is up: undoing the faults in progress")
        faults.stop()
        done = sorted(faults.done, key=lambda d: d.episode.index)
        extra["process_exits"] = faults.process_exits
        reads.stop()
        writes.stop()
        registers.stop()
        bank.finish()
        bulk.stop()
        _heal(cluster)
        log.info("checking")
        _check(cluster, settings, anomalies, checks, registers=registers, bank=bank, writes=writes, bulk=bulk,
               watchers=watchers, extra=extra)
        anomalies["read-back"] = reads.anomalies
        checks["read-back"] = "ok" if not reads.anomalies else f"{len(reads.anomalies)} anomalies"
        extra["read_back"] = {"reads": reads.reads}
        log.info("check read-back: %s", checks["read-back"])
        watchers.stop()
        if settings.audit:
            _audit(cluster, faults, anomalies, checks)
    except Exception as exc:  # the campaign itself failed: reported as such, everything kept
        log.exception("the campaign failed")
        anomalies.setdefault("campaign-error", []).append(f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt as exc:
        log.warning("interrupted (%s): stopping the cluster, keeping it", exc)
        anomalies.setdefault("campaign-error", []).append(f"interrupted ({exc}): the checks did not run")
    finally:
        if faults is not None:  # interrupted or failed mid-run: no fault (nor the supervisor) outlives it
            faults.stop(timeout_s=60)
            done = sorted(faults.done, key=lambda d: d.episode.index)  # what ran, even if cut short
        duration = (time.monotonic() - recorder.started) if recorder else 0.0
        result = report.build(
            seed=settings.seed, duration_s=duration, operations=recorder.by_outcome() if recorder else {},
            episodes=[d.as_dict() for d in done], anomalies=anomalies, checks=checks,
            extra={"cluster": {"brokers": BROKERS, "nodes": NODES, "shards": settings.shards,
                               "wal_replication_factor": 3, "min_insync_replicas": 2, "shard_replicas": 3},
                   "replay": f"make soak SEED={settings.seed} DURATION={int(settings.duration_s)}", **extra})
        (out / "report.json").write_text(json.dumps(result, indent=2) + "\n")
        if recorder is not None:
            title = (f"seed {settings.seed}: {result['operations']['total']} operations, "
                     f"{result['faults']['total']} faults, {result['anomalies']['total']} anomalies")
            (out / "timeline.svg").write_text(report.timeline_svg(recorder.buckets, result["episodes"], duration,
                                                                   title))
        if not result["ok"] and registers is not None:
            _save_history(out, registers)
        _stop(cluster, out, keep=settings.keep or not result["ok"])
    log.info("%s: %d operations, %d faults, %d anomalies; report %s", "PASSED" if result["ok"] else "FAILED",
             result["operations"]["total"], result["faults"]["total"], result["anomalies"]["total"],
             out / "report.json")
    return result


# What a run writes into its directory. A replay of the same seed (or a run killed before it
# cleaned up) finds them there: brokers and nodes started on an earlier run's data would carry its
# WAL, its prepared transactions and its LevelDBs into this run.
RUN_ENTRIES = ("campaign.log", "clock", "history.jsonl", "kafka", "kept", "logs", "nodes", "report.json",
               "snapshots", "timeline.svg")


def _clear_earlier_run(out: Path) -> list[str]:
    removed = []
    for name in RUN_ENTRIES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def _progress(recorder: Recorder, duration_s: float, faults: nemesis.Nemesis) -> None:
    while (elapsed := time.monotonic() - recorder.started) < duration_s:
        time.sleep(min(PROGRESS_EVERY_S, max(0.0, duration_s - elapsed)))
        log.info("%4.0f s: %d operations, %d fault episodes done", time.monotonic() - recorder.started,
                 recorder.operations(), len(faults.done))


def _heal(cluster: SoakCluster) -> None:
    """Every fault undone whatever happened to the nemesis: links, disks, clocks, processes."""
    cluster.net.heal()
    for name, disk in cluster.disks.items():
        disk.empty()
        cluster.set_clock_offset(name, 0)
    for i in range(BROKERS):
        cluster.kafka.resume_node(i)
        cluster.kafka.start_node(i, wait=True, timeout_s=120)
    for name in cluster.node_names:
        cluster.resume_node(name)
        if not cluster.node_alive(name):
            cluster.start_node(name)
    cluster.wait_settled(SETTLE_TIMEOUT_S)


def _check(cluster: SoakCluster, settings: Settings, anomalies: dict[str, list[str]], checks: dict[str, str], *,
           registers: Registers, bank: Bank, writes: demo.Workload, bulk: BulkLoad, watchers: Watchers,
           extra: dict[str, Any]) -> None:
    def record(name: str, found: list[str]) -> None:
        anomalies[name] = found
        checks[name] = "ok" if not found else f"{len(found)} anomalies"
        log.info("check %s: %s", name, checks[name])

    verdict = registers.check()
    record("linearizable", [verdict] if verdict else [])
    extra["registers"] = {"keys": len(registers.keys), "operations": len(registers.history)}

    with cluster.client(timeout_s=60) as client:
        record("bank", bank.check(client, timeout_s=SETTLE_TIMEOUT_S))
        extra["bank"] = {"sums": len(bank.sums), "transfers": dict(bank.outcomes)}

        verdict_w = demo.verify(client, writes, timeout_s=SETTLE_TIMEOUT_S)
        record("acknowledged-lost", verdict_w.lost_examples if verdict_w.acked_lost else [])
        record("failed-but-applied", verdict_w.failed_applied_examples if verdict_w.failed_but_applied else [])
        record("replicas-equal", [] if verdict_w.replicas_equal else
               [json.dumps(verdict_w.replicas, sort_keys=True)[:2000]])
        fresh = _scan(client, f"{WRITES_PREFIX}/".encode())
        stored = {kv.key: (kv.value, kv.version) for kv in fresh}
        record("applied-twice", [f"{k!r} at version {v}" for k, (_, v) in stored.items() if v > 1][:20])
        extra["writes"] = verdict_w.summary()

        bulk_stored = {kv.key: (kv.value, kv.version) for kv in _scan(client, f"{BULK_PREFIX}/".encode())}
        record("bulk-load", bulk.check(bulk_stored))
        extra["bulk_load"] = {"batches_acknowledged": len(bulk.acked), "rows_acknowledged": bulk.rows,
                              "batches_unfinished": len(bulk.unfinished)}

        ends: dict[int, int] = {}
        for kv in fresh:
            shard = shard_of(kv.key, settings.shards)
            ends[shard] = max(ends.get(shard, -1), kv.mod_revision)
        try:
            wait_until(lambda: watchers.caught_up(ends), 120, interval_s=0.5, what="the watchers to catch up")
            record("watch", watchers.check(stored))
        except AssertionError as exc:
            record("watch", [f"not caught up: {exc}", *watchers.check(stored)[:5]])
        extra["watch"] = {"events": watchers.events, "reopened": watchers.reopened}
        record("prepared-left", _prepared_left(client))


def _prepared_left(client: Client) -> list[str]:
    """The transactions still prepared once every fault is undone (T3: each is resolved in time)."""
    deadline = time.monotonic() + 120
    while True:
        prepared, unreachable = client.prepared_transactions()
        if (not prepared and not unreachable) or time.monotonic() > deadline:
            return ([f"{t.txn_id} at shard {t.shard} ({t.age_ms} ms old)" for t in prepared]
                    + [f"{member} did not answer" for member in unreachable])
        time.sleep(1.0)


def _scan(client: Client, prefix: bytes) -> list[KeyValue]:
    return list(client.scan_all(prefix=prefix, limit=1000, timeout_s=60))


def _audit(cluster: SoakCluster, faults: nemesis.Nemesis, anomalies: dict[str, list[str]],
           checks: dict[str, str]) -> None:
    cluster.snapshot_dir.mkdir(parents=True, exist_ok=True)
    code, tail = nemesis.run_cli(cluster.out / "logs" / "pipeline.log",
                                 [*faults.pipeline_args()[:4], "audit", "--dir", str(cluster.snapshot_dir),
                                  "--master", "local[2]", *faults.pipeline_args()[4:]])
    anomalies["audit"] = [] if code == 0 else [f"kvstore audit exited {code}: {tail[:1000]}"]
    checks["audit"] = "ok" if code == 0 else "anomalies (logs/pipeline.log)"
    log.info("check audit: %s", checks["audit"])


def _save_history(out: Path, registers: Registers) -> None:
    with open(out / "history.jsonl", "w") as f:
        for op in list(registers.history):
            f.write(json.dumps({"client": op.client, "kind": op.kind.value, "key": op.key.decode(errors="replace"),
                                "value": op.value.decode(errors="replace") if op.value is not None else None,
                                "outcome": op.outcome.value if op.outcome else None, "invoke_ns": op.invoke,
                                "complete_ns": op.complete, "output": repr(op.output)}) + "\n")


def _stop(cluster: SoakCluster, out: Path, *, keep: bool) -> None:
    """Stop everything; without `keep`, drop the bulky data (the WAL, the nodes' LevelDBs)."""
    if keep:
        for name in cluster.node_names:  # the node's data lives on its tmpfs: copy it out first
            node_dir = out / "nodes" / name
            if node_dir.exists():
                shutil.copytree(node_dir, out / "kept" / name, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("filler.bin"))
    try:
        cluster.stop()
    finally:
        for i in range(BROKERS):  # the brokers' logs join the nodes' in logs/
            broker_log = out / "kafka" / f"node-{i + 1}" / "broker.log"
            if broker_log.exists():
                shutil.copy(broker_log, out / "logs" / f"b{i + 1}.log")
        if not keep:
            shutil.rmtree(out / "kafka", ignore_errors=True)
            shutil.rmtree(out / "nodes", ignore_errors=True)
            shutil.rmtree(out / "snapshots", ignore_errors=True)

