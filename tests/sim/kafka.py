"""A model of the Kafka broker the WAL relies on: one partition per shard, one transaction
coordinator per transactional id, with the transactional semantics the guard depends on.

Why a model and not the real broker: the simulation must replay exactly from a seed and run a
million steps in minutes. So this is the smallest broker that still has every behaviour the
protocol reasons about (docs/design.md §4), and nothing else:

* **Producer ids and epochs.** `init_producer_id` on a transactional id keeps its producer id,
  bumps its epoch, and first settles the transaction the previous holder left: an ongoing one is
  aborted (its abort marker takes an offset), one whose EndTxn was accepted gets its markers
  written. Older epochs are refused as fenced from then on (W4).
* **Transactions on the partition.** Records of an open transaction take offsets at once (the
  high watermark moves) but stay invisible to read_committed; commit and abort markers take one
  offset each, written a little *after* EndTxn was answered (as Kafka does), so the last stable
  offset (LSO) lags the high watermark (HW) while a transaction is open or being completed.
  Aborted records stay in the log, invisible to read_committed.
* **Idempotent produce.** A produce request carries (producer id, epoch, sequence); the broker
  answers a duplicate (network duplication, a retry) with the original offsets and appends
  nothing, as it does for idempotent producers.
* **Transaction timeout.** An ongoing transaction older than `txn_timeout_ms` is aborted by the
  coordinator with an epoch bump, so its stalled producer is fenced when it wakes up.
* **KIP-890** (Kafka 4, `KafkaVariant.kip890`): the coordinator bumps the epoch at the end of
  every transaction and hands the new one back in the EndTxn answer, so a late EndTxn or produce
  of an earlier transaction is refused as fenced instead of landing on a later transaction of the
  same producer; a retry of the EndTxn that ended the previous transaction is still answered with
  success. The partition also verifies that a produce belongs to an ongoing transaction (part 1).
  Without KIP-890 a late EndTxn ends whatever transaction the producer has open (the
  torn-transaction and lost-write cases of the public analyses), and a late produce silently
  opens a transaction of its own.

`KafkaVariant(fencing=False)` is the deliberately broken broker of the teeth test: epochs are
neither bumped nor checked, so `init_transactions` fences nobody (it still aborts the open
transaction, as a plain InitProducerId would).

Simplifications, each harmless for what is checked: one partition per transactional id (the
shard's own), so AddPartitionsToTxn travels with the first produce of a transaction; markers are
written by the coordinator directly; a produce request is one record batch; no log truncation,
no replication, no broker restarts (a broker bounce looks like late answers and refusals here).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from tests.sim.scheduler import Scheduler
from wal.record import Headers

TICK_MS = 50  # how often the coordinator looks for transactions past their timeout


class TxnPhase(enum.Enum):
    EMPTY = "empty"
    ONGOING = "ongoing"
    PREPARE_COMMIT = "prepare_commit"  # EndTxn(commit) accepted and answered; markers not written yet
    PREPARE_ABORT = "prepare_abort"
    COMPLETE_COMMIT = "complete_commit"
    COMPLETE_ABORT = "complete_abort"


_PREPARING = (TxnPhase.PREPARE_COMMIT, TxnPhase.PREPARE_ABORT)
_ENDED = (TxnPhase.PREPARE_COMMIT, TxnPhase.PREPARE_ABORT, TxnPhase.COMPLETE_COMMIT, TxnPhase.COMPLETE_ABORT)


@dataclasses.dataclass(frozen=True)
class KafkaVariant:
    """Which broker the run has. The default is Kafka 4 with its transaction protocol v2."""

    fencing: bool = True  # init_transactions bumps the epoch; older epochs are refused (W4)
    kip890: bool = True  # an epoch bump per transaction; produce verified against the coordinator


@dataclasses.dataclass(frozen=True)
class BrokerError:
    """An error answer, with the flags librdkafka would put on it (`wal.errors.classify` reads them)."""

    name: str
    fatal: bool = False
    retriable: bool = False
    abortable: bool = False


PRODUCER_FENCED = BrokerError("PRODUCER_FENCED", fatal=True)
INVALID_TXN_STATE = BrokerError("INVALID_TXN_STATE", fatal=True)
TRANSACTION_ABORTABLE = BrokerError("TRANSACTION_ABORTABLE", abortable=True)
NOT_COORDINATOR = BrokerError("NOT_COORDINATOR", retriable=True)
NOT_ENOUGH_REPLICAS = BrokerError("NOT_ENOUGH_REPLICAS", retriable=True)


@dataclasses.dataclass(slots=True)
class Entry:
    """One offset of a partition: a data record or a control marker."""

    offset: int
    pid: int  # -1: a non-transactional producer (a foreign writer)
    epoch: int
    value: bytes | None
    headers: Headers | None
    control: bool = False  # a commit or abort marker
    committed: bool | None = None  # data: None while its transaction is open, then its outcome


@dataclasses.dataclass(frozen=True)
class FetchResult:
    """A read_committed fetch: the visible records from the position, and where to continue
    (past markers and aborted records, up to the bound the fetch could see)."""

    records: tuple[tuple[int, bytes | None, Headers | None], ...]
    next_position: int
    # The position lies below the log start (truncated): nothing is read (auto.offset.reset=error).
    below_log_start: int | None = None


class Partition:
    def __init__(self, index: int) -> None:
        self.index = index
        self.log: list[Entry] = []
        self.open: dict[int, list[Entry]] = {}  # producer id -> records of its open transaction here
        self.seen: dict[tuple[int, int, int], tuple[int, ...]] = {}  # (pid, epoch, seq) -> offsets
        # Records below this were deleted (`wal truncate`): unreadable, though the checker still
        # sees them in `log` (the truth of what was written).
        self.log_start = 0

    @property
    def high_watermark(self) -> int:
        return len(self.log)

    @property
    def last_stable_offset(self) -> int:
        if not self.open:
            return len(self.log)
        return min(records[0].offset for records in self.open.values())

    def append(self, pid: int, epoch: int, records: tuple[tuple[bytes, Headers], ...], *,
               transactional: bool) -> tuple[int, ...]:
        offsets = []
        for value, headers in records:
            entry = Entry(len(self.log), pid, epoch, value, headers, committed=None if transactional else True)
            self.log.append(entry)
            offsets.append(entry.offset)
            if transactional:
                self.open.setdefault(pid, []).append(entry)
        return tuple(offsets)

    def write_marker(self, pid: int, epoch: int, commit: bool) -> int:
        for entry in self.open.pop(pid, []):
            entry.committed = commit
        marker = Entry(len(self.log), pid, epoch, None, None, control=True, committed=commit)
        self.log.append(marker)
        return marker.offset

    def read_committed(self, position: int, bound: int, limit: int) -> FetchResult:
        records: list[tuple[int, bytes | None, Headers | None]] = []
        next_position = max(position, bound)
        log = self.log
        for offset in range(position, bound):
            entry = log[offset]
            if entry.committed and not entry.control:
                records.append((offset, entry.value, entry.headers))
                if len(records) == limit:
                    next_position = offset + 1
                    break
        return FetchResult(tuple(records), next_position)


@dataclasses.dataclass
class Transactional:
    """The coordinator's state of one transactional id."""

    txn_id: str
    shard: int
    pid: int
    epoch: int = 0
    phase: TxnPhase = TxnPhase.EMPTY
    added: bool = False  # the shard's partition joined the current transaction
    started_ms: int = 0
    last_commit: bool | None = None  # outcome of the last transaction ended
    last_epoch: int = -1  # the epoch it ran under
    completion: int = 0  # token of the scheduled marker write


@dataclasses.dataclass(frozen=True)
class ProduceRequest:
    txn_id: str
    shard: int
    pid: int
    epoch: int
    seq: int  # unique per request of a producer instance (duplicates carry the same)
    first_in_txn: bool  # carries AddPartitionsToTxn: the first produce of a transaction
    records: tuple[tuple[bytes, Headers], ...]


@dataclasses.dataclass(eq=False)
class _Parked:
    position: int
    upto: int | None
    limit: int
    reply: Callable[[FetchResult], None]


@dataclasses.dataclass
class BrokerStats:
    duplicate_produces: int = 0
    fenced: int = 0
    late_end_txn_refused: int = 0
    txn_timeouts: int = 0
    refusals: int = 0
    init_aborts: int = 0


class Broker:
    """The cluster's Kafka, as one process that never fails (its failures are modelled as late
    answers and refused requests). Requests are handled when the network delivers them."""

    def __init__(self, sched: Scheduler, partitions: int, variant: KafkaVariant, *, txn_timeout_ms: int,
                 marker_delay_ms: tuple[int, int] = (1, 8)) -> None:
        self.sched = sched
        self.variant = variant
        self.partitions = [Partition(i) for i in range(partitions)]
        self.txns: dict[str, Transactional] = {}
        self.txn_timeout_ms = txn_timeout_ms
        self.marker_delay_ms = marker_delay_ms
        self.refuse_rate = 0.0  # fault knob: requests refused with a retriable error, without effect
        self.stats = BrokerStats()
        self._next_pid = 1000
        self._parked: list[list[_Parked]] = [[] for _ in range(partitions)]
        sched.at(TICK_MS, self._tick)

    # ---- the transaction coordinator -----------------------------------------------------------

    def init_producer_id(self, txn_id: str, shard: int) -> tuple[int, int] | BrokerError:
        """InitProducerId: settle what the previous holder left, bump the epoch (fence it)."""
        if self._refused():
            return NOT_COORDINATOR
        txn = self.txns.get(txn_id)
        if txn is None:
            txn = self.txns[txn_id] = Transactional(txn_id, shard, self._next_pid)
            self._next_pid += 1
        else:
            self._flush(txn)  # CONCURRENT_TRANSACTIONS until the markers are written: modelled as done
            if txn.phase is TxnPhase.ONGOING:
                self.stats.init_aborts += 1
                self._end(txn, commit=False)
                self._flush(txn)
            if self.variant.fencing:
                txn.epoch += 1
        return txn.pid, txn.epoch

    def end_txn(self, txn_id: str, pid: int, epoch: int, commit: bool) -> int | BrokerError:
        """EndTxn: returns the producer's epoch from now on (bumped under KIP-890)."""
        if self._refused():
            return NOT_COORDINATOR
        txn = self.txns[txn_id]
        assert txn.pid == pid, f"EndTxn of producer {pid} on {txn_id} (producer {txn.pid})"
        if self.variant.fencing and epoch < txn.epoch:
            if (self.variant.kip890 and txn.phase in _ENDED and txn.last_epoch == epoch
                    and txn.epoch == epoch + 1 and txn.last_commit == commit):
                return txn.epoch  # a retry of the EndTxn that ended the last transaction
            self.stats.fenced += 1
            if self.variant.kip890:
                self.stats.late_end_txn_refused += 1
            return PRODUCER_FENCED
        if txn.phase is TxnPhase.ONGOING:
            self._end(txn, commit)
            return txn.epoch
        if txn.phase in _ENDED and txn.last_commit == commit and not (self.variant.kip890 and self.variant.fencing):
            return txn.epoch  # protocol v1: looks like a retry of the EndTxn that ended it
        return INVALID_TXN_STATE

    def _end(self, txn: Transactional, commit: bool) -> None:
        txn.last_commit = commit
        txn.last_epoch = txn.epoch
        if self.variant.fencing and self.variant.kip890:
            txn.epoch += 1
        txn.phase = TxnPhase.PREPARE_COMMIT if commit else TxnPhase.PREPARE_ABORT
        txn.completion += 1
        token = txn.completion
        self.sched.at(self.sched.between(*self.marker_delay_ms), lambda: self._complete(txn, token))

    def _complete(self, txn: Transactional, token: int) -> None:
        if txn.completion != token or txn.phase not in _PREPARING:
            return
        commit = txn.phase is TxnPhase.PREPARE_COMMIT
        if txn.added:
            part = self.partitions[txn.shard]
            part.write_marker(txn.pid, txn.last_epoch, commit)
            self._wake(part)
        txn.added = False
        txn.phase = TxnPhase.COMPLETE_COMMIT if commit else TxnPhase.COMPLETE_ABORT

    def _flush(self, txn: Transactional) -> None:
        if txn.phase in _PREPARING:
            self._complete(txn, txn.completion)

    def _tick(self) -> None:
        now = self.sched.now
        for txn in self.txns.values():
            if txn.phase is TxnPhase.ONGOING and now - txn.started_ms > self.txn_timeout_ms:
                self.stats.txn_timeouts += 1
                bumped = self.variant.fencing and self.variant.kip890
                self._end(txn, commit=False)
                if self.variant.fencing and not bumped:
                    txn.epoch += 1  # the coordinator fences the stalled producer
        self.sched.at(TICK_MS, self._tick)

    # ---- the partition leader --------------------------------------------------------------------

    def produce(self, req: ProduceRequest) -> tuple[int, ...] | BrokerError:
        part = self.partitions[req.shard]
        txn = self.txns[req.txn_id]
        assert txn.pid == req.pid
        done = part.seen.get((req.pid, req.epoch, req.seq))
        if done is not None:
            self.stats.duplicate_produces += 1
            return done
        if self._refused():
            return NOT_ENOUGH_REPLICAS
        if self.variant.fencing and req.epoch < txn.epoch:
            self.stats.fenced += 1
            return PRODUCER_FENCED
        self._flush(txn)
        if txn.phase is not TxnPhase.ONGOING:
            if not req.first_in_txn and self.variant.kip890 and self.variant.fencing:
                return TRANSACTION_ABORTABLE  # KIP-890 part 1: not part of an ongoing transaction
            # AddPartitionsToTxn (or, without KIP-890, a late produce opening a transaction of its own)
            txn.phase = TxnPhase.ONGOING
            txn.started_ms = self.sched.now
        txn.added = True
        offsets = part.append(req.pid, req.epoch, req.records, transactional=True)
        part.seen[(req.pid, req.epoch, req.seq)] = offsets
        return offsets

    def produce_foreign(self, shard: int, value: bytes, headers: Headers) -> int:
        """A writer outside the protocol (no transactional id of the shard's): what W3 is for."""
        part = self.partitions[shard]
        (offset,) = part.append(-1, 0, ((value, headers),), transactional=False)
        self._wake(part)
        return offset

    def truncate(self, shard: int, below: int) -> None:
        """Delete the records below `below` (DeleteRecords): readers below it are out of range."""
        part = self.partitions[shard]
        assert below <= part.last_stable_offset, f"truncating at {below}, above the LSO {part.last_stable_offset}"
        part.log_start = max(part.log_start, below)

    def ends(self, shard: int) -> tuple[int, int]:
        """(last stable offset, high watermark) of a shard's partition."""
        part = self.partitions[shard]
        return part.last_stable_offset, part.high_watermark

    def fetch(self, shard: int, position: int, upto: int | None, limit: int, max_wait_ms: int,
              reply: Callable[[FetchResult], None]) -> None:
        """A read_committed fetch from `position`, never beyond `upto`. With nothing to read it
        waits (long poll) until the LSO moves or `max_wait_ms` passed."""
        part = self.partitions[shard]
        if position < part.log_start:
            reply(FetchResult((), position, below_log_start=part.log_start))
            return
        bound = part.last_stable_offset if upto is None else min(part.last_stable_offset, upto)
        if position < bound or max_wait_ms <= 0:
            reply(part.read_committed(position, bound, limit))
            return
        parked = _Parked(position, upto, limit, reply)
        self._parked[shard].append(parked)

        def expire() -> None:
            waiting = self._parked[shard]
            if any(p is parked for p in waiting):
                self._parked[shard] = [p for p in waiting if p is not parked]
                reply(FetchResult((), position))

        self.sched.at(max_wait_ms, expire)

    def _wake(self, part: Partition) -> None:
        waiting = self._parked[part.index]
        if not waiting:
            return
        lso = part.last_stable_offset
        keep: list[_Parked] = []
        for parked in waiting:
            bound = lso if parked.upto is None else min(lso, parked.upto)
            if parked.position < bound:
                parked.reply(part.read_committed(parked.position, bound, parked.limit))
            else:
                keep.append(parked)
        self._parked[part.index] = keep

    def _refused(self) -> bool:
        if self.refuse_rate and self.sched.chance(self.refuse_rate):
            self.stats.refusals += 1
            return True
        return False
