"""Leader-side evaluation of write requests: conditions in, effects out; pure.

The leader evaluates a request against its applied state plus the batch still pending
(`lookup` covers both), at the revision (WAL offset) the request's record will be appended at.
The result is the WAL entry to append (effects only, docs/design.md §5) and the response to send
once the batch commits. The response travels inside the entry, so that any replica can answer a
retry with the original result from its request-id table.

A Txn's response carries the values its gets read, and only the state tells how large they are:
so it is measured here, where it is built, and a Txn whose answer would exceed
`limits.MAX_RESPONSE_BYTES` is refused (`errors.InvalidRequestError`, limit named) before
anything of it is queued, read-only or not, instead of failing in gRPC's send cap afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvstore import errors, limits
from kvstore.core.reads import field_bytes
from kvstore.core.state import KeyState, Lookup, PreparedTxn, RequestRecord, next_key_state
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.v1 import kv_pb2

Response = (kv_pb2.PutResponse | kv_pb2.DeleteResponse | kv_pb2.TxnResponse | kv_pb2.ShardMutationsResult
            | wal_entry_pb2.TxnVote | wal_entry_pb2.TxnDecided | wal_entry_pb2.TxnResolve | wal_entry_pb2.TxnForget)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """`entry` is None when the request writes nothing (e.g. a Txn branch of only gets).
    `keys`, when given, are the keys of `entry.effects` in order: the planner then need not
    read them back out of the protobuf effects (a wrapper object per element)."""

    entry: wal_entry_pb2.WalEntry | None
    response: Response
    keys: list[bytes] | None = None
    # Cross-shard transactions' locks (docs/design.md §10), which the planner checks every write
    # against: the keys it reads without writing (a Txn's compares and gets: they conflict with an
    # exclusive lock only), the locks a prepare takes (its keys are checked instead of the
    # effects'), and the transaction whose locks a resolve releases (its own are no conflict).
    reads: Sequence[bytes] = ()
    locks: PreparedTxn | None = None
    releases: str = ""
    # A client request id the entry records as its outcome besides its own (a cross-shard
    # decision's): the planner shows it to the records after it in the batch.
    outcome: RequestRecord | None = None


def key_value(key: bytes, state: KeyState) -> kv_pb2.KeyValue:
    return kv_pb2.KeyValue(key=key, value=state.value, version=state.version,
                           mod_revision=state.mod_revision, create_revision=state.create_revision)


def _entry(request_id: str, effects: list[wal_entry_pb2.Effect], response: Response) -> wal_entry_pb2.WalEntry:
    return wal_entry_pb2.WalEntry(request_id=request_id, effects=effects, response=response.SerializeToString())


def _put_effect(key: bytes, value: bytes) -> wal_entry_pb2.Effect:
    return wal_entry_pb2.Effect(put=wal_entry_pb2.PutEffect(key=key, value=value))


def _delete_effect(key: bytes) -> wal_entry_pb2.Effect:
    return wal_entry_pb2.Effect(delete=wal_entry_pb2.DeleteEffect(key=key))


def evaluate_put(req: kv_pb2.PutRequest, lookup: Lookup, shard: int, revision: int) -> Evaluation:
    effect = _put_effect(req.key, req.value)
    new = next_key_state(lookup(req.key), effect, revision)
    assert new is not None
    response = kv_pb2.PutResponse(result=kv_pb2.WriteResult(shard=shard, revision=revision), version=new.version)
    return Evaluation(_entry(req.request_id, [effect], response), response)


def evaluate_delete(req: kv_pb2.DeleteRequest, lookup: Lookup, shard: int, revision: int) -> Evaluation:
    existed = lookup(req.key) is not None
    response = kv_pb2.DeleteResponse(result=kv_pb2.WriteResult(shard=shard, revision=revision), deleted=existed)
    return Evaluation(_entry(req.request_id, [_delete_effect(req.key)], response), response)


def evaluate_mutations(part: kv_pb2.ShardMutations, shard: int, revision: int) -> Evaluation:
    """One WriteBatch part: its mutations as effects, in order; the answer names only the
    revision. Nothing is looked up: a part has no conditions and no per-mutation results, which
    is why it is the cheap way to write many keys."""
    entry = wal_entry_pb2.WalEntry(request_id=part.request_id)
    effects = entry.effects
    for m in part.mutations:  # filled in place: half the cost of building each Effect and copying the list
        if m.delete:
            effects.add().delete.key = m.key
        else:
            put = effects.add().put
            put.key = m.key
            put.value = m.value
    response = kv_pb2.ShardMutationsResult(shard=shard, result=kv_pb2.WriteResult(shard=shard, revision=revision),
                                           mutations=len(effects))
    entry.response = response.SerializeToString()
    return Evaluation(entry, response, [m.key for m in part.mutations])


def compare_holds(compare: kv_pb2.Compare, state: KeyState | None) -> bool:
    """One compare against a key's current state. A missing key has version 0, no value."""
    target, op = compare.target, compare.op
    if op not in (kv_pb2.Compare.OP_EQUAL, kv_pb2.Compare.OP_NOT_EQUAL, kv_pb2.Compare.OP_GREATER,
                  kv_pb2.Compare.OP_LESS):
        raise ValueError(f"compare op {op} is not supported")
    if target == kv_pb2.Compare.TARGET_EXISTS:
        left: int | bytes = int(state is not None)
        right: int | bytes = int(compare.exists)
    elif target == kv_pb2.Compare.TARGET_VERSION:
        left, right = (state.version if state else 0), compare.version
    elif target == kv_pb2.Compare.TARGET_MOD_REVISION:
        left, right = (state.mod_revision if state else 0), compare.mod_revision
    elif target == kv_pb2.Compare.TARGET_VALUE:
        if state is None:
            return op == kv_pb2.Compare.OP_NOT_EQUAL
        left, right = state.value, compare.value
    else:
        raise ValueError(f"compare target {target} is not supported")
    if op == kv_pb2.Compare.OP_EQUAL:
        return left == right
    if op == kv_pb2.Compare.OP_NOT_EQUAL:
        return left != right
    if op == kv_pb2.Compare.OP_GREATER:
        return left > right  # type: ignore[operator]
    if op == kv_pb2.Compare.OP_LESS:
        return left < right  # type: ignore[operator]
    raise ValueError(f"compare op {op} is not supported")


@dataclasses.dataclass
class Branch:
    """A Txn branch's operations run against a state (`run_ops`)."""

    effects: list[wal_entry_pb2.Effect]
    keys: list[bytes]  # of `effects`, in order
    results: list[kv_pb2.TxnOpResult]
    reads: list[bytes]  # the keys its gets read
    answer_bytes: int  # the encoded results (TxnResponse.results)


def run_ops(ops: Sequence[kv_pb2.TxnOp], lookup: Lookup, write: kv_pb2.WriteResult, *, branch: str,
            max_response_bytes: int, answer_bytes: int = 0) -> Branch:
    """One branch's operations in order: puts and deletes see the writes before them, gets see
    the state before the Txn (what its compares saw). Raises InvalidRequestError (limit
    MAX_RESPONSE_BYTES) as soon as the results, with `answer_bytes` before them, exceed
    `max_response_bytes`; ValueError for an operation of no kind. Shared by the single-shard
    Txn and a cross-shard Txn's participants (`kvstore.core.txn`), so both answer alike."""
    overlay: dict[bytes, KeyState | None] = {}

    def current(key: bytes) -> KeyState | None:
        return overlay[key] if key in overlay else lookup(key)

    out = Branch([], [], [], [], answer_bytes)
    for op in ops:
        kind = op.WhichOneof("op")
        if kind == "put":
            effect = _put_effect(op.put.key, op.put.value)
            new = next_key_state(current(op.put.key), effect, write.revision)
            assert new is not None
            overlay[op.put.key] = new
            out.effects.append(effect)
            out.keys.append(op.put.key)
            out.results.append(kv_pb2.TxnOpResult(put=kv_pb2.PutResponse(result=write, version=new.version)))
        elif kind == "delete":
            existed = current(op.delete.key) is not None
            overlay[op.delete.key] = None
            out.effects.append(_delete_effect(op.delete.key))
            out.keys.append(op.delete.key)
            out.results.append(kv_pb2.TxnOpResult(delete=kv_pb2.DeleteResponse(result=write, deleted=existed)))
        elif kind == "get":
            state = lookup(op.get.key)
            get = kv_pb2.GetResponse(found=state is not None)
            if state is not None:
                get.kv.CopyFrom(key_value(op.get.key, state))
            out.reads.append(op.get.key)
            out.results.append(kv_pb2.TxnOpResult(get=get))
        else:
            raise ValueError("a Txn operation must be a put, delete or get")
        out.answer_bytes += field_bytes(out.results[-1].ByteSize())
        if out.answer_bytes > max_response_bytes:
            raise _answer_too_large(f"more than {max_response_bytes} bytes after {len(out.results)} of its "
                                    f"{len(ops)} {branch} operations", branch, max_response_bytes)
    return out


def evaluate_txn(req: kv_pb2.TxnRequest, lookup: Lookup, shard: int, revision: int, *,
                 max_response_bytes: int = limits.MAX_RESPONSE_BYTES) -> Evaluation:
    """Compares and gets see the state before the Txn; its writes apply in order. Raises
    InvalidRequestError (limit MAX_RESPONSE_BYTES) when the answer would exceed
    `max_response_bytes`; it stops reading as soon as its results do, so a Txn of many large gets
    never holds more than the budget and one value."""
    succeeded = all(compare_holds(c, lookup(c.key)) for c in req.compares)
    branch = "success" if succeeded else "failure"
    write = kv_pb2.WriteResult(shard=shard, revision=revision)
    ran = run_ops(req.success if succeeded else req.failure, lookup, write, branch=branch,
                  max_response_bytes=max_response_bytes)
    reads = [c.key for c in req.compares] + ran.reads
    if not ran.effects and not (req.request_id and _may_write(req)):
        # Only gets, whichever branch: nothing to record, answered after a read barrier.
        response = kv_pb2.TxnResponse(succeeded=succeeded, results=ran.results,
                                      result=kv_pb2.WriteResult(shard=shard))
        _check_answer(response, branch, max_response_bytes)
        return Evaluation(None, response, reads=reads)
    # A branch that writes nothing in a Txn that could have written (a compare-and-set whose
    # compare failed) is still recorded under its request id, as an entry without effects: an
    # earlier attempt of the same id that reaches the leader late (delayed in transit past the
    # client's deadline) must find this answer and replay it, never write after the client was
    # told the other branch ran (found by the simulation, tests/sim).
    response = kv_pb2.TxnResponse(succeeded=succeeded, results=ran.results, result=write)
    _check_answer(response, branch, max_response_bytes)
    return Evaluation(_entry(req.request_id, ran.effects, response), response, ran.keys, reads=reads)


def _check_answer(response: kv_pb2.TxnResponse, branch: str, max_response_bytes: int) -> None:
    """The whole answer, its results and the rest, within the budget."""
    size = response.ByteSize()
    if size > max_response_bytes:
        raise _answer_too_large(f"{size} bytes", branch, max_response_bytes)


def _answer_too_large(size: str, branch: str, max_response_bytes: int) -> errors.InvalidRequestError:
    return errors.InvalidRequestError(
        f"the Txn's answer would be {size} (the keys and values its gets read), above MAX_RESPONSE_BYTES "
        f"({max_response_bytes}); nothing was done: read those keys with fewer gets per Txn, or with Get",
        field=branch, limit="MAX_RESPONSE_BYTES")


def _may_write(req: kv_pb2.TxnRequest) -> bool:
    return any(op.WhichOneof("op") in ("put", "delete") for op in (*req.success, *req.failure))
