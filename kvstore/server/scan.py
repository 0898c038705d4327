"""Scan on a node: one page over many shards, the parts this node holds read here, the others at
their leaders (PeerService.ScanShards), merged in key order.

Apart from the KV service because the peer service serves the same page for the parts other
nodes forward here (without forwarding again), and a linearizable page over several shards must
be one cut (T4, `kvstore.core.cut`) whichever service asked for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from kvstore import errors
from kvstore.core import reads, validation
from kvstore.core.cut import Answer as CutAnswer
from kvstore.core.cut import Cut, CutConfig
from kvstore.core.cut import GiveUp as CutGiveUp
from kvstore.core.cut import ReadParts as CutReadParts
from kvstore.core.cut import ValidateParts as CutValidateParts
from kvstore.core.evaluate import key_value
from kvstore.internal.v1 import peer_pb2
from kvstore.server import routing
from kvstore.v1 import kv_pb2

if TYPE_CHECKING:
    from kvstore.server.node import Node
    from kvstore.server.peers import Peers
    from kvstore.server.replica import ShardReplica

log = logging.getLogger("kvstore.server")

FORWARD_TIMEOUT_S = 10.0  # a forwarded scan part, when the caller set no shorter deadline
SCAN_CUT = CutConfig()  # a linearizable multi-shard page: read at most this many times before UNAVAILABLE


class Scans:
    """The Scan pages this node serves: a client's (KVService.Scan), gathered here from every
    shard, and the parts other nodes ask of it (PeerService.ScanShards), served here or refused."""

    def __init__(self, node: Node, peers: Peers) -> None:
        self.node = node
        self.peers = peers

    async def page(self, request: kv_pb2.ScanRequest, shards: list[int],
                   context: grpc.aio.ServicerContext[Any, Any], *, forward: bool) -> kv_pb2.ScanResponse:
        """One page of `request` over `shards`. `forward`: the shards this node cannot serve go
        to their leaders (PeerService.ScanShards); without it (a part forwarded to us) every shard is
        served here or refused, so a part is never forwarded twice.

        A linearizable page over several shards, gathered here, is one cut (T4, `kvstore.core.cut`):
        once every shard's part was read, each is validated (nothing in the page's span changed
        since the revision it was read at); a page that changed is read again, a few times, then
        refused as retriable. Stale and leader-local pages promise no cut and are not validated."""
        start, end, limit = validation.scan_bounds(request)
        if request.page_token:
            if request.page_token <= start and not request.page_token.startswith(start):
                raise errors.InvalidRequestError("page_token does not belong to this scan")
            start = max(start, request.page_token)
        linearizable = request.read.consistency in (kv_pb2.CONSISTENCY_UNSPECIFIED, kv_pb2.CONSISTENCY_LINEARIZABLE)
        if not forward or not linearizable or len(shards) < 2:
            return await self._read_once(request, shards, start, end, limit, context, forward=forward)
        cut = Cut(shards, SCAN_CUT)
        action = cut.start()
        page = kv_pb2.ScanResponse()
        while True:  # bounded: the cut gives up after its rounds
            if isinstance(action, CutReadParts):
                page = await self._read_once(request, shards, start, end, limit, context, forward=True)
                action = cut.read({h.shard: h.applied_revision for h in page.headers})
            elif isinstance(action, CutValidateParts):
                span = (start, page.next_page_token or end)
                checks = await asyncio.gather(*(self._validate_part(shard, revision, span, context)
                                                for shard, revision in sorted(action.revisions.items())))
                action = cut.validated([shard for shard, ok in zip(sorted(action.revisions), checks, strict=True)
                                        if not ok])
            elif isinstance(action, CutAnswer):
                if action.rounds > 1:
                    self.node.metrics.scan_cut_rounds.inc(action.rounds - 1)
                return page
            else:
                assert isinstance(action, CutGiveUp)
                raise action.error

    async def _validate_part(self, shard: int, since: int, span: tuple[bytes, bytes | None],
                             context: grpc.aio.ServicerContext[Any, Any]) -> bool:
        """Whether nothing in `span` changed at `shard` at or after `since` (its leader says, this
        node's own replica when it leads it); no answer counts as a change."""
        try:
            if self.node.leads(shard):
                return await self.node.txns.validate(shard, since, (), span)
            leader = self.node.leader_address(shard)
            if not leader:
                return False
            ask = peer_pb2.ValidateReadsRequest(shard=shard, since_revision=since, has_span=True, span_start=span[0],
                                                span_end=span[1] or b"", span_to_end=span[1] is None)
            reply = await self.peers.peer(leader).ValidateReads(
                ask, timeout=routing.deadline_s(context, FORWARD_TIMEOUT_S))
            return bool(reply.unchanged)
        except (errors.StoreError, grpc.RpcError) as exc:
            log.debug("shard %d: validating a scan's part failed: %s", shard, exc)
            return False

    async def _read_once(self, request: kv_pb2.ScanRequest, shards: list[int], start: bytes, end: bytes | None,
                         limit: int, context: grpc.aio.ServicerContext[Any, Any], *,
                         forward: bool) -> kv_pb2.ScanResponse:
        """One page read once: every shard's part, here or at its leader, merged."""
        floors = reads.scan_floors(request.read, request.min_revisions, self.node.config.shards)
        local, remote = routing.plan(self.node, shards, request.read.consistency) if forward else (shards, {})
        cleared = [await routing.read_ready(self.node, shard, request.read.consistency, floors.get(shard), context,
                                            span=(start, end)) for shard in local]
        forwarded = await asyncio.gather(*(self._forward(address, group, request, context)
                                           for address, group in remote.items()))
        for replica, epoch in cleared:  # the awaits since: none of these states may have gone back
            replica.unchanged_since(epoch)
        replicas = [replica for replica, _epoch in cleared]
        response = kv_pb2.ScanResponse(headers=[routing.read_header(self.node, r) for r in replicas])
        for part in forwarded:
            response.headers.extend(part.headers)
        # Scatter-gather, bounded by `limit` and by MAX_RESPONSE_BYTES (kvstore.core.reads): the
        # shards served here are read lazily in key order, merged with the pages the other
        # leaders served, and the page stops where either bound or a part's end of knowledge is.
        streams = [_rows(replica, start, end, keys_only=request.keys_only) for replica in replicas]
        try:
            page = reads.merge_pages(streams, [reads.Page(list(part.kvs), more=bool(part.next_page_token))
                                               for part in forwarded],
                                     limit, reads.page_budget_bytes(response.headers))
        finally:
            for stream in streams:
                stream.close()
        response.kvs.extend(page.kvs)
        response.next_page_token = page.next_page_token()
        return response

    async def _forward(self, address: str, shards: list[int], request: kv_pb2.ScanRequest,
                       context: grpc.aio.ServicerContext[Any, Any]) -> kv_pb2.ScanResponse:
        part = peer_pb2.ScanShardsRequest(scan=request, shards=shards)
        try:
            reply = await self.peers.peer(address).ScanShards(
                part, timeout=routing.deadline_s(context, FORWARD_TIMEOUT_S))
        except grpc.RpcError as exc:
            # Whatever went wrong there (leader moving, node gone), the scan as a whole is
            # retriable: nothing was changed.
            raise errors.UnavailableError(
                f"shards {shards}: forwarding the scan to their leader {address} failed "
                f"({exc.code().name}: {exc.details()}); retry") from exc
        assert isinstance(reply, peer_pb2.ScanShardsResponse)
        return reply.scan


def _rows(replica: ShardReplica, start: bytes, end: bytes | None, *,
          keys_only: bool) -> Generator[kv_pb2.KeyValue, None, None]:
    """The shard's keys in [start, end) as the page will carry them (no value for keys_only:
    the page's bytes are counted on what is sent)."""
    for key, state in replica.store.scan_lazily(start, end):
        kv = key_value(key, state)
        if keys_only:
            kv.ClearField("value")
        yield kv
