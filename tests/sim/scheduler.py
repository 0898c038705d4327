"""The seeded discrete-event scheduler every simulated part runs on.

Why one scheduler: determinism. Every event of a run (a message arriving, a timer firing, a
fault) is a callback in one heap ordered by (simulated time, insertion number), and every random
choice is drawn from one `random.Random(seed)`. Nothing reads the wall clock, nothing iterates a
set of strings (whose order changes with PYTHONHASHSEED), so a seed replays exactly, in any
process. A *step* is one event taken from the heap; budgets are counted in steps.

Crashes and pauses are properties of the event's owner, an `Actor` (a node, a client):

* an actor that crashed loses every event addressed to its old incarnation (timers, messages in
  flight to it): a process that died forgets everything that was not on its disk;
* a paused actor (SIGSTOP) keeps its events: they wait, in order, and run when it resumes,
  which is how a zombie leader wakes up still believing what it believed before.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

# Simulated time is Unix milliseconds, so that the request-id horizon (kvstore.core.request_horizon)
# sees realistic clocks. Any fixed value works; this one is in 2025.
START_UNIX_MS = 1_750_000_000_000

Callback = Callable[[], None]


class Actor:
    """Something that owns events and can crash, restart, pause and resume."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.incarnation = 0
        self.alive = True
        self.paused = False
        self.deferred: list[Callback] = []
        # How far this process's wall clock is from true (simulated) time: nodes and clients
        # disagree within Timing.clock_skew_ms, the bound the request-id horizon allows for.
        self.clock_skew_ms = 0


class Scheduler:
    """Simulated time, the event heap and the run's only source of randomness."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = START_UNIX_MS
        self.steps = 0
        self._heap: list[tuple[int, int, Callback, Actor | None, int]] = []
        self._seq = 0

    def at(self, delay_ms: int, callback: Callback, actor: Actor | None = None, incarnation: int | None = None) -> None:
        """Run `callback` after `delay_ms`, on behalf of `actor` (None: the broker, the group
        coordinator and the harness, which never crash), if `actor` is then still in
        `incarnation` (default: its current one)."""
        assert delay_ms >= 0, f"negative delay {delay_ms}"
        self._seq += 1
        if incarnation is None:
            incarnation = actor.incarnation if actor is not None else 0
        heapq.heappush(self._heap, (self.now + delay_ms, self._seq, callback, actor, incarnation))

    def step(self) -> bool:
        """Take one event; False when none is left."""
        if not self._heap:
            return False
        when, _, callback, actor, incarnation = heapq.heappop(self._heap)
        self.now = when
        self.steps += 1
        if actor is not None:
            if not actor.alive or actor.incarnation != incarnation:
                return True  # addressed to a process that is gone
            if actor.paused:
                actor.deferred.append(callback)
                return True
        callback()
        return True

    # ---- faults on actors ----------------------------------------------------------------------

    def crash(self, actor: Actor) -> None:
        actor.alive = False
        actor.paused = False
        actor.incarnation += 1
        actor.deferred.clear()

    def restart(self, actor: Actor) -> None:
        assert not actor.alive
        actor.alive = True

    def pause(self, actor: Actor) -> None:
        assert actor.alive
        actor.paused = True

    def resume(self, actor: Actor) -> None:
        """The paused events run now, in the order they were due."""
        actor.paused = False
        deferred, actor.deferred = actor.deferred, []
        for callback in deferred:
            self.at(0, callback, actor)

    # ---- random draws (all from the one generator) -------------------------------------------------

    def chance(self, probability: float) -> bool:
        return probability > 0 and self.rng.random() < probability

    def between(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)
