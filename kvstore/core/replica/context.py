"""What every part of the replica machine shares within one step: its bounds, the store it
reads, the time the event came with, and the list of actions going out.

Why one object: the parts (`batching`, `barrier`, `catchup`) each own their state, but they
answer clients, read the checkpoint and stamp times the same way, and their actions must leave
in the one order the machine produced them (a driver performs them in that order).
"""

from __future__ import annotations

from kvstore.core.replica.actions import Action, AnswerRequest, Reply
from kvstore.core.replica.config import Mutation, ReplicaConfig, StateView


class Context:
    def __init__(self, config: ReplicaConfig, view: StateView) -> None:
        self.config = config  # a driver may replace it (`standby`): parts read it at each use
        self.shard = config.shard
        self.view = view
        self.now_ms = 0.0  # monotonic, as the event came
        self.unix_ms = 0  # wall clock, as the event came: batch stamps and request-id horizons
        self.out: list[Action] = []

    def emit(self, action: Action) -> None:
        self.out.append(action)

    def answer(self, ticket: int | None, answer: Reply) -> None:
        """A ticket None is the leader's own probe: nobody waits for it."""
        if ticket is not None:
            self.emit(AnswerRequest(ticket, answer))

    def broken(self, mutation: Mutation) -> bool:
        return mutation in self.config.mutations

    def applied(self) -> int:
        """The replica's checkpoint. Every apply this machine asks for is reported done
        (`Replayed`, `CommitApplied`) before anything reads the state again: never plan or serve
        from a state whose apply is still in the driver's hands (sim seed 4: a batch planned in
        the step that asked to apply the catch-up's records missed their request ids)."""
        return self.view.applied_offset

    def horizon(self) -> dict[str, int]:
        kwargs: dict[str, int] = {}
        if self.config.request_horizon_ms is not None:
            kwargs["horizon_ms"] = self.config.request_horizon_ms
        if self.config.clock_skew_ms is not None:
            kwargs["skew_ms"] = self.config.clock_skew_ms
        return kwargs
