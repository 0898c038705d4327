"""A simulated store node: a replica of every shard (or, with placement, of the shards the
placement log gives it), a group member, a request handler.

Why this split from the replica: a node is the unit that crashes, restarts and pauses. Its
disk (one `kvstore.core.request_window.MemoryShard` per shard: keys, request-id window,
checkpoint, the unverified marker slot, applied atomically as LevelDB's write batch) survives a
crash; everything else (replicas, producers, the
group view, queued writes) is rebuilt from the disk and the WAL when it restarts, as a real
node process is. A paused node keeps all of it and, when it wakes up, acts on what it knew
before it slept until a heartbeat answer tells it otherwise.

With placement (`World.replication_factor`), the node only follows the placement log
(`tests.sim.following`, around `kvstore.core.placement_follower.acts`): it opens a copy, joins a
shard's leadership group (`eligible` in its heartbeats), leaves it or deletes a copy only because
the log says so, and reopens the copies on its disk once it read the log after a start. It is
also a member of the controller's group (`World.controller_group`, in the same heartbeat): the
member that group assigns its one partition runs the controller (`tests.sim.controller`). It
checks P2 as it goes: a shard's group never lists it with a replica that has not caught up.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore import errors
from kvstore.core import txn
from kvstore.core.batch import Answer
from kvstore.core.replica.writes import ClientRequest, WriteRequest
from kvstore.core.request_window import MemoryShard
from kvstore.core.sharding import shard_of
from kvstore.v1 import kv_pb2
from tests.sim.controller import ControllerShell
from tests.sim.following import Following
from tests.sim.group import GroupAnswer
from tests.sim.replica import Replica
from tests.sim.scan import ScanShell
from tests.sim.scheduler import Actor
from tests.sim.txn import TxnShell
from tests.sim.world import World

Request = kv_pb2.PutRequest | kv_pb2.DeleteRequest | kv_pb2.TxnRequest | kv_pb2.GetRequest | kv_pb2.ScanRequest
ClientAnswer = Answer | kv_pb2.GetResponse | kv_pb2.ScanResponse


class Node(Actor):
    def __init__(self, name: str, world: World) -> None:
        super().__init__(name)
        self.alive = False  # until its first `restart` (the harness starts nodes at random moments)
        self.world = world
        # The disk: a store per shard it holds (every shard without placement).
        self.stores: dict[int, MemoryShard] = ({} if world.replication_factor is not None
                                               else {s: world.new_disk() for s in range(world.shards)})
        self.replicas: dict[int, Replica] = {}
        self.zone = ""  # its --zone (the harness sets it)
        self.following = Following(self)
        self.controller = ControllerShell(self)
        self.started_ms = 0
        self.joined = False
        self.assigned: frozenset[int] = frozenset()
        self.owners: tuple[str | None, ...] = (None,) * world.shards
        self.txns = TxnShell(self)
        self.scans = ScanShell(self)

    @property
    def placing(self) -> bool:
        return self.world.replication_factor is not None

    # ---- life ---------------------------------------------------------------------------------------

    def _boot(self) -> None:
        """Start (or restart after a crash) from what is on disk."""
        self.replicas = {}
        self.started_ms = self.world.sched.now
        self.joined = False
        self.assigned = frozenset()
        self.owners = (None,) * self.world.shards
        self.txns = TxnShell(self)  # the drivers died with the process
        for store in self.stores.values():
            store.restarted()
        # With placement, the copies on its disk are opened once the log said so (`Following`).
        self.following = Following(self)
        self.controller = ControllerShell(self)
        if self.placing:
            self.following.start()
        else:
            for shard in sorted(self.stores):
                self.open_copy(shard)
        self._heartbeat()
        self.txns.start()

    def open_copy(self, shard: int) -> None:
        """Open a replica of `shard` on its store (a new, empty one if it has none)."""
        if shard not in self.stores:
            self.stores[shard] = self.world.new_disk()
        replica = self.replicas[shard] = Replica(self.world, self, shard, self.stores[shard], self.leader_hint)
        replica.resolve_now = self.txns.kick
        replica.start()

    def drop_copy(self, shard: int) -> None:
        """Close the replica of `shard` and delete its store (placement's DROP)."""
        replica = self.replicas.pop(shard, None)
        if replica is not None:
            replica.close()
        del self.stores[shard]

    def crash(self, *, lose_disk: bool = False) -> None:
        self.world.sched.crash(self)
        self.replicas = {}
        if lose_disk:
            self.stores = {s: self.world.new_disk() for s in self.stores} if not self.placing else {}

    def restart(self) -> None:
        """Start the process (again): from what is on disk."""
        self.world.sched.restart(self)
        self._boot()

    def leader_hint(self, shard: int) -> str | None:
        owner = self.owners[shard]
        return owner if owner != self.name else None

    # ---- the group -------------------------------------------------------------------------------------

    def _eligible(self) -> frozenset[int] | None:
        """The shards whose leadership group it is in (every shard's without placement)."""
        if not self.placing:
            return None
        in_group = frozenset(self.following.in_group)
        for shard in sorted(in_group):  # P2: only a caught-up replica counts
            replica = self.replicas.get(shard)
            if replica is None or not replica.caught_up_once:
                self.world.violation(f"P2: {self.name} is in shard {shard}'s leadership group with a replica that "
                                     "has not caught up")
        return in_group

    def _heartbeat(self) -> None:
        """One heartbeat to the group coordinator, and, with placement, to the controller's group
        (one message: both coordinators are the brokers')."""
        world = self.world
        holding = frozenset(s for s, r in self.replicas.items() if r.holding)
        join = not self.joined
        name = self.name
        eligible = self._eligible()
        back = world.net.answer_to(self)
        controller_group, shell = world.controller_group, self.controller
        controller_holding, controller_join = shell.holding, not shell.joined

        def at_coordinator() -> None:
            answer = world.group.heartbeat(name, holding, join, eligible)
            if controller_group is None:
                back(lambda: self._on_group(answer))
                return
            role = controller_group.heartbeat(name, controller_holding, controller_join)

            def both() -> None:
                self._on_group(answer)
                shell.on_group(role)

            back(both)

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
                if shard in self.replicas:
                    self.replicas[shard].set_lead(False)
            return
        self.joined = True
        for shard in sorted(self.assigned - answer.assigned):
            if shard in self.replicas:
                self.replicas[shard].set_lead(False)
        for shard in sorted(answer.assigned - self.assigned):
            if shard in self.replicas:
                self.replicas[shard].set_lead(True)
            else:  # a late answer from before it left the shard's group: its group member is gone
                self.world.trace.log(f"{self.name} s{shard}: assigned without a replica (a late answer)")
        self.assigned = answer.assigned
        if self.placing:
            self.following.follow()  # a copy that caught up joins its group (re-evaluated continuously)

    # ---- requests ----------------------------------------------------------------------------------

    def handle(self, request: Request, deadline_ms: int, reply: Callable[[ClientAnswer], None]) -> None:
        """A client request arrived here (gRPC in the real node), to be answered by `deadline_ms`."""
        if not self.world.late_requests and self.world.sched.now > deadline_ms:
            return  # the client cancelled it already: gRPC drops the call (DEADLINE_EXCEEDED)
        if isinstance(request, kv_pb2.ScanRequest):
            self.scans.scan(request, reply)  # this node gathers it, wherever its shards are led
            return
        if isinstance(request, kv_pb2.TxnRequest):
            if len(txn.participants(request, self.world.shards)) > 1:
                self.txns.begin(request, reply)  # this node drives it, wherever its shards are led
                return
            key = txn.txn_keys(request)[0]
        else:
            key = request.key
        shard = shard_of(key, self.world.shards)
        replica = self.replicas.get(shard)
        if replica is None:  # placed elsewhere (or not loaded yet after a restart)
            reply(errors.NotHeldError(shard, self.leader_hint(shard)))
            return
        if isinstance(request, kv_pb2.GetRequest):
            replica.read(request.key, reply)
            return
        replica.write(ClientRequest(request, shard), None if self.world.late_requests else deadline_ms, reply)

    def handle_read(self, shard: int, keys: tuple[bytes, ...], span: tuple[bytes, bytes | None] | None,
                    read: Callable[[MemoryShard], object], reply: Callable[[object], None]) -> None:
        """A peer's read of `shard` here (a read-only Txn's part, a validation, a scan's part):
        through this node's leader's read barrier and lock wait, then `read` of the store."""
        replica = self.replicas.get(shard)
        if replica is None:
            reply(errors.NotHeldError(shard, self.leader_hint(shard)))
            return

        def ready(refused: errors.StoreError | None) -> None:
            reply(refused if refused is not None else read(replica.store))

        replica.barrier(ready, keys, span)

    def handle_record(self, shard: int, write: WriteRequest, reply: Callable[[Answer], None]) -> None:
        """A peer's call for a cross-shard transaction's record at `shard` (prepare, decision,
        resolve): queued like any write at this node's replica, refused if it holds none."""
        replica = self.replicas.get(shard)
        if replica is None:
            reply(errors.NotHeldError(shard, self.leader_hint(shard)))
            return
        replica.write(write, None, reply)
