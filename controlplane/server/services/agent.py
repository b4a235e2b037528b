"""AgentService: node agents register, heartbeat, watch their assignments and ack them."""

# ruff: noqa: N802  (gRPC servicer methods are named after the RPCs)

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from mixfleet.v1 import agent_pb2, agent_pb2_grpc

from apis.wire.inventory import health_from_proto, inventory_from_proto
from controlplane.server.controller import Controller
from controlplane.server.services.guard import Ctx, check_node, log, status_for
from controlplane.wire.plans import ACK_FROM_PROTO, NODE_STATE_FROM_PROTO, assignment_to_proto
from policies.errors import InputError, MixfleetError
from policies.limits import MAX_VERSION, bounded_int


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self.c = controller

    async def Register(
        self, request: agent_pb2.RegisterRequest, context: Ctx
    ) -> agent_pb2.RegisterResponse:
        if not request.HasField("inventory"):
            raise InputError("missing", field="inventory")
        inv = inventory_from_proto(request.inventory)
        check_node(inv.node)
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
        check_node(request.node)
        for name, version in request.applied.items():
            bounded_int(version, f"applied[{name!r}]", minimum=0, maximum=MAX_VERSION)
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
        check_node(request.node)
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
        check_node(request.node)
        state = ACK_FROM_PROTO.get(request.state)
        if state is None:
            raise InputError("must be PREPARED, COMMITTED or FAILED", field="state")
        if not request.deployment:
            raise InputError("missing", field="deployment")
        if not 0 < request.version <= MAX_VERSION:
            raise InputError(f"must be from 1 to {MAX_VERSION}", field="version")
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
