"""kvstore.v1.KVService: the public key-value API of a node, what clients call.

Any node answers any request: a write or a leader read for a shard this node does not lead goes
to the shard's leader, one hop (`kvstore.server.forward`); a Scan or a Watch over several shards
is served in parts (`kvstore.server.scan`, `kvstore.server.watch`); a Txn over several shards is
a cross-shard transaction this node drives (`kvstore.server.txns`). The handlers only raise:
errors reach the client through the one interceptor's mapping (`kvstore.server.interceptor`,
`kvstore.errors.to_status`), apart from a WriteBatch part's, which its own result carries.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc.aio

from kvstore import errors
from kvstore.core import validation
from kvstore.core.evaluate import key_value
from kvstore.core.replica import ClientRequest
from kvstore.server import forward, routing
from kvstore.server.scan import Scans
from kvstore.server.watch import Watches
from kvstore.v1 import kv_pb2, kv_pb2_grpc

if TYPE_CHECKING:
    from kvstore.server.node import Node
    from kvstore.server.peers import Peers


class KVService(kv_pb2_grpc.KVServiceServicer):
    def __init__(self, node: Node, peers: Peers, scans: Scans, watches: Watches) -> None:
        self.node = node
        self.forwarder = forward.Forwarder(peers, node.config.node_id)
        self.scans = scans
        self.watches = watches

    async def Get(self, request: kv_pb2.GetRequest, context: Any) -> kv_pb2.GetResponse:
        validation.check_key(request.key)
        floor = request.read.min_revision if request.read.HasField("min_revision") else None
        try:
            replica, _epoch = await routing.read_ready(self.node, self.node.shard_for(request.key),
                                                       request.read.consistency, floor, context, keys=(request.key,))
        except errors.NotLeaderError as refusal:
            response = await self._forward(refusal, "Get", request, context, write=False)
            assert isinstance(response, kv_pb2.GetResponse)
            return response
        state = replica.store.get(request.key)  # no await since `read_ready` checked the epoch
        response = kv_pb2.GetResponse(header=routing.read_header(self.node, replica), found=state is not None)
        if state is not None:
            response.kv.CopyFrom(key_value(request.key, state))
        return response

    async def _forward(self, refusal: errors.NotLeaderError, method: str, request: Any,
                       context: grpc.aio.ServicerContext[Any, Any], *, write: bool) -> Any:
        """`request` answered by the shard's leader (kvstore.server.forward), or `refusal` raised
        when it may not go there (no leader known, already forwarded, the caller routes itself)."""
        leader = forward.target(refusal, context.invocation_metadata(), self.node.address)
        if leader is None:
            raise refusal
        self.node.metrics.forwarded.labels(method=method).inc()
        try:
            return await self.forwarder.call(leader, method, request, context, write=write)
        except forward.LeaderAnswered as answer:
            await answer.abort(context)
            raise AssertionError("abort returned") from answer

    async def _write(self, method: str, request: Any, shard: int, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            # `write` is the one leadership check of a write (RoleMachine.write_refusal).
            return await self.node.replica(shard).write(ClientRequest(request, shard), request.ByteSize())
        except errors.NotLeaderError as refusal:  # definite: nothing was queued here
            return await self._forward(refusal, method, request, context, write=True)

    async def Put(self, request: kv_pb2.PutRequest, context: Any) -> kv_pb2.PutResponse:
        validation.check_put(request)
        response = await self._write("Put", request, self.node.shard_for(request.key), context)
        assert isinstance(response, kv_pb2.PutResponse)
        return response

    async def Delete(self, request: kv_pb2.DeleteRequest, context: Any) -> kv_pb2.DeleteResponse:
        validation.check_delete(request)
        response = await self._write("Delete", request, self.node.shard_for(request.key), context)
        assert isinstance(response, kv_pb2.DeleteResponse)
        return response

    async def Txn(self, request: kv_pb2.TxnRequest, context: Any) -> kv_pb2.TxnResponse:
        participants = validation.check_txn(request, self.node.config.shards)
        if len(participants) > 1:  # a cross-shard transaction: this node drives it (docs/design.md §10)
            return await self.node.txns.run(request, context.time_remaining())
        response = await self._write("Txn", request, participants[0], context)
        assert isinstance(response, kv_pb2.TxnResponse)
        return response

    async def WriteBatch(self, request: kv_pb2.WriteBatchRequest, context: Any) -> kv_pb2.WriteBatchResponse:
        validation.check_write_batch(request, self.node.config.shards)
        results = await asyncio.gather(*(self._write_part(part, context) for part in request.shards))
        return kv_pb2.WriteBatchResponse(results=results)

    async def _write_part(self, part: kv_pb2.ShardMutations,
                          context: grpc.aio.ServicerContext[Any, Any]) -> kv_pb2.ShardMutationsResult:
        """One part, answered like a unary write to its shard: committed, or the error (with
        its kvstore-* metadata from the one mapping, `errors.to_status`) that call would get.
        A part for a shard led elsewhere goes there as a WriteBatch of that part alone (one hop).
        Anything else raised here fails the whole call untagged: every part is then unknown to
        the client (W7), and its retry, with the same ids, is answered from the request table."""
        shard = part.shard
        try:
            try:
                response = await self.node.replica(shard).write(ClientRequest(part, shard), part.ByteSize())
            except errors.NotLeaderError as refusal:
                response = await self._forward_part(refusal, part, context)
        except errors.StoreError as exc:
            code, details, metadata = errors.to_status(exc, request_id=part.request_id)
            self.node.metrics.count_request("WriteBatch.part", code.name, exc.reason.value)
            text = {key: value for key, value in metadata if isinstance(value, str)}  # trailers, not the -bin
            return kv_pb2.ShardMutationsResult(
                shard=shard, error=kv_pb2.PartError(code=code.value[0], message=details, metadata=text))
        assert isinstance(response, kv_pb2.ShardMutationsResult), type(response)
        self.node.metrics.count_request("WriteBatch.part", "OK")
        return response

    async def _forward_part(self, refusal: errors.NotLeaderError, part: kv_pb2.ShardMutations,
                            context: grpc.aio.ServicerContext[Any, Any]) -> kv_pb2.ShardMutationsResult:
        leader = forward.target(refusal, context.invocation_metadata(), self.node.address)
        if leader is None:
            raise refusal
        self.node.metrics.forwarded.labels(method="WriteBatch.part").inc()
        try:
            reply = await self.forwarder.call(leader, "WriteBatch", kv_pb2.WriteBatchRequest(shards=[part]), context,
                                              write=True)
        except forward.LeaderAnswered as answer:  # its definite refusal of the call is this part's
            text = {key: value for key, value in answer.trailing if isinstance(value, str)}
            return kv_pb2.ShardMutationsResult(shard=part.shard, error=kv_pb2.PartError(
                code=answer.code.value[0], message=answer.details, metadata=text))
        assert isinstance(reply, kv_pb2.WriteBatchResponse) and len(reply.results) == 1, reply
        return reply.results[0]

    async def Scan(self, request: kv_pb2.ScanRequest, context: Any) -> kv_pb2.ScanResponse:
        return await self.scans.page(request, list(range(self.node.config.shards)), context, forward=True)

    async def Watch(self, request: kv_pb2.WatchRequest,
                    context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[kv_pb2.WatchResponse]:
        async for event in self.watches.watch(request, context):
            yield event
