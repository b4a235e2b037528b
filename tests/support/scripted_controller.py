"""A small real gRPC ``EngineService`` for the router's tests and ``bench.router_traffic``: it
serves the ``Instances`` and ``Routing`` messages a test scripts (each watch gets the current
message, then every new one), records the ``ReportTraffic`` calls, and can refuse them. The
controller's own implementation is tested end to end elsewhere; this one lets a test say
exactly what the controller lists."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
from mixfleet.v1 import engine_pb2, engine_pb2_grpc


def instance(
    name: str,
    url: str,
    *,
    role: str = "aggregated",
    pool: str = "",
    rps: float = 0.0,
    batch_limit: int = 0,
    ready: bool = True,
    draining: bool = False,
    bootstrap_port: int = 0,
) -> engine_pb2.Instance:
    """One listed instance (version 1 when ready)."""
    return engine_pb2.Instance(
        name=name,
        role=role,
        pool=pool or name,
        url=url,
        requests_per_s=rps,
        batch_limit=batch_limit,
        ready=ready,
        draining=draining,
        version=1 if ready else 0,
        bootstrap_port=bootstrap_port,
    )


class ScriptedEngineService(engine_pb2_grpc.EngineServiceServicer):
    """The servicer (module docstring).

    Attributes:
        sets: deployment -> its current Instances message (unknown: NOT_FOUND).
        routings: deployment (instance) name -> its current Routing message.
        reports: the traffic reports received, in order.
        refuse_reports: answer ReportTraffic with UNAVAILABLE.
    """

    def __init__(self) -> None:
        self.sets: dict[str, engine_pb2.Instances] = {}
        self.routings: dict[str, engine_pb2.Routing] = {}
        self.reports: list[engine_pb2.TrafficReport] = []
        self.refuse_reports = False
        self._bump = asyncio.Event()

    def publish(
        self, deployment: str, instances: Sequence[engine_pb2.Instance], engine: str = "sglang"
    ) -> None:
        """Make ``instances`` the deployment's current set (a new generation)."""
        old = self.sets.get(deployment)
        self.sets[deployment] = engine_pb2.Instances(
            deployment=deployment,
            engine=engine,
            generation=(old.generation + 1) if old is not None else 1,
            instances=list(instances),
        )
        self._wake()

    def route(self, name: str, weights: Sequence[float], engine: str = "sglang") -> None:
        """Commit ``weights`` (one per DP rank) as ``name``'s routing (a new version)."""
        old = self.routings.get(name)
        self.routings[name] = engine_pb2.Routing(
            deployment=name,
            version=(old.version + 1) if old is not None else 1,
            dp_weights=list(weights),
            engine=engine,
        )
        self._wake()

    def _wake(self) -> None:
        bump, self._bump = self._bump, asyncio.Event()
        bump.set()

    async def _stream(self, table: dict[str, Any], key: str, context: Any) -> AsyncIterator[Any]:
        if key not in table:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"deployment {key!r} not found")
        sent = None
        while True:
            bump = self._bump
            current = table[key]
            if current is not sent:
                sent = current
                yield current
            await bump.wait()

    async def WatchInstances(  # noqa: N802 (the generated servicer's name)
        self, request: engine_pb2.GetInstancesRequest, context: Any
    ) -> AsyncIterator[engine_pb2.Instances]:
        async for message in self._stream(self.sets, request.deployment, context):
            yield message

    async def WatchRouting(  # noqa: N802
        self, request: engine_pb2.GetRoutingRequest, context: Any
    ) -> AsyncIterator[engine_pb2.Routing]:
        async for message in self._stream(self.routings, request.deployment, context):
            yield message

    async def GetRouting(  # noqa: N802
        self, request: engine_pb2.GetRoutingRequest, context: Any
    ) -> engine_pb2.Routing:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")
        raise AssertionError("abort raises")

    async def ReportExpertLoad(  # noqa: N802
        self, request_iterator: Any, context: Any
    ) -> engine_pb2.ReportExpertLoadResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")
        raise AssertionError("abort raises")

    async def ReportTraffic(  # noqa: N802
        self, request: engine_pb2.TrafficReport, context: Any
    ) -> engine_pb2.ReportTrafficResponse:
        if self.refuse_reports:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "refused by the test")
        self.reports.append(request)
        return engine_pb2.ReportTrafficResponse(accepted=True)


@asynccontextmanager
async def scripted_controller(service: ScriptedEngineService, port: int = 0) -> AsyncIterator[str]:
    """Serve ``service`` on 127.0.0.1 (``port`` 0: any free one); yields ``HOST:PORT``."""
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(service, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield f"127.0.0.1:{bound}"
    finally:
        await server.stop(grace=None)
