"""Build a cluster, run it under faults for a number of steps, heal it, let it settle, check it.

Why this shape: safety is checked on every run whatever happened (W1-W7, acknowledged writes,
request ids, linearizability), and convergence once the faults stopped: after `heal` every node
is up, the network is calm, clients finish with a Get of every key, and the run continues until
every replica of every shard sits at its partition's end with no transaction open (or the heal
budget runs out, which is itself a failure: the cluster did not recover).

A run is a pure function of its `SimConfig`: `run` returns the violations, a trace of the last
interesting events, statistics, and a digest of everything observable (the logs and the
history), which the replay test compares across processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import time
import traceback

from kvstore.core import placement_follower
from kvstore.core.placement_controller import DRAIN_BELOW_R, DROP_BEFORE_CAUGHT_UP, MERGE_STALE_REQUEST
from kvstore.core.placement_log import CopyState
from kvstore.core.replica import Mutation
from kvstore.core.txn_driver import TxnMutation
from tests.sim.bank import BankClient, BankOp, accounts
from tests.sim.checker import check_run
from tests.sim.client import Client, Operation
from tests.sim.controller import UNFENCED_CONTROLLER
from tests.sim.faults import FaultInjector, FaultPlan
from tests.sim.group import GroupCoordinator
from tests.sim.kafka import Broker, KafkaVariant
from tests.sim.network import Network
from tests.sim.node import Node
from tests.sim.operator import Operator
from tests.sim.placement_checker import PlacementOracle, check_placement
from tests.sim.scheduler import START_UNIX_MS, Scheduler
from tests.sim.world import Audit, Timing, Trace, World, spread_keys

SETTLE_CHECK_EVERY = 500  # steps between convergence checks in the heal phase


@dataclasses.dataclass(frozen=True)
class SimConfig:
    seed: int
    steps: int = 50_000  # scheduler events under faults
    heal_steps: int = 200_000  # at most this many more to converge after healing
    nodes: int = 3
    shards: int = 2
    clients: int = 4
    keys: int = 5
    kafka: KafkaVariant = dataclasses.field(default_factory=KafkaVariant)
    check_w2: bool = True  # False: leaders commit without comparing delivered offsets (teeth)
    late_requests: bool = True  # nodes run client requests that arrive after their deadline (gRPC's are relative)
    faults: FaultPlan | None = dataclasses.field(default_factory=FaultPlan)
    timing: Timing = dataclasses.field(default_factory=Timing)
    mutations: frozenset[Mutation] = frozenset()  # the replica machine's broken variants
    replication_factor: int | None = None  # placement: each shard on this many nodes (None: on every node)
    skip_caught_up: bool = False  # the placement mutation: a node judges a copy caught up once it is open
    placement_mutations: frozenset[str] = frozenset()  # PLACEMENT_MUTATIONS
    late_start_ms: int = 0  # with placement: one node starts this much later than the others (cold start)
    zones: int = 0  # with placement: nodes spread over this many zones (0: none)
    bank_clients: int = 1  # transfers and sums over accounts in every shard (cross-shard Txns)
    bank_accounts: int = 4
    txn_mutations: frozenset[TxnMutation] = frozenset()  # the transaction protocol's broken variants

    @property
    def variant(self) -> str:
        parts = [] if self.check_w2 else [W2_SKIPPED]
        parts += [] if self.kafka.fencing else [FENCING_SKIPPED]
        parts += [] if self.kafka.kip890 else [NO_KIP890]
        parts += [] if self.late_requests else ["no-late-requests"]
        parts += sorted(m.value for m in self.mutations)
        parts += sorted(m.value for m in self.txn_mutations)
        parts += [SKIP_CAUGHT_UP] if self.skip_caught_up else []
        parts += sorted(self.placement_mutations)
        parts += [f"rf{self.replication_factor}"] if self.replication_factor is not None else []
        return ",".join(parts) or "correct"


# Every mutation the simulation must catch, by the name KVSTORE_SIM_MUTATION takes: three broken
# environments or shells (the guard's W2 comparison skipped by the writer's shell, a broker that
# fences nobody, a broker without KIP-890's epoch bump per transaction) and the replica machine's
# own (`kvstore.core.replica.Mutation`).
W2_SKIPPED = "skip-w2-check"
FENCING_SKIPPED = "skip-fencing"
NO_KIP890 = "no-kip890"
SKIP_CAUGHT_UP = "skip-caught-up"  # placement: a node judges a copy caught up once it is open ("joined once")
# Placement's (docs/design.md §8): the controller machine's and the follower's own
# (kvstore.core.placement_controller.MUTATIONS, placement_follower.DROP_REOPENED_COPY), and the
# controller shell's (tests.sim.controller.UNFENCED_CONTROLLER).
PLACEMENT_MUTATIONS = (DROP_BEFORE_CAUGHT_UP, placement_follower.DROP_REOPENED_COPY, DRAIN_BELOW_R,
                       UNFENCED_CONTROLLER, MERGE_STALE_REQUEST)
# The log's and the replica machine's mutations run without the bank's transactions, as they were
# written: the bank's traffic and the resolvers' rounds take steps from the hazards they are about
# (no-kip890 went uncaught in its 16 seeds with them). And without placement, for the same reason:
# a placed cluster serves nothing until its first placement (a quiet membership, every member's
# report, the learners caught up), and its controller's traffic takes steps too (skip-fencing went
# from seed 0 to seed 7 with the placement log). Placement's own mutations run without the bank.
_LOG_ONLY: dict[str, object] = {"bank_clients": 0, "replication_factor": None}
_PLACED: dict[str, object] = {"bank_clients": 0, "replication_factor": 2}
MUTATIONS: dict[str, dict[str, object]] = {
    W2_SKIPPED: {"check_w2": False, **_LOG_ONLY},
    FENCING_SKIPPED: {"kafka": KafkaVariant(fencing=False), **_LOG_ONLY},
    NO_KIP890: {"kafka": KafkaVariant(kip890=False), **_LOG_ONLY},
    SKIP_CAUGHT_UP: {"skip_caught_up": True, **_PLACED},
    **{m: {"placement_mutations": frozenset({m}), **_PLACED} for m in PLACEMENT_MUTATIONS},
    DRAIN_BELOW_R: {"placement_mutations": frozenset({DRAIN_BELOW_R}), **_PLACED, "replication_factor": 3},
    **{m.value: {"mutations": frozenset({m}), **_LOG_ONLY} for m in Mutation},
    # The transaction protocol's (`kvstore.core.txn_driver.TxnMutation`): on clusters whose bank
    # clients' transfers span shards.
    **{m.value: {"txn_mutations": frozenset({m}), "shards": 3, "bank_clients": 2} for m in TxnMutation},
    # Reads of locked keys show only with bank clients reading accounts over shards.
    Mutation.SKIP_READ_LOCK_WAIT.value: {"mutations": frozenset({Mutation.SKIP_READ_LOCK_WAIT}), "shards": 3,
                                         "bank_clients": 3},
}


def mutation_overrides(name: str) -> dict[str, object]:
    """The `SimConfig` fields that make mutation `name` (KVSTORE_SIM_MUTATION)."""
    if name not in MUTATIONS:
        raise ValueError(f"unknown mutation {name!r}; known: {', '.join(sorted(MUTATIONS))}")
    return MUTATIONS[name]


@dataclasses.dataclass
class SimResult:
    config: SimConfig
    violations: list[str]
    steps: int
    sim_ms: int
    wall_s: float
    converged: bool
    stats: dict[str, int]
    trace: list[str]
    digest: str

    @property
    def ok(self) -> bool:
        return not self.violations

    def report(self, test: str, limit: int = 80) -> str:
        c = self.config
        lines = [f"simulation seed {c.seed} ({c.variant}, {c.steps} steps) failed with "
                 f"{len(self.violations)} violation(s):"]
        lines += [f"  - {v}" for v in self.violations[:20]]
        lines.append(f"replay: {replay_command(c.seed, c.steps, test)}")
        lines.append(f"stats: {self.stats}")
        lines.append(f"last {min(limit, len(self.trace))} trace lines (step, time, event):")
        lines += [f"  {line}" for line in self.trace[-limit:]]
        return "\n".join(lines)


def replay_command(seed: int, steps: int, test: str) -> str:
    return f"KVSTORE_SIM_SEED={seed} KVSTORE_SIM_STEPS={steps} .venv/bin/python -m pytest tests/sim -k '{test}'"


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


class Simulation:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        sched = self.sched = Scheduler(config.seed)
        timing = config.timing
        placing = config.replication_factor is not None
        self.world = World(
            sched=sched, net=Network(sched),
            # With placement, one partition more: the placement log's (World.placement_partition).
            broker=Broker(sched, config.shards + (1 if placing else 0), config.kafka,
                          txn_timeout_ms=timing.txn_timeout_ms),
            group=GroupCoordinator(sched, config.shards, session_timeout_ms=timing.session_timeout_ms,
                                   revoke_timeout_ms=timing.revoke_timeout_ms),
            timing=timing, audit=Audit(), trace=Trace(sched), shards=config.shards, check_w2=config.check_w2,
            late_requests=config.late_requests, mutations=config.mutations,
            replication_factor=config.replication_factor, skip_caught_up=config.skip_caught_up,
            placement_mutations=config.placement_mutations,
            controller_group=GroupCoordinator(sched, 1, session_timeout_ms=timing.session_timeout_ms,
                                              revoke_timeout_ms=timing.revoke_timeout_ms) if placing else None,
            txn_mutations=config.txn_mutations)
        self.nodes = [Node(f"n{i}", self.world) for i in range(config.nodes)]
        for index, node in enumerate(self.nodes):
            node.zone = f"z{index % config.zones}" if config.zones else ""
        self.world.peers.update({node.name: node for node in self.nodes})
        self.operator = Operator(self.world, self.nodes) if placing else None
        self.placement_oracle = (PlacementOracle(self.world.broker.partitions[self.world.placement_partition])
                                 if placing else None)
        keys = client_keys(config.keys, config.shards)
        self.clients = [Client(i, self.world, self.nodes, keys) for i in range(config.clients)]
        self.accounts = accounts(config.bank_accounts, config.shards)
        self.bank = [BankClient(i, self.world, self.nodes, self.accounts) for i in range(config.bank_clients)]
        # Every clock within half the skew bound of true time: any two within the bound.
        half = timing.clock_skew_ms // 2
        for actor in (*self.nodes, *self.clients, *self.bank):
            actor.clock_skew_ms = sched.between(-half, half)
        self.faults = FaultInjector(self.world, self.nodes, config.faults, self.operator) if config.faults else None

    def run(self) -> SimResult:
        started = time.perf_counter()
        sched, world = self.sched, self.world
        for index, node in enumerate(self.nodes):
            late = self.config.late_start_ms if index == len(self.nodes) - 1 and self.world.replication_factor else 0
            sched.at(sched.between(0, 50) + late, node.restart)
        for client in (*self.clients, *self.bank):
            client.start()
        if self.faults is not None:
            self.faults.start()
        converged = False
        try:
            while sched.steps < self.config.steps and sched.step():
                pass
            if self.faults is not None:
                self.faults.heal()
            world.trace.log("HEAL: faults stopped, clients finishing")
            for client in (*self.clients, *self.bank):
                client.finish()
            limit = sched.steps + self.config.heal_steps
            while sched.steps < limit:
                for _ in range(SETTLE_CHECK_EVERY):
                    sched.step()
                if self.settled():
                    converged = True
                    break
            if not converged:
                world.violation(f"no convergence {self.config.heal_steps} steps after healing: {self.unsettled()}")
            violations = list(world.audit.violations)
            violations += check_run(world.broker, self.nodes, self.history(), world.audit, world.new_disk,
                                    converged=converged, bank=self.bank_history(), accounts=self.accounts,
                                    keeps_decisions=self.keeps_decisions, shards=world.shards)
            if self.operator is not None:
                violations += check_placement(world.broker.partitions[world.placement_partition], self.nodes,
                                              world.audit, self.operator.history, world.placement_partition,
                                              converged=converged)
        except Exception as exc:  # a core's assertion or a simulation bug: report it with the seed
            tb = "".join(traceback.format_exception(exc)[-6:])
            violations = [*world.audit.violations,
                          f"exception at step {sched.steps}: {type(exc).__name__}: {exc}\n{tb}"]
        return SimResult(self.config, violations, sched.steps, sched.now - START_UNIX_MS,
                         time.perf_counter() - started, converged, self.stats(), list(world.trace.lines),
                         self.digest())

    @property
    def keeps_decisions(self) -> bool:
        """Whether the protocol run forgets decisions once resolved everywhere (not under the
        mutation that keeps them in the request-id table only)."""
        return TxnMutation.DECISION_IN_REQUEST_TABLE not in self.config.txn_mutations

    def history(self) -> list[Operation]:
        return [op for client in self.clients for op in client.history]

    def bank_history(self) -> list[BankOp]:
        return [op for client in self.bank for op in client.history]

    def settled(self) -> bool:
        return not self.unsettled()

    def unsettled(self) -> str:
        """Why the cluster has not converged yet ('' once it has)."""
        if not all(client.done for client in (*self.clients, *self.bank)):
            return "clients still running"
        for node in self.nodes:  # T3: every prepared transaction resolved, every decision forgotten
            for shard, store in sorted(node.stores.items()):
                if store.locks.has_locks():
                    return f"{node.name} shard {shard} holds prepared transactions"
                if store.decisions and self.keeps_decisions:
                    return f"{node.name} shard {shard} holds decisions not resolved everywhere"
        broker = self.world.broker
        for shard, partition in enumerate(broker.partitions[:self.world.shards]):
            if partition.last_stable_offset != partition.high_watermark:
                return f"shard {shard} has an open transaction"
            end = partition.high_watermark
            for node in self.nodes:
                held = node.stores.get(shard)
                if held is not None and held.applied_offset != end:
                    return f"{node.name} shard {shard} at {held.applied_offset}, end {end}"
        if self.placement_oracle is not None:
            return self.placement_unsettled()
        return ""

    def placement_unsettled(self) -> str:
        """Placement settled: every node a member and at the log's end, every shard's copies its
        target, each a replica, open, caught up and in its shard's group, no other copy anywhere."""
        assert self.placement_oracle is not None
        partition = self.placement_oracle.partition
        if partition.last_stable_offset != partition.high_watermark:
            return "the placement log has an open transaction"
        state = self.placement_oracle.catch_up()
        if state.settings is None:
            return "the placement log has no settings yet"
        if set(state.nodes) != {node.name for node in self.nodes}:
            return f"members in the log {sorted(state.nodes)}"
        targets = state.targets()
        for node in self.nodes:
            following = node.following
            if following.position < self.placement_oracle.position:
                return f"{node.name} read the placement log to {following.position} of {self.placement_oracle.position}"
            placed = {shard for shard, target in enumerate(targets) if node.name in target}
            if set(node.stores) != placed:
                return f"{node.name} holds copies of {sorted(node.stores)}, its target is {sorted(placed)}"
            for shard in sorted(placed):
                if (state.copy_state(shard, node.name) is not CopyState.REPLICA or shard not in node.replicas
                        or shard not in following.in_group or not following.really_caught_up(shard)):
                    return (f"{node.name} shard {shard}: {state.copy_state(shard, node.name)} in the log, "
                            f"{'open' if shard in node.replicas else 'closed'}, "
                            f"{'in' if shard in following.in_group else 'out of'} its group")
        for shard, target in enumerate(targets):
            if set(state.copies_of(shard)) != set(target):
                return f"shard {shard}: copies {dict(state.copies_of(shard))}, target {list(target)}"
        return ""

    def stats(self) -> dict[str, int]:
        world = self.world
        stats = dict(sorted(world.audit.counters.items()))
        stats["records"] = sum(p.high_watermark for p in world.broker.partitions)
        stats["leader_commits"] = len(world.audit.leader_commits)
        stats["replicas_forgetting_ids"] = sum(1 for n in self.nodes for s in n.stores.values()
                                              if s.evicted_through_ms)
        for name, value in dataclasses.asdict(world.broker.stats).items():
            stats[f"broker_{name}"] = value
        for name, value in dataclasses.asdict(world.group.stats).items():
            stats[f"group_{name}"] = value
        stats["net_late"] = world.net.late
        stats["net_duplicated"] = world.net.duplicated
        stats["net_dropped"] = world.net.dropped
        stats["net_cut_off_dropped"] = world.net.cut_off_dropped
        stats["net_brokers_down_dropped"] = world.net.brokers_down_dropped
        return stats

    def digest(self) -> str:
        """Everything observable: every offset of every partition and every operation."""
        h = hashlib.sha256()
        for partition in self.world.broker.partitions:
            for e in partition.log:
                h.update(f"{e.offset}:{e.pid}:{e.epoch}:{e.control}:{e.committed}:".encode())
                h.update(e.value or b"")
        for op in self.history():
            h.update(f"{op.client}:{op.kind.value}:{op.key!r}:{op.value!r}:{op.invoke}:{op.complete}:"
                     f"{op.outcome}:{op.output}:{op.revision}".encode())
        for bank_op in self.bank_history():
            h.update(f"{bank_op.client}:{bank_op.kind.value}:{bank_op.request_id}:{bank_op.invoke}:"
                     f"{bank_op.complete}:{bank_op.outcome}:{bank_op.succeeded}:{bank_op.balances}".encode())
        h.update(str(self.sched.steps).encode())
        return h.hexdigest()


def client_keys(count: int, shards: int) -> list[bytes]:
    """`count` keys, and more if needed so that every shard has one: a leader learns of records
    appended behind its back (a foreign writer's) only when it writes or serves a read barrier,
    so every shard needs traffic for the final reads to bring every replica to the end."""
    return spread_keys("k", count, shards)


def run(config: SimConfig) -> SimResult:
    return Simulation(config).run()


def config_for(seed: int, steps: int, **overrides: object) -> SimConfig:
    """The cluster a seed runs: its shape varies with the seed too (3-5 nodes, 1-3 shards, 2-6
    clients, 3-8 keys, every shard on every node or placed on 1-3 of them), drawn from a generator
    of its own so the run's stream stays untouched."""
    shape = random.Random(seed * 7919 + 1)
    config = SimConfig(seed=seed, steps=steps, nodes=shape.choice((3, 3, 4, 5)), shards=shape.choice((1, 2, 2, 3)),
                       clients=shape.randint(2, 6), keys=shape.randint(3, 8),
                       replication_factor=shape.choice((None, 1, 2, 2, 3)), bank_clients=shape.choice((0, 1, 2, 2)),
                       bank_accounts=shape.randint(3, 6), late_start_ms=shape.choice((0, 0, 3_000, 5_000)),
                       zones=shape.choice((0, 0, 2)))
    return dataclasses.replace(config, **overrides)  # type: ignore[arg-type]
