"""A scripted AgentService for agent tests: real gRPC on loopback, no controller logic.

Tests push assignments into a node's queue and read back what the agent sent (registers,
heartbeats, acks). Faults are switches: refuse Register with a status, ask for re-register.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
from grpc import aio
from mixfleet.v1 import agent_pb2, agent_pb2_grpc
from support.waits import hang_guard_s

Ctx = aio.ServicerContext[Any, Any]


@dataclass
class FakeAgentService:
    """Duck-typed AgentService servicer."""

    heartbeat_interval_s: float = 0.05
    registers: list[agent_pb2.RegisterRequest] = field(default_factory=list)
    heartbeats: list[agent_pb2.HeartbeatRequest] = field(default_factory=list)
    acks: list[agent_pb2.AckRequest] = field(default_factory=list)
    queues: dict[str, asyncio.Queue[agent_pb2.Assignment | None]] = field(default_factory=dict)
    refuse_register: grpc.StatusCode | None = None
    reregister_next: bool = False
    ack_error: grpc.StatusCode | None = None
    metadata_seen: list[dict[str, str]] = field(default_factory=list)
    sessions: int = 0
    heartbeat_stream: bool = True
    ack_stream: bool = True
    ack_stream_opens: int = 0
    stream_opens: int = 0

    def queue(self, node: str) -> asyncio.Queue[agent_pb2.Assignment | None]:
        return self.queues.setdefault(node, asyncio.Queue())

    async def Register(  # noqa: N802
        self, request: agent_pb2.RegisterRequest, context: Ctx
    ) -> agent_pb2.RegisterResponse:
        self.metadata_seen.append({k: str(v) for k, v in context.invocation_metadata() or ()})
        if self.refuse_register is not None:
            await context.abort(self.refuse_register, "inventory.gpus[0].uuid: refused by test")
        self.registers.append(request)
        self.sessions += 1
        return agent_pb2.RegisterResponse(
            node=request.inventory.node,
            session_id=f"s{self.sessions}",
            heartbeat_interval_s=self.heartbeat_interval_s,
            node_lost_after_s=1.0,
            controller_id="fake",
        )

    async def Heartbeat(  # noqa: N802
        self, request: agent_pb2.HeartbeatRequest, context: Ctx
    ) -> agent_pb2.HeartbeatResponse:
        self.heartbeats.append(request)
        if self.reregister_next:
            self.reregister_next = False
            return agent_pb2.HeartbeatResponse(reregister=True)
        return agent_pb2.HeartbeatResponse(heartbeat_interval_s=self.heartbeat_interval_s)

    async def HeartbeatStream(  # noqa: N802
        self, request_iterator: AsyncIterator[agent_pb2.HeartbeatRequest], context: Ctx
    ) -> AsyncIterator[agent_pb2.HeartbeatResponse]:
        if not self.heartbeat_stream:  # an older controller
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        self.stream_opens += 1
        async for request in request_iterator:
            yield await self.Heartbeat(request, context)

    async def WatchAssignments(  # noqa: N802
        self, request: agent_pb2.WatchAssignmentsRequest, context: Ctx
    ) -> AsyncIterator[agent_pb2.Assignment]:
        q = self.queue(request.node)
        while True:
            msg = await q.get()
            if msg is None:  # the test closes the stream
                return
            yield msg

    async def AckStream(  # noqa: N802
        self, request_iterator: AsyncIterator[agent_pb2.AckRequest], context: Ctx
    ) -> AsyncIterator[agent_pb2.AckResponse]:
        if not self.ack_stream:  # an older controller
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        self.ack_stream_opens += 1
        async for request in request_iterator:
            if self.ack_error is not None:
                yield agent_pb2.AckResponse(code=self.ack_error.value[0], message="refused by test")
                continue
            self.acks.append(request)
            yield agent_pb2.AckResponse()

    async def Ack(  # noqa: N802
        self, request: agent_pb2.AckRequest, context: Ctx
    ) -> agent_pb2.AckResponse:
        if self.ack_error is not None:
            await context.abort(self.ack_error, "refused by test")
        self.acks.append(request)
        return agent_pb2.AckResponse()


async def start_fake(service: FakeAgentService, port: int = 0) -> tuple[aio.Server, int]:
    server = aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(cast(Any, service), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


async def wait_for(predicate: object, timeout_s: float = 5.0, what: str = "") -> None:
    """Poll ``predicate()`` every 10 ms until it is true or ``timeout_s`` passes (at least
    :data:`support.waits.HANG_GUARD_S`: a hang guard, not a speed claim)."""
    assert callable(predicate)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + hang_guard_s(timeout_s)
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.01)
