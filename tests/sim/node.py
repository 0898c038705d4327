"""A simulated store node: a replica of every shard, a group member, a request handler.

Why this split from the replica: a node is the unit that crashes, restarts and pauses. Its
disk (one `kvstore.core.request_window.MemoryShard` per shard: keys, request-id window,
checkpoint, the unverified marker slot, applied atomically as LevelDB's write batch) survives a
crash; everything else (replicas, producers, the
group view, queued writes) is rebuilt from the disk and the WAL when it restarts, as a real
node process is. A paused node keeps all of it and, when it wakes up, acts on what it knew
before it slept until a heartbeat answer tells it otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore import errors
from kvstore.core.batch import Answer, write_of
from kvstore.core.sharding import shard_of
from kvstore.v1 import kv_pb2
from tests.sim.group import GroupAnswer
from tests.sim.replica import Replica
from tests.sim.scheduler import Actor
from tests.sim.world import World

Request = kv_pb2.PutRequest | kv_pb2.DeleteRequest | kv_pb2.TxnRequest | kv_pb2.GetRequest
ClientAnswer = Answer | kv_pb2.GetResponse


class Node(Actor):
    def __init__(self, name: str, world: World) -> None:
        super().__init__(name)
        self.alive = False  # until its first `restart` (the harness starts nodes at random moments)
        self.world = world
        self.stores = [world.new_disk() for _ in range(world.shards)]  # the disk
        self.replicas: list[Replica] = []
        self.joined = False
        self.assigned: frozenset[int] = frozenset()
        self.owners: tuple[str | None, ...] = (None,) * world.shards

    # ---- life ---------------------------------------------------------------------------------------

    def _boot(self) -> None:
        """Start (or restart after a crash) from what is on disk."""
        self.replicas = [Replica(self.world, self, s, self.stores[s], self.leader_hint)
                         for s in range(self.world.shards)]
        self.joined = False
        self.assigned = frozenset()
        self.owners = (None,) * self.world.shards
        for replica in self.replicas:
            replica.start()
        self._heartbeat()

    def crash(self, *, lose_disk: bool = False) -> None:
        self.world.sched.crash(self)
        self.replicas = []
        if lose_disk:
            self.stores = [self.world.new_disk() for _ in range(self.world.shards)]

    def restart(self) -> None:
        """Start the process (again): from what is on disk."""
        self.world.sched.restart(self)
        self._boot()

    def leader_hint(self, shard: int) -> str | None:
        owner = self.owners[shard]
        return owner if owner != self.name else None

    # ---- the group -------------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        world = self.world
        holding = frozenset(r.shard for r in self.replicas if r.holding)
        join = not self.joined
        name = self.name
        back = world.net.answer_to(self)

        def at_coordinator() -> None:
            answer = world.group.heartbeat(name, holding, join)
            back(lambda: self._on_group(answer))

        world.net.send(at_coordinator, None, sender=self)
        world.sched.at(world.timing.heartbeat_ms, self._heartbeat, self)

    def _on_group(self, answer: GroupAnswer) -> None:
        self.owners = answer.owners
        if not answer.known:  # expelled while it slept (or never joined): drop everything, rejoin
            if self.joined:
                self.world.trace.log(f"{self.name} learns it was expelled")
            self.joined = False
            gone, self.assigned = self.assigned, frozenset()
            for shard in sorted(gone):
                self.replicas[shard].set_lead(False)
            return
        self.joined = True
        for shard in sorted(self.assigned - answer.assigned):
            self.replicas[shard].set_lead(False)
        for shard in sorted(answer.assigned - self.assigned):
            self.replicas[shard].set_lead(True)
        self.assigned = answer.assigned

    # ---- requests ----------------------------------------------------------------------------------

    def handle(self, request: Request, deadline_ms: int, reply: Callable[[ClientAnswer], None]) -> None:
        """A client request arrived here (gRPC in the real node), to be answered by `deadline_ms`."""
        if not self.world.late_requests and self.world.sched.now > deadline_ms:
            return  # the client cancelled it already: gRPC drops the call (DEADLINE_EXCEEDED)
        if isinstance(request, kv_pb2.TxnRequest) and not request.compares:
            reply(errors.InvalidRequestError("a Txn without compares"))
            return
        key = request.compares[0].key if isinstance(request, kv_pb2.TxnRequest) else request.key
        shard = shard_of(key, self.world.shards)
        replica = self.replicas[shard]
        if isinstance(request, kv_pb2.GetRequest):
            replica.read(request.key, reply)
            return
        replica.write(write_of(request, shard), None if self.world.late_requests else deadline_ms, reply)
