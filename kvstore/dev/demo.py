"""`kvstore demo failover`: kill a shard's leader under load, show the takeover, then verify.

It kills only a process it was given a way to kill (`failover(..., kill=...)`): the CLI passes
`children.dev_cluster_kill(data_dir)`, which signals only a node the local dev cluster recorded
as its own child (`make up`), never a pid some node reports; bench/failover.py does the same
for the dev cluster it started.

One workload and one verification, shared by the demo, the fault tests and bench/failover.py:

* `Workload`: writer threads, a few per shard, each putting fresh keys of its own shard with
  a request id through the client (which routes, follows hints and retries with the same id).
  Every acknowledgement is recorded with the time it arrived, every write the client raised an
  error for with its key and its outcome (`outcome_of`, W7): `unknown` for `UnknownOutcome`
  and, for a write, `DeadlineExceeded` (may or may not have committed), `failed` for any other
  `KvError` (the server said nothing was committed). A writer never retries a key itself, so
  a key is present afterwards exactly when its one write was applied.
* `verify`: wait until every replica of every shard reached the partition's end, compare
  replica digests per shard, read every key of the run back (linearizable, retried while a
  shard is between leaders, up to a deadline) and check that every acknowledged write is there
  with its value and version 1 (a request applied twice would show version 2), and that no
  definitely failed write is there.

The verdict (`Verdict`, and the demo's result: JSON with `--output json`, else a table):

* `acked`, `acked_lost` (acknowledged, not read back), `duplicates` (a key at version > 1),
  `replicas_equal` (every replica of every shard at one offset with one digest);
* `failed`: writes the client raised an error for, `unknown_outcomes` of them with an unknown
  outcome and the rest definitely failed;
* `failed_but_applied`: definitely failed writes whose key is present afterwards: a lie to the
  client, must be 0;
* `unknown_applied`: how many of the `unknown_outcomes` writes are present afterwards (either
  way is correct; it shows which way the unknowns went);
* `ok`: `acked_lost == 0`, `duplicates == 0`, `replicas_equal` and `failed_but_applied == 0`.

Unavailability is measured from the client's side: per shard, the longest time between two
consecutive acknowledgements (and from the last one to the end of the run). It includes the
failure detection (the group's session timeout for a SIGKILL), the rebalance, fencing,
bootstrap of the short tail, and the client's retry back-off.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import grpc

from kvstore.client import (
    Client,
    DeadlineExceeded,
    KvError,
    NotLeader,
    RequestExpired,
    ShardMap,
    Unavailable,
    UnknownOutcome,
)
from kvstore.client.security import open_channel
from kvstore.core.sharding import shard_of
from kvstore.dev.children import Kill
from kvstore.v1 import cluster_pb2, cluster_pb2_grpc

WRITE_TIMEOUT_S = 10.0  # one put, retries included: longer than any takeover we accept
MAX_KEYS_PER_WRITER = 1_000_000  # bound on a writer's key space (it stops when it runs out)
EXAMPLES = 5  # keys listed per problem in the verdict

# A write that raised one of these may or may not have committed (W7). Every other KvError from a
# write means the server said nothing was committed (the client's contract).
# RequestExpired: the retry was refused and the first attempt's outcome cannot be learnt any more.
UNKNOWN_OUTCOME_ERRORS: tuple[type[KvError], ...] = (UnknownOutcome, DeadlineExceeded, RequestExpired)

Outcome = Literal["failed", "unknown"]


def outcome_of(error: KvError) -> Outcome:
    """How the client reported a write that raised `error`: `unknown` (may have committed) or
    `failed` (definitely not committed)."""
    return "unknown" if isinstance(error, UNKNOWN_OUTCOME_ERRORS) else "failed"


@dataclasses.dataclass(frozen=True, slots=True)
class Ack:
    key: bytes
    value: bytes
    shard: int
    revision: int
    at_s: float  # time.monotonic() when the acknowledgement arrived


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """A write the client raised an error for (the writer moves on to a fresh key)."""

    key: bytes
    shard: int
    outcome: Outcome  # `outcome_of` the error
    error: str  # the error's class and message
    at_s: float  # time.monotonic() when the error was raised


class Workload:
    """Writer threads putting fresh keys; `writers_per_shard` threads for each shard, so a
    shard without a leader stalls only its own writers and the others keep measuring."""

    def __init__(self, endpoints: Sequence[str], shards: int, *, writers_per_shard: int = 2,
                 prefix: str | None = None, value_bytes: int = 100,
                 write_timeout_s: float = WRITE_TIMEOUT_S,
                 observe: Callable[[str, str, float, float], None] | None = None,
                 max_backoff_s: float = 0.1) -> None:
        """`write_timeout_s` bounds one put, retries included. Shorter than a takeover, writes
        fail during it: that is how a user with tight deadlines sees the cluster, and what
        `failed_but_applied` checks (a write reported as failed must not be there). `observe`
        is told of every put: ("put", "ok" | "failed" | "unknown", its start and end on
        time.monotonic()), for a timeline."""
        assert write_timeout_s > 0 and max_backoff_s >= 0
        self.write_timeout_s = write_timeout_s
        self.max_backoff_s = max_backoff_s
        self.endpoints = list(endpoints)
        self.shards = shards
        self.prefix = prefix or f"demo/{uuid.uuid4().hex[:8]}"
        self.value_bytes = value_bytes
        self.acks: list[Ack] = []
        self.failures: list[Failure] = []  # writes the client raised an error for, classified
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._write, args=(shard, n), daemon=True,
                                          name=f"writer-{shard}-{n}")
                         for shard in range(shards) for n in range(writers_per_shard)]
        self.started_s = 0.0
        self.stopped_s = 0.0
        self._observe = observe

    def start(self) -> Workload:
        self.started_s = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.write_timeout_s + 5)
        self.stopped_s = time.monotonic()

    def _keys(self, shard: int, writer: int) -> Callable[[], bytes | None]:
        counter = itertools.count()

        def next_key() -> bytes | None:
            for n in counter:
                if n >= MAX_KEYS_PER_WRITER:
                    return None
                key = f"{self.prefix}/{shard}/{writer}/{n:07d}".encode()
                if shard_of(key, self.shards) == shard:
                    return key
            return None

        return next_key

    def _write(self, shard: int, writer: int) -> None:
        next_key = self._keys(shard, writer)
        # A short back-off cap: the measured unavailability should be the cluster's, not the
        # client waiting out a long back-off after the new leader is already there.
        with Client(self.endpoints, timeout_s=self.write_timeout_s, max_attempts=100,
                    max_backoff_s=self.max_backoff_s) as client:
            while not self._stop.is_set():
                key = next_key()
                if key is None:
                    return
                value = key + b"=" + b"x" * max(0, self.value_bytes - len(key) - 1)
                started = time.monotonic()
                try:
                    result = client.put(key, value, request_id=f"{self.prefix}:{key.decode()}")
                except KvError as exc:
                    failure = self.record_failure(key, shard, exc)
                    if self._observe is not None:
                        self._observe("put", failure.outcome, started, failure.at_s)
                    continue
                ack = Ack(key, value, shard, result.revision or 0, time.monotonic())
                with self._lock:
                    self.acks.append(ack)
                if self._observe is not None:
                    self._observe("put", "ok", started, ack.at_s)

    def record_failure(self, key: bytes, shard: int, error: KvError) -> Failure:
        failure = Failure(key, shard, outcome_of(error), f"{type(error).__name__}: {error}", time.monotonic())
        with self._lock:
            self.failures.append(failure)
        return failure

    def results(self) -> tuple[list[Ack], list[Failure]]:
        """A copy of the acknowledgements and the failures so far."""
        with self._lock:
            return list(self.acks), list(self.failures)

    def unknown_outcomes(self) -> int:
        with self._lock:
            return sum(1 for f in self.failures if f.outcome == "unknown")

    def unavailable_ms(self, since_s: float | None = None) -> dict[int, int]:
        """Per shard, the longest time without an acknowledgement (ms), from `since_s` (default:
        the first acknowledgement of that shard) to the end of the run."""
        with self._lock:
            acks = list(self.acks)
        end = self.stopped_s or time.monotonic()
        out: dict[int, int] = {}
        for shard in range(self.shards):
            times = sorted(a.at_s for a in acks if a.shard == shard)
            if not times:
                out[shard] = int((end - (since_s or self.started_s)) * 1000)
                continue
            points = [since_s] if since_s is not None and since_s < times[0] else []
            points += [*times, end]
            out[shard] = int(max(b - a for a, b in itertools.pairwise(points)) * 1000) if len(points) > 1 else 0
        return out


@dataclasses.dataclass
class Verdict:
    acked: int
    acked_lost: int
    duplicates: int
    replicas_equal: bool
    replicas: dict[int, list[dict[str, Any]]]  # shard -> per node digest
    lost_examples: list[str]
    failed: int = 0  # writes the client raised an error for: unknown_outcomes + definitely failed
    failed_but_applied: int = 0  # definitely failed, yet present afterwards (must be 0)
    unknown_outcomes: int = 0  # reported as unknown outcome (UnknownOutcome, DeadlineExceeded)
    unknown_applied: int = 0  # ... of which present afterwards
    failed_applied_examples: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every check passed: nothing acknowledged lost, nothing applied twice, replicas equal,
        nothing reported as failed applied."""
        return (self.acked_lost == 0 and self.duplicates == 0 and self.replicas_equal
                and self.failed_but_applied == 0)

    def summary(self) -> dict[str, Any]:
        """The verdict's fields as the demo reports them (without the per-replica digests)."""
        return {
            "acked": self.acked, "failed": self.failed, "acked_lost": self.acked_lost,
            "duplicates": self.duplicates, "replicas_equal": self.replicas_equal,
            "failed_but_applied": self.failed_but_applied, "unknown_outcomes": self.unknown_outcomes,
            "unknown_applied": self.unknown_applied, "ok": self.ok,
            "lost_examples": self.lost_examples, "failed_applied_examples": self.failed_applied_examples,
        }


def replica_digests(addresses: Sequence[str], shards: int, timeout_s: float,
                    holders: Mapping[int, set[str]] | None = None) -> dict[int, list[cluster_pb2.ShardDigestResponse]]:
    """Every reachable node's digest of every shard it holds (`holders`: shard -> the addresses
    of its copies; None: ask every node for every shard, skipping those it holds no copy of)."""
    out: dict[int, list[cluster_pb2.ShardDigestResponse]] = {s: [] for s in range(shards)}
    for address in addresses:
        with open_channel(address) as channel:  # TLS and credentials from the KVSTORE_* environment
            stub = cluster_pb2_grpc.ClusterServiceStub(channel)  # type: ignore[no-untyped-call]
            for shard in range(shards):
                if holders is not None and address not in holders.get(shard, set()):
                    continue
                try:
                    reply = stub.ShardDigest(cluster_pb2.ShardDigestRequest(shard=shard), timeout=timeout_s)
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        continue  # it holds no copy of this shard (placement put it elsewhere)
                    break  # a dead node: it is not a replica any more
                out[shard].append(reply)
    return out


def holders_of(smap: ShardMap) -> dict[int, set[str]]:
    """shard -> the addresses of its caught-up copies (replicas and read replicas) in `smap`."""
    return {info.shard: set(info.caught_up()) for info in smap.shards}


def converge(client: Client, timeout_s: float) -> tuple[bool, dict[int, list[cluster_pb2.ShardDigestResponse]]]:
    """Wait until every node's replica of every shard reached the partition end, then compare."""
    deadline = time.monotonic() + timeout_s
    digests: dict[int, list[cluster_pb2.ShardDigestResponse]] = {}
    while True:
        try:
            smap = client.shard_map(timeout_s=5)
        except KvError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            continue
        ends = {info.shard: info.end_offset for info in smap.shards}
        addresses = [n.address for n in smap.nodes]
        holders = holders_of(smap)
        digests = replica_digests(addresses, smap.shard_count, timeout_s=5, holders=holders)
        # Settled: every copy the map lists answered (no learner, no retiring copy left), and per
        # shard all stand at one offset, at least the last known end (writes have stopped, so
        # they all get there).
        moving = {info.shard for info in smap.shards if any(r.state in ("learner", "retiring") for r in info.replicas)}
        settled = all(replies and len(replies) == len(holders.get(shard, ())) and shard not in moving
                      and len({r.applied_offset for r in replies}) == 1 and replies[0].applied_offset >= ends[shard]
                      for shard, replies in digests.items())
        if settled or time.monotonic() > deadline:
            equal = settled and all(len({(r.applied_offset, r.sha256) for r in replies}) == 1
                                    for replies in digests.values())
            return equal, digests
        time.sleep(0.2)


def verify(client: Client, workload: Workload, timeout_s: float = 60.0) -> Verdict:
    """Once the writers stopped: converge, read every key of the run back, judge. Every key a
    writer tried (acknowledged or failed) lies under the workload's prefix, so one linearizable
    scan of the prefix reads the failed writes' keys back too."""
    deadline = time.monotonic() + timeout_s
    equal, digests = converge(client, timeout_s)
    stored = _read_back(client, workload.prefix.encode() + b"/", deadline)
    acks, failures = workload.results()
    lost = [a.key.decode() for a in acks if stored.get(a.key, (None, 0))[0] != a.value]
    duplicates = sum(1 for _, version in stored.values() if version > 1)
    failed_applied = [f"{f.key.decode()}: {f.error}" for f in failures if f.outcome == "failed" and f.key in stored]
    unknown = [f for f in failures if f.outcome == "unknown"]
    return Verdict(
        acked=len(acks), acked_lost=len(lost), duplicates=duplicates, replicas_equal=equal,
        replicas={shard: [{"node": r.node_id, "applied_offset": r.applied_offset, "sha256": r.sha256[:16],
                           "keys": r.keys} for r in replies] for shard, replies in digests.items()},
        lost_examples=lost[:EXAMPLES],
        failed=len(failures), failed_but_applied=len(failed_applied), unknown_outcomes=len(unknown),
        unknown_applied=sum(1 for f in unknown if f.key in stored),
        failed_applied_examples=failed_applied[:EXAMPLES])


def _read_back(client: Client, prefix: bytes, deadline: float) -> dict[bytes, tuple[bytes, int]]:
    """Every key under `prefix` with its value and version. A read is safe to repeat, so a shard
    that is between leaders (the restarted node taking its shards back) only delays it, up to
    `deadline`; the client's own retries cover shorter gaps."""
    while True:
        try:
            return {kv.key: (kv.value, kv.version) for kv in client.scan_all(prefix=prefix, limit=1000, timeout_s=30)}
        except (Unavailable, NotLeader, UnknownOutcome, DeadlineExceeded):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def wait_for_new_leader(client: Client, shard: int, old_leader: str, timeout_s: float) -> tuple[str, int, float]:
    """(new leader id, its term, when) once another node leads `shard` (fenced, bootstrapped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            smap = client.shard_map(timeout_s=5)
        except KvError:
            time.sleep(0.05)
            continue
        info = smap.shards[shard]
        if info.leader_ready and info.leader_id and info.leader_id != old_leader:
            return info.leader_id, info.term, time.monotonic()
        time.sleep(0.05)
    raise TimeoutError(f"no other node took shard {shard} over within {timeout_s}s")


def _say(out: Any, quiet: bool, text: str) -> None:
    if not quiet:
        print(text, file=out, flush=True)


def failover(endpoints: Sequence[str], *, kill: Kill, clean: bool = False, shard: int = 0, warmup_s: float = 3.0,
             after_s: float = 5.0, writers_per_shard: int = 2, quiet: bool = False,
             write_timeout_s: float = WRITE_TIMEOUT_S) -> dict[str, Any]:
    """The demo. `kill` signals the shard's leader, if it may (`children.dev_cluster_kill`: only a
    node the local dev cluster started); it refuses with RuntimeError before any load starts
    when the leader is not such a node (checked with signal 0, which signals nothing)."""
    out = sys.stderr
    with Client(endpoints, timeout_s=10) as client:
        smap = _ready_map(client, timeout_s=30)
        if not 0 <= shard < smap.shard_count:
            raise ValueError(f"--shard must be within 0..{smap.shard_count - 1}")
        info = smap.shards[shard]
        victim = smap.node(info.leader_id)
        if victim is None:
            raise RuntimeError(f"shard {shard}'s leader {info.leader_id!r} did not describe itself")
        if len([n for n in smap.nodes if n.can_lead]) < 2:
            raise RuntimeError("failover needs at least two nodes that can lead; `make up` starts three")
        process = kill(victim, 0)  # may we? (signal 0 checks, delivers nothing)
        _say(out, quiet, f"cluster: {len(smap.nodes)} nodes; shard {shard} is led by {victim.node_id} "
                         f"({victim.address}, {process}, term {info.term})")
        everyone = list(dict.fromkeys([*endpoints, *(n.address for n in smap.nodes)]))
        workload = Workload(everyone, smap.shard_count, writers_per_shard=writers_per_shard,
                            write_timeout_s=write_timeout_s).start()
        _say(out, quiet, f"writing through the client ({writers_per_shard} writers per shard) for {warmup_s}s ...")
        time.sleep(warmup_s)
        sig = signal.SIGTERM if clean else signal.SIGKILL
        _say(out, quiet, f"{'stopping' if clean else 'killing'} {victim.node_id} ({process}) with {sig.name}")
        killed_at = time.monotonic()
        try:
            kill(victim, sig)
        except RuntimeError:
            workload.stop()
            raise
        new_leader, term, took_over_at = wait_for_new_leader(client, shard, victim.node_id, timeout_s=60)
        _say(out, quiet, f"{new_leader} took shard {shard} over (term {term}) after "
                         f"{(took_over_at - killed_at) * 1000:.0f} ms")
        time.sleep(after_s)
        workload.stop()
        _say(out, quiet, f"stopped writing: {len(workload.acks)} acknowledged, {len(workload.failures)} failed "
                         f"({workload.unknown_outcomes()} with unknown outcome); verifying ...")
        unavailable = workload.unavailable_ms(since_s=workload.started_s + 1.0)
        verdict = verify(client, workload)
    return {
        "mode": "clean" if clean else "sigkill",
        "shard": shard,
        "killed": victim.node_id,
        "new_leader": new_leader,
        "new_term": term,
        "takeover_ms": int((took_over_at - killed_at) * 1000),
        **verdict.summary(),
        "unavailable_ms_max": max(unavailable.values()),
        "unavailable_ms_by_shard": {str(k): v for k, v in unavailable.items()},
        "replicas": {str(k): v for k, v in verdict.replicas.items()},
        "duration_s": round(workload.stopped_s - workload.started_s, 2),
    }


def _ready_map(client: Client, timeout_s: float) -> ShardMap:
    """A shard map in which every shard has a ready leader (the cluster settled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        smap = client.shard_map(timeout_s=5)
        if all(info.leader_ready for info in smap.shards):
            return smap
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster has shards without a leader; is it still starting?")
        time.sleep(0.2)


REPORT_KEYS = ("mode", "shard", "killed", "new_leader", "takeover_ms", "acked", "failed", "acked_lost", "duplicates",
               "replicas_equal", "failed_but_applied", "unknown_outcomes", "unknown_applied", "unavailable_ms_max",
               "ok")


def report_table(result: dict[str, Any]) -> str:
    lines = [f"{k:<20}{json.dumps(result[k])}" for k in REPORT_KEYS]
    lines += [f"{'lost':<20}{example}" for example in result.get("lost_examples", [])]
    lines += [f"{'failed but applied':<20}{example}" for example in result.get("failed_applied_examples", [])]
    return "\n".join(lines)
