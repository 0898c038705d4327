"""gRPC channels from this node to the other nodes, which it calls through the internal peer
service (kvstore.internal.v1.Peer: shard-map fan-out, forwarded scan parts, fence notices)."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio

from kvstore import limits
from kvstore.internal.v1 import peer_pb2_grpc

MAX_PEERS = 256  # channels kept open; the cluster's node count is far below this


class Peers:
    """One channel per peer address, opened on first use; bounded, oldest closed first."""

    def __init__(self) -> None:
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
            channel = grpc.aio.insecure_channel(address, options=[
                ("grpc.max_receive_message_length", limits.GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", limits.GRPC_MAX_MESSAGE_BYTES)])
            self._channels[address] = channel
        return channel

    def peer(self, address: str) -> peer_pb2_grpc.PeerStub:
        """The peer service of the node at `address`: nodes never call each other's public API."""
        return peer_pb2_grpc.PeerStub(self._channel(address))  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        await asyncio.gather(*(c.close() for c in channels), *self._closing, return_exceptions=True)
