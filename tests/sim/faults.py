"""The fault injector: crashes, restarts, pauses, bad networks, late EndTxns, a foreign writer,
refusing brokers, at random moments of the run, all drawn from the run's one generator.

Why these faults: each is one the protocol claims to survive (docs/design.md §4-6).

* **crash** a node (sometimes losing its disk): the in-memory state is gone; it restarts later
  from its checkpoint and state (or from nothing) and replays the WAL;
* **pause** a node (SIGSTOP), preferably a leader, mostly for up to three session timeouts,
  sometimes for ten: the group moves its shards and the node wakes up as a zombie that still
  believes it leads;
* **freeze** every node at once (a host or hypervisor stall) for up to eight session timeouts:
  nobody fences anybody, so a transaction left open outlives `transaction.timeout.ms` and the
  coordinator aborts it, and everyone wakes up expelled;
* **network storm**: for a while messages are late (beyond the call timeouts, so requests land
  after their caller gave up), duplicated and lost;
* **late EndTxn**: for a while commits and aborts in particular are late, the KIP-890 hazard;
* **foreign write**: a producer outside the protocol appends a record to a shard, well formed
  with the expected offset it guessed from the high watermark, or garbage; either may land
  between a leader's records and its commit marker or shift the leader's next batch (W2, W3);
* **broker refusals**: for a while requests are refused with retriable errors (a coordinator
  moving, replicas missing), and commits are refused before EndTxn leaves the client;
* **cut off from Kafka**: one node's requests to the brokers and the group coordinator are lost
  for a while, mostly a leader's, while its clients still reach it: the group moves its shards,
  and until it learns so it believes it leads (the case a read barrier exists for);
* **clock jump**: a node's wall clock steps forward or back, within the skew bound every clock
  keeps (nodes and clients each start somewhere within it, too);
* **broker crash**: the brokers are down for a while, every request to them and answer from them
  lost (what they had written stays written), the group's sessions running out meanwhile;
* **truncation**: a snapshot of a shard built from the WAL, then the WAL truncated below it:
  replicas behind it, and any that lost its disk, bootstrap from the snapshot;
* **outage**: every node holding one shard (placement put it on some nodes only) is paused for
  longer than the request-id horizon, while the others go on: a cross-shard transaction's
  participant comes back after its coordinator forgot the decision's request ids (T3 must not
  depend on them);
* **placement** (runs with placement only): an **operator**'s drain (sometimes forced, sometimes
  undone) or move, computed from the placement one node shows, sometimes at a stale epoch
  (`tests.sim.operator`); the **controller's node paused** (past its session, so another takes
  office and it wakes up a zombie) or **crashed**, often in the middle of a move; a node whose
  **listings of the members keep failing** for a while (a controller there sees no one come or go);
* **fast clock at start-up**: a node restarts with its wall clock ahead by more than the skew
  bound (the clock guard has no earlier reading to hold it to): its prepares look old to others
  and its request-id horizon judges every retry expired. Ahead only: a clock behind by more than
  the bound can let a retry whose id was forgotten through (docs/design.md §4.1, a documented
  limit of every write), which is not what this fault is about.

`heal` ends all of it: the network is calm again, paused nodes resume, crashed ones restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import cast

from kvstore.core.evaluate import evaluate_put
from kvstore.internal.v1 import placement_pb2 as pb
from kvstore.v1 import kv_pb2
from tests.sim.checker import FOREIGN_WRITER
from tests.sim.network import CALM, Conditions
from tests.sim.node import Node
from tests.sim.operator import Operator
from tests.sim.world import World
from wal import record


def _hostile_placement_payloads() -> tuple[bytes, ...]:
    """Placement records no reader may take: they do not decode, or break a rule of the apply."""
    return (
        b"\x0a\xff\xff\xff\xff\x0f garbage",  # a length past the end
        b"\x0b" * 3_000,  # groups nested past the parser's recursion limit
        b"\x00" * (70 * 1024),  # over the record bound
        pb.PlacementRecord(reason="no kind").SerializeToString(),
        pb.PlacementRecord(step=pb.CopyStep(shard=1_000_000, node_id="n0", kind=pb.COPY_STEP_KIND_DROP))
        .SerializeToString(),
        pb.PlacementRecord(step=pb.CopyStep(shard=0, node_id="n0", kind=cast(pb.CopyStepKind, 99)))
        .SerializeToString(),
        pb.PlacementRecord(node_gone=pb.NodeGone(node_id="nobody")).SerializeToString(),
        pb.PlacementRecord(node_joined=pb.NodeJoined(node_id="")).SerializeToString(),
        pb.PlacementRecord(pin=pb.PinShard(shard=0, nodes=["n0", "n0"])).SerializeToString(),
        pb.PlacementRecord(settings=pb.PlacementSettings(shard_count=0, replication_factor=2)).SerializeToString(),
    )


HOSTILE_PLACEMENT_PAYLOADS = _hostile_placement_payloads()


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    """How often each fault strikes: one fault every `mean_gap_ms` on average, chosen by weight."""

    mean_gap_ms: int = 1_000
    crash: int = 3
    pause: int = 4
    freeze: int = 1
    storm: int = 3
    late_end_txn: int = 2
    foreign_write: int = 3
    refusals: int = 1
    cut_off: int = 2
    clock_jump: int = 2
    broker_crash: int = 1
    truncate: int = 2
    outage: int = 1
    # Placement's, in runs with placement only (weight 0 otherwise, so the others' draws stay as they were).
    operator: int = 3
    controller_pause: int = 1
    controller_crash: int = 1
    listing_failure: int = 1
    disk_loss: float = 0.15  # share of crashes that also lose the disk
    fast_clock_start: float = 0.2  # share of restarts with the wall clock ahead past the skew bound


class FaultInjector:
    def __init__(self, world: World, nodes: Sequence[Node], plan: FaultPlan, operator: Operator | None = None) -> None:
        self.world = world
        self.nodes = list(nodes)
        self.plan = plan
        self.operator = operator
        if operator is not None:
            operator.on_accepted = self._mid_move
        self.active = False
        self._network_token = 0
        self._refusal_token = 0
        self._foreign = 0

    def start(self) -> None:
        self.active = True
        self._schedule()

    def heal(self) -> None:
        """Stop injecting; undo every fault still in effect."""
        self.active = False
        self._network_token += 1
        self._refusal_token += 1
        self.world.net.conditions = CALM
        self.world.net.cut_off.clear()
        self.world.net.brokers_down = False
        self.world.broker.refuse_rate = 0.0
        self.world.listing_fails.clear()
        for node in self.nodes:
            if node.paused:
                self._resume(node)
            elif not node.alive:
                self._restart(node)

    def _schedule(self) -> None:
        gap = max(1, int(self.world.sched.rng.expovariate(1 / self.plan.mean_gap_ms)))
        self.world.sched.at(gap, self._strike)

    def _strike(self) -> None:
        if not self.active:
            return
        p = self.plan
        kinds = ("crash", "pause", "freeze", "storm", "late_end_txn", "foreign_write", "refusals", "cut_off",
                 "clock_jump", "broker_crash", "truncate", "outage", "operator", "controller_pause", "controller_crash",
                 "listing_failure", "foreign_placement_record")
        placing = self.world.replication_factor is not None
        weights = (p.crash, p.pause, p.freeze, p.storm, p.late_end_txn, p.foreign_write, p.refusals, p.cut_off,
                   p.clock_jump, p.broker_crash, p.truncate, p.outage,
                   *((p.operator, p.controller_pause, p.controller_crash, p.listing_failure, p.foreign_write)
                     if placing else (0, 0, 0, 0, 0)))
        kind = self.world.sched.rng.choices(kinds, weights)[0]
        getattr(self, f"_{kind}")()
        self._schedule()

    # ---- node faults --------------------------------------------------------------------------------

    def _crash(self) -> None:
        sched = self.world.sched
        up = [n for n in self.nodes if n.alive]
        if not up:
            return
        node = sched.rng.choice(up)
        lose_disk = sched.chance(self.plan.disk_loss)
        self.world.audit.counters["fault_crash"] += 1
        self.world.trace.log(f"FAULT crash {node.name}{' (disk lost)' if lose_disk else ''}")
        node.crash(lose_disk=lose_disk)
        sched.at(sched.between(100, 3_000), lambda: self._restart(node))

    def _restart(self, node: Node) -> None:
        if node.alive:
            return
        sched = self.world.sched
        if self.active and sched.chance(self.plan.fast_clock_start):
            bound = self.world.timing.clock_skew_ms
            node.clock_skew_ms = sched.between(2 * bound, 6 * bound)
            self.world.audit.counters["fault_fast_clock_start"] += 1
            self.world.trace.log(f"FAULT restart {node.name} with its clock {node.clock_skew_ms} ms ahead")
        else:
            self.world.trace.log(f"FAULT restart {node.name}")
        node.restart()

    def _outage(self) -> None:
        """Every node holding one shard paused past the request-id horizon (no-op where every
        node holds every shard: that would stop the whole cluster, and nothing would move)."""
        sched, world = self.world.sched, self.world
        shard = sched.between(0, world.shards - 1)
        holders = [n for n in self.nodes if shard in n.stores and n.alive and not n.paused]
        if not holders or len(holders) == len([n for n in self.nodes if n.alive]):
            return
        horizon = world.timing.request_horizon_ms
        duration = sched.between(horizon + horizon // 10, horizon + horizon // 2)
        world.audit.counters["fault_outage"] += 1
        world.trace.log(f"FAULT outage of shard {shard}: {[n.name for n in holders]} paused for {duration}ms")
        for node in holders:
            sched.pause(node)
            sched.at(duration, self._resumer(node))

    def _pause(self) -> None:
        sched = self.world.sched
        up = [n for n in self.nodes if n.alive and not n.paused]
        if not up:
            return
        leaders = [n for n in up if n.assigned]
        node = sched.rng.choice(leaders if leaders and sched.chance(0.7) else up)
        session = self.world.timing.session_timeout_ms
        # mostly around the session timeout; sometimes beyond the transaction timeout
        duration = sched.between(50, 3 * session) if sched.chance(0.9) else sched.between(3 * session, 10 * session)
        self.world.audit.counters["fault_pause"] += 1
        self.world.trace.log(f"FAULT pause {node.name} for {duration}ms (leads {sorted(node.assigned)})")
        sched.pause(node)
        sched.at(duration, self._resumer(node))

    def _cut_off(self) -> None:
        """A node loses Kafka (brokers and group coordinator) for a while, mostly a leader, and
        keeps serving its clients: the group gives its shards to others, and until it learns
        so it still believes it leads (its reads must not be served from its own state)."""
        sched, net = self.world.sched, self.world.net
        up = [n for n in self.nodes if n.alive and n.name not in net.cut_off]
        if not up:
            return
        leaders = [n for n in up if n.assigned]
        node = sched.rng.choice(leaders if leaders and sched.chance(0.8) else up)
        duration = sched.between(self.world.timing.session_timeout_ms, 5 * self.world.timing.session_timeout_ms)
        self.world.audit.counters["fault_cut_off"] += 1
        self.world.trace.log(f"FAULT cut {node.name} off from Kafka for {duration}ms (leads {sorted(node.assigned)})")
        net.cut_off.add(node.name)

        def reconnect() -> None:
            if node.name in net.cut_off:
                net.cut_off.discard(node.name)
                self.world.trace.log(f"FAULT {node.name} reaches Kafka again")

        sched.at(duration, reconnect)

    def _broker_crash(self) -> None:
        """The brokers go down for a while (a crash and restart of a single broker, or of the
        controller and the partitions' leaders): every request and answer in between is lost,
        the group's sessions run out, open transactions time out. Their logs survive."""
        sched, net = self.world.sched, self.world.net
        if net.brokers_down:
            return
        duration = sched.between(self.world.timing.call_timeout_ms, 4 * self.world.timing.session_timeout_ms)
        self.world.audit.counters["fault_broker_crash"] += 1
        self.world.trace.log(f"FAULT brokers down for {duration}ms")
        net.brokers_down = True

        def back_up() -> None:
            if net.brokers_down:
                net.brokers_down = False
                self.world.trace.log("FAULT brokers back")

        sched.at(duration, back_up)

    def _truncate(self) -> None:
        """A snapshot of a shard at its last stable offset, built from the WAL (the Spark job's
        fold: read_committed, W3, the replicas' own apply), then the WAL truncated below it,
        keeping the slot below the cut (a quiet leader's assumed marker slot, `wal truncate`).
        Replicas behind it must bootstrap from the snapshot; so must one that lost its disk."""
        world = self.world
        shard = world.sched.between(0, world.shards - 1)
        part = world.broker.partitions[shard]
        cut = part.last_stable_offset
        if cut - 1 <= part.log_start:
            return
        state = world.new_disk()
        accepted: list[tuple[int, bytes]] = []
        for entry in part.log[:cut]:
            if entry.committed and not entry.control:
                verdict, accepted_record = record.judge(entry.offset, entry.value, entry.headers)
                if verdict is record.Verdict.ACCEPTED:
                    assert accepted_record is not None
                    accepted.append((entry.offset, accepted_record.payload))
        state.apply(accepted, cut)
        world.snapshots.setdefault(shard, []).append((cut, state))
        world.broker.truncate(shard, cut - 1)
        world.audit.counters["fault_truncate"] += 1
        world.trace.log(f"FAULT snapshot of shard {shard} at {cut}; WAL truncated below {cut - 1}")

    def _clock_jump(self) -> None:
        """A node's wall clock jumps, forward or back, anywhere within the documented skew bound
        (NTP stepping it): leader times stamped in the WAL and request-id horizons see it."""
        sched = self.world.sched
        node = sched.rng.choice(self.nodes)
        half = self.world.timing.clock_skew_ms // 2
        before, node.clock_skew_ms = node.clock_skew_ms, sched.between(-half, half)
        self.world.audit.counters["fault_clock_jump"] += 1
        self.world.trace.log(f"FAULT clock of {node.name} jumps {node.clock_skew_ms - before:+d}ms")

    def _freeze(self) -> None:
        sched = self.world.sched
        up = [n for n in self.nodes if n.alive and not n.paused]
        duration = sched.between(500, 8 * self.world.timing.session_timeout_ms)
        self.world.audit.counters["fault_freeze"] += 1
        self.world.trace.log(f"FAULT freeze {[n.name for n in up]} for {duration}ms")
        for node in up:
            sched.pause(node)
            sched.at(duration, self._resumer(node))

    def _resumer(self, node: Node) -> Callable[[], None]:
        """What resumes `node` later, unless it crashed (and restarted) meanwhile."""
        incarnation = node.incarnation

        def resume() -> None:
            if node.incarnation == incarnation:
                self._resume(node)

        return resume

    def _resume(self, node: Node) -> None:
        if node.alive and node.paused:
            self.world.trace.log(f"FAULT resume {node.name}")
            self.world.sched.resume(node)

    # ---- placement ---------------------------------------------------------------------------------------

    def _operator(self) -> None:
        if self.operator is not None:
            self.operator.act()

    def _mid_move(self) -> None:
        """An operator's drain or move was just recorded: sometimes the controller's node is paused
        or killed a moment later, in the middle of the move."""
        sched = self.world.sched
        if not self.active or not sched.chance(0.4):
            return
        then = self._controller_pause if sched.chance(0.5) else self._controller_crash
        self.world.audit.counters["fault_controller_mid_move"] += 1
        sched.at(sched.between(20, 600), lambda: then() if self.active else None)

    def _controller(self) -> Node | None:
        """The node in the controller's office now (running, or still taking office)."""
        holders = [n for n in self.nodes if n.alive and not n.paused and n.controller.tenure is not None]
        return holders[0] if holders else None

    def _controller_pause(self) -> None:
        """The controller's node stops past its session (often mid-move): another takes office;
        it wakes up believing it still decides, until its next append is refused as fenced."""
        node = self._controller()
        if node is None:
            return
        sched, session = self.world.sched, self.world.timing.session_timeout_ms
        duration = sched.between(session, 4 * session)
        self.world.audit.counters["fault_controller_pause"] += 1
        self.world.trace.log(f"FAULT pause the controller {node.name} for {duration}ms")
        sched.pause(node)
        sched.at(duration, self._resumer(node))

    def _controller_crash(self) -> None:
        node = self._controller()
        if node is None:
            return
        self.world.audit.counters["fault_controller_crash"] += 1
        self.world.trace.log(f"FAULT crash the controller {node.name}")
        node.crash()
        self.world.sched.at(self.world.sched.between(100, 3_000), lambda: self._restart(node))

    def _listing_failure(self) -> None:
        """One node's listings of the membership group fail for a while (mostly the controller's)."""
        sched = self.world.sched
        controller = self._controller()
        node = controller if controller is not None and sched.chance(0.7) else sched.rng.choice(self.nodes)
        grace = self.world.timing.placement_grace_ms
        until = sched.now + sched.between(grace, 5 * grace)
        self.world.listing_fails[node.name] = until
        self.world.audit.counters["fault_listing_failure"] += 1
        self.world.trace.log(f"FAULT listings of the members fail on {node.name} for {until - sched.now}ms")

    def _foreign_placement_record(self) -> None:
        """A record from outside the store in the placement log, at the end a naive writer reads:
        garbage, or a hostile one in a well-formed envelope that every reader must skip (P1: any
        byte of the log may be hostile)."""
        world = self.world
        partition = world.placement_partition
        _, guess = world.broker.ends(partition)
        payload = world.sched.rng.choice(HOSTILE_PLACEMENT_PAYLOADS)
        world.audit.counters["fault_foreign_placement_record"] += 1
        if world.sched.chance(0.2):
            value, headers = b"\xff not a WAL record", cast(record.Headers, [])
        else:
            value, headers = record.encode(guess, record.WriterIdentity(FOREIGN_WRITER, 0), payload)

        def land() -> None:
            if self.active:
                offset = world.broker.produce_foreign(partition, value, headers)
                world.trace.log(f"FAULT foreign record in the placement log at {offset} (expects {guess})")

        world.net.send(land, None)

    # ---- network and broker faults ----------------------------------------------------------------------

    def _storm(self) -> None:
        sched = self.world.sched
        conditions = Conditions(late=sched.rng.choice((0.01, 0.03, 0.1)), duplicate=sched.rng.choice((0.02, 0.1)),
                                drop=sched.rng.choice((0.0, 0.01, 0.03)))
        self._network(conditions, sched.between(100, 2_000), "storm")

    def _late_end_txn(self) -> None:
        sched = self.world.sched
        self._network(Conditions(late_end_txn=0.5, duplicate=0.05), sched.between(200, 2_000), "late_end_txn")

    def _network(self, conditions: Conditions, duration: int, kind: str) -> None:
        self._network_token += 1
        token = self._network_token
        self.world.net.conditions = conditions
        self.world.audit.counters[f"fault_{kind}"] += 1
        self.world.trace.log(f"FAULT {kind} {conditions} for {duration}ms")

        def calm() -> None:
            if token == self._network_token:
                self.world.net.conditions = CALM

        self.world.sched.at(duration, calm)

    def _refusals(self) -> None:
        self._refusal_token += 1
        token = self._refusal_token
        self.world.broker.refuse_rate = self.world.sched.rng.choice((0.05, 0.2))
        self.world.audit.counters["fault_refusals"] += 1

        def stop() -> None:
            if token == self._refusal_token:
                self.world.broker.refuse_rate = 0.0

        self.world.sched.at(self.world.sched.between(100, 1_000), stop)

    def _foreign_write(self) -> None:
        """A record from outside the protocol, with the expected offset a naive writer would
        guess (the high watermark it just read), or garbage."""
        world = self.world
        shard = world.sched.between(0, world.shards - 1)
        self._foreign += 1
        world.audit.counters["fault_foreign_write"] += 1
        if world.sched.chance(0.2):
            world.broker.produce_foreign(shard, b"\xff not a WAL record", [])
            return
        _, guess = world.broker.ends(shard)
        key = f"foreign-{self._foreign}".encode()
        entry = evaluate_put(kv_pb2.PutRequest(key=key, value=b"x"), lambda _k: None, shard, guess).entry
        assert entry is not None
        value, headers = record.encode(guess, record.WriterIdentity(FOREIGN_WRITER, 0), entry.SerializeToString())

        def land() -> None:
            if not self.active:
                return  # healed meanwhile: the foreign writer was stopped too
            offset = world.broker.produce_foreign(shard, value, headers)
            world.trace.log(f"FAULT foreign record on shard {shard} at {offset} (expects {guess})")

        world.net.send(land, None)
