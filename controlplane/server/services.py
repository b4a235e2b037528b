"""The controller's gRPC server: AgentService, PlanService, EngineService, health, reflection.

Servicers are thin: they turn messages into plain values, call the
:class:`controlplane.server.controller.Controller`, and turn the answer back into messages. One
interceptor (:class:`_Guard`) wraps every method: it authenticates and authorizes the caller
(:mod:`controlplane.server.auth`), maps the project's errors to status codes with
``context.abort`` (:func:`status_for`), logs and times the call.

:func:`create_server` returns ``(server, port)`` so tests bind port 0.
"""

# ruff: noqa: N802  (gRPC servicer methods are named after the RPCs)

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import structlog
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from mixfleet.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    plan_pb2,
    plan_pb2_grpc,
)

from apis.wire.inventory import health_from_proto, inventory_from_proto
from controlplane.deployment import spec_from_proto
from controlplane.errors import (
    AlreadyExistsError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    StoreError,
    UnauthenticatedError,
)
from controlplane.server.auth import (
    Authenticator,
    Identity,
    allowed_roles,
    current_identity,
    load_tokens,
)
from controlplane.server.controller import Controller
from controlplane.server.strategies import StrategyService
from controlplane.store import LoadWindow, StoredDeployment
from controlplane.wire.plans import (
    ACK_FROM_PROTO,
    NODE_STATE_FROM_PROTO,
    assignment_to_proto,
    deployment_to_proto,
    diff_to_proto,
    node_to_proto,
    plan_to_proto,
    routing_to_proto,
    unstored_plan_to_proto,
)
from controlplane.wire.strategies import (
    batch_question,
    batch_to_proto,
    context_question,
    context_to_proto,
    cost_question,
    cost_to_proto,
    min_cost_question,
    min_cost_to_proto,
    tiers_question,
    tiers_to_proto,
)
from policies.assignment import diff_plans
from policies.errors import InfeasibleError, InputError, MixfleetError
from policies.fleet import parse_fleet

MIB = 1 << 20
SERVICE_NAMES = (
    agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
    plan_pb2.DESCRIPTOR.services_by_name["PlanService"].full_name,
    engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name,
)
log = structlog.get_logger("mixfleet.server")

if TYPE_CHECKING:
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
    Ctx = grpc.aio.ServicerContext[Any, Any]
else:  # the runtime classes are not generic
    _Interceptor = grpc.aio.ServerInterceptor
    Ctx = grpc.aio.ServicerContext


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of the server side of mutual TLS.

    Attributes:
        cert: server certificate (chain).
        key: its private key.
        ca: CA that signed the client certificates to accept.
    """

    cert: Path
    key: Path
    ca: Path


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and whom it lets in.

    Attributes:
        tls: mutual TLS files; None = plaintext (needs ``insecure`` and a loopback address).
        token_file: bearer tokens (see :mod:`controlplane.server.auth`); None = no tokens.
        insecure: allow plaintext; only on a loopback address.
        max_receive_message_bytes: largest request message accepted, bytes.
        max_send_message_bytes: largest response message sent, bytes.
        max_pending_rpcs: calls gRPC may hold that the server has not picked up yet (its
            ``grpc.server.max_pending_requests``; the hard limit is twice this). gRPC's
            default of 1,000 is too small for a fleet: every agent keeps a WatchAssignments
            stream open and heartbeats, so when the event loop is busy for a moment (a
            rollout to 2,000 nodes) more than 1,000 calls arrive before it picks them up, and
            gRPC refuses the excess - streams that never open, heartbeats that fail, nodes
            declared lost.
    """

    tls: TlsFiles | None = None
    token_file: Path | None = None
    insecure: bool = False
    max_receive_message_bytes: int = 16 * MIB
    max_send_message_bytes: int = 64 * MIB
    max_pending_rpcs: int = 32_768


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


class _Guard(_Interceptor):
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


def _check_node(node: str) -> None:
    """The caller may act for ``node`` (node-bound agent certificates)."""
    identity = current_identity.get()
    if identity is not None and not identity.may_act_for(node):
        raise PermissionDeniedError(
            f"certificate {identity.name} may only act for node {identity.node}, not {node!r}",
            field="node",
        )


# --------------------------------------------------------------------------- servicers


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self.c = controller

    async def Register(
        self, request: agent_pb2.RegisterRequest, context: Ctx
    ) -> agent_pb2.RegisterResponse:
        if not request.HasField("inventory"):
            raise InputError("missing", field="inventory")
        inv = inventory_from_proto(request.inventory)
        _check_node(inv.node)
        r = self.c.register(inv)
        return agent_pb2.RegisterResponse(
            node=r.node,
            session_id=r.session_id,
            heartbeat_interval_s=r.heartbeat_interval_s,
            node_lost_after_s=r.node_lost_after_s,
            controller_id=r.controller_id,
        )

    async def Heartbeat(
        self, request: agent_pb2.HeartbeatRequest, context: Ctx
    ) -> agent_pb2.HeartbeatResponse:
        return self._heartbeat(request)

    async def HeartbeatStream(
        self, request_iterator: AsyncIterator[agent_pb2.HeartbeatRequest], context: Ctx
    ) -> AsyncIterator[agent_pb2.HeartbeatResponse]:
        async for request in request_iterator:
            yield self._heartbeat(request)

    def _heartbeat(self, request: agent_pb2.HeartbeatRequest) -> agent_pb2.HeartbeatResponse:
        _check_node(request.node)
        health: dict[int, Any] = {}
        for k, h in enumerate(request.gpu_health):
            if h.index in health:
                raise InputError(f"GPU {h.index} reported twice", field=f"gpu_health[{k}].index")
            health[h.index] = health_from_proto(h.health)
        ok = self.c.heartbeat(
            request.node,
            request.session_id,
            state=NODE_STATE_FROM_PROTO.get(request.state, "ready"),  # type: ignore[arg-type]
            message=request.message,
            health=health,
            applied=dict(request.applied),
        )
        return agent_pb2.HeartbeatResponse(
            reregister=not ok, heartbeat_interval_s=self.c.settings.heartbeat_interval_s
        )

    async def WatchAssignments(
        self, request: agent_pb2.WatchAssignmentsRequest, context: Ctx
    ) -> AsyncIterator[agent_pb2.Assignment]:
        _check_node(request.node)
        async for event in self.c.watch_assignments(request.node, request.session_id):
            yield assignment_to_proto(event)

    async def Ack(self, request: agent_pb2.AckRequest, context: Ctx) -> agent_pb2.AckResponse:
        return self._ack(request)

    async def AckStream(
        self, request_iterator: AsyncIterator[agent_pb2.AckRequest], context: Ctx
    ) -> AsyncIterator[agent_pb2.AckResponse]:
        async for request in request_iterator:
            try:
                yield self._ack(request)
            except MixfleetError as exc:  # refused: say so in-band, keep the stream
                code, message = status_for(exc)
                log.info("rpc refused", method="AckStream", code=code.name, error=message)
                yield agent_pb2.AckResponse(code=code.value[0], message=message)

    def _ack(self, request: agent_pb2.AckRequest) -> agent_pb2.AckResponse:
        _check_node(request.node)
        state = ACK_FROM_PROTO.get(request.state)
        if state is None:
            raise InputError("must be PREPARED, COMMITTED or FAILED", field="state")
        if not request.deployment:
            raise InputError("missing", field="deployment")
        if request.version == 0:
            raise InputError("must be > 0", field="version")
        duplicate = self.c.ack(
            request.node,
            request.session_id,
            request.deployment,
            request.plan_id,
            request.version,
            state,
            request.reason,
        )
        return agent_pb2.AckResponse(duplicate=duplicate)


class PlanServicer(plan_pb2_grpc.PlanServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self.strategies = StrategyService(controller)

    def _deployment(self, d: StoredDeployment) -> plan_pb2.Deployment:
        latest = self.c.store.list_plans(d.name, limit=1)
        return deployment_to_proto(d, latest_version=latest[0].version if latest else 0)

    async def _apply(
        self, request: plan_pb2.ApplyDeploymentRequest, *, create: bool, update: bool
    ) -> plan_pb2.Deployment:
        if not request.HasField("spec"):
            raise InputError("missing", field="spec")
        spec = spec_from_proto(request.spec)
        return self._deployment(
            self.c.apply_deployment(spec, create_only=create, update_only=update)
        )

    async def CreateDeployment(
        self, request: plan_pb2.ApplyDeploymentRequest, context: Ctx
    ) -> plan_pb2.Deployment:
        return await self._apply(request, create=True, update=False)

    async def UpdateDeployment(
        self, request: plan_pb2.ApplyDeploymentRequest, context: Ctx
    ) -> plan_pb2.Deployment:
        return await self._apply(request, create=False, update=True)

    async def ApplyDeployment(
        self, request: plan_pb2.ApplyDeploymentRequest, context: Ctx
    ) -> plan_pb2.Deployment:
        return await self._apply(request, create=False, update=False)

    async def DeleteDeployment(
        self, request: plan_pb2.DeleteDeploymentRequest, context: Ctx
    ) -> plan_pb2.DeleteDeploymentResponse:
        if not request.name:
            raise InputError("missing", field="name")
        return plan_pb2.DeleteDeploymentResponse(deleted=self.c.delete_deployment(request.name))

    async def GetDeployment(
        self, request: plan_pb2.GetDeploymentRequest, context: Ctx
    ) -> plan_pb2.Deployment:
        return self._deployment(self.c.get_deployment(request.name))

    async def ListDeployments(
        self, request: plan_pb2.ListDeploymentsRequest, context: Ctx
    ) -> plan_pb2.ListDeploymentsResponse:
        return plan_pb2.ListDeploymentsResponse(
            deployments=[self._deployment(d) for d in self.c.store.list_deployments()]
        )

    async def Solve(self, request: plan_pb2.SolveRequest, context: Ctx) -> plan_pb2.SolveResponse:
        if not request.HasField("spec"):
            raise InputError("missing", field="spec")
        spec = spec_from_proto(request.spec)
        fleet = None
        if request.fleet_json:
            try:
                doc = json.loads(request.fleet_json.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise InputError(f"not valid UTF-8 JSON: {exc}", field="fleet_json") from exc
            try:
                fleet = parse_fleet(doc)
            except InputError as exc:
                raise InputError(str(exc), field=f"fleet_json.{exc.field}") from exc
        try:
            result = await self.c.dry_run(spec, fleet)
        except InfeasibleError as exc:
            return plan_pb2.SolveResponse(infeasible=[str(exc).split("\n")[0], *exc.reasons])
        return plan_pb2.SolveResponse(
            plan=unstored_plan_to_proto(result.plan, with_doc=request.include_plan),
            infeasible=list(result.infeasible),
        )

    async def GetPlan(self, request: plan_pb2.GetPlanRequest, context: Ctx) -> plan_pb2.PlanRecord:
        if not request.deployment:
            raise InputError("missing", field="deployment")
        # Reading a plan document back and encoding it grows with the fleet (about a second
        # at 2,000 GPUs): a thread keeps heartbeats and rollouts moving meanwhile.
        p = await asyncio.to_thread(self.c.get_plan, request.deployment, request.version)
        acks = self.c.acks_of(p.deployment, p.version)
        return await asyncio.to_thread(plan_to_proto, p, acks=acks, with_doc=True)

    async def ListPlans(
        self, request: plan_pb2.ListPlansRequest, context: Ctx
    ) -> plan_pb2.ListPlansResponse:
        if request.limit < 0:
            raise InputError("must be >= 0", field="limit")
        plans = self.c.store.list_plans(request.deployment or None, limit=request.limit or 50)
        return plan_pb2.ListPlansResponse(plans=[plan_to_proto(p) for p in plans])

    async def WatchPlans(
        self, request: plan_pb2.WatchPlansRequest, context: Ctx
    ) -> AsyncIterator[plan_pb2.PlanEvent]:
        async for p in self.c.watch_plans(request.deployment):
            yield plan_pb2.PlanEvent(plan=plan_to_proto(p))

    async def DiffPlans(
        self, request: plan_pb2.DiffPlansRequest, context: Ctx
    ) -> plan_pb2.PlanDiff:
        if not request.deployment:
            raise InputError("missing", field="deployment")
        b = self.c.get_plan(request.deployment, request.to_version)
        if request.from_version:
            a = self.c.get_plan(request.deployment, request.from_version)
        else:
            older = [
                p
                for p in self.c.store.list_plans(request.deployment, limit=1000)
                if p.version < b.version and p.state in ("committed", "superseded")
            ]
            if not older:
                raise NotFoundError(
                    f"no served version before {b.version} to compare with. To fix: give "
                    "from_version",
                    field="from_version",
                )
            a = self.c.get_plan(request.deployment, older[0].version)
        assert a.plan is not None and b.plan is not None
        return diff_to_proto(request.deployment, a.version, b.version, diff_plans(a.plan, b.plan))

    async def ListNodes(
        self, request: plan_pb2.ListNodesRequest, context: Ctx
    ) -> plan_pb2.ListNodesResponse:
        return plan_pb2.ListNodesResponse(nodes=[node_to_proto(v) for v in self.c.node_views()])

    async def GetNode(self, request: plan_pb2.GetNodeRequest, context: Ctx) -> plan_pb2.NodeRecord:
        for v in self.c.node_views(only=request.name):
            return node_to_proto(v)
        raise NotFoundError(f"no node {request.name!r}", field="name")

    # Deployment strategies: parse and validate (strategy_wire), answer on the live fleet
    # in a worker thread (strategy_service), reply.

    async def AdviseTiers(
        self, request: plan_pb2.AdviseTiersRequest, context: Ctx
    ) -> plan_pb2.AdviseTiersResponse:
        return tiers_to_proto(await self.strategies.tiers(tiers_question(request)))

    async def AdviseBatch(
        self, request: plan_pb2.AdviseBatchRequest, context: Ctx
    ) -> plan_pb2.AdviseBatchResponse:
        return batch_to_proto(await self.strategies.batch(batch_question(request)))

    async def AdviseContext(
        self, request: plan_pb2.AdviseContextRequest, context: Ctx
    ) -> plan_pb2.AdviseContextResponse:
        return context_to_proto(await self.strategies.context(context_question(request)))

    async def EstimateCost(
        self, request: plan_pb2.EstimateCostRequest, context: Ctx
    ) -> plan_pb2.EstimateCostResponse:
        return cost_to_proto(await self.strategies.cost(cost_question(request)))

    async def MinCost(
        self, request: plan_pb2.MinCostRequest, context: Ctx
    ) -> plan_pb2.MinCostResponse:
        answer = await self.strategies.min_cost(min_cost_question(request))
        return min_cost_to_proto(answer, with_docs=request.include_plans)


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self.c = controller

    async def GetRouting(
        self, request: engine_pb2.GetRoutingRequest, context: Ctx
    ) -> engine_pb2.Routing:
        return routing_to_proto(self.c.routing_plan(request.deployment), request.format)

    async def WatchRouting(
        self, request: engine_pb2.GetRoutingRequest, context: Ctx
    ) -> AsyncIterator[engine_pb2.Routing]:
        async for p in self.c.watch_routing(request.deployment):
            yield routing_to_proto(p, request.format)

    async def ReportExpertLoad(
        self, request_iterator: AsyncIterator[engine_pb2.ExpertLoadWindow], context: Ctx
    ) -> engine_pb2.ReportExpertLoadResponse:
        accepted = 0
        async for w in request_iterator:
            path = f"windows[{accepted}]"
            if w.num_layers <= 0 or w.num_experts <= 0:
                raise InputError("must be > 0", field=f"{path}.num_layers/num_experts")
            if len(w.counts) != w.num_layers * w.num_experts:
                raise InputError(
                    f"has {len(w.counts)} values, num_layers x num_experts is "
                    f"{w.num_layers * w.num_experts}",
                    field=f"{path}.counts",
                )
            rows = tuple(
                tuple(w.counts[i * w.num_experts : (i + 1) * w.num_experts])
                for i in range(w.num_layers)
            )
            window = LoadWindow(
                w.deployment, w.engine_id, w.start_unix_s, w.end_unix_s, w.plan_version, rows
            )
            try:
                self.c.report_load(window)
            except InputError as exc:
                raise InputError(str(exc).split(": ", 1)[-1], field=f"{path}.{exc.field}") from exc
            accepted += 1
        return engine_pb2.ReportExpertLoadResponse(windows_accepted=accepted)


# --------------------------------------------------------------------------- server


def is_loopback(address: str) -> bool:
    """Whether ``HOST:PORT`` names a loopback host."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def create_server(
    address: str, controller: Controller, options: ServerOptions | None = None
) -> tuple[grpc.aio.Server, int]:
    """Build (not start) the server on ``address`` (``HOST:PORT``; port 0 = any free port).

    Returns:
        ``(server, port)``; ``await server.start()`` to serve.

    Raises:
        InputError: plaintext without ``insecure`` or off loopback, unreadable TLS or token
            files, or the address cannot be bound.
    """
    opts = options or ServerOptions()
    if opts.tls is None:
        if not opts.insecure:
            raise InputError(
                "no TLS configured. To fix: pass --tls-cert/--tls-key/--tls-ca (make them "
                "with 'mixfleetctl certs init DIR'), or --insecure on a loopback address",
                field="tls",
            )
        if not is_loopback(address):
            raise InputError(
                f"--insecure is only allowed on loopback, not {address}. To fix: listen on "
                "127.0.0.1 or configure TLS",
                field="listen",
            )
    tokens = load_tokens(opts.token_file) if opts.token_file is not None else None
    auth = Authenticator(tokens, dev_mode=opts.tls is None and opts.insecure)
    server = grpc.aio.server(
        interceptors=[_Guard(auth, controller)],
        options=[
            ("grpc.max_receive_message_length", opts.max_receive_message_bytes),
            ("grpc.max_send_message_length", opts.max_send_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.server.max_pending_requests", opts.max_pending_rpcs),
            ("grpc.server.max_pending_requests_hard_limit", 2 * opts.max_pending_rpcs),
        ],
    )
    agent_pb2_grpc.add_AgentServiceServicer_to_server(AgentServicer(controller), server)
    plan_pb2_grpc.add_PlanServiceServicer_to_server(PlanServicer(controller), server)
    engine_pb2_grpc.add_EngineServiceServicer_to_server(EngineServicer(controller), server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        if opts.tls is not None:
            creds = grpc.ssl_server_credentials(
                [(opts.tls.key.read_bytes(), opts.tls.cert.read_bytes())],
                root_certificates=opts.tls.ca.read_bytes(),
                require_client_auth=True,
            )
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except OSError as exc:
        raise InputError(f"cannot read TLS files: {exc}", field="tls") from exc
    except RuntimeError as exc:
        raise InputError(f"cannot listen on {address}: {exc}", field="listen") from exc
    if port == 0:
        raise InputError(f"cannot listen on {address}", field="listen")
    server.mixfleet_health = health_servicer  # type: ignore[attr-defined]
    return server, port


async def mark_serving(server: grpc.aio.Server) -> None:
    """Set the health status of the whole server and each service to SERVING."""
    h: health_aio.HealthServicer = server.mixfleet_health  # type: ignore[attr-defined]
    for name in ("", *SERVICE_NAMES):
        await h.set(name, health_pb2.HealthCheckResponse.SERVING)
