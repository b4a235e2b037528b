"""The demo's fleet-plan step: one deployment stated by its demand and SLOs, served as
several engine instances, routed by mixfleet-router, re-planned when the demand doubles.

1. A controller on SQLite with its drift settings shortened (:data:`SETTINGS`: the re-plan
   comes within seconds, not minutes) and simulated agents for examples/fleets/mixed-12.yaml
   (two A100, two H100 and two H200 nodes of 2 GPUs) advertising 127.0.0.1 as where their
   engines serve.
2. Qwen3-30B-A3B on SGLang (examples/deployments/qwen3-30b-a3b-demand.yaml): 15 requests/s
   of 8192-token prompts and 64-token answers, TTFT 1 s and TPOT 20 ms at p90,
   disaggregation left to the planner. The controller's fleet planner cuts it into engine
   instances, listed by ``EngineService.WatchInstances``: an aggregated instance and a
   prefill/decode pair (``mixfleetctl schedule show --fleet ... -f ...`` shows the same).
3. One loopback engine per instance at the instance's URL (its role and protocol from
   WatchInstances; an SGLang prefill instance's bootstrap server at its bootstrap port),
   generating one token per predicted TPOT of the instance. **The loopback engines stand in
   for the GPUs**: they do no prefill work and no batching, so the measured latencies are
   those of the request path (router, prefill/decode hand-off, the paced tokens), not of a
   GPU.
4. ``mixfleet-router --deployment qwen3`` (its own process) takes the instances, their
   shares and batch limits from the controller and reports the traffic it measures.
5. A client load at the planned demand (Poisson arrivals, every :data:`STREAM_EVERY`-th
   request streamed so that TTFT and TPOT can be seen); the tables: each instance's planned
   share against the requests it got, and TTFT/TPOT and SLO attainment as the planner
   predicted them, as the serving simulator (``policies.serving.simulate``, what
   ``mixfleetctl serve simulate`` runs) finds them on the same fleet plan, and as measured.
6. The demand doubles; the router's reports show it to the controller, which re-plans once
   the drift has lasted long enough and adds instances; the demo starts their engines as
   WatchInstances lists them, the router follows, and no answer that has begun is cut (a
   request the router refuses - no free batch slot, no routable instance - is counted and
   shown with the router's reason).

Every wait prints progress; the router's log goes to ``router-instances.log`` beside the
other logs.

This module holds the step's inputs and settings and runs it, phase by phase (:func:`run`);
the engines, the client and the router process are in :mod:`demo.instances_serving`, the
tables and lines it prints in :mod:`demo.instances_report`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from grpc import aio
from mixfleet.v1 import engine_pb2, engine_pb2_grpc, plan_pb2, plan_pb2_grpc

from agents.agent import AgentSettings
from agents.backoff import BackoffSettings
from agents.discovery.static import load_fleet_file
from agents.simulate import SimulatedFleet
from apis.wire.deployment import spec_to_proto
from controlplane.server.controller import ControllerSettings
from controlplane.server.controller.demand import DemandStatus
from controlplane.server.controller.measured import DemandSettings
from controlplane.server.inprocess import RunningController, start_controller
from demo.instances_report import (
    Latencies,
    measured,
    predicted,
    show_instances,
    show_latencies,
    show_measured,
    show_router,
    show_shares,
    simulated,
    verdict,
)

# the ``X as X`` names are re-exported: the fleet-plan end-to-end test imports them from here
from demo.instances_serving import ADDRESS as ADDRESS
from demo.instances_serving import REPO, STREAM_EVERY, current
from demo.instances_serving import Client as Client
from demo.instances_serving import EngineFarm as EngineFarm
from demo.instances_serving import Router as Router
from demo.instances_serving import routed as routed
from demo.instances_serving import start_router as start_router
from demo.session import PROGRESS_S, say
from policies.spec.build import DeploymentSpec
from policies.spec.document import parse_deployment

FLEET_FILE = REPO / "examples" / "fleets" / "mixed-12.yaml"
DEPLOYMENT_FILE = REPO / "examples" / "deployments" / "qwen3-30b-a3b-demand.yaml"
LOAD_S = 16.0  # client load at the planned demand, s
SHIFT = 2.0  # the demand shift: the client's rate times this
SHIFT_LIMIT_S = 120.0  # longest wait for the re-plan after the shift, s
READY_LIMIT_S = 120.0  # longest wait for the first instances and the router, s
TAIL_S = 10.0  # load on the new instances after the re-plan, s
#: Demo timing: quick ticks and heartbeats; drift settings shortened from minutes to seconds
#: (``mixfleetctl controller run --drift-threshold 0.5 --drift-sustain 6`` and the like): the
#: measured rate, in 2-s buckets, must stay out of the band [planned / 1.5, planned x 1.5]
#: for 6 s (the band is wide because the demo's client, engines and controller share a small
#: machine: a doubled demand leaves it, a busy moment does not); at most one re-plan in two
#: minutes (one in the demo).
SETTINGS = ControllerSettings(
    heartbeat_interval_s=1.0,
    node_lost_after_s=5.0,
    tick_s=0.2,
    retry_after_abort_s=2.0,
    retry_after_error_s=2.0,
    drain_grace_s=5.0,  # a dropped instance drains 5 s (--drain-grace); answers take ~1 s
    demand=DemandSettings(
        drift_threshold=0.5,
        sustain_s=6.0,
        min_interval_s=120.0,
        bucket_s=2.0,
        status_write_s=1.0,
    ),
)


def read_spec() -> DeploymentSpec:
    """The demo's deployment (:data:`DEPLOYMENT_FILE`)."""
    return parse_deployment(yaml.safe_load(DEPLOYMENT_FILE.read_text()))


# ------------------------------------------------------------------------- the story


async def watch(
    engines: engine_pb2_grpc.EngineServiceAsyncStub, deployment: str
) -> AsyncIterator[engine_pb2.Instances]:
    """``EngineService.WatchInstances`` of ``deployment`` (applied before: an unknown one is
    NOT_FOUND)."""
    call = engines.WatchInstances(engine_pb2.GetInstancesRequest(deployment=deployment))
    async for msg in call:
        yield msg


def _ready(msg: engine_pb2.Instances) -> bool:
    live = [i for i in msg.instances if current(i)]
    return bool(live) and all(i.ready and i.url for i in live)


def _diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


@dataclass
class Story:
    """What the step needs across its parts."""

    spec: DeploymentSpec
    plans: plan_pb2_grpc.PlanServiceAsyncStub
    engines: engine_pb2_grpc.EngineServiceAsyncStub
    farm: EngineFarm
    latest: engine_pb2.Instances = field(default_factory=engine_pb2.Instances)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    on_start: Callable[[list[str]], None] = lambda names: None

    async def follow(self) -> None:
        """Keep :attr:`latest` and the engines in step with WatchInstances."""
        async for msg in watch(self.engines, self.spec.name):
            self.latest = msg
            started = await self.farm.sync(msg)
            if started:
                self.on_start(started)
            self.changed.set()

    async def until(
        self, ok: Callable[[engine_pb2.Instances], bool], limit_s: float, what: str
    ) -> float:
        t0 = last = time.monotonic()
        while not ok(self.latest):
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), 1.0)
            now = time.monotonic()
            if now - t0 > limit_s:
                raise TimeoutError(f"{what}: not within {limit_s:.0f} s")
            if now - last >= PROGRESS_S:
                live = [i for i in self.latest.instances if current(i)]
                ready = sum(1 for i in live if i.ready)
                say(f"  ... {what}: {ready} of {len(live)} instances ready ({now - t0:.0f} s)")
                last = now
        return time.monotonic() - t0


def fleet_plan_doc(spec: DeploymentSpec) -> dict[str, Any]:
    """The fleet plan of the demo's deployment on its fleet, as ``mixfleetctl schedule show
    --fleet FLEET -f DEPLOYMENT -o json`` writes it (the planner the controller runs, on the
    same inputs)."""
    from controlplane.cli.files import read_fleet
    from policies.fleetplan import FleetDeployment, PlanRequest, plan_fleet
    from policies.fleetplan.report import plan_doc
    from policies.fleetplan.types import PlannerSettings

    plan = plan_fleet(PlanRequest(read_fleet(FLEET_FILE), (FleetDeployment(spec),)))
    doc = plan_doc(plan, PlannerSettings().chunk_tokens)
    found: dict[str, Any] = next(d for d in doc["deployments"] if d["name"] == spec.name)
    return found


async def _agents(plans: plan_pb2_grpc.PlanServiceAsyncStub, expected: int) -> None:
    t0 = time.monotonic()
    while True:
        nodes = await plans.ListNodes(plan_pb2.ListNodesRequest(), timeout=10)
        if len(nodes.nodes) == expected:
            break
        if time.monotonic() - t0 > READY_LIMIT_S:
            raise TimeoutError(f"{len(nodes.nodes)} of {expected} agents registered")
        await asyncio.sleep(0.1)
    where = {n.inventory.address or n.inventory.node for n in nodes.nodes}
    models = sorted({n.inventory.gpus[0].catalog_model for n in nodes.nodes if n.inventory.gpus})
    say(
        f"agents       {expected} simulated agents registered ({', '.join(models)}; 2 GPUs "
        f"each), engines served at {', '.join(sorted(where))}"
    )


async def _load_for(client: Client, farm: EngineFarm, seconds: float, what: str) -> dict[str, int]:
    """Requests each instance served during ``seconds`` of the client's load."""
    before = farm.counts()
    sent = len(client.answers)
    t0 = last = time.monotonic()
    while (now := time.monotonic()) - t0 < seconds:
        if now - last >= PROGRESS_S:
            say(f"  ... {what}: {len(client.answers) - sent} requests sent ({now - t0:.0f} s)")
            last = now
        await asyncio.sleep(0.25)
    return _diff(farm.counts(), before)


def demand_status(ctl: RunningController, name: str) -> DemandStatus:
    """The controller's record of the deployment's demand (planned, measured, re-plans)."""
    stored = ctl.controller.store.get_deployment(name)
    return DemandStatus.from_status(stored.status if stored is not None else {})


# ------------------------------------------------------------------------- the phases


@dataclass
class _Stage:
    """What the step's phases share, and what :meth:`close` stops at the end."""

    spec: DeploymentSpec
    settings: ControllerSettings
    ctl: RunningController
    sim: SimulatedFleet
    channel: aio.Channel
    story: Story
    logs: Path
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    router: Router | None = None
    stop_client: asyncio.Event = field(default_factory=asyncio.Event)
    session: aiohttp.ClientSession = field(default_factory=aiohttp.ClientSession)

    async def close(self) -> None:
        """Stop the client and the watch, then the HTTP session, the router, the engines,
        the agents and the channel to the controller."""
        self.stop_client.set()
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.session.close()
        if self.router is not None:
            await self.router.stop()
        await self.story.farm.stop()
        await self.sim.stop()
        await self.channel.close(None)


def _announce(spec: DeploymentSpec) -> None:
    """The step's first lines: the deployment, its demand and SLO, the fleet."""
    assert spec.traffic is not None and spec.slo is not None
    slo = spec.slo
    rate = spec.traffic.requests_per_s
    say()
    say(
        f"instances    {spec.name}: {spec.model} on {spec.engine.name}, {rate:g} requests/s of "
        f"{spec.traffic.input_len.mean:.0f}-token prompts and "
        f"{spec.traffic.output_len.mean:.0f}-token answers, SLO TTFT {slo.ttft_ms:.0f} ms / "
        f"TPOT {slo.tpot_ms:.0f} ms at p{slo.percentile:.0f}, disaggregation "
        f"{spec.disaggregation} ({DEPLOYMENT_FILE.relative_to(REPO)})"
    )
    say(f"             on {FLEET_FILE.relative_to(REPO)}, with a controller of its own")


async def _roll_out(stage: _Stage) -> engine_pb2.Instances:
    """Apply the deployment and follow WatchInstances (each instance's engine starts as it
    is listed) until every instance is ready; returns that list."""
    story = stage.story
    t0 = time.monotonic()
    await story.plans.ApplyDeployment(
        plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(stage.spec)), timeout=30
    )
    stage.tasks.append(asyncio.create_task(story.follow(), name="watch-instances"))
    await story.until(_ready, READY_LIMIT_S, "planning and rolling out the instances")
    first = story.latest
    say(
        f"planned      {len(first.instances)} engine instances, each a deployment of "
        f"its own with its plan committed on its nodes, {time.monotonic() - t0:.1f} s "
        "after the apply (EngineService.WatchInstances):"
    )
    show_instances(first)
    say(
        "engines      one loopback engine per instance at its url, role and protocol "
        f"({first.engine}) from WatchInstances, a token every predicted TPOT: they "
        "stand in for the GPUs (no prefill work, no batching)"
    )
    return first


async def _simulate_and_route(stage: _Stage, first: engine_pb2.Instances) -> Latencies:
    """The serving simulator on the fleet plan (before the load: it would take the client's
    CPU), then the router, until it routes to every instance of ``first``; returns the
    simulator's latencies."""
    spec = stage.spec
    doc = await asyncio.to_thread(fleet_plan_doc, spec)
    sim_row = await asyncio.to_thread(simulated, doc, spec, first)
    router = stage.router = await start_router(stage.ctl.address, spec.name, stage.logs)
    waited = await routed(router, stage.session, first, READY_LIMIT_S)
    say(
        f"router       mixfleet-router --deployment {spec.name} (pid {router.proc.pid}) "
        f"on {router.url} routes to every instance after {waited:.1f} s (a "
        "prefill/decode pool as one pair)"
    )
    return sim_row


async def _planned_load(stage: _Stage, first: engine_pb2.Instances, sim_row: Latencies) -> Client:
    """The client at the planned demand for :data:`LOAD_S`; then the shares, the latencies
    (predicted, simulated, measured) and the demand the router measured. Returns the client,
    still sending."""
    spec = stage.spec
    assert spec.traffic is not None and spec.slo is not None and stage.router is not None
    rate = spec.traffic.requests_per_s
    client = Client(
        stage.router.url,
        round(spec.traffic.input_len.mean),
        round(spec.traffic.output_len.mean),
        rate,
    )
    stage.tasks.append(
        asyncio.create_task(client.run(stage.stop_client, random.Random(7)), name="client")
    )
    say()
    say(
        f"load         {rate:g} requests/s (Poisson arrivals) for {LOAD_S:.0f} s, "
        f"every {STREAM_EVERY}th streamed"
    )
    got = await _load_for(client, stage.story.farm, LOAD_S, "planned demand")
    answered = list(client.answers)
    show_shares(first, got, "shares       per instance, planned vs got:")
    show_latencies(
        [predicted(first), sim_row, measured(answered, spec.slo.ttft_ms, spec.slo.tpot_ms)], spec
    )
    show_measured(demand_status(stage.ctl, spec.name), spec)
    return client


async def _replan(stage: _Stage, client: Client) -> tuple[engine_pb2.Instances, list[str], int]:
    """The demand shift: the client's rate times :data:`SHIFT`, then the wait for the
    controller's re-plan (new instances, every live one ready) and for the router to route
    to them. Returns the new list, the new instances' names and how many requests the client
    had sent at the shift."""
    spec, story, demand = stage.spec, stage.story, stage.settings.demand
    assert spec.traffic is not None and stage.router is not None
    before = {i.name for i in story.latest.instances}
    client.rate_rps = spec.traffic.requests_per_s * SHIFT
    say()
    say(
        f"load         SHIFT: {client.rate_rps:g} requests/s ({SHIFT:g}x the planned "
        "demand); the controller re-plans once the router's measurements have left "
        f"[planned / {1 + demand.drift_threshold:g}, planned x "
        f"{1 + demand.drift_threshold:g}] for {demand.sustain_s:.0f} s"
    )
    t_shift, shift_unix_s = time.monotonic(), time.time()
    shifted_from = len(client.answers)

    def grown(msg: engine_pb2.Instances) -> bool:
        live = [i for i in msg.instances if current(i)]
        return _ready(msg) and any(i.name not in before for i in live)

    await story.until(grown, SHIFT_LIMIT_S, "re-planning for the new demand")
    after = story.latest
    new = [i.name for i in after.instances if i.name not in before]
    status = demand_status(stage.ctl, spec.name)
    drift_s = (status.last_replan_s or shift_unix_s) - shift_unix_s
    say(
        f"re-plan      {drift_s:.1f} s after the shift: "
        f"{status.last_replan_reason or 'the demand changed'}"
    )
    say(
        f"             new instances {', '.join(new)}, every live one committed "
        f"{time.monotonic() - t_shift:.1f} s after the shift; their engines started as "
        "WatchInstances listed them:"
    )
    show_instances(after)
    waited = await routed(stage.router, stage.session, after, READY_LIMIT_S)
    say(f"router       follows: routes to the new instances {waited:.1f} s later")
    return after, new, shifted_from


async def _shifted_load(
    stage: _Stage, client: Client, after: engine_pb2.Instances, new: list[str], shifted_from: int
) -> None:
    """:data:`TAIL_S` of the shifted load on the new instances; then the router's open
    requests, the shares, the latencies since the shift, the measured demand and how the
    client's requests ended.

    Raises:
        RuntimeError: an answer was cut.
    """
    spec = stage.spec
    assert spec.slo is not None and stage.router is not None
    got = await _load_for(client, stage.story.farm, TAIL_S, "shifted demand")
    await show_router(stage.router, stage.session, stage.story.farm)
    show_shares(stage.story.latest, got, "shares       per instance after the re-plan:", new)
    stage.stop_client.set()
    await stage.tasks[-1]  # the client's: it ends once its open requests have
    show_latencies(
        [
            predicted(after),
            measured(client.answers[shifted_from:], spec.slo.ttft_ms, spec.slo.tpot_ms),
        ],
        spec,
    )
    show_measured(demand_status(stage.ctl, spec.name), spec)
    say(verdict(client.answers))
    cut = [a for a in client.answers if a.status == 200 and not a.complete]
    if cut:
        raise RuntimeError(f"{len(cut)} answers were cut: {cut[0].error}")


async def run(workdir: Path, logs: Path, *, settings: ControllerSettings = SETTINGS) -> None:
    """The step (module docstring), against its own controller and agents."""
    spec = read_spec()
    assert spec.traffic is not None and spec.slo is not None
    fleet = load_fleet_file(FLEET_FILE)
    _announce(spec)
    async with start_controller(workdir / "instances-controller", settings=settings) as ctl:
        sim = SimulatedFleet(
            fleet,
            AgentSettings(
                controller=ctl.address,
                insecure=True,
                backoff=BackoffSettings(initial_s=0.2, max_s=2.0),
            ),
            plan_dir=workdir / "instances-agents",
            address=ADDRESS,
        )
        sim.start()
        channel = aio.insecure_channel(ctl.address)
        farm = EngineFarm(spec.engine.name, {n.name: len(n.gpus) for n in fleet.nodes})
        story = Story(
            spec,
            plan_pb2_grpc.PlanServiceStub(channel),
            engine_pb2_grpc.EngineServiceStub(channel),
            farm,
        )
        stage = _Stage(spec, settings, ctl, sim, channel, story, logs)
        try:
            await _agents(story.plans, len(fleet.nodes))
            first = await _roll_out(stage)
            sim_row = await _simulate_and_route(stage, first)
            client = await _planned_load(stage, first, sim_row)
            after, new, shifted_from = await _replan(stage, client)
            await _shifted_load(stage, client, after, new, shifted_from)
        finally:
            await stage.close()
