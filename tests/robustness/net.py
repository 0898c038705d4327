"""The campaign's network: every broker and node in a Linux network namespace of its own, on one
bridge, so that links between any two of them can be cut and restored while they run.

Why this way: a partition must look to the processes like a real one, packets that vanish, not
an error they can react to at once. A blackhole route answers a send with EINVAL and the kernel
here has no tc drop action (no act_gact), so a cut is made at the neighbour table instead: the
sender's entry for the receiver's address is pinned to a MAC address nobody owns (`nud
permanent`, so ARP replies cannot repair it). The bridge floods such frames and every interface
drops them: the sender's packets are lost silently, TCP retransmits and times out as it would on
a real network. That cuts one direction: `A -> B` lost, `B -> A` delivered (B's requests reach A,
A's answers never come back). A two-way partition is both directions.

The orchestrator (and its clients) stay in the root namespace, on the bridge's own address: a
cut never separates the checker from the store, only members from members.

Needs root (namespaces, links, a tmpfs mount); `require_root` says so clearly otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

PREFIX = "kvsoak"  # every namespace and link of the campaign starts with it (cleaned up at start)
SUBNET = "10.77.0"
NOBODY_MAC = "02:00:00:00:77:77"  # locally administered, owned by no interface
INSIDE_LINK = "eth0"  # the member's end of its veth pair, inside its namespace
COMMAND_TIMEOUT_S = 20.0


class NetworkError(RuntimeError):
    """A namespace, link or mount could not be set up or changed."""


def require_root() -> None:
    """Refuse to start, saying why, unless this process can make namespaces and mounts."""
    missing = [tool for tool in ("ip", "nsenter", "mount", "umount") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        raise NetworkError("the robustness campaign runs every broker and node in its own network namespace "
                           "(ip netns), cuts links between them and mounts a small tmpfs under a node's data "
                           "directory: it must run as root (sudo make soak)")
    if missing:
        raise NetworkError(f"the robustness campaign needs {', '.join(missing)} on PATH "
                           "(Debian: apt-get install iproute2 util-linux)")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    if check and result.returncode != 0:
        raise NetworkError(f"{' '.join(cmd)}: exit {result.returncode}: {result.stderr.strip()}")
    return result


@dataclasses.dataclass(frozen=True)
class Member:
    name: str  # "b1".."b3" (brokers), "n1".."n5" (nodes)
    ip: str


class Network:
    """The bridge, one namespace per member, and the cuts in force. `prefix` names them all (a
    leftover of an earlier run with the same prefix is removed first) and `subnet` is their /24:
    the campaign's and the tests' own small networks never meet."""

    def __init__(self, members: Sequence[Member], *, prefix: str = PREFIX, subnet: str = SUBNET) -> None:
        assert len({m.name for m in members}) == len(members), "member names are unique"
        assert all(m.ip.startswith(subnet + ".") for m in members), f"every member is in {subnet}.0/24"
        assert len(prefix) + 1 + max(len(m.name) for m in members) <= 15, "link names have 15 characters at most"
        self.members = {m.name: m for m in members}
        self.prefix = prefix
        self.bridge = f"{prefix}0"
        self.root_ip = f"{subnet}.1"
        self.cuts: set[tuple[str, str]] = set()  # (sender, receiver): the sender's packets are lost

    def netns(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    # ---- lifecycle -------------------------------------------------------------------------

    def create(self) -> Network:
        cleanup_leftovers(self.prefix)
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.root_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for m in self.members.values():
            ns = self.netns(m.name)  # its host-side link has the same name, in the root namespace
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", ns, "type", "veth", "peer", "name", INSIDE_LINK, "netns", ns)
            _run("ip", "link", "set", ns, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{m.ip}/24", "dev", INSIDE_LINK)
            _run("ip", "-n", ns, "link", "set", INSIDE_LINK, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        return self

    def destroy(self) -> None:
        self.cuts.clear()
        cleanup_leftovers(self.prefix)

    def launcher(self, name: str) -> list[str]:
        """The command prefix that runs a program in `name`'s namespace. nsenter execs it in
        place (it forks only to enter a pid namespace), so the pid is the program's own: kill and
        SIGSTOP reach the broker or node, not a wrapper. Only the network is entered: the
        mounts stay the root's (a node's small data disk is visible to it)."""
        return ["nsenter", f"--net=/run/netns/{self.netns(name)}", "--"]

    # ---- cuts ------------------------------------------------------------------------------

    def cut(self, sender: str, receiver: str) -> None:
        """`sender`'s packets to `receiver` are lost from now on (one direction)."""
        _run("ip", "-n", self.netns(sender), "neigh", "replace", self.members[receiver].ip, "lladdr", NOBODY_MAC,
             "dev", INSIDE_LINK, "nud", "permanent")
        self.cuts.add((sender, receiver))

    def restore(self, sender: str, receiver: str) -> None:
        # ARP learns the receiver's address again
        _run("ip", "-n", self.netns(sender), "neigh", "del", self.members[receiver].ip, "dev", INSIDE_LINK, check=False)
        self.cuts.discard((sender, receiver))

    def partition(self, side_a: Iterable[str], side_b: Iterable[str], *,
                  one_way: bool = False) -> list[tuple[str, str]]:
        """Cut every link from side_a to side_b (and back unless `one_way`); returns the cuts made."""
        made = []
        b = list(side_b)
        for x in side_a:
            for y in b:
                if x == y:
                    continue
                self.cut(x, y)
                made.append((x, y))
                if not one_way:
                    self.cut(y, x)
                    made.append((y, x))
        return made

    def heal(self, cuts: Iterable[tuple[str, str]] | None = None) -> None:
        for sender, receiver in list(cuts if cuts is not None else self.cuts):
            self.restore(sender, receiver)


def cleanup_leftovers(prefix: str = PREFIX) -> None:
    """Remove the namespaces and the bridge an earlier run left (one that was killed); deleting a
    namespace deletes its veth pair too."""
    listed = _run("ip", "netns", "list", check=False).stdout.split()
    for name in listed:
        if name.startswith(f"{prefix}-"):
            _run("ip", "netns", "del", name, check=False)
    # A namespace some process still runs in (a node restarted while the run stopped) outlives
    # its name, and its veth pair with it: delete the host side by name, which deletes the pair.
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        link = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        if link.startswith(f"{prefix}-"):
            _run("ip", "link", "del", link, check=False)
    _run("ip", "link", "del", f"{prefix}0", check=False)


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """One campaign per machine: they would share the namespaces' names and the bridge."""
    path = Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")
    with open(path / f"{PREFIX}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NetworkError("another robustness campaign is running on this machine (it holds "
                               f"{path / (PREFIX + '.lock')}); one at a time") from None
        yield


class SmallDisk:
    """A tmpfs of `size_mb` under `path` (a node's data directory): filling it makes every write
    of the node fail with ENOSPC, as a full disk does; emptying it gives the space back."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = path
        self.size_mb = size_mb
        self.filler = path / "filler.bin"

    def mount(self) -> SmallDisk:
        self.path.mkdir(parents=True, exist_ok=True)
        _run("mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0755", f"{PREFIX}-disk", str(self.path))
        return self

    def fill(self) -> int:
        """Take every free byte; returns how many were taken."""
        stats = os.statvfs(self.path)
        free = stats.f_bavail * stats.f_frsize
        with open(self.filler, "ab") as f, contextlib.suppress(OSError):  # what could be taken was taken
            os.posix_fallocate(f.fileno(), f.tell(), free)
        return free

    def empty(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        _run("umount", "-l", str(self.path), check=False)
