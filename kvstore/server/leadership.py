"""Shard leadership from the consumer group (docs/design.md §6), bridged onto the node's loop.

`wal.membership.GroupMember` says which partitions this node is assigned; here a gained
partition becomes "lead shard s" and a lost one "resign shard s". Revocation waits (bounded)
until the replica finished its batch in flight and answered its clients, so a clean handover
never aborts a batch. Safety never rests on this: a node that still believes it leads is
fenced by the next leader (W4) and its appends miss their expected offsets (W2).

It also keeps the group's view (who is assigned what, at which address), refreshed every
`VIEW_REFRESH_S` and right after every rebalance, for leader hints and the shard map.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time

from kvstore.core.role import Role
from kvstore.server.metrics import Metrics
from kvstore.server.replica import ShardReplica
from wal.clients import ClientSecurity
from wal.membership import GroupMember, Member, owners

log = logging.getLogger(__name__)

VIEW_REFRESH_S = 0.5
VIEW_TIMEOUT_S = 2.0
MISSING_LIMIT_S = 5.0  # not listed by the coordinator this long (at least): rejoin


class Leadership:
    def __init__(self, *, bootstrap_servers: str, group: str, topic: str, node_id: str, address: str,
                 session_timeout_ms: int, replicas: dict[int, ShardReplica], resign_timeout_s: float,
                 metrics: Metrics | None = None, security: ClientSecurity | None = None) -> None:
        self.node_id = node_id
        self._metrics = metrics
        self.address = address
        self._replicas = replicas
        self._resign_timeout_s = resign_timeout_s
        self._missing_limit_s = max(MISSING_LIMIT_S, 3 * session_timeout_ms / 1000)
        self._loop = asyncio.get_running_loop()
        self._members: list[Member] = []
        self._owners: dict[int, Member] = {}
        self._refresh_task: asyncio.Task[None] | None = None
        self._member = GroupMember(bootstrap_servers=bootstrap_servers, group=group, topic=topic,
                                   member_id=node_id, address=address, session_timeout_ms=session_timeout_ms,
                                   on_assigned=self._assigned, on_revoked=self._revoked,
                                   on_rebalanced=self._rebalanced, security=security)
        # Set when a rebalance ended: the view is stale now, refresh it at once rather than at
        # the next tick (clients asking another node where a shard went get the new leader).
        self._view_stale = asyncio.Event()
        # Shards this node cannot lead right now (a replica rebuilding after a failed apply),
        # with why: while any, the node stays out of the group so that others lead them all.
        self.unable: dict[int, str] = {}

    def start(self) -> None:
        self._member.start()
        self._refresh_task = asyncio.create_task(self._refresh(), name="leadership-view")

    async def leave(self) -> None:
        """Resign every shard (batches in flight finish) and leave the group, so the other nodes
        take over at once instead of after the session timeout."""
        await asyncio.to_thread(self._member.leave, self._resign_timeout_s)
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            await asyncio.gather(self._refresh_task, return_exceptions=True)

    def set_unable(self, shard: int, reason: str | None) -> None:
        """A replica says it cannot lead (`reason`) or can again (None). The group has no way
        to give up one partition, so the node leaves it while any shard cannot be led, and the
        other nodes take every shard of it; it joins again once all its replicas can lead."""
        if reason is not None:
            if not self.unable:
                log.warning("shard %d cannot be led here (%s): leaving the leadership group", shard, reason)
                if self._metrics is not None:
                    self._metrics.group_leaves.inc()
            self.unable[shard] = reason
            self._member.step_aside()
            return
        self.unable.pop(shard, None)
        if not self.unable and self._member.away:
            log.info("every shard can be led here again: rejoining the leadership group")
            if self._metrics is not None:
                self._metrics.group_rejoins.inc()
            self._member.come_back()
            # If the member thread never got to leave (a quick rebuild), the group still gives
            # us these shards and nobody else leads them: lead them again.
            self._lead(sorted(self.assigned))

    @property
    def joined(self) -> bool:
        return self._member.joined

    @property
    def assigned(self) -> frozenset[int]:
        return self._member.owned

    @property
    def members(self) -> list[Member]:
        return list(self._members)

    def owner(self, shard: int) -> Member | None:
        """Who the group assigned `shard` to, as last described (this node's own view wins)."""
        if shard in self._member.owned:
            return Member(self.node_id, self.address, tuple(sorted(self._member.owned)))
        member = self._owners.get(shard)
        if member is not None and member.member_id == self.node_id:
            return None  # the description is older than our own revocation
        return member

    # ---- called on the member's thread ---------------------------------------------------------

    def _assigned(self, shards: list[int]) -> None:
        self._loop.call_soon_threadsafe(self._lead, shards)

    def _revoked(self, shards: list[int], lost: bool) -> None:
        future = asyncio.run_coroutine_threadsafe(self._resign(shards), self._loop)
        try:
            future.result(self._resign_timeout_s + 1)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:  # RuntimeError: loop closed
            log.warning("resigning shards %s did not finish: %r", shards, exc)

    def _rebalanced(self) -> None:
        self._loop.call_soon_threadsafe(self._view_stale.set)

    # ---- on the loop ---------------------------------------------------------------------------

    def _lead(self, shards: list[int]) -> None:
        for shard in shards:
            replica = self._replicas.get(shard)
            if replica is None:
                log.error("assigned partition %d but the node has no such shard", shard)
                continue
            if replica.role is Role.LEADING and replica.check_fenced():
                # Assigned a shard it leads: the member held it through a loss librdkafka declared
                # and the group gave it back in a new generation (wal.membership.settle), so
                # someone else may have fenced us meanwhile. The probe tells; fenced, the replica
                # steps down and, still assigned, takes the shard back (docs/design.md §4, W4).
                log.info("shard %d: assigned again while leading it: probing the writer", shard)
            replica.set_lead(True)

    async def _resign(self, shards: list[int]) -> None:
        started = time.monotonic()
        replicas = [self._replicas[s] for s in shards if s in self._replicas]
        await asyncio.gather(*(r.resign(self._resign_timeout_s) for r in replicas))
        log.info("resigned shards %s in %d ms", shards, (time.monotonic() - started) * 1000)
        led = [r.shard for r in replicas if r.role is Role.LEADING]
        if led:
            log.warning("shards %s still leading after resigning", led)

    async def _refresh(self) -> None:
        missing_since: float | None = None
        while True:
            try:
                members = await asyncio.to_thread(self._member.describe, VIEW_TIMEOUT_S)
                self._members = members
                self._owners = owners(members)
                # Watchdog: the coordinator's word is final. A member it has not listed for a
                # while is not in the group, whatever the local consumer believes.
                now = time.monotonic()
                if self._member.away or any(m.member_id == self.node_id for m in members):
                    missing_since = None  # out of the group on purpose, or listed
                elif missing_since is None:
                    missing_since = now
                elif now - missing_since > self._missing_limit_s:
                    log.warning("the leadership group has not listed %s for %.0fs; rejoining", self.node_id,
                                now - missing_since)
                    self._member.rejoin()
                    missing_since = None
            except Exception as exc:  # keep the last view; the next round retries
                log.debug("describing the leadership group failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._view_stale.wait(), VIEW_REFRESH_S)
            self._view_stale.clear()
