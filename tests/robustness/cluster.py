"""The campaign's cluster: three Kafka brokers (KRaft, each broker and controller; the WAL at
replication factor 3 and min.insync.replicas 2) and five store nodes with placement (each shard on
three of them), every process in its own network namespace (`net.Network`), every node's data
directory on a small tmpfs of its own (`net.SmallDisk`) and its wall clock behind the clock seam
(`kvstore.server.clock.OFFSET_FILE_ENV`).

Ports are fixed: each member has its own network namespace, hence its own port space.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
from pathlib import Path

from kvstore.client import Client, ShardMap
from tests.integration.helpers import start_all
from tests.integration.store_process import StoreProcess
from tests.robustness.net import SUBNET, Member, Network, SmallDisk
from tests.waiting import wait_until
from wal.broker import QUICK_JVM_FLAGS, LocalKafka

BROKERS = 3
NODES = 5
BROKER_PORT, CONTROLLER_PORT = 9092, 9093
NODE_PORT = 50051
CLUSTER = "soak"
SESSION_TIMEOUT_MS = 3000  # the leadership group's: 2 cores shared by 8 processes stall for seconds
BROKER_HEAP_MB = 384


class SoakCluster:
    def __init__(self, out: Path, *, shards: int, disk_mb: int) -> None:
        self.out = out
        self.shards = shards
        self.brokers = [f"b{i}" for i in range(1, BROKERS + 1)]
        self.node_names = [f"n{i}" for i in range(1, NODES + 1)]
        members = ([Member(b, f"{SUBNET}.{10 + i}") for i, b in enumerate(self.brokers, start=1)]
                   + [Member(n, f"{SUBNET}.{20 + i}") for i, n in enumerate(self.node_names, start=1)])
        self.net = Network(members)
        # QUICK_JVM_FLAGS: every restart a fault causes pays a fresh JVM's compilation again,
        # on the two cores the five nodes and the workloads need.
        self.kafka = LocalKafka(out / "kafka", nodes=BROKERS, heap_mb=BROKER_HEAP_MB, jvm_flags=QUICK_JVM_FLAGS,
                                ports=[(BROKER_PORT, CONTROLLER_PORT)] * BROKERS,
                                hosts=[self.net.members[b].ip for b in self.brokers],
                                launcher=lambda n: self.net.launcher(self.brokers[n]))
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "clock").mkdir(parents=True, exist_ok=True)
        self.snapshot_dir = out / "snapshots"
        self.disks = {n: SmallDisk(out / "nodes" / n, disk_mb) for n in self.node_names}
        self.nodes: dict[str, StoreProcess] = {}
        for name in self.node_names:
            node = StoreProcess(self.kafka.bootstrap_servers, out / "nodes" / name, CLUSTER, shards=shards,
                                port=NODE_PORT, node_id=name, host=self.net.members[name].ip,
                                launcher=tuple(self.net.launcher(name)), log_path=out / "logs" / f"{name}.log",
                                extra_args=("--replication-factor", "3",
                                            "--session-timeout-ms", str(SESSION_TIMEOUT_MS),
                                            "--snapshot-dir", str(self.snapshot_dir)))
            node.env["KVSTORE_CLOCK_OFFSET_FILE"] = str(self.clock_file(name))
            self.nodes[name] = node

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> SoakCluster:
        self.net.create()
        for disk in self.disks.values():
            disk.mount()
        self.kafka.start(timeout_s=180)
        start_all(list(self.nodes.values()), timeout_s=180)
        self.wait_settled(180)
        return self

    def stop(self) -> None:
        for node in self.nodes.values():
            self.resume_node(node.node_id)
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.nodes)) as pool:
            for stopped in [pool.submit(node.stop) for node in self.nodes.values()]:
                stopped.result()
        self.kafka.stop()
        for disk in self.disks.values():
            disk.empty()
            disk.unmount()
        self.net.destroy()

    @property
    def endpoints(self) -> list[str]:
        return [n.address for n in self.nodes.values()]

    def client(self, timeout_s: float = 20.0) -> Client:
        return Client(self.endpoints, timeout_s=timeout_s, max_attempts=100, max_backoff_s=1.0)

    def shard_map(self) -> ShardMap | None:
        try:
            with self.client(timeout_s=10) as client:
                return client.shard_map(timeout_s=10)
        except Exception:
            return None

    def wait_settled(self, timeout_s: float) -> ShardMap:
        """Every shard has a ready leader and every live node is listed."""
        def settled() -> ShardMap | None:
            smap = self.shard_map()
            live = [n for n in self.nodes.values() if self.node_alive(n.node_id)]
            return smap if smap and all(s.leader_ready for s in smap.shards) and len(smap.nodes) == len(live) else None

        return wait_until(settled, timeout_s, interval_s=0.5, what="every shard led and every live node listed")

    # ---- nodes -----------------------------------------------------------------------------

    def clock_file(self, name: str) -> Path:
        return self.out / "clock" / name

    def set_clock_offset(self, name: str, offset_ms: int) -> None:
        path = self.clock_file(name)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{offset_ms}\n")
        os.replace(tmp, path)  # whole or not at all: the node never reads half a number

    def node_alive(self, name: str) -> bool:
        proc = self.nodes[name].proc
        return proc is not None and proc.poll() is None

    def kill_node(self, name: str) -> None:
        self.resume_node(name)
        self.nodes[name].stop(signal.SIGKILL)

    def start_node(self, name: str, timeout_s: float = 120.0) -> None:
        node = self.nodes[name]
        if node.channel is not None:
            node.channel.close()
            node.channel = None
        # A host that boots syncs its clock before the store starts: a node started in the middle
        # of a clock jump would take the jumped time as its own (kvstore.core.clock_guard: the
        # guard holds a running process to its first reading, not a new one to anything).
        self.set_clock_offset(name, 0)
        node.start(timeout_s=timeout_s)

    def pause_node(self, name: str) -> None:
        os.kill(self.nodes[name].pid, signal.SIGSTOP)

    def resume_node(self, name: str) -> None:
        proc = self.nodes[name].proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)

    # ---- brokers ---------------------------------------------------------------------------

    def broker_index(self, name: str) -> int:
        return self.brokers.index(name)

    def active_controller(self) -> str | None:
        """The KRaft quorum's leader, from the election state each controller persists (the
        highest epoch wins): the broker metadata clients see names a random broker instead."""
        best: tuple[int, int] | None = None
        for i in range(BROKERS):
            path = self.out / "kafka" / f"node-{i + 1}" / "data" / "__cluster_metadata-0" / "quorum-state"
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            leader, epoch = int(state.get("leaderId", -1)), int(state.get("leaderEpoch", -1))
            if leader > 0 and (best is None or epoch > best[1]):
                best = (leader, epoch)
        return self.brokers[best[0] - 1] if best is not None else None
