"""A store node: the WAL topic, the replicas of the shards placed on it, and their leadership.

Placement (docs/design.md §9) is a log, `<wal topic>.placement`, which the node reads into the
one fold (kvstore.server.placement_log, kvstore.core.placement_log) and follows: it opens a copy,
joins a shard's leadership group with a caught-up replica (kvstore.server.leadership), leaves it
or drops the data only because the log says so (`kvstore.core.placement_follower.acts`). Every
`cluster_view.REFRESH_S` it also learns the members and every node's report of its copies
(kvstore.server.cluster_view): for routing, the shard map, and, on the node the membership group
makes the placement controller (kvstore.server.controller), for the controller's decisions. The
decisions are pure; here are only their I/O.

A read replica (`--follower`) holds every shard, follows them all, never leads and is no
member: placement does not count it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

import kvstore
import wal
import wal.topic
from kvstore import errors
from kvstore.core import placement_follower
from kvstore.core.placement_controller import Drain, Request, RequestRefused, is_caught_up
from kvstore.core.placement_follower import Act, Local
from kvstore.core.placement_log import CopyState, Settings
from kvstore.core.role import Role
from kvstore.core.sharding import shard_of
from kvstore.internal.v1 import peer_pb2
from kvstore.server import cluster_view
from kvstore.server.clock import process_clock
from kvstore.server.cluster_view import View
from kvstore.server.config import NodeConfig, ReplicaConfig
from kvstore.server.controller import ControllerShell, node_report
from kvstore.server.leadership import ShardLeadership
from kvstore.server.metrics import Metrics
from kvstore.server.peers import Peers
from kvstore.server.placement_log import PlacementLogReader, PlacementSettingsError, settings_problem
from kvstore.server.replica import ShardReplica
from kvstore.server.txns import Transactions
from kvstore.v1 import cluster_pb2
from wal.membership import GroupMember

log = logging.getLogger(__name__)
# The wall clock of every replica of this process: the system's, or the tests' offset seam
# (kvstore.server.clock.OFFSET_FILE_ENV; the robustness campaign makes a leader's clock jump).
_CLOCK = process_clock()

ENDS_REFRESH_S = 1.0
ENDS_FRESH_S = 2.5  # a copy's lag counts for "caught up" only against an end read this recently
RESIGN_TIMEOUT_S = 15.0  # a batch in flight gets this long to finish when a shard is handed over
SLOW_STOP_STEP_MS = 1000  # a shutdown step this slow is logged at INFO (with its time), faster ones at DEBUG
SHARD_DIR_PREFIX = "shard-"
_REPLICA_STATES = {CopyState.LEARNER: cluster_pb2.REPLICA_STATE_LEARNER,
                   CopyState.REPLICA: cluster_pb2.REPLICA_STATE_REPLICA,
                   CopyState.RETIRING: cluster_pb2.REPLICA_STATE_RETIRING}
COLD_START_REFRESH_S = 0.25  # the members are listed this often until the placement log has its settings
PEER_TIMEOUT_S = 0.5  # a peer's report of itself: a node that does not answer within this is left out
MAX_NODES_KNOWN = 1024  # client addresses kept for other nodes (a cluster has far fewer)


def shard_dir(data_dir: Path, shard: int) -> Path:
    """Where a replica of `shard` keeps its LevelDB store (kvstore.server.replica)."""
    return data_dir / f"{SHARD_DIR_PREFIX}{shard}"


def shards_on_disk(data_dir: Path, shard_count: int) -> list[int]:
    """The shards this node has a store of from an earlier run (scratch directories aside)."""
    found = []
    for path in data_dir.glob(f"{SHARD_DIR_PREFIX}*"):
        number = path.name[len(SHARD_DIR_PREFIX):]
        if number.isdigit() and int(number) < shard_count and path.is_dir():
            found.append(int(number))
    return sorted(found)


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Node:
    def __init__(self, config: NodeConfig, peers: Peers) -> None:
        """`peers`: the channels to the other nodes, which placement asks for their reports and
        cross-shard transactions send their records through; built by the caller, which closes
        them after `stop`, since the services forward over the same channels."""
        self.config = config
        self.peers = peers
        self.metrics = Metrics()
        self.replicas: dict[int, ShardReplica] = {}
        self.leaderships: dict[int, ShardLeadership] = {}
        self.view: View = cluster_view.EMPTY
        self.settings = Settings(config.shards, config.replication_factor, config.placement_grace_ms,
                                 config.placement_max_learners)
        self.log = PlacementLogReader(config.kafka, config.wal_topic, security=config.kafka_security,
                                      on_change=self._stale_set)
        self.controller: ControllerShell | None = None
        self._found_at_start: set[int] = set()  # copies on disk when the node started
        self._following: asyncio.Task[None] | None = None
        self.stopping_step = ""  # the step `stop` is in ("" when not stopping)
        self._misconfigured = False  # its settings disagree with the log's, recorded after it started
        # Called once when the node must stop by itself (the process stops it: main.py).
        self.on_fatal: Callable[[str], None] = lambda why: None
        self._unable: dict[int, str] = {}  # shard -> why its replica cannot lead now
        self._ends_read_at: dict[int, float] = {}  # shard -> when its partition end was last read (monotonic)
        self._ends_pass_s = 0.0  # how long the last pass over every copy's partition end took
        # A copy just opened: read the ends now, not after ENDS_REFRESH_S, so a learner of a short
        # log counts as caught up (and moves on) within a round, not a second later.
        self._ends_kick = asyncio.Event()
        self._membership: GroupMember | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stale = asyncio.Event()  # a rebalance happened: describe again at once
        self._started_s = time.monotonic()
        self._ready_once = False  # serving() said yes once: learners no longer take the node out
        self.address = config.address
        self._client_addresses: dict[str, str] = {}  # a node's address among nodes -> the clients' one
        # Cross-shard transactions: built here, so that every replica's `resolve_now` finds them
        # from the first one opened; their background round runs between `start` and `stop`.
        self.txns = Transactions(self, peers)

    # ---- life ----------------------------------------------------------------------------------

    async def start(self, address: str | None = None) -> None:
        """Open the replicas this node had (learners until caught up), join the membership group
        advertising `address` (the bound one when the configured port was 0), and start placing."""
        self.address = self.config.advertise or address or self.config.listen
        self._started_s = time.monotonic()
        await asyncio.to_thread(self._ensure_topic)
        if not self.config.lead:  # a read replica: every shard, no placement
            for shard in range(self.config.shards):
                self._open(shard, standby=True)
        else:
            # The cluster's settings first: a node that disagrees with them must not take part,
            # not even as a candidate controller.
            self._tasks.append(asyncio.create_task(self.log.run(), name="placement-log"))
            await self.log.read_to_end_once()
            cluster = self.log.state.settings
            problem = settings_problem(self.settings, cluster) if cluster is not None else None
            if problem is not None:
                raise PlacementSettingsError(problem)
            loop = asyncio.get_running_loop()
            self._membership = GroupMember(
                bootstrap_servers=self.config.kafka, group=self.config.leader_group, topic=self.config.wal_topic,
                member_id=self.config.node_id, address=self.address, session_timeout_ms=self.config.session_timeout_ms,
                on_assigned=lambda _: None, on_revoked=lambda _p, _l: None,
                on_rebalanced=lambda: self._wake_threadsafe(loop), security=self.config.kafka_security)
            self._membership.start()
            self.controller = ControllerShell(
                node_id=self.config.node_id, address=self.address, settings=self.settings, reader=self.log,
                bootstrap_servers=self.config.kafka, wal_topic=self.config.wal_topic,
                security=self.config.kafka_security, metrics=self.metrics)
            for shard in shards_on_disk(self.config.data_dir, self.config.shards):
                # Kept until the log says otherwise (P2); it replays its tail before it counts.
                self._open(shard, standby=True)
                self._found_at_start.add(shard)
            self._tasks.append(asyncio.create_task(self._place_loop(), name="placement"))
        self._tasks.append(asyncio.create_task(self._refresh_ends(), name="partition-ends"))
        self.txns.start()

    async def stop(self) -> None:
        """Let the cross-shard transactions under way finish (each is bounded), then hand
        leadership over (batches in flight finish, the groups reassign at once), then leave the
        membership group and stop the replicas."""
        async def cancel_tasks() -> None:
            if self._following is not None:
                self._tasks.append(self._following)
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        async def leave_leaderships() -> None:
            await asyncio.gather(*(leadership.leave() for leadership in self.leaderships.values()))
            self.leaderships.clear()

        async def close_controller() -> None:
            if self.controller is not None:
                await self.controller.close()

        async def leave_membership() -> None:
            if self._membership is not None:
                await asyncio.to_thread(self._membership.leave)

        async def stop_replicas() -> None:
            await asyncio.gather(*(replica.stop() for replica in self.replicas.values()))

        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("cross-shard transactions", self.txns.stop), ("tasks", cancel_tasks),
            ("leaderships", leave_leaderships), ("placement controller", close_controller),
            ("membership group", leave_membership), ("replicas", stop_replicas),
            ("placement log", lambda: asyncio.to_thread(self.log.close))]
        for name, step in steps:
            # Each step timed and named while it runs: a shutdown that overruns its bound (`kvstore
            # serve`) says which step it was in.
            self.stopping_step = name
            started = time.monotonic()
            await step()
            took_ms = int((time.monotonic() - started) * 1000)
            log.log(logging.INFO if took_ms >= SLOW_STOP_STEP_MS else logging.DEBUG, "stopped: %s in %d ms", name,
                    took_ms, extra={"event": "stop_step", "step": name, "took_ms": took_ms})
        self.stopping_step = ""

    def _stale_set(self) -> None:
        self._stale.set()

    def _wake_threadsafe(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.call_soon_threadsafe(self._stale.set)

    def _now_ms(self) -> int:
        return int(time.monotonic() * 1000)

    # ---- placement -----------------------------------------------------------------------------

    async def _place_loop(self) -> None:
        assert self._membership is not None
        membership = self._membership
        described_at = -cluster_view.MEMBERS_REFRESH_S
        while True:
            members = dict(self.view.members)
            described = bool(self.view.at_s)
            listing: list[str] | None = None  # the members, if the group was listed this round
            # A new cluster's controller waits for the members to stay the same for a moment before
            # its first placement: list them more often until the log has its settings.
            every_s = cluster_view.MEMBERS_REFRESH_S if self.log.state.settings else COLD_START_REFRESH_S
            if time.monotonic() - described_at >= every_s:
                try:
                    found = await asyncio.to_thread(membership.describe, cluster_view.DESCRIBE_TIMEOUT_S)
                    members = {m.member_id: m.address for m in found}
                    listing = list(members)
                    described_at = time.monotonic()
                    membership.listed(self.config.node_id in members)
                    described = True
                except Exception as exc:  # keep the last members; the next round retries
                    log.debug("describing the membership group failed: %s", exc)
            reports: list[cluster_pb2.ShardMapResponse] = []
            if described:
                reports = [self.local_view(), *await self._peer_reports(members)]
                self.view = cluster_view.from_reports(members, reports, time.monotonic())
            try:
                assert self.controller is not None
                await self.controller.step(0 in membership.owned, listing,
                                           [node_report(r, self.controller.now_ms()) for r in reports if r.nodes])
            except errors.StoreError as exc:
                log.debug("placement controller: %s", exc)
            except Exception:  # a bug: say so loudly, keep the node up, try again next round
                log.exception("the placement controller's round failed")
            # Following runs on its own (a leave waits for a batch to finish, a drop removes a
            # directory): the controller's rounds on this node must not wait for it.
            if self.log.reached_end and (self._following is None or self._following.done()):
                self._following = asyncio.create_task(self._follow_once(), name="placement-follow")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stale.wait(), cluster_view.REFRESH_S)
            self._stale.clear()

    async def _peer_reports(self, members: dict[str, str]) -> list[cluster_pb2.ShardMapResponse]:
        """Every other member's report of itself (PeerService.LocalShardView), those that answer."""
        addresses = sorted({a for node_id, a in members.items() if a and node_id != self.config.node_id})
        answers = await asyncio.gather(*(self.peer_report(address) for address in addresses))
        return [answer for answer in answers if answer is not None]

    async def peer_report(self, address: str) -> cluster_pb2.ShardMapResponse | None:
        """The node at `address` describing itself (its `local_view`), or None if it did not
        answer within PEER_TIMEOUT_S: one slow peer must not hold up placement or the shard map."""
        try:
            reply = await self.peers.peer(address).LocalShardView(peer_pb2.LocalShardViewRequest(),
                                                                  timeout=PEER_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.debug("peer %s did not describe itself: %s", address, exc)
            return None
        assert isinstance(reply, peer_pb2.LocalShardViewResponse)
        for me in reply.view.nodes[:1]:  # each node describes itself first
            if me.address and me.client_address and me.client_address != me.address:
                if len(self._client_addresses) >= MAX_NODES_KNOWN and me.address not in self._client_addresses:
                    self._client_addresses.clear()  # bounded; the next rounds learn them again
                self._client_addresses[me.address] = me.client_address
        return reply.view

    def client_address(self, address: str) -> str:
        """The address clients use for the node the other nodes reach at `address` (its
        `--advertise-client`, learned from its own report; the same address when it has none)."""
        if address == self.address:
            return self.config.advertise_client or address
        return self._client_addresses.get(address, address)

    def _local(self) -> dict[int, Local]:
        """This node's copies as it has them now (the follower's input)."""
        local = {}
        now = time.monotonic()
        for shard, replica in self.replicas.items():
            lag = max(0, replica.end_offset - replica.store.applied_offset)
            # A lag against an end read long ago says nothing (a node just back from a pause):
            # not caught up until the end was read again.
            # A slow pass (many copies, a partition without a leader) stretches the window with it.
            window_s = max(ENDS_FRESH_S, 2 * (self._ends_pass_s + ENDS_REFRESH_S))
            fresh = now - self._ends_read_at.get(shard, 0.0) <= window_s or replica.role is Role.LEADING
            local[shard] = Local(open=True, in_group=shard in self.leaderships,
                                 caught_up=fresh and is_caught_up(replica.caught_up, lag, shard in self._unable),
                                 found_at_start=shard in self._found_at_start)
        return local

    async def _follow_once(self) -> None:
        try:
            await self._follow()
        except Exception:  # a bug: say so loudly, keep the node up, try again next round
            log.exception("following the placement log failed")

    async def _follow(self) -> None:
        """Take every step the placement log asks of this node now."""
        state = self.log.state
        problem = settings_problem(self.settings, state.settings) if state.settings is not None else None
        if problem is not None:  # recorded after this node started (a cold start with another node first)
            if not self._misconfigured:
                log.error("placement: %s; this node stops", problem)
                self._misconfigured = True
                self.on_fatal(problem)
            return
        for shard, act in placement_follower.acts(state, self.config.node_id, self._local()):
            said = state.copy_state(shard, self.config.node_id)
            log.info("shard %d: %s (the placement log has %s; targets %s)", shard, act.value,
                     f"a {said.value} copy here" if said else "no copy here",
                     ", ".join(state.targets()[shard]) if state.targets() else "none yet")
            await self._take(shard, act)
            self.metrics.placement_steps.labels(step=act.value).inc()
        mine = state.held_by(self.config.node_id)
        for held in CopyState:
            self.metrics.shards_held.labels(state=held.value).set(sum(1 for s in mine.values() if s is held))
        self.metrics.moves_in_progress.set(sum(1 for copies in state.copies.values() for c in copies.values()
                                               if c is not CopyState.REPLICA))
        self.metrics.placement_skipped.set(sum(state.skipped.values()))

    async def placement_request(self, request: Request, *, forward: bool = True,
                                ) -> tuple[list[tuple[int, tuple[str, ...], tuple[str, ...]]], int]:
        """An operator's drain or move, recorded by the placement controller (this node, or the
        one the log names, over the peer channel): (the target changes, the epoch after). Raises
        InvalidRequestError (refused: the message says why; FAILED_PRECONDITION for a stale
        epoch) or UnavailableError."""
        if not self.config.lead:
            raise errors.InvalidRequestError("a read replica (--follower) takes part in no placement: ask a member")
        if self.controller is not None and self.controller.active:
            try:
                return await self.controller.request(request)
            except RequestRefused as exc:
                if exc.stale:
                    raise errors.PlacementChangedError(str(exc)) from exc
                if exc.below_r:
                    raise errors.PlacementRefusedError(str(exc)) from exc
                if exc.retry:
                    raise errors.UnavailableError(str(exc)) from exc
                raise errors.InvalidRequestError(str(exc)) from exc
        known = self.log.state.controller
        if not forward:
            raise errors.UnavailableError("this node is not the placement controller (any more): retry")
        if known is None or known.node_id == self.config.node_id or not known.address:
            raise errors.UnavailableError("no placement controller is known yet (one is being elected): retry")
        if isinstance(request, Drain):
            message = peer_pb2.PlacementRequestRequest(drain=cluster_pb2.DrainRequest(
                node_id=request.node, undo=request.undo, epoch=request.epoch, force=request.force))
        else:
            message = peer_pb2.PlacementRequestRequest(move=cluster_pb2.MoveShardRequest(
                shard=request.shard, to_node=request.to, from_node=request.source, unpin=request.unpin,
                epoch=request.epoch))
        try:
            reply = await self.peers.peer(known.address).PlacementRequest(message, timeout=30.0)
        except grpc.aio.AioRpcError as exc:
            trailing = tuple((str(k), v) for k, v in (exc.trailing_metadata() or ()))
            error = errors.from_status(exc.code(), exc.details() or "", trailing)
            if isinstance(error, errors.UnknownOutcomeError):  # lost on the way: it may have been recorded
                raise errors.UnknownOutcomeError(f"the placement controller {known.node_id} at {known.address} did not "
                                              f"answer ({error}): the request may or may not have been recorded; "
                                              "look at `kvstore placement log`") from exc
            raise error from exc
        assert isinstance(reply, peer_pb2.PlacementRequestResponse)
        return [(c.shard, tuple(c.before), tuple(c.after)) for c in reply.changes], reply.epoch

    async def _take(self, shard: int, act: Act) -> None:
        if act is Act.OPEN:
            self._open(shard, standby=True)
        elif act is Act.JOIN:
            replica = self.replicas[shard]
            self.metrics.learner_bytes.inc(await asyncio.to_thread(directory_bytes, replica.store.path))
            self._join(shard, replica)
        elif act is Act.LEAVE:
            leadership = self.leaderships.pop(shard, None)
            if leadership is not None:
                await leadership.leave()
        else:
            assert act is Act.DROP, act
            leadership = self.leaderships.pop(shard, None)
            if leadership is not None:
                await leadership.leave()
            self._found_at_start.discard(shard)
            replica = self.replicas.pop(shard)
            await replica.stop()
            path = replica.store.path
            await asyncio.to_thread(shutil.rmtree, path, True)
            self._unable.pop(shard, None)
            self.metrics.forget_shard(shard)
            self._ends_read_at.pop(shard, None)
            log.info("shard %d: dropped its replica (%s removed)", shard, path)

    def _resolve_now(self, txn_ids: tuple[str, ...]) -> None:
        for txn_id in txn_ids:
            self.txns.resolve_in_doubt(only=txn_id)

    def _open(self, shard: int, *, standby: bool) -> ShardReplica:
        assert shard not in self.replicas, shard
        replica = ShardReplica(ReplicaConfig(
            cluster=self.config.cluster, topic=self.config.wal_topic, shard=shard,
            bootstrap_servers=self.config.kafka, node_id=self.config.node_id,
            data_dir=self.config.data_dir, transaction_timeout_ms=self.config.transaction_timeout_ms,
            max_pending_writes=self.config.max_pending_writes,
            snapshot_dir=self.config.snapshot_dir or None, kafka_security=self.config.kafka_security,
            max_request_ids=self.config.max_request_ids),
            self.metrics, _CLOCK)
        assert replica.store.path == shard_dir(self.config.data_dir, shard), replica.store.path
        self.replicas[shard] = replica
        replica.leader_hint = functools.partial(self.leader_address, shard)
        replica.on_unable_to_lead = self._set_unable
        replica.resolve_now = self._resolve_now
        replica.start(lead=False, standby=standby)
        self._ends_kick.set()
        return replica

    def _join(self, shard: int, replica: ShardReplica) -> None:
        if not self.config.standby:  # from now on it follows only while it leads
            replica.set_standby(False)
        leadership = ShardLeadership(
            shard=shard, replica=replica, bootstrap_servers=self.config.kafka,
            leader_group=self.config.leader_group, topic=self.config.wal_topic, node_id=self.config.node_id,
            address=self.address, session_timeout_ms=self.config.session_timeout_ms,
            resign_timeout_s=RESIGN_TIMEOUT_S, metrics=self.metrics, security=self.config.kafka_security,
            on_rebalanced=self._stale.set)
        if shard in self._unable:
            leadership.set_unable(self._unable[shard])
        self.leaderships[shard] = leadership
        leadership.start()

    def _set_unable(self, shard: int, reason: str | None) -> None:
        if reason is None:
            self._unable.pop(shard, None)
        else:
            self._unable[shard] = reason
        leadership = self.leaderships.get(shard)
        if leadership is not None:
            leadership.set_unable(reason)

    async def _refresh_ends(self) -> None:
        """Keep every replica's last known high watermark fresh (for lag, metrics and the shard
        map), one query at a time so a slow broker cannot tie up the worker threads."""
        while True:
            started = time.monotonic()
            for shard, replica in list(self.replicas.items()):
                try:
                    end = await asyncio.to_thread(replica.ends.high_watermark, self.config.wal_topic, shard)
                except Exception as exc:  # a broker is down or moving, or the replica was dropped
                    log.debug("shard %d: high watermark: %s", shard, exc)
                    continue
                replica.end_offset = max(replica.end_offset, end)
                self._ends_read_at[shard] = time.monotonic()
            self._ends_pass_s = time.monotonic() - started
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ends_kick.wait(), ENDS_REFRESH_S)
            self._ends_kick.clear()

    # ---- what the API asks ---------------------------------------------------------------------

    def shard_for(self, key: bytes) -> int:
        return shard_of(key, self.config.shards)

    def holds_shard(self, shard: int) -> bool:
        return shard in self.replicas

    def replica(self, shard: int) -> ShardReplica:
        """This node's replica of `shard`; raises NotHeldError (a NOT_LEADER refusal naming the
        leader, so that the request is forwarded there) if it holds none."""
        replica = self.replicas.get(shard)
        if replica is None:
            raise errors.NotHeldError(shard, self.leader_address(shard) or self.replica_address(shard))
        return replica

    def leads(self, shard: int) -> bool:
        replica = self.replicas.get(shard)
        return replica is not None and replica.role is Role.LEADING

    def serving(self) -> bool:
        """Healthy once the node first placed its shards and every shard placed on it then is a
        caught-up replica in its leadership group; from then on, as long as every shard its groups
        gave it leads. A shard gained later loads as a learner without taking the node out of
        service (its requests are forwarded meanwhile). A read replica: once every replica caught up."""
        if not self.config.lead:
            return bool(self.replicas) and all(r.caught_up for r in self.replicas.values())
        targets = self.log.state.targets()
        if self._membership is None or not self._membership.joined or not targets or self._misconfigured:
            return False
        if not self._ready_once and self.config.node_id not in self.log.state.nodes:
            return False  # not a member in the log yet: the targets do not count it (its copies to come)
        if not self._ready_once:
            me = self.config.node_id
            for shard, target in enumerate(targets):
                said = self.log.state.copy_state(shard, me)
                if me in target and (said is not CopyState.REPLICA or shard not in self.leaderships):
                    return False
        for shard, leadership in self.leaderships.items():
            if not leadership.joined:
                return False
            if leadership.assigned and leadership.unable is None and not self.leads(shard):
                return False
        self._ready_once = True
        return True

    def leader_address(self, shard: int) -> str:
        """Where shard's leader is, as far as this node knows ("" if nobody right now)."""
        if self.leads(shard):
            return self.address
        leader = self.view.leader(shard)
        if leader is None or leader.member_id == self.config.node_id:
            return ""  # nobody, or a description older than our own resignation
        return leader.address or self.view.address(leader.member_id)

    def leader_id(self, shard: int) -> str:
        """The node id of shard's leader as the group chose it ("" if nobody right now): this
        node's own if it leads the shard or its group assigned it the shard."""
        leadership = self.leaderships.get(shard)
        if self.leads(shard) or (leadership is not None and leadership.assigned):
            return self.config.node_id
        leader = self.view.leader(shard)
        return leader.member_id if leader is not None and leader.member_id != self.config.node_id else ""

    def local_view(self) -> cluster_pb2.ShardMapResponse:
        """What this node knows itself: its copies of shards (each with its state), what it leads
        or was assigned, and itself (first in `nodes`). The peers build their view of the shards
        from these (`cluster_view.from_reports`), and the shard map merges them."""
        config = self.config
        security = config.kafka_security  # the mode only: the node's own login stays here
        response = cluster_pb2.ShardMapResponse(shard_count=config.shards, topic=config.wal_topic,
                                                served_by=config.node_id, kafka=cluster_pb2.KafkaInfo(
                                                    bootstrap_servers=config.kafka, security_protocol=security.protocol,
                                                    sasl_mechanism=security.mechanism))
        me = cluster_pb2.NodeInfo(node_id=config.node_id, address=self.address, can_lead=config.lead,
                                  zone=config.zone, version=kvstore.__version__,
                                  client_address=config.advertise_client or self.address)
        local = self._local()
        for shard, replica in sorted(self.replicas.items()):
            # The last known high watermark (refreshed every second): a map must answer at once,
            # also while a broker is down and offset queries hang.
            end = replica.end_offset
            applied = replica.store.applied_offset
            leading = replica.role is Role.LEADING
            if leading:
                me.leads.append(shard)
            if not config.lead:
                state = cluster_pb2.REPLICA_STATE_FOLLOWER
            else:
                said = self.log.state.copy_state(shard, config.node_id)
                state = _REPLICA_STATES[said] if said is not None else cluster_pb2.REPLICA_STATE_STRAY
            response.shards.append(cluster_pb2.ShardInfo(
                shard=shard, leader=self.leader_address(shard), term=replica.term if leading else 0,
                applied_offset=applied, end_offset=end, lag=max(0, end - applied),
                open_txn_age_ms=replica.open_txn_age_ms(), leader_id=self.leader_id(shard), leader_ready=leading,
                replicas=[cluster_pb2.ReplicaInfo(node_id=config.node_id, address=self.address, state=state,
                                                  applied_offset=applied, lag=max(0, end - applied),
                                                  caught_up=local[shard].caught_up,
                                                  # Joined, not joining: a copy counts for the
                                                  # controller's floor only once it can be elected.
                                                  in_group=shard in self.leaderships
                                                  and self.leaderships[shard].joined)]))
        response.nodes.append(me)
        response.placement_epoch = self.log.state.epoch
        if self.log.state.controller is not None:
            response.controller = self.log.state.controller.node_id
        return response

    def replica_address(self, shard: int) -> str:
        """The address of a caught-up replica of `shard` other than this node ("" if none known):
        where a stale read goes when the shard has no leader right now."""
        for node_id in sorted(self.view.in_group(shard)):
            if node_id != self.config.node_id and (address := self.view.address(node_id)):
                return address
        return ""

    def _ensure_topic(self) -> None:
        wal.ensure_wal_topic(self.config.kafka, self.config.wal_topic, self.config.shards,
                             self.config.wal_replication_factor or None, security=self.config.kafka_security)
        if self.config.lead:
            wal.topic.ensure_placement_topic(self.config.kafka, self.config.wal_topic,
                                             security=self.config.kafka_security)
