"""`kvstore serve`: the process of one node, its gRPC server (grpc.aio) and its life.

Services: kvstore.v1.KVService (`kvstore.server.kv_service`), kvstore.v1.ClusterService
(`kvstore.server.cluster_service`), grpc.health.v1.Health (NOT_SERVING until every shard
bootstrapped), server reflection of those (grpcurl works without .proto files), and, on the same
port, kvstore.internal.v1.PeerService (`kvstore.server.peer_service`): the calls nodes make to
each other. It is internal: not listed by reflection, not for clients, no compatibility promise.
Prometheus metrics on --metrics-port. Security (kvstore.server.auth): TLS with --tls-cert, bearer
tokens and/or mutual TLS with roles, checked by the one interceptor; without a certificate the
node is plaintext and unauthenticated, and says so loudly at startup.
SIGTERM/SIGINT: stop taking requests, finish the batches in flight, answer their clients, then
stop (no acknowledged write is lost: acknowledgement follows commit).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

import kvstore
import wal
from kvstore import limits
from kvstore.internal.v1 import peer_pb2_grpc
from kvstore.server import auth, config, logs
from kvstore.server.cluster_service import ClusterService
from kvstore.server.config import NodeConfig
from kvstore.server.interceptor import ErrorInterceptor
from kvstore.server.kv_service import KVService
from kvstore.server.node import Node
from kvstore.server.peer_service import PeerService
from kvstore.server.peers import Peers
from kvstore.server.placement_log import PlacementSettingsError
from kvstore.server.scan import Scans
from kvstore.server.watch import Watches
from kvstore.v1 import cluster_pb2, cluster_pb2_grpc, kv_pb2, kv_pb2_grpc

log = logging.getLogger("kvstore.server")

MAX_IO_THREADS = 512


async def _health_loop(node: Node, servicer: health.HealthServicer, stop: asyncio.Event) -> None:
    names = ("", "kvstore.v1.KVService", "kvstore.v1.ClusterService")
    while not stop.is_set():
        serving = node.serving()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in names:
            await servicer.set(name, status)
        for shard, replica in node.replicas.items():
            label = str(shard)
            node.metrics.open_txn_age.labels(shard=label).set(replica.open_txn_age_ms() / 1000)
            node.metrics.end_offset.labels(shard=label).set(replica.end_offset)
            node.metrics.lag_records.labels(shard=label).set(max(0, replica.end_offset - replica.store.applied_offset))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
    for name in names:
        await servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


async def serve(config: NodeConfig, ready: Callable[[str], None] | None = None) -> None:
    """Run a node until SIGTERM/SIGINT."""
    try:
        security = auth.load(config)  # TLS, who may call what, how to call the peers (docs/security.md)
    except ValueError as exc:
        raise SystemExit(f"kvstore serve: {exc}") from exc
    peers = Peers(security.peer_credentials)
    node = Node(config, peers)
    # gRPC binds with SO_REUSEPORT by default: a second process on the same address would share
    # its connections with the first without a word (two nodes answering as one). Refuse instead.
    # Every RPC passes the one interceptor: it authorizes, decodes, maps errors to rich status, counts.
    server = grpc.aio.server(interceptors=[ErrorInterceptor(node.metrics, authorize=security.authorizer,
                                                            client_address=node.client_address)],
                             options=[("grpc.max_receive_message_length", limits.GRPC_MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", limits.GRPC_MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])
    # Scan pages and watch streams are served to clients and, in parts, to the other nodes.
    scans, watches = Scans(node, peers), Watches(node, peers)
    kv_service = KVService(node, peers, scans, watches)
    kv_pb2_grpc.add_KVServiceServicer_to_server(kv_service, server)  # type: ignore[no-untyped-call]
    cluster_service = ClusterService(node, peers)
    cluster_pb2_grpc.add_ClusterServiceServicer_to_server(cluster_service, server)  # type: ignore[no-untyped-call]
    # Internal, on the same port (peer.proto): left out of reflection, which lists the API.
    peer_pb2_grpc.add_PeerServiceServicer_to_server(PeerService(node, scans, watches), server)  # type: ignore[no-untyped-call]
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((
        kv_pb2.DESCRIPTOR.services_by_name["KVService"].full_name,
        cluster_pb2.DESCRIPTOR.services_by_name["ClusterService"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME), server)
    try:
        port = (server.add_secure_port(config.listen, security.credentials) if security.credentials is not None
                else server.add_insecure_port(config.listen))
    except RuntimeError as exc:  # grpc raises instead of returning 0 when the address is taken
        raise SystemExit(f"cannot listen on {config.listen}: {exc} (another process there?)") from exc
    if port == 0:
        raise SystemExit(f"cannot listen on {config.listen}")
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.metrics_host, registry=node.metrics.registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Every blocking WAL call runs in a worker thread (asyncio.to_thread). The default pool has
    # cpu + 4 workers, fewer than the replicas that each keep one busy polling: size it for them
    # (a follower poll, an append or bootstrap, a barrier query per shard, plus the node's own).
    workers = min(MAX_IO_THREADS, 3 * config.shards + 16)
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvstore-io"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    fatal: list[str] = []  # why the node stops by itself (its settings are not the cluster's)

    def stop_fatally(why: str) -> None:
        fatal.append(why)
        stop.set()

    node.on_fatal = stop_fatally
    host = config.listen.rsplit(":", 1)[0]
    address = f"{host}:{port}"
    warning = security.warning(address)
    if warning is not None:
        log.warning("WARNING: %s", warning, extra={"event": "insecure", "address": address, "security": security.mode})
    await server.start()
    try:
        await node.start(address)
    except (wal.WalError, PlacementSettingsError):  # the WAL topic is wrong, the brokers unreachable, or
        await node.stop()                            # this node's settings are not the cluster's
        await server.stop(grace=None)
        raise
    health_task = asyncio.create_task(_health_loop(node, health_servicer, stop))
    log.info("serving", extra={"event": "serving", "address": address, "node": config.node_id,
                               "shards": config.shards, "topic": config.wal_topic, "security": security.mode,
                               "version": kvstore.__version__})
    if ready is not None:
        ready(address)
    await stop.wait()
    log.info("shutting down", extra={"event": "shutdown"})
    # Stop taking new RPCs (in-flight ones, waiting on commits, get the grace period) and at the
    # same time hand the shards over: the other nodes take them while this one drains.
    stopping = asyncio.create_task(server.stop(grace=10))
    try:
        await asyncio.wait_for(node.stop(), STOP_TIMEOUT_S)
    except TimeoutError:
        # A step hangs (a broker not answering a group leave, a thread stuck in a call): say which,
        # and exit as a crash would. Nothing acknowledged depends on it (acknowledgement follows
        # commit) and a restart recovers from the WAL; waiting on would only hold the port.
        log.error("shutdown overran %.0f s in its step %r: exiting without finishing it", STOP_TIMEOUT_S,
                  node.stopping_step, extra={"event": "stop_overran", "step": node.stopping_step})
        logging.shutdown()
        os._exit(EXIT_STOP_OVERRAN)
    await stopping
    await health_task
    await peers.close()
    if fatal:
        raise PlacementSettingsError(fatal[0])


# A graceful stop's bound, above the sum of its documented waits (a shard handover waiting for its
# batch in flight, RESIGN_TIMEOUT_S = 15 s; an append in flight, up to 2 x the call timeout = 20 s;
# docs/operations.md): past it the process exits as a crash would, naming the step it hung in.
STOP_TIMEOUT_S = 45.0
EXIT_STOP_OVERRAN = 3


# The young generation's threshold: CPython collects it every 700 net allocations by default; a node
# allocates a few objects per record it replays and per request it serves, almost none of them in
# cycles, so most of those passes find nothing (GC took 8-15 % of a replay's samples).
GC_YOUNG_THRESHOLD = 50_000


def tune_gc() -> None:
    """Fewer, cheaper collector passes: what was loaded at start (modules, config, stubs) is frozen
    out of every later pass, and the young generation is collected every GC_YOUNG_THRESHOLD
    allocations instead of 700. Cycles are still collected, only later; memory held by them is
    bounded by the threshold. Measured on a node bootstrap of 200k records: +12-14 %."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstore serve", description="Run a kvstore node.",
        epilog="Every setting is a flag, a KVSTORE_* environment variable and a key of the --config TOML file "
               "(kvstore.server.config); an unknown KVSTORE_* variable or file key is refused.")
    parser.add_argument("--log-format", choices=("json", "text"), default="json")
    parser.add_argument("--log-level", choices=logs.LEVELS, default="info",
                        help="the least severe level logged (default: info)")
    config.add_flags(parser)
    args = parser.parse_args(argv)
    logs.configure(args.log_format, args.log_level)
    try:
        settings = config.from_args(args)
        auth.load(settings)  # refuse a contradictory or unreadable security setting before anything starts
    except (ValueError, TypeError) as exc:
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    tune_gc()
    try:
        asyncio.run(serve(settings, ready=lambda addr: print(
            json.dumps({"event": "ready", "address": addr, "after_s": round(time.monotonic() - started, 2)}),
            flush=True)))
    except wal.WalError as exc:
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 1
    except PlacementSettingsError as exc:
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
