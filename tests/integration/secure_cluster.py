"""A cluster of real node processes with gRPC security on, for tests/integration/test_security*.py:
certificates and tokens from the development CA (`kvstore.dev.ca`), either TLS + bearer tokens (the
nodes show each other a node token) or mutual TLS (every caller presents a certificate; the nodes
their own, role node)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc

from kvstore.client import Client, ClientSecurity, ShardMap
from kvstore.core.sharding import shard_of
from kvstore.dev.ca import DevCA, DevPki
from tests.conftest import unique
from tests.integration.helpers import REPO, placement_settled, start_all
from tests.integration.store_process import StoreProcess
from tests.waiting import wait_until

SHARDS = 4
KVSTORE = str(Path(sys.executable).parent / "kvstore")  # the installed console script
TOKENS, MTLS = "tokens", "mtls"


class SecureCluster:
    def __init__(self, kafka: str, base: Path, mode: str, nodes: int = 2) -> None:
        self.mode = mode
        self.name = unique("sec").replace("-", "")
        ids = [f"n{i}" for i in range(1, nodes + 1)]
        self.pki: DevPki = DevCA(base / "tls").ensure(ids)
        self.nodes = [StoreProcess(kafka, base / node_id, self.name, shards=SHARDS, node_id=node_id,
                                   extra_args=("--session-timeout-ms", "1500", *self._tls_args(node_id)),
                                   metrics=True, credentials=self.security("read").credentials())
                      for node_id in ids]

    def _tls_args(self, node_id: str) -> tuple[str, ...]:
        own = ("--tls-cert", str(self.pki.nodes[node_id].cert), "--tls-key", str(self.pki.nodes[node_id].key))
        if self.mode == MTLS:
            return (*own, "--tls-client-ca", str(self.pki.ca))
        return (*own, "--tokens-file", str(self.pki.tokens_file), "--node-token-file", str(self.pki.tokens["node"]),
                "--peer-ca", str(self.pki.ca))

    def security(self, role: str | None) -> ClientSecurity:
        """A client of `role` (None: TLS without credentials, or for mutual TLS no certificate)."""
        if role is None:
            return ClientSecurity(ca=str(self.pki.ca))
        if self.mode == MTLS:
            cred = self.pki.clients[role]
            return ClientSecurity(ca=str(self.pki.ca), cert=str(cred.cert), key=str(cred.key))
        return ClientSecurity(ca=str(self.pki.ca), token=self.pki.tokens[role].read_text().strip())

    def cli_env(self, role: str) -> dict[str, str]:
        """The KVSTORE_* variables a shell of `role` exports (as `make up --tls/--mtls` prints them)."""
        if self.mode == MTLS:
            cred = self.pki.clients[role]
            return {"KVSTORE_CA": str(self.pki.ca), "KVSTORE_CERT": str(cred.cert), "KVSTORE_KEY": str(cred.key)}
        return {"KVSTORE_CA": str(self.pki.ca), "KVSTORE_TOKEN_FILE": str(self.pki.tokens[role])}

    def start(self) -> SecureCluster:
        start_all(self.nodes)
        self.wait_settled()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    @property
    def endpoints(self) -> list[str]:
        return [n.address for n in self.nodes]

    def client(self, role: str | None = "admin") -> Client:
        return Client(self.endpoints, timeout_s=20, max_attempts=100, max_backoff_s=0.1,
                      security=self.security(role))

    def channel(self, address: str, role: str | None) -> grpc.Channel:
        return self.security(role).channel(address)

    def wait_settled(self, timeout_s: float = 60.0) -> ShardMap:
        """Every shard led by its targets and every node in the map: the nodes' peer calls are
        authenticated."""
        with self.client("read") as client:
            def settled() -> ShardMap | None:
                smap = client.shard_map(timeout_s=10)
                return smap if placement_settled(smap, {n.node_id for n in self.nodes}) else None

            return wait_until(settled, timeout_s, interval_s=0.2, what="every shard led and every node listed")

    def node(self, node_id: str) -> StoreProcess:
        return next(n for n in self.nodes if n.node_id == node_id)

    def log_of(self, node: StoreProcess) -> str:
        return (node.data_dir.parent / f"{self.name}-{node.node_id}.log").read_text(errors="replace")


def key_of(shard: int, prefix: str) -> bytes:
    return next(k for k in (f"{prefix}/{i}".encode() for i in range(1000)) if shard_of(k, SHARDS) == shard)


def kvstore(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI, with only `env`'s KVSTORE_* security settings (none inherited)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run([KVSTORE, *args], capture_output=True, text=True, timeout=60, check=False, cwd=REPO,
                          env={**clean, "PYTHONPATH": str(REPO), **env})
