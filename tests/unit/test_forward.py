"""Forwarding's decisions (kvstore.server.forward), pure: where a request goes, what a lost hop means."""

from __future__ import annotations

import grpc
import pytest

from kvstore import errors
from kvstore.server import forward

HINT = errors.NotLeaderError(1, "10.0.0.2:50051")
NONE_KNOWN = errors.NotLeaderError(1, None)
ME = "10.0.0.1:50051"


@pytest.mark.parametrize(("refusal", "metadata", "expected"), [
    pytest.param(HINT, (), "10.0.0.2:50051", id="forward-to-the-leader"),
    pytest.param(HINT, (("x-other", "1"),), "10.0.0.2:50051", id="other-metadata"),
    pytest.param(NONE_KNOWN, (), None, id="no-leader-known"),
    pytest.param(errors.NotLeaderError(1, ME), (), None, id="the-hint-is-this-node"),
    pytest.param(HINT, ((errors.FORWARDED_BY_KEY, "n2"),), None, id="one-hop-only"),
    pytest.param(HINT, ((errors.FORWARD_KEY, errors.FORWARD_NEVER),), None, id="the-caller-routes-itself"),
    pytest.param(HINT, ((errors.FORWARD_KEY, b"never"),), None, id="bytes-metadata"),
])
def test_target(refusal: errors.NotLeaderError, metadata: tuple[tuple[str, object], ...], expected: str | None) -> None:
    assert forward.target(refusal, metadata, ME) == expected


DEFINITE = ((errors.OUTCOME_KEY, errors.OUTCOME_NONE),)


@pytest.mark.parametrize(("code", "trailing", "write", "unknown"), [
    pytest.param(grpc.StatusCode.DEADLINE_EXCEEDED, (), True, True, id="write-deadline-is-unknown"),
    pytest.param(grpc.StatusCode.UNAVAILABLE, (), True, True, id="write-connection-lost-is-unknown"),
    pytest.param(grpc.StatusCode.UNKNOWN, ((errors.OUTCOME_KEY, errors.OUTCOME_UNKNOWN),), True, True,
                 id="write-leader-says-unknown"),
    pytest.param(grpc.StatusCode.FAILED_PRECONDITION, DEFINITE, True, False, id="write-leader-definite-passes"),
    pytest.param(grpc.StatusCode.INVALID_ARGUMENT, DEFINITE, True, False, id="write-invalid-passes"),
    pytest.param(grpc.StatusCode.DEADLINE_EXCEEDED, (), False, False, id="read-passes"),
])
def test_lost(code: grpc.StatusCode, trailing: tuple[tuple[str, str], ...], write: bool, unknown: bool) -> None:
    verdict = forward.lost("10.0.0.2:50051", code, "x", trailing, write=write)
    assert (verdict is not None) is unknown
    if verdict is not None:
        assert isinstance(verdict, errors.UnknownOutcomeError) and not verdict.definite
        assert "10.0.0.2:50051" in str(verdict) and "same request id" in str(verdict)


@pytest.mark.parametrize(("remaining", "expected"), [
    (None, forward.FORWARD_TIMEOUT_S), (100.0, forward.FORWARD_TIMEOUT_S), (3.0, 2.8), (0.2, 0.1), (0.0, 0.001),
])
def test_hop_timeout(remaining: float | None, expected: float) -> None:
    assert forward.hop_timeout_s(remaining) == pytest.approx(expected)


def test_a_hop_that_reached_no_leader_is_not_relayed_as_the_clients_own_connect_failure() -> None:
    from kvstore.client.errors import Unavailable, Unreachable, error_from_status
    from kvstore.server.forward import relayed_details

    grpc_text = "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.2:50051: Connection refused"
    relayed = relayed_details("10.0.0.2:50051", grpc.StatusCode.UNAVAILABLE, grpc_text, ())
    assert relayed.startswith("forwarded to the shard's leader 10.0.0.2:50051") and grpc_text in relayed
    # The client reached this node: a definite Unavailable, not "no node reached".
    seen = error_from_status(grpc.StatusCode.UNAVAILABLE, relayed, {})
    assert type(seen) is Unavailable and not isinstance(seen, Unreachable)
    # The leader's own answers pass on unchanged.
    own = ((errors.OUTCOME_KEY, errors.OUTCOME_NONE),)
    assert relayed_details("l:1", grpc.StatusCode.UNAVAILABLE, "shard 0 bootstrapping", own) == "shard 0 bootstrapping"
    assert relayed_details("l:1", grpc.StatusCode.INVALID_ARGUMENT, "key too long", ()) == "key too long"


@pytest.mark.parametrize(("path", "hint"), [("/kvstore.v1.KVService/Put", "127.0.0.1:50052"),
                                            ("/kvstore.internal.v1.PeerService/PrepareTxn", "node-2:50052")])
def test_a_leader_hint_names_the_address_its_caller_uses(path: str, hint: str) -> None:
    """A client is hinted the leader's client address (`--advertise-client`), a node the nodes' one."""
    import asyncio

    from kvstore.server.interceptor import ErrorInterceptor
    from kvstore.server.metrics import Metrics

    class Context:
        trailing: dict[str, str] = {}

        async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
            self.trailing = {str(k): v for k, v in trailing_metadata}  # type: ignore[attr-defined]

    interceptor = ErrorInterceptor(Metrics(), client_address={"node-2:50052": "127.0.0.1:50052"}.get)
    context = Context()
    asyncio.run(interceptor._abort("Put", context, errors.NotLeaderError(0, "node-2:50052"), None,  # type: ignore[arg-type]
                                   path=path))
    assert context.trailing[errors.LEADER_HINT_KEY] == hint
