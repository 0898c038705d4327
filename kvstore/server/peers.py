"""gRPC channels from this node to the other nodes, which it calls through the internal peer
service (kvstore.internal.v1.PeerService: shard-map fan-out, forwarded scan parts, fence notices)
and, for a client's write or leader read sent to a node that does not lead the shard, through the
leader's public API (kvstore.server.forward: one hop, the request unchanged)."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio

from kvstore import limits
from kvstore.internal.v1 import peer_pb2_grpc
from kvstore.v1 import kv_pb2_grpc

MAX_PEERS = 256  # channels kept open; the cluster's node count is far below this


class Peers:
    """One channel per peer address, opened on first use; bounded, oldest closed first."""

    def __init__(self, credentials: grpc.ChannelCredentials | None = None) -> None:
        # None: plaintext. Else TLS with the cluster's CA and this node's credentials (its
        # certificate and/or its node token, kvstore.server.auth): the peers see role node.
        self._credentials = credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            if len(self._channels) >= MAX_PEERS:
                oldest = next(iter(self._channels))
                task = asyncio.create_task(self._channels.pop(oldest).close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            options = [("grpc.max_receive_message_length", limits.GRPC_MAX_MESSAGE_BYTES),
                       ("grpc.max_send_message_length", limits.GRPC_MAX_MESSAGE_BYTES)]
            channel = (grpc.aio.secure_channel(address, self._credentials, options=options)
                       if self._credentials is not None else grpc.aio.insecure_channel(address, options=options))
            self._channels[address] = channel
        return channel

    def peer(self, address: str) -> peer_pb2_grpc.PeerServiceStub:
        """The peer service of the node at `address`: nodes never call each other's public API."""
        return peer_pb2_grpc.PeerServiceStub(self._channel(address))  # type: ignore[no-untyped-call]

    def kv(self, address: str) -> kv_pb2_grpc.KVServiceStub:
        """The public KV service of the node at `address`, for a forwarded client request."""
        return kv_pb2_grpc.KVServiceStub(self._channel(address))  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        await asyncio.gather(*(c.close() for c in channels), *self._closing, return_exceptions=True)
