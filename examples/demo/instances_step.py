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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import yaml
from aiohttp import web
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
from demo.router_step import _engine_class, _free_port
from demo.session import PROGRESS_S, _table, say
from policies.serving.sim_types import SimOptions, SimReport, quantile_sorted
from policies.serving.simulate import simulate
from policies.spec import DeploymentSpec
from policies.spec_doc import parse_deployment

if TYPE_CHECKING:
    from support.openai_engine import LoopbackEngine

REPO = Path(__file__).resolve().parents[2]
FLEET_FILE = REPO / "examples" / "fleets" / "mixed-12.yaml"
DEPLOYMENT_FILE = REPO / "examples" / "deployments" / "qwen3-30b-a3b-demand.yaml"
ADDRESS = "127.0.0.1"  # where every simulated node says its engines serve
STREAM_EVERY = 4  # every 4th request is streamed (TTFT and TPOT are seen on streams)
LOAD_S = 16.0  # client load at the planned demand, s
SHIFT = 2.0  # the demand shift: the client's rate times this
SHIFT_LIMIT_S = 120.0  # longest wait for the re-plan after the shift, s
READY_LIMIT_S = 120.0  # longest wait for the first instances and the router, s
TAIL_S = 10.0  # load on the new instances after the re-plan, s
SIM_REQUESTS = 2000  # requests the serving simulator runs
RETIRE_LIMIT_S = 30.0  # longest wait for a removed instance's open requests, s
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


# ------------------------------------------------------------------------- engines


@dataclass
class Running:
    """One instance's loopback engine (and an SGLang prefill's bootstrap server)."""

    instance: engine_pb2.Instance
    engine: LoopbackEngine
    bootstrap: web.AppRunner | None = None

    def requests(self) -> int:
        """Requests this instance has served (a prefill side: the prefills it ran)."""
        if self.instance.role == "prefill":
            return len(self.engine.pd_seen)
        return sum(1 for r in self.engine.records if r.done)


async def _bootstrap_server(port: int, prefill_url: str) -> web.AppRunner:
    """A prefill instance's bootstrap server on ``port`` (SGLang runs one beside each prefill
    server, at ``--disaggregation-bootstrap-port``): a decode side's KV lookup
    (``GET /loopback/kv/{key}``) is handed to the prefill engine."""
    session = aiohttp.ClientSession()

    async def kv(request: web.Request) -> web.Response:
        async with session.get(f"{prefill_url}/loopback/kv/{request.match_info['key']}") as r:
            return web.Response(status=r.status, text=await r.text())

    async def close(_: web.Application) -> None:
        await session.close()

    app = web.Application()
    app.router.add_get("/loopback/kv/{key}", kv)
    app.on_cleanup.append(close)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, ADDRESS, port).start()
    return runner


@dataclass
class EngineFarm:
    """The loopback engines of the deployment's instances, started as WatchInstances lists
    them. An engine whose instance is no longer listed (or is listed again at another url
    or role: names and ports are reused) is retired: stopped once its open requests have
    finished, within :data:`RETIRE_LIMIT_S`.

    Attributes:
        protocol: the engines' protocol (``Instances.engine``).
        gpus: GPUs per node (an engine gets one DP rank per GPU of its nodes).
        running: by instance name.
    """

    protocol: str
    gpus: dict[str, int]
    running: dict[str, Running] = field(default_factory=dict)
    _retiring: dict[int, asyncio.Task[None]] = field(default_factory=dict)

    async def sync(self, msg: engine_pb2.Instances) -> list[str]:
        """Retire the engines of instances gone or moved; start one for every listed
        instance that has none. Returns the names started."""
        self.protocol = msg.engine or self.protocol
        listed = {i.name: i for i in msg.instances}
        for name, run in list(self.running.items()):
            now = listed.get(name)
            if now is None or now.url != run.instance.url or now.role != run.instance.role:
                del self.running[name]
                self._retiring[run.engine.port] = asyncio.create_task(self._retire(run))
        started = []
        for inst in msg.instances:
            if inst.name in self.running or not inst.url:
                continue
            port = urlsplit(inst.url).port or 80
            for busy in (port, inst.bootstrap_port):
                if busy in self._retiring:
                    await self._retiring.pop(busy)
            self.running[inst.name] = await self._start(inst)
            started.append(inst.name)
        for inst in msg.instances:  # the newest record of each (draining, share)
            if inst.name in self.running:
                self.running[inst.name].instance = inst
        return started

    async def _start(self, inst: engine_pb2.Instance) -> Running:
        ranks = max(1, sum(self.gpus.get(n, 1) for n in inst.nodes))
        tpot_ms = inst.tpot_ms if inst.tpot_ms > 0 else 20.0
        try:
            engine = await _engine_class()(
                engine=self.protocol,
                role=inst.role,
                port=urlsplit(inst.url).port or 80,
                tokens_per_s=[1000.0 / tpot_ms] * ranks,
                model=inst.name,
            ).start()
            run = Running(inst, engine)
            if inst.role == "prefill" and self.protocol == "sglang" and inst.bootstrap_port:
                run.bootstrap = await _bootstrap_server(inst.bootstrap_port, engine.url)
        except OSError as exc:
            raise RuntimeError(
                f"cannot serve instance {inst.name} at {inst.url} (bootstrap port "
                f"{inst.bootstrap_port}): {exc}; is another run using the port?"
            ) from exc
        return run

    async def _retire(self, run: Running) -> None:
        t0 = time.monotonic()
        while any(not r.done for r in run.engine.records):
            if time.monotonic() - t0 > RETIRE_LIMIT_S:
                break
            await asyncio.sleep(0.1)
        await run.engine.stop()
        if run.bootstrap is not None:
            await run.bootstrap.cleanup()

    def counts(self) -> dict[str, int]:
        """Requests each running engine has served, by instance name."""
        return {name: r.requests() for name, r in self.running.items()}

    async def stop(self) -> None:
        """Stop every engine (those being retired once their open requests end)."""
        for task in self._retiring.values():
            await task
        for r in self.running.values():
            await r.engine.stop()
            if r.bootstrap is not None:
                await r.bootstrap.cleanup()


# ------------------------------------------------------------------------- client


@dataclass
class Answer:
    """One client request: when it was sent (monotonic s), its status (0: the connection
    failed), and for a streamed one its TTFT and TPOT, s (nan when not seen)."""

    sent_s: float
    status: int
    stream: bool
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    complete: bool = False
    error: str = ""


@dataclass
class Client:
    """The demo's users: Poisson arrivals of equal-sized completions through the router.

    Attributes:
        url: the router. prompt_tokens, output_tokens: every request's size, tokens.
        rate_rps: the arrival rate now, requests/s (changed while it runs).
        answers: every request so far.
    """

    url: str
    prompt_tokens: int
    output_tokens: int
    rate_rps: float
    answers: list[Answer] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _body: dict[bool, bytes] = field(default_factory=dict)

    def body(self, stream: bool) -> bytes:
        """The request body: the prompt as token ids (the router counts them exactly)."""
        if stream not in self._body:
            doc = {
                "model": "qwen3",
                "prompt": [1] * self.prompt_tokens,
                "max_tokens": self.output_tokens,
                "stream": stream,
            }
            self._body[stream] = json.dumps(doc, separators=(",", ":")).encode()
        return self._body[stream]

    async def send(self, session: aiohttp.ClientSession, stream: bool) -> None:
        """One request; its :class:`Answer` is appended to :attr:`answers`."""
        ans = Answer(time.monotonic(), 0, stream)
        self.answers.append(ans)
        headers = {"Content-Type": "application/json"}
        try:
            async with session.post(
                f"{self.url}/v1/completions", data=self.body(stream), headers=headers
            ) as r:
                ans.status = r.status
                if r.status != 200:
                    ans.error = (await r.read())[:200].decode(errors="replace")
                    return
                if not stream:
                    await r.read()
                    ans.complete = r.status == 200
                    return
                first = last = 0.0
                tokens = 0
                async for line in r.content:
                    if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                        ans.complete = ans.complete or line.startswith(b"data: [DONE]")
                        continue
                    last = time.monotonic()
                    first = first or last
                    tokens += 1
                if first:
                    ans.ttft_s = first - ans.sent_s
                if tokens > 1:
                    ans.tpot_s = (last - first) / (tokens - 1)
        except (aiohttp.ClientError, OSError) as exc:
            ans.complete = False
            ans.error = f"{type(exc).__name__}: {exc}"

    async def run(self, stop: asyncio.Event, rng: random.Random) -> None:
        """Send until ``stop``, then wait for every open request. Arrivals keep their
        schedule (each gap drawn at the rate in force) even when the loop falls behind: a
        late request goes out at once, so the rate holds on a busy machine."""
        timeout = aiohttp.ClientTimeout(total=120)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            i = 0
            due = time.monotonic()
            while not stop.is_set():
                task = asyncio.create_task(self.send(session, i % STREAM_EVERY == 0))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                i += 1
                due += rng.expovariate(self.rate_rps)
                wait_s = due - time.monotonic()
                if wait_s > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait_s)
            if self._tasks:
                await asyncio.gather(*self._tasks)


# ------------------------------------------------------------------------- the router


@dataclass
class Router:
    """The ``mixfleet-router`` process: its process, URL and log file."""

    proc: asyncio.subprocess.Process
    url: str
    log_path: Path

    def tail(self) -> str:
        """The last lines of its log, for an error message."""
        lines = (
            self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        )
        return "; ".join(lines[-3:]) or "no log lines"

    async def status(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        """Its ``GET /router/status`` document."""
        async with session.get(f"{self.url}/router/status") as r:
            doc: dict[str, Any] = await r.json()
            return doc

    async def stop(self) -> None:
        """Terminate it (killed after 10 s)."""
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def start_router(controller: str, deployment: str, log_dir: Path) -> Router:
    """``mixfleet-router --deployment NAME`` as its own process on a free port."""
    port = _free_port()
    log_path = log_dir / "router-instances.log"
    cmd = [
        sys.executable, "-m", "controlplane.cli", "router", "run",
        "--listen", f"{ADDRESS}:{port}",
        "--controller", controller,
        "--deployment", deployment,
        "--traffic-report-s", "1",
        "--health-interval-s", "0.2",
        "--log-level", "warning",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=REPO, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log
        )
    return Router(proc, f"http://{ADDRESS}:{port}", log_path)


def router_names(msg: engine_pb2.Instances) -> set[str]:
    """The router's instances for ``msg``: each live aggregated instance by its name, each
    prefill/decode pool as one pair named ``<deployment>/<pool>``."""
    names = set()
    for i in msg.instances:
        if i.draining:
            continue
        names.add(i.name if i.role == "aggregated" else f"{msg.deployment}/{i.pool}")
    return names


async def routed(
    router: Router, session: aiohttp.ClientSession, msg: engine_pb2.Instances, limit_s: float
) -> float:
    """Wait until the router routes to every live instance of ``msg`` (a prefill/decode
    pool: to its pair), each healthy; returns the seconds waited."""
    want = router_names(msg)
    t0 = last = time.monotonic()
    while True:
        if router.proc.returncode is not None:
            raise RuntimeError(f"the router exited ({router.tail()})")
        with contextlib.suppress(aiohttp.ClientError, ValueError, KeyError):
            doc = await router.status(session)
            ok = {
                i["name"] for i in doc["instances"] if i.get("healthy") and i.get("routable", True)
            }
            if want <= ok:
                return time.monotonic() - t0
        now = time.monotonic()
        if now - t0 > limit_s:
            raise TimeoutError(f"the router does not route to {sorted(want)} ({router.tail()})")
        if now - last >= PROGRESS_S:
            say(f"  ... waiting for the router to route to every instance ({now - t0:.0f} s)")
            last = now
        await asyncio.sleep(0.2)


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
    live = [i for i in msg.instances if not i.draining]
    return bool(live) and all(i.ready and i.url for i in live)


@dataclass
class Latencies:
    """TTFT and TPOT p90 (ms) and the SLO attainment (share of requests within both
    targets) of one source."""

    source: str
    ttft_p90_ms: float
    tpot_p90_ms: float
    attainment: float
    note: str = ""


def measured(answers: Sequence[Answer], ttft_ms: float, tpot_ms: float) -> Latencies:
    """The client's view of its streamed requests."""
    seen = [a for a in answers if a.stream and a.status == 200 and not math.isnan(a.ttft_s)]
    if not seen:
        return Latencies("measured (client)", math.nan, math.nan, math.nan, "no stream")
    ttft = sorted(a.ttft_s * 1000 for a in seen)
    tpot = sorted(a.tpot_s * 1000 for a in seen if not math.isnan(a.tpot_s))
    ok = sum(
        1
        for a in seen
        if a.ttft_s * 1000 <= ttft_ms and (math.isnan(a.tpot_s) or a.tpot_s * 1000 <= tpot_ms)
    )
    return Latencies(
        "measured (client)",
        quantile_sorted(ttft, 0.9),
        quantile_sorted(tpot, 0.9) if tpot else math.nan,
        ok / len(seen),
        f"{len(seen)} streamed requests",
    )


def simulated(doc: Any, spec: DeploymentSpec, msg: engine_pb2.Instances) -> Latencies:
    """The serving simulator on the deployment's fleet plan document ``doc``; the note says
    whether that plan has the instances (role and nodes) the controller lists in ``msg``."""
    from policies.launch import planned_instances
    from policies.serving.plan import plan_from_doc

    offline = planned_instances({"kind": "FleetPlan", "deployments": [doc]}, spec.name)
    same = sorted((i.role, tuple(i.nodes)) for i in offline) == sorted(
        (i.role, tuple(i.nodes)) for i in msg.instances if not i.draining
    )

    assert spec.traffic is not None
    plan = plan_from_doc(doc["servingPlan"], "servingPlan")
    report: SimReport = simulate(plan, spec.traffic, spec.slo, SimOptions(SIM_REQUESTS, seed=1))
    return Latencies(
        "simulated",
        report.ttft_ms.p90,
        report.tpot_ms.p90,
        report.attainment,
        f"{SIM_REQUESTS} requests, serving simulator"
        + ("" if same else "; NOTE: its plan is not the controller's"),
    )


def _ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def show_latencies(rows: Sequence[Latencies], spec: DeploymentSpec) -> None:
    """The SLO and one line per source: TTFT and TPOT p90 (ms), share within the SLO."""
    slo = spec.slo
    assert slo is not None
    say()
    say(
        f"latency      SLO: TTFT <= {slo.ttft_ms:.0f} ms, TPOT <= {slo.tpot_ms:.0f} ms for "
        f"{slo.percentile:.0f}% of requests"
    )
    table = [["source", "TTFT p90 ms", "TPOT p90 ms", "within SLO", "from"]]
    for r in rows:
        att = "-" if math.isnan(r.attainment) else f"{r.attainment:.1%}"
        table.append([r.source, _ms(r.ttft_p90_ms), _ms(r.tpot_p90_ms), att, r.note])
    _table(table)


def show_shares(
    msg: engine_pb2.Instances, got: dict[str, int], title: str, new: Sequence[str] = ()
) -> None:
    """Per instance: role, nodes, planned requests/s and share, the requests it got. An
    aggregated or decode instance's share is of the requests (a prefill/decode pair's
    requests are its decode instances'), a prefill instance's of the prefills."""
    live = [i for i in msg.instances if not i.draining or got.get(i.name)]

    def side(i: engine_pb2.Instance) -> str:
        return "prefill" if i.role == "prefill" else "serve"

    planned_total: dict[str, float] = {}
    got_total: dict[str, int] = {}
    for i in live:
        if not i.draining:
            planned_total[side(i)] = planned_total.get(side(i), 0.0) + i.requests_per_s
        got_total[side(i)] = got_total.get(side(i), 0) + got.get(i.name, 0)
    say(title)
    rows = [["instance", "role", "nodes", "planned req/s", "planned share", "got", "share"]]
    for i in live:
        planned = i.requests_per_s / planned_total[side(i)] if planned_total.get(side(i)) else 0
        n = got.get(i.name, 0)
        mark = " (new)" if i.name in new else " (draining)" if i.draining else ""
        rows.append(
            [
                i.name + mark,
                i.role,
                ",".join(i.nodes),
                f"{i.requests_per_s:.2f}",
                f"{planned:.3f}",
                str(n),
                f"{n / got_total[side(i)] if got_total[side(i)] else 0:.3f}",
            ]
        )
    _table(rows)


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
                live = [i for i in self.latest.instances if not i.draining]
                ready = sum(1 for i in live if i.ready)
                say(f"  ... {what}: {ready} of {len(live)} instances ready ({now - t0:.0f} s)")
                last = now
        return time.monotonic() - t0


def predicted(msg: engine_pb2.Instances) -> Latencies:
    """The planner's prediction: the slowest live pool's TTFT (at the SLO percentile) and
    TPOT; each pool is sized to meet the SLO, so no attainment figure of its own."""
    live = [i for i in msg.instances if not i.draining]
    return Latencies(
        "predicted (planner)",
        max((i.ttft_ms for i in live), default=math.nan),
        max((i.tpot_ms for i in live), default=math.nan),
        math.nan,
        "slowest pool; every pool sized to meet the SLO",
    )


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


def _instance_rows(msg: engine_pb2.Instances) -> None:
    rows = [["instance", "role", "pool", "nodes", "url", "batch", "TTFT ms", "TPOT ms", "req/s"]]
    for i in msg.instances:
        if i.draining:
            continue
        rows.append(
            [
                i.name,
                i.role,
                i.pool,
                ",".join(i.nodes),
                i.url,
                str(i.batch_limit),
                _ms(i.ttft_ms),
                _ms(i.tpot_ms),
                f"{i.requests_per_s:.2f}",
            ]
        )
    _table(rows)


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


async def show_router(router: Router, session: aiohttp.ClientSession, farm: EngineFarm) -> None:
    """The router's open requests and batch limit per instance beside the requests its
    engine has open (they differ only by requests on their way)."""
    doc = await router.status(session)
    engine_open = {
        name: sum(1 for r in run.engine.records if not r.done) for name, run in farm.running.items()
    }
    rows = [["router instance", "open", "batch limit", "engine open"]]
    for i in doc.get("instances", []):
        rows.append(
            [
                str(i.get("name")),
                str(i.get("open_requests")),
                str(i.get("batch_limit")),
                str(engine_open.get(str(i.get("deployment")), "-")),
            ]
        )
    _table(rows)


def verdict(answers: Sequence[Answer]) -> str:
    """How the client's requests ended: answered, cut (an answer begun, then broken off)
    and refused (no answer begun: the router's 429/503, or no connection), with the most
    frequent refusal."""
    cut = sum(1 for a in answers if a.status == 200 and not a.complete)
    refused = [a for a in answers if a.status != 200]
    text = (
        f"streams      {len(answers)} requests in all ({sum(a.stream for a in answers)} "
        f"streamed): {len(answers) - cut - len(refused)} answered, {cut} cut, "
        f"{len(refused)} refused"
    )
    if refused:
        kinds: dict[str, int] = {}
        for a in refused:
            key = f"{a.status} {a.error[:110]}".strip()
            kinds[key] = kinds.get(key, 0) + 1
        key, n = max(kinds.items(), key=lambda kn: kn[1])
        text += f" ({n}x {key})"
    return text


def demand_status(ctl: RunningController, name: str) -> DemandStatus:
    """The controller's record of the deployment's demand (planned, measured, re-plans)."""
    stored = ctl.controller.store.get_deployment(name)
    return DemandStatus.from_status(stored.status if stored is not None else {})


def show_measured(status: DemandStatus, spec: DeploymentSpec) -> None:
    """What the router measured, as the controller keeps it (ReportTraffic, summed), and
    the demand the deployment is planned for now."""
    m = status.measured
    planning = status.planning_traffic(spec)
    planned_rps = planning.requests_per_s if planning is not None else math.nan
    if m is None:
        say("controller   no traffic report from the router yet")
        return
    say(
        f"controller   measured by the router (ReportTraffic): {m.requests_per_s:.1f} "
        f"requests/s over the last {m.end_s - m.start_s:.0f} s (planned {planned_rps:.3g}), "
        f"prompts {m.input_tokens_mean:.0f} and answers {m.output_tokens_mean:.0f} tokens, "
        f"TTFT p50/p99 {m.ttft_ms_p50:.0f}/{m.ttft_ms_p99:.0f} ms, TPOT p50/p99 "
        f"{m.tpot_ms_p50:.1f}/{m.tpot_ms_p99:.1f} ms"
    )


async def run(workdir: Path, logs: Path, *, settings: ControllerSettings = SETTINGS) -> None:
    """The step (module docstring), against its own controller and agents."""
    spec = read_spec()
    assert spec.traffic is not None and spec.slo is not None
    slo = spec.slo
    fleet = load_fleet_file(FLEET_FILE)
    gpus = {n.name: len(n.gpus) for n in fleet.nodes}
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
        farm = EngineFarm(spec.engine.name, gpus)
        story = Story(
            spec,
            plan_pb2_grpc.PlanServiceStub(channel),
            engine_pb2_grpc.EngineServiceStub(channel),
            farm,
        )
        tasks: list[asyncio.Task[Any]] = []
        router: Router | None = None
        stop_client = asyncio.Event()
        session = aiohttp.ClientSession()
        try:
            await _agents(story.plans, len(fleet.nodes))
            t0 = time.monotonic()
            await story.plans.ApplyDeployment(
                plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(spec)), timeout=30
            )
            tasks.append(asyncio.create_task(story.follow(), name="watch-instances"))
            await story.until(_ready, READY_LIMIT_S, "planning and rolling out the instances")
            first = story.latest
            say(
                f"planned      {len(first.instances)} engine instances, each a deployment of "
                f"its own with its plan committed on its nodes, {time.monotonic() - t0:.1f} s "
                "after the apply (EngineService.WatchInstances):"
            )
            _instance_rows(first)
            say(
                "engines      one loopback engine per instance at its url, role and protocol "
                f"({first.engine}) from WatchInstances, a token every predicted TPOT: they "
                "stand in for the GPUs (no prefill work, no batching)"
            )
            # the serving simulator before the load (it would take the client's CPU)
            doc = await asyncio.to_thread(fleet_plan_doc, spec)
            sim_row = await asyncio.to_thread(simulated, doc, spec, first)
            router = await start_router(ctl.address, spec.name, logs)
            waited = await routed(router, session, first, READY_LIMIT_S)
            say(
                f"router       mixfleet-router --deployment {spec.name} (pid {router.proc.pid}) "
                f"on {router.url} routes to every instance after {waited:.1f} s (a "
                "prefill/decode pool as one pair)"
            )
            client = Client(
                router.url,
                round(spec.traffic.input_len.mean),
                round(spec.traffic.output_len.mean),
                rate,
            )
            tasks.append(
                asyncio.create_task(client.run(stop_client, random.Random(7)), name="client")
            )
            say()
            say(
                f"load         {rate:g} requests/s (Poisson arrivals) for {LOAD_S:.0f} s, "
                f"every {STREAM_EVERY}th streamed"
            )
            got = await _load_for(client, farm, LOAD_S, "planned demand")
            answered = list(client.answers)
            show_shares(first, got, "shares       per instance, planned vs got:")
            show_latencies(
                [predicted(first), sim_row, measured(answered, slo.ttft_ms, slo.tpot_ms)], spec
            )
            show_measured(demand_status(ctl, spec.name), spec)

            # the demand shift
            before = {i.name for i in story.latest.instances}
            client.rate_rps = rate * SHIFT
            say()
            say(
                f"load         SHIFT: {client.rate_rps:g} requests/s ({SHIFT:g}x the planned "
                "demand); the controller re-plans once the router's measurements have left "
                f"[planned / {1 + settings.demand.drift_threshold:g}, planned x "
                f"{1 + settings.demand.drift_threshold:g}] for {settings.demand.sustain_s:.0f} s"
            )
            t_shift, shift_unix_s = time.monotonic(), time.time()
            shifted_from = len(client.answers)

            def grown(msg: engine_pb2.Instances) -> bool:
                live = [i for i in msg.instances if not i.draining]
                return _ready(msg) and any(i.name not in before for i in live)

            await story.until(grown, SHIFT_LIMIT_S, "re-planning for the new demand")
            after = story.latest
            new = [i.name for i in after.instances if i.name not in before]
            status = demand_status(ctl, spec.name)
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
            _instance_rows(after)
            waited = await routed(router, session, after, READY_LIMIT_S)
            say(f"router       follows: routes to the new instances {waited:.1f} s later")
            got = await _load_for(client, farm, TAIL_S, "shifted demand")
            await show_router(router, session, farm)
            show_shares(story.latest, got, "shares       per instance after the re-plan:", new)
            stop_client.set()
            await tasks[-1]
            show_latencies(
                [
                    predicted(after),
                    measured(client.answers[shifted_from:], slo.ttft_ms, slo.tpot_ms),
                ],
                spec,
            )
            show_measured(demand_status(ctl, spec.name), spec)
            say(verdict(client.answers))
            cut = [a for a in client.answers if a.status == 200 and not a.complete]
            if cut:
                raise RuntimeError(f"{len(cut)} answers were cut: {cut[0].error}")
        finally:
            stop_client.set()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await session.close()
            if router is not None:
                await router.stop()
            await farm.stop()
            await sim.stop()
            await channel.close(None)
