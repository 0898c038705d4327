"""kvstore.internal.v1.PeerService: what nodes ask each other (peer.proto). Internal: it serves
the other nodes of this release and the one before it (a rolling restart), never clients, and
is left out of reflection.

The parts of a client's request another node gathers (a scan's shards, a watch's, a read-only
Txn's part, a validation of what it read), a node's report of itself, the records of a
cross-shard transaction at the shard this node leads, operators' questions fanned out, and a
fence notice. A part is served here or refused, never forwarded again: one hop at most.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc.aio

from kvstore import errors, limits
from kvstore.core import reads, validation
from kvstore.core import txn as txn_core
from kvstore.core.placement_controller import Drain, Move, Request
from kvstore.internal.v1 import peer_pb2, peer_pb2_grpc, wal_entry_pb2
from kvstore.server import txns as txns_module
from kvstore.v1 import cluster_pb2

if TYPE_CHECKING:
    from kvstore.server.node import Node
    from kvstore.server.scan import Scans
    from kvstore.server.watch import Watches


class PeerService(peer_pb2_grpc.PeerServiceServicer):
    """kvstore.internal.v1.PeerService: what nodes ask each other. Internal (see peer.proto): it serves
    the other nodes of this release, not clients."""

    def __init__(self, node: Node, scans: Scans, watches: Watches) -> None:
        self.node = node
        self.scans = scans
        self.watches = watches

    async def ScanShards(self, request: peer_pb2.ScanShardsRequest, context: Any) -> peer_pb2.ScanShardsResponse:
        shards = sorted(set(request.shards))
        if not shards:
            raise errors.InvalidRequestError("ScanShards needs at least one shard")
        if shards[-1] >= self.node.config.shards:
            raise errors.InvalidRequestError(f"shard {shards[-1]} out of range ({self.node.config.shards} shards)")
        return peer_pb2.ScanShardsResponse(scan=await self.scans.page(request.scan, shards, context, forward=False))

    async def WatchShards(self, request: peer_pb2.WatchShardsRequest,
                          context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[peer_pb2.WatchShardsResponse]:
        shards = sorted(set(request.shards))
        if not shards:
            raise errors.InvalidRequestError("WatchShards needs at least one shard")
        if shards[-1] >= self.node.config.shards:
            raise errors.InvalidRequestError(f"shard {shards[-1]} out of range ({self.node.config.shards} shards)")
        starts = reads.watch_starts(request.watch, shards, self.node.config.shards)
        async for event in self.watches.here(request.watch, shards, starts, context):
            yield peer_pb2.WatchShardsResponse(event=event)

    async def LocalShardView(self, request: peer_pb2.LocalShardViewRequest,
                             context: Any) -> peer_pb2.LocalShardViewResponse:
        return peer_pb2.LocalShardViewResponse(view=self.node.local_view())

    def _shard(self, shard: int) -> int:
        if shard >= self.node.config.shards:
            raise errors.InvalidRequestError(f"shard {shard} out of range: the cluster has {self.node.config.shards} "
                                             "shards")
        return shard

    async def PrepareTxn(self, request: peer_pb2.PrepareTxnRequest, context: Any) -> peer_pb2.PrepareTxnResponse:
        participants = validation.check_txn(request.txn, self.node.config.shards)
        if self._shard(request.shard) not in participants[1:] or not request.txn_id:
            raise errors.InvalidRequestError(f"shard {request.shard} does not prepare this cross-shard Txn (only its "
                                             "participants but the first, its coordinator, do)")
        txns = self.node.txns
        answer = await txns.record(request.shard, txns.prepare_write(request), request.ByteSize())
        assert isinstance(answer, wal_entry_pb2.TxnVote), type(answer)
        return peer_pb2.PrepareTxnResponse(vote=answer)

    async def DecideTxn(self, request: peer_pb2.DecideTxnRequest, context: Any) -> peer_pb2.DecideTxnResponse:
        raise errors.InvalidRequestError(
            "DecideTxn is the decision of an older release, whose coordinator prepared too; this node decides "
            "with DecideTxnWithPart (docs/design.md section 10): nothing was appended. Upgrade every node before "
            "running cross-shard transactions through it")

    async def DecideTxnWithPart(self, request: peer_pb2.DecideTxnWithPartRequest,
                                context: Any) -> peer_pb2.DecideTxnWithPartResponse:
        decision = request.decision
        shards = sorted(set(decision.participants))
        if not decision.txn_id or len(shards) < 2 or list(decision.participants) != shards:
            raise errors.InvalidRequestError("a decision needs a txn id and its participants, ascending")
        self._shard(shards[-1])
        if decision.commit and (tuple(validation.check_txn(request.txn, self.node.config.shards)) != tuple(shards)
                                or sorted(v.shard for v in request.votes) != shards[1:]
                                or request.txn.request_id != decision.request_id):
            raise errors.InvalidRequestError("a commit decision needs the client's Txn over exactly its participants, "
                                             "with one vote from every participant but the first")
        txns = self.node.txns
        answer = await txns.record(self._shard(decision.participants[0]), txns.decide_write(request),
                                   request.ByteSize())
        assert isinstance(answer, wal_entry_pb2.TxnDecided), type(answer)
        return peer_pb2.DecideTxnWithPartResponse(decided=answer)

    async def ResolveTxn(self, request: peer_pb2.ResolveTxnRequest, context: Any) -> peer_pb2.ResolveTxnResponse:
        if not request.resolve.txn_id:
            raise errors.InvalidRequestError("a resolve needs a txn id")
        txns = self.node.txns
        answer = await txns.record(self._shard(request.shard), txns.resolve_write(request), request.ByteSize())
        assert isinstance(answer, wal_entry_pb2.TxnResolve), type(answer)
        return peer_pb2.ResolveTxnResponse(resolve=answer)

    async def ForgetTxns(self, request: peer_pb2.ForgetTxnsRequest, context: Any) -> peer_pb2.ForgetTxnsResponse:
        if len(request.txn_ids) > txns_module.MAX_FORGET_IDS:
            raise errors.InvalidRequestError(f"at most {txns_module.MAX_FORGET_IDS} txn ids per ForgetTxns",
                                             limit="MAX_FORGET_IDS")
        self.node.txns.note_forget(self._shard(request.shard), list(request.txn_ids))
        return peer_pb2.ForgetTxnsResponse()

    async def PlacementRequest(self, request: peer_pb2.PlacementRequestRequest,
                               context: Any) -> peer_pb2.PlacementRequestResponse:
        which = request.WhichOneof("request")
        placement_request: Request
        if which == "drain":
            drain = request.drain
            placement_request = Drain(drain.node_id, drain.epoch, undo=drain.undo, force=drain.force)
        elif which == "move":
            move = request.move
            placement_request = Move(move.shard, move.epoch, to=move.to_node, source=move.from_node, unpin=move.unpin)
        else:
            raise errors.InvalidRequestError("a placement request is a drain or a move")
        changes, epoch = await self.node.placement_request(placement_request, forward=False)
        return peer_pb2.PlacementRequestResponse(epoch=epoch, changes=[
            cluster_pb2.PlacementChange(shard=shard, before=before, after=after) for shard, before, after in changes])

    async def ReadTxnPart(self, request: peer_pb2.ReadTxnPartRequest, context: Any) -> peer_pb2.ReadTxnPartResponse:
        participants = validation.check_txn(request.txn, self.node.config.shards)
        if self._shard(request.shard) not in participants or not txn_core.read_only(request.txn):
            raise errors.InvalidRequestError(f"shard {request.shard} is no participant of this read-only Txn")
        read = await self.node.txns.read_part(request.shard, request.txn)
        return peer_pb2.ReadTxnPartResponse(vote=read.vote, revision=read.revision)

    async def ValidateReads(self, request: peer_pb2.ValidateReadsRequest,
                            context: Any) -> peer_pb2.ValidateReadsResponse:
        for key in request.keys:
            validation.check_key(key)
        if len(request.keys) > limits.MAX_TXN_OPS:
            raise errors.InvalidRequestError(f"at most {limits.MAX_TXN_OPS} keys per validation", limit="MAX_TXN_OPS")
        span = None
        if request.has_span:
            span = (bytes(request.span_start), None if request.span_to_end else bytes(request.span_end))
        unchanged = await self.node.txns.validate(self._shard(request.shard), request.since_revision,
                                                  tuple(request.keys), span)
        return peer_pb2.ValidateReadsResponse(unchanged=unchanged)

    async def ResolvePrepared(self, request: peer_pb2.ResolvePreparedRequest,
                              context: Any) -> peer_pb2.ResolvePreparedResponse:
        return peer_pb2.ResolvePreparedResponse(resolution=await self.node.txns.force(request.txn_id))

    async def PreparedTxns(self, request: peer_pb2.PreparedTxnsRequest, context: Any) -> peer_pb2.PreparedTxnsResponse:
        return peer_pb2.PreparedTxnsResponse(node_id=self.node.config.node_id,
                                             prepared=self.node.txns.prepared(request.older_than_ms))

    async def CheckFenced(self, request: peer_pb2.CheckFencedRequest, context: Any) -> peer_pb2.CheckFencedResponse:
        if request.shard >= self.node.config.shards:
            raise errors.InvalidRequestError(
                f"shard {request.shard} out of range: the cluster has {self.node.config.shards} shards")
        notified = self.node.config.node_id if self.node.replica(request.shard).check_fenced() else ""
        return peer_pb2.CheckFencedResponse(notified=notified)
