"""The replica machine's bounds, its deliberate breakages, and what it reads of the store.

Kept apart from the machine so that a driver builds a machine from settings (`ReplicaConfig`,
in the node's and the simulation's units) without reading how it decides, and so that every
part of the machine (`batching`, `barrier`, `catchup`) takes its bounds from one place.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

from kvstore import limits as store_limits
from kvstore.core.batch import BatchLimits
from kvstore.core.locks import LockView
from kvstore.core.state import KeyState
from kvstore.core.txn import TxnTables


class Mutation(enum.Enum):
    """A deliberately broken variant of the protocol (tests/sim's teeth): never set in a node."""

    SKIP_READ_BARRIER = "skip-read-barrier"  # serve linearizable reads without asking the log's end
    SKIP_MARKER_REWIND = "skip-marker-rewind"  # never re-read the slot a leader assumed its marker took
    SKIP_REQUEST_DEDUPE = "skip-request-dedupe"  # admit every attempt as new (no replay, no "in progress")
    ANSWER_BEFORE_COMMIT = "answer-before-commit"  # answer a batch's writers when it is appended, not committed
    SKIP_READ_LOCK_WAIT = "skip-read-lock-wait"  # serve a read of a key a prepared transaction locked at once


@dataclasses.dataclass(frozen=True)
class ReplicaConfig:
    """The machine's bounds, in milliseconds and counts (the drivers take them from settings)."""

    shard: int
    standby: bool = True  # follow the shard while not leading (a takeover then replays a short tail)
    batch_limits: BatchLimits = dataclasses.field(default_factory=lambda: BatchLimits(
        store_limits.MAX_BATCH_RECORDS, store_limits.MAX_BATCH_BYTES, store_limits.MAX_WAL_RECORD_BYTES))
    max_pending: int = 10_000  # queued writes (carried ones not counted): beyond, OverloadedError
    linger_ms: float = 2.0  # a lone write waits this long for company before its batch starts
    # A lone `patient` write (a resolve, a forget) waits this long instead, unless a write is parked
    # or a linearizable read is in flight (they may wait on its lock): see `batching.GroupCommit`.
    patient_linger_ms: float = 10.0
    bootstrap_timeout_ms: float = 120_000  # catching up to the fenced end takes longer: give the shard up
    barrier_timeout_ms: float = 10_000  # a read waits this long for the replica to apply the end it read
    # A write meeting a key locked by a prepared cross-shard transaction waits this long (retried
    # after every apply) before it is refused with TxnConflictError (docs/design.md §10). Waits
    # are bounded, so no deadlock between transactions outlives this; 0: refuse at once.
    lock_wait_ms: float = 500
    # A linearizable read of a key a prepared cross-shard transaction locked exclusively waits
    # (T4) for an apply that releases it, at most `read_lock_wait_ms` (then UNAVAILABLE); after
    # `read_kick_ms` it asks for the holders to be resolved at once (`ResolveNow`).
    read_lock_wait_ms: float = 3_000
    read_kick_ms: float = 500
    refence_pause_ms: float = 1_000  # fenced while still assigned the shard: pause, then fence back
    beyond_end_grace_ms: float = 45_000  # a checkpoint beyond the end must last this long to be believed
    beyond_end_poll_ms: float = 500  # how often the end is read again meanwhile
    backoff_first_ms: float = 200  # after a failed step (a fetch, a fence, ...): retry after this,
    backoff_max_ms: float = 5_000  # doubling up to this
    request_horizon_ms: int | None = None  # None: kvstore.limits' (the simulation shrinks it)
    clock_skew_ms: int | None = None
    mutations: frozenset[Mutation] = frozenset()

    def __post_init__(self) -> None:
        assert self.shard >= 0 and self.max_pending > 0 and self.linger_ms >= 0 and self.lock_wait_ms >= 0, self
        assert self.patient_linger_ms >= self.linger_ms, self
        assert 0 < self.backoff_first_ms <= self.backoff_max_ms, self
        assert self.beyond_end_poll_ms > 0 and self.beyond_end_grace_ms >= 0, self


class StateView(TxnTables, Protocol):
    """What the machine reads of the replica's committed state: the store (LevelDB in a node,
    `MemoryShard` in the simulation), its keys, request ids and decisions (a transaction's
    records are built against them, `kvstore.core.replica.writes.write_for`). `applied_offset` is the
    checkpoint: every record below it applied, none above."""

    @property
    def applied_offset(self) -> int: ...

    def get(self, key: bytes) -> KeyState | None: ...

    @property
    def locks(self) -> LockView:
        """The prepared cross-shard transactions and their locks (docs/design.md §10)."""
        ...
