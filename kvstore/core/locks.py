"""Cross-shard transactions' locks at one shard: the prepared table as the planner sees it; pure.

docs/design.md §10. A prepared transaction locks the keys of its prepare until its resolve: the
keys either branch writes exclusively, the keys it only compares or reads shared. The planner
(`kvstore.core.batch.plan_batch`) checks every write against them (`conflict`): a key written
conflicts with any other transaction's lock, a key only read with another's exclusive lock. A
write in conflict is not planned: the replica machine parks it and tries it again after every
apply for at most `ReplicaConfig.lock_wait_ms`, then refuses it definitely
(`errors.TxnConflictError`, retriable). Waits are bounded, so a cycle of waits between
transactions (a deadlock) lasts no longer than that bound.

`BatchLocks` is the committed table plus the prepares and resolves planned earlier in the same
batch; `LockIndex` is a table with its locks indexed by key (the memory replica's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from kvstore import errors
from kvstore.core.state import PreparedTxn

if TYPE_CHECKING:
    from kvstore.core.evaluate import Evaluation


class LockView(Protocol):
    """A shard's prepared table, as the planner reads it (the store's, or `BatchLocks`)."""

    def prepared_txn(self, txn_id: str) -> PreparedTxn | None: ...

    def lock_holders(self, key: bytes) -> Mapping[str, bool]:
        """txn id -> exclusive, of every prepared transaction locking `key`."""
        ...

    def has_locks(self) -> bool: ...

    def prepared_count(self) -> int:
        """How many transactions are prepared (bounded: `kvstore.limits.MAX_PREPARED_TXNS`)."""
        ...

    def prepared(self) -> list[PreparedTxn]:
        """Every prepared transaction (a scan's range is checked against their keys)."""
        ...


class LockIndex:
    """A prepared table with its locks indexed by key: the memory replica's, and the shape a
    store keeps (`kvstore.storage.shard_store`)."""

    def __init__(self, prepared: Iterable[PreparedTxn] = ()) -> None:
        self._txns: dict[str, PreparedTxn] = {}
        self._holders: dict[bytes, dict[str, bool]] = {}
        for txn in prepared:
            self.add(txn)

    def add(self, txn: PreparedTxn) -> None:
        assert txn.txn_id not in self._txns, f"transaction {txn.txn_id} prepared twice"
        self._txns[txn.txn_id] = txn
        for key in txn.prepare.shared_keys:
            self._holders.setdefault(key, {})[txn.txn_id] = False
        for key in txn.prepare.exclusive_keys:  # a key both read and written is exclusive
            self._holders.setdefault(key, {})[txn.txn_id] = True

    def remove(self, txn_id: str) -> None:
        txn = self._txns.pop(txn_id)
        for key in (*txn.prepare.shared_keys, *txn.prepare.exclusive_keys):
            holders = self._holders.get(key)
            if holders is not None:
                holders.pop(txn_id, None)
                if not holders:
                    del self._holders[key]

    def change(self, changes: Mapping[str, PreparedTxn | None]) -> None:
        """Apply `Applied.prepared` (in order: a txn prepared, or released)."""
        for txn_id, txn in changes.items():
            if txn is None:
                if txn_id in self._txns:
                    self.remove(txn_id)
            else:
                self.add(txn)

    def prepared_txn(self, txn_id: str) -> PreparedTxn | None:
        return self._txns.get(txn_id)

    def lock_holders(self, key: bytes) -> Mapping[str, bool]:
        return self._holders.get(key, _NONE)

    def has_locks(self) -> bool:
        return bool(self._txns)

    def prepared_count(self) -> int:
        return len(self._txns)

    def prepared(self) -> list[PreparedTxn]:
        return list(self._txns.values())



_NONE: Mapping[str, bool] = {}


class NoLocks:
    """The lock view of a replica without any prepared transaction."""

    def prepared_txn(self, txn_id: str) -> PreparedTxn | None:
        return None

    def lock_holders(self, key: bytes) -> Mapping[str, bool]:
        return _NONE

    def has_locks(self) -> bool:
        return False

    def prepared_count(self) -> int:
        return 0

    def prepared(self) -> list[PreparedTxn]:
        return []


NO_LOCKS = NoLocks()


class BatchLocks:
    """The committed locks plus those of the batch being planned (`kvstore.core.batch.plan_batch`):
    a prepare planned earlier in the batch locks, a resolve releases."""

    def __init__(self, committed: LockView) -> None:
        self._committed = committed
        self._added = LockIndex()
        self._released: set[str] = set()

    def prepared_txn(self, txn_id: str) -> PreparedTxn | None:
        if txn_id in self._released:
            return None
        return self._added.prepared_txn(txn_id) or self._committed.prepared_txn(txn_id)

    def lock_holders(self, key: bytes) -> Mapping[str, bool]:
        committed = self._committed.lock_holders(key)
        added = self._added.lock_holders(key)
        if not self._released and not added:
            return committed
        merged = {txn: exclusive for txn, exclusive in committed.items() if txn not in self._released}
        merged.update({txn: exclusive for txn, exclusive in added.items() if txn not in self._released})
        return merged

    def has_locks(self) -> bool:
        return self._committed.has_locks() or self._added.has_locks()

    def prepared_count(self) -> int:
        """An upper bound: the batch's resolves are not subtracted."""
        return self._committed.prepared_count() + self._added.prepared_count()

    def prepared(self) -> list[PreparedTxn]:
        return [p for p in (*self._committed.prepared(), *self._added.prepared()) if p.txn_id not in self._released]

    def planned(self, evaluation: Evaluation) -> None:
        """`evaluation` joins the batch: its locks are taken, or its transaction's released."""
        if evaluation.locks is not None:
            self._released.discard(evaluation.locks.txn_id)
            self._added.add(evaluation.locks)
        if evaluation.releases:
            self._released.add(evaluation.releases)


def conflict(locks: LockView, *, exclusive: Iterable[bytes], shared: Iterable[bytes] = (), request_id: str = "",
             own_txn: str = "") -> errors.StoreError | None:
    """Why a write touching these keys may not be planned now, or None. A key written
    (`exclusive`) conflicts with any lock of another transaction, a key only read (`shared`) with
    another's exclusive lock. The refusal is definite and retriable (`TxnConflictError`); when the
    holder is an attempt of the same client request (`request_id`) it says so (`same_request`):
    that attempt may still commit, so the request's outcome is unknown (W7), though this write
    was not queued."""
    if not locks.has_locks():
        return None
    for key in exclusive:
        for txn_id in locks.lock_holders(key):
            if txn_id != own_txn:
                return _refusal(locks, txn_id, key, request_id)
    for key in shared:
        for txn_id, exclusively in locks.lock_holders(key).items():
            if exclusively and txn_id != own_txn:
                return _refusal(locks, txn_id, key, request_id)
    return None


def _refusal(locks: LockView, txn_id: str, key: bytes, request_id: str) -> errors.StoreError:
    holder = locks.prepared_txn(txn_id)
    if request_id and holder is not None and holder.prepare.request_id == request_id:
        return errors.TxnConflictError(
            f"an earlier attempt of this request (transaction {txn_id}) is prepared and not decided yet: its "
            "outcome is unknown; retry with the same request id", txn_id=txn_id, same_request=True)
    return errors.TxnConflictError(
        f"key {key[:64]!r} is locked by the prepared cross-shard transaction {txn_id}; nothing was done: retry",
        txn_id=txn_id)
