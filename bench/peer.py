"""The store next to etcd and an empty grpc.aio server: one node each, one neutral load generator.

Three targets on this machine, in one run: the store (one node, 4 shards, its own single-node Kafka), a
single etcd node (Debian's `etcd-server`, data dir in a temporary directory) and an empty grpc.aio server
(a kvstore.v1.KVService servicer whose Put, Get and Txn answer an empty message at once: Python's serving ceiling).
Every target is driven by the same code: one asyncio process, one coroutine per client in a closed loop,
generic unary calls on grpc.aio channels with *pre-serialized* protobuf bytes in and raw bytes out (no
serializer, no parsing in the loop), so the load generator spends the same per request on every target.
Requests are built before each series; answers are checked by size in the loop (a Get must return the
value) and parsed once per target before the load (`verify`). etcd's messages come from
`bench/etcd_rpc.proto` (a subset of etcd's rpc.proto), compiled at run time with grpc_tools.protoc.

Loads, 100-byte values: `put`; `get`, linearizable (store: CONSISTENCY_LINEARIZABLE; etcd: Range with
serializable=false); `batch`, a Txn of 100 puts without compares (store: keys of one shard, each client
its own shard and keys; etcd: the same keys); `wbatch`, the store's batch RPC (WriteBatch: one part of
100 puts, the same keys; etcd has no other batch call, so it runs its Txn of 100 puts again); `mixed`,
90 % linearizable Gets of seeded keys and 10 % Puts. At 1, 16, 64, 256 concurrent clients (quick: 1, 64,
256). The three targets alternate per point so drift on a shared machine hits all alike; CPU of server,
broker and load generator is sampled per series.

    python bench/peer.py --quick    # ~2 min: prints one JSON line with the headline ratios
    python bench/peer.py            # full run, ~7 min
    python bench/peer.py --render bench/results/peer-latest-full.json   # the README tables and the plot again

To reproduce one point (e.g. the node's group membership at saturation, issue 18):

    python bench/peer.py --only get@256 --seconds 120 --systems store --keep-logs /tmp/peer-logs

`--only OP@CLIENTS` (repeatable) runs just those points of the profile's loads (seeding, verification
and the global warm-up still run; the WAL phase does not); `--seconds` sets every point's window;
`--systems` picks the targets (the store always runs); `--keep-logs DIR` copies the node's, the
broker's and etcd's logs there before the temporary directory goes. Such a partial run writes
`bench/results/peer-only-<UTC>.json` and leaves the `peer-latest-*` files and the plot alone.
`WAL_GROUP_DEBUG=cgrp` in the environment reaches the node (librdkafka's group debug log in node.log).

The node's group membership is watched in every run: `node.membership_losses` (partitions the node
gave up, "lost" or "revoked", before it was stopped: a false failover), `node.session_timeouts`
(librdkafka's own "session timed out" verdicts) and `node.losses_held` (those the node rode out
without giving anything up, wal/membership.py) are in the JSON and in the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime
import importlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from confluent_kafka.admin import AdminClient
from google.protobuf.internal import api_implementation

from kvstore.core.sharding import shard_of
from kvstore.v1 import kv_pb2
from wal.broker import KAFKA_VERSION, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv as kvbench  # bench/kv.py: node start, broker, CPU counters, the empty servicer, replay
import wal_append  # bench/wal_append.py: the guard against a raw transactional producer

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR, ETCD_PROTO = REPO / "bench" / "results", Path(__file__).resolve().parent / "etcd_rpc.proto"
SYSTEMS = ("store", "etcd", "empty")
OPS = ("put", "get", "batch", "wbatch", "mixed", "txn1", "txnx", "txnr")
BATCH_OPS = ("batch", "wbatch")  # measured in keys/s
SHARDS, VALUE_BYTES, BATCH, SEED_KEYS, KEYS_PER_CLIENT = 4, 100, 100, 256, 16
TRANSFER_PAIRS = 8  # per client, cycled: txn1 / txnx
WRITE_BATCH_MAX_ANSWER = 40  # bytes: a committed part's answer is far below, any error message above
CHANNELS = kvbench.CHANNELS  # per target, as bench/kv.py: 256 clients = 64 streams per HTTP/2 connection
RPC_TIMEOUT_S = 10.0
MAX_OPS_PER_SERIES = 400_000
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"clients": (1, 64, 256), "seconds": 2.0, "warmup": 0.5, "global_warmup": 3.0,
              "replay_records": 200_000, "replay_rounds": 2, "node_rounds": 2,
              "wal": {**wal_append.PROFILES["quick"], "seconds": 3.0}},
    "full": {"clients": (1, 16, 64, 256), "seconds": 6.0, "warmup": 1.5, "global_warmup": 8.0,
             "replay_records": 200_000, "replay_rounds": 3, "node_rounds": 3, "wal": wal_append.PROFILES["quick"]},
}
# Issue 12's goals, all measured in one run of this script: (headline key, at least, what).
GOALS: tuple[tuple[str, float, str], ...] = (
    ("put64_store_vs_empty", 0.6, "Put at 64 clients vs the empty grpc.aio server"),
    ("get64_store_vs_empty", 0.6, "linearizable Get at 64 clients vs the empty server"),
    ("wbatch_best_keys_store_vs_etcd_txn", 1.0, "batch RPC keys/s vs etcd's Txn of 100 puts (best of each)"),
    ("replay_node_records_per_s", 200_000, "node bootstrap from the WAL, records/s"),
    ("replay_node_vs_raw_consumer", 0.7, "node bootstrap vs a raw read_committed consumer"),
    ("guard_vs_raw_txn_b100", 0.9, "the WAL guard vs a raw transactional producer, batches of 100"),
)
WAL_BATCH = 100
ETCD_PACKAGE = "etcd-server"
APT_TIMEOUT_S, START_TIMEOUT_S = 600, 120
Row = dict[str, Any]
Proc = subprocess.Popen[bytes]


def log(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


# ---- etcd: find or install, compile its messages, start one node ----------------------------------------


def ensure_etcd() -> tuple[str | None, str]:
    """The etcd binary and how it was found; installs Debian's etcd-server with apt-get when it can (root)."""
    if path := shutil.which("etcd"):
        return path, "found on PATH"
    apt = shutil.which("apt-get")
    if os.geteuid() != 0 or apt is None:
        why = "not root" if apt else "no apt-get"
        log(f"etcd not found ({why}): install Debian's `{ETCD_PACKAGE}` package (apt-get install {ETCD_PACKAGE}) "
            "to compare with etcd; continuing without etcd")
        return None, f"missing ({why})"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [apt, "install", "-y", "-q", ETCD_PACKAGE]
    for attempt in ("install", "update", "install again"):
        cmd = [apt, "update", "-q"] if attempt == "update" else install
        log(f"etcd not found: {' '.join(cmd)}")
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log(f"{' '.join(cmd)} timed out after {APT_TIMEOUT_S}s")
            continue
        if done.returncode != 0:
            log(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        elif attempt != "update" and (path := shutil.which("etcd")):
            return path, f"installed with apt-get install {ETCD_PACKAGE}"
    log(f"could not install `{ETCD_PACKAGE}`; continuing without etcd")
    return None, "missing (apt-get install failed)"


def etcd_version(binary: str) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
        return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                     if line.startswith("etcd Version")), out.strip())
    return "unknown"


def etcd_messages(out_dir: Path) -> types.ModuleType:
    """bench/etcd_rpc.proto compiled into `out_dir` (messages only) and imported."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ETCD_PROTO.parent}", f"--python_out={out_dir}", ETCD_PROTO.name]
    if protoc.main(args) != 0:
        raise RuntimeError(f"grpc_tools.protoc failed on {ETCD_PROTO}")
    sys.path.insert(0, str(out_dir))
    return importlib.import_module("etcd_rpc_pb2")


def start_etcd(binary: str, data_dir: Path, log_path: Path) -> tuple[Proc, str]:
    """One member, loopback only, its own data dir. The backend quota is raised so that a long run of
    batches (etcd keeps every revision until compacted; nothing compacts here) never hits NOSPACE."""
    client, peer = free_port(), free_port()
    cmd = [binary, "--name", "peerbench", "--data-dir", str(data_dir),
           "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
           "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
           "--initial-cluster", f"peerbench=http://127.0.0.1:{peer}", "--initial-cluster-state", "new",
           "--quota-backend-bytes", str(8 * 1024**3), "--logger", "zap", "--log-outputs", "stderr",
           "--log-level", "warn"]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=data_dir.parent)
    return proc, f"127.0.0.1:{client}"


def wait_etcd(proc: Proc, address: str, etcd: types.ModuleType, timeout_s: float) -> None:
    """Until a linearizable Range answers (a leader is elected and the member serves)."""
    deadline, request = time.monotonic() + timeout_s, etcd.RangeRequest(key=b"ready").SerializeToString()
    with grpc.insecure_channel(address) as channel:
        rng = channel.unary_unary("/etcdserverpb.KV/Range")
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                rng(request, timeout=1)
                return
            time.sleep(0.1)
    raise RuntimeError(f"etcd at {address} not serving after {timeout_s}s (exit code {proc.poll()})")


def etcd_log_problems(path: Path) -> list[str]:
    text = path.read_text(errors="replace") if path.exists() else ""
    return [line for line in text.splitlines() if '"level":"warn"' in line or '"level":"error"' in line]


# ---- the empty server ------------------------------------------------------------------------------------


class EmptyKV(kvbench.EmptyKV):
    """bench/kv.py's empty servicer (Put, Get) plus Txn: gRPC + protobuf parsing + asyncio, no work."""

    async def Txn(self, request: kv_pb2.TxnRequest, context: Any) -> kv_pb2.TxnResponse:
        return kv_pb2.TxnResponse()

    async def WriteBatch(self, request: kv_pb2.WriteBatchRequest, context: Any) -> kv_pb2.WriteBatchResponse:
        return kv_pb2.WriteBatchResponse()


def wait_channel(proc: Proc, address: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        with grpc.insecure_channel(address) as channel, contextlib.suppress(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=1)
            return
    raise RuntimeError(f"empty server at {address} not up after {timeout_s}s (exit code {proc.poll()})")


# ---- requests: the same shapes for every target, serialized before the load -----------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    body: bytes
    min_answer: int  # an answer shorter than this is wrong (a Get that found nothing, an empty write answer)
    max_answer: int = 1 << 30  # a longer one is wrong too (a WriteBatch part that carries an error message)


class Codec:
    """Builds the serialized request of each operation for one target's API."""

    def __init__(self, system: str, etcd: types.ModuleType | None) -> None:
        self.system, self.etcd = system, etcd
        self.checked = system != "empty"  # the empty server answers empty messages

    def put(self, key: bytes, value: bytes) -> Request:
        if self.etcd is not None:
            return Request("/etcdserverpb.KV/Put", self.etcd.PutRequest(key=key, value=value).SerializeToString(),
                           int(self.checked))
        return Request("/kvstore.v1.KVService/Put", kv_pb2.PutRequest(key=key, value=value).SerializeToString(),
                       int(self.checked))

    def get(self, key: bytes) -> Request:
        if self.etcd is not None:  # serializable=false (the default): linearizable
            return Request("/etcdserverpb.KV/Range", self.etcd.RangeRequest(key=key).SerializeToString(),
                           VALUE_BYTES * self.checked)
        read = kv_pb2.ReadOptions(consistency=kv_pb2.CONSISTENCY_LINEARIZABLE)
        return Request("/kvstore.v1.KVService/Get", kv_pb2.GetRequest(key=key, read=read).SerializeToString(),
                       VALUE_BYTES * self.checked)

    def batch(self, keys: Sequence[bytes], value: bytes) -> Request:
        if self.etcd is not None:
            ops = [self.etcd.RequestOp(request_put=self.etcd.PutRequest(key=k, value=value)) for k in keys]
            return Request("/etcdserverpb.KV/Txn", self.etcd.TxnRequest(success=ops).SerializeToString(),
                           len(keys) * self.checked)
        ops = [kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=k, value=value)) for k in keys]
        return Request("/kvstore.v1.KVService/Txn", kv_pb2.TxnRequest(success=ops).SerializeToString(),
                       len(keys) * self.checked)

    def transfer(self, a: bytes, b: bytes, value: bytes) -> Request:
        """A transfer's shape: two compares that hold (version > -1) and two puts. For the store,
        one record when a and b share a shard, a cross-shard transaction (prepare, decision,
        resolve) when they do not; for etcd, one Txn either way."""
        if self.etcd is not None:
            compares = [self.etcd.Compare(result=1, target=0, key=k, version=-1) for k in (a, b)]
            ops = [self.etcd.RequestOp(request_put=self.etcd.PutRequest(key=k, value=value)) for k in (a, b)]
            return Request("/etcdserverpb.KV/Txn", self.etcd.TxnRequest(compare=compares, success=ops)
                           .SerializeToString(), 2 * self.checked)
        compares = [kv_pb2.Compare(key=k, target=kv_pb2.Compare.TARGET_VERSION, op=kv_pb2.Compare.OP_GREATER,
                                   version=-1) for k in (a, b)]
        ops = [kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=k, value=value)) for k in (a, b)]
        return Request("/kvstore.v1.KVService/Txn", kv_pb2.TxnRequest(compares=compares, success=ops)
                       .SerializeToString(), 2 * self.checked)

    def read_pair(self, a: bytes, b: bytes) -> Request:
        """A read-only Txn of two keys (two gets). For the store, with a and b in two shards, a
        cross-shard read that writes nothing (read and validated as one cut, docs/design.md
        section 10.5); for etcd, one Txn of two Ranges (serializable=false: linearizable)."""
        if self.etcd is not None:
            ops = [self.etcd.RequestOp(request_range=self.etcd.RangeRequest(key=k)) for k in (a, b)]
            return Request("/etcdserverpb.KV/Txn", self.etcd.TxnRequest(success=ops).SerializeToString(),
                           2 * VALUE_BYTES * self.checked)
        ops = [kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=k)) for k in (a, b)]
        return Request("/kvstore.v1.KVService/Txn", kv_pb2.TxnRequest(success=ops).SerializeToString(),
                       2 * VALUE_BYTES * self.checked)

    def write_batch(self, keys: Sequence[bytes], value: bytes) -> Request:
        """The store's WriteBatch of one shard's part; etcd's batch is its Txn (it has no other)."""
        if self.etcd is not None:
            return self.batch(keys, value)
        shard = shard_of(keys[0], SHARDS)
        part = kv_pb2.ShardMutations(shard=shard, mutations=[kv_pb2.Mutation(key=k, value=value) for k in keys])
        # A committed part answers ~12 bytes (shard, revision, count); an error carries a message.
        return Request("/kvstore.v1.KVService/WriteBatch", kv_pb2.WriteBatchRequest(shards=[part]).SerializeToString(),
                       8 * self.checked, WRITE_BATCH_MAX_ANSWER if self.checked else 0)


def seed_key(j: int) -> bytes:
    return b"seed/%d" % j


def seed_pairs(client: int) -> list[tuple[bytes, bytes]]:
    """TRANSFER_PAIRS pairs of seeded keys, the first in the client's shard, the second in the next."""
    shard = client % SHARDS
    mine = [seed_key(j) for j in range(SEED_KEYS) if shard_of(seed_key(j), SHARDS) == shard]
    next_ = [seed_key(j) for j in range(SEED_KEYS) if shard_of(seed_key(j), SHARDS) == (shard + 1) % SHARDS]
    return [(mine[(client + j) % len(mine)], next_[(client * 7 + j) % len(next_)]) for j in range(TRANSFER_PAIRS)]


def batch_keys(tag: str, client: int) -> list[bytes]:
    """BATCH distinct keys, all in shard client % SHARDS (a store Txn of one shard: one record)."""
    shard, keys, j = client % SHARDS, list[bytes](), 0
    while len(keys) < BATCH:
        if shard_of(key := f"b/{tag}/{client}/{j}".encode(), SHARDS) == shard:
            keys.append(key)
        j += 1
    return keys


def key_in(shard: int, prefix: str) -> bytes:
    """The first key `prefix/<j>` of `shard`."""
    j = 0
    while shard_of(key := f"{prefix}/{j}".encode(), SHARDS) != shard:
        j += 1
    return key


def transfers(codec: Codec, client: int, tag: str, value: bytes, *, cross: bool) -> list[Request]:
    """TRANSFER_PAIRS transfers of client `client`'s own accounts (no two clients contend): both
    in its shard, or (`cross`) the second in the next shard."""
    shard = client % SHARDS
    other = (shard + 1) % SHARDS if cross else shard
    return [codec.transfer(key_in(shard, f"t/{tag}/{client}/{j}/a"), key_in(other, f"t/{tag}/{client}/{j}/b"), value)
            for j in range(TRANSFER_PAIRS)]


def requests_for(codec: Codec, op: str, client: int, tag: str, value: bytes) -> list[Request]:
    """Client `client`'s requests in the order it sends them (cycled)."""
    puts = [codec.put(f"p/{tag}/{client}/{j}".encode(), value) for j in range(KEYS_PER_CLIENT)]
    gets = [codec.get(seed_key((client * 31 + j) % SEED_KEYS)) for j in range(40)]
    if op == "put":
        return puts
    if op == "get":
        return gets
    if op == "batch":
        return [codec.batch(batch_keys(tag, client), value)]
    if op == "wbatch":
        return [codec.write_batch(batch_keys(tag, client), value)]
    if op in ("txn1", "txnx"):
        return transfers(codec, client, tag, value, cross=op == "txnx")
    if op == "txnr":  # seeded keys of two shards, read together
        return [codec.read_pair(*pair) for pair in seed_pairs(client)]
    # mixed: 9 Gets then 1 Put, 160 requests
    return [puts[(j // 10) % len(puts)] if j % 10 == 9 else gets[j % len(gets)] for j in range(160)]


# ---- the load generator ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    system: str
    address: str
    codec: Codec
    pids: dict[str, int | None]
    metrics_port: int | None = None
    channels: list[grpc.aio.Channel] = dataclasses.field(default_factory=list)
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    async def open(self) -> None:
        options = [("grpc.use_local_subchannel_pool", 1)]  # else all channels share one connection
        self.channels = [grpc.aio.insecure_channel(self.address, options=options) for _ in range(CHANNELS)]
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in self.channels)), 30)
        # No serializer: bytes in, bytes out. The same generic call for every target.
        self.calls = [{m: c.unary_unary(m) for m in ("/kvstore.v1.KVService/Put", "/kvstore.v1.KVService/Get",
                                                    "/kvstore.v1.KVService/Txn", "/kvstore.v1.KVService/WriteBatch",
                                                    "/etcdserverpb.KV/Put", "/etcdserverpb.KV/Range",
                                                    "/etcdserverpb.KV/Txn")} for c in self.channels]

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


async def run_series(target: Target, op: str, clients_n: int, seconds: float, warmup: float) -> Row:
    """`clients_n` coroutines in a closed loop; only requests started inside the window count."""
    latencies, errors, first_errors = list[float](), collections.Counter[str](), list[str]()
    wrong, writes, start = 0, 0, time.perf_counter()
    window_start, window_end = start + warmup, start + warmup + seconds
    tag, value = uuid.uuid4().hex[:8], os.urandom(VALUE_BYTES)
    started_utc = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S")  # to match the node's log

    async def client(i: int) -> None:
        nonlocal wrong, writes
        calls, plan = target.calls[i % len(target.calls)], requests_for(target.codec, op, i, tag, value)
        pairs = [(calls[r.method], r.body, r.min_answer, r.max_answer, r.method.endswith("Put")) for r in plan]
        for n in range(math.ceil(MAX_OPS_PER_SERIES / clients_n)):
            call, body, min_answer, max_answer, is_put = pairs[n % len(pairs)]
            started = time.perf_counter()
            if started >= window_end:
                return
            try:
                answer = await call(body, timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] += 1
                if len(first_errors) < 5:
                    first_errors.append(f"{exc.code().name}: {exc.details()}")
                await asyncio.sleep(0.01)  # never spin on a failing server
                continue
            if started >= window_start:
                latencies.append(time.perf_counter() - started)
                wrong += not min_answer <= len(answer) <= max_answer
                writes += is_put

    async def sample() -> Row:
        await asyncio.sleep(max(0.0, window_start - time.perf_counter()))
        before, t0 = await asyncio.to_thread(kvbench.counters, target.pids, target.metrics_port), time.perf_counter()
        await asyncio.sleep(max(0.0, window_end - time.perf_counter()))
        after = await asyncio.to_thread(kvbench.counters, target.pids, target.metrics_port)
        wall = time.perf_counter() - t0
        delta = {k: after[k] - v for k, v in before.items() if k in after}
        out: Row = {"cpu_percent": {k: round(100 * delta[k] / wall, 1) if k in delta else None
                                    for k in (*target.pids, "machine")}}
        if batches := delta.get("kvstore_commit_latency_seconds_count"):  # the store's WAL transactions
            out.update(wal_batches=int(batches), mean_batch_records=round(
                delta["kvstore_batch_records_sum"] / batches, 1), mean_commit_ms=round(
                1000 * delta["kvstore_commit_latency_seconds_sum"] / batches, 2))
        return out

    sampler = asyncio.create_task(sample())
    await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(clients_n))),
                           warmup + seconds + RPC_TIMEOUT_S + 30)
    values = sorted(latencies)
    ms = {f"{name}_ms": None if (p := kvbench.percentile(values, q)) is None else round(p * 1000, 3)
          for name, q in (("p50", 50), ("p99", 99), ("p999", 99.9))}
    ops_per_s = round(len(values) / seconds, 1)
    return {"system": target.system, "op": op, "clients": clients_n, "started_utc": started_utc, "ops": len(values),
            "ops_per_s": ops_per_s,
            "keys_per_s": round(ops_per_s * (BATCH if op in BATCH_OPS else 1), 1), "writes": writes, **ms,
            "errors": dict(errors), "first_errors": first_errors, "wrong_answers": wrong, **(await sampler)}


async def seed(target: Target) -> None:
    """The keys every Get reads, written through the target's own API."""
    value = os.urandom(VALUE_BYTES)
    calls = target.calls
    await asyncio.gather(*(calls[j % len(calls)][(r := target.codec.put(seed_key(j), value)).method](
        r.body, timeout=RPC_TIMEOUT_S) for j in range(SEED_KEYS)))


async def verify(target: Target, etcd: types.ModuleType | None) -> Row:
    """One Put, Get and batch, parsed: the answers the size checks in the loop stand for are right."""
    calls, codec, value = target.calls[0], target.codec, os.urandom(VALUE_BYTES)
    key, keys = f"verify/{uuid.uuid4().hex}".encode(), batch_keys(f"verify-{uuid.uuid4().hex[:6]}", 0)

    async def send(r: Request) -> bytes:
        answer: bytes = await calls[r.method](r.body, timeout=RPC_TIMEOUT_S)
        return answer

    put, get = await send(codec.put(key, value)), await send(codec.get(key))
    batch = await send(codec.batch(keys, value))
    wkeys = batch_keys(f"verify-{uuid.uuid4().hex[:6]}", 1)
    wbatch = await send(codec.write_batch(wkeys, value))
    if target.system == "empty":
        ok = put == get == batch == wbatch == b""
        return {"ok": ok, "detail": "empty answers" if ok else "non-empty answers"}
    if etcd is not None:
        p, g = etcd.PutResponse.FromString(put), etcd.RangeResponse.FromString(get)
        b = etcd.TxnResponse.FromString(batch)
        ok = (p.header.revision > 0 and len(g.kvs) == 1 and g.kvs[0].value == value and b.succeeded
              and len(b.responses) == BATCH and b.header.revision > p.header.revision)
        return {"ok": ok, "detail": f"put revision {p.header.revision}, batch revision {b.header.revision}"}
    # A cross-shard transfer commits both puts, under the coordinator shard's decision.
    xa, xb = key_in(0, f"verify/{uuid.uuid4().hex}/a"), key_in(1, f"verify/{uuid.uuid4().hex}/b")
    cross = kv_pb2.TxnResponse.FromString(await send(codec.transfer(xa, xb, value)))
    xread = kv_pb2.GetResponse.FromString(await send(codec.get(xb)))
    sp, sg, sb = (kv_pb2.PutResponse.FromString(put), kv_pb2.GetResponse.FromString(get),
                  kv_pb2.TxnResponse.FromString(batch))
    if not (cross.succeeded and cross.result.shard == 0 and len(cross.results) == 2 and xread.kv.value == value):
        return {"ok": False, "detail": f"a cross-shard transfer answered {cross}, its key reads {xread.kv.value!r}"}
    ok = (sp.result.revision > 0 and sg.found and sg.kv.value == value and sb.succeeded
          and len(sb.results) == BATCH and all(r.put.version == 1 for r in sb.results))
    [part] = kv_pb2.WriteBatchResponse.FromString(wbatch).results
    readback = kv_pb2.GetResponse.FromString(await send(codec.get(wkeys[-1])))
    ok = ok and (not part.HasField("error") and part.mutations == BATCH and part.result.revision > 0
                 and readback.found and readback.kv.value == value
                 and len(wbatch) <= WRITE_BATCH_MAX_ANSWER and len(wbatch) >= 8)
    return {"ok": ok, "detail": f"put revision {sp.result.revision} (shard {sp.result.shard}), batch revision "
                                f"{sb.result.revision} (shard {sb.result.shard}), write batch revision "
                                f"{part.result.revision} (shard {part.shard}, {len(wbatch)} bytes answered)"}


async def load_phase(targets: list[Target], profile: dict[str, Any], etcd: types.ModuleType | None) -> tuple[
        list[Row], dict[str, Row]]:
    """Seed and verify each target, warm it, then every (clients, op) point with the targets alternating."""
    try:
        for target in targets:
            await target.open()
        checks = {}
        for target in targets:
            await seed(target)
            checks[target.system] = await verify(target, etcd if target.system == "etcd" else None)
            log(f"{target.system}: verify {checks[target.system]}")
        for target in targets:  # JIT the broker, grow etcd's and gRPC's pools: not measured
            for op, share in (("put", 0.5), ("batch", 0.25), ("get", 0.25)):
                await run_series(target, op, 16, profile["global_warmup"] * share, 0)
        results, turn, only = [], 0, profile.get("only")
        for clients_n in profile["clients"]:
            for op in OPS:
                if only and (op, clients_n) not in only:
                    continue
                for target in targets[turn % len(targets):] + targets[:turn % len(targets)]:
                    results.append(row := await run_series(target, op, clients_n, profile["seconds"],
                                                           profile["warmup"]))
                    log(f"{target.system:5} {op:5} {clients_n:>3} clients {row['ops_per_s']:>9,.0f}/s "
                        f"({row['keys_per_s']:,.0f} keys/s) p99 {row['p99_ms']} ms errors {row['errors']} "
                        f"wrong {row['wrong_answers']} cpu {row['cpu_percent']}"
                        + (f" wal batch {row['mean_batch_records']} commit {row['mean_commit_ms']} ms"
                           if "wal_batches" in row else ""))
                turn += 1
        return results, checks
    finally:
        for target in targets:
            await target.close()


# ---- the run ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    """Every child process started here is stopped on the way out, also on error or SIGTERM."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            kvbench.stop_proc(proc)


def run(tmp: Path, profile: dict[str, Any], etcd_binary: str | None, systems: Sequence[str] = SYSTEMS) -> Row:
    etcd = etcd_messages(tmp / "etcd_pb") if etcd_binary and "etcd" in systems else None
    with kvbench.broker(tmp) as (bootstrap, broker_pid), processes() as procs:
        started = time.perf_counter()
        metrics_port = free_port()
        node, node_address = kvbench.start_node(bootstrap, tmp / "node", f"peer{uuid.uuid4().hex[:8]}", SHARDS,
                                                tmp / "node.log", metrics_port)
        procs.append(node)
        targets = [Target("store", node_address, Codec("store", None),
                          {"server": node.pid, "broker": broker_pid, "loadgen": os.getpid()}, metrics_port)]
        empty = None
        if "empty" in systems:
            empty_address = f"127.0.0.1:{free_port()}"
            procs.append(empty := subprocess.Popen([sys.executable, __file__, "--serve-empty", empty_address],
                                                   cwd=REPO))
        if etcd_binary and etcd is not None:
            (tmp / "etcd").mkdir()
            etcd_proc, etcd_address = start_etcd(etcd_binary, tmp / "etcd" / "data", tmp / "etcd.log")
            procs.append(etcd_proc)
            wait_etcd(etcd_proc, etcd_address, etcd, START_TIMEOUT_S)
            targets.append(Target("etcd", etcd_address, Codec("etcd", etcd),
                                  {"server": etcd_proc.pid, "loadgen": os.getpid()}))
        if empty is not None:
            wait_channel(empty, empty_address, START_TIMEOUT_S)
            targets.append(Target("empty", empty_address, Codec("empty", None),
                                  {"server": empty.pid, "loadgen": os.getpid()}))
        kvbench.wait_serving(node, node_address, START_TIMEOUT_S)
        log(f"targets up after {time.perf_counter() - started:.1f}s: "
            + ", ".join(f"{t.system} {t.address}" for t in targets))
        results, checks = asyncio.run(load_phase(targets, profile, etcd))
        node_stopped_utc = datetime.datetime.now(datetime.UTC)
        kvbench.stop_proc(node)  # the rest measures the WAL paths alone, on the same broker
        wal = {} if profile.get("only") else wal_phase(bootstrap, tmp, profile)
    node_problems = kvbench.log_problems(tmp / "node.log")
    node_log = (tmp / "node.log").read_text(errors="replace") if (tmp / "node.log").exists() else ""
    etcd_problems = etcd_log_problems(tmp / "etcd.log")
    broker_log = "\n".join(p.read_text(errors="replace") for p in sorted((tmp / "kafka").glob("node-*/broker.log")))
    # The coordinator's side (wal/broker.py logs the group coordinator at INFO): members it removed
    # on session expiry; and the controller falling behind (its own broker's heartbeats).
    removals = [line for line in broker_log.splitlines() if "has failed, removing it from the group" in line]
    overloaded = [line for line in broker_log.splitlines() if "Fencing broker" in line or "overloaded" in line]
    return {"results": results, "verify": checks, **wal,
            "node": {"log_problems": len(node_problems), "first_log_problems": node_problems[:5],
                     **membership_events(node_log, node_stopped_utc),
                     "coordinator_removals": len(removals), "first_coordinator_removals": removals[:5],
                     "controller_overloaded": len(overloaded), "first_controller_overloaded": overloaded[:5]},
            "etcd_log": {"warnings": len(etcd_problems),
                         "took_too_long": sum("took too long" in p for p in etcd_problems),
                         "first_warnings": [p[:300] for p in etcd_problems[:5]]}}


LEADERSHIP_WORDS = (" assigned [", " revoked [", " leading at offset ", " lost [", "librdkafka dropped [",
                    " back in generation ", "assigned again while leading")
SESSION_TIMEOUT_WORDS = ("SESSTMOUT", "session timed out")


def membership_events(node_log: str, stopped_utc: datetime.datetime) -> Row:
    """The node's group membership from its log. One node leads every shard from its first
    assignment to its stop: any partition it gave up before `stopped_utc` ("lost", or "revoked" in
    a rebalance) is a false failover (issue 18). librdkafka's own session timeouts are counted
    apart, with those the node rode out without giving anything up. The node logs in local time
    (logging's asctime)."""
    stopped = stopped_utc.astimezone().replace(tzinfo=None)
    events = [line for line in node_log.splitlines() if any(word in line for word in LEADERSHIP_WORDS)]

    def before_stop(line: str) -> bool:
        with contextlib.suppress(ValueError):
            return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f") < stopped
        return True  # no timestamp: count it

    losses = [line for line in events if (" lost [" in line or " revoked [" in line) and before_stop(line)]
    timeouts = [line for line in node_log.splitlines() if any(word in line for word in SESSION_TIMEOUT_WORDS)]
    held = [line for line in events if " back in generation " in line]
    return {"membership_losses": len(losses), "session_timeouts": len(timeouts),
            # librdkafka's own session timeouts the node rode out (wal.membership.settle): kept, the
            # coordinator never removed it; regained, it did and gave everything back at once.
            "losses_held": len(held), "losses_held_kept": sum(" led throughout" in line for line in held),
            "first_losses": losses[:10], "first_session_timeouts": [t[:400] for t in timeouts[:5]],
            # Leadership changes: more than the first "assigned" and one "leading at" per shard means
            # the node lost and re-took shards under load.
            "leadership_events": len(events), "first_leadership_events": events[:20]}


def wal_phase(bootstrap: str, tmp: Path, profile: dict[str, Any]) -> Row:
    """The two goals that are not about serving: a node's bootstrap replay against a raw consumer
    (bench/kv.py's replay phase) and the guard against a raw transactional producer at batches of
    WAL_BATCH (bench/wal_append.py), on the same broker, after the load."""
    run_id = uuid.uuid4().hex[:8]
    log(f"replay: {profile['replay_records']:,} records, node bootstrap vs wal.Replayer vs a raw consumer")
    replay = kvbench.replay_phase(bootstrap, tmp / "replay", profile, run_id)
    log(f"replay: node {replay['node_bootstrap_records_per_s']}/s, raw {replay['raw_consumer_records_per_s']}/s")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    guard = wal_append.run_size(bootstrap, admin, run_id, WAL_BATCH, profile["wal"])
    log("guard: " + ", ".join(f"{m} {guard[m]['records_per_s']:,.0f} records/s" for m in wal_append.MODES))
    return {"replay": replay, "guard": {"batch": WAL_BATCH, **guard}}


def ratio(rows: list[Row], op: str, clients: int, a: str, b: str, key: str = "ops_per_s") -> float | None:
    by = {r["system"]: r[key] for r in rows if r["op"] == op and r["clients"] == clients}
    return round(float(by[a]) / float(by[b]), 3) if by.get(a) is not None and by.get(b) else None


def op_ratio(rows: list[Row], system: str, a: str, b: str, clients: int) -> float | None:
    """One system's throughput on load `a` over load `b`, at `clients`."""
    by = {r["op"]: r["ops_per_s"] for r in rows if r["system"] == system and r["clients"] == clients}
    return round(float(by[a]) / float(by[b]), 3) if by.get(a) is not None and by.get(b) else None


def headline(report: Row) -> Row:
    rows, clients = report["results"], 64
    best = {(op, s): max((r["keys_per_s"] for r in rows if r["op"] == op and r["system"] == s), default=None)
            for op in BATCH_OPS for s in SYSTEMS}
    at64 = {op: {s: next((r["keys_per_s" if op in BATCH_OPS else "ops_per_s"] for r in rows
                          if r["op"] == op and r["clients"] == clients and r["system"] == s), None) for s in SYSTEMS}
            for op in OPS}
    replay, guard = report.get("replay") or {}, report.get("guard")
    replay_rate, raw_rate = replay.get("node_bootstrap_records_per_s"), replay.get("raw_consumer_records_per_s")
    out = {"bench": "peer", "profile": report["profile"], "utc": report["utc"],
            "put64_store_vs_etcd": ratio(rows, "put", clients, "store", "etcd"),
            "put64_store_vs_empty": ratio(rows, "put", clients, "store", "empty"),
            "get64_store_vs_etcd": ratio(rows, "get", clients, "store", "etcd"),
            "get64_store_vs_empty": ratio(rows, "get", clients, "store", "empty"),
            "batch64_keys_store_vs_etcd": ratio(rows, "batch", clients, "store", "etcd", "keys_per_s"),
            "batch_best_keys_store_vs_etcd": round(best["batch", "store"] / best["batch", "etcd"], 3)
            if best["batch", "store"] and best["batch", "etcd"] else None,
            # The goal's ratio: the store's batch RPC against etcd's Txn of 100 puts.
            "wbatch64_keys_store_vs_etcd": ratio(rows, "wbatch", clients, "store", "etcd", "keys_per_s"),
            "wbatch_best_keys_store_vs_etcd_txn": round(best["wbatch", "store"] / best["batch", "etcd"], 3)
            if best["wbatch", "store"] and best["batch", "etcd"] else None,
            "replay_node_records_per_s": replay_rate,
            "replay_node_vs_raw_consumer": round(replay_rate / raw_rate, 3) if replay_rate and raw_rate else None,
            "guard_vs_raw_txn_b100": round(guard["guard"]["records_per_s"] / guard["raw_txn"]["records_per_s"], 3)
            if guard and guard["raw_txn"]["records_per_s"] else None,
            "mixed64_store_vs_etcd": ratio(rows, "mixed", clients, "store", "etcd"),
            # Cross-shard transactions (issue 21): a transfer over two shards against one within a shard,
            # and against etcd's Txn of the same shape.
            **{f"txnx{n}_vs_txn1_store": op_ratio(rows, "store", "txnx", "txn1", n) for n in (1, 16, 64)},
            **{f"txnx{n}_store_vs_etcd": ratio(rows, "txnx", n, "store", "etcd") for n in (1, 16, 64)},
            # A read-only Txn over two shards (one cut, no record) against the single-shard transfer.
            **{f"txnr{n}_vs_txn1_store": op_ratio(rows, "store", "txnr", "txn1", n) for n in (1, 16, 64)},
            **{f"txnr{n}_store_vs_etcd": ratio(rows, "txnr", n, "store", "etcd") for n in (1, 16, 64)},
            "mixed64_store_vs_empty": ratio(rows, "mixed", clients, "store", "empty"),
            "at64_per_s": at64,
            "errors": {s: sum(sum(r["errors"].values()) for r in rows if r["system"] == s) for s in SYSTEMS},
            "wrong_answers": {s: sum(r["wrong_answers"] for r in rows if r["system"] == s) for s in SYSTEMS},
            "membership_losses": report["node"].get("membership_losses"),
            "session_timeouts": report["node"].get("session_timeouts"),
            "losses_held": report["node"].get("losses_held"),
            "etcd": report["etcd"]["version"], "wall_seconds": report["wall_seconds"]}
    out["goals"] = {key: {"value": out.get(key), "at_least": target, "met": out.get(key) is not None
                          and out[key] >= target, "what": what} for key, target, what in GOALS}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="clients 1, 64, 256 and 2 s windows (~2 min)")
    parser.add_argument("--no-etcd", action="store_true", help="only the store and the empty server")
    parser.add_argument("--serve-empty", metavar="HOST:PORT", help=argparse.SUPPRESS)
    parser.add_argument("--render", metavar="JSON", type=Path,
                        help="only print the README tables and redraw the plot of a recorded run")
    parser.add_argument("--only", metavar="OP@CLIENTS", action="append", type=point,
                        help=f"run only this point (repeatable; OP one of {', '.join(OPS)}), no WAL phase")
    parser.add_argument("--seconds", type=float, help="window of every point (default: the profile's)")
    parser.add_argument("--systems", type=systems_arg, default=SYSTEMS,
                        help="comma-separated targets among store, etcd, empty (the store always runs)")
    parser.add_argument("--keep-logs", metavar="DIR", type=Path,
                        help="copy the node's, the broker's and etcd's logs into DIR")
    args = parser.parse_args(argv)
    if args.serve_empty:
        asyncio.run(kvbench.serve_empty(args.serve_empty, EmptyKV()))
        return 0
    if args.render:
        report = json.loads(args.render.read_text())
        plot(report)
        print(markdown(report))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through the finally blocks
    profile_name = "quick" if args.quick else "full"
    profile, wall = dict(PROFILES[profile_name]), time.monotonic()
    if args.only:
        profile.update(only=frozenset(args.only), clients=tuple(sorted({c for _, c in args.only})))
    if args.seconds is not None:
        profile["seconds"] = args.seconds
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    skip_etcd = args.no_etcd or "etcd" not in args.systems
    binary, how = (None, "skipped (--no-etcd / --systems)") if skip_etcd else ensure_etcd()
    info = {"nproc": len(os.sched_getaffinity(0)), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "platform": platform.platform(), "grpc": grpc.__version__,
            "protobuf_impl": api_implementation.Type(), "kafka": KAFKA_VERSION}
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp_name:
        try:
            measured = run(Path(tmp_name), profile, binary, args.systems)
        finally:
            if args.keep_logs:
                keep_logs(Path(tmp_name), args.keep_logs)
    if args.only:
        profile_name = "only"
    report = {"bench": "peer", "profile": profile_name, "utc": stamp, "wall_seconds": round(time.monotonic() - wall, 1),
              "series_seconds": profile["seconds"], "warmup_seconds": profile["warmup"], "clients": profile["clients"],
              "shards": SHARDS, "value_bytes": VALUE_BYTES, "batch": BATCH, "machine": info,
              "etcd": {"binary": binary, "how": how, "version": etcd_version(binary) if binary else None}, **measured}
    summary = headline(report)
    report = {**summary, **report}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    names = [f"peer-{profile_name}-{stamp}.json"] + ([] if args.only else [f"peer-latest-{profile_name}.json"])
    for name in names:
        (RESULTS_DIR / name).write_text(json.dumps(report, indent=2) + "\n")
    if not args.only:
        plot(report)
    print(json.dumps(summary))
    return 0


def point(raw: str) -> tuple[str, int]:
    """`--only get@256` -> ("get", 256)."""
    op, sep, clients = raw.partition("@")
    if not sep or op not in OPS or not clients.isdigit() or int(clients) < 1:
        raise argparse.ArgumentTypeError(f"{raw!r}: expected OP@CLIENTS, OP one of {', '.join(OPS)}")
    return op, int(clients)


def systems_arg(raw: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(["store", *(n.strip() for n in raw.split(",") if n.strip())]))
    if unknown := [n for n in names if n not in SYSTEMS]:
        raise argparse.ArgumentTypeError(f"unknown targets {unknown}: choose among {', '.join(SYSTEMS)}")
    return names


def keep_logs(tmp: Path, out: Path) -> None:
    """The logs worth reading after a run: the node's, the broker's (the group coordinator and the
    controller say there why a member or a broker was removed) and etcd's."""
    out.mkdir(parents=True, exist_ok=True)
    for path in (tmp / "node.log", tmp / "etcd.log", *sorted((tmp / "kafka").glob("node-*/broker.log"))):
        if path.exists():
            shutil.copy(path, out / (f"broker-{path.parent.name}.log" if path.name == "broker.log" else path.name))
    log(f"logs kept in {out}")


# ---- output ----------------------------------------------------------------------------------------------

COLORS = {"store": "tab:blue", "etcd": "tab:green", "empty": "grey"}
TITLES = {"put": "Put", "get": "linearizable Get", "batch": f"Txn of {BATCH} puts (keys/s)",
          "wbatch": f"batch RPC, {BATCH} puts (keys/s; etcd: Txn)", "mixed": "90 % Get / 10 % Put",
          "txn1": "transfer, one shard", "txnx": "transfer, two shards", "txnr": "read-only Txn, two shards"}


def plot(report: Row) -> None:
    """bench/results/peer-<profile>.png: throughput (top) and p99 (bottom) against clients, per load."""
    try:
        import matplotlib
    except ImportError:
        log(f"no plot: matplotlib is missing (pip install -e '.[bench]'); then: python bench/peer.py --render "
            f"bench/results/peer-latest-{report['profile']}.json")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(OPS), figsize=(22, 8.5))
    for col, op in enumerate(OPS):
        for system in SYSTEMS:
            rows = sorted((r for r in report["results"] if r["op"] == op and r["system"] == system),
                          key=lambda r: r["clients"])
            if not rows:
                continue
            style = {"color": COLORS[system], "marker": "s" if system == "empty" else "o", "linewidth": 1.8,
                     "label": {"empty": "empty grpc.aio server", "etcd": f"etcd {report['etcd']['version']}",
                               "store": f"store (1 node, {SHARDS} shards, Kafka WAL)"}[system]}
            for row_i, key in enumerate(("keys_per_s" if op in BATCH_OPS else "ops_per_s", "p99_ms")):
                axes[row_i][col].plot([r["clients"] for r in rows], [r[key] for r in rows], **style)
        axes[0][col].set_title(TITLES[op])
        for row_i, ylabel in enumerate(("throughput (per s)", "p99 latency (ms)")):
            ax = axes[row_i][col]
            ax.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel=ylabel)
            ax.set_xticks(report["clients"], [str(c) for c in report["clients"]])
            ax.grid(True, which="both", alpha=0.3)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=3)
    fig.suptitle(f"bench/peer.py --{report['profile']} at {report['utc']}: {report['machine']['nproc']} cores "
                 "shared by the targets, Kafka and the load generator")
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path := RESULTS_DIR / f"peer-{report['profile']}.png", dpi=100)
    plt.close(fig)
    log(f"plot: {path.relative_to(REPO)}")


def markdown(report: Row) -> str:
    """The tables for bench/README.md (the analysis there is written by hand)."""
    rows = report["results"]
    by = {(r["system"], r["op"], r["clients"]): r for r in rows}

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.3g}"

    def field(r: Row | None, key: str) -> Any:
        return None if r is None else r[key]

    def cpu(r: Row | None) -> str:
        if r is None:
            return "-"
        c = r["cpu_percent"]
        return "/".join("-" if c.get(k) is None else f"{c[k]:.0f}" for k in ("server", "broker", "loadgen")
                        if k in c)

    goals = ["| goal (issue 12) | at least | measured | |", "|---|---:|---:|---|"]
    for key, target, what in GOALS:
        value = report.get("goals", {}).get(key, {}).get("value")
        met = "-" if value is None else "met" if value >= target else "**missed**"
        goals.append(f"| {what} (`{key}`) | {num(target)} | {num(value)} | {met} |")
    out = [*goals, "",
           "| load | clients | store | etcd | empty | store/etcd | store/empty | p99 ms store / etcd / empty "
           "| CPU % store (node/broker/loadgen) | CPU % etcd (server/loadgen) | CPU % empty (server/loadgen) |",
           "|---|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    for op in OPS:
        key = "keys_per_s" if op in BATCH_OPS else "ops_per_s"
        for clients in report["clients"]:
            r = {s: by.get((s, op, clients)) for s in SYSTEMS}
            v = {s: field(r[s], key) for s in SYSTEMS}
            ratios = [f"**{v['store'] / v[s]:.2f}**" if v["store"] is not None and v[s] else "-"
                      for s in ("etcd", "empty")]
            p99 = " / ".join(num(field(r[s], "p99_ms")) for s in SYSTEMS)
            out.append(f"| {op}{' keys/s' if op in BATCH_OPS else ''} | {clients} | {num(v['store'])} | "
                       f"{num(v['etcd'])} | {num(v['empty'])} | {ratios[0]} | {ratios[1]} | {p99} | "
                       f"{cpu(r['store'])} | {cpu(r['etcd'])} | {cpu(r['empty'])} |")
    wal = [f"{r['op']}@{r['clients']}: {r['mean_batch_records']} records / {r['mean_commit_ms']} ms"
           for r in rows if r["system"] == "store" and "wal_batches" in r]
    node = report.get("node", {})
    membership = (f"Node group membership: {node.get('membership_losses', '-')} losses (partitions given up "
                  f"before the stop), {node.get('session_timeouts', '-')} session timeouts of librdkafka's own, "
                  f"{node.get('losses_held', '-')} of them ridden out (kept in the same generation: "
                  f"{node.get('losses_held_kept', '-')}); errors: "
                  + ", ".join(f"{s} {n:,}" for s, n in report.get("errors", {}).items()) + ".")
    return "\n".join([*out, "", "Store WAL transactions (mean records per transaction / mean append+commit): "
                      + "; ".join(wal) + ".", "", membership])


if __name__ == "__main__":
    sys.exit(main())
