"""`make up`: a local Kafka broker plus three store nodes on loopback, in the foreground.

Data lives in a visible directory (default `.data/`) and a second run resumes it: the broker
keeps its ports and log, each node its LevelDB checkpoint and its port (50051, 50052, 50053
when free). A node that dies (say, killed by `kvstore demo failover`) is restarted after a
moment, like a process supervisor would, and takes shards again. Ctrl-C stops the nodes
gracefully (batches in flight finish and are answered), then the broker.

The nodes it started (id, address, pid, and the process's start time and command line) are
recorded in `children.json` in the data dir, rewritten on every (re)start and removed on exit:
`kvstore demo failover` kills only a process recorded there (`kvstore.dev.children`).

`--secure-kafka` runs the broker with SASL/SCRAM logins and ACLs (`wal.broker`, `wal.acl`;
docs/security.md, "Kafka security"): the nodes log in as the store's principal `<cluster>-store`, the
pipeline commands as `<cluster>-pipeline`; their passwords are in files (mode 0600) under the
broker's data dir. A data dir keeps the mode it was first started with.

gRPC security (docs/security.md): without flags the nodes speak plaintext and authenticate
nobody, and the cluster says so loudly. `--tls` runs every node with TLS and bearer tokens (the
nodes authenticate to each other with a token of role node); `--mtls` with mutual TLS instead
(every caller presents a certificate; its role is in it); `--secure` is `--tls` plus
`--secure-kafka` (`make up-secure`). The certificates and tokens come from a development CA
(`kvstore.dev.ca`) under `<data dir>/tls/`, reused across runs; the cluster prints the
KVSTORE_CA/KVSTORE_TOKEN_FILE (or KVSTORE_CERT/KVSTORE_KEY) exports a shell needs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import Client, KvError
from kvstore.client.security import ClientSecurity
from kvstore.dev import children
from kvstore.dev.ca import DevCA, DevPki
from kvstore.server.logs import LEVELS
from wal.acl import create_acls, wal_grants
from wal.broker import ADMIN_USER, KAFKA_VERSION, LocalKafka, free_port

RESTART_DELAY_S = 2.0
FIRST_PORT = 50051
FIRST_METRICS_PORT = 9101  # Prometheus /metrics of node-1, node-2, ... (as docker-compose.yml publishes them)


def _wait_serving(address: str, proc: subprocess.Popen[bytes], timeout_s: float,
                  security: ClientSecurity | None = None) -> None:
    channel = security.channel(address) if security is not None else grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the store node exited with {proc.returncode}; see its log")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVService"), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"the store node did not become SERVING within {timeout_s}s")
    finally:
        channel.close()


def _wait_led(endpoints: list[str], security: ClientSecurity | None, timeout_s: float) -> None:
    """Until every shard has a ready leader: SERVING says only that a node answers, and a
    newcomer's first `kvstore get` right after the endpoints are printed (or after a resume, while
    the leadership group still rebalances) must not meet a shard nobody leads yet."""
    deadline = time.monotonic() + timeout_s
    waiting = "no shard map yet"
    with Client(endpoints, security=security if security is not None else ClientSecurity(), timeout_s=5) as client:
        while time.monotonic() < deadline:
            try:
                shard_map = client.shard_map(timeout_s=2)
                unled = [s.shard for s in shard_map.shards if not (s.leader and s.leader_ready)]
                if shard_map.shards and not unled:
                    return
                waiting = f"shards without a ready leader: {unled}"
            except KvError as e:
                waiting = f"shard map: {e}"
            time.sleep(0.2)
    raise SystemExit(f"not every shard had a ready leader within {timeout_s}s ({waiting}); see the nodes' logs")


def _port_free(port: int) -> bool:
    """Whether a node could listen on `port` now: bound as gRPC binds (SO_REUSEADDR), so the
    connections a previous run left in TIME_WAIT do not count, a process listening there does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ports(data_dir: Path, nodes: int, *, first: int = FIRST_PORT, name: str = "ports.json",
           what: str = "port", taken: Sequence[int] = ()) -> list[int]:
    """Each node's port, kept across runs (clients and the README's examples keep working) while
    it is free: one that another process took meanwhile would keep its node from ever starting
    (a resume waited forever), so that node gets a free port, said on stderr and saved. `taken`:
    ports already handed out (the gRPC ports, when these are the metrics ports)."""
    port_file = data_dir / name
    saved: list[int] = json.loads(port_file.read_text()) if port_file.exists() else []
    ports: list[int] = []
    for i in range(nodes):
        kept = saved[i] if i < len(saved) else None
        if kept is not None and kept not in ports and kept not in taken and _port_free(kept):
            ports.append(kept)
            continue
        preferred = first + i
        free = preferred not in ports and preferred not in saved and preferred not in taken and _port_free(preferred)
        port = preferred if free else free_port()
        if kept is not None:
            print(f"node-{i + 1}: {what} {kept} is taken by another process; using {port} instead", file=sys.stderr)
        ports.append(port)
    port_file.write_text(json.dumps(ports) + "\n")
    return ports


class _Node:
    def __init__(self, node_id: str, address: str, data_dir: Path, kafka: str, args: argparse.Namespace,
                 login: tuple[str, ...] = (), metrics_port: int = 0) -> None:
        self.node_id = node_id
        self.address = address
        self.metrics = f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else ""
        self.log_path = data_dir / f"{node_id}.log"
        self.cmd = [sys.executable, "-m", "kvstore.server", "--node-id", node_id, "--listen", address,
                    "--data-dir", str(data_dir / node_id), "--kafka", kafka, "--cluster", args.cluster,
                    "--shards", str(args.shards), "--replication-factor", str(args.replication_factor),
                    "--session-timeout-ms", str(args.session_timeout_ms),
                    "--snapshot-dir", str(data_dir / "snapshots"), "--metrics-port", str(metrics_port),
                    "--log-level", args.log_level, *login]
        self.proc: subprocess.Popen[bytes] | None = None
        self.child: children.Child | None = None
        self.died_at: float | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # Its identity now, while it is our unreaped child: the pid cannot have been reused yet.
        self.child = children.child_of(self.node_id, self.address, self.proc.pid)
        self.died_at = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.dev.cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path(".data"))
    parser.add_argument("--nodes", type=int, default=3, choices=range(1, 10), metavar="N")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--replication-factor", type=int, default=3, metavar="R",
                        help="replicas of each shard, capped by the node count (docs/design.md §9)")
    parser.add_argument("--cluster", default="dev")
    parser.add_argument("--session-timeout-ms", type=int, default=1500,
                        help="leadership group session timeout: SIGKILL failover takes about this + ~1 s")
    parser.add_argument("--secure-kafka", action="store_true",
                        help="Kafka with SASL/SCRAM logins and ACLs: only the store may write the WAL, the pipeline "
                             "read it (kept by the data dir once started so)")
    parser.add_argument("--tls", action="store_true",
                        help="gRPC over TLS with bearer tokens per role (a development CA under <data dir>/tls)")
    parser.add_argument("--mtls", action="store_true",
                        help="gRPC over mutual TLS: every caller presents a certificate carrying its role")
    parser.add_argument("--secure", action="store_true", help="--tls and --secure-kafka (make up-secure)")
    parser.add_argument("--log-level", choices=LEVELS, default="info",
                        help="the nodes' log level (their logs: <data dir>/node-N.log)")
    args = parser.parse_args(argv)
    if args.secure:
        args.tls = args.secure_kafka = True
    data_dir: Path = args.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)

    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    store_user, pipeline_user = f"{args.cluster}-store", f"{args.cluster}-pipeline"
    kafka = LocalKafka(data_dir / "kafka", nodes=1, secure=args.secure_kafka,
                       users=(store_user, pipeline_user) if args.secure_kafka else ())
    ports = _ports(data_dir, args.nodes)
    metrics_ports = _ports(data_dir, args.nodes, first=FIRST_METRICS_PORT, name="metrics_ports.json",
                           what="metrics port", taken=ports)
    pki = DevCA(data_dir / "tls").ensure([f"node-{i}" for i in range(1, args.nodes + 1)]) \
        if args.tls or args.mtls else None
    probe = _probe_security(pki, args.mtls)
    nodes: list[_Node] = []
    try:
        print(f"starting Kafka {KAFKA_VERSION} (KRaft) in {data_dir / 'kafka'} ...", flush=True)
        kafka.start()
        login: tuple[str, ...] = ()
        if kafka.secure:
            create_acls(kafka.bootstrap_servers, kafka.credentials(),
                        wal_grants(f"{args.cluster}.wal", f"{args.cluster}.leaders", f"User:{store_user}",
                                   f"User:{pipeline_user}"))
            login = ("--kafka-username", store_user, "--kafka-password-file", str(kafka.password_file(store_user)))
        for i, (port, metrics_port) in enumerate(zip(ports, metrics_ports, strict=True), start=1):
            node = _Node(f"node-{i}", f"127.0.0.1:{port}", data_dir, kafka.bootstrap_servers, args,
                         (*login, *_tls_args(pki, f"node-{i}", args.mtls)), metrics_port)
            node.start()
            nodes.append(node)
            _record(data_dir, nodes)
            print(f"starting {node.node_id} on {node.address} (log: {node.log_path}) ...", flush=True)
        for node in nodes:
            assert node.proc is not None
            _wait_serving(node.address, node.proc, timeout_s=120, security=probe)
        _wait_led([n.address for n in nodes], probe, timeout_s=120)
        endpoints = ",".join(n.address for n in nodes)
        snapshots = data_dir / "snapshots"
        secure = ({"kafka_username": pipeline_user, "kafka_password_file": str(kafka.password_file(pipeline_user))}
                  if kafka.secure else {})
        print(json.dumps({"kafka": kafka.bootstrap_servers, "endpoints": [n.address for n in nodes],
                          "metrics": [n.metrics for n in nodes],
                          "data_dir": str(data_dir), "snapshot_dir": str(snapshots), **secure,
                          **_tls_info(pki, args.mtls)}))
        replicas = min(args.replication_factor, len(nodes))
        print(f"""
The store is up: {len(nodes)} nodes, {args.shards} shards on {replicas} nodes each, WAL topic {args.cluster}.wal
on {kafka.bootstrap_servers}.

  export KVSTORE_ENDPOINTS={endpoints}{_client_login(pki, args.mtls)}
  .venv/bin/kvstore put greeting hello
  .venv/bin/kvstore get greeting
  .venv/bin/kvstore scan --prefix gr
  .venv/bin/kvstore shards                        # who leads what, terms, lag, nodes
  .venv/bin/kvstore demo failover --data-dir {data_dir} --output json   # SIGKILL a leader under load, verify
  .venv/bin/kvstore txn list --older-than 5s
  {_grpcurl(pki, args.mtls, nodes[0].address)}

Prometheus metrics (no authentication, loopback only; docs/operations.md, "Metrics and dashboards"):
  {"  ".join(n.metrics for n in nodes)}

The Spark pipeline (docs/pipeline.md; its commands ask the nodes at KVSTORE_ENDPOINTS for the brokers
and the topic); the nodes load snapshots from {snapshots}:
{_pipeline_login(kafka, pipeline_user)}
  .venv/bin/kvstore snapshot create --dir {snapshots}
  .venv/bin/kvstore audit --dir {snapshots}
  .venv/bin/kvstore wal truncate --dir {snapshots} --dry-run
  .venv/bin/kvstore changes --to {data_dir / "changes"}

A node that dies is restarted after {RESTART_DELAY_S:.0f}s. Ctrl-C stops everything; `make up` again resumes
from {data_dir}.""", flush=True)
        if pki is None:
            print(f"\nWARNING: plaintext, no authentication: anyone who can reach {endpoints} can read and write "
                  "(and fence shards). For local development only; `make up-secure` (--secure) runs TLS with "
                  "tokens.", flush=True)
        while not stop:
            for node in nodes:
                assert node.proc is not None
                if node.proc.poll() is None:
                    continue
                if node.died_at is None:
                    node.died_at = time.monotonic()
                    print(f"{node.node_id} exited ({_how(node.proc.returncode)}); restarting it in "
                          f"{RESTART_DELAY_S:.0f}s (log: {node.log_path})", flush=True)
                elif time.monotonic() - node.died_at >= RESTART_DELAY_S:
                    node.start()
                    _record(data_dir, nodes)
                    print(f"{node.node_id} restarted on {node.address}", flush=True)
            time.sleep(0.2)
        return 0
    finally:
        for node in nodes:
            node.stop()
        for node in nodes:
            node.wait(30)
        children.forget(data_dir)
        kafka.stop()
        print("stopped.", flush=True)


def _pipeline_login(kafka: LocalKafka, user: str) -> str:
    """The pipeline's login for the shell (secure Kafka only): its principal and password file."""
    if not kafka.secure:
        return ""
    return (f"\n  export KVSTORE_KAFKA_USERNAME={user} KVSTORE_KAFKA_PASSWORD_FILE={kafka.password_file(user)}"
            "\n  # Kafka: SASL/SCRAM-SHA-512 and ACLs; this principal reads the WAL, nothing more. `wal truncate`"
            f"\n  # deletes records: run it with KVSTORE_KAFKA_USERNAME={ADMIN_USER} "
            f"KVSTORE_KAFKA_PASSWORD_FILE={kafka.password_file(ADMIN_USER)}")


def _tls_args(pki: DevPki | None, node_id: str, mtls: bool) -> tuple[str, ...]:
    """A node's security flags: its certificate, and tokens (--tls) or mutual TLS (--mtls)."""
    if pki is None:
        return ()
    own = ("--tls-cert", str(pki.nodes[node_id].cert), "--tls-key", str(pki.nodes[node_id].key))
    if mtls:  # the CA verifies callers and peers; the node's certificate carries role node
        return (*own, "--tls-client-ca", str(pki.ca))
    return (*own, "--tokens-file", str(pki.tokens_file), "--node-token-file", str(pki.tokens["node"]),
            "--peer-ca", str(pki.ca))


def _probe_security(pki: DevPki | None, mtls: bool) -> ClientSecurity | None:
    """How the cluster itself asks the nodes' health and shard map: as the read role (its token
    over TLS, its certificate with mutual TLS)."""
    if pki is None:
        return None
    if mtls:
        return ClientSecurity(ca=str(pki.ca), cert=str(pki.clients["read"].cert), key=str(pki.clients["read"].key))
    return ClientSecurity(ca=str(pki.ca), token=Path(pki.tokens["read"]).read_text().strip())


def _tls_info(pki: DevPki | None, mtls: bool) -> dict[str, object]:
    """The JSON line's security part: where the CA, tokens and certificates are."""
    if pki is None:
        return {"grpc_security": "plaintext"}
    return {"grpc_security": "mtls" if mtls else "tls+tokens", "ca": str(pki.ca),
            "tokens": {role: str(path) for role, path in pki.tokens.items() if role != "node"},
            "certs": {role: {"cert": str(c.cert), "key": str(c.key)} for role, c in pki.clients.items()}}


def _client_login(pki: DevPki | None, mtls: bool) -> str:
    """The exports a shell needs to reach a secure cluster (empty for plaintext)."""
    if pki is None:
        return ""
    if mtls:
        write = pki.clients["write"]
        return (f"\n  export KVSTORE_CA={pki.ca} KVSTORE_CERT={write.cert} KVSTORE_KEY={write.key}"
                f"\n  # mutual TLS; other roles: {pki.directory}/{{read,admin}}.pem and .key (admin: kvstore fence)")
    return (f"\n  export KVSTORE_CA={pki.ca} KVSTORE_TOKEN_FILE={pki.tokens['write']}"
            f"\n  # TLS + tokens; other roles: {pki.tokens['read']}, {pki.tokens['admin']} (kvstore fence)")


def _grpcurl(pki: DevPki | None, mtls: bool, address: str) -> str:
    if pki is None:
        return f"grpcurl -plaintext {address} list"
    if mtls:
        read = pki.clients["read"]
        return f"grpcurl -cacert {pki.ca} -cert {read.cert} -key {read.key} {address} list"
    return f"grpcurl -cacert {pki.ca} -H \"authorization: Bearer $(cat {pki.tokens['read']})\" {address} list"


def _record(data_dir: Path, nodes: list[_Node]) -> None:
    children.record(data_dir, [node.child for node in nodes if node.child is not None])


def _how(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
