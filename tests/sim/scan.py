"""A simulated node's linearizable Scan over every shard: the node's own cut (`kvstore.core.cut`)
around peer reads, as `kvstore.server.scan.Scans.page` runs it.

Each round reads every shard's part at the node the group says leads it (its read barrier and
the wait for exclusive locks in the span, then the rows and the revision they were read at),
then, once every part is read, asks each leader whether anything in the span changed since that
revision (`kvstore.core.recent_writes`). A call that gets no answer in time fails the round's
read (the scan is refused, retriable) or counts as a change (the cut reads again). Nothing here
decides anything: the cut does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore import errors
from kvstore.core import validation
from kvstore.core.cut import Answer, Cut, CutConfig, GiveUp, ReadParts, ValidateParts
from kvstore.core.evaluate import key_value
from kvstore.core.request_window import MemoryShard
from kvstore.core.txn_driver import TxnMutation
from kvstore.v1 import kv_pb2

if TYPE_CHECKING:
    from tests.sim.node import Node

ScanReply = Callable[[kv_pb2.ScanResponse | errors.StoreError], None]
Span = tuple[bytes, bytes | None]


class ScanShell:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.world = node.world

    def scan(self, request: kv_pb2.ScanRequest, reply: ScanReply) -> None:
        """One linearizable page of the scan's range over every shard (the bank's accounts fit in
        one page)."""
        world = self.world
        start, end, _limit = validation.scan_bounds(request)
        span: Span = (start, end)
        config = CutConfig(skip_validation=TxnMutation.SCAN_WITHOUT_CUT in world.txn_mutations)
        cut = Cut(list(range(world.shards)), config)
        rows: dict[int, tuple[list[kv_pb2.KeyValue], int]] = {}
        checks: dict[int, bool] = {}
        state = {"round": 0, "over": False}

        def act(action: Any) -> None:
            if isinstance(action, ReadParts):
                state["round"] = action.round
                rows.clear()
                for shard in range(world.shards):
                    self._ask(shard, span, read_part, functools.partial(read, action.round, shard))
            elif isinstance(action, ValidateParts):
                checks.clear()
                for shard, revision in sorted(action.revisions.items()):
                    self._ask(shard, span, functools.partial(_unchanged_since, revision, span),
                              functools.partial(validated, state["round"], shard))
            elif isinstance(action, Answer):
                state["over"] = True
                merged = sorted((kv for part, _ in rows.values() for kv in part), key=lambda kv: kv.key)
                world.audit.counters["scan_rounds"] += action.rounds
                if action.rounds > 1:
                    world.audit.counters["scan_read_again"] += 1
                reply(kv_pb2.ScanResponse(kvs=merged))
            else:
                assert isinstance(action, GiveUp)
                state["over"] = True
                world.audit.counters["scan_gave_up"] += 1
                reply(action.error)

        def read_part(store: MemoryShard) -> object:
            start, end = span
            part = [key_value(k, key_state) for k, key_state in sorted(store.keys.items())
                    if start <= k and (end is None or k < end)]
            return part, store.read_revision

        def read(round_: int, shard: int, answer: object) -> None:
            if state["over"] or round_ != state["round"] or shard in rows:
                return  # late: the scan moved on
            if isinstance(answer, errors.StoreError):
                state["over"] = True
                reply(answer)  # retriable: the client asks again
                return
            assert isinstance(answer, tuple)
            rows[shard] = answer
            if len(rows) == world.shards:
                act(cut.read({s: revision for s, (_, revision) in rows.items()}))

        def validated(round_: int, shard: int, answer: object) -> None:
            if state["over"] or round_ != state["round"] or shard in checks:
                return
            checks[shard] = answer is True  # no answer counts as a change
            if len(checks) == world.shards:
                act(cut.validated([s for s, ok in sorted(checks.items()) if not ok]))

        act(cut.start())

    def _ask(self, shard: int, span: Span, read: Callable[[MemoryShard], object],
             answered: Callable[[object], None]) -> None:
        """`read` at the node the group says leads `shard` (any node if none is known), through
        its read barrier and lock wait on `span`; no answer within the call timeout is a refusal."""
        world, node = self.world, self.node
        owner = node.owners[shard]
        target = world.peers.get(owner) if owner is not None else None
        if target is None:
            target = world.peers[sorted(world.peers)[world.sched.between(0, len(world.peers) - 1)]]
        done: list[bool] = []
        back = world.net.answer_to(node, from_brokers=False)

        def deliver(answer: object) -> None:
            if not done:
                done.append(True)
                answered(answer)

        def at_target() -> None:
            target.handle_read(shard, (), span, read, lambda answer: back(lambda: deliver(answer)))

        def expire() -> None:
            deliver(errors.UnavailableError(f"no answer from {target.name} in time"))

        world.net.send(at_target, target, once=True)
        world.sched.at(world.timing.txn_call_timeout_ms, expire, node)


def _unchanged_since(revision: int, span: Span, store: MemoryShard) -> object:
    """A validation's read: whether nothing in `span` changed at `store` since `revision`."""
    return store.recent.unchanged_since(revision, span=span)
