"""WAL append throughput and commit latency: the guarded ShardWriter against two raw baselines.

What the single-writer guard (docs/design.md §4, W1/W2) costs is only visible next to a producer that
does the same Kafka work without it, measured in the same run on the same broker. Three modes:

* ``guard``    - ``wal.ShardWriter.append``: expected-offset header + protobuf envelope per record,
                 a delivery callback per record, the W2 offset check, then commit.
* ``raw_txn``  - a plain transactional producer: begin, produce, flush, commit. Same Kafka round
                 trips as the guard (and the same short pause between transactions), none of its
                 per-record work or checks.
* ``idem``     - a non-transactional idempotent producer: produce, flush. No transaction at all,
                 so it shows what transactions themselves cost.

All three use the writer's own producer settings (``wal.clients.producer_config``: acks=all,
linger.ms=2), so only the guard and the transaction differ. Each (mode, batch size) series gets a
fresh one-partition topic. The modes of one batch size run in alternating rounds, so a noisy
neighbour on a small machine hurts all three alike. The last stdout line is one JSON object.
How to run it and how to read it: bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import confluent_kafka
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

import wal
from kvstore import limits
from wal import clients, record
from wal.broker import KAFKA_VERSION, LocalKafka

MODES = ("guard", "raw_txn", "idem")
BATCH_SIZES = (1, 10, 100, 1000)
RECORD_BYTES = 100
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Per series (mode, batch size): a time budget and a batch cap, whichever is hit first.
# Rounds alternate the modes so that drift (JVM JIT, neighbours) hits all three; the broker warm-up
# runs transactions first, because a cold JVM makes the first series several times slower.
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"seconds": 4.0, "max_batches": {1: 20000, 10: 10000, 100: 4000, 1000: 800}, "rounds": 6,
              "warmup": 5, "broker_warmup_s": 4.0},
    "full": {"seconds": 15.0, "max_batches": {1: 60000, 10: 30000, 100: 12000, 1000: 3000}, "rounds": 12,
             "warmup": 20, "broker_warmup_s": 10.0},
}
MAX_ERRORS = 5  # per series; a broken writer must not turn the benchmark into a retry loop

Batch = Callable[[], None]
_SIGNALS: list[int] = []


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived; raised between batches, never from inside a librdkafka call."""


def _on_signal(signum: int, frame: object) -> None:
    # Only record it: an exception raised while flush() runs is turned by confluent-kafka into a
    # SystemError, which the writer reports as an aborted batch, and the interrupt is lost.
    _SIGNALS.append(signum)


def check_signals() -> None:
    if _SIGNALS:
        raise Interrupted(signal.Signals(_SIGNALS[0]).name)


@dataclasses.dataclass
class Runner:
    """One mode's producer on its own topic: one batch per call, close, and counters to report."""

    batch: Batch
    close: Batch
    stats: Callable[[], dict[str, Any]] = dict


def make_guard(bootstrap: str, topic: str, txn_id: str, payloads: Sequence[bytes]) -> Runner:
    """The path under test, exactly as the store uses it: fence() once, then append() per batch."""
    writer = wal.ShardWriter(wal.WriterConfig(bootstrap, topic, 0, txn_id, wal.WriterIdentity("bench"),
                                              max_batch_records=limits.MAX_BATCH_RECORDS,
                                              max_batch_bytes=limits.MAX_BATCH_BYTES,
                                              max_record_bytes=limits.MAX_WAL_RECORD_BYTES))
    writer.fence()

    def batch() -> None:
        writer.append(payloads)

    return Runner(batch, writer.close, lambda: dataclasses.asdict(writer.stats))


def make_raw_txn(bootstrap: str, topic: str, txn_id: str, payloads: Sequence[bytes]) -> Runner:
    """Same transactional producer settings as the writer, without header, envelope or checks."""
    producer = Producer(clients.producer_config(bootstrap, txn_id, 60_000))
    producer.init_transactions(10.0)
    # The writer's pause between transactions (WriterConfig.commit_gap_ms), so that both modes
    # dodge librdkafka's 20 ms CONCURRENT_TRANSACTIONS back-off alike.
    gap_s, ended_at = wal.WriterConfig.commit_gap_ms / 1000, [0.0]

    def batch() -> None:
        if (pause := gap_s - (time.monotonic() - ended_at[0])) > 0:
            time.sleep(pause)
        producer.begin_transaction()
        try:
            for payload in payloads:
                producer.produce(topic, payload, partition=0)
            if producer.flush(10.0):
                raise KafkaException("raw_txn: records undelivered after flush")
            producer.commit_transaction(10.0)
        except KafkaException:
            with contextlib.suppress(KafkaException):  # best effort, so the next batch can begin
                producer.abort_transaction(10.0)
            raise
        finally:
            ended_at[0] = time.monotonic()

    return Runner(batch, lambda: _close(producer))


def make_idem(bootstrap: str, topic: str, txn_id: str, payloads: Sequence[bytes]) -> Runner:
    """The writer's settings minus transactional.id: idempotent, acks=all, no commit round trip."""
    config = clients.producer_config(bootstrap, txn_id, 60_000)
    del config["transactional.id"], config["transaction.timeout.ms"]
    producer = Producer(config)

    def batch() -> None:
        for payload in payloads:
            producer.produce(topic, payload, partition=0)
        if producer.flush(10.0):
            raise KafkaException("idem: records undelivered after flush")

    return Runner(batch, lambda: _close(producer))


FACTORIES = {"guard": make_guard, "raw_txn": make_raw_txn, "idem": make_idem}


def _close(producer: Producer) -> None:
    """Flush what is left (nothing, normally) and release the client's threads and sockets."""
    producer.flush(5.0)
    with contextlib.suppress(KafkaException, RuntimeError):
        producer.close()


def create_topics(admin: AdminClient, names: list[str]) -> None:
    """One partition each, the cluster's default replication: one WAL shard per topic."""
    for future in admin.create_topics([NewTopic(n, 1) for n in names], request_timeout=30).values():
        future.result(30)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; with few batches p99 is simply the worst one, which is honest."""
    assert sorted_values, "no samples"
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def run_size(
    bootstrap: str, admin: AdminClient, run_id: str, size: int, profile: dict[str, Any]
) -> dict[str, Any]:
    """All three modes at one batch size, in alternating rounds (fairness under a noisy machine)."""
    payloads = [os.urandom(RECORD_BYTES) for _ in range(size)]
    topics = {mode: f"bench-wal-{run_id}-{mode}-b{size}" for mode in MODES}
    create_topics(admin, list(topics.values()))
    runners: dict[str, Runner] = {}
    latencies: dict[str, list[float]] = {mode: [] for mode in MODES}
    errors: dict[str, list[str]] = {mode: [] for mode in MODES}
    # Client CPU (this process, librdkafka threads included): the guard's cost without the waiting.
    cpu = dict.fromkeys(MODES, 0.0)
    try:
        for mode in MODES:
            txn_id = f"bench-{run_id}-{mode}-b{size}"
            runners[mode] = FACTORIES[mode](bootstrap, topics[mode], txn_id, payloads)
            for _ in range(profile["warmup"]):
                check_signals()
                runners[mode].batch()
        rounds: int = profile["rounds"]
        per_round_s = profile["seconds"] / rounds
        per_round_batches = max(1, profile["max_batches"][size] // rounds)
        for round_no in range(rounds):
            order = MODES[round_no % 3:] + MODES[:round_no % 3]  # rotate who goes first
            for mode in order:
                if len(errors[mode]) >= MAX_ERRORS:
                    continue
                batch = runners[mode].batch
                deadline, cpu_start = time.perf_counter() + per_round_s, time.process_time()
                for _ in range(per_round_batches):
                    check_signals()
                    started = time.perf_counter()
                    try:
                        batch()
                    except (wal.WalError, KafkaException) as exc:
                        errors[mode].append(f"{type(exc).__name__}: {exc}")
                        if len(errors[mode]) >= MAX_ERRORS:
                            break
                        continue
                    ended = time.perf_counter()
                    latencies[mode].append(ended - started)
                    if ended >= deadline:
                        break
                cpu[mode] += time.process_time() - cpu_start
        stats = {mode: runner.stats() for mode, runner in runners.items()}
    finally:
        for runner in runners.values():
            runner.close()
    out: dict[str, Any] = {}
    for mode in MODES:
        values, n = sorted(latencies[mode]), len(latencies[mode])
        busy = sum(values)
        ms = {"mean_ms": busy / max(n, 1), "cpu_ms_per_batch": cpu[mode] / max(n, 1),
              "p50_ms": percentile(values, 50) if n else 0.0, "p99_ms": percentile(values, 99) if n else 0.0}
        out[mode] = {"batches": n, "records": n * size, "seconds": round(busy, 4),
                     "records_per_s": round(n * size / busy, 1) if busy else 0.0,
                     **{k: round(v * 1000, 3) if n else None for k, v in ms.items()},
                     "errors": len(errors[mode]), "first_errors": errors[mode][:3],
                     **({"writer_stats": stats[mode]} if stats[mode] else {})}
    return out


def warm_broker(bootstrap: str, admin: AdminClient, run_id: str, seconds: float) -> None:
    """Transactions of 100 records on a scratch topic until the broker's hot paths are compiled."""
    topic = f"bench-wal-{run_id}-warmup"
    create_topics(admin, [topic])
    runner = make_raw_txn(bootstrap, topic, f"bench-{run_id}-warmup", [os.urandom(RECORD_BYTES)] * 100)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            check_signals()
            runner.batch()
    finally:
        runner.close()


def encode_cost_us() -> float:
    """The guard's per-record envelope work alone (protobuf + header), to explain part of the gap."""
    writer, payload, n = wal.WriterIdentity("bench"), os.urandom(RECORD_BYTES), 20_000
    started = time.perf_counter()
    for offset in range(n):
        record.encode(offset, writer, payload)
    return round((time.perf_counter() - started) / n * 1e6, 3)


def machine_info() -> dict[str, Any]:
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "confluent_kafka": getattr(confluent_kafka, "__version__", None) or str(confluent_kafka.version()),
        "librdkafka": confluent_kafka.libversion()[0],
        "kafka": KAFKA_VERSION,
    }


@contextlib.contextmanager
def broker(bootstrap: str | None) -> Iterator[str]:
    """The given cluster, or a private single-node broker in a temp dir, always stopped and removed."""
    if bootstrap:
        yield bootstrap
        return
    with tempfile.TemporaryDirectory(prefix="bench-wal-kafka-") as data_dir:
        kafka = LocalKafka(data_dir=Path(data_dir), nodes=1)
        try:
            kafka.start()
            yield kafka.bootstrap_servers
        finally:
            kafka.stop()


def print_table(results: dict[int, dict[str, Any]], ratios: dict[str, float | None]) -> None:
    print(f"{'batch':>6} {'mode':<8} {'batches':>8} {'records/s':>11} {'mean ms':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'cpu ms':>7} {'errors':>6}")
    for size, by_mode in results.items():
        for mode in MODES:
            r = by_mode[mode]
            ms = [f"{'-' if r[k] is None else f'{r[k]:.2f}':>{w}}"
                  for k, w in (("mean_ms", 8), ("p50_ms", 8), ("p99_ms", 8), ("cpu_ms_per_batch", 7))]
            print(f"{size:>6} {mode:<8} {r['batches']:>8} {r['records_per_s']:>11,.0f} {' '.join(ms)} "
                  f"{r['errors']:>6}")
        pairs = ("guard_vs_raw_txn", "guard_vs_idem", "raw_txn_vs_idem")
        shown = [(p, ratios[f"ratio_{p}_batch{size}"]) for p in pairs]
        print(f"{'':>6} " + "   ".join(f"{p} = {'n/a' if v is None else f'{v:.3f}'}" for p, v in shown))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short series (whole run < 2 min)")
    parser.add_argument("--bootstrap", metavar="HOST:PORT", help="use this cluster instead of starting one")
    args = parser.parse_args(argv)
    # A signal must unwind through the finally that stops our broker, or the JVM is orphaned.
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    profile_name = "quick" if args.quick else "full"
    profile = PROFILES[profile_name]
    run_id = uuid.uuid4().hex[:8]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    info = machine_info()
    wall = time.monotonic()
    results: dict[int, dict[str, Any]] = {}
    try:
        with broker(args.bootstrap) as bootstrap:
            admin = AdminClient({"bootstrap.servers": bootstrap})
            warm_broker(bootstrap, admin, run_id, profile["broker_warmup_s"])
            for size in BATCH_SIZES:
                results[size] = run_size(bootstrap, admin, run_id, size, profile)
                elapsed = time.monotonic() - wall
                print(f"# batch {size} done after {elapsed:.1f}s", file=sys.stderr, flush=True)
    except Interrupted as exc:
        print(f"# interrupted by {exc}; broker stopped, nothing recorded", file=sys.stderr)
        return 128 + _SIGNALS[0]
    ratios: dict[str, float | None] = {}
    for size, r in results.items():
        rate = {mode: r[mode]["records_per_s"] for mode in MODES}
        for a, b in (("guard", "raw_txn"), ("guard", "idem"), ("raw_txn", "idem")):
            ratios[f"ratio_{a}_vs_{b}_batch{size}"] = round(rate[a] / rate[b], 4) if rate[b] else None
        p50 = (r["guard"]["p50_ms"], r["raw_txn"]["p50_ms"])
        ratios[f"p50_latency_guard_vs_raw_txn_batch{size}"] = round(p50[0] / p50[1], 4) if all(p50) else None
    print_table(results, ratios)
    report = {
        "bench": "wal_append", "profile": profile_name, "utc": stamp, **ratios,
        "record_bytes": RECORD_BYTES, "series_seconds": profile["seconds"], "rounds": profile["rounds"],
        "warmup_batches": profile["warmup"], "own_broker": args.bootstrap is None,
        "guard_encode_us_per_record": encode_cost_us(), "machine": info,
        "wall_seconds": round(time.monotonic() - wall, 1),
        "results": {str(size): by_mode for size, by_mode in results.items()},
    }
    line = json.dumps(report, sort_keys=False)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for name in (f"wal_append-{profile_name}-{stamp}.json", f"wal_append-latest-{profile_name}.json"):
        (RESULTS_DIR / name).write_text(json.dumps(report, indent=2) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
