"""What every simulated part shares: the scheduler, the network, the broker, the group, the
timing constants, and the audit log the checker reads at the end.

Why the timings are what they are: they keep the ratios of a real deployment (network delay <<
call timeout < session timeout < transaction timeout; docs/design.md §4.2 asks for
`transaction.timeout.ms` above the worst batch time plus a broker bounce) while shrinking
everything, so that a run of 10^5 steps sees dozens of leader changes.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from kvstore.core.replica import Mutation
from kvstore.core.request_window import MemoryShard
from kvstore.core.sharding import shard_of
from kvstore.core.txn_driver import TxnMutation
from tests.sim.group import GroupCoordinator
from tests.sim.kafka import Broker
from tests.sim.network import Network
from tests.sim.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class Timing:
    """Every bound of the simulated deployment, in simulated milliseconds or counts."""

    call_timeout_ms: int = 600  # one librdkafka call (init, produce+flush, commit, abort, end offsets)
    settle_poll_ms: int = 10  # how often a settled-end read asks again while a transaction is open
    fetch_wait_ms: int = 250  # a fetch's long poll (fetch.wait.max.ms)
    fetch_timeout_ms: int = 1_500  # a fetch whose answer never came is sent again
    fetch_limit: int = 64  # records per fetch answer
    bootstrap_timeout_ms: int = 5_000  # a catch-up that takes longer gives the leadership up
    linger_ms: int = 2  # group commit: wait this long for more writes before a batch
    heartbeat_ms: int = 100
    session_timeout_ms: int = 1_000
    revoke_timeout_ms: int = 2_000
    refence_pause_ms: int = 200  # after losing a leadership it still holds, before taking it again
    barrier_timeout_ms: int = 2_000
    txn_timeout_ms: int = 5_000  # transaction.timeout.ms, above the worst batch (produce + 4 commit calls)
    max_pending: int = 64  # queued writes per shard (OverloadedError beyond)
    batch_records: int = 6  # small, so that batches are carried over
    batch_bytes: int = 2_048
    record_bytes: int = 1_024
    retry_limit: int = 3  # the guard's retries of a retriable call
    produce_chunks: int = 3  # a batch goes out in 1..this many produce requests
    # The request-id window (`kvstore.core.request_window`): small enough that long runs forget ids
    # by count and by time and refuse retries that may be older than what is remembered
    # (`kvstore.core.request_horizon`), large enough that the ids kept cover far more than the skew
    # margin at the simulated write rate (~100/s per shard): with fewer, even first attempts are
    # refused (limits.py: the horizon is min(time bound, ids / rate)). The skew margin is small:
    # simulated clocks agree exactly.
    request_ids: int = 2_048
    request_horizon_ms: int = 15_000
    clock_skew_ms: int = 2_000
    # Placement (docs/design.md §8; tests/sim/controller.py, tests/sim/following.py): how long a node
    # that left the membership group still counts (the log's settings), how often the controller
    # lists the members and asks every node for its report, how often it plans when nothing else
    # woke it, and how long a node's reader of the placement log waits in one fetch.
    placement_grace_ms: int = 2_000
    report_every_ms: int = 300
    controller_tick_ms: int = 100
    placement_fetch_wait_ms: int = 500
    max_learners_per_node: int = 2
    # Cross-shard transactions (kvstore.core.txn_driver): a peer call's timeout, a driver's budget
    # for its prepares, when a prepare is in doubt and when a decision the coordinator still holds
    # is resolved again (its resolvers and finishers look every `txn_resolve_every_ms`, and it
    # forgets decisions resolved everywhere as often): the node's ratios, shrunk. A driver answers
    # at its decision, its resolves still in flight, so the client's next read races them (T4's
    # wait is then what keeps it linearizable).
    txn_call_timeout_ms: int = 800
    txn_deadline_ms: int = 4_000
    txn_in_doubt_ms: int = 1_500
    txn_finish_after_ms: int = 2_000
    txn_resolve_every_ms: int = 300


@dataclasses.dataclass(frozen=True)
class LeaderCommit:
    """A batch a leader's guard reported committed: where it says each record landed."""

    node: str
    shard: int
    offsets: tuple[int, ...]
    payloads: tuple[bytes, ...]


@dataclasses.dataclass
class Audit:
    """What the run observed, for `tests.sim.checker` (the final log is the broker's)."""

    leader_commits: list[LeaderCommit] = dataclasses.field(default_factory=list)
    # (node, shard) -> every (offset, payload) that replica applied, across crashes and wipes
    applied: dict[tuple[str, int], list[tuple[int, bytes]]] = dataclasses.field(default_factory=dict)
    violations: list[str] = dataclasses.field(default_factory=list)
    counters: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # Placement (tests.sim.placement_checker): when each (node, shard) copy was seen really caught
    # up (the simulated replica against the broker's end, never a report), in sim ms, ascending;
    # every deletion of a copy's data (node, shard, the node's position in the placement log, ms).
    caught_up_seen: dict[tuple[str, int], list[int]] = dataclasses.field(default_factory=dict)
    copy_deletes: list[tuple[str, int, int, int]] = dataclasses.field(default_factory=list)


class Trace:
    """The last events worth reading when a seed fails (faults, leadership, batch outcomes)."""

    def __init__(self, sched: Scheduler, keep: int = 400) -> None:
        self._sched = sched
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)

    def log(self, text: str) -> None:
        self.lines.append(f"{self._sched.steps:>9} {self._sched.now % 10_000_000:>8}ms {text}")


@dataclasses.dataclass
class World:
    sched: Scheduler
    net: Network
    broker: Broker
    group: GroupCoordinator
    timing: Timing
    audit: Audit
    trace: Trace
    shards: int
    check_w2: bool = True  # False: the teeth test's leaders commit without comparing offsets
    # True (the server's behaviour: gRPC deadlines are relative, so a request delayed in transit
    # past its client's deadline still runs): a node runs it. This found that a failed
    # compare-and-set left no trace under its request id (kvstore.core.evaluate now records it).
    # False: a node drops a request that arrives after its client gave up.
    late_requests: bool = True
    mutations: frozenset[Mutation] = frozenset()  # the replica machine's broken variants (teeth)
    # Placement: each shard on this many nodes (None: every node holds every shard, no placement).
    replication_factor: int | None = None
    skip_caught_up: bool = False  # the placement mutation: a node judges a copy caught up once it is open
    # Placement's broken variants (tests.sim.harness.PLACEMENT_MUTATIONS): the core machines' own
    # (kvstore.core.placement_controller.MUTATIONS, placement_follower.DROP_REOPENED_COPY) and the
    # controller shell's (tests.sim.controller.UNFENCED_CONTROLLER).
    placement_mutations: frozenset[str] = frozenset()
    # The group whose one "partition" is the controller's role (None: no placement).
    controller_group: GroupCoordinator | None = None
    # Nodes whose listings of the membership group fail, until when (sim ms): the faults' stale view.
    listing_fails: dict[str, int] = dataclasses.field(default_factory=dict)
    # Per shard, the snapshots taken (cut, state), oldest first: what `kvstore snapshot create`
    # leaves in a node's --snapshot-dir, built from the WAL, never from a replica.
    snapshots: dict[int, list[tuple[int, MemoryShard]]] = dataclasses.field(default_factory=dict)
    # Every replica machine's trace (`tests.sim.replica.ReplicaTrace`), when a test asks for them
    # (a list); None: not recorded (the cost of printing every step's actions).
    replica_traces: list[Any] | None = None
    txn_mutations: frozenset[TxnMutation] = frozenset()  # the transaction protocol's broken variants (teeth)
    peers: dict[str, Any] = dataclasses.field(default_factory=dict)  # every node by name (peer calls)
    _ids: int = 0

    def next_id(self) -> int:
        """A number unique in this run (producer instances, request sequences, attempts)."""
        self._ids += 1
        return self._ids

    @property
    def placement_partition(self) -> int:
        """The placement log's partition in the simulated Kafka: the one after the shards'."""
        return self.shards

    def new_disk(self) -> MemoryShard:
        """An empty replica of one shard: what a node keeps across crashes (its LevelDB)."""
        return MemoryShard(self.timing.request_ids, self.timing.request_horizon_ms)

    def violation(self, text: str) -> None:
        self.audit.violations.append(text)
        self.trace.log(f"VIOLATION {text}")


def spread_keys(prefix: str, count: int, shards: int) -> list[bytes]:
    """`count` keys `<prefix><i>`, and more if needed so that every shard holds one."""
    keys = [f"{prefix}{i}".encode() for i in range(count)]
    index = count
    while len({shard_of(k, shards) for k in keys}) < shards:
        key = f"{prefix}{index}".encode()
        if shard_of(key, shards) not in {shard_of(k, shards) for k in keys}:
            keys.append(key)
        index += 1
    return keys
