"""kvstore.v1.ClusterService: the cluster as operators and clients see it, and what operators ask.

The shard map (every node's report of itself, merged here, reused briefly), a shard's digest,
the WAL's open transactions and forcing one closed (`fence`), placement (drain, move, its log)
and the cross-shard transactions left prepared (list, resolve). It answers for the whole
cluster from any node, asking the other members through their peer service where it must.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc

import wal
import wal.transactions
from kvstore import errors
from kvstore.core.placement_controller import Drain, Move
from kvstore.core.placement_log import RECENT_RECORDS
from kvstore.internal.v1 import peer_pb2
from kvstore.server import shardmap
from kvstore.server.node import PEER_TIMEOUT_S
from kvstore.v1 import cluster_pb2, cluster_pb2_grpc

if TYPE_CHECKING:
    from kvstore.server.node import Node
    from kvstore.server.peers import Peers
    from kvstore.server.replica import ShardReplica

log = logging.getLogger("kvstore.server")

# A merged shard map is reused this long, and one is merged at a time: every map asks each peer
# for its view, and clients refetch the map after each refusal. With a shard between leaders, some
# 130 clients in issue 22's campaign made each node fan out hundreds of calls a second, which kept
# two cores busy and the brokers starved. Routing tolerates a map this old (a refusal hints anyway).
SHARD_MAP_REUSE_S = 0.25
_monotonic = time.monotonic  # a seam for the reuse test (patching time.monotonic would stop asyncio's clock)


class ClusterService(cluster_pb2_grpc.ClusterServiceServicer):
    def __init__(self, node: Node, peers: Peers) -> None:
        self.node = node
        self.peers = peers
        self._merged: tuple[float, cluster_pb2.ShardMapResponse] | None = None
        self._merging: asyncio.Future[cluster_pb2.ShardMapResponse] | None = None

    async def ShardMap(self, request: cluster_pb2.ShardMapRequest,
                       context: Any) -> cluster_pb2.ShardMapResponse:
        if not self.node.config.lead:
            return shardmap.for_clients(self.node.local_view(), self.node.client_address)
        merged = self._merged
        if merged is not None and _monotonic() - merged[0] < SHARD_MAP_REUSE_S:
            return merged[1]
        if self._merging is None:
            self._merging = asyncio.ensure_future(self._merge_map())

            def done(future: asyncio.Future[cluster_pb2.ShardMapResponse]) -> None:
                self._merging = None
                if not future.cancelled() and future.exception() is None:
                    self._merged = (_monotonic(), future.result())

            self._merging.add_done_callback(done)
        # Shielded: a caller that goes away does not cancel the merge the others wait for.
        return await asyncio.shield(self._merging)

    def forget_merged_map(self) -> None:
        """The placement changed here (a move, a drain): the next map is merged afresh."""
        self._merged = None

    async def _merge_map(self) -> cluster_pb2.ShardMapResponse:
        local = self.node.local_view()
        me = self.node.config.node_id
        addresses = sorted({a for node_id, a in self.node.view.members.items() if a and node_id != me})
        answers = await asyncio.gather(*(self.node.peer_report(address) for address in addresses))
        assigned = {shard: (leader, self.node.leader_address(shard)) for shard in range(self.node.config.shards)
                    if (leader := self.node.leader_id(shard))}
        merged = shardmap.merge(local, [a for a in answers if a is not None], assigned, self.node.log.state.targets())
        return shardmap.for_clients(merged, self.node.client_address)

    async def ShardDigest(self, request: cluster_pb2.ShardDigestRequest,
                          context: Any) -> cluster_pb2.ShardDigestResponse:
        if request.shard >= self.node.config.shards:
            raise errors.InvalidRequestError(
                f"shard {request.shard} out of range: the cluster has {self.node.config.shards} shards")
        replica = self.node.replica(request.shard)
        # Digest and checkpoint in one loop step: apply runs on this loop, so they cannot disagree.
        applied = replica.store.applied_offset
        sha, keys = replica.store.digest()
        return cluster_pb2.ShardDigestResponse(node_id=self.node.config.node_id, shard=request.shard,
                                               applied_offset=applied, sha256=sha, keys=keys)

    async def ListTransactions(self, request: cluster_pb2.ListTransactionsRequest,
                               context: Any) -> cluster_pb2.ListTransactionsResponse:
        if request.older_than_ms < 0:
            raise errors.InvalidRequestError(f"older_than_ms must be >= 0, got {request.older_than_ms}")
        config = self.node.config

        def inspect(replica: ShardReplica) -> wal.transactions.OpenTransaction | None:
            return wal.transactions.open_transaction(replica.ends, config.kafka, config.wal_topic, replica.shard,
                                                     timeout_s=2.0, security=config.kafka_security)

        response = cluster_pb2.ListTransactionsResponse()
        for shard, replica in sorted(self.node.replicas.items()):
            try:
                txn = await asyncio.to_thread(inspect, replica)
            except Exception as exc:
                raise errors.UnavailableError(f"shard {shard}: cannot read the partition's offsets: {exc}") from exc
            if txn is None or txn.age_ms() < request.older_than_ms:
                continue
            response.transactions.append(cluster_pb2.TransactionInfo(
                shard=shard, first_offset=txn.first_offset, end_offset=txn.end_offset, age_ms=txn.age_ms(),
                leader_id=self.node.leader_id(shard)))
        return response

    async def FenceShard(self, request: cluster_pb2.FenceShardRequest,
                         context: Any) -> cluster_pb2.FenceShardResponse:
        if request.shard >= self.node.config.shards:
            raise errors.InvalidRequestError(
                f"shard {request.shard} out of range: the cluster has {self.node.config.shards} shards")
        replica = self.node.replica(request.shard)
        response = cluster_pb2.FenceShardResponse(shard=request.shard)
        try:
            response.end_offset = await asyncio.to_thread(wal.transactions.force_fence, replica.writer_config())
        except wal.WalError as exc:
            raise errors.UnavailableError(f"shard {request.shard}: fencing failed: {exc}") from exc
        log.warning("shard %d fenced by an operator at offset %d", request.shard, response.end_offset)
        if replica.check_fenced():
            response.notified = self.node.config.node_id
        else:
            leader = self.node.leader_address(request.shard)
            if leader:
                with contextlib.suppress(grpc.RpcError):
                    reply = await self.peers.peer(leader).CheckFenced(
                        peer_pb2.CheckFencedRequest(shard=request.shard), timeout=PEER_TIMEOUT_S * 2)
                    response.notified = reply.notified
        return response

    def _placing(self) -> None:
        if not self.node.config.lead:
            raise errors.InvalidRequestError("this node is a read replica (--follower): it takes part in no "
                                             "placement; ask a member")

    async def Drain(self, request: cluster_pb2.DrainRequest, context: Any) -> cluster_pb2.DrainResponse:
        self._placing()
        if not request.node_id:
            raise errors.InvalidRequestError("drain needs a node id", field="node_id")
        changes, epoch = await self.node.placement_request(
            Drain(request.node_id, _epoch(request.epoch), undo=request.undo, force=request.force))
        self.forget_merged_map()
        log.warning("placement: %s %s by an operator (%d shards to move, epoch %d)",
                    "undrained" if request.undo else "drained", request.node_id, len(changes), epoch)
        return cluster_pb2.DrainResponse(changes=_changes(changes), epoch=epoch)

    async def MoveShard(self, request: cluster_pb2.MoveShardRequest, context: Any) -> cluster_pb2.MoveShardResponse:
        self._placing()
        shards = self.node.config.shards
        if request.shard >= shards:
            raise errors.InvalidRequestError(f"shard {request.shard} out of range: the cluster has {shards} shards",
                                             field="shard")
        if request.unpin and (request.to_node or request.from_node):
            raise errors.InvalidRequestError("unpin takes no to_node or from_node", field="unpin")
        if not request.unpin and not request.to_node:
            raise errors.InvalidRequestError("a move needs to_node (or unpin)", field="to_node")
        changes, epoch = await self.node.placement_request(
            Move(request.shard, _epoch(request.epoch), to=request.to_node, source=request.from_node,
                 unpin=request.unpin))
        self.forget_merged_map()
        log.warning("placement: shard %d %s by an operator (epoch %d)", request.shard,
                    "unpinned" if request.unpin else f"moved to {request.to_node}", epoch)
        return cluster_pb2.MoveShardResponse(changes=_changes(changes), epoch=epoch)

    async def PlacementLog(self, request: cluster_pb2.PlacementLogRequest,
                           context: Any) -> cluster_pb2.PlacementLogResponse:
        self._placing()
        limit = request.limit or DEFAULT_PLACEMENT_LOG_LIMIT
        if limit > RECENT_RECORDS:
            raise errors.InvalidRequestError(f"limit {limit} is over {RECENT_RECORDS}, the entries a node keeps",
                                             field="limit", limit="RECENT_RECORDS")
        state = self.node.log.state
        response = cluster_pb2.PlacementLogResponse(epoch=state.epoch, skipped=dict(state.skipped))
        if state.controller is not None:
            response.controller = state.controller.node_id
            response.controller_term = state.controller.term
        for entry in list(state.recent)[-limit:]:
            response.entries.append(cluster_pb2.PlacementLogEntry(
                offset=entry.offset, epoch=entry.epoch, kind=entry.kind, summary=entry.summary, reason=entry.reason,
                at_ms=entry.at_ms))
        return response

    async def ListPreparedTransactions(self, request: cluster_pb2.ListPreparedTransactionsRequest,
                                       context: Any) -> cluster_pb2.ListPreparedTransactionsResponse:
        if request.older_than_ms < 0:
            raise errors.InvalidRequestError(f"older_than_ms must be >= 0, got {request.older_than_ms}")
        ask = peer_pb2.PreparedTxnsRequest(older_than_ms=request.older_than_ms)
        local = peer_pb2.PreparedTxnsResponse(node_id=self.node.config.node_id,
                                              prepared=self.node.txns.prepared(request.older_than_ms))
        answers = await self._each_member("PreparedTxns", ask)
        response = cluster_pb2.ListPreparedTransactionsResponse()
        now_ms = int(time.time() * 1000)
        for address, reply in [("", local), *answers]:
            if reply is None:
                response.unreachable.append(address)
                continue
            assert isinstance(reply, peer_pb2.PreparedTxnsResponse)
            for p in reply.prepared:
                response.transactions.append(cluster_pb2.PreparedTransaction(
                    txn_id=p.txn_id, shard=p.shard, coordinator=p.coordinator, participants=p.participants,
                    age_ms=max(0, now_ms - p.prepared_unix_ms) if p.prepared_unix_ms else 0, revision=p.revision,
                    request_id=p.request_id, locked_keys=p.locked_keys, leader_id=reply.node_id))
        response.transactions.sort(key=lambda t: (-t.age_ms, t.txn_id, t.shard))
        return response

    async def ResolveTransaction(self, request: cluster_pb2.ResolveTransactionRequest,
                                 context: Any) -> cluster_pb2.ResolveTransactionResponse:
        if not request.txn_id:
            raise errors.InvalidRequestError("ResolveTransaction needs a txn_id (kvstore txn list --in-doubt)",
                                             field="txn_id")
        local = await self.node.txns.force(request.txn_id)
        asked = await self._each_member("ResolvePrepared", peer_pb2.ResolvePreparedRequest(txn_id=request.txn_id),
                                        timeout_s=30.0)
        outcomes = [local, *[r.resolution for _, r in asked if isinstance(r, peer_pb2.ResolvePreparedResponse)]]
        shards = sorted({s for a in outcomes for s in a.shards})
        for outcome in ("committed", "aborted", "in doubt"):
            found = [a for a in outcomes if a.outcome == outcome]
            if found:
                return cluster_pb2.ResolveTransactionResponse(txn_id=request.txn_id, outcome=outcome,
                                                              detail=found[0].detail, shards=shards)
        return cluster_pb2.ResolveTransactionResponse(txn_id=request.txn_id, outcome="not prepared")

    async def _each_member(self, method: str, request: Any, timeout_s: float = 5.0) -> list[tuple[str, Any]]:
        """`method` of PeerService at every other member: (address, answer or None if it failed)."""
        me = self.node.config.node_id
        addresses = sorted({a for node_id, a in self.node.view.members.items() if a and node_id != me})

        async def one(address: str) -> tuple[str, Any]:
            try:
                return address, await getattr(self.peers.peer(address), method)(request, timeout=timeout_s)
            except grpc.RpcError as exc:
                log.debug("peer %s: %s failed: %s", address, method, exc)
                return address, None

        return list(await asyncio.gather(*(one(a) for a in addresses)))


DEFAULT_PLACEMENT_LOG_LIMIT = 50


def _epoch(epoch: int) -> int:
    """A drain or move names the placement epoch it was computed from (P4): required."""
    if epoch == 0:
        raise errors.InvalidRequestError("the request names no placement epoch: read ShardMap's placement_epoch "
                                         "and send it (a request is refused if the placement moved since)",
                                         field="epoch")
    return epoch


def _changes(moves: list[tuple[int, tuple[str, ...], tuple[str, ...]]]) -> list[cluster_pb2.PlacementChange]:
    return [cluster_pb2.PlacementChange(shard=shard, before=before, after=after) for shard, before, after in moves]
