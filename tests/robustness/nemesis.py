"""The faults: a plan drawn from the seed (pure, `plan`), and the executor that runs it against a
live `SoakCluster`, logging what it did and when.

Three lanes run at once, each one episode at a time:
- lane 0, processes and links: SIGKILL or SIGSTOP of a node (a shard leader more often than not)
  or of a broker (the active KRaft controller in some), and partitions: a node from every broker,
  a node from another node, a broker from the other brokers, and one-way cuts between any two;
- lane 1, a node's environment: its disk filling up, its wall clock jumping forward or back (a
  leader's, mostly), and shard moves (a replica of a shard to another node);
- lane 2, the pipeline (long campaigns): a snapshot (Spark), then WAL truncation below it.

The plan fixes each episode's kind, start, length and a random number; the executor turns the
number into a target among what exists at that moment (which node leads which shard then), so
the same seed replays the same sequence of fault kinds and timings, not necessarily the same
victims (leadership depends on timing).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.client import PlacementChanged
from tests.robustness.cluster import CLUSTER, SoakCluster

log = logging.getLogger("soak.nemesis")

# kind -> (weight in its lane, (shortest, longest) hold in seconds)
LANE0: dict[str, tuple[int, tuple[float, float]]] = {
    "node-kill": (4, (1.0, 6.0)),
    "node-pause": (3, (2.0, 8.0)),
    "broker-kill": (2, (2.0, 8.0)),
    "broker-pause": (2, (2.0, 6.0)),
    "controller-kill": (1, (2.0, 8.0)),
    "controller-pause": (1, (2.0, 6.0)),
    "partition-node-brokers": (3, (3.0, 12.0)),
    "partition-node-node": (2, (3.0, 10.0)),
    "partition-broker-brokers": (2, (3.0, 10.0)),
    "partition-one-way": (3, (3.0, 10.0)),
}
LANE1: dict[str, tuple[int, tuple[float, float]]] = {
    "disk-full": (2, (3.0, 10.0)),
    "clock-jump": (3, (5.0, 15.0)),
    "shard-move": (2, (0.0, 0.0)),
}
# How far a clock jumps (ms): small steps, five minutes, and past the one-hour request-id horizon.
CLOCK_JUMPS_MS = (30_000, -30_000, 300_000, -300_000, 70 * 60_000)
GAP_S = {0: (1.0, 3.0), 1: (3.0, 8.0)}
WARMUP_S = 8.0
COOLDOWN_S = 5.0  # no episode starts this close to the end
SNAPSHOT_MIN_DURATION_S = 240.0  # shorter campaigns take no snapshot (Spark costs a minute of CPU)
RESTART_TIMEOUT_S = 120.0
BROKERS_BACK_TIMEOUT_S = 600.0  # lane 0 waits at most this long for every broker before its next fault
BROKERS_SETTLED_S = 8.0  # ... and for them to stay in sync this long (over twice a broker's session)
SPARK_TIMEOUT_S = 600.0
# A pipeline step that failed (Kafka between partition leaders while a broker fault runs: the
# snapshot job exits 1) is tried again this many times in all, this long apart and once every
# broker serves again, in sync (bounded: BROKERS_BACK_TIMEOUT_S).
PIPELINE_ATTEMPTS = 3
PIPELINE_RETRY_WAIT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Episode:
    index: int
    lane: int
    kind: str
    at_s: float  # planned start, from the run's start
    hold_s: float  # how long the fault lasts
    pick: int  # turned into a target by the executor
    amount: int = 0  # clock-jump: the offset (ms)


def plan(seed: int, duration_s: float, *, snapshot: bool | None = None) -> list[Episode]:
    """The campaign's faults, by the seed alone."""
    rng = random.Random(seed)
    episodes: list[Episode] = []
    for lane, kinds in ((0, LANE0), (1, LANE1)):
        t = WARMUP_S + (0.0 if lane == 0 else 4.0)
        names = sorted(kinds)
        weights = [kinds[k][0] for k in names]
        while t < duration_s - COOLDOWN_S:
            kind = rng.choices(names, weights)[0]
            low, high = kinds[kind][1]
            hold = round(rng.uniform(low, high), 1)
            amount = rng.choice(CLOCK_JUMPS_MS) if kind == "clock-jump" else 0
            episodes.append(Episode(0, lane, kind, round(t, 1), hold, rng.randrange(1 << 30), amount))
            t += hold + rng.uniform(*GAP_S[lane])
    if snapshot if snapshot is not None else duration_s >= SNAPSHOT_MIN_DURATION_S:
        episodes.append(Episode(0, 2, "snapshot-truncate", round(duration_s * 0.4, 1), 0.0, rng.randrange(1 << 30)))
    episodes.sort(key=lambda e: (e.at_s, e.lane))
    return [dataclasses.replace(e, index=i) for i, e in enumerate(episodes)]


@dataclasses.dataclass
class Done:
    """An episode as it ran."""

    episode: Episode
    started_s: float = 0.0  # from the run's start
    ended_s: float = 0.0  # when everything it broke was restored
    targets: list[str] = dataclasses.field(default_factory=list)
    detail: str = ""
    error: str = ""  # the executor could not do or undo it (the campaign goes on)

    def as_dict(self) -> dict[str, Any]:
        e = self.episode
        return {"index": e.index, "lane": e.lane, "kind": e.kind, "planned_s": e.at_s, "hold_s": e.hold_s,
                "started_s": round(self.started_s, 2), "ended_s": round(self.ended_s, 2),
                "targets": self.targets, "detail": self.detail, "error": self.error}


class Nemesis:
    """Runs a plan's lanes in threads against the cluster; a supervisor restarts a node that
    exited on its own (a full disk may make it stop), as a process supervisor would."""

    def __init__(self, cluster: SoakCluster, episodes: list[Episode], started: float, out: Path) -> None:
        self.cluster = cluster
        self.episodes = episodes
        self.started = started
        self.out = out
        self.done: list[Done] = []
        self.process_exits: list[dict[str, Any]] = []  # nodes and brokers that exited without a kill
        self._lock = threading.Lock()
        self._held: set[str] = set()  # nodes and brokers an episode keeps down or paused: not the supervisor's
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._lane, args=(lane,), daemon=True, name=f"nemesis-{lane}")
                         for lane in sorted({e.lane for e in episodes})]
        self._threads.append(threading.Thread(target=self._supervise, daemon=True, name="supervisor"))

    def now(self) -> float:
        return time.monotonic() - self.started

    def start(self) -> Nemesis:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 300.0) -> None:
        """Stop after the running episodes are undone."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)

    # ---- lanes -----------------------------------------------------------------------------

    def _lane(self, lane: int) -> None:
        for episode in (e for e in self.episodes if e.lane == lane):
            wait = episode.at_s - self.now()
            if self._stop.wait(max(0.0, wait)):
                return
            if lane == 0:
                self._brokers_back()
            done = Done(episode, started_s=self.now())
            try:
                getattr(self, "_" + episode.kind.replace("-", "_"))(episode, done)
            except Exception as exc:
                done.error = f"{type(exc).__name__}: {exc}"
                log.warning("episode %d %s: %s", episode.index, episode.kind, done.error)
            done.ended_s = self.now()
            log.info("episode %d %s %s %.1fs-%.1fs %s%s", episode.index, episode.kind, done.targets, done.started_s,
                     done.ended_s, done.detail, f" ERROR {done.error}" if done.error else "")
            with self._lock:
                self.done.append(done)

    def _brokers_back(self) -> None:
        """Before the next process or link fault: every broker up, serving and back in every
        ISR (`LocalKafka.in_sync`), for BROKERS_SETTLED_S. A broker's restart can outlast its episode on two starved
        cores (minutes), and the next episode then took a second broker down with it: Kafka
        without a quorum or partition leaders for minutes, a fault beyond the model (one broker
        at a time: Limits). Bounded: past BROKERS_BACK_TIMEOUT_S the lane goes on, and says so."""
        started = time.monotonic()
        in_sync_since: float | None = None
        while not self._stop.is_set():
            # Each broker asked itself: the others list a restarted broker before its startup is
            # over (the third long run's first stall: a kill went on while another broker was
            # still starting, and the quorum lost its majority). And in sync, not only serving:
            # the fifth run's stall (a broker still fenced when the next one was killed). And for
            # a while: a pause or a cut fences a broker only once its session (3 s) has run out.
            now = time.monotonic()
            if not self.cluster.kafka.in_sync():
                in_sync_since = None
            elif in_sync_since is None:
                in_sync_since = now
            if in_sync_since is not None and now - in_sync_since >= BROKERS_SETTLED_S:
                break
            if time.monotonic() - started > BROKERS_BACK_TIMEOUT_S:
                lagging = self.cluster.kafka.under_replicated()
                log.warning("the brokers are not all back in sync after %.0f s (%s): the next fault goes on "
                            "anyway", BROKERS_BACK_TIMEOUT_S,
                            "a broker does not answer" if lagging is None else
                            f"under-replicated: {', '.join(lagging) or 'none'}")
                return
            self._stop.wait(1.0)
        waited = time.monotonic() - started
        if waited > 5:
            log.info("waited %.0f s for every broker to be back and in sync before the next fault", waited)

    def _hold(self, seconds: float) -> None:
        """Hold a fault; the campaign's end does not cut it short (every fault is undone)."""
        time.sleep(seconds)

    def _supervise(self) -> None:
        while not self._stop.wait(1.0):
            for name in [*self.cluster.node_names, *self.cluster.brokers]:
                with self._lock:
                    held = name in self._held
                broker = name in self.cluster.brokers
                proc = (self.cluster.kafka.process(self.cluster.broker_index(name)) if broker
                        else self.cluster.nodes[name].proc)
                if held or proc is None or proc.poll() is None:
                    continue
                self.process_exits.append({"process": name, "at_s": round(self.now(), 2), "code": proc.returncode})
                log.warning("%s exited by itself (code %s): restarting it", name, proc.returncode)
                try:
                    if broker:
                        self.cluster.kafka.start_node(self.cluster.broker_index(name), wait=True,
                                                      timeout_s=RESTART_TIMEOUT_S)
                    else:
                        self._restart_node(name)
                except Exception as exc:
                    log.warning("restarting %s: %s", name, exc)

    def _restart_node(self, name: str) -> None:
        for attempt in range(3):
            try:
                self.cluster.start_node(name, timeout_s=RESTART_TIMEOUT_S)
                return
            except Exception as exc:
                log.warning("restarting %s (attempt %d): %s", name, attempt + 1, exc)
                self.cluster.kill_node(name)
        raise RuntimeError(f"node {name} did not come back after 3 starts")

    # ---- targets ---------------------------------------------------------------------------

    def _node(self, pick: int, *, leader: bool = True) -> str:
        """A shard leader (pick-th shard) for most picks, else any node; never one already held."""
        with self._lock:
            names = [n for n in self.cluster.node_names if n not in self._held]
        if leader and pick % 4 != 0:
            smap = self.cluster.shard_map()
            if smap is not None:
                leaders = [s.leader_id for s in smap.shards if s.leader_id in names]
                if leaders:
                    return leaders[pick % len(leaders)]
        return names[pick % len(names)]

    def _hold_process(self, name: str, held: bool) -> None:
        with self._lock:
            (self._held.add if held else self._held.discard)(name)

    # ---- episodes: processes ---------------------------------------------------------------

    def _node_kill(self, e: Episode, done: Done) -> None:
        name = self._node(e.pick)
        done.targets = [name]
        self._hold_process(name, True)
        try:
            self.cluster.kill_node(name)
            self._hold(e.hold_s)
            self._restart_node(name)
        finally:
            self._hold_process(name, False)

    def _node_pause(self, e: Episode, done: Done) -> None:
        name = self._node(e.pick)
        done.targets = [name]
        self._hold_process(name, True)
        try:
            self.cluster.pause_node(name)
            self._hold(e.hold_s)
        finally:
            self.cluster.resume_node(name)
            self._hold_process(name, False)

    def _broker(self, e: Episode, controller: bool) -> str:
        if controller:
            active = self.cluster.active_controller()
            if active is not None:
                return active
        return self.cluster.brokers[e.pick % len(self.cluster.brokers)]

    def _kill_broker(self, e: Episode, done: Done, controller: bool) -> None:
        name = self._broker(e, controller)
        done.targets = [name]
        index = self.cluster.broker_index(name)
        self._hold_process(name, True)
        try:
            self.cluster.kafka.kill_node(index)
            self._hold(e.hold_s)
            self.cluster.kafka.start_node(index, wait=True, timeout_s=RESTART_TIMEOUT_S)
        finally:
            self._hold_process(name, False)  # not back: the supervisor starts it again

    def _pause_broker(self, e: Episode, done: Done, controller: bool) -> None:
        name = self._broker(e, controller)
        done.targets = [name]
        index = self.cluster.broker_index(name)
        self._hold_process(name, True)
        self.cluster.kafka.pause_node(index)
        try:
            self._hold(e.hold_s)
        finally:
            self.cluster.kafka.resume_node(index)
            self._hold_process(name, False)

    def _broker_kill(self, e: Episode, done: Done) -> None:
        self._kill_broker(e, done, controller=False)

    def _controller_kill(self, e: Episode, done: Done) -> None:
        self._kill_broker(e, done, controller=True)

    def _broker_pause(self, e: Episode, done: Done) -> None:
        self._pause_broker(e, done, controller=False)

    def _controller_pause(self, e: Episode, done: Done) -> None:
        self._pause_broker(e, done, controller=True)

    # ---- episodes: links -------------------------------------------------------------------

    def _cut(self, e: Episode, done: Done, side_a: list[str], side_b: list[str], *, one_way: bool = False) -> None:
        net = self.cluster.net
        done.targets = [*side_a, "->" if one_way else "<->", *side_b]
        cuts = net.partition(side_a, side_b, one_way=one_way)
        try:
            self._hold(e.hold_s)
        finally:
            net.heal(cuts)

    def _partition_node_brokers(self, e: Episode, done: Done) -> None:
        self._cut(e, done, [self._node(e.pick)], list(self.cluster.brokers))

    def _partition_node_node(self, e: Episode, done: Done) -> None:
        a = self._node(e.pick)
        others = [n for n in self.cluster.node_names if n != a]
        self._cut(e, done, [a], [others[(e.pick >> 8) % len(others)]])

    def _partition_broker_brokers(self, e: Episode, done: Done) -> None:
        broker = self.cluster.brokers[e.pick % len(self.cluster.brokers)]
        self._cut(e, done, [broker], [b for b in self.cluster.brokers if b != broker])

    def _partition_one_way(self, e: Episode, done: Done) -> None:
        members = [*self.cluster.brokers, *self.cluster.node_names]
        sender = members[e.pick % len(members)]
        others = [m for m in members if m != sender]
        self._cut(e, done, [sender], [others[(e.pick >> 8) % len(others)]], one_way=True)

    # ---- episodes: a node's environment ----------------------------------------------------

    def _disk_full(self, e: Episode, done: Done) -> None:
        name = self._node(e.pick, leader=False)
        done.targets = [name]
        disk = self.cluster.disks[name]
        try:
            taken = disk.fill()
            done.detail = f"took {taken >> 20} MiB"
            self._hold(e.hold_s)
        finally:
            disk.empty()

    def _clock_jump(self, e: Episode, done: Done) -> None:
        name = self._node(e.pick)
        done.targets = [name]
        done.detail = f"{e.amount:+d} ms"
        self.cluster.set_clock_offset(name, e.amount)
        try:
            self._hold(e.hold_s)
        finally:
            self.cluster.set_clock_offset(name, 0)

    def _shard_move(self, e: Episode, done: Done) -> None:
        smap = self.cluster.shard_map()
        if smap is None:
            done.detail = "no shard map: nothing moved"
            return
        info = smap.shards[e.pick % len(smap.shards)]
        holding = {r.node_id for r in info.replicas}
        candidates = [n for n in self.cluster.node_names if n not in holding]
        if not candidates:
            done.detail = f"shard {info.shard} is on every node"
            return
        to = candidates[(e.pick >> 8) % len(candidates)]
        done.targets = [f"shard {info.shard}", to]
        with self.cluster.client() as client:
            try:  # conditional on the placement the move was computed from (P4)
                changes = client.move_shard(info.shard, to, epoch=smap.placement_epoch or None)
            except PlacementChanged as exc:
                done.detail = f"refused, the placement changed meanwhile: {exc}"
                return
        done.detail = "; ".join(f"shard {c.shard}: {','.join(c.before)} -> {','.join(c.after)}" for c in changes)

    # ---- episodes: the pipeline ------------------------------------------------------------

    def _snapshot_truncate(self, e: Episode, done: Done) -> None:
        done.targets = [str(self.cluster.snapshot_dir)]
        common = self.pipeline_args()
        retried = []
        for step in (["snapshot", "create", "--dir", str(self.cluster.snapshot_dir), "--master", "local[2]"],
                     ["wal", "truncate", "--dir", str(self.cluster.snapshot_dir)]):
            name = " ".join(step[:2])
            for attempt in range(1, PIPELINE_ATTEMPTS + 1):
                code, tail = run_cli(self.out / "logs" / "pipeline.log", [*common[:4], *step, *common[4:]])
                if code == 0:
                    break
                if attempt == PIPELINE_ATTEMPTS or self._stop.is_set():
                    raise RuntimeError(f"kvstore {name} exited {code} ({attempt} attempts): {tail}")
                log.warning("kvstore %s exited %d (attempt %d of %d), again in %.0f s once every broker serves: %s",
                            name, code, attempt, PIPELINE_ATTEMPTS, PIPELINE_RETRY_WAIT_S, tail)
                retried.append(name)
                # The third long run's three attempts all met one broker's seven-minute restart.
                self._stop.wait(PIPELINE_RETRY_WAIT_S)
                self._brokers_back()
        done.detail = "snapshot taken, WAL truncated below it" + (
            f" (tried again: {', '.join(retried)})" if retried else "")

    def pipeline_args(self) -> list[str]:
        return ["--endpoints", ",".join(self.cluster.endpoints), "--output", "json",
                "--kafka", self.cluster.kafka.bootstrap_servers, "--topic", f"{CLUSTER}.wal"]


def run_cli(log_path: Path, args: list[str], timeout_s: float = SPARK_TIMEOUT_S) -> tuple[int, str]:
    """`kvstore ARGS` in a child process (Spark's JVM with it), output appended to `log_path`;
    returns the exit code and the last line of its output, or when it failed the last line of
    its errors (where it says why: "kvstore: snapshot: Spark failed: ...")."""
    with open(log_path, "ab") as out:
        out.write(f"\n$ kvstore {' '.join(args)}\n".encode())
        out.flush()
        errors_from = out.tell()
        result = subprocess.run([sys.executable, "-m", "kvstore.cli", *args], stdout=subprocess.PIPE,
                                stderr=out, timeout=timeout_s, check=False)
        out.write(result.stdout)
    said = result.stdout
    if result.returncode != 0:
        with open(log_path, "rb") as log_file:
            log_file.seek(errors_from)
            said = log_file.read()
    lines = [line for line in said.decode(errors="replace").splitlines()
             if line.strip() and not line.startswith(("%", "\t", " "))]  # not librdkafka's log, a trace's frames
    return result.returncode, lines[-1] if lines else ""


Executor = Callable[[Episode, Done], None]
