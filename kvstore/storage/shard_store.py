"""One shard's replica state in LevelDB (plyvel): a cache of the WAL, never the source of truth.

Layout (one LevelDB directory per shard, all keys prefixed):

    d<key>                 -> KeyState.encode()
    r<request id>          -> revision (8 bytes) + leader_unix_ms (8 bytes) + request kind (1 byte)
                              + original response
    q<revision:8><id>      -> leader_unix_ms (8 bytes)   (request ids in commit order, to bound the table)
    t<txn id>              -> revision (8 bytes) + leader_unix_ms (8 bytes) + TxnPrepare
                              (cross-shard transactions prepared here and not resolved: their
                              locks, docs/design.md §10; held in memory too, `locks`)
    c<txn id>              -> revision (8 bytes) + leader_unix_ms (8 bytes) + decision length (8 bytes)
                              + TxnDecision + recorded response (the decision table of a
                              coordinator shard: decisions not forgotten yet, docs/design.md §10;
                              read from LevelDB, never held whole in memory: a commit's answer
                              may be large, and decisions wait here while a participant is away)
    o<len:8><client request id><revision:8> -> txn id   (the decision table by the client request
                              id its decisions carry: `decided_request`)
    m:format, m:topic, m:shard, m:checkpoint, m:requests (ids kept), m:evicted_through (ms)
    m:loading              present while a snapshot is being loaded (`load_snapshot`)

W5: the writes of a committed batch and the new checkpoint (the next WAL offset to read) go in
one LevelDB write batch, so state and checkpoint never disagree. A directory that cannot be
opened, was written by another format, topic or shard, or lacks a checkpoint is wiped and
rebuilt from the WAL by the replica (`needs_rebuild` tells it so), never trusted.

Format 4 added the decision table. A directory of format 3 is migrated in place (as format 2 is,
through 3): it gets an empty decision table. Decisions it applied before the upgrade are not in
it (that release kept none), so this replica's table lacks them where a replica rebuilt from the
WAL has them; their transactions were resolved by that release's drivers and resolvers, and
their request ids (the decision's and the client's) in the request-id table still answer for
them within the horizon, as they did before. Keys never differ: only the decision table does.

The request-id table forgets ids by time and by count (docs/design.md §4.1, `kvstore.core.request_window`), as a pure
function of the applied entries, and keeps `evicted_through_ms`, the newest leader time it ever
forgot, for `kvstore.core.request_horizon` to refuse retries it can no longer recognise.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import plyvel

from kvstore.core.delta import store_delta
from kvstore.core.locks import LockIndex
from kvstore.core.recent_writes import RecentWrites
from kvstore.core.request_window import RequestWindow
from kvstore.core.state import Applied, DecidedTxn, KeyState, PreparedTxn, RequestRecord
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.limits import MAX_REQUEST_IDS, REQUEST_ID_HORIZON_MS
from wal.offsets import past_marker

log = logging.getLogger(__name__)

# 2: request ids keep their leader time, m:evicted_through. 3: and the kind of request they
# answered (a byte after the time). 4: the decision table (c<txn id>). A directory of format 2 or
# 3 is migrated in place when opened (2 -> 3: its ids' kinds are unknown, 0; 3 -> 4: an empty
# decision table); older ones are rebuilt.
FORMAT_VERSION = b"4"
_MIGRATES_FROM = (b"2", b"3")

_DATA = b"d"
_REQUEST = b"r"
_REQUEST_ORDER = b"q"
_PREPARED = b"t"
# Not b"d"-anything: `scan` reads keys up to bytes([_DATA[0] + 1]), and every other table's
# prefix must lie outside [b"d", b"e").
_DECIDED = b"c"
_DECIDED_BY_REQUEST = b"o"
_META = b"m:"
_U64 = struct.Struct(">Q")
_REQUEST_HEAD = struct.Struct(">QQB")  # revision, leader_unix_ms, request kind
_REQUEST_HEAD_V2 = struct.Struct(">QQ")  # format 2: revision, leader_unix_ms
_PREPARED_HEAD = struct.Struct(">QQ")  # revision, leader_unix_ms
_DECIDED_HEAD = struct.Struct(">QQQ")  # revision, leader_unix_ms, length of the TxnDecision that follows


# A Bloom filter per table: applying a record looks its key up first, and during a bootstrap or
# for new keys that lookup misses; without a filter a miss reads every level-0 table's index
# (measured: apply 35k -> 55k records/s for 200k new keys). Tables written before it have no
# filter and are still read correctly.
_DB_OPTIONS: dict[str, object] = {"create_if_missing": True, "paranoid_checks": True, "bloom_filter_bits": 10}
# Room a full disk must have again before a store reopens its LevelDB after a failed write.
_REOPEN_MIN_FREE_BYTES = 4 << 20


class StorageError(Exception):
    """The local state cannot be used; rebuild it from the WAL."""


class HeldKeys:
    """A Bloom filter over every key a replica has held since it was empty: "certainly absent"
    answers a lookup without LevelDB.

    Applying a put reads the key's state first (version, create revision). While a replica is
    rebuilt from the WAL nearly every key is new, and LevelDB answers a miss only after
    searching its memtable and the index of every level (its Bloom filters are per table, the
    memtable has none): 1.5-2 µs, a third of what applying the record costs otherwise
    (measured on 200k WAL records: store apply 5.5 µs a record with LevelDB lookups, 4.3 with
    this filter, 3.8 with no lookup at all).

    Sound only while it has seen every key ever written: `ShardStore` keeps one from a moment
    its LevelDB held no key (opened empty, wiped) and adds the keys it writes before the write
    (a key added and then not written only costs a lookup); anything that writes keys another
    way drops it. It never answers "absent" for a key added: the key's hash (stable within the
    process, which the filter never leaves) picks one byte and two bits in it, which `add` sets
    and `may_hold` requires. One byte per key, not two bytes anywhere: the table is 2 MiB and
    a lookup mostly waits for memory. `MAX_KEYS` fill it (false "maybe": ~3% at 1M keys, ~18%
    at 4M, measured); past that it is dropped and every lookup reads LevelDB again. The cost:
    2 MiB per replica that started empty (a new node: one per shard it keeps), until it is
    full or the store is opened again (then it holds keys: no filter).
    """

    BYTES = 1 << 21  # 2 MiB
    MAX_KEYS = 4_000_000

    __slots__ = ("added", "bits")

    def __init__(self) -> None:
        self.bits = bytearray(self.BYTES)
        self.added = 0  # keys written (a key written twice counts twice: it only fills sooner)

    def may_hold(self, key: bytes) -> bool:
        """False: the key was never added. (`ShardStore.get` has this inline.)"""
        h = hash(key)
        mask = _HELD_BITS[h >> 21 & 63]
        return self.bits[h & _HELD_INDEX] & mask == mask

    def add(self, key: bytes) -> None:
        """(`ShardStore.apply` has this inline.)"""
        h = hash(key)
        self.bits[h & _HELD_INDEX] |= _HELD_BITS[h >> 21 & 63]
        self.added += 1

    @property
    def full(self) -> bool:
        return self.added > self.MAX_KEYS


# A key's hash h picks the byte h & _HELD_INDEX and in it the bits _HELD_BITS[h >> 21 & 63]: two of
# eight, by two 3-bit fields of h (one bit when they are equal).
_HELD_INDEX = HeldKeys.BYTES - 1
_HELD_BITS = [1 << (fields & 7) | 1 << (fields >> 3) for fields in range(64)]


class ShardStore:
    """LevelDB state of one shard. Not thread-safe: the replica serialises apply and reads."""

    def __init__(self, path: Path, *, topic: str, shard: int, max_request_ids: int = MAX_REQUEST_IDS,
                 request_id_horizon_ms: int = REQUEST_ID_HORIZON_MS) -> None:
        """`max_request_ids` and `request_id_horizon_ms` are parameters for tests only: every
        replica of a shard must run with the same values, or their tables differ."""
        assert max_request_ids > 0 and request_id_horizon_ms > 0
        self.path = Path(path)
        self.topic = topic
        self.shard = shard
        self.max_request_ids = max_request_ids
        self.request_id_horizon_ms = request_id_horizon_ms
        self.rebuilt_reason: str | None = None
        self._reopen_pending: str | None = None  # a write failed: its error (`_writing`)
        self._db = self._open()
        self._held = self._held_keys()
        self.locks = self._stored_locks()
        # Which keys the records applied since this store opened wrote (not stored: a reopened
        # store knows nothing below its checkpoint); what validates an optimistic read.
        self.recent = RecentWrites(floor=self.read_revision)

    # ---- opening and rebuilding ----------------------------------------------------------------

    def _open(self) -> plyvel.DB:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            db = plyvel.DB(str(self.path), **_DB_OPTIONS)
        except plyvel.IOError as exc:
            if "lock" in str(exc).lower():
                # Another live process owns this directory: never wipe it from under it.
                raise StorageError(f"shard {self.shard}: {self.path} is in use by another process: {exc}") from exc
            return self._wipe_and_create(f"cannot open: {exc}")
        except plyvel.Error as exc:
            return self._wipe_and_create(f"cannot open: {exc}")
        try:
            why = self._suspect(db)
        except plyvel.Error as exc:  # a table LevelDB opens lazily may be the corrupt one
            why = f"unreadable: {exc}"
        if why is None:
            return db
        db.close()
        return self._wipe_and_create(why)

    def _suspect(self, db: plyvel.DB) -> str | None:
        """Why an existing directory must not be trusted, or None (fresh or consistent)."""
        fmt = db.get(_META + b"format")
        if fmt is None:
            has_anything = next(db.iterator(include_value=False), None) is not None
            if has_anything:
                return "data without format marker"
            self._initialise(db)
            return None
        if fmt != FORMAT_VERSION and fmt not in _MIGRATES_FROM:
            return f"format {fmt!r}, expected {FORMAT_VERSION!r}"
        if db.get(_META + b"topic") != self.topic.encode() or db.get(_META + b"shard") != str(self.shard).encode():
            return "written for another topic or shard"
        if db.get(_META + b"loading") is not None:
            return "a snapshot load did not finish"
        if db.get(_META + b"checkpoint") is None:
            return "no checkpoint"
        if db.get(_META + b"requests") is None or db.get(_META + b"evicted_through") is None:
            return "no request-table metadata"
        if fmt == b"2":
            self._migrate_from_2(db)
            fmt = b"3"
        if fmt == b"3":
            self._migrate_from_3(db)
        return None

    def _migrate_from_2(self, db: plyvel.DB) -> None:
        """Format 2 -> 3 in one write batch: every kept request id gets kind 0 (unknown), which
        `kvstore.core.batch.admit` treats as before (the recorded answer decides). In place,
        because a rebuild needs the whole WAL (or a snapshot), which a truncated WAL without
        --snapshot-dir cannot give. Bounded by MAX_REQUEST_IDS rows. (`_migrate_from_3` follows.)"""
        count = 0
        with db.write_batch(sync=True, transaction=True) as batch:
            for raw_key, raw_value in db.iterator(prefix=_REQUEST):  # bounded: the kept ids
                revision, leader_ms = _REQUEST_HEAD_V2.unpack_from(raw_value)
                batch.put(raw_key, _REQUEST_HEAD.pack(revision, leader_ms, 0) + raw_value[_REQUEST_HEAD_V2.size:])
                count += 1
            batch.put(_META + b"format", b"3")
        log.info("shard %d: migrated %s from format 2 to 3 (%d request ids)", self.shard, self.path, count)

    def _migrate_from_3(self, db: plyvel.DB) -> None:
        """Format 3 -> 4: an empty decision table, in place for the reason `_migrate_from_2`
        gives. Format 3 had no c<txn id> rows, so only the marker changes; any stray row under
        the prefix (none was ever written) is dropped rather than trusted. The decisions applied
        before the upgrade stay out of the table (the module's docstring says what answers for
        them)."""
        with db.write_batch(sync=True, transaction=True) as batch:
            for prefix in (_DECIDED, _DECIDED_BY_REQUEST):
                for raw_key in db.iterator(prefix=prefix, include_value=False):  # none expected
                    batch.delete(raw_key)
            batch.put(_META + b"format", FORMAT_VERSION)
        log.info("shard %d: migrated %s from format 3 to %s (an empty decision table)", self.shard, self.path,
                 FORMAT_VERSION.decode())

    def _initialise(self, db: plyvel.DB) -> None:
        with db.write_batch(sync=True, transaction=True) as batch:
            batch.put(_META + b"format", FORMAT_VERSION)
            batch.put(_META + b"topic", self.topic.encode())
            batch.put(_META + b"shard", str(self.shard).encode())
            batch.put(_META + b"checkpoint", _U64.pack(0))
            batch.put(_META + b"requests", _U64.pack(0))
            batch.put(_META + b"evicted_through", _U64.pack(0))

    def _wipe_and_create(self, why: str) -> plyvel.DB:
        log.warning("shard %d: local state at %s is unusable (%s): rebuilding from the WAL", self.shard,
                    self.path, why)
        self.rebuilt_reason = why
        shutil.rmtree(self.path, ignore_errors=True)
        db = plyvel.DB(str(self.path), **_DB_OPTIONS)
        self._initialise(db)
        return db

    def wipe(self, why: str) -> None:
        """Forget everything (e.g. the WAL is behind our checkpoint: it was recreated)."""
        self._held = None
        self._db.close()
        self._db = self._wipe_and_create(why)
        self._reopen_pending = None
        self._held = self._held_keys()
        self.locks = LockIndex()
        self.recent.reset(self.read_revision)

    def _stored_locks(self) -> LockIndex:
        """The prepared table, read whole: bounded by the transactions prepared and not resolved
        (the planner refuses prepares beyond `kvstore.limits.MAX_PREPARED_TXNS`)."""
        index = LockIndex()
        for raw_key, raw_value in self._db.iterator(prefix=_PREPARED):
            revision, leader_ms = _PREPARED_HEAD.unpack_from(raw_value)
            prepare = wal_entry_pb2.TxnPrepare.FromString(raw_value[_PREPARED_HEAD.size:])
            assert raw_key[len(_PREPARED):].decode() == prepare.txn_id, raw_key
            index.add(PreparedTxn(prepare, revision, leader_ms))
        return index

    def _held_keys(self) -> HeldKeys | None:
        """A `HeldKeys` filter if the store holds no key now (fresh, wiped, rebuilt), else None."""
        return HeldKeys() if next(self._db.iterator(prefix=_DATA, include_value=False), None) is None else None

    def close(self) -> None:
        if not self._db.closed:
            self._db.close()

    # ---- reads -----------------------------------------------------------------------------------

    @property
    def applied_offset(self) -> int:
        """The checkpoint: every WAL record below this offset is applied, none above it."""
        raw = self._db.get(_META + b"checkpoint")
        if raw is None:
            raise StorageError(f"shard {self.shard}: checkpoint vanished")
        return int(_U64.unpack(raw)[0])

    @property
    def read_revision(self) -> int:
        """The revision a read of this state is at: every WAL record below it is applied. The
        checkpoint, except while a leader's marker slot is assumed (`unverified`): a record that a
        writer outside the guard slipped into that slot would be applied later, at the slot, so
        a read claiming the slot would be validated against it too late (T4, `kvstore.core.cut`)."""
        unverified = self.unverified
        return self.applied_offset if unverified is None else unverified

    @property
    def evicted_through_ms(self) -> int:
        """The largest leader time (Unix ms) of any request id this table ever forgot, by time
        or by count; 0 if none. A retry whose id is absent and whose first attempt is not after
        this (plus clock skew) may be a forgotten one: `kvstore.core.request_horizon.expired`."""
        raw = self._db.get(_META + b"evicted_through")
        if raw is None:
            raise StorageError(f"shard {self.shard}: evicted-through time vanished")
        return int(_U64.unpack(raw)[0])

    def get(self, key: bytes) -> KeyState | None:
        held = self._held
        if held is not None:  # `HeldKeys.may_hold`, inline: a replay asks this for every put
            h = hash(key)
            mask = _HELD_BITS[h >> 21 & 63]
            if held.bits[h & _HELD_INDEX] & mask != mask:
                return None  # never written since this store was empty
        raw = self._db.get(_DATA + key)
        return KeyState.decode(raw) if raw is not None else None

    def scan(self, start: bytes, end: bytes | None, limit: int) -> list[tuple[bytes, KeyState]]:
        """Keys in [start, end) in byte order, at most `limit`; end None = to the last key."""
        assert limit > 0
        stop = _DATA + end if end is not None else bytes([_DATA[0] + 1])
        out: list[tuple[bytes, KeyState]] = []
        for raw_key, raw_value in self._db.iterator(start=_DATA + start, stop=stop):
            out.append((raw_key[len(_DATA):], KeyState.decode(raw_value)))
            if len(out) >= limit:
                break
        return out

    def scan_lazily(self, start: bytes, end: bytes | None) -> Iterator[tuple[bytes, KeyState]]:
        """`scan` without a count, read as the caller goes: a scan page bounded by bytes
        (kvstore.core.reads.take_page) stops reading where it is full, instead of loading a
        page's count of values first. Read it to its end or close it, within one step of the
        event loop (the iterator reads one LevelDB snapshot, taken at its first row)."""
        stop = _DATA + end if end is not None else bytes([_DATA[0] + 1])
        for raw_key, raw_value in self._db.iterator(start=_DATA + start, stop=stop):
            yield raw_key[len(_DATA):], KeyState.decode(raw_value)

    def request(self, request_id: str) -> RequestRecord | None:
        raw = self._db.get(_REQUEST + request_id.encode())
        if raw is None:
            return None
        revision, leader_ms, kind = _REQUEST_HEAD.unpack_from(raw)
        return RequestRecord(request_id, revision, raw[_REQUEST_HEAD.size:], leader_ms, kind)

    def keys(self) -> Iterator[tuple[bytes, KeyState]]:
        """Every key, in order (for audits and replica comparisons)."""
        for raw_key, raw_value in self._db.iterator(prefix=_DATA):
            yield raw_key[len(_DATA):], KeyState.decode(raw_value)

    def requests(self) -> Iterator[RequestRecord]:
        """The request-id table in commit (revision) order, what a snapshot must carry."""
        for raw_key, _ in self._db.iterator(prefix=_REQUEST_ORDER):
            rid = raw_key[len(_REQUEST_ORDER) + _U64.size:]
            record = self.request(rid.decode())
            if record is None:
                raise StorageError(f"shard {self.shard}: request id {rid!r} is ordered but missing")
            yield record

    @property
    def request_count(self) -> int:
        return int(_U64.unpack(self._db.get(_META + b"requests") or _U64.pack(0))[0])

    def digest(self) -> tuple[str, int]:
        """(SHA-256 hex, key count) over every key with its full state, in key order: two
        replicas at the same checkpoint must agree (W5 + one shared apply function)."""
        h = hashlib.sha256()
        count = 0
        for raw_key, raw_value in self._db.iterator(prefix=_DATA):
            h.update(_U64.pack(len(raw_key)) + raw_key + _U64.pack(len(raw_value)) + raw_value)
            count += 1
        return h.hexdigest(), count

    def requests_digest(self) -> str:
        """SHA-256 hex over the request-id table as a replica continues from it: the ids kept
        (count, in commit order, each with its revision, leader time, kind and recorded answer)
        and the newest leader time ever forgotten (`evicted_through_ms`). Two replicas at the same
        checkpoint must agree on it as on `digest`: a table that lost ids would answer a retry
        inside the window by applying it a second time, and keys alone would never show it."""
        h = hashlib.sha256()
        h.update(_U64.pack(self.request_count) + _U64.pack(self.evicted_through_ms))
        for req in self.requests():  # bounded by MAX_REQUEST_IDS
            rid = req.request_id.encode()
            h.update(_REQUEST_HEAD.pack(req.revision, req.leader_unix_ms, req.kind) + _U64.pack(len(rid)) + rid
                     + _U64.pack(len(req.response)) + req.response)
        return h.hexdigest()

    def prepared_digest(self) -> str:
        """SHA-256 hex over the prepared cross-shard transactions (docs/design.md §10), by txn id:
        each with its revision, leader time and prepare. A replica that lost one would apply its
        resolve as an orphan (nothing), half a transaction; keys alone would not show it until then."""
        return prepared_digest(self.locks.prepared())

    def decided_txn(self, txn_id: str) -> DecidedTxn | None:
        """The decision table's row of `txn_id` (this shard its coordinator), or None: never
        decided here, or forgotten (a `TxnForget`)."""
        raw = self._db.get(_DECIDED + txn_id.encode())
        return None if raw is None else _decode_decided(txn_id, raw)

    def decided_request(self, request_id: str) -> DecidedTxn | None:
        """The decision in the table that recorded the client's `request_id` as its outcome:
        the oldest one carrying it (a later attempt's decision carries the id too, but the first
        decision of a request id is its outcome), or None. One seek in the index."""
        for _, raw_txn in self._db.iterator(prefix=_request_index_prefix(request_id)):  # the first only
            txn_id = raw_txn.decode()
            found = self.decided_txn(txn_id)
            if found is None:
                raise StorageError(f"shard {self.shard}: request id {request_id!r} indexes decision {txn_id}, "
                                   "which the table does not hold")
            return found
        return None

    def decided(self) -> list[DecidedTxn]:
        """The decision table, oldest decision (lowest revision) first. Read whole from LevelDB:
        bounded by the decisions not forgotten yet, which the coordinator's finishers resolve and
        forget (`kvstore.server.txns`)."""
        out = [_decode_decided(raw_key[len(_DECIDED):].decode(), raw_value)
               for raw_key, raw_value in self._db.iterator(prefix=_DECIDED)]
        out.sort(key=lambda d: d.revision)
        return out

    def decided_digest(self) -> str:
        """SHA-256 hex over the decision table, by txn id: each decision with its revision, leader
        time and recorded answer. A replica that lost one could not answer a resolver with it once
        the request-id table forgot its id (T3); keys alone would never show it."""
        return decided_digest(self.decided())

    # ---- apply -------------------------------------------------------------------------------------

    @property
    def unverified(self) -> int | None:
        """The slot just below the checkpoint that a leader assumed its commit marker took
        without reading it, or None. A replay must look at it (`rewind_unverified`)."""
        raw = self._db.get(_META + b"unverified")
        return None if raw is None else int(_U64.unpack(raw)[0])

    def apply(self, records: Sequence[tuple[int, bytes]], new_checkpoint: int, *, sync: bool = False,
              unverified: int | None = None) -> Applied:
        """Apply accepted WAL records (offset, payload) and move the checkpoint, atomically (W5):
        the change is `kvstore.core.delta.store_delta`'s, shared with the simulation's
        `MemoryShard`; here it is only written, in one LevelDB write batch."""
        self._reopen_if_room()  # before any read: a reopen that failed left the handle closed
        window = RequestWindow(contains=lambda rid: self._db.get(_REQUEST + rid.encode()) is not None,
                               stored_oldest_first=self._stored_requests(), count=self.request_count,
                               evicted_through_ms=self.evicted_through_ms, limit=self.max_request_ids,
                               horizon_ms=self.request_id_horizon_ms)
        delta = store_delta(self, window, records, new_checkpoint, unverified=unverified)
        applied = delta.applied
        held = self._held
        if held is not None and held.full:
            held = self._held = None
        held_bits = held.bits if held is not None else None
        with self._writing(), self._db.write_batch(sync=sync, transaction=True) as batch:
            for key, state in applied.writes.items():  # bounded by the records
                if state is None:
                    batch.delete(_DATA + key)
                    continue
                if held_bits is not None:  # `HeldKeys.add`, inline; before the write
                    h = hash(key)
                    held_bits[h & _HELD_INDEX] |= _HELD_BITS[h >> 21 & 63]
                batch.put(_DATA + key, state.encode())
            if held is not None:
                held.added += len(applied.writes)
            for revision, evicted in delta.forgotten:  # deletes before puts: an id may come back
                rid = evicted.encode()
                batch.delete(_REQUEST_ORDER + _U64.pack(revision) + rid)
                batch.delete(_REQUEST + rid)
            for req in delta.remembered:
                rid = req.request_id.encode()
                batch.put(_REQUEST + rid, _REQUEST_HEAD.pack(req.revision, req.leader_unix_ms, req.kind) + req.response)
                batch.put(_REQUEST_ORDER + _U64.pack(req.revision) + rid, _U64.pack(req.leader_unix_ms))
            for txn_id, txn in applied.prepared.items():  # bounded by the records
                if txn is None:
                    batch.delete(_PREPARED + txn_id.encode())
                else:
                    batch.put(_PREPARED + txn_id.encode(),
                              _PREPARED_HEAD.pack(txn.revision, txn.leader_unix_ms) + txn.prepare.SerializeToString())
            for txn_id, decided in applied.decided.items():  # bounded by the records
                before = self.decided_txn(txn_id)  # LevelDB before this batch: its index row goes
                if before is not None and before.decision.request_id:
                    batch.delete(_request_index_key(before))
                if decided is None:
                    batch.delete(_DECIDED + txn_id.encode())
                else:
                    _put_decided(batch, decided)
            batch.put(_META + b"requests", _U64.pack(delta.request_count))
            batch.put(_META + b"evicted_through", _U64.pack(delta.evicted_through_ms))
            batch.put(_META + b"checkpoint", _U64.pack(delta.checkpoint))
            if delta.mark_unverified is not None:
                batch.put(_META + b"unverified", _U64.pack(delta.mark_unverified))
            elif delta.clear_unverified:
                batch.delete(_META + b"unverified")
        self.locks.change(applied.prepared)  # after the write: a failed write changed nothing
        self.recent.note(applied.changed[0], applied.changed[2])
        return applied

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Around a write to the handle: LevelDB answers every write of a handle with the error of
        its last failed background write (a memtable flush or a compaction that met a full disk)
        for as long as the handle is open, however much room the disk has again, and a follower
        retrying its replay stayed behind for good (issue 22's fourth long run). After a failed
        write the store reopens its handle, which keeps the data, as soon as the disk has room:
        here, or first thing in the next `apply` or `rewind_unverified` (`_reopen_if_room`)."""
        try:
            yield
        except plyvel.Error as exc:
            self._reopen_pending = str(exc)
            self._reopen_if_room()
            raise

    def _reopen_if_room(self) -> None:
        if self._reopen_pending is None or shutil.disk_usage(self.path).free < _REOPEN_MIN_FREE_BYTES:
            return  # nothing failed, or no room yet: the next write asks again
        log.warning("shard %d: reopening the store's LevelDB after a failed write (%s)", self.shard,
                    self._reopen_pending)
        self._db.close()
        self._db = plyvel.DB(str(self.path), **_DB_OPTIONS)
        self._reopen_pending = None
        self.recent.reset(self.read_revision)  # whatever the failed write left, nothing below is known

    def _stored_requests(self) -> Iterator[tuple[int, str, int]]:
        """(revision, request id, leader ms) of the kept ids, oldest first, read lazily: an apply
        that forgets nothing reads only the first row."""
        for raw_key, raw_value in self._db.iterator(prefix=_REQUEST_ORDER):
            revision = int(_U64.unpack_from(raw_key, len(_REQUEST_ORDER))[0])
            yield revision, raw_key[len(_REQUEST_ORDER) + _U64.size:].decode(), int(_U64.unpack(raw_value)[0])

    def load_snapshot(self, key_batches: Iterable[Sequence[tuple[bytes, bytes]]],
                      request_batches: Iterable[Sequence[RequestRecord]], *, checkpoint: int,
                      evicted_through_ms: int, on_progress: Callable[[int, int], None] | None = None,
                      prepared: Iterable[PreparedTxn] = (), decided: Iterable[DecidedTxn] = ()) -> None:
        """Replace this replica by a snapshot's state at `checkpoint` (its cut). Keys come with
        their state already encoded (`KeyState.encode`, or `kvstore.storage.snapshot.encode_states` for a
        whole column at once: this is the hot loop of a bootstrap).

        The directory is wiped first and marked `m:loading` until the last write batch, which
        sets the checkpoint and drops the mark: a load cut short by a crash leaves a directory
        that `_suspect` wipes at the next open, never a half state that looks whole.
        `on_progress(keys, requests)` is told the totals after each write batch. `prepared`: the
        cross-shard transactions prepared at the cut (their locks; bounded by MAX_PREPARED_TXNS);
        `decided`: the decision table at the cut (the decisions not forgotten by then).
        """
        assert checkpoint >= 0 and evicted_through_ms >= 0
        self._held = None  # keys arrive here without `apply`: the filter would not know them
        self._db.close()
        shutil.rmtree(self.path, ignore_errors=True)
        self._db = plyvel.DB(str(self.path), **_DB_OPTIONS)
        self._reopen_pending = None
        self.rebuilt_reason = None
        self.locks = LockIndex()
        self._initialise(self._db)
        self._db.put(_META + b"loading", b"1", sync=True)
        keys = requests = 0
        for batch_rows in key_batches:
            with self._db.write_batch(transaction=True) as batch:
                for key, encoded in batch_rows:
                    batch.put(_DATA + key, encoded)
            keys += len(batch_rows)
            if on_progress is not None:
                on_progress(keys, requests)
        for request_rows in request_batches:
            with self._db.write_batch(transaction=True) as batch:
                for req in request_rows:
                    assert req.revision < checkpoint, f"request {req.request_id} at {req.revision} >= cut {checkpoint}"
                    rid = req.request_id.encode()
                    head = _REQUEST_HEAD.pack(req.revision, req.leader_unix_ms, req.kind)
                    batch.put(_REQUEST + rid, head + req.response)
                    batch.put(_REQUEST_ORDER + _U64.pack(req.revision) + rid, _U64.pack(req.leader_unix_ms))
            requests += len(request_rows)
            if on_progress is not None:
                on_progress(keys, requests)
        locks = LockIndex()
        with self._db.write_batch(sync=True, transaction=True) as batch:
            for txn in prepared:
                assert txn.revision < checkpoint, f"{txn.txn_id} prepared at {txn.revision} >= cut {checkpoint}"
                locks.add(txn)
                batch.put(_PREPARED + txn.txn_id.encode(),
                          _PREPARED_HEAD.pack(txn.revision, txn.leader_unix_ms) + txn.prepare.SerializeToString())
            for row in decided:
                assert row.revision < checkpoint, f"{row.txn_id} decided at {row.revision} >= cut {checkpoint}"
                _put_decided(batch, row)
            batch.put(_META + b"requests", _U64.pack(requests))
            batch.put(_META + b"evicted_through", _U64.pack(evicted_through_ms))
            batch.put(_META + b"checkpoint", _U64.pack(checkpoint))
            batch.delete(_META + b"unverified")
            batch.delete(_META + b"loading")
        self.locks = locks
        self.recent.reset(checkpoint)

    def rewind_unverified(self) -> bool:
        """Move the checkpoint back over the slot a leader assumed its commit marker took, so
        that the next replay reads it (docs/design.md §4.1: the marker's slot is assumed, not observed):
        if a writer that bypassed the guard slipped a record in there, every replica applies it.
        True if it moved. Nothing this store applied lies in that slot."""
        self._reopen_if_room()
        unverified = self.unverified
        if unverified is None or not past_marker(self.applied_offset, unverified):
            return False
        with self._writing(), self._db.write_batch(sync=True, transaction=True) as batch:
            batch.put(_META + b"checkpoint", _U64.pack(unverified))
            batch.delete(_META + b"unverified")
        return True


def prepared_digest(prepared: Iterable[PreparedTxn]) -> str:
    """`ShardStore.prepared_digest` of a prepared table (a snapshot's manifest carries it)."""
    h = hashlib.sha256()
    rows = sorted(prepared, key=lambda txn: txn.txn_id)
    h.update(_U64.pack(len(rows)))
    for txn in rows:  # bounded by MAX_PREPARED_TXNS
        body = txn.prepare.SerializeToString(deterministic=True)
        tid = txn.txn_id.encode()
        h.update(_PREPARED_HEAD.pack(txn.revision, txn.leader_unix_ms) + _U64.pack(len(tid)) + tid
                 + _U64.pack(len(body)) + body)
    return h.hexdigest()


def _put_decided(batch: plyvel._plyvel.WriteBatch, row: DecidedTxn) -> None:
    """A decision table row, and its index row when the decision carries a client request id."""
    body = row.decision.SerializeToString()
    batch.put(_DECIDED + row.txn_id.encode(), _DECIDED_HEAD.pack(row.revision, row.leader_unix_ms, len(body)) + body
              + row.response)
    if row.decision.request_id:
        batch.put(_request_index_key(row), row.txn_id.encode())


def _request_index_prefix(request_id: str) -> bytes:
    """Length-prefixed: a request id may hold any byte, and one id must never prefix another's rows."""
    rid = request_id.encode()
    return _DECIDED_BY_REQUEST + _U64.pack(len(rid)) + rid


def _request_index_key(row: DecidedTxn) -> bytes:
    return _request_index_prefix(row.decision.request_id) + _U64.pack(row.revision)


def _decode_decided(txn_id: str, raw: bytes) -> DecidedTxn:
    revision, leader_ms, length = _DECIDED_HEAD.unpack_from(raw)
    end = _DECIDED_HEAD.size + length
    if end > len(raw):
        raise StorageError(f"the decision of {txn_id} is truncated ({len(raw)} bytes, its decision ends at {end})")
    decision = wal_entry_pb2.TxnDecision.FromString(raw[_DECIDED_HEAD.size:end])
    if decision.txn_id != txn_id:
        raise StorageError(f"the decision table's row of {txn_id} holds {decision.txn_id}'s decision")
    return DecidedTxn(decision, revision, leader_ms, raw[end:])


def decided_digest(decided: Iterable[DecidedTxn]) -> str:
    """`ShardStore.decided_digest` of a decision table (a snapshot's manifest carries it)."""
    h = hashlib.sha256()
    rows = sorted(decided, key=lambda row: row.txn_id)
    h.update(_U64.pack(len(rows)))
    for row in rows:  # bounded by the table
        body = row.decision.SerializeToString(deterministic=True)
        tid = row.txn_id.encode()
        h.update(_PREPARED_HEAD.pack(row.revision, row.leader_unix_ms) + _U64.pack(len(tid)) + tid
                 + _U64.pack(len(body)) + body + _U64.pack(len(row.response)) + row.response)
    return h.hexdigest()
