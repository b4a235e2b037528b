"""EngineService: inference engines read the routing and report expert load; routers follow a
deployment's engine instances and report the traffic they measure."""

# ruff: noqa: N802  (gRPC servicer methods are named after the RPCs)

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from mixfleet.v1 import engine_pb2, engine_pb2_grpc

from controlplane.server.controller import Controller
from controlplane.server.controller.measured import TrafficWindow
from controlplane.server.services.guard import Ctx
from controlplane.store import LoadWindow
from controlplane.wire.instances import instances_to_proto
from controlplane.wire.plans import routing_to_proto
from policies.errors import InputError
from policies.limits import MAX_VERSION, bounded_int


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self.c = controller

    async def GetRouting(
        self, request: engine_pb2.GetRoutingRequest, context: Ctx
    ) -> engine_pb2.Routing:
        # Reading a plan back and exporting it grow with the fleet: off the loop.
        plan = await asyncio.to_thread(self.c.routing_plan, request.deployment)
        return await asyncio.to_thread(routing_to_proto, plan, request.format)

    async def WatchRouting(
        self, request: engine_pb2.GetRoutingRequest, context: Ctx
    ) -> AsyncIterator[engine_pb2.Routing]:
        async for p in self.c.watch_routing(request.deployment):
            yield await asyncio.to_thread(routing_to_proto, p, request.format)

    async def ReportExpertLoad(
        self, request_iterator: AsyncIterator[engine_pb2.ExpertLoadWindow], context: Ctx
    ) -> engine_pb2.ReportExpertLoadResponse:
        accepted = 0
        async for w in request_iterator:
            path = f"windows[{accepted}]"
            if w.num_layers <= 0 or w.num_experts <= 0:
                raise InputError("must be > 0", field=f"{path}.num_layers/num_experts")
            bounded_int(w.plan_version, f"{path}.plan_version", minimum=0, maximum=MAX_VERSION)
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

    async def WatchInstances(
        self, request: engine_pb2.GetInstancesRequest, context: Ctx
    ) -> AsyncIterator[engine_pb2.Instances]:
        async for generation, instances in self.c.endpoints.watch(request.deployment):
            yield instances_to_proto(instances, generation)

    async def ReportTraffic(
        self, request: engine_pb2.TrafficReport, context: Ctx
    ) -> engine_pb2.ReportTrafficResponse:
        r = request
        window = TrafficWindow(
            deployment=r.deployment,
            reporter=r.reporter,
            start_s=r.start_unix_s,
            end_s=r.end_unix_s,
            requests=r.requests,
            input_tokens_mean=r.input_tokens_mean,
            input_tokens_p90=r.input_tokens_p90,
            output_tokens_mean=r.output_tokens_mean,
            output_tokens_p90=r.output_tokens_p90,
            ttft_ms_p50=r.ttft_ms_p50,
            ttft_ms_p99=r.ttft_ms_p99,
            tpot_ms_p50=r.tpot_ms_p50,
            tpot_ms_p99=r.tpot_ms_p99,
            slo_judged=r.slo_judged,
            slo_met=r.slo_met,
        )
        return engine_pb2.ReportTrafficResponse(accepted=self.c.demands.report(window))
