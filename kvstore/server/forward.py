"""Any node serves any request: a write or a leader read that reaches a node which does not lead
the key's shard goes on to the leader, one hop, unchanged (the request id with it), so grpcurl and
clients in any language work against any node without a routing library.

The decisions are pure (`target`, `lost`), the call is a thin shell (`Forwarder`):

* forward only on NOT_LEADER with a known leader that is not this node, never a request that was
  forwarded already (one hop: two nodes with stale views cannot bounce it), never when the caller
  routes itself (`kvstore-forward: never`; it gets NOT_LEADER and the leader's address instead);
* the leader's answer goes back as it is, errors included (status, message, rich details);
* a forwarded write whose answer is lost (the connection dropped, the deadline passed, the
  leader died) may have committed there: OUTCOME_UNKNOWN (W7), never a clean failure. Only an
  answer the leader marked definite (outcome "none") says nothing happened.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import Message

from kvstore import errors
from kvstore.server.peers import Peers

FORWARD_TIMEOUT_S = 10.0  # when the caller set no shorter deadline
# The hop ends this much before the caller's deadline, so that the caller hears why (an unknown
# outcome, the leader's error) rather than its own DEADLINE_EXCEEDED.
FORWARD_MARGIN_S = 0.2


def hop_timeout_s(remaining_s: float | None) -> float:
    """The forwarded call's timeout for a caller with `remaining_s` left (None: no deadline). Pure."""
    if remaining_s is None:
        return FORWARD_TIMEOUT_S
    margin = min(FORWARD_MARGIN_S, remaining_s / 2)
    return max(0.001, min(FORWARD_TIMEOUT_S, remaining_s - margin))


def _value(metadata: Iterable[Any] | None, key: str) -> str | None:
    for item in metadata or ():
        if item[0] == key:
            value = item[1]
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def target(refusal: errors.NotLeaderError, metadata: Iterable[Any] | None, own_address: str) -> str | None:
    """Where to forward a request refused with `refusal` here, or None to answer NOT_LEADER. Pure."""
    hint = refusal.leader_hint
    if not hint or hint == own_address:
        return None
    if _value(metadata, errors.FORWARDED_BY_KEY) is not None:
        return None  # one hop only
    if _value(metadata, errors.FORWARD_KEY) == errors.FORWARD_NEVER:
        return None
    return hint


def lost(leader: str, code: grpc.StatusCode, details: str, trailing: Iterable[Any] | None,
         *, write: bool) -> errors.StoreError | None:
    """What to answer when the forwarded call failed: None to pass the leader's status on as it
    is (it is the leader's own definite answer, or a read, which changes nothing), else the
    unknown outcome of a write whose answer was lost on the way (W7). Pure."""
    if not write or _value(trailing, errors.OUTCOME_KEY) == errors.OUTCOME_NONE:
        return None
    return errors.UnknownOutcomeError(
        f"forwarded to the shard's leader {leader}, whose answer was lost ({code.name}: {details}); the write "
        "may or may not have committed: retry with the same request id")


def relayed_details(leader: str, code: grpc.StatusCode, details: str, trailing: Iterable[Any] | None) -> str:
    """The text passed on to the client. gRPC's own UNAVAILABLE of the hop (no answer of the
    leader's: it carries no `kvstore-outcome`) is said to be the hop's: as it was, "failed to
    connect to all addresses" would tell the client that its own request reached no node
    (`Unreachable`), when this node had it. Pure."""
    if code == grpc.StatusCode.UNAVAILABLE and _value(trailing, errors.OUTCOME_KEY) is None:
        return f"forwarded to the shard's leader {leader}, which this node could not reach: {details}"
    return details


class LeaderAnswered(Exception):
    """The forwarded call failed with the leader's own answer (or, for a read, whatever gRPC
    said): the caller passes it on as it is."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str | bytes], ...]) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing = trailing

    async def abort(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(self.code, self.details, trailing_metadata=self.trailing)


class Forwarder:
    """Calls a leader's public API on behalf of a client (one hop, the caller's deadline)."""

    def __init__(self, peers: Peers, node_id: str) -> None:
        self._peers = peers
        self._metadata = ((errors.FORWARDED_BY_KEY, node_id),)

    async def call(self, leader: str, method: str, request: Message, context: grpc.aio.ServicerContext[Any, Any],
                   *, write: bool) -> Message:
        """The leader's response; raises `LeaderAnswered` (pass it on) or UnknownOutcomeError."""
        timeout = hop_timeout_s(context.time_remaining())
        try:
            response: Message = await getattr(self._peers.kv(leader), method)(
                request, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            trailing = tuple((str(k), v) for k, v in (exc.trailing_metadata() or ()))
            unknown = lost(leader, exc.code(), exc.details() or "", trailing, write=write)
            if unknown is not None:
                raise unknown from exc
            raise LeaderAnswered(exc.code(), relayed_details(leader, exc.code(), exc.details() or "", trailing),
                                 trailing) from exc
        return response
