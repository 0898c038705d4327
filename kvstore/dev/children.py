"""The store nodes the dev cluster started, recorded in its data dir, and the only processes local
tooling may signal.

`kvstore demo failover` kills a shard's leader. It must never kill a pid some node *reports*
(a remote node, a node of another cluster, or a pid long since reused by an unrelated process of
yours): the public API carries no pid at all. Instead the dev cluster (`make up`,
`python -m kvstore.dev.cluster`) writes `children.json` into its data dir whenever it starts a
node: node id, address, pid, and the process's identity as the OS reports it (its start time
and command line). `dev_cluster_kill` signals a node only when the shard map's node (id *and*
address) is in that record and the pid still runs the very process recorded; otherwise it
refuses and says why.

Identity: on Linux the start time in clock ticks since boot (`/proc/<pid>/stat`, field 22) and
the command line; elsewhere `ps -o lstart=` and `ps -o command=`. A pid reused by another
process has another start time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstore.client import NodeInfo

CHILDREN_FILE = "children.json"

# Signals a node: (the node as the shard map describes it, the signal; 0 only checks that it may)
# -> what was signalled, for the demo's output ("pid 4711"). Raises RuntimeError when it may not.
Kill = Callable[[NodeInfo, int], str]


@dataclasses.dataclass(frozen=True, slots=True)
class Child:
    """One node process the dev cluster started."""

    node_id: str
    address: str
    pid: int
    started: str  # the process's start time as the OS reports it (see the module docstring)
    command: str  # its command line, space-joined


def process_identity(pid: int) -> tuple[str, str] | None:
    """(start time, command line) of a running process; None if there is no such process."""
    proc = Path(f"/proc/{pid}")
    if Path("/proc/self/stat").exists():
        try:
            stat = (proc / "stat").read_text()
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return None
        # The command name (field 2) is in parentheses and may hold spaces: split after it.
        fields = stat.rsplit(")", 1)[-1].split()
        return fields[19], command  # field 22 (starttime); fields[0] is field 3
    try:
        out = [subprocess.run(["ps", "-o", f"{column}=", "-p", str(pid)], capture_output=True, text=True,
                              timeout=5, check=False).stdout.strip() for column in ("lstart", "command")]
    except (OSError, subprocess.SubprocessError):
        return None
    return (out[0], out[1]) if out[0] else None


# How long a child just started may show an empty command line. Popen returns once the child's
# execve switched to the new program's memory, but the kernel sets the new command line's bounds a
# little later (load_elf_binary, after exec_mmap): read in between, /proc/<pid>/cmdline is empty.
# Recording that empty line made the demo refuse a live node later ("is gone"), under CI load.
IDENTITY_SETTLE_S = 5.0


def child_of(node_id: str, address: str, pid: int, *, settle_s: float = IDENTITY_SETTLE_S,
             identity_of: Callable[[int], tuple[str, str] | None] | None = None) -> Child | None:
    """The record of a node process just started (call it before the process can be reaped);
    None if it is gone already (nothing to record: the supervisor sees it exit and says why).
    Waits (at most `settle_s`) until the process shows its command line (IDENTITY_SETTLE_S)."""
    read = identity_of or process_identity
    deadline = time.monotonic() + settle_s
    identity = read(pid)
    while identity is not None and not identity[1] and time.monotonic() < deadline:
        time.sleep(0.005)
        identity = read(pid)
    return Child(node_id, address, pid, *identity) if identity is not None else None


def record(data_dir: Path, children: Sequence[Child]) -> None:
    """Write the record atomically (a reader never sees half a file)."""
    path = data_dir / CHILDREN_FILE
    tmp = path.with_suffix(".tmp")
    body = {"cluster_pid": os.getpid(), "nodes": [dataclasses.asdict(c) for c in children]}
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    tmp.replace(path)


def forget(data_dir: Path) -> None:
    """Remove the record (the dev cluster stopped its nodes)."""
    with contextlib.suppress(FileNotFoundError):
        (data_dir / CHILDREN_FILE).unlink()


def load(data_dir: Path) -> list[Child]:
    """The recorded children; [] when there is no record."""
    path = data_dir / CHILDREN_FILE
    try:
        body: Any = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"{path} is unreadable: {exc}") from exc
    try:
        return [Child(str(n["node_id"]), str(n["address"]), int(n["pid"]), str(n["started"]), str(n["command"]))
                for n in body["nodes"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise RuntimeError(f"{path} is not a dev cluster record: {exc!r}") from exc


def choose(children: Sequence[Child], node: NodeInfo) -> Child | str:
    """The recorded child that is `node` (same id and address), or why there is none. Pure."""
    for child in children:
        if child.node_id == node.node_id and child.address == node.address:
            return child
    if not children:
        return "the dev cluster recorded no nodes"
    known = ", ".join(f"{c.node_id} at {c.address}" for c in children)
    return f"{node.node_id} at {node.address} is not one of its nodes ({known})"


def same_process(child: Child, identity: tuple[str, str] | None) -> bool:
    """Whether the process now behind `child.pid` is the one recorded. Pure."""
    return identity is not None and identity == (child.started, child.command)


def dev_cluster_kill(data_dir: Path) -> Kill:
    """A `Kill` that signals only the nodes the dev cluster in `data_dir` started."""
    directory = data_dir.resolve()

    def kill(node: NodeInfo, sig: int) -> str:
        def refuse(why: str) -> RuntimeError:
            return RuntimeError(
                f"refusing to signal {node.node_id} ({node.address}): the demo kills only a node the local dev "
                f"cluster started (`make up`), as recorded in {directory / CHILDREN_FILE}, and {why}. Run it "
                f"against `make up` on this machine, with --data-dir naming that cluster's data directory")

        children = load(directory)
        if not children and not (directory / CHILDREN_FILE).exists():
            raise refuse("there is no such record (is the dev cluster running with this data dir?)")
        chosen = choose(children, node)
        if isinstance(chosen, str):
            raise refuse(chosen)
        if not same_process(chosen, process_identity(chosen.pid)):
            raise refuse(f"its recorded process {chosen.pid} is gone or the pid now belongs to another process")
        try:
            os.kill(chosen.pid, sig)
        except ProcessLookupError as exc:
            raise refuse(f"its recorded process {chosen.pid} exited meanwhile") from exc
        return f"pid {chosen.pid}"

    return kill
