"""The network between nodes, clients and the broker: delay, duplication, loss.

Why a model: every protocol hazard the WAL defends against is a message that arrives late or
twice. A produce that times out at the client may still land; an EndTxn whose commit_transaction
call gave up may land on a later transaction (the KIP-890 case); a retried request may arrive
after its retry. Here every request and every answer is a scheduled delivery whose delay is
drawn from the current `Conditions`; the fault injector makes them worse for a while.

A message to an actor that crashed is lost (its connections died with it); a message to a paused
actor waits in its queue. Messages to the broker (actor None) always arrive, eventually, except
from a node cut off from Kafka (`cut_off`, a network partition between one node and the
brokers while its clients still reach it: the case a leader's read barrier exists for).

Duplication is for the Kafka protocol and the group (librdkafka resends requests; a retried
request may arrive twice). A client's request to a node is never duplicated: gRPC does not
replay a call behind the client's back, and a copy the client does not know of would be an
attempt whose answer nobody reads (a write reported failed by one copy, applied by the other).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tests.sim.scheduler import Actor, Callback, Scheduler


@dataclasses.dataclass(frozen=True)
class Conditions:
    """How messages travel right now. Delays in simulated milliseconds."""

    min_delay_ms: int = 1
    max_delay_ms: int = 3
    late: float = 0.0  # probability that a message takes late_min_ms..late_max_ms
    late_min_ms: int = 200
    late_max_ms: int = 3_000
    duplicate: float = 0.0  # probability that a message is delivered twice (each copy its own delay)
    drop: float = 0.0  # probability that a message is lost
    late_end_txn: float = 0.0  # extra probability that an EndTxn (commit/abort) arrives late


CALM = Conditions()


class Network:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.conditions = CALM
        self.sent = 0
        self.duplicated = 0
        self.dropped = 0
        self.late = 0
        self.cut_off: set[str] = set()  # nodes whose requests to the brokers are lost
        self.cut_off_dropped = 0
        # The brokers are down (crashed, restarting): requests to them and answers from them are
        # lost; what a broker had written is kept (its log is on disk), so a request that landed
        # just before stays landed although nobody hears of it.
        self.brokers_down = False
        self.brokers_down_dropped = 0

    def send(self, deliver: Callback, to: Actor | None, *, end_txn: bool = False,
             incarnation: int | None = None, once: bool = False, sender: Actor | None = None) -> None:
        """Deliver `deliver` at `to` after a delay; maybe twice (unless `once`), maybe never. An
        answer is sent with the `incarnation` of its request's sender: it never reaches a
        restarted process. `sender`: who sends a request to the brokers (None: the harness)."""
        c = self.conditions
        self.sent += 1
        if to is None and sender is not None and sender.name in self.cut_off:
            self.cut_off_dropped += 1
            return
        if to is None and self.brokers_down:
            self.brokers_down_dropped += 1
            return
        if c.drop and self.sched.chance(c.drop):
            self.dropped += 1
            return
        self.sched.at(self._delay(c, end_txn), deliver, to, incarnation)
        if c.duplicate and not once and self.sched.chance(c.duplicate):
            self.duplicated += 1
            self.sched.at(self._delay(c, end_txn), deliver, to, incarnation)

    def answer_to(self, to: Actor, *, from_brokers: bool = True) -> Callable[[Callback], None]:
        """How the receiver of a request sent now by `to` answers it (over this network, to
        this incarnation of `to` only). `from_brokers`: the answerer is a broker or the group
        coordinator (its answers are lost while the brokers are down), not a node."""
        incarnation = to.incarnation

        def send_back(deliver: Callback) -> None:
            if from_brokers and self.brokers_down:
                self.brokers_down_dropped += 1
                return
            self.send(deliver, to, incarnation=incarnation)

        return send_back

    def _delay(self, c: Conditions, end_txn: bool) -> int:
        late = c.late + (c.late_end_txn if end_txn else 0.0)
        if late and self.sched.chance(late):
            self.late += 1
            return self.sched.between(c.late_min_ms, c.late_max_ms)
        return self.sched.between(c.min_delay_ms, c.max_delay_ms)
