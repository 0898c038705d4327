"""One shard's leadership, from that shard's consumer group (docs/design.md §6), bridged onto the
node's loop.

Every shard has its own group, `<cluster>.leaders.<shard>`, whose members are the shard's
caught-up replicas (kvstore.core.placement: a learner joins once caught up, a replica that is
no longer placed leaves before it drops its data). The group subscribes to the WAL topic; the
member the coordinator assigns the shard's own partition leads the shard, the other partitions
it hands out mean nothing. One group per shard because a consumer group can neither place R
replicas (it gives each partition to exactly one member) nor let a member give up one
partition: here a node joins and leaves each shard's group on its own, and a replica that
cannot lead (`set_unable`) leaves only its own shard's group. Handing out all of the topic's
partitions, not one, spreads the leaders of different shards over their replicas.

Revocation waits (bounded) until the replica finished its batch in flight and answered its
clients, so a clean handover never aborts a batch. Safety never rests on this: a node that still
believes it leads is fenced by the next leader (W4) and its appends miss their expected offsets
(W2).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable

from kvstore.core.role import Role
from kvstore.server.metrics import Metrics
from kvstore.server.replica import ShardReplica
from wal.clients import ClientSecurity
from wal.membership import GroupMember

log = logging.getLogger(__name__)


def shard_group(leader_group: str, shard: int) -> str:
    """The consumer group that elects `shard`'s leader among its replicas."""
    return f"{leader_group}.{shard}"


class ShardLeadership:
    def __init__(self, *, shard: int, replica: ShardReplica, bootstrap_servers: str, leader_group: str, topic: str,
                 node_id: str, address: str, session_timeout_ms: int, resign_timeout_s: float,
                 metrics: Metrics | None = None, security: ClientSecurity | None = None,
                 on_rebalanced: Callable[[], None] | None = None) -> None:
        self.shard = shard
        self.node_id = node_id
        self.group = shard_group(leader_group, shard)
        self._replica = replica
        self._metrics = metrics
        self._resign_timeout_s = resign_timeout_s
        self._loop = asyncio.get_running_loop()
        self._on_rebalanced = on_rebalanced
        self._member = GroupMember(bootstrap_servers=bootstrap_servers, group=self.group, topic=topic,
                                   member_id=node_id, address=address, session_timeout_ms=session_timeout_ms,
                                   on_assigned=self._assigned, on_revoked=self._revoked,
                                   on_rebalanced=self._rebalanced, security=security)
        # Why this replica cannot lead right now (a rebuild after a failed apply), or None: while
        # set, the node stays out of this shard's group, so that another replica leads it.
        self.unable: str | None = None

    def start(self) -> None:
        self._member.start()

    async def leave(self) -> None:
        """Resign (the batch in flight finishes) and leave the group, so another replica takes
        over at once instead of after the session timeout."""
        await asyncio.to_thread(self._member.leave, self._resign_timeout_s)

    def set_unable(self, reason: str | None) -> None:
        """The replica says it cannot lead (`reason`) or can again (None): leave this shard's
        group meanwhile (the others lead it), join again once it can."""
        if reason is not None:
            if self.unable is None:
                log.warning("shard %d cannot be led here (%s): leaving its leadership group", self.shard, reason)
                if self._metrics is not None:
                    self._metrics.group_leaves.inc()
            self.unable = reason
            self._member.step_aside()
            return
        self.unable = None
        if self._member.away:
            log.info("shard %d can be led here again: rejoining its leadership group", self.shard)
            if self._metrics is not None:
                self._metrics.group_rejoins.inc()
            self._member.come_back()
            # If the member thread never got to leave (a quick rebuild), the group still gives
            # us the shard and nobody else leads it: lead it again.
            if self.assigned:
                self._lead()

    @property
    def joined(self) -> bool:
        return self._member.joined

    @property
    def assigned(self) -> bool:
        """The group gave this node the shard's partition: it should lead the shard."""
        return self.shard in self._member.owned

    # ---- called on the member's thread ---------------------------------------------------------

    def _assigned(self, partitions: list[int]) -> None:
        if self.shard in partitions:
            self._loop.call_soon_threadsafe(self._lead)

    def _revoked(self, partitions: list[int], lost: bool) -> None:
        if self.shard not in partitions:
            return
        future = asyncio.run_coroutine_threadsafe(self._resign(), self._loop)
        try:
            future.result(self._resign_timeout_s + 1)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:  # RuntimeError: loop closed
            log.warning("resigning shard %d did not finish: %r", self.shard, exc)

    def _rebalanced(self) -> None:
        if self._on_rebalanced is not None:
            self._loop.call_soon_threadsafe(self._on_rebalanced)

    # ---- on the loop ---------------------------------------------------------------------------

    def _lead(self) -> None:
        replica = self._replica
        if replica.role is Role.LEADING and replica.check_fenced():
            # Assigned a shard it leads: the member held it through a loss librdkafka declared
            # and the group gave it back in a new generation (wal.membership.settle), so
            # someone else may have fenced us meanwhile. The probe tells; fenced, the replica
            # steps down and, still assigned, takes the shard back (docs/design.md §4, W4).
            log.info("shard %d: assigned again while leading it: probing the writer", self.shard)
        replica.set_lead(True)

    async def _resign(self) -> None:
        started = time.monotonic()
        await self._replica.resign(self._resign_timeout_s)
        log.info("resigned shard %d in %d ms", self.shard, (time.monotonic() - started) * 1000)
        if self._replica.role is Role.LEADING:
            log.warning("shard %d still leading after resigning", self.shard)
