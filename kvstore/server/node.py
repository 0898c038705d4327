"""A store node: the WAL topic, the replicas of the shards placed on it, and their leadership.

Placement (docs/design.md §9, kvstore.core.placement) decides which shards a node holds: every
`cluster_view.REFRESH_S` the node learns the members and every shard's replicas and leader
(kvstore.server.cluster_view), counts the live members (with a grace period), places every
shard, and takes the next step for each shard (`kvstore.core.placement.decide`): open a learner,
join the shard's leadership group once caught up (kvstore.server.leadership), leave it when the
shard is placed elsewhere and its placed replicas are all caught up, drop the data. The decisions
are pure; here are only their I/O.

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
from pathlib import Path

import grpc

import wal
import wal.control
from kvstore import errors
from kvstore.core import placement
from kvstore.core.placement import Act, Hold, ShardFacts, ShardHold
from kvstore.core.role import Role
from kvstore.core.sharding import shard_of
from kvstore.internal.v1 import peer_pb2
from kvstore.server import cluster_view
from kvstore.server.clock import process_clock
from kvstore.server.cluster_view import View
from kvstore.server.config import NodeConfig, ReplicaConfig
from kvstore.server.leadership import ShardLeadership
from kvstore.server.metrics import Metrics
from kvstore.server.peers import Peers
from kvstore.server.replica import ShardReplica
from kvstore.server.txns import Transactions
from kvstore.v1 import cluster_pb2
from wal.membership import GroupMember

log = logging.getLogger(__name__)
# The wall clock of every replica of this process: the system's, or the tests' offset seam
# (kvstore.server.clock.OFFSET_FILE_ENV; the robustness campaign makes a leader's clock jump).
_CLOCK = process_clock()

ENDS_REFRESH_S = 1.0
RESIGN_TIMEOUT_S = 15.0  # a batch in flight gets this long to finish when a shard is handed over
SHARD_DIR_PREFIX = "shard-"
_REPLICA_STATES = {Hold.LEARNING: cluster_pb2.REPLICA_STATE_LEARNER, Hold.SERVING: cluster_pb2.REPLICA_STATE_REPLICA,
                   Hold.RETIRING: cluster_pb2.REPLICA_STATE_RETIRING}
CONTROL_POLL_S = 0.5
PEER_TIMEOUT_S = 0.5  # a peer's report of itself: a node that does not answer within this is left out


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
        self.holds: dict[int, ShardHold] = {}
        self.leaderships: dict[int, ShardLeadership] = {}
        self.placement: tuple[tuple[str, ...], ...] = ()
        self.view: View = cluster_view.EMPTY
        self.liveness = placement.Liveness(config.placement_grace_ms)
        self.overrides = placement.NO_OVERRIDES  # the operators' word (drain, move), from the control topic
        self._control: wal.control.ControlLog | None = None
        self._unusable_entries: list[str] = []
        self._control_read = False  # the control topic was read to its end once (placement waits for it)
        self._unable: dict[int, str] = {}  # shard -> why its replica cannot lead now
        self._membership: GroupMember | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stale = asyncio.Event()  # a rebalance happened: describe again at once
        self._started_s = time.monotonic()
        self._ready_once = False  # serving() said yes once: learners no longer take the node out
        self.address = config.address
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
            loop = asyncio.get_running_loop()
            self._membership = GroupMember(
                bootstrap_servers=self.config.kafka, group=self.config.leader_group, topic=self.config.wal_topic,
                member_id=self.config.node_id, address=self.address, session_timeout_ms=self.config.session_timeout_ms,
                on_assigned=lambda _: None, on_revoked=lambda _p, _l: None,
                on_rebalanced=lambda: self._wake_threadsafe(loop), security=self.config.kafka_security)
            self._membership.start()
            self._control = wal.control.ControlLog(self.config.kafka, self.config.wal_topic,
                                                   security=self.config.kafka_security)
            self._tasks.append(asyncio.create_task(self._follow_control(), name="control"))
            for shard in shards_on_disk(self.config.data_dir, self.config.shards):
                self._open(shard, standby=True)  # a learner: it replays its tail before it counts
                self.holds[shard] = ShardHold(Hold.LEARNING, self._now_ms())
            self._tasks.append(asyncio.create_task(self._place_loop(), name="placement"))
        self._tasks.append(asyncio.create_task(self._refresh_ends(), name="partition-ends"))
        self.txns.start()

    async def stop(self) -> None:
        """Let the cross-shard transactions under way finish (each is bounded), then hand
        leadership over (batches in flight finish, the groups reassign at once), then leave the
        membership group and stop the replicas."""
        await self.txns.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(leadership.leave() for leadership in self.leaderships.values()))
        self.leaderships.clear()
        if self._membership is not None:
            await asyncio.to_thread(self._membership.leave)
        await asyncio.gather(*(replica.stop() for replica in self.replicas.values()))
        if self._control is not None:
            await asyncio.to_thread(self._control.close)

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
            if time.monotonic() - described_at >= cluster_view.MEMBERS_REFRESH_S:
                try:
                    listing = await asyncio.to_thread(membership.describe, cluster_view.DESCRIBE_TIMEOUT_S)
                    members = {m.member_id: m.address for m in listing}
                    described_at = time.monotonic()
                    membership.listed(self.config.node_id in members)
                    described = True
                except Exception as exc:  # keep the last members; the next round retries
                    log.debug("describing the membership group failed: %s", exc)
            if described:
                reports = [self.local_view(), *await self._peer_reports(members)]
                self.view = cluster_view.from_reports(members, reports, time.monotonic())
            try:
                # Not before the coordinator answered once and the control topic was read to its
                # end: a node that placed with only itself as a member, or without the operators'
                # overrides, would open learners for shards that are not its own.
                if self.view.at_s and self._control_read:
                    await self._place()
            except Exception:  # a bug: say so loudly, keep the node up, try again next round
                log.exception("placing shards failed")
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
        return reply.view

    async def _place(self) -> None:
        """One round: place every shard over the live members and take each shard's next step."""
        now_ms = self._now_ms()
        me = self.config.node_id
        self.liveness.observe([*self.view.members, me], now_ms)
        self.placement = placement.place(self.config.shards, self.liveness.members(now_ms),
                                         self.config.replication_factor, self.overrides)
        settled = now_ms - self._started_s * 1000 >= self.config.placement_grace_ms
        for shard, placed in enumerate(self.placement):
            replica = self.replicas.get(shard)
            facts = ShardFacts(placed_here=me in placed, placed=placed,
                               caught_up=replica is not None and replica.caught_up,
                               in_group=self.view.in_group(shard), view_settled=settled)
            held = self.holds.get(shard)
            act = placement.decide(me, held, facts, now_ms)
            if act is Act.NOTHING:
                continue
            log.info("shard %d: %s (placed on %s%s)", shard, act.value, ", ".join(placed) or "nobody",
                     f"; was {held.hold.value}" if held else "")
            await self._take(shard, act)
            hold = placement.after(held, act, now_ms)
            if hold is None:
                self.holds.pop(shard, None)
            else:
                self.holds[shard] = hold
            self.metrics.placement_steps.labels(step=act.value).inc()
        for state in Hold:
            self.metrics.shards_held.labels(state=state.value).set(
                sum(1 for h in self.holds.values() if h.hold is state))

    async def _follow_control(self) -> None:
        """Keep `overrides` as the control topic says; a change places shards again at once."""
        assert self._control is not None
        while True:
            changed = await asyncio.to_thread(self._control.poll, CONTROL_POLL_S)
            self._control_read = self._control.reached_end
            if changed:
                overrides, unusable = placement.overrides_from(self._control.entries, self.config.shards)
                if unusable != self._unusable_entries:
                    self._unusable_entries = unusable
                    if unusable:
                        log.warning("control topic %s: unusable placement entries skipped: %s", self._control.topic,
                                    ", ".join(unusable))
                if overrides != self.overrides:
                    log.info("placement overrides: drained %s, pinned %s", sorted(overrides.drained) or "none",
                             dict(overrides.pinned) or "none")
                    self.overrides = overrides
                    self._stale.set()
            await asyncio.sleep(0)

    async def set_override(self, entry: tuple[str, bytes | None], overrides: placement.Overrides,
                           ) -> list[tuple[int, tuple[str, ...], tuple[str, ...]]]:
        """Record `entry` in the control topic (every node then places shards with `overrides`)
        and take it here at once; the placement changes to expect. Raises UnavailableError."""
        if not self.config.lead:
            raise errors.InvalidRequestError("a read replica (--follower) takes part in no placement: ask a member")
        key, value = entry
        try:
            await asyncio.to_thread(wal.control.write, self.config.kafka, self.config.wal_topic, key, value,
                                    security=self.config.kafka_security)
        except ValueError as exc:  # beyond the control topic's bounds
            raise errors.InvalidRequestError(str(exc)) from exc
        except wal.WalError as exc:
            raise errors.UnavailableError(f"recording the placement change failed: {exc}; nothing may have changed, "
                                          "or it may have: ask again") from exc
        members = self.liveness.members(self._now_ms())
        before = placement.place(self.config.shards, members, self.config.replication_factor, self.overrides)
        self.overrides = overrides
        self._stale.set()
        after = placement.place(self.config.shards, members, self.config.replication_factor, overrides)
        return placement.changes(before, after)

    def members(self) -> frozenset[str]:
        """The members placement counts now (live, or away less than the grace period)."""
        return self.liveness.members(self._now_ms()) if self.config.lead else frozenset()

    async def _take(self, shard: int, act: Act) -> None:
        if act is Act.OPEN:
            self._open(shard, standby=True)
        elif act is Act.JOIN:
            replica = self.replicas[shard]
            if self.holds[shard].hold is Hold.LEARNING:
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
            replica = self.replicas.pop(shard)
            await replica.stop()
            path = replica.store.path
            await asyncio.to_thread(shutil.rmtree, path, True)
            self._unable.pop(shard, None)
            self.metrics.forget_shard(shard)
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
            for shard, replica in list(self.replicas.items()):
                try:
                    end = await asyncio.to_thread(replica.ends.high_watermark, self.config.wal_topic, shard)
                except Exception as exc:  # a broker is down or moving, or the replica was dropped
                    log.debug("shard %d: high watermark: %s", shard, exc)
                    continue
                replica.end_offset = max(replica.end_offset, end)
            await asyncio.sleep(ENDS_REFRESH_S)

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
        if self._membership is None or not self._membership.joined or not self.placement:
            return False
        if not self._ready_once:
            me = self.config.node_id
            for shard, placed in enumerate(self.placement):
                hold = self.holds.get(shard)
                if me in placed and (hold is None or hold.hold is not Hold.SERVING):
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
        response = cluster_pb2.ShardMapResponse(shard_count=config.shards, topic=config.wal_topic,
                                                served_by=config.node_id)
        me = cluster_pb2.NodeInfo(node_id=config.node_id, address=self.address, can_lead=config.lead)
        for shard, replica in sorted(self.replicas.items()):
            # The last known high watermark (refreshed every second): a map must answer at once,
            # also while a broker is down and offset queries hang.
            end = replica.end_offset
            applied = replica.store.applied_offset
            leading = replica.role is Role.LEADING
            if leading:
                me.leads.append(shard)
            hold = self.holds.get(shard)
            state = _REPLICA_STATES[hold.hold] if hold is not None else cluster_pb2.REPLICA_STATE_FOLLOWER
            response.shards.append(cluster_pb2.ShardInfo(
                shard=shard, leader=self.leader_address(shard), term=replica.term if leading else 0,
                applied_offset=applied, end_offset=end, lag=max(0, end - applied),
                open_txn_age_ms=replica.open_txn_age_ms(), leader_id=self.leader_id(shard), leader_ready=leading,
                replicas=[cluster_pb2.ReplicaInfo(node_id=config.node_id, address=self.address, state=state,
                                                  applied_offset=applied, lag=max(0, end - applied))]))
        response.nodes.append(me)
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
            wal.control.ensure_control_topic(self.config.kafka, self.config.wal_topic,
                                             security=self.config.kafka_security)
