"""Simulated bank clients: transfers between accounts spread over every shard, as Txns with
compares (cross-shard whenever the two accounts live in different shards), and read-only Txns
that sum every account. The accounts start absent (a balance of 0), so every sum must be 0.

Why this workload (docs/design.md §10): a transfer that is applied in one shard and not the
other, applied twice, or applied after the client was told it failed changes a sum; a read-only
Txn that sees part of a transfer (no consistent cut) sees a sum that is not 0. The checker
(`tests.sim.checker.check_bank`) holds the answers against the WALs.

A transfer compares both accounts' versions with what this client last saw, so transfers race
each other: the losers take the failure branch, which reads both accounts and teaches the
client the current versions. Request ids and retries are the register clients' (W7): only a
definite refusal is a failure; a lost answer or an unknown outcome leaves the transfer unknown
unless a retry returns its result.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from kvstore import errors
from kvstore.v1 import kv_pb2
from tests.sim.client import ATTEMPT_TIMEOUT_MS, OP_DEADLINE_MS, Outcome, Sequential
from tests.sim.node import ClientAnswer, Node
from tests.sim.world import World, spread_keys


class BankKind(enum.Enum):
    TRANSFER = "transfer"
    SUM = "sum"  # a read-only Txn of every account: one cut (kvstore.core.cut)
    SCAN = "scan"  # a linearizable Scan of the accounts' prefix: one cut too
    CHECK = "check"  # a linearizable Get of one account (T4: never a decided transfer's value from before it)


@dataclasses.dataclass
class BankOp:
    client: int
    kind: BankKind
    request_id: str
    accounts: tuple[bytes, ...]
    amount: int
    invoke: int  # scheduler step of the first attempt
    complete: int | None = None
    outcome: Outcome | None = None
    succeeded: bool | None = None  # a transfer's branch (OK only)
    balances: dict[bytes, int] | None = None  # a sum's reads (OK only)
    # What the checker orders operations by (OK only): the version of each account it read (a
    # sum's gets, a failed transfer's gets, a successful transfer's compares) and wrote.
    read_versions: dict[bytes, int] = dataclasses.field(default_factory=dict)
    wrote_versions: dict[bytes, int] = dataclasses.field(default_factory=dict)
    compared: tuple[int, int] = (0, 0)  # a transfer's compared versions (what it read if it succeeded)
    attempts: int = 0
    unknown_attempts: int = 0


ACCOUNT_PREFIX = b"acct-"


def accounts(count: int, shards: int) -> list[bytes]:
    """`count` account keys, more if needed so that every shard holds one."""
    return spread_keys(ACCOUNT_PREFIX.decode(), count, shards)


def balance(value: bytes) -> int:
    return int(value) if value else 0


class BankClient(Sequential):
    op: BankOp | None

    def __init__(self, index: int, world: World, nodes: Sequence[Node], keys: Sequence[bytes]) -> None:
        super().__init__(f"bank{index}", world, nodes)
        self.index = index
        self.keys = list(keys)
        self.known: dict[bytes, tuple[int, int]] = {k: (0, 0) for k in keys}  # balance, version last seen
        self.history: list[BankOp] = []
        self._final_sum = False
        self._read_back: bytes | None = None  # an account its acknowledged transfer wrote: read it next

    # ---- operations ------------------------------------------------------------------------------------

    def _next(self) -> None:
        if self.op is not None or self.done:
            return
        sched = self.world.sched
        if self.stopping and self._final_sum:
            self.done = True
            return
        self._serial += 1
        if self.stopping or sched.chance(0.3):
            self._final_sum = self.stopping
            kind = BankKind.SCAN if sched.chance(0.4) else BankKind.SUM
            self.op = BankOp(self.index, kind, "", tuple(self.keys), 0, sched.steps)
        elif self._read_back is not None or sched.chance(0.2):
            key = self._read_back if self._read_back is not None else sched.rng.choice(self.keys)
            self._read_back = None
            self.op = BankOp(self.index, BankKind.CHECK, "", (key,), 0, sched.steps)
        else:
            a, b = sched.rng.sample(self.keys, 2)
            self.op = BankOp(self.index, BankKind.TRANSFER, f"bank{self.index}-{self._serial}", (a, b),
                             sched.between(1, 9), sched.steps)
        self._first_ms = sched.now + self.clock_skew_ms
        self.history.append(self.op)
        self._deadline = sched.now + OP_DEADLINE_MS
        self._request_cache = self._request(self.op)
        self._send()

    def _request(self, op: BankOp) -> kv_pb2.TxnRequest | kv_pb2.GetRequest | kv_pb2.ScanRequest:
        if op.kind is BankKind.CHECK:
            return kv_pb2.GetRequest(key=op.accounts[0])
        if op.kind is BankKind.SCAN:
            return kv_pb2.ScanRequest(prefix=ACCOUNT_PREFIX)
        if op.kind is BankKind.SUM:
            return kv_pb2.TxnRequest(success=[kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=k)) for k in op.accounts])
        a, b = op.accounts
        (va, ver_a), (vb, ver_b) = self.known[a], self.known[b]
        op.compared = (ver_a, ver_b)
        compares = [kv_pb2.Compare(key=k, target=kv_pb2.Compare.TARGET_VERSION, op=kv_pb2.Compare.OP_EQUAL, version=v)
                    for k, v in ((a, ver_a), (b, ver_b))]
        return kv_pb2.TxnRequest(
            compares=compares,
            success=[kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=a, value=str(va - op.amount).encode())),
                     kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=b, value=str(vb + op.amount).encode()))],
            failure=[kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=a)), kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=b))],
            request_id=op.request_id, first_attempt_unix_ms=self._first_ms)

    def _send(self) -> None:
        op = self.op
        assert op is not None
        world = self.world
        op.attempts += 1
        node = world.sched.rng.choice(self.nodes)  # any node drives a cross-shard Txn (a Get: retried until a leader)
        self._attempt = attempt = world.next_id()
        request = self._request_cache
        back = world.net.answer_to(self, from_brokers=False)

        def at_node() -> None:
            node.handle(request, world.sched.now + ATTEMPT_TIMEOUT_MS,
                        lambda answer: back(lambda: self._on_answer(attempt, answer)))

        world.net.send(at_node, node, once=True)
        world.sched.at(ATTEMPT_TIMEOUT_MS, lambda: self._on_timeout(attempt), self)

    def _on_timeout(self, attempt: int) -> None:
        if self._timed_out(attempt):
            self._retry(self.world.sched.between(1, 50))

    def _on_answer(self, attempt: int, answer: ClientAnswer) -> None:
        if attempt != self._attempt:
            return
        self._attempt = 0
        op = self.op
        assert op is not None
        if isinstance(answer, kv_pb2.TxnResponse | kv_pb2.GetResponse | kv_pb2.ScanResponse):
            self._complete(Outcome.OK, answer)
            return
        assert isinstance(answer, errors.StoreError), answer
        if isinstance(answer, errors.InvalidRequestError):
            self.world.violation(f"bank client {self.index}: {op.kind.value} refused as invalid: {answer}")
            self._complete(Outcome.FAILED, None)
            return
        if isinstance(answer, errors.RequestExpiredError):
            self._complete(Outcome.UNKNOWN if op.unknown_attempts else Outcome.FAILED, None)
            return
        if isinstance(answer, errors.TxnAbortedError):
            # The request's recorded outcome (T5): failed, whatever its earlier attempts were, so
            # this counts as definite even after an unknown one (the checker's W7 holds it to that).
            self._complete(Outcome.FAILED, None)
            return
        if not answer.definite:
            op.unknown_attempts += 1
        self._retry(self.world.sched.between(5, 100))

    def _writes(self) -> bool:
        return self.op is not None and self.op.kind is BankKind.TRANSFER

    def _complete(self, outcome: Outcome, answer: ClientAnswer | None) -> None:
        op = self.op
        assert op is not None
        op.outcome = outcome
        if outcome is not Outcome.UNKNOWN:
            op.complete = self.world.sched.steps
        if isinstance(answer, kv_pb2.GetResponse):
            op.read_versions = {op.accounts[0]: answer.kv.version if answer.found else 0}
        elif isinstance(answer, kv_pb2.ScanResponse):
            found = {kv.key: kv for kv in answer.kvs}
            op.balances = {}
            for key in op.accounts:  # an account never written is absent: balance 0, version 0
                kv = found.get(key)
                op.balances[key] = balance(kv.value) if kv is not None else 0
                op.read_versions[key] = kv.version if kv is not None else 0
                self.known[key] = (op.balances[key], op.read_versions[key])
        elif answer is not None:
            assert isinstance(answer, kv_pb2.TxnResponse), answer
            self._learn(op, answer)
        self.world.audit.counters[f"bank_{op.kind.value}_{outcome.value}"] += 1
        self.op = None
        self.world.sched.at(self.world.sched.between(0, 15), self._next, self)

    def _learn(self, op: BankOp, answer: kv_pb2.TxnResponse) -> None:
        if op.kind is BankKind.SUM:
            op.balances = {}
            for key, result in zip(op.accounts, answer.results, strict=True):
                get = result.get
                op.balances[key] = balance(get.kv.value) if get.found else 0
                op.read_versions[key] = get.kv.version if get.found else 0
                self.known[key] = (op.balances[key], op.read_versions[key])
            return
        op.succeeded = answer.succeeded
        a, b = op.accounts
        if answer.succeeded:
            (va, _), (vb, _) = self.known[a], self.known[b]
            self.known[a] = (va - op.amount, answer.results[0].put.version)
            self.known[b] = (vb + op.amount, answer.results[1].put.version)
            op.read_versions = {a: op.compared[0], b: op.compared[1]}
            op.wrote_versions = {a: answer.results[0].put.version, b: answer.results[1].put.version}
            self._read_back = b
        else:
            for key, result in zip((a, b), answer.results, strict=True):
                get = result.get
                op.read_versions[key] = get.kv.version if get.found else 0
                self.known[key] = (balance(get.kv.value) if get.found else 0, op.read_versions[key])
