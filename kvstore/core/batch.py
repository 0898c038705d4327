"""Group-commit planning for one shard leader: writes in, a batch and its answers out; pure.

The leader queues writes while a batch is in flight and turns the queue into the next batch
here (docs/design.md §5, group commit). Everything that decides what a write gets lives in this
module, so the asyncio replica (`kvstore.server.replica`) and the deterministic simulation
(tests/sim) share it:

* **admission** (`admit`): a write whose request id committed before is answered with the
  recorded answer (a replay, marked so); one that may be a forgotten id is refused as expired
  (`kvstore.core.request_horizon`); one whose earlier attempt is still queued or committing is
  "unknown for now" (W7: it must not end in a definite refusal while that attempt may commit);
* **dedupe inside a batch**: a second attempt of the same id in one batch shares the first's
  answer and adds no record;
* **evaluation over an overlay**: each write is evaluated against the committed state plus the
  writes planned before it in this batch, at the offset its record will land at (W1). The overlay
  advances with `kvstore.core.state.next_key_state`, the state machine's own transition (the one
  `apply_effects` and `apply_entries` chain), so the plan can never disagree with what apply will
  do. It advances lazily: an entry's effects are kept per key and folded into a key's state only
  when a later write of the batch reads that key, so a WriteBatch part of thousands of keys costs
  no state lookups at all unless something after it in the batch touches them;
* **sizing** by WAL-entry bytes and records (the writer's limits, `BatchLimits`): a write that
  does not fit goes first into the next batch (`Plan.carry`), evaluated again there; one entry
  above the record limit alone is refused with the limit named.

Answers fall in two groups: `Plan.now` (refusals and replays: independent of the append, given
at once) and `Plan.after_commit` (given only once the batch committed, W5, or, for a batch with
no records, once a read barrier passed). No clock is read here: the caller passes `now_unix_ms`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container, Sequence
from typing import Any, Protocol

from kvstore import errors, limits
from kvstore.core import request_horizon
from kvstore.core.evaluate import (
    Evaluation,
    Response,
    evaluate_delete,
    evaluate_mutations,
    evaluate_put,
    evaluate_txn,
)
from kvstore.core.locks import NO_LOCKS, BatchLocks, LockView, conflict
from kvstore.core.state import KeyState, Lookup, RequestRecord, effect_key, next_key_state
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.v1 import kv_pb2
from wal.offsets import batch_end

Build = Callable[[Lookup, int], Evaluation]


@dataclasses.dataclass(frozen=True, slots=True)
class Horizon:
    """The request-id horizon as the planner judges it for this batch (`admit`): what a
    transaction's decision needs to tell whether the client's request id may still be recorded
    as its outcome, or may be one the table has forgotten."""

    now_unix_ms: int
    evicted_through_ms: int
    horizon_ms: int = limits.REQUEST_ID_HORIZON_MS
    skew_ms: int = limits.MAX_CLOCK_SKEW_MS
    # Request ids the batch's earlier records record (their own, and a decision's client id,
    # `Evaluation.outcome`): a later write of the same batch must see them as if committed, as it
    # sees their keys (a Put reusing a cross-shard Txn's id, or the other way round, is refused).
    outcomes: dict[str, RequestRecord] = dataclasses.field(default_factory=dict)

    def request(self, table: RequestTable, request_id: str) -> RequestRecord | None:
        """`request_id` as the batch so far and the committed table know it."""
        recorded = self.outcomes.get(request_id)
        return recorded if recorded is not None else table.request(request_id)

    def expired(self, first_attempt_unix_ms: int) -> str | None:
        """Why a request first attempted then may have been forgotten (`request_horizon.expired`);
        an unknown first attempt (0) is taken as expired: nothing can be ruled out."""
        if first_attempt_unix_ms <= 0:
            return "the request's first attempt is not known"
        return request_horizon.expired(first_attempt_unix_ms, self.now_unix_ms, self.evicted_through_ms,
                                       self.horizon_ms, self.skew_ms)


# A cross-shard transaction's record is built against the locks and the horizon too (kvstore.core.txn).
LockedBuild = Callable[[Lookup, "LockView", int, Horizon], Evaluation]


class RequestTable(Protocol):
    """The committed request-id window of a shard (LevelDB in a node, a dict in the simulation)."""

    def request(self, request_id: str) -> RequestRecord | None: ...

    @property
    def evicted_through_ms(self) -> int: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Write:
    """One queued write as the planner sees it. `request_id` "" = no dedupe (a leader's probe)."""

    request_id: str
    build: Build
    response_type: type[Any]  # the response message of the request's kind: decodes a replayed answer
    first_attempt_unix_ms: int = 0
    kind: int = wal_entry_pb2.REQUEST_KIND_UNSPECIFIED  # WalEntry.request_kind: stamped into its entry
    locked_build: LockedBuild | None = None  # instead of `build`: a transaction's prepare or resolve
    # False: admission never refuses it as expired (`kvstore.core.request_horizon`): an abort
    # decision, which may be recorded whenever no decision is (its build judges the client's id).
    check_horizon: bool = True
    # A resolve or a forget: no client waits on its answer, so its batch lingers longer for
    # company (`ReplicaConfig.patient_linger_ms`).
    patient: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class BatchLimits:
    """The WAL writer's limits a batch must respect (`wal.WriterConfig`)."""

    max_records: int
    max_bytes: int
    max_record_bytes: int

    def __post_init__(self) -> None:
        assert self.max_records > 0 and self.max_bytes > 0 and self.max_record_bytes > 0, self


Answer = Response | errors.StoreError


@dataclasses.dataclass
class Plan:
    """What to append and what to answer. Indices refer to the `writes` given to `plan_batch`;
    every index appears exactly once in `now`, `after_commit` or `carry`."""

    revision: int  # the expected offset of the first record (W1)
    payloads: list[bytes] = dataclasses.field(default_factory=list)
    now: list[tuple[int, Answer]] = dataclasses.field(default_factory=list)
    after_commit: list[tuple[int, Response]] = dataclasses.field(default_factory=list)
    carry: list[int] = dataclasses.field(default_factory=list)
    payload_bytes: int = 0

    @property
    def upcoming_if_committed(self) -> int:
        """The partition's upcoming offset once this batch committed: records + the marker (W1)."""
        assert self.payloads, "a batch without records appends nothing"
        return batch_end(self.revision, len(self.payloads))


ClientWrite = kv_pb2.PutRequest | kv_pb2.DeleteRequest | kv_pb2.TxnRequest | kv_pb2.ShardMutations


def write_of(request: ClientWrite, shard: int) -> Write:
    """A client's write (already validated) as the planner takes it: evaluated at plan time
    against the state plus the batch before it (`kvstore.core.evaluate`)."""
    if isinstance(request, kv_pb2.PutRequest):
        put = request
        return Write(put.request_id, lambda lookup, rev: evaluate_put(put, lookup, shard, rev), kv_pb2.PutResponse,
                     put.first_attempt_unix_ms, wal_entry_pb2.REQUEST_KIND_PUT)
    if isinstance(request, kv_pb2.DeleteRequest):
        delete = request
        return Write(delete.request_id, lambda lookup, rev: evaluate_delete(delete, lookup, shard, rev),
                     kv_pb2.DeleteResponse, delete.first_attempt_unix_ms, wal_entry_pb2.REQUEST_KIND_DELETE)
    if isinstance(request, kv_pb2.ShardMutations):
        part = request
        return Write(part.request_id, lambda _lookup, rev: evaluate_mutations(part, shard, rev),
                     kv_pb2.ShardMutationsResult, part.first_attempt_unix_ms,
                     wal_entry_pb2.REQUEST_KIND_WRITE_BATCH_PART)
    txn = request
    return Write(txn.request_id, lambda lookup, rev: evaluate_txn(txn, lookup, shard, rev), kv_pb2.TxnResponse,
                 txn.first_attempt_unix_ms, wal_entry_pb2.REQUEST_KIND_TXN)


def probe_write() -> Write:
    """The leader's probe: an empty entry at its upcoming offset, no request id. Appended when a
    read barrier saw the log beyond this leader's writes: if the log moved, W2 aborts it and the
    leader learns the log again; if the leader was fenced, it steps down."""
    return Write("", lambda lookup, revision: Evaluation(wal_entry_pb2.WalEntry(), kv_pb2.PutResponse()),
                 kv_pb2.PutResponse)


# A cross-shard transaction's records (kvstore.core.txn): their answers are internal messages,
# replayed as recorded (their ids are derived from txn ids, never reused by another kind).
TXN_RECORD_KINDS = frozenset({wal_entry_pb2.REQUEST_KIND_TXN_PREPARE, wal_entry_pb2.REQUEST_KIND_TXN_DECISION,
                              wal_entry_pb2.REQUEST_KIND_TXN_RESOLVE})

_KIND_NAMES: dict[int, str] = {wal_entry_pb2.REQUEST_KIND_PUT: "a Put", wal_entry_pb2.REQUEST_KIND_DELETE: "a Delete",
                               wal_entry_pb2.REQUEST_KIND_TXN: "a Txn",
                               wal_entry_pb2.REQUEST_KIND_TXN_ABORTED: "a cross-shard Txn (aborted)",
                               wal_entry_pb2.REQUEST_KIND_WRITE_BATCH_PART: "a WriteBatch part"}


def replayed(write: Write, earlier: RequestRecord) -> Response | errors.StoreError:
    """The original answer to a request id seen before, marked as a replay; a refusal when it
    answered another kind of request: the id was used before by another request, which did
    commit, and this one is not applied (a Delete retried with a Put's id must not get the Put's
    answer, whose bytes parse as a DeleteResponse just as well).

    The kind recorded with the id decides (WalEntry.request_kind). An id recorded before kinds
    were (0) falls back to the answer's shape: every recorded answer carries a `result`, and a
    WriteBatch part's answer and the others' do not parse into one another's; Put, Delete and
    Txn answers cannot be told apart that way."""
    response_type = write.response_type
    if write.kind in TXN_RECORD_KINDS and earlier.kind == write.kind:
        answer: Response = response_type.FromString(earlier.response)
        return answer
    if earlier.kind and write.kind and earlier.kind != write.kind:
        return errors.InvalidRequestError(
            f"this request id was already used by {_KIND_NAMES.get(earlier.kind, 'another request')}, which "
            f"committed at revision {earlier.revision}; this is {_KIND_NAMES.get(write.kind, 'another kind')}, "
            "and was not applied: give every request its own id", field="request_id")
    response = response_type.FromString(earlier.response)
    if not response.HasField("result"):
        return errors.InvalidRequestError(
            "this request id was already used by another kind of request, which committed (its recorded "
            f"answer is not a {response_type.__name__}); give every request its own id", field="request_id")
    response.result.replayed = True
    assert isinstance(response, (kv_pb2.PutResponse, kv_pb2.DeleteResponse, kv_pb2.TxnResponse,
                                 kv_pb2.ShardMutationsResult)), response_type
    return response


def admit(write: Write, table: RequestTable, in_progress: Container[str], now_unix_ms: int, *,
          horizon_ms: int = limits.REQUEST_ID_HORIZON_MS, skew_ms: int = limits.MAX_CLOCK_SKEW_MS) -> Answer | None:
    """What a write gets before it is queued: None to queue it, else its answer now.

    A replay of a committed id (its recorded answer), a refusal of an id that may have been
    forgotten (`RequestExpiredError`, definite for this attempt), or `UnknownOutcomeError` when an
    earlier attempt with this id is queued or committing here (`in_progress`): this attempt
    must not end in a definite refusal (leadership lost, node stopping) while that one may
    commit; a retry later finds the id in the table or free again."""
    if not write.request_id:
        return None
    earlier = table.request(write.request_id)
    if earlier is not None:
        return replayed(write, earlier)
    why = request_horizon.expired(write.first_attempt_unix_ms, now_unix_ms, table.evicted_through_ms, horizon_ms,
                                  skew_ms) if write.check_horizon else None
    if why is not None:
        return errors.RequestExpiredError(why)
    if write.request_id in in_progress:
        return errors.UnknownOutcomeError("an earlier attempt with this request id is in progress; "
                                          "retry with the same request id")
    return None


def plan_batch(writes: Sequence[Write], revision: int, lookup: Lookup, table: RequestTable, now_unix_ms: int,
               batch_limits: BatchLimits, *, horizon_ms: int = limits.REQUEST_ID_HORIZON_MS,
               skew_ms: int = limits.MAX_CLOCK_SKEW_MS, locks: LockView = NO_LOCKS) -> Plan:
    """Plan the batch that starts at `revision` (the leader's upcoming offset) from `writes`, in
    order. `lookup` reads the committed state; `table` the committed request ids; `locks` the
    prepared cross-shard transactions (docs/design.md §10): a write touching a locked key is
    answered with the conflict (`kvstore.core.locks.conflict`; the replica machine parks it and
    tries again after the next apply, bounded), and the batch's own prepares and resolves lock
    and release for the writes after them.

    Stamps each entry with `now_unix_ms` as its leader time (the clock by which every replica
    forgets request ids at the same entry, `kvstore.storage.shard_store`)."""
    plan = Plan(revision=revision)
    overlay: dict[bytes, KeyState | None] = {}  # keys written earlier in the batch, folded
    # Per key, the effects not folded yet, in batch order: (the entry's effects, index, revision).
    deferred: dict[bytes, list[tuple[Any, int, int]]] = {}

    def current(key: bytes) -> KeyState | None:
        pending = deferred.pop(key, None)
        if pending is not None:
            state = overlay[key] if key in overlay else lookup(key)
            for effects, index, at in pending:
                state = next_key_state(state, effects[index], at)
            overlay[key] = state
            return state
        return overlay[key] if key in overlay else lookup(key)

    in_batch: dict[str, Response] = {}  # first answer of each id planned in this batch
    batch_locks = BatchLocks(locks)
    horizon = Horizon(now_unix_ms, table.evicted_through_ms, horizon_ms, skew_ms)
    for index, write in enumerate(writes):
        rid = write.request_id
        if rid and rid in in_batch:
            plan.after_commit.append((index, in_batch[rid]))  # its first attempt's record, once
            continue
        refusal = admit(write, _BatchTable(table, horizon), (), now_unix_ms, horizon_ms=horizon_ms, skew_ms=skew_ms)
        if refusal is not None:
            plan.now.append((index, refusal))
            continue
        record_revision = revision + len(plan.payloads)
        try:
            if write.locked_build is not None:
                evaluation = write.locked_build(current, batch_locks, record_revision, horizon)
            else:
                evaluation = write.build(current, record_revision)
        except ValueError as exc:  # a condition the validator could not see (e.g. an unknown compare op)
            plan.now.append((index, errors.InvalidRequestError(str(exc))))
            continue
        except errors.StoreError as refused:  # e.g. a Txn answer above MAX_RESPONSE_BYTES: nothing queued
            assert refused.definite, f"a build may only refuse definitely: {refused!r}"
            plan.now.append((index, refused))
            continue
        if batch_locks.has_locks():
            held = _locked(evaluation, rid, batch_locks)
            if held is not None:
                plan.now.append((index, held))
                continue
        if evaluation.entry is not None:
            evaluation.entry.leader_unix_ms = now_unix_ms
            if rid:
                evaluation.entry.request_kind = write.kind  # type: ignore[assignment]
            payload = evaluation.entry.SerializeToString()
            if len(payload) > batch_limits.max_record_bytes:
                # e.g. a Txn whose answer (stored with it for retries) carries large gets
                plan.now.append((index, errors.InvalidRequestError(
                    f"WAL record of {len(payload)} bytes exceeds the record limit {batch_limits.max_record_bytes}; "
                    "split the Txn", limit="max_record_bytes")))
                continue
            if plan.payloads and (plan.payload_bytes + len(payload) > batch_limits.max_bytes
                                  or len(plan.payloads) >= batch_limits.max_records):
                plan.carry.extend(range(index, len(writes)))  # in order, first into the next batch
                break
            effects = evaluation.entry.effects
            keys = evaluation.keys if evaluation.keys is not None else [effect_key(e) for e in effects]
            assert len(keys) == len(effects), "an evaluation's keys must name its effects"
            for position, key in enumerate(keys):  # a plain loop: once per key written
                later = deferred.get(key)
                if later is None:
                    deferred[key] = [(effects, position, record_revision)]
                else:
                    later.append((effects, position, record_revision))
            plan.payloads.append(payload)
            plan.payload_bytes += len(payload)
        batch_locks.planned(evaluation)
        if evaluation.entry is not None:
            if evaluation.outcome is not None:
                horizon.outcomes[evaluation.outcome.request_id] = evaluation.outcome
            if rid:
                horizon.outcomes[rid] = RequestRecord(rid, record_revision, evaluation.entry.response, now_unix_ms,
                                                      write.kind)
        if rid:
            in_batch[rid] = evaluation.response
        plan.after_commit.append((index, evaluation.response))
    _check(plan, len(writes))
    return plan


class _BatchTable:
    """The committed request-id table with the ids recorded earlier in the batch (admission)."""

    def __init__(self, table: RequestTable, horizon: Horizon) -> None:
        self._table = table
        self._horizon = horizon
        self.evicted_through_ms = table.evicted_through_ms

    def request(self, request_id: str) -> RequestRecord | None:
        return self._horizon.request(self._table, request_id)


def _locked(evaluation: Evaluation, request_id: str, locks: LockView) -> errors.StoreError | None:
    """Whether a planned write touches a key a prepared transaction locked (its prepare's keys,
    or the keys it writes and reads)."""
    if evaluation.locks is not None:
        prepare = evaluation.locks.prepare
        return conflict(locks, exclusive=prepare.exclusive_keys, shared=prepare.shared_keys,
                        request_id=prepare.request_id)
    written: Sequence[bytes] = ()
    if evaluation.keys is not None:
        written = evaluation.keys
    elif evaluation.entry is not None:
        written = [effect_key(e) for e in evaluation.entry.effects]
    return conflict(locks, exclusive=written, shared=evaluation.reads, request_id=request_id,
                    own_txn=evaluation.releases)


def _check(plan: Plan, count: int) -> None:
    """Paired assertion: every write is answered now, after the commit, or carried, once."""
    seen = [i for i, _ in plan.now] + [i for i, _ in plan.after_commit] + plan.carry
    assert sorted(seen) == list(range(count)), f"plan lost or doubled writes: {sorted(seen)} of {count}"
    assert len(plan.payloads) <= max(1, len(plan.after_commit)), "more records than answered writes"
