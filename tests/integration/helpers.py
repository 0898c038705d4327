"""Helpers shared by the WAL integration tests: writers, replay, a zombie writer process."""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore import limits
from kvstore.client import ShardMap

if TYPE_CHECKING:
    from tests.integration.store_process import StoreProcess
from tests.waiting import wait_until
from wal import Replayer, ShardWriter, WriterConfig, WriterIdentity, shard_transactional_id
from wal.record import AcceptedRecord

REPO = Path(__file__).resolve().parents[2]
# The store's batch bounds (WriterConfig takes them from its caller).
WAL_BOUNDS: dict[str, Any] = {"max_batch_records": limits.MAX_BATCH_RECORDS, "max_batch_bytes": limits.MAX_BATCH_BYTES,
                              "max_record_bytes": limits.MAX_WAL_RECORD_BYTES}


def writer(bootstrap: str, topic: str, name: str = "w", cluster: str = "test", **overrides: Any) -> ShardWriter:
    config = WriterConfig(
        bootstrap_servers=bootstrap,
        topic=topic,
        partition=0,
        transactional_id=shard_transactional_id(f"{cluster}.{topic}", 0),
        writer=WriterIdentity(name, 1),
        **{**WAL_BOUNDS, **overrides},
    )
    return ShardWriter(config)


def replay_all(
    bootstrap: str, topic: str, start: int = 0, timeout_s: float = 30.0
) -> tuple[list[AcceptedRecord], Replayer]:
    """Everything a read_committed reader accepts, up to the high watermark now."""
    replayer = Replayer(bootstrap, topic, 0, start)
    records = list(replayer.read_to_end(timeout_s))
    replayer.close()
    return records, replayer


def payloads(records: list[AcceptedRecord]) -> list[bytes]:
    return [r.payload for r in records]


# A writer in its own process, so that tests can really pause (SIGSTOP) and resume it.
# It appends the batches given on its command line; for the batch named by --pause-before-commit
# it stops itself after delivery and before commit_transaction. It prints one JSON line per batch.
ZOMBIE = r'''
import json, os, signal, sys
from wal import ShardWriter, WriterConfig, WriterIdentity, WalError
args = json.loads(sys.argv[1])
pause_at = args["pause_before_commit"]
current = {"batch": None}
def before_commit():
    if current["batch"] == pause_at:
        print(json.dumps({"event": "paused", "batch": pause_at}), flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
w = ShardWriter(WriterConfig(bootstrap_servers=args["bootstrap"], topic=args["topic"], partition=0,
                             transactional_id=args["tid"], writer=WriterIdentity("zombie", 1),
                             transaction_timeout_ms=args["txn_timeout_ms"], max_batch_records=1000,
                             max_batch_bytes=1 << 22, max_record_bytes=1 << 19), before_commit=before_commit)
print(json.dumps({"event": "fenced-in", "upcoming": w.fence()}), flush=True)
for name in args["batches"]:
    current["batch"] = name
    try:
        r = w.append([f"{name}-{i}".encode() for i in range(args["records"])])
        print(json.dumps({"event": "committed", "batch": name, "offsets": list(r.offsets)}), flush=True)
    except WalError as e:
        print(json.dumps({"event": "error", "batch": name, "type": type(e).__name__,
                          "fenced": getattr(e, "fenced", None), "message": str(e)}), flush=True)
w.close()
'''


class ZombieProcess:
    def __init__(self, bootstrap: str, topic: str, tid: str, batches: list[str], pause_before_commit: str,
                 records: int = 3, txn_timeout_ms: int = 60_000) -> None:
        args = {"bootstrap": bootstrap, "topic": topic, "tid": tid, "batches": batches,
                "pause_before_commit": pause_before_commit, "records": records,
                "txn_timeout_ms": txn_timeout_ms}
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-c", ZOMBIE, json.dumps(args)], stdout=subprocess.PIPE,
                                     text=True, env=env)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip():
                self._lines.put(line)
        self._lines.put("")

    def next_event(self, timeout_s: float = 60.0) -> dict[str, Any]:
        line = self._lines.get(timeout=timeout_s)
        assert line, f"zombie exited early with {self.proc.poll()}"
        event: dict[str, Any] = json.loads(line)
        return event

    def wait_stopped(self, timeout_s: float = 30.0) -> None:
        """Until the kernel reports the process as stopped (state T)."""

        def state() -> str:
            assert self.proc.poll() is None, f"zombie exited with {self.proc.returncode} instead of stopping"
            return Path(f"/proc/{self.proc.pid}/stat").read_text().split(")")[-1].split()[0]

        wait_until(lambda: state() == "T", timeout_s, what=f"zombie pid {self.proc.pid} to stop (state T)")

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def finish(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """The remaining events, once the process has exited."""
        self.proc.wait(timeout_s)
        events = []
        while (line := self._lines.get(timeout=timeout_s)) != "":
            events.append(json.loads(line))
        return events

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def placement_settled(smap: ShardMap, live: set[str]) -> bool:
    """Every shard led and held by exactly its targets in the placement log among the `live` nodes,
    each a replica in its leadership group; every live node listed (docs/design.md §9: the moves a
    join starts are done)."""
    if {n.node_id for n in smap.nodes} != live:
        return False
    for info in smap.shards:
        # A node stopped within the grace period is still a target; its copies are not listed.
        copies = {(r.node_id, r.state, r.in_group) for r in info.replicas if r.node_id in live}
        targets = set(info.placed_on) & live
        if not info.leader_ready or not targets or copies != {(n, "replica", True) for n in targets}:
            return False
    return True


def start_all(nodes: Sequence[StoreProcess], timeout_s: float = 90.0) -> None:
    """Start `nodes` together, as after a power cut or a deploy, and wait until each serves: the
    placement controller then places a new cluster's shards once, with every node a member, and
    no test waits for one node after another."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        for started in [pool.submit(node.start, timeout_s) for node in nodes]:
            started.result()
