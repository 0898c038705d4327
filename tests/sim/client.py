"""Simulated clients: sequential processes issuing Put, Delete, compare-and-set and Get on a
small key space, with request ids and retries, recording the history the checker judges.

Why they behave as they do (docs/design.md §4.1, the client's side of W7):

* a write keeps its request id and its first-attempt time across every retry, so the store can
  apply it at most once and answer a retry with the original result;
* only an error the store marks definite (`StoreError.definite`) says "nothing was written"; a
  lost answer, a timeout or an `UnknownOutcomeError` makes the outcome unknown, and a write
  with any unknown attempt stays unknown unless a later attempt returns its result;
* a client follows leader hints (`NotLeaderError`), and sometimes takes a definite failure at
  its word and gives up: that is what makes a wrong "definite" answer visible to the checker
  (a write reported failed that took effect anyway);
* every operation has a deadline; an operation that runs out of it ends unknown (writes) or
  failed (reads, which have no effect).

The history is recorded in scheduler steps: an operation is invoked at the step its first
attempt is sent and completes at the step its final answer arrives.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore import errors
from kvstore.core.sharding import shard_of
from kvstore.v1 import kv_pb2
from tests.sim.node import ClientAnswer, Node, Request
from tests.sim.scheduler import Actor

if TYPE_CHECKING:
    from tests.sim.bank import BankOp as BankOpLike
from tests.sim.world import World

ATTEMPT_TIMEOUT_MS = 1_500
OP_DEADLINE_MS = 20_000
GIVE_UP_ON_DEFINITE = 0.2  # a write whose every attempt failed definitely is abandoned with this chance

Output = tuple[object, ...]


class Kind(enum.Enum):
    PUT = "put"
    DELETE = "delete"
    CAS = "cas"  # a Txn: if value == expected (None: absent) then put(value) else get
    GET = "get"


class Outcome(enum.Enum):
    OK = "ok"
    UNKNOWN = "unknown"  # may or may not have taken effect
    FAILED = "failed"  # definitely took no effect


@dataclasses.dataclass
class Operation:
    client: int
    kind: Kind
    key: bytes
    value: bytes | None  # put, cas: the value written
    expected: bytes | None  # cas: the value compared against (None: the key must be absent)
    request_id: str
    invoke: int  # scheduler step of the first attempt
    first_attempt_ms: int
    complete: int | None = None  # step of the final answer (None while running or unknown)
    outcome: Outcome | None = None
    output: Output | None = None  # what the store answered (OK only)
    revision: int | None = None  # where an acknowledged write committed (WriteResult.revision)
    attempts: int = 0
    unknown_attempts: int = 0


class Sequential(Actor):
    """A client process running one operation at a time: attempts with a timeout, retries until
    the operation's deadline, then unknown (a write with an attempt of unknown outcome) or
    failed (the client's side of W7, the module docstring). The register clients and the bank's
    (`tests.sim.bank`) differ in what they ask and what they learn, not in this."""

    op: Operation | BankOpLike | None

    def __init__(self, name: str, world: World, nodes: Sequence[Node]) -> None:
        super().__init__(name)
        self.world = world
        self.nodes = list(nodes)
        self.op = None
        self.stopping = False
        self.done = False
        self._attempt = 0
        self._deadline = 0
        self._serial = 0

    def start(self) -> None:
        self.world.sched.at(self.world.sched.between(0, 20), self._next, self)

    def finish(self) -> None:
        """No new random operations; end with the final reads (heal phase)."""
        self.stopping = True
        self._finishing()
        if self.op is None and not self.done:
            self.world.sched.at(0, self._next, self)

    def _finishing(self) -> None:
        """What the final reads are (before the next operation starts)."""

    def _next(self) -> None:
        raise NotImplementedError

    def _send(self) -> None:
        raise NotImplementedError

    def _complete(self, outcome: Outcome, answer: ClientAnswer | None) -> None:
        raise NotImplementedError

    def _writes(self) -> bool:
        """Whether the operation running can have taken effect (its unknown attempts matter)."""
        raise NotImplementedError

    def _timed_out(self, attempt: int) -> bool:
        """`attempt` got no answer in time (if it is still the one out): it may have been applied."""
        if attempt != self._attempt:
            return False
        self._attempt = 0
        assert self.op is not None
        self.op.unknown_attempts += 1
        return True

    def _retry(self, delay_ms: int) -> None:
        op = self.op
        assert op is not None
        if self.world.sched.now + delay_ms > self._deadline:
            unknown = self._writes() and op.unknown_attempts > 0
            self._complete(Outcome.UNKNOWN if unknown else Outcome.FAILED, None)
            return
        self.world.sched.at(delay_ms, self._send, self)


class Client(Sequential):
    op: Operation | None

    def __init__(self, index: int, world: World, nodes: Sequence[Node], keys: Sequence[bytes]) -> None:
        super().__init__(f"c{index}", world, nodes)
        self.index = index
        self.keys = list(keys)
        self.history: list[Operation] = []
        self.leaders: dict[int, Node] = {}
        self._final: list[bytes] = []

    def _finishing(self) -> None:
        self._final = list(self.keys)

    # ---- operations ------------------------------------------------------------------------------------

    def _next(self) -> None:
        if self.op is not None or self.done:
            return
        sched = self.world.sched
        if self.stopping:
            if not self._final:
                self.done = True
                return
            kind, key = Kind.GET, self._final.pop(0)
        else:
            kind = sched.rng.choices((Kind.PUT, Kind.DELETE, Kind.CAS, Kind.GET), (40, 8, 27, 25))[0]
            key = sched.rng.choice(self.keys)
        self._serial += 1
        tag = f"c{self.index}-{self._serial}"
        value = tag.encode() if kind in (Kind.PUT, Kind.CAS) else None
        expected: bytes | None = None
        if kind is Kind.CAS:
            expected = self._guess(key)
        request_id = tag if kind is not Kind.GET else ""
        self.op = Operation(self.index, kind, key, value, expected, request_id, sched.steps,
                            sched.now + self.clock_skew_ms)  # its own clock, as a real client's
        self.history.append(self.op)
        self._deadline = sched.now + OP_DEADLINE_MS
        self._send()

    def _guess(self, key: bytes) -> bytes | None:
        """The value a CAS compares against: the last one this client saw for the key, so that
        some succeed and some fail."""
        for op in reversed(self.history):
            if op.key != key or op.outcome is not Outcome.OK or op.output is None:
                continue
            if op.kind is Kind.GET:
                seen = op.output[2]
            elif op.kind is Kind.CAS and op.output[1] is False:
                seen = op.output[3]
            elif op.kind is Kind.DELETE:
                seen = None
            else:
                seen = op.value
            assert seen is None or isinstance(seen, bytes)
            return seen
        return None

    def _request(self, op: Operation) -> Request:
        if op.kind is Kind.PUT:
            return kv_pb2.PutRequest(key=op.key, value=op.value, request_id=op.request_id,
                                     first_attempt_unix_ms=op.first_attempt_ms)
        if op.kind is Kind.DELETE:
            return kv_pb2.DeleteRequest(key=op.key, request_id=op.request_id, first_attempt_unix_ms=op.first_attempt_ms)
        if op.kind is Kind.GET:
            return kv_pb2.GetRequest(key=op.key)
        if op.expected is None:
            compare = kv_pb2.Compare(key=op.key, target=kv_pb2.Compare.TARGET_VERSION, op=kv_pb2.Compare.OP_EQUAL,
                                     version=0)
        else:
            compare = kv_pb2.Compare(key=op.key, target=kv_pb2.Compare.TARGET_VALUE, op=kv_pb2.Compare.OP_EQUAL,
                                     value=op.expected)
        return kv_pb2.TxnRequest(
            compares=[compare],
            success=[kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=op.key, value=op.value))],
            failure=[kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=op.key))],
            request_id=op.request_id, first_attempt_unix_ms=op.first_attempt_ms)

    # ---- attempts ----------------------------------------------------------------------------------

    def _send(self) -> None:
        op = self.op
        assert op is not None
        world = self.world
        op.attempts += 1
        shard = shard_of(op.key, world.shards)
        node = self.leaders.get(shard) or world.sched.rng.choice(self.nodes)
        self._attempt = attempt = world.next_id()
        request = self._request(op)
        back = world.net.answer_to(self, from_brokers=False)  # the node answers
        deadline = world.sched.now + ATTEMPT_TIMEOUT_MS

        def at_node() -> None:
            node.handle(request, deadline, lambda answer: back(lambda: self._on_answer(attempt, answer)))

        world.net.send(at_node, node, once=True)
        world.sched.at(ATTEMPT_TIMEOUT_MS, lambda: self._on_timeout(attempt, shard), self)

    def _on_timeout(self, attempt: int, shard: int) -> None:
        if self._timed_out(attempt):
            self.leaders.pop(shard, None)
            self._retry(self.world.sched.between(1, 50))

    def _on_answer(self, attempt: int, answer: ClientAnswer) -> None:
        if attempt != self._attempt:
            return  # a late answer to an attempt already given up on
        self._attempt = 0
        op = self.op
        assert op is not None
        if not isinstance(answer, errors.StoreError):
            self._complete(Outcome.OK, answer)
            return
        shard = shard_of(op.key, self.world.shards)
        rng_wait = self.world.sched.between
        if isinstance(answer, errors.NotLeaderError):
            hinted = [n for n in self.nodes if n.name == answer.leader_hint]
            if hinted:
                self.leaders[shard] = hinted[0]
            else:
                self.leaders.pop(shard, None)
            self._retry(rng_wait(1, 20) if hinted else rng_wait(20, 100))
            return
        if isinstance(answer, errors.InvalidRequestError):
            self.world.violation(f"client {self.index}: {op.kind.value} refused as invalid: {answer}")
            self._complete(Outcome.FAILED, None)
            return
        if isinstance(answer, errors.RequestExpiredError):
            # Its id may have been forgotten: unknown for good, unless no earlier attempt can have
            # been queued anywhere (every one was refused definitely), and this one was refused too.
            self.world.audit.counters["op_expired"] += 1
            self._complete(Outcome.UNKNOWN if op.unknown_attempts else Outcome.FAILED, None)
            return
        if not answer.definite:
            op.unknown_attempts += 1
        elif (op.kind is not Kind.GET and not op.unknown_attempts
              and self.world.sched.chance(GIVE_UP_ON_DEFINITE)):
            self._complete(Outcome.FAILED, None)
            return
        if isinstance(answer, errors.UnavailableError) and self.world.sched.chance(0.3):
            self.leaders.pop(shard, None)
        self._retry(rng_wait(5, 100))

    def _writes(self) -> bool:
        return self.op is not None and self.op.kind is not Kind.GET

    def _complete(self, outcome: Outcome, answer: ClientAnswer | None) -> None:
        op = self.op
        assert op is not None
        op.outcome = outcome
        if outcome is Outcome.OK:
            assert isinstance(answer, (kv_pb2.PutResponse, kv_pb2.DeleteResponse, kv_pb2.TxnResponse,
                                       kv_pb2.GetResponse)), answer
            op.complete = self.world.sched.steps
            op.output, op.revision = _output(op, answer)
        elif outcome is Outcome.FAILED:
            op.complete = self.world.sched.steps
        self.world.audit.counters[f"op_{outcome.value}"] += 1
        self.op = None
        self.world.sched.at(self.world.sched.between(0, 15), self._next, self)


def _output(op: Operation, answer: kv_pb2.PutResponse | kv_pb2.DeleteResponse | kv_pb2.TxnResponse
            | kv_pb2.GetResponse) -> tuple[Output, int | None]:
    """What the checker's register model must reproduce, and the write's revision."""
    if isinstance(answer, kv_pb2.GetResponse):
        assert op.kind is Kind.GET
        return ("get", answer.found, answer.kv.value if answer.found else None,
                answer.kv.version if answer.found else 0), None
    revision = answer.result.revision if answer.result.HasField("revision") else None
    if isinstance(answer, kv_pb2.PutResponse):
        assert op.kind is Kind.PUT
        return ("put", answer.version), revision
    if isinstance(answer, kv_pb2.DeleteResponse):
        assert op.kind is Kind.DELETE
        return ("delete", answer.deleted), revision
    assert op.kind is Kind.CAS and isinstance(answer, kv_pb2.TxnResponse), (op.kind, answer)
    result = answer.results[0]
    if answer.succeeded:
        return ("cas", True, result.put.version), revision
    get = result.get
    return ("cas", False, get.found, get.kv.value if get.found else None, get.kv.version if get.found else 0), revision
