"""What a cross-shard transaction's driver (`kvstore.core.txn_driver.TxnDriver`) is told and
asks for: plain data, one event answering each action that has an answer (the table in
txn_driver's docstring). Apart from the machine so that its shells (the node's
`kvstore.server.txns`, the simulation's) read what they perform without the protocol's rules."""

from __future__ import annotations

import dataclasses

from kvstore import errors
from kvstore.core.txn import Decide
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.v1 import kv_pb2

# ---- events ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Started:
    pass


@dataclasses.dataclass(frozen=True)
class Tick:
    pass


@dataclasses.dataclass(frozen=True)
class PrepareAnswered:
    shard: int
    answer: wal_entry_pb2.TxnVote | errors.StoreError


@dataclasses.dataclass(frozen=True)
class DecideAnswered:
    answer: wal_entry_pb2.TxnDecided | errors.StoreError


@dataclasses.dataclass(frozen=True)
class ResolveAnswered:
    shard: int
    answer: wal_entry_pb2.TxnResolve | errors.StoreError


@dataclasses.dataclass(frozen=True)
class PartRead:
    """A read-only Txn's part, read at one shard's leader at `revision` (its checkpoint then)."""

    vote: wal_entry_pb2.TxnVote
    revision: int


@dataclasses.dataclass(frozen=True)
class ReadAnswered:
    shard: int
    answer: PartRead | errors.StoreError


@dataclasses.dataclass(frozen=True)
class ValidateAnswered:
    shard: int
    answer: bool | errors.StoreError  # True: nothing read there changed since


Event = Started | Tick | PrepareAnswered | DecideAnswered | ResolveAnswered | ReadAnswered | ValidateAnswered

# ---- actions ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SendPrepare:
    """Ask `shard`'s leader to append this transaction's prepare (`kvstore.core.txn.prepare_write`,
    with these times: the attempt's start judges its id, the client's first attempt goes into it)."""

    shard: int
    txn_id: str
    request: kv_pb2.TxnRequest
    started_unix_ms: int
    first_attempt_unix_ms: int


@dataclasses.dataclass(frozen=True)
class SendDecide:
    """Ask the coordinator shard's leader to append the decision (`kvstore.core.txn.decision_write`)."""

    shard: int
    decide: Decide
    started_unix_ms: int


@dataclasses.dataclass(frozen=True)
class SendResolve:
    shard: int
    resolve: wal_entry_pb2.TxnResolve


@dataclasses.dataclass(frozen=True)
class SendRead:
    """Read this shard's part of a read-only Txn at its leader (linearizable, waiting for
    exclusive locks on its keys: T4), no record (`kvstore.core.txn.evaluate_read_part`)."""

    shard: int
    request: kv_pb2.TxnRequest


@dataclasses.dataclass(frozen=True)
class SendValidate:
    """Ask this shard's leader (after a read barrier and the same lock wait) whether a record at
    or after `revision` wrote any of `keys` (`kvstore.core.recent_writes`)."""

    shard: int
    keys: tuple[bytes, ...]
    revision: int


@dataclasses.dataclass(frozen=True)
class Reply:
    """The client's answer (a recovery or a finish has no client)."""

    answer: kv_pb2.TxnResponse | errors.StoreError


@dataclasses.dataclass(frozen=True)
class Forget:
    """Tell the coordinator's leader that every other participant resolved the transaction: it
    may forget the decision (a hint; lost, the coordinator's finishers resolve it again)."""

    shard: int
    txn_id: str


@dataclasses.dataclass(frozen=True)
class Finished:
    """Nothing more to do. `committed`: the decision read back (None: not learned)."""

    committed: bool | None
    in_doubt: str = ""  # a recovery that could not learn the decision: why (the prepare stays locked)


Action = SendPrepare | SendDecide | SendResolve | SendRead | SendValidate | Reply | Forget | Finished
