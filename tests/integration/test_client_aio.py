"""The clients against real nodes (a broker, two node processes, real gRPC): the asyncio client's
every call (batches, a batching writer and the operators' calls too), a watch, a write whose
leader is paused mid-call (an unknown outcome, finished once by its retry), a leader killed under
a stream of writes (failover: nothing acknowledged lost), a watch resumed across its node's
death; and the command line's binary values and health."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore import errors
from kvstore.client import Client, Compare, Op, PlacementRefused, ShardMap, UnknownOutcome
from kvstore.client.aio import AsyncBatchingWriter, AsyncClient
from kvstore.core.sharding import shard_of
from kvstore.v1 import kv_pb2, kv_pb2_grpc
from tests.integration.helpers import start_all
from tests.integration.store_process import StoreProcess
from tests.integration.test_cluster import SHARDS, Cluster
from tests.waiting import wait_until
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
TIMEOUT_S = 20.0
KVSTORE = str(Path(sys.executable).parent / "kvstore")  # the installed console script


@pytest.fixture(scope="module")
def cluster(kafka: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(kafka.bootstrap_servers, tmp_path_factory.mktemp("aio"), nodes=2).start()
    try:
        yield c
    finally:
        c.stop()


def key_of(shard: int, prefix: str) -> bytes:
    return next(k for k in (f"{prefix}/{i}".encode() for i in range(1000)) if shard_of(k, SHARDS) == shard)


def client_of(cluster: Cluster, **kwargs: float) -> AsyncClient:
    options = {"timeout_s": TIMEOUT_S, "max_attempts": 100, "max_backoff_s": 0.1, **kwargs}
    return AsyncClient(cluster.endpoints, **options)  # type: ignore[arg-type]


def test_every_call_and_a_watch(cluster: Cluster) -> None:
    a, b = key_of(0, "aio"), key_of(1, "aio")

    async def scenario() -> None:
        async with client_of(cluster) as client:
            smap = await client.shard_map()
            assert smap.shard_count == SHARDS and all(s.leader for s in smap.shards)
            watch = await client.watch(prefix="aio/")  # registered: every change from now on is delivered
            async with watch:
                put = await client.put(a, "1")
                assert (await client.get(a)).value == b"1" and put.revision is not None
                moved = await client.txn([Compare.value(a, "==", "1")], [Op.put(a, "0"), Op.put(b, "1")])
                assert moved.succeeded and {r.key for r in moved.results} == {a, b}  # a cross-shard Txn
                assert [kv.key for kv in [kv async for kv in client.scan_all(prefix="aio/")]] == sorted([a, b])
                assert (await client.delete(b)).request_id
                seen = []
                async for event in watch:
                    seen.append((event.type, event.kv.key))
                    if len(seen) == 4:
                        break
            assert sorted(seen) == sorted([("put", a), ("put", a), ("put", b), ("delete", b)]), seen
            stale = await client.get(a, consistency="stale", min_revision=moved.results[0].revision)  # type: ignore[union-attr]
            assert stale.value == b"0"

    asyncio.run(scenario())


def test_batches_a_batching_writer_and_the_operators_calls(cluster: Cluster) -> None:
    """write_batch (and its retry by id, applied once), put_many, AsyncBatchingWriter, and the
    operators' calls against real nodes, each read back as the synchronous client reads it."""
    ops = [Op.put(key_of(s, "aio-batch"), f"v{s}") for s in range(SHARDS)]
    first_ms = int(time.time() * 1000)

    async def scenario() -> None:
        async with client_of(cluster) as client:
            result = await client.write_batch(ops, "aio-batch-1", first_attempt_unix_ms=first_ms)
            assert sorted(p.shard for p in result.shards) == list(range(SHARDS)) and result.mutations == SHARDS
            again = await client.write_batch(ops, "aio-batch-1", first_attempt_unix_ms=first_ms)
            assert all(p.replayed for p in again.shards) and again.revisions == result.revisions
            many = await client.put_many({key_of(s, "aio-many"): "m" for s in range(SHARDS)})
            assert many.mutations == SHARDS
            async with AsyncBatchingWriter(client, linger_ms=2, max_batch_mutations=50) as writer:
                futures = [await writer.put(f"aio-w/{i:04d}", str(i)) for i in range(400)]
                written = await asyncio.gather(*futures)
            assert {w.shard for w in written} == set(range(SHARDS)) and writer.mutations == 400
            assert 2 <= writer.batches < 400, writer.batches  # batched: a call carries <= 50 writes per shard
            # The operators' calls (a read role's and an admin's), answered by the real nodes.
            log = await client.placement_log(10)
            assert log.entries and log.controller and log.epoch > 0
            assert await client.list_transactions(older_than_ms=60_000) == []
            prepared, unreachable = await client.prepared_transactions(older_than_ms=60_000)
            assert prepared == [] and unreachable == []
            with pytest.raises(PlacementRefused, match="fewer than R"):
                await client.drain(cluster.nodes[0].node_id)  # two nodes, R = 2: no floor left
            fenced = await client.fence(1)
            assert fenced.shard == 1 and fenced.end_offset >= 0

    asyncio.run(scenario())
    with cluster.client() as sync:
        assert [(kv.key, kv.version) for kv in sync.scan_all(prefix="aio-batch/")] == \
            sorted((op.key, 1) for op in ops)  # the retry applied nothing twice
        values = {kv.key: kv.value for kv in sync.scan_all(prefix="aio-w/")}
        assert values == {f"aio-w/{i:04d}".encode(): str(i).encode() for i in range(400)}
    cluster.wait_settled()  # the fenced shard led again
    with cluster.client() as sync:
        assert sync.put(key_of(1, "aio-after-fence"), "x").revision is not None


def test_a_write_whose_leader_is_paused_is_unknown_and_its_retry_applies_once(cluster: Cluster) -> None:
    shard = 2
    key = key_of(shard, "aio-paused")
    leader = cluster.leader_of(shard)
    assert leader.proc is not None

    async def lost() -> UnknownOutcome:
        # The call's deadline (1.2 s) ends before the paused leader's session can (1.5 s): no other
        # node can have taken the shard over and committed the write while the call ran. (With
        # 2.5 s a loaded CI run saw the takeover, and the retry committed there: no unknown.)
        async with client_of(cluster, timeout_s=1.2, attempt_timeout_s=1.0) as client:
            await client.get(key)  # the map cached and the channel to the leader open
            leader.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
            try:
                with pytest.raises(UnknownOutcome) as unknown:
                    await client.put(key, "maybe")
            finally:
                leader.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
            return unknown.value

    error = asyncio.run(lost())
    assert error.request_id and error.first_attempt_unix_ms
    cluster.wait_settled()

    async def retried() -> None:
        async with client_of(cluster) as client:
            done = await client.put(key, "maybe", error.request_id, first_attempt_unix_ms=error.first_attempt_unix_ms)
            got = await client.get(key)
            assert got.value == b"maybe" and got.kv is not None and got.kv.version == 1, (done, got)  # applied once

    asyncio.run(retried())


def test_writes_go_on_through_a_leader_killed_under_them(cluster: Cluster) -> None:
    shard = 3
    victim = cluster.leader_of(shard)
    acked: list[bytes] = []

    async def writer(client: AsyncClient, stop: asyncio.Event) -> None:
        i = 0
        while not stop.is_set():
            key = key_of(shard, f"aio-fo-{i}")
            i += 1
            try:
                await client.put(key, "v")
                acked.append(key)
            except UnknownOutcome:
                pass  # may or may not be in: not counted either way

    async def scenario() -> None:
        async with client_of(cluster) as client:
            stop = asyncio.Event()
            task = asyncio.create_task(writer(client, stop))
            while len(acked) < 10:
                await asyncio.sleep(0.05)
            victim.stop(signal.SIGKILL)
            before = len(acked)
            deadline = time.monotonic() + 60
            while len(acked) < before + 20:  # writes flow again, on the new leader
                assert time.monotonic() < deadline, f"no writes acknowledged after the kill ({before})"
                await asyncio.sleep(0.1)
            stop.set()
            await task
            for key in acked:  # nothing acknowledged was lost
                assert (await client.get(key)).value == b"v", key

    try:
        asyncio.run(scenario())
    finally:
        victim.start()
        cluster.wait_settled()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_watch_resumes_where_it_stood_when_its_node_is_killed(cluster: Cluster, how: signal.Signals) -> None:
    """The node serving a prefix watch over every shard dies between changes (or stops cleanly,
    which once ended the stream as if the watch were over): the watch resumes on the other node
    from the start revisions and the changes it had delivered (etcd's clientv3 does the same),
    and every change arrives exactly once."""
    victim, other = cluster.nodes[0], cluster.nodes[1]
    before = [key_of(s, f"aio-w-{how.name}-{s}") for s in range(SHARDS)]
    after = [key_of(s, f"aio-w2-{how.name}-{s}") for s in range(SHARDS)]

    async def scenario() -> list[bytes]:
        async with AsyncClient([victim.address, other.address], timeout_s=TIMEOUT_S, max_attempts=100,
                               max_backoff_s=0.2) as watching, client_of(cluster) as writer:
            seen: list[bytes] = []
            async with await watching.watch(prefix="aio-w") as watch:
                for key in before:
                    await writer.put(key, "1")
                async for event in watch:
                    seen.append(event.kv.key)
                    if len(seen) == len(before):
                        break
                victim.stop(how)  # the watch's node: its stream breaks
                for key in after:
                    await writer.put(key, "2")
                async for event in watch:
                    seen.append(event.kv.key)
                    if len(seen) == len(before) + len(after):
                        break
            return seen

    try:
        seen = asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        victim.start()
        cluster.wait_settled()
    assert sorted(seen) == sorted(before + after) and len(seen) == len(set(seen)), seen


def kvstore_cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([KVSTORE, *args], input=stdin, capture_output=True, timeout=60, check=False)


def test_the_cli_round_trips_binary_values_and_reports_health(cluster: Cluster, tmp_path: Path) -> None:
    """The command line beside the clients: a binary value in with --value-file and out, byte for
    byte, raw on stdout or into a file; hex; every endpoint's health."""
    endpoints = ",".join(cluster.endpoints)
    blob = bytes(range(256)) * 4 + b"\x00\xff"
    (tmp_path / "in.bin").write_bytes(blob)
    put = kvstore_cli("--endpoints", endpoints, "put", "aio-cli/blob", "--value-file", str(tmp_path / "in.bin"))
    assert put.returncode == 0, put.stderr
    raw = kvstore_cli("--endpoints", endpoints, "get", "aio-cli/blob", "--print-value-only")
    assert raw.returncode == 0 and raw.stdout == blob, raw.stderr
    out = kvstore_cli("--endpoints", endpoints, "get", "aio-cli/blob", "--out", str(tmp_path / "out.bin"), "-o",
                      "json")
    assert out.returncode == 0 and (tmp_path / "out.bin").read_bytes() == blob, out.stderr
    record = json.loads(out.stdout)
    assert record["value_file"] == str(tmp_path / "out.bin") and record["value_bytes"] == len(blob), record
    hexed = kvstore_cli("--endpoints", endpoints, "get", "aio-cli/blob", "--hex", "-o", "json")
    assert json.loads(hexed.stdout)["value_hex"] == blob.hex(), hexed.stderr
    health = kvstore_cli("--endpoints", endpoints, "-o", "json", "health")
    assert health.returncode == 0, health.stderr
    assert [json.loads(line)["status"] for line in health.stdout.splitlines()] == ["SERVING"] * len(cluster.nodes)
    missing = kvstore_cli("--endpoints", f"{endpoints},127.0.0.1:1", "health")
    assert missing.returncode == 1 and b"UNREACHABLE" in missing.stdout, missing.stdout


def test_nodes_advertise_to_clients_an_address_apart_from_their_peers(kafka: LocalKafka, tmp_path: Path) -> None:
    """`--advertise-client` (docker-compose.yml's published ports): the nodes reach each other at
    127.0.0.1:P, clients are told localhost:P (the same socket under another name), in the shard
    map and in a NOT_LEADER hint, and a client routed by them works."""
    nodes = [StoreProcess(kafka.bootstrap_servers, tmp_path / f"n{i}", "advc", shards=2, node_id=f"n{i}",
                          extra_args=("--session-timeout-ms", "1500")) for i in (1, 2)]
    for node in nodes:
        node.extra_args = (*node.extra_args, "--advertise-client", f"localhost:{node.port}")
    start_all(nodes)
    try:
        client_addresses = {f"localhost:{n.port}" for n in nodes}
        with Client([nodes[0].address], timeout_s=TIMEOUT_S, max_attempts=100, max_backoff_s=0.1) as client:
            def settled() -> ShardMap | None:
                smap = client.shard_map()
                ready = len(smap.nodes) == 2 and all(s.leader and s.leader_ready for s in smap.shards)
                return smap if ready else None

            smap = wait_until(settled, 60, what="both nodes listed, every shard led")
            assert {n.address for n in smap.nodes} == client_addresses, smap.nodes
            assert {s.leader for s in smap.shards} <= client_addresses, smap.shards
            client.put("advc-key", "v")
            assert client.get("advc-key").value == b"v"
        leader = smap.shards[0].leader
        other = next(n for n in nodes if f"localhost:{n.port}" != leader)
        channel = grpc.insecure_channel(other.address)
        stub = kv_pb2_grpc.KVServiceStub(channel)  # type: ignore[no-untyped-call]

        def hinted() -> str | None:
            """The hint a client gets (once the node heard its peer's client address: its next
            report round, about a second)."""
            try:
                stub.Put(kv_pb2.PutRequest(key=key_of_shard(0, 2), value=b"x"), timeout=TIMEOUT_S,
                         metadata=((errors.FORWARD_KEY, errors.FORWARD_NEVER),))
            except grpc.RpcError as refused:
                hint = dict(refused.trailing_metadata() or ()).get(errors.LEADER_HINT_KEY)  # type: ignore[attr-defined]
                return hint if hint == leader else None
            raise AssertionError(f"{other.address} took a write of a shard led by {leader}")

        try:
            wait_until(hinted, 20, what=f"a NOT_LEADER hint naming {leader}")
        finally:
            channel.close()
    finally:
        for node in nodes:
            node.stop()


def key_of_shard(shard: int, shards: int) -> bytes:
    return next(k for k in (f"advc/{i}".encode() for i in range(1000)) if shard_of(k, shards) == shard)
