"""The one server interceptor: every RPC's bytes in, its status out.

It decodes the request itself, so that bytes that are not a valid message, or more bytes than
MAX_REQUEST_BYTES, are refused with INVALID_ARGUMENT (reason INVALID_ARGUMENT or LIMIT_EXCEEDED,
a BadRequest naming the problem) instead of gRPC's UNKNOWN "Unexpected DecodeError", which a
client must read as an unknown outcome (W7) for a write. It maps every `StoreError` the handler
raises to its rich status (`kvstore.errors.to_status`, the one mapping), turns any other
exception into INTERNAL with an unknown outcome (a bug must never look like "nothing happened"),
and records `kvstore_requests_total{method, code, reason}` and, for unary calls,
`kvstore_request_duration_seconds{method, code}`. Handlers only raise.

Health and reflection pass through it too (their bad bytes get the same clean refusal); only
the store's own services are counted.

With `authorize` (a node with authentication: `kvstore.server.auth.Authorizer`) every call is
authorized first, before its request is decoded: the callable raises `UnauthenticatedError` or
`PermissionDeniedError`, which are refused like any other `StoreError` (rich status, outcome
none, counted with their reason). Streaming requests (reflection) are authorized here too.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from kvstore import errors, limits
from kvstore.server.metrics import Metrics

log = logging.getLogger("kvstore.server")
PUBLIC_PREFIX = "/kvstore.v1."  # the clients' services; kvstore.internal.v1 is the nodes' own

# Called before a request is decoded with the method path and the call's context; raises a
# StoreError (UnauthenticatedError, PermissionDeniedError) to refuse the call.
Authorize = Callable[[str, "grpc.aio.ServicerContext[Any, Any]"], None]

# Services counted in the metrics; their methods are labelled by name, the internal peer service's
# with a "Peer." prefix (as before the interceptor existed, so dashboards keep their labels).
_COUNTED = {"kvstore.v1.": "", "kvstore.internal.v1.": "Peer."}


def method_label(path: str) -> str | None:
    """The metric label of a method path ("/kvstore.v1.KVService/Put" -> "Put"); None for a
    service that is not the store's (health, reflection). Pure."""
    service, _, method = path.lstrip("/").rpartition("/")
    for package, prefix in _COUNTED.items():
        if service.startswith(package):
            return prefix + method
    return None


def decode(deserializer: Callable[[bytes], Any] | None, raw: bytes) -> Any:
    """The request message of `raw`, or InvalidRequestError saying why there is none. Pure."""
    if len(raw) > limits.MAX_REQUEST_BYTES:
        raise errors.InvalidRequestError(
            f"request has {len(raw)} bytes; limit MAX_REQUEST_BYTES is {limits.MAX_REQUEST_BYTES}",
            limit="MAX_REQUEST_BYTES")
    if deserializer is None:
        return raw
    try:
        return deserializer(raw)
    except (DecodeError, ValueError, TypeError) as exc:  # protobuf raises DecodeError; upb also ValueError
        raise errors.InvalidRequestError(f"the request is not a valid protobuf message of this method "
                                         f"({type(exc).__name__}: {exc})") from exc


def request_id_of(request: Any) -> str:
    """The request id a write carries (Put, Delete, Txn), for an unknown outcome's ErrorInfo."""
    value = getattr(request, "request_id", "")
    return value if isinstance(value, str) else ""


class ErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """See the module docstring. One per server; the wrapped handlers are built once per method."""

    def __init__(self, metrics: Metrics, authorize: Authorize | None = None,
                 client_address: Callable[[str], str] | None = None) -> None:
        self._metrics = metrics
        self._authorize = authorize
        # A leader hint to a client names the address clients use (`--advertise-client`); to a
        # node (the peer service) the one nodes use.
        self._client_address = client_address
        self._handlers: dict[str, grpc.RpcMethodHandler | None] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        path: str = handler_call_details.method
        if path in self._handlers:
            return self._handlers[path]
        handler = await continuation(handler_call_details)
        wrapped = self._wrap(path, handler) if handler is not None else None
        if len(self._handlers) < 1024:  # bounded: unknown paths a client invents are not kept
            self._handlers[path] = wrapped
        return wrapped

    def _wrap(self, path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        label = method_label(path)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(path, label, handler.unary_unary, handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(path, label, handler.unary_stream, handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if self._authorize is not None and handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._guarded_streams(path, label, handler.stream_stream),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if self._authorize is not None and handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._guarded_stream_unary(path, label, handler.stream_unary),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        return handler  # client streaming (reflection): gRPC decodes those itself

    def _count(self, label: str | None, code: str, reason: str = "", started: float | None = None) -> None:
        """Count the call; a unary one (`started`: its perf_counter at arrival) is timed too."""
        if label is not None:
            self._metrics.count_request(label, code, reason)
            if started is not None:
                self._metrics.observe_request(label, code, time.perf_counter() - started)

    async def _abort(self, label: str | None, context: grpc.aio.ServicerContext[Any, Any], error: errors.StoreError,
                     request: Any, started: float | None = None, path: str = "") -> None:
        if (isinstance(error, errors.NotLeaderError) and error.leader_hint and self._client_address is not None
                and path.startswith(PUBLIC_PREFIX)):
            error = errors.NotLeaderError(error.shard, self._client_address(error.leader_hint))
        code, details, trailing = errors.to_status(error, request_id=request_id_of(request))
        self._count(label, code.name, error.reason.value, started)
        await context.abort(code, details, trailing_metadata=trailing)

    def _unary(self, path: str, label: str | None, behavior: Callable[..., Any],
               deserializer: Callable[[bytes], Any] | None) -> Callable[..., Awaitable[Any]]:
        async def run(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            started = time.perf_counter()
            request: Any = None
            try:
                if self._authorize is not None:
                    self._authorize(path, context)
                request = decode(deserializer, raw)
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
            except errors.StoreError as exc:
                await self._abort(label, context, exc, request, started, path)
                raise AssertionError("abort returned") from exc
            except grpc.aio.AbortError:
                self._count(label, context.code().name if context.code() else "UNKNOWN", started=started)
                raise
            except Exception as exc:
                log.exception("%s failed", label or "a call")
                await self._abort(label, context, _internal(exc), request, started, path)
                raise AssertionError("abort returned") from exc
            self._count(label, "OK", started=started)
            return result

        return run

    def _stream(self, path: str, label: str | None, behavior: Callable[..., Any],
                deserializer: Callable[[bytes], Any] | None) -> Callable[..., AsyncIterator[Any]]:
        async def run(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            request: Any = None
            try:
                if self._authorize is not None:
                    self._authorize(path, context)
                request = decode(deserializer, raw)
                async for item in _items(behavior(request, context)):
                    yield item
            except errors.StoreError as exc:
                await self._abort(label, context, exc, request, path=path)
                return
            except grpc.aio.AbortError:
                self._count(label, context.code().name if context.code() else "UNKNOWN")
                raise
            except Exception as exc:
                log.exception("%s failed", label or "a stream")
                await self._abort(label, context, _internal(exc), request, path=path)
                return
            self._count(label, "OK")

        return run

    async def _refused(self, path: str, label: str | None, context: grpc.aio.ServicerContext[Any, Any]) -> bool:
        """Authorize a call whose requests gRPC decodes itself (client streaming); True if it was
        refused (the call is then aborted with the refusal's status)."""
        assert self._authorize is not None
        try:
            self._authorize(path, context)
        except errors.StoreError as exc:
            await self._abort(label, context, exc, None)
            return True
        return False

    def _guarded_streams(self, path: str, label: str | None,
                         behavior: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
        async def run(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            if await self._refused(path, label, context):
                return
            async for item in _items(behavior(requests, context)):
                yield item

        return run

    def _guarded_stream_unary(self, path: str, label: str | None,
                              behavior: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        async def run(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if await self._refused(path, label, context):
                return None
            result = behavior(requests, context)
            return await result if inspect.isawaitable(result) else result

        return run


async def _items(stream: Any) -> AsyncIterator[Any]:
    """A handler's responses, whether it is an async generator (ours) or a plain one."""
    if hasattr(stream, "__aiter__"):
        async for item in stream:
            yield item
    else:
        for item in stream:
            yield item


def _internal(exc: Exception) -> errors.StoreError:
    return errors.InternalError(f"internal error ({type(exc).__name__}: {exc}); the outcome of a write is "
                                "unknown: retry it with the same request id")
