"""What a write carries into the machine: its request, and what the core needs to plan it.

Why data and not a `kvstore.core.batch.Write`: a `Write` is the planner's view, with closures
that evaluate the request against the state at plan time. Carried in `WriteArrived`, closures
would make a trace of events unprintable and unreplayable; carried as the request, the machine
builds the `Write` itself (`write_for`) from the store it reads anyway (`StateView`, which is a
`kvstore.core.txn.TxnTables` too), so the node, the simulation and a replayed trace plan the
very same write.
"""

from __future__ import annotations

import dataclasses

from kvstore.core import txn
from kvstore.core.batch import ClientWrite, Write, write_of
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.v1 import kv_pb2


@dataclasses.dataclass(frozen=True)
class ClientRequest:
    """A client's Put, Delete, Txn or WriteBatch part, validated, for `shard`."""

    request: ClientWrite
    shard: int


@dataclasses.dataclass(frozen=True)
class PrepareTxn:
    """A participant's prepare (`kvstore.core.txn.prepare_write`)."""

    txn_id: str
    request: kv_pb2.TxnRequest
    shard: int
    shard_count: int
    started_unix_ms: int = 0
    first_attempt_unix_ms: int = 0


@dataclasses.dataclass(frozen=True)
class DecideTxn:
    """The coordinator's decision (`kvstore.core.txn.decision_write`); the two simulation
    mutations it knows ride along as data."""

    decide: txn.Decide
    shard_count: int
    started_unix_ms: int = 0
    second_decision: bool = False
    request_table_only: bool = False


@dataclasses.dataclass(frozen=True)
class ResolveTxn:
    """A participant's resolve, with the decision read from the coordinator's WAL."""

    resolve: wal_entry_pb2.TxnResolve
    first_attempt_unix_ms: int = 0


@dataclasses.dataclass(frozen=True)
class ForgetTxns:
    """The coordinator's leader forgets decisions every other participant resolved."""

    txn_ids: tuple[str, ...]


WriteRequest = ClientRequest | PrepareTxn | DecideTxn | ResolveTxn | ForgetTxns


def write_for(request: WriteRequest, tables: txn.TxnTables) -> Write:
    """The planner's `Write` for `request`, its records built against `tables` (the store)."""
    if isinstance(request, ClientRequest):
        return write_of(request.request, request.shard)
    if isinstance(request, PrepareTxn):
        return txn.prepare_write(request.txn_id, request.request, request.shard, request.shard_count, tables,
                                 started_unix_ms=request.started_unix_ms,
                                 first_attempt_unix_ms=request.first_attempt_unix_ms)
    if isinstance(request, DecideTxn):
        return txn.decision_write(request.decide, tables, shard_count=request.shard_count,
                                  started_unix_ms=request.started_unix_ms, second_decision=request.second_decision,
                                  request_table_only=request.request_table_only)
    if isinstance(request, ResolveTxn):
        return txn.resolve_write(request.resolve, first_attempt_unix_ms=request.first_attempt_unix_ms)
    return txn.forget_write(request.txn_ids, tables)
