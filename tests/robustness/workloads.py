"""The campaign's own workloads (the registers, the bank and the fresh-key writers come from
tests/integration and kvstore.dev.demo) and the recorder every workload reports to.

- `BulkLoad`: batches of fresh keys through the store's batch RPC (`Client.write_batch`, what
  `kvstore load` sends), each retried with its own request id and first attempt until it commits
  or the retries run out, as the loader does. Checked: every acknowledged batch is there whole, no
  key is at a version above 1 (a batch applied twice would put it at 2).
- `ReadBack`: linearizable reads of keys the fresh-key writers were told are written. Checked:
  each read finds the acknowledged value (an acknowledged write is visible to every later read).
- `Watchers`: prefix watches over the fresh-key writers' keys from revision 0, resumed after every
  break from the last revision seen of each shard. Checked: per shard, revisions strictly increase
  (no repeat, in order), and once the writers stopped every stored key was seen (no gap).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Sequence

from kvstore.client import Client, KvError, Op, UnknownOutcome
from kvstore.client.errors import BatchIncomplete, RequestExpired
from kvstore.dev.demo import Workload, outcome_of
from tests.integration.registers import Observer

log = logging.getLogger("soak")

BUCKET_S = 1.0
# Every client of the campaign backs off as the library does by default (kvstore.client.retry):
# at 0.1-0.2 s, some 130 client threads retrying against a shard without a leader kept two cores
# busy answering refusals and fetching shard maps, and the brokers starved (the store stood still).
CLIENT_MAX_BACKOFF_S = 1.0
MAX_LATENCIES_PER_BUCKET = 2000  # a bucket's latency sample (the p99 of a second), bounded
BULK_ROWS = 50
BULK_ATTEMPTS = 20
WATCH_REOPEN_PAUSE_S = 0.2


@dataclasses.dataclass
class Bucket:
    ok: int = 0
    failed: int = 0
    unknown: int = 0
    latencies_ms: list[float] = dataclasses.field(default_factory=list)


class Recorder:
    """Every client operation's outcome, per workload and per second of the run."""

    def __init__(self, started: float) -> None:
        self.started = started  # time.monotonic() of the run's start
        self._lock = threading.Lock()
        self.totals: collections.Counter[tuple[str, str]] = collections.Counter()  # (kind, outcome)
        self.buckets: dict[int, Bucket] = {}

    def observe(self, kind: str, outcome: str, start: float, end: float) -> None:
        assert outcome in ("ok", "failed", "unknown"), outcome
        second = int((end - self.started) / BUCKET_S)
        with self._lock:
            self.totals[(kind, outcome)] += 1
            bucket = self.buckets.setdefault(second, Bucket())
            setattr(bucket, outcome, getattr(bucket, outcome) + 1)
            if outcome == "ok" and len(bucket.latencies_ms) < MAX_LATENCIES_PER_BUCKET:
                bucket.latencies_ms.append((end - start) * 1000)

    def operations(self) -> int:
        with self._lock:
            return sum(self.totals.values())

    def by_outcome(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for (kind, outcome), n in sorted(self.totals.items()):
                out.setdefault(kind, {})[outcome] = n
        return out


class BulkLoad:
    """One thread writing batches of fresh keys (module docstring)."""

    def __init__(self, endpoints: Sequence[str], prefix: str, *, observe: Observer, pause_s: float = 0.2) -> None:
        self.endpoints = list(endpoints)
        self.prefix = prefix
        self._observe = observe
        self._pause_s = pause_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bulk-load")
        self.acked: list[int] = []  # batch numbers that committed whole
        self.unfinished: list[int] = []  # batch numbers whose retries ran out (some parts may be in)
        self.rows = 0  # rows acknowledged

    def start(self) -> BulkLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(300)
        assert not self._thread.is_alive(), "the bulk load hangs"

    def key(self, batch: int, row: int) -> bytes:
        return f"{self.prefix}/{batch:07d}/{row:03d}".encode()

    def value(self, batch: int, row: int) -> bytes:
        return f"bulk-{batch}-{row}".encode()

    def _run(self) -> None:
        with Client(self.endpoints, timeout_s=15, max_attempts=50, max_backoff_s=CLIENT_MAX_BACKOFF_S) as client:
            batch = 0
            while not self._stop.is_set():
                ops = [Op.put(self.key(batch, row), self.value(batch, row)) for row in range(BULK_ROWS)]
                request_id = f"{self.prefix}:{batch}"
                first_attempt_ms = int(time.time() * 1000)
                for _attempt in range(BULK_ATTEMPTS):
                    started = time.monotonic()
                    try:
                        client.write_batch(ops, request_id, first_attempt_unix_ms=first_attempt_ms)
                    except RequestExpired:
                        self._observe("bulk-batch", "unknown", started, time.monotonic())
                        self.unfinished.append(batch)
                        break
                    except (BatchIncomplete, UnknownOutcome):  # parts may be in: the same id again, at most once
                        self._observe("bulk-batch", "unknown", started, time.monotonic())
                        time.sleep(0.2)
                        continue
                    except KvError as exc:
                        self._observe("bulk-batch", outcome_of(exc), started, time.monotonic())
                        time.sleep(0.2)
                        continue
                    self._observe("bulk-batch", "ok", started, time.monotonic())
                    self.acked.append(batch)
                    self.rows += BULK_ROWS
                    break
                else:
                    self.unfinished.append(batch)
                batch += 1
                self._stop.wait(self._pause_s)

    def check(self, stored: dict[bytes, tuple[bytes, int]]) -> list[str]:
        """Anomalies, given every stored key under the prefix with (value, version)."""
        anomalies = [f"{key!r} at version {version}: a batch applied twice" for key, (_, version) in stored.items()
                     if version > 1]
        for batch in self.acked:
            missing = [row for row in range(BULK_ROWS)
                       if stored.get(self.key(batch, row), (None, 0))[0] != self.value(batch, row)]
            if missing:
                anomalies.append(f"acknowledged batch {batch}: rows {missing[:5]} missing or changed")
        return anomalies


class ReadBack:
    """Threads reading back acknowledged fresh keys (module docstring)."""

    def __init__(self, endpoints: Sequence[str], writes: Workload, *, observe: Observer, threads: int = 2,
                 seed: int = 0) -> None:
        self.endpoints = list(endpoints)
        self.writes = writes
        self._observe = observe
        self._seed = seed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.anomalies: list[str] = []
        self.reads = 0
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True, name=f"read-back-{i}")
                         for i in range(threads)]

    def start(self) -> ReadBack:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, index: int) -> None:
        rng = random.Random(self._seed * 1000 + index)
        with Client(self.endpoints, timeout_s=15, max_attempts=50, max_backoff_s=CLIENT_MAX_BACKOFF_S) as client:
            while not self._stop.is_set():
                acks = self.writes.acks  # appended to under the workload's lock; reading an index is safe
                if not acks:
                    self._stop.wait(0.1)
                    continue
                ack = acks[rng.randrange(len(acks))]
                started = time.monotonic()
                try:
                    got = client.get(ack.key)
                except KvError:
                    self._observe("read-back", "failed", started, time.monotonic())  # a read changes nothing
                    continue
                self._observe("read-back", "ok", started, time.monotonic())
                with self._lock:
                    self.reads += 1
                    if not got.found or got.value != ack.value:
                        h = got.header
                        where = f" from {h.served_by} at applied revision {h.applied_revision}" if h else ""
                        self.anomalies.append(f"{ack.key!r} acknowledged at revision {ack.revision}, read back "
                                              f"{'absent' if not got.found else repr(got.value[:40])}{where} "
                                              f"at {time.strftime('%H:%M:%S')}")
                        log.warning("read-back anomaly: %s", self.anomalies[-1])
                        del self.anomalies[20:]


class Watchers:
    """Prefix watches from revision 0 over every shard, resumed after each break (module docstring)."""

    def __init__(self, endpoints: Sequence[str], prefix: bytes, shards: int, *, count: int = 2) -> None:
        self.endpoints = list(endpoints)
        self.prefix = prefix
        self.shards = shards
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.last: list[dict[int, int]] = [{} for _ in range(count)]  # per watcher: shard -> last revision
        self.seen: list[dict[bytes, int]] = [{} for _ in range(count)]  # per watcher: key -> times seen
        self.events = [0] * count
        self.reopened = [0] * count
        self.anomalies: list[str] = []
        self._watches: list[object] = [None] * count
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True, name=f"watch-{i}")
                         for i in range(count)]

    def start(self) -> Watchers:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for watch in list(self._watches):
            cancel = getattr(watch, "cancel", None)
            if cancel is not None:
                cancel()
        for t in self._threads:
            t.join(60)

    def caught_up(self, ends: dict[int, int]) -> bool:
        """Every watcher saw each shard up to `ends[shard]` (the last revision written there)."""
        with self._lock:
            return all(last.get(shard, -1) >= end for last in self.last for shard, end in ends.items())

    def _run(self, index: int) -> None:
        with Client(self.endpoints, timeout_s=15, max_attempts=50, max_backoff_s=CLIENT_MAX_BACKOFF_S) as client:
            while not self._stop.is_set():
                with self._lock:
                    starts = {s: self.last[index].get(s, -1) + 1 for s in range(self.shards)}
                try:
                    watch = client.watch(prefix=self.prefix, start_revisions=starts)
                except KvError:
                    self._stop.wait(WATCH_REOPEN_PAUSE_S)
                    continue
                self._watches[index] = watch
                try:
                    for event in watch:
                        self._event(index, event.shard, event.kv.key, event.kv.mod_revision)
                        if self._stop.is_set():
                            break
                except KvError:
                    pass
                finally:
                    watch.cancel()
                with self._lock:
                    self.reopened[index] += 1
                self._stop.wait(WATCH_REOPEN_PAUSE_S)

    def _event(self, index: int, shard: int, key: bytes, revision: int) -> None:
        with self._lock:
            self.events[index] += 1
            last = self.last[index].get(shard, -1)
            if revision <= last:
                self.anomalies.append(f"watcher {index}: shard {shard} revision {revision} after {last} "
                                      f"({key!r}): repeated or out of order at {time.strftime('%H:%M:%S')}")
                if len(self.anomalies) <= 3:
                    log.warning("watch anomaly: %s", self.anomalies[-1])
            self.last[index][shard] = max(last, revision)
            self.seen[index][key] = self.seen[index].get(key, 0) + 1

    def check(self, stored: dict[bytes, tuple[bytes, int]]) -> list[str]:
        """Anomalies once caught up, given every stored key under the prefix."""
        with self._lock:
            anomalies = list(self.anomalies[:20])
            for index, seen in enumerate(self.seen):
                missed = [k for k in stored if k not in seen]
                if missed:
                    anomalies.append(f"watcher {index} missed {len(missed)} changes, e.g. {missed[:3]}")
                repeated = [k for k, n in seen.items() if n > 1]
                if repeated:
                    anomalies.append(f"watcher {index} saw {len(repeated)} changes twice, e.g. {repeated[:3]}")
        return anomalies
