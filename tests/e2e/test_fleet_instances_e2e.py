"""Fleet plans against real servers, per engine protocol: a controller on SQLite (gRPC on
loopback), simulated agents for examples/fleets/mixed-12.yaml advertising 127.0.0.1,
``mixfleet-router --deployment`` (its own process) and one loopback engine per instance the
controller lists (tests/support/openai_engine.py, speaking the protocol and role that
``EngineService.WatchInstances`` gives), all started by the demo's own parts
(:mod:`demo.instances_step`).

The deployment is the demo's Qwen3-30B-A3B with its demand and SLOs
(examples/deployments/qwen3-30b-a3b-demand.yaml), with SGLang or vLLM as its engine. The
planner serves it with an aggregated instance and a prefill/decode pool. A burst of requests
through the router must be served by exactly those instances: each request by one
aggregated or decode instance, each one that reached a decode instance also prefilled on a
prefill instance of its pool, with the protocol's hand-off fields (SGLang: bootstrap host,
port and room on both sides; vLLM: the prefill's ``kv_transfer_params`` passed to the
decode), in the shares the plan sets; the router's traffic reports reach the controller.

Counts only, no clock: the assertions hold however slowly the machine runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from demo.instances_step import (
    ADDRESS,
    FLEET_FILE,
    SETTINGS,
    Client,
    EngineFarm,
    Router,
    Story,
    demand_status,
    read_spec,
    routed,
    start_router,
)
from grpc import aio
from mixfleet.v1 import engine_pb2, engine_pb2_grpc, plan_pb2, plan_pb2_grpc

from agents.agent import AgentSettings
from agents.discovery.static import load_fleet_file
from agents.simulate import SimulatedFleet
from apis.wire.deployment import spec_to_proto
from controlplane.server.controller.demand import DemandSettings
from controlplane.server.inprocess import start_controller
from policies.estimate.engines import EngineName

REQUESTS = 240  # one request is 1/240 = 0.004 of the burst
CLIENTS = 8  # concurrent clients: below every instance's batch limit, so none waits
PROMPT_TOKENS = 512
OUTPUT_TOKENS = 4
#: The tolerance on a share of the burst: 12 requests of 240. The router's weighted rule
#: keeps each instance within a request or two of its planned count; an even split
#: (0.5 each) misses the aggregated instance's planned share (about a third) by far more.
SHARE_TOLERANCE = 0.05
#: The engine protocols a prefill/decode pair is driven in (TensorRT-LLM's pairs are its own
#: disaggregated server's business).
PROTOCOLS: dict[str, EngineName] = {"sglang": "sglang", "vllm": "vllm"}


def _free_port_block(count: int) -> int:
    """The first of ``count`` consecutive TCP ports free on the engines' address now: the
    controller's engine and bootstrap port bases, so that a demo (ports from 30000 and
    8998) or another test on the machine does not collide with this one's engines."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((ADDRESS, 0))
            base = int(probe.getsockname()[1])
        if base + count > 65536:
            continue
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind((ADDRESS, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free TCP ports on {ADDRESS}")


@dataclass
class Outcome:
    """What one run saw.

    Attributes:
        instances: the controller's list once every instance was ready.
        statuses: the HTTP status of each request (complete: its answer was whole).
        complete: requests whose answer came whole.
        served: requests each instance's engine served (prefill: the prefills it ran).
        seen: each prefill/decode engine's record of the hand-off fields it received.
        engine_ports: each instance's engine port.
        reported_requests: requests the controller counted from the router's reports.
    """

    instances: engine_pb2.Instances
    statuses: list[int]
    complete: int
    served: dict[str, int]
    seen: dict[str, list[dict[str, Any]]]
    engine_ports: dict[str, int]
    reported_requests: float


async def _burst(client: Client) -> None:
    """:data:`REQUESTS` requests from :data:`CLIENTS` concurrent clients, every 4th
    streamed."""
    todo = iter(range(REQUESTS))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one_client() -> None:
            for i in todo:
                await client.send(session, stream=i % 4 == 0)

        await asyncio.gather(*(one_client() for _ in range(CLIENTS)))


async def _serve(protocol: str, workdir: Path) -> Outcome:
    spec = read_spec()
    spec = replace(spec, engine=replace(spec.engine, name=PROTOCOLS[protocol]))
    fleet = load_fleet_file(FLEET_FILE)
    # the default drift settings: nothing this short re-plans; ports of its own
    base = _free_port_block(32)
    settings = replace(
        SETTINGS, demand=DemandSettings(), engine_base_port=base, bootstrap_base_port=base + 16
    )
    async with start_controller(workdir / "controller", settings=settings) as ctl:
        sim = SimulatedFleet(
            fleet,
            AgentSettings(controller=ctl.address, insecure=True),
            plan_dir=workdir / "agents",
            address=ADDRESS,
        )
        sim.start()
        channel = aio.insecure_channel(ctl.address)
        farm = EngineFarm(protocol, {n.name: len(n.gpus) for n in fleet.nodes})
        story = Story(
            spec,
            plan_pb2_grpc.PlanServiceStub(channel),
            engine_pb2_grpc.EngineServiceStub(channel),
            farm,
        )
        follow: asyncio.Task[None] | None = None
        router: Router | None = None
        session = aiohttp.ClientSession()
        try:
            await story.plans.ApplyDeployment(
                plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(spec)), timeout=30
            )
            follow = asyncio.create_task(story.follow())
            await story.until(
                lambda m: bool(m.instances) and all(i.ready and i.url for i in m.instances),
                300.0,
                "instances",
            )
            listed = story.latest
            router = await start_router(ctl.address, spec.name, workdir)
            await routed(router, session, listed, 120.0)
            client = Client(router.url, PROMPT_TOKENS, OUTPUT_TOKENS, 1.0)
            await _burst(client)
            # the router reports every second: wait for a report that counts the burst
            for _ in range(100):
                measured = demand_status(ctl, spec.name).measured
                if measured is not None and measured.requests > 0:
                    break
                await asyncio.sleep(0.2)
            return Outcome(
                instances=listed,
                statuses=[a.status for a in client.answers],
                complete=sum(a.complete for a in client.answers),
                served=farm.counts(),
                seen={n: list(r.engine.pd_seen) for n, r in farm.running.items()},
                engine_ports={n: r.engine.port for n, r in farm.running.items()},
                reported_requests=measured.requests if measured is not None else 0.0,
            )
        finally:
            if follow is not None:
                follow.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follow
            await session.close()
            if router is not None:
                await router.stop()
            await farm.stop()
            await sim.stop()
            await channel.close(None)


def _by_role(instances: Sequence[engine_pb2.Instance], role: str) -> list[engine_pb2.Instance]:
    return [i for i in instances if i.role == role]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_requests_flow_through_the_instances_the_controller_planned(
    protocol: str, tmp_path: Path
) -> None:
    out = asyncio.run(_serve(protocol, tmp_path))
    listed = list(out.instances.instances)
    assert out.instances.engine == protocol
    # the plan: an aggregated instance and a prefill/decode pool, each at its own port on
    # the address the agents advertise
    aggregated = _by_role(listed, "aggregated")
    prefill, decode = _by_role(listed, "prefill"), _by_role(listed, "decode")
    assert aggregated and prefill and decode, listed
    assert {i.pool for i in prefill} == {i.pool for i in decode}
    urls = [urlsplit(i.url) for i in listed]
    assert {u.hostname for u in urls} == {ADDRESS}
    assert len({u.port for u in urls}) == len(listed)

    # every request answered, whole, by the instances the controller listed
    assert out.statuses == [200] * REQUESTS
    assert out.complete == REQUESTS
    serving = aggregated + decode
    assert sum(out.served[i.name] for i in serving) == REQUESTS
    # each request of the pair prefilled once, on its pool's prefill side
    assert sum(out.served[i.name] for i in prefill) == sum(out.served[i.name] for i in decode)

    # the shares the plan sets (requests/s of each aggregated instance and decode side)
    planned_total = sum(i.requests_per_s for i in serving)
    for i in serving:
        planned = i.requests_per_s / planned_total
        got = out.served[i.name] / REQUESTS
        assert abs(got - planned) <= SHARE_TOLERANCE, (i.name, planned, got)

    # the prefill/decode hand-off as the protocol drives it, on both sides
    pre = [s for i in prefill for s in out.seen[i.name]]
    dec = [s for i in decode for s in out.seen[i.name]]
    assert len(pre) == len(dec) == sum(out.served[i.name] for i in decode) > 0
    if protocol == "sglang":
        ports = {i.bootstrap_port for i in prefill}
        for side in (pre, dec):
            assert {s["bootstrap_host"] for s in side} == {ADDRESS}
            assert {s["bootstrap_port"] for s in side} <= ports
        assert sorted(s["bootstrap_room"] for s in pre) == sorted(s["bootstrap_room"] for s in dec)
    else:
        assert all(s["kv_transfer_params"]["do_remote_decode"] is True for s in pre)
        assert all(s["max_tokens"] == 1 for s in pre)
        prefill_ports = {out.engine_ports[i.name] for i in prefill}
        assert {s["kv_transfer_params"]["remote_port"] for s in dec} <= prefill_ports
        assert sorted(s["request_id"] for s in pre) == sorted(s["request_id"] for s in dec)

    # the router's traffic reports reached the controller
    assert out.reported_requests > 0
