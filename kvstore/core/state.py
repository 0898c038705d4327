"""The store's state machine: pure, deterministic, shared by every replayer of the WAL.

`apply_entries` is the one apply function (rqlite's lesson): leader apply after commit, bootstrap,
followers and the Spark jobs all compute the next state with it, so they cannot disagree. It
takes the state it needs through a lookup function and returns the writes; LevelDB is the
caller's business (`kvstore.storage.shard_store`).

A WAL entry carries effects only. Conditions are evaluated by the leader before the entry is
appended (`kvstore.core.evaluate`), using `next_key_state`, the same transition this module applies.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvstore.core.entries import decode_canonical, decode_entry, fields_of
from kvstore.internal.v1 import wal_entry_pb2

_KEY_HEADER = struct.Struct(">qqq")  # version, mod_revision, create_revision


class KeyState(NamedTuple):
    """A live key: its value, how many writes since it was created, and where they were.

    A NamedTuple, not a frozen dataclass: one is built per record replayed, and a frozen
    dataclass costs ~1 µs more to construct (bench/README.md, replay)."""

    value: bytes
    version: int
    mod_revision: int
    create_revision: int

    def encode(self) -> bytes:
        return _KEY_HEADER.pack(self.version, self.mod_revision, self.create_revision) + self.value

    @staticmethod
    def decode(raw: bytes) -> KeyState:
        assert len(raw) >= _KEY_HEADER.size, f"key state of {len(raw)} bytes is truncated"
        version, mod_revision, create_revision = _KEY_HEADER.unpack_from(raw)
        return KeyState(raw[_KEY_HEADER.size:], version, mod_revision, create_revision)


class ChangeType(enum.Enum):
    PUT = "put"
    DELETE = "delete"


class Change(NamedTuple):
    """One applied effect, as Watch streams and the change feed show it (a NamedTuple, like KeyState)."""

    type: ChangeType
    key: bytes
    state: KeyState | None  # None for deletes
    revision: int


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRecord:
    """What the request-id table keeps: where the request committed, what was answered, the
    leader's clock when it built the entry (0: an entry written before WalEntry.leader_unix_ms
    existed), by which every replica forgets the id at the same entry (`kvstore.storage.shard_store`),
    and the kind of request that was answered (WalEntry.request_kind; 0: not known), so that a
    retry of another kind with the same id is refused (`kvstore.core.batch.admit`)."""

    request_id: str
    revision: int
    response: bytes
    leader_unix_ms: int = 0
    kind: int = 0


# ---- cross-shard transactions: what a replica keeps of them (docs/design.md §10) ------------------------
# A transaction's records carry request ids derived from its txn id, in a prefix no client may use
# (`kvstore.core.validation.check_request_id`): the request-id table then gives every record of a
# transaction exactly-once appends and replays, and the first decision of a txn id wins (T1).
TXN_ID_PREFIX = "kvstore.txn/"


def prepare_id(txn_id: str) -> str:
    return f"{TXN_ID_PREFIX}p/{txn_id}"


def decision_id(txn_id: str) -> str:
    return f"{TXN_ID_PREFIX}d/{txn_id}"


def resolve_id(txn_id: str) -> str:
    return f"{TXN_ID_PREFIX}r/{txn_id}"


def forgotten_id(txn_id: str) -> str:
    """The id under which a forgotten decision stays in the request-id table (its horizon), with
    its answer: a late question about it is answered, and once even that is forgotten, the
    table's `evicted_through_ms` tells an abort asked before the forget from a fresh one."""
    return f"{TXN_ID_PREFIX}f/{txn_id}"


class PreparedTxn(NamedTuple):
    """A transaction prepared at this shard and not resolved yet: it holds locks on its keys."""

    prepare: wal_entry_pb2.TxnPrepare
    revision: int  # the prepare's offset
    leader_unix_ms: int  # when its leader built it (0: not known): how long it has been in doubt

    @property
    def txn_id(self) -> str:
        return self.prepare.txn_id


PreparedLookup = Callable[[str], "PreparedTxn | None"]


class DecidedTxn(NamedTuple):
    """A decision in the coordinator's decision table: kept until every other participant
    resolved it (a `TxnForget`), so recovery, resolvers and operators learn it from the
    coordinator's state, never from the request-id table's bounded memory (T3)."""

    decision: wal_entry_pb2.TxnDecision
    revision: int  # the decision's offset
    leader_unix_ms: int  # when its leader built it (0: not known): how long it has waited
    response: bytes = b""  # what it answered (a serialized TxnDecided): replayed to anyone asking again

    @property
    def txn_id(self) -> str:
        return self.decision.txn_id

    @property
    def pending(self) -> tuple[int, ...]:
        """The participants that must resolve it: all but the coordinator (the lowest), which
        applied its part with the decision."""
        return tuple(self.decision.participants)[1:]

    def decided(self) -> wal_entry_pb2.TxnDecided:
        """What the decision answers anyone asking again (the driver's retry, a resolver): its
        recorded answer; for a record without one, the decision itself."""
        d = self.decision
        try:
            answered = wal_entry_pb2.TxnDecided.FromString(self.response)
        except Exception:  # hostile bytes in a well-formed decision: the decision still says it all
            answered = wal_entry_pb2.TxnDecided()
        if answered.commit != d.commit or answered.succeeded != d.succeeded:
            answered = wal_entry_pb2.TxnDecided(commit=d.commit, succeeded=d.succeeded, reason=d.reason,
                                                answer=d.answer if d.commit else b"")
        answered.revision = self.revision
        return answered


DecidedLookup = Callable[[str], "DecidedTxn | None"]


@dataclasses.dataclass
class Applied:
    """The outcome of applying accepted entries: writes to make, in one batch with the checkpoint.

    `changes` (every effect applied, in order, for Watch) is built when read, from what
    `apply_entries` noted in `changed`: a bootstrap applies millions of effects that nobody
    watches, and building a Change object per effect cost ~8% of its apply (measured, 200k
    WAL records)."""

    writes: dict[bytes, KeyState | None] = dataclasses.field(default_factory=dict)
    requests: list[RequestRecord] = dataclasses.field(default_factory=list)
    duplicates: int = 0  # entries skipped because their request id was already applied
    malformed: int = 0  # accepted WAL records whose payload is not a WalEntry
    # Cross-shard transactions (docs/design.md §10): the prepared table's changes, in order (a
    # txn id prepared here, or None: released by its resolve), and the transaction records not
    # applied because they break a rule (`txn_record_rule`), counted like malformed ones.
    prepared: dict[str, PreparedTxn | None] = dataclasses.field(default_factory=dict)
    # The decision table's changes, in order (a decision recorded, or None: forgotten).
    decided: dict[str, DecidedTxn | None] = dataclasses.field(default_factory=dict)
    txn_skipped: int = 0
    # Each effect applied, as three flat columns (key, new state or None, revision): no object per effect.
    changed: tuple[list[bytes], list[KeyState | None], list[int]] = dataclasses.field(
        default_factory=lambda: ([], [], []), repr=False)

    @property
    def changes(self) -> list[Change]:
        """The effects applied, in order: a put with the key's new state, a delete with None."""
        put, delete = ChangeType.PUT, ChangeType.DELETE
        return [Change(delete if state is None else put, key, state, revision)
                for key, state, revision in zip(*self.changed, strict=True)]


Lookup = Callable[[bytes], KeyState | None]
RequestSeen = Callable[[str], bool]


# KeyState(...) through its NamedTuple __new__ costs ~290 ns; tuple's own constructor builds the very
# same object in ~180 (replay builds one per put).
_new_key_state: Callable[[tuple[bytes, int, int, int]], KeyState] = functools.partial(tuple.__new__, KeyState)


def put_state(old: KeyState | None, value: bytes, revision: int) -> KeyState:
    """The one transition of a put: a new key starts at version 1, an existing one counts on and
    keeps its create revision. (A delete's transition is "no state", whatever was there.)"""
    if old is None:
        return _new_key_state((value, 1, revision, revision))
    return _new_key_state((value, old.version + 1, revision, old.create_revision))


def next_key_state(old: KeyState | None, effect: wal_entry_pb2.Effect, revision: int) -> KeyState | None:
    """The one transition of a key (`put_state`). Deleting a missing key is a no-op that still counts."""
    kind = effect.WhichOneof("kind")
    if kind == "put":
        return put_state(old, effect.put.value, revision)
    assert kind == "delete", f"effect without a kind at revision {revision}"
    return None


def effect_key(effect: wal_entry_pb2.Effect) -> bytes:
    kind = effect.WhichOneof("kind")
    return bytes(effect.put.key if kind == "put" else effect.delete.key)


def apply_effects(effects: Sequence[wal_entry_pb2.Effect], revision: int,
                  lookup: Lookup) -> list[tuple[bytes, KeyState | None]]:
    """One entry's effects at `revision`, in order (a later effect on a key sees the earlier one):
    each key's new state (`next_key_state`). The leader's batch overlay (`kvstore.core.batch`)
    and the simulation go through it; replay (`apply_entries`) applies the same transition
    (`put_state`) to the plain values of `decode_fields`."""
    out: list[tuple[bytes, KeyState | None]] = []
    local: dict[bytes, KeyState | None] = {}
    for effect in effects:  # a plain loop: this runs once per record replayed
        key = effect_key(effect)
        new_state = next_key_state(local[key] if key in local else lookup(key), effect, revision)
        local[key] = new_state
        out.append((key, new_state))
    return out


def apply_entries(
    lookup: Lookup,
    request_seen: RequestSeen,
    records: Sequence[tuple[int, bytes]],
    on_request: Callable[[RequestRecord], None] | None = None,
    on_leader_time: Callable[[int], None] | None = None,
    prepared: PreparedLookup | None = None,
    decided: DecidedLookup | None = None,
) -> Applied:
    """Apply accepted WAL records (offset, payload) in offset order; pure.

    Later records see the writes of earlier ones (an overlay over `lookup`), so a batch gives
    the same state as applying its records one at a time. A request id is applied at most once
    per shard: a repeat (a client retry whose first attempt did commit) has no effect.

    With `on_request`, the caller keeps the request table itself (it is told of every request
    as it is applied, and `request_seen` must answer for those too): that lets a bounded table
    evict at the exact same record whether records arrive one at a time or in one batch.

    With `on_leader_time`, it is told the leader time (> 0) of every well-formed entry that has
    one, duplicates and entries without a request id included, in order: after the entry's
    duplicate check (an id is never forgotten from under its own retry) and before its request
    reaches `on_request`. That is the clock by which a bounded table forgets ids by age.

    `prepared` reads the shard's prepared table and `decided` its decision table (cross-shard
    transactions, docs/design.md §10): None for a caller with no transaction state, which then
    sees every resolve as an orphan and every decision as new. A transaction's record is applied
    by `txn_record_rule`; its changes to the tables are `Applied.prepared` and `Applied.decided`.

    Replay runs this loop once per record (a bootstrap: millions), so it works on plain values
    (`decode_fields`), looks a key up only for a put (a delete's new state is none, whatever
    was there), and keeps the batch's states in `writes`, which later records read first.
    """
    out = Applied()
    writes, requests = out.writes, out.requests
    changed_keys, changed_states, changed_revisions = out.changed
    seen_here: set[str] = set()
    previous = -1
    for offset, payload in records:  # bounded by the caller's batch
        assert offset > previous, f"records out of order: {offset} after {previous}"
        previous = offset
        entry = decode_canonical(payload)  # `decode_fields`, inline: hot loop
        txn: wal_entry_pb2.WalEntry | None = None
        if entry is None:  # every transaction record comes this way (fields 6-8 are not canonical)
            message = decode_entry(payload)
            if message is None:
                out.malformed += 1
                continue
            entry = fields_of(message)
            if _is_txn_record(message):
                txn = message
        request_id, effects, response, leader_ms, kind = entry
        # Without `on_request` this call keeps the ids it applied itself; `request_seen` is
        # asked only about the others.
        duplicate = bool(request_id) and ((on_request is None and request_id in seen_here)
                                          or request_seen(request_id))
        # 0 = unknown: written before the field existed; a negative time is nonsense, and a
        # bounded table must treat it as unknown rather than as very old.
        if leader_ms > 0:
            if on_leader_time is not None:
                on_leader_time(leader_ms)
        else:
            leader_ms = 0
        if duplicate:
            out.duplicates += 1
            continue
        extra: tuple[RequestRecord, ...] = ()
        if txn is not None:
            def seen(rid: str) -> bool:
                return (on_request is None and rid in seen_here) or request_seen(rid)

            def prepared_now(txn_id: str) -> PreparedTxn | None:
                if txn_id in out.prepared:
                    return out.prepared[txn_id]
                return prepared(txn_id) if prepared is not None else None

            def decided_now(txn_id: str) -> DecidedTxn | None:
                if txn_id in out.decided:
                    return out.decided[txn_id]
                return decided(txn_id) if decided is not None else None

            rule = txn_record_rule(txn, offset, leader_ms, seen, prepared_now, decided_now)
            if rule.skip:
                out.txn_skipped += 1
                if not rule.record_id:
                    continue
            if rule.change is not None:
                out.prepared[rule.change[0]] = rule.change[1]
            for txn_id, decision in rule.decisions:
                out.decided[txn_id] = decision
            if not rule.apply_effects:
                effects = []
            extra = rule.requests
        for key, value in effects:  # bounded by the entry
            new_state = None if value is None else put_state(writes[key] if key in writes else lookup(key),
                                                              value, offset)
            writes[key] = new_state
            changed_keys.append(key)
            changed_states.append(new_state)
            changed_revisions.append(offset)
        recorded: tuple[RequestRecord, ...] = extra
        if request_id:
            recorded = (RequestRecord(request_id, offset, bytes(response), leader_ms, kind), *extra)
        if len(recorded) > 1:  # (a decision's client id, a forget's tombstones): one revision, ids in order
            recorded = tuple(sorted(recorded, key=lambda r: r.request_id))
        for request in recorded:  # the table keeps (revision, id) order, whatever the batches
            seen_here.add(request.request_id)
            requests.append(request)
            if on_request is not None:
                on_request(request)
    return out


def _is_txn_record(entry: wal_entry_pb2.WalEntry) -> bool:
    return (entry.HasField("prepare") or entry.HasField("decision") or entry.HasField("resolve")
            or entry.HasField("forget"))


@dataclasses.dataclass(frozen=True)
class TxnRule:
    """What applying one transaction record does (`txn_record_rule`)."""

    skip: bool = False  # the record breaks a rule: counted in Applied.txn_skipped
    record_id: bool = True  # its request id is recorded (a skipped orphan resolve's still is)
    apply_effects: bool = False  # its effects are applied (a commit decision; a commit's resolve of a prepared txn)
    change: tuple[str, PreparedTxn | None] | None = None  # the prepared table's change
    decisions: tuple[tuple[str, DecidedTxn | None], ...] = ()  # the decision table's changes
    requests: tuple[RequestRecord, ...] = ()  # ids recorded besides the entry's own (a decision's client's, ...)


_SKIP = TxnRule(skip=True, record_id=False)


def txn_record_rule(entry: wal_entry_pb2.WalEntry, offset: int, leader_ms: int, seen: RequestSeen,
                    prepared: PreparedLookup, decided: DecidedLookup | None = None) -> TxnRule:
    """The rules of a cross-shard transaction's record (docs/design.md §10), applied by every
    replayer alike; any record that breaks one is skipped and counted, never applied:

    * exactly one of prepare / decision / resolve / forget; a prepare's, decision's or resolve's
      request id the one derived from its txn id (`prepare_id`, ...), a forget's none; no effects
      but a resolve's and a commit decision's (the coordinator's own part);
    * a prepare locks its keys unless its transaction is prepared here already or resolved (a
      prepare arriving after its resolve must not lock again: its resolve id is remembered);
    * a decision joins the decision table, where it stays until a forget removes it (T3); it
      records itself under its id too, and a second decision of a txn id, a duplicate of either,
      is never applied (T1). A commit applies the coordinator's effects with it. Its client
      request id, when set and not seen, is recorded as the request's outcome: a commit's answer
      (REQUEST_KIND_TXN), or the abort (REQUEST_KIND_TXN_ABORTED, T5);
    * a resolve applies its effects only for a transaction prepared here and a commit (T2), and
      releases the locks; an orphan resolve (nothing prepared) applies nothing but keeps its id;
    * a forget removes the decisions it names from the table (an id not there is no change) and
      leaves each in the request-id table under `forgotten_id` with its answer: for the table's
      horizon a late question is answered, and after it an abort asked before the forget is
      refused by the table's `evicted_through_ms` (`kvstore.core.txn.evaluate_decision`).
    """
    kinds = (int(entry.HasField("prepare")) + int(entry.HasField("decision")) + int(entry.HasField("resolve"))
             + int(entry.HasField("forget")))
    if kinds != 1:
        return _SKIP
    if entry.HasField("prepare"):
        prepare = entry.prepare
        if not prepare.txn_id or entry.request_id != prepare_id(prepare.txn_id) or len(entry.effects):
            return _SKIP
        if seen(resolve_id(prepare.txn_id)) or prepared(prepare.txn_id) is not None:
            return TxnRule(skip=True)
        return TxnRule(change=(prepare.txn_id, PreparedTxn(prepare, offset, leader_ms)))
    if entry.HasField("decision"):
        decision = entry.decision
        if (not decision.txn_id or entry.request_id != decision_id(decision.txn_id)
                or (len(entry.effects) and not decision.commit) or len(decision.participants) < 2):
            return _SKIP
        if decided is not None and decided(decision.txn_id) is not None:
            return TxnRule(skip=True)  # a second decision of a transaction decided here (T1)
        recorded: tuple[tuple[str, DecidedTxn | None], ...] = ()
        if decision.kept:  # (an older release's decision is not kept: its id answers for it)
            recorded = ((decision.txn_id, DecidedTxn(decision, offset, leader_ms, bytes(entry.response))),)
        client = decision.request_id
        if not client or client.startswith(TXN_ID_PREFIX) or seen(client):
            return TxnRule(apply_effects=decision.commit, decisions=recorded)
        if decision.commit:
            answer = bytes(decision.answer) or DecidedTxn(decision, offset, leader_ms, bytes(entry.response)).decided(
            ).answer
            outcome = RequestRecord(client, offset, answer, leader_ms, wal_entry_pb2.REQUEST_KIND_TXN)
        else:
            aborted = wal_entry_pb2.TxnDecided(commit=False, reason=decision.reason, revision=offset)
            outcome = RequestRecord(client, offset, aborted.SerializeToString(), leader_ms,
                                    wal_entry_pb2.REQUEST_KIND_TXN_ABORTED)
        return TxnRule(apply_effects=decision.commit, decisions=recorded, requests=(outcome,))
    if entry.HasField("forget"):
        if entry.request_id or len(entry.effects):
            return _SKIP
        gone = {t: d for t in entry.forget.txn_ids if decided is not None and (d := decided(t)) is not None}
        tombstones = tuple(RequestRecord(forgotten_id(t), offset, d.decided().SerializeToString(), leader_ms,
                                         wal_entry_pb2.REQUEST_KIND_TXN_DECISION)
                           for t, d in gone.items() if not seen(forgotten_id(t)))
        return TxnRule(decisions=tuple((txn_id, None) for txn_id in gone), requests=tombstones)
    resolve = entry.resolve
    if not resolve.txn_id or entry.request_id != resolve_id(resolve.txn_id):
        return _SKIP
    if prepared(resolve.txn_id) is None:
        return TxnRule(skip=True)  # an orphan: nothing to apply or release, its id kept
    return TxnRule(apply_effects=resolve.commit, change=(resolve.txn_id, None))
