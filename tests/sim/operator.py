"""An operator at the placement (P4; docs/design.md §8): `kvstore drain` (sometimes `--force`,
sometimes `--undo`) and `kvstore move` (or an unpin), each computed from the placement one node
shows (`kvstore shards`: its fold of the log, with the epoch), sent to the controller that log
names, and recorded with the answer for the checker (`tests.sim.placement_checker`).

Why stale requests on purpose: P4 says a request computed from an older placement is refused,
never merged. So some requests carry the epoch before the one seen, some are sent late (the
placement may move meanwhile), and the node asked may itself be behind the log.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvstore.core.placement_controller import Drain, Move, Request
from tests.sim.controller import ACCEPTED, NOT_CONTROLLER, RequestAnswer
from tests.sim.node import Node
from tests.sim.scheduler import Actor
from tests.sim.world import World

ANSWER_TIMEOUT_MS = 3_000


@dataclasses.dataclass(frozen=True)
class View:
    """What `kvstore shards` shows on one node: its fold of the placement log."""

    epoch: int
    members: tuple[str, ...]
    drained: tuple[str, ...]
    pinned: tuple[int, ...]
    controller: str | None
    targets: tuple[tuple[str, ...], ...]


@dataclasses.dataclass
class OperatorOp:
    request: Request
    sent_to: str
    sent_ms: int
    seen_epoch: int  # the epoch the node it asked showed (the request may name an older one)
    answer: RequestAnswer | None = None  # None: no answer came (lost, or the controller died)


class Operator(Actor):
    def __init__(self, world: World, nodes: Sequence[Node]) -> None:
        super().__init__("operator")
        self.world = world
        self.nodes = list(nodes)
        self.history: list[OperatorOp] = []
        self.on_accepted: Callable[[], None] = lambda: None  # a request that changes something was recorded

    def act(self, again: int = 1) -> None:
        """Look at the placement on some node, then send one request (told "not the controller",
        look again, `again` more times)."""
        world = self.world
        up = [n for n in self.nodes if n.alive]
        if not up:
            return
        node = world.sched.rng.choice(up)
        back = world.net.answer_to(self, from_brokers=False)

        def at_node() -> None:
            state = node.following.state
            if state.settings is None:
                return
            controller = state.controller.node_id if state.controller is not None else None
            view = View(state.epoch, tuple(sorted(state.nodes)), tuple(sorted(state.drained)),
                        tuple(sorted(state.pins)), controller, state.targets())
            back(lambda: self._decide(view, again))

        world.net.send(at_node, node)

    def _decide(self, view: View, again: int) -> None:
        sched = self.world.sched
        if view.controller is None or not view.members:
            return
        epoch = view.epoch
        if sched.chance(0.25):
            epoch -= 1  # computed from an older placement
            self.world.audit.counters["operator_stale_on_purpose"] += 1
        request: Request
        if view.drained and sched.chance(0.5):
            request = Drain(sched.rng.choice(view.drained), epoch, undo=True)
        elif sched.chance(0.5):
            request = Drain(sched.rng.choice(view.members), epoch, force=sched.chance(0.3))
        elif view.pinned and sched.chance(0.3):
            request = Move(sched.rng.choice(view.pinned), epoch, unpin=True)
        else:
            shard = sched.between(0, len(view.targets) - 1)
            others = [n for n in view.members if n not in view.targets[shard]] or list(view.members)
            request = Move(shard, epoch, to=sched.rng.choice(others))
        delay = sched.between(300, 3_000) if sched.chance(0.2) else 0  # sent late: the placement may move
        controller = view.controller
        sched.at(delay, lambda: self._send(request, controller, view.epoch, again), self)

    def _send(self, request: Request, to: str, seen_epoch: int, again: int) -> None:
        world = self.world
        peer = world.peers[to]
        op = OperatorOp(request, to, world.sched.now, seen_epoch)
        self.history.append(op)
        world.audit.counters["operator_requests"] += 1
        world.trace.log(f"OPERATOR {request} to {to}")
        back = world.net.answer_to(self, from_brokers=False)

        def reply(answer: RequestAnswer) -> None:
            back(lambda: self._answered(op, answer, again))

        def at_controller() -> None:
            if peer.placing:
                peer.controller.request(request, reply)
            else:
                reply(RequestAnswer(NOT_CONTROLLER))

        world.net.send(at_controller, peer)

    def _answered(self, op: OperatorOp, answer: RequestAnswer, again: int) -> None:
        sched = self.world.sched
        if op.answer is not None or sched.now - op.sent_ms > ANSWER_TIMEOUT_MS:
            return  # the operator stopped waiting
        op.answer = answer
        self.world.audit.counters[f"operator_{answer.kind}"] += 1
        self.world.trace.log(f"OPERATOR {op.request} answered {answer.kind}"
                             f"{' at ' + str(answer.offsets) if answer.offsets else ''} {answer.message[:120]}")
        if answer.kind == ACCEPTED and answer.offsets:
            self.on_accepted()
        if answer.kind == NOT_CONTROLLER and again > 0:
            sched.at(sched.between(200, 1_000), lambda: self.act(again - 1), self)
