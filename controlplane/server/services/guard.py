"""The one interceptor every method of the controller's server goes through.

:class:`Guard` authenticates and authorizes the caller (:mod:`controlplane.server.auth`), maps the
project's errors to status codes with ``context.abort`` (:func:`status_for`), logs and times the
call. :func:`check_node` is the servicers' check that a node-bound caller acts for its own node.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import structlog

from controlplane.errors import (
    AlreadyExistsError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    StoreError,
    UnauthenticatedError,
)
from controlplane.server.auth import Authenticator, Identity, allowed_roles, current_identity
from controlplane.server.controller import Controller
from policies.errors import InfeasibleError, InputError, MixfleetError

log = structlog.get_logger("mixfleet.server")

if TYPE_CHECKING:
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
    Ctx = grpc.aio.ServicerContext[Any, Any]
else:  # the runtime classes are not generic
    _Interceptor = grpc.aio.ServerInterceptor
    Ctx = grpc.aio.ServicerContext


# --------------------------------------------------------------------------- errors


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message an exception leaves the server with."""
    if isinstance(exc, InputError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, AlreadyExistsError):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, PreconditionError | InfeasibleError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, PermissionDeniedError):
        return grpc.StatusCode.PERMISSION_DENIED, str(exc)
    if isinstance(exc, StoreError):
        return grpc.StatusCode.UNAVAILABLE, f"{exc}. The request may be retried"
    if isinstance(exc, MixfleetError):
        return grpc.StatusCode.INTERNAL, str(exc)
    return grpc.StatusCode.INTERNAL, "internal error; the controller log has the details"


# --------------------------------------------------------------------------- guard

Req = TypeVar("Req")


def _peer_cns(context: Ctx) -> list[str]:
    auth = context.auth_context() or {}
    return [v.decode() for v in auth.get("x509_common_name", [])]


class Guard(_Interceptor):
    """Authentication, authorization, error mapping, logs and latency for every method."""

    def __init__(self, auth: Authenticator, controller: Controller) -> None:
        self.auth = auth
        self.metrics = controller.metrics
        # method -> wrapped handler: built once, not on every call (at 2,000 heartbeats a
        # second the per-call wrapping alone took several percent of a core)
        self._handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        self._latency: dict[tuple[str, str], Any] = {}

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        method: str = details.method
        cached = self._handlers.get(method)
        if cached is not None:
            return cached
        handler = await continuation(details)
        if handler is None:
            return handler
        h: Any = handler
        wrapped: grpc.RpcMethodHandler[Any, Any]
        if h.unary_unary:
            wrapped = grpc.unary_unary_rpc_method_handler(
                self._unary(method, h.unary_unary), h.request_deserializer, h.response_serializer
            )
        elif h.unary_stream:
            wrapped = grpc.unary_stream_rpc_method_handler(
                self._stream(method, h.unary_stream), h.request_deserializer, h.response_serializer
            )
        elif h.stream_unary:
            wrapped = grpc.stream_unary_rpc_method_handler(
                self._unary(method, h.stream_unary), h.request_deserializer, h.response_serializer
            )
        elif h.stream_stream:
            wrapped = grpc.stream_stream_rpc_method_handler(
                self._stream(method, h.stream_stream),
                h.request_deserializer,
                h.response_serializer,
            )
        else:
            return handler
        self._handlers[method] = wrapped
        return wrapped

    def _enter(self, method: str, context: Ctx) -> Identity | None:
        if allowed_roles(method) is None:  # health, reflection: open
            return None
        metadata = [(k, v) for k, v in (context.invocation_metadata() or ())]
        identity = self.auth.identify(metadata, _peer_cns(context))
        self.auth.authorize(identity, method)
        current_identity.set(identity)
        return identity

    async def _fail(self, method: str, context: Ctx, exc: Exception) -> grpc.StatusCode:
        code, message = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("rpc failed", method=method, exc_info=exc)
        else:
            log.info("rpc refused", method=method, code=code.name, error=message)
        await context.abort(code, message)
        return code  # not reached: abort raises

    def _observe(self, method: str, code: str, t0: float) -> None:
        child = self._latency.get((method, code))
        if child is None:
            child = self._latency[(method, code)] = self.metrics.rpc_seconds.labels(method, code)
        child.observe(time.perf_counter() - t0)

    def _unary(self, method: str, inner: Any) -> Any:
        async def behavior(request: Any, context: Ctx) -> Any:
            t0 = time.perf_counter()
            code = "OK"
            try:
                self._enter(method, context)
                return await inner(request, context)
            except grpc.aio.AbortError:
                code = "ABORTED_BY_SERVICER"
                raise
            except Exception as exc:
                code = "ERROR"
                code = (await self._fail(method, context, exc)).name
                raise
            finally:
                self._observe(method, code, t0)

        return behavior

    def _stream(self, method: str, inner: Any) -> Any:
        async def behavior(request: Any, context: Ctx) -> Any:
            t0 = time.perf_counter()
            code = "OK"
            try:
                self._enter(method, context)
                async for item in inner(request, context):
                    yield item
            except grpc.aio.AbortError:
                code = "ABORTED_BY_SERVICER"
                raise
            except Exception as exc:
                code = "ERROR"
                code = (await self._fail(method, context, exc)).name
                raise
            finally:
                self._observe(method, code, t0)

        return behavior


def check_node(node: str) -> None:
    """The caller may act for ``node`` (node-bound agent certificates)."""
    identity = current_identity.get()
    if identity is not None and not identity.may_act_for(node):
        raise PermissionDeniedError(
            f"certificate {identity.name} may only act for node {identity.node}, not {node!r}",
            field="node",
        )
