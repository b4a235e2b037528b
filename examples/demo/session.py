"""The end-to-end demo's parts (:mod:`demo.e2e` runs them in order).

The settings and deployment of the demo, the simulated engine (:func:`engine`: load
windows, uniform then shifted), the gRPC clients (:class:`Demo`) and one function per step:
:func:`show_agents`, :func:`deploy`, :func:`show_contingencies`, :func:`shift_load`,
:func:`show_replan`, :func:`show_history`. Each step prints its lines and returns what the
next needs; a step that waits longer than a few seconds prints a progress line every
:data:`PROGRESS_S` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc import aio
from mixfleet.v1 import engine_pb2, engine_pb2_grpc, plan_pb2, plan_pb2_grpc

from agents.applier import parse_env
from apis.wire.deployment import spec_from_proto
from controlplane.server.controller import ControllerSettings
from controlplane.server.inprocess import RunningController
from policies.assignment import diff_plans
from policies.model.architecture import preset
from policies.plan import Plan, plan_from_dict
from policies.solve import rescore
from policies.spec.build import build_request

T = TypeVar("T")

FLEET_FILE = Path(__file__).resolve().parents[2] / "examples" / "fleets" / "mixed-24.yaml"
DEPLOYMENT = "deepseek-v3"
MODEL = "deepseek-v3"
#: Demo timing: 1 s heartbeats, quick ticks.
SETTINGS = ControllerSettings(
    heartbeat_interval_s=1.0,
    node_lost_after_s=5.0,
    tick_s=0.2,
    retry_after_abort_s=2.0,
    retry_after_error_s=2.0,
)
WINDOW_S = 0.5  # one load window every half second
UNIFORM_S = 2.0  # load before the shift, s
HOT_EXPERTS = 8  # per MoE layer, after the shift
HOT_FACTOR = 6.0  # their load relative to the others
SUSTAIN_S = 5.0  # the imbalance must persist this long before the controller re-plans, s
MIN_GPUS = 24  # the deployment keeps every GPU of mixed-24 (see _spec)
PROGRESS_S = 5.0  # a waiting step prints a progress line this often, s
SAME_WEIGHT = 0.01  # DP weights within this fraction of v1's count as unchanged


def say(text: str = "") -> None:
    print(text, flush=True)


async def with_progress(
    work: Awaitable[T], line: Callable[[float], str], every_s: float = PROGRESS_S
) -> T:
    """Await ``work``, printing ``line(seconds so far)`` every ``every_s`` until it is done."""
    task = asyncio.ensure_future(work)
    t0 = time.monotonic()
    while True:
        done, _ = await asyncio.wait({task}, timeout=every_s)
        if done:
            return task.result()
        say(line(time.monotonic() - t0))


#: What each status of a layer's solve means (``HiGHS (optimal x44, mapped x14)``).
_LAYER_WORDS = {
    "optimal": "solved to optimality",
    "work_limit": "stopped at their work limit (good, not proven optimal)",
    "mapped": "took the first layer's answer, mapped by load rank (work limit)",
    "previous": "kept the previous plan's placement (no move paid for itself)",
    "wall_clock": "stopped by the clock (the machine is busy: the answer depends on it)",
    "skipped": "not solved before the deadline, greedy placement kept (the machine is busy)",
}


def solver_words(plan: Plan) -> str:
    """The plan's solver summary in words: what became of each MoE layer's solve, and which
    safety net won if one did (``HiGHS (mapped x14, optimal x44)`` -> "of 58 MoE layers, 44
    solved to optimality, 14 took the first layer's answer...")."""
    text = plan.summary.solver
    if text.startswith("previous plan kept"):
        return "no re-placement paid for its moves: the previous placement stands"
    counts = [(k, int(n)) for k, n in re.findall(r"(\w+) x(\d+)", text)]
    parts = [f"{n} {_LAYER_WORDS.get(k, k)}" for k, n in sorted(counts, key=lambda kn: -kn[1])]
    words = f"of {sum(n for _, n in counts)} MoE layers, " + ", ".join(parts) if parts else text
    for tail, why in (
        ("EPLB plan kept", "; the EPLB plan realised better and was kept"),
        ("greedy plan kept", "; the greedy plan realised better and was kept"),
    ):
        if tail in text:
            words += why
    return words


def _spec(time_limit_s: float) -> plan_pb2.DeploymentSpec:
    return plan_pb2.DeploymentSpec(
        name=DEPLOYMENT,
        model=MODEL,
        workload=plan_pb2.WorkloadSpec(phase="prefill", tokens_per_gpu=4096, context_len=4096),
        policy="ilp",
        form="engine",
        # The whole mixed fleet: the fleet scheduler alone would give this prefill deployment
        # only h200-0 (more tokens/s than with the A100 and H100 nodes, whose all-to-all
        # crosses the RDMA fabric); the demo is about planning across GPU generations.
        min_gpus=MIN_GPUS,
        solver_time_limit_s=time_limit_s,
        prepare_timeout_s=30.0,
        rebalance=plan_pb2.RebalanceSpec(
            enabled=True,
            imbalance_threshold=0.2,
            sustain_s=SUSTAIN_S,
            min_interval_s=60.0,
            # ~0.002 % of a 3 s prefill step per moved replica: re-balance, but do not
            # reshuffle experts that are fine where they are.
            migration_weight_us=50.0,
        ),
    )


def _load(shifted: bool, rng: random.Random) -> list[list[float]]:
    """Expert token counts of one window, ``[moe_layers][experts]``: uniform up to +-5 %
    sampling noise before the shift; after it, ``HOT_EXPERTS`` experts per layer (fixed per
    layer) get ``HOT_FACTOR`` times the tokens."""
    model = preset(MODEL)
    hot = random.Random(5)
    rows = []
    for _ in range(model.num_moe_layers):
        hot_set = set(hot.sample(range(model.num_experts), HOT_EXPERTS))
        rows.append(
            [
                1000.0 * (HOT_FACTOR if shifted and e in hot_set else 1.0) * rng.uniform(0.95, 1.05)
                for e in range(model.num_experts)
            ]
        )
    return rows


class Demo:
    """PlanService and EngineService clients of the demo, on one channel."""

    def __init__(self, channel: aio.Channel) -> None:
        self.plans = plan_pb2_grpc.PlanServiceStub(channel)
        self.engines = engine_pb2_grpc.EngineServiceStub(channel)
        self.sent: list[list[list[float]]] = []  # the engine's load windows, in order

    async def deployment(self) -> plan_pb2.Deployment:
        reply: plan_pb2.Deployment = await self.plans.GetDeployment(
            plan_pb2.GetDeploymentRequest(name=DEPLOYMENT), timeout=10
        )
        return reply

    async def wait_version(self, version: int, timeout_s: float) -> plan_pb2.Deployment:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            d = await self.deployment()
            if d.status.committed_version >= version:
                return d
            await asyncio.sleep(0.2)
        raise TimeoutError(f"no committed version {version} within {timeout_s:.0f} s")

    async def plan_doc(self, version: int) -> tuple[plan_pb2.PlanRecord, Any]:
        rec: plan_pb2.PlanRecord = await self.plans.GetPlan(
            plan_pb2.GetPlanRequest(deployment=DEPLOYMENT, version=version), timeout=30
        )
        return rec, plan_from_dict(json.loads(rec.plan_json))


async def engine(
    demo: Demo, stop: asyncio.Event, shift_at: asyncio.Event, rng: random.Random
) -> int:
    """A simulated engine: streams one load window every WINDOW_S until stopped (each one
    also kept in ``demo.sent``)."""
    sent = 0

    async def windows() -> AsyncIterator[engine_pb2.ExpertLoadWindow]:
        nonlocal sent
        model = preset(MODEL)
        while not stop.is_set():
            end = time.time()
            counts = _load(shift_at.is_set(), rng)
            demo.sent.append(counts)
            yield engine_pb2.ExpertLoadWindow(
                deployment=DEPLOYMENT,
                engine_id="sim-engine-0",
                start_unix_s=end - WINDOW_S,
                end_unix_s=end,
                num_layers=model.num_moe_layers,
                num_experts=model.num_experts,
                counts=[x for row in counts for x in row],
                plan_version=0,
            )
            sent += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), WINDOW_S)

    reply = await demo.engines.ReportExpertLoad(windows(), timeout=600)
    return int(reply.windows_accepted)


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        say(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _acks(rec: plan_pb2.PlanRecord) -> str:
    counts: dict[str, int] = {}
    for v in rec.acks.values():
        counts[v.split(":")[0]] = counts.get(v.split(":")[0], 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"


def _shares(plan: Any) -> str:
    by_node: dict[str, float] = {}
    for g in plan.gpus:
        by_node[g.node] = by_node.get(g.node, 0.0) + g.attention_share
    return ", ".join(f"{n} {s:.2f}" for n, s in by_node.items())


async def show_agents(demo: Demo, expected: int) -> None:
    """Wait for ``expected`` agents to register; print their inventories."""
    nodes: plan_pb2.ListNodesResponse = plan_pb2.ListNodesResponse()
    for _ in range(100):
        nodes = await demo.plans.ListNodes(plan_pb2.ListNodesRequest(), timeout=10)
        if len(nodes.nodes) == expected:
            break
        await asyncio.sleep(0.1)
    say(f"agents       {len(nodes.nodes)} simulated agents registered:")
    rows = [["node", "GPUs", "model", "NVLink GB/s", "RDMA", "simulated"]]
    for n in nodes.nodes:
        inv = n.inventory
        links = sum(1 for x in inv.gpus[0].nvlinks if x.active) if inv.gpus else 0
        rows.append(
            [
                inv.node,
                str(len(inv.gpus)),
                inv.gpus[0].catalog_model if inv.gpus else "-",
                str(links * 50),
                f"{len(inv.nics)}x{inv.nics[0].rate_per_direction_gbits_per_s:.0f} Gb/s"
                if inv.nics
                else "-",
                str(inv.simulated).lower(),
            ]
        )
    _table(rows)


def _phase(d: plan_pb2.Deployment) -> str:
    """The deployment's phase as a user writes it (``rolling out``)."""
    name = plan_pb2.DeploymentPhase.Name(d.status.phase).removeprefix("DEPLOYMENT_PHASE_")
    return name.lower().replace("_", " ")


async def follow(
    demo: Demo,
    version: int,
    limit_s: float,
    detail: Callable[[plan_pb2.Deployment], str] = lambda d: "",
    on_status: Callable[[plan_pb2.Deployment], None] = lambda d: None,
) -> plan_pb2.Deployment:
    """Follow the deployment until it commits ``version``: a line for each new phase or
    message, a progress line every :data:`PROGRESS_S` meanwhile (``detail`` adds to both;
    ``on_status`` sees every status read)."""
    t0 = last = time.monotonic()
    seen = ""
    while True:
        d = await demo.deployment()
        if d.status.committed_version >= version:
            return d
        on_status(d)
        message = d.status.message.splitlines()[0] if d.status.message else ""
        line = _phase(d) + (f": {message}" if message else "")
        now = time.monotonic()
        if line != seen or now - last >= PROGRESS_S:
            text = line if line != seen else f"... still {_phase(d)}"
            say(f"controller   t+{now - t0:4.1f} s {detail(d)}{text}")
            seen, last = line, now
        if now - t0 > limit_s:
            raise TimeoutError(f"no committed version {version} within {limit_s:.0f} s")
        await asyncio.sleep(0.25)


async def deploy(demo: Demo, workdir: Path, time_limit_s: float) -> Any:
    """Apply the deployment, follow it to v1, print it and an agent's plan file; returns v1."""
    say()
    say(
        f"deploy       {MODEL}, prefill 4096 tokens/GPU, policy ilp "
        f"(time limit {time_limit_s:.0f} s), rebalance on, minGpus {MIN_GPUS}"
    )
    say(
        "             (without minGpus the fleet scheduler picks h200-0 alone for prefill: "
        "mixfleetctl schedule explain says why)"
    )
    t0 = time.monotonic()
    await demo.plans.ApplyDeployment(
        plan_pb2.ApplyDeploymentRequest(spec=_spec(time_limit_s)), timeout=10
    )
    await follow(demo, 1, limit_s=time_limit_s * 4 + 60)
    rec1, plan1 = await demo.plan_doc(1)
    say(
        f"committed    v1 {rec1.plan_id} {time.monotonic() - t0:.1f} s after the apply; "
        f"predicted step {plan1.summary.step_time_us / 1000:.0f} ms; acks {_acks(rec1)}"
    )
    say(f"  solver     {plan1.summary.solve_s:.1f} s: {solver_words(plan1)}")
    env = parse_env((workdir / "agents" / "h200-0" / DEPLOYMENT / "gpu0.env").read_text())
    say("agent files  h200-0 gpu0.env (excerpt):")
    for key in (
        "MIXFLEET_PLAN_VERSION",
        "MIXFLEET_RANK",
        "MIXFLEET_ATTENTION_SHARE",
        "MIXFLEET_DP_WEIGHT",
        "MIXFLEET_EP_BACKEND",
        "MIXFLEET_DEEPEP_NUM_SMS",
        "MIXFLEET_ATTENTION_BACKEND",
    ):
        say(f"  {key}={env.get(key, '')}")
    say("attention    share per node: " + _shares(plan1))
    return plan1


async def show_contingencies(
    ctl: RunningController, version: int, nodes: int, limit_s: float
) -> None:
    """Wait until the controller has solved, in the background, the plan for the loss of
    each of the ``nodes`` nodes of ``version`` (a node loss then rolls one out without a
    solve)."""
    plans = ctl.controller.contingencies
    say()
    say(
        f"contingency  the controller solves in the background what v{version} becomes if one "
        f"of its {nodes} nodes is lost, so that a node loss is a rollout, not a solve:"
    )
    t0 = last = time.monotonic()
    while plans.planned_for(DEPLOYMENT) != version or plans.tasks():
        now = time.monotonic()
        if now - last >= PROGRESS_S:
            ready = len(plans.keys(DEPLOYMENT))
            say(f"  ... {ready} of {nodes} ready ({now - t0:.0f} s)")
            last = now
        if now - t0 > limit_s:
            raise TimeoutError(f"contingency plans not solved within {limit_s:.0f} s")
        await asyncio.sleep(0.25)
    ready = len(plans.keys(DEPLOYMENT))
    say(
        f"contingency  {ready} of {nodes} node-loss plans ready after {time.monotonic() - t0:.0f} s"
    )


async def start_engine(
    demo: Demo, stop_engine: asyncio.Event
) -> tuple[asyncio.Task[int], asyncio.Event]:
    """Read the routing, start the simulated engine on uniform load; returns its task and
    the event that shifts its load."""
    routing: engine_pb2.Routing = await demo.engines.GetRouting(
        engine_pb2.GetRoutingRequest(
            deployment=DEPLOYMENT, format=engine_pb2.ROUTING_FORMAT_SGLANG
        ),
        timeout=30,
    )
    say()
    say(
        f"engine       GetRouting: v{routing.version}, {routing.world_size} ranks x "
        f"{routing.slots_per_rank} expert slots, {len(routing.layers)} MoE layers "
        f"(SGLang document {len(routing.engine_json) // 1024} KiB)"
    )
    shift = asyncio.Event()
    task = asyncio.create_task(engine(demo, stop_engine, shift, random.Random(1)), name="engine")
    return task, shift


@dataclass
class Replan:
    """The re-plan the load shift caused.

    Attributes:
        record: v2's plan record. plan: v2.
        windows: the load windows the engine had reported when the re-plan began (those
            the controller measured: all were sent within its last 60 s).
        after_shift: how many of them came after the shift.
    """

    record: plan_pb2.PlanRecord
    plan: Any
    windows: list[list[list[float]]] = field(default_factory=list)
    after_shift: int = 0


async def shift_load(
    demo: Demo, shift: asyncio.Event, stop_engine: asyncio.Event, time_limit_s: float
) -> Replan:
    """Uniform load for ``UNIFORM_S``, then the shift; follow the controller until it
    commits the re-plan (the engine stops reporting once planning starts)."""
    await asyncio.sleep(UNIFORM_S)
    d = await demo.deployment()
    say(
        f"load         uniform: observed imbalance {d.status.observed_imbalance:+.2f} "
        f"(plan predicted {d.status.imbalance:+.2f}); no re-plan"
    )
    before = len(demo.sent)
    shift.set()
    say(
        f"load         SHIFT: {HOT_EXPERTS} experts per layer now get {HOT_FACTOR:.0f}x the "
        f"tokens, and keep getting them (the controller re-plans once the imbalance has "
        f"lasted {SUSTAIN_S:.0f} s)"
    )
    t_shift = time.monotonic()
    measured: list[list[list[float]]] = []

    def planning(d: plan_pb2.Deployment) -> None:
        if d.status.phase == plan_pb2.DEPLOYMENT_PHASE_PLANNING and not stop_engine.is_set():
            # The re-plan has started: stop reporting, so that the comparisons below plan
            # and score exactly the load the controller measured.
            stop_engine.set()
            measured.extend(demo.sent)

    d = await follow(
        demo,
        2,
        limit_s=time_limit_s * 4 + 60,
        detail=lambda d: f"observed imbalance {d.status.observed_imbalance:+.2f}; ",
        on_status=planning,
    )
    rec2, plan2 = await demo.plan_doc(d.status.committed_version)
    say(
        f"committed    v{rec2.version} {rec2.plan_id} {time.monotonic() - t_shift:.1f} s "
        f"after the shift: {rec2.reason}"
    )
    windows = measured or list(demo.sent)
    return Replan(rec2, plan2, windows, max(0, len(windows) - before))


def _measured_step_us(
    ctl: RunningController,
    time_limit_s: float,
    plans: Sequence[Any],
    windows: Sequence[Sequence[Sequence[float]]],
) -> list[float]:
    """Each plan's predicted step under the summed ``windows``, us (scored as the engine
    executes it, :func:`policies.solve.rescore`)."""
    load = [
        [sum(w[li][e] for w in windows) for e in range(len(windows[0][li]))]
        for li in range(len(windows[0]))
    ]
    nodes = list(dict.fromkeys(g.node for g in plans[0].gpus))
    request = build_request(
        spec_from_proto(_spec(time_limit_s)),
        ctl.controller.fleet_for(DEPLOYMENT, nodes),
        measured=load,
    )
    return [rescore(request, p).plan.summary.step_time_us for p in plans]


def _weights_by_node(plan: Any) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for g in plan.gpus:
        out.setdefault(g.node, []).append(g.dp_weight)
    return out


async def show_replan(
    demo: Demo, ctl: RunningController, plan1: Any, replan: Replan, time_limit_s: float
) -> None:
    """What the re-plan changed: the step under the measured load before and after, the
    expert moves, the router weights; then the same load planned from scratch (a dry run)."""
    rec2, plan2 = replan.record, replan.plan
    diff: plan_pb2.PlanDiff = await demo.plans.DiffPlans(
        plan_pb2.DiffPlansRequest(deployment=DEPLOYMENT, from_version=1, to_version=rec2.version),
        timeout=30,
    )
    step1, step2 = await asyncio.to_thread(
        _measured_step_us, ctl, time_limit_s, [plan1, plan2], replan.windows
    )
    say()
    say(
        f"re-plan      v1 -> v{rec2.version}: migration-aware ILP, starting from v1 (a move must pay for itself)"
    )
    say(
        f"  load       the {len(replan.windows)} load windows the controller measured, "
        f"{replan.after_shift} of them after the shift"
    )
    say(f"  solver     {plan2.summary.solve_s:.1f} s: {solver_words(plan2)}")
    say(
        f"  step time  v1: {plan1.summary.step_time_us / 1000:.0f} ms planned for uniform load, "
        f"{step1 / 1000:.0f} ms under the measured load; v{rec2.version}: "
        f"{step2 / 1000:.0f} ms under the same load ({step2 / step1 - 1:+.0%})"
    )
    say(
        f"  moves      {diff.expert_moves} of {diff.total_slots} expert slots "
        f"({diff.expert_moves / max(1, diff.total_slots):.0%}) on {len(diff.gpus)} of "
        f"{len(plan2.gpus)} GPUs" + ("; most churn:" if diff.gpus else "")
    )
    changed = sorted(diff.gpus, key=lambda g: -(g.experts_added + g.experts_removed))
    if changed:
        _table(
            [["gpu", "+experts", "-experts"]]
            + [[g.gpu, str(g.experts_added), str(g.experts_removed)] for g in changed[:4]],
            indent="    ",
        )
    before, after = _weights_by_node(plan1), _weights_by_node(plan2)
    change = max(
        (
            abs(b / a - 1)
            for n in before
            for a, b in zip(before[n], after.get(n, []), strict=False)
            if a
        ),
        default=0.0,
    )
    if change < SAME_WEIGHT:
        say(
            f"  router     DP weights within {change:.1%} of v1's: the shift moved load between "
            "experts, not between attention ranks, so every rank keeps its share of requests"
        )
    else:
        say(f"  router     DP weights changed by up to {change:.0%} (mean per node, v1 -> v2):")
    for n in before:
        a, b = before[n], after.get(n, [])
        say(f"    {n}  {sum(a) / len(a):.3f} -> " + (f"{sum(b) / len(b):.3f}" if b else "gone"))
    await _from_scratch(demo, plan1, time_limit_s)


async def _from_scratch(demo: Demo, plan1: Any, time_limit_s: float) -> None:
    """The same measured load planned from scratch (a dry run: nothing stored or rolled
    out): its moves against v1 and its step."""
    scratch_spec = _spec(time_limit_s)
    scratch_spec.workload.load = "measured"
    say("  from scratch (dry run: the same load planned from nothing, nothing rolled out)")
    t0 = time.monotonic()
    try:
        reply: plan_pb2.SolveResponse = await with_progress(
            demo.plans.Solve(
                plan_pb2.SolveRequest(spec=scratch_spec, include_plan=True),
                timeout=time_limit_s * 4 + 60,
            ),
            lambda s: f"    ... solving ({s:.0f} s)",
        )
    except aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        # The controller stops a dry run after twice its time limit and 30 s; on a busy
        # machine this comparison may not finish. It is a viewer's question: say so, go on.
        say(f"    not compared: {exc.details()}")
        return
    scratch = plan_from_dict(json.loads(reply.plan.plan_json))
    scratch_diff = diff_plans(plan1, scratch)
    say(
        f"    {scratch_diff.expert_moves} moves "
        f"({scratch_diff.expert_moves / max(1, scratch_diff.total_slots):.0%}) for "
        f"{scratch.summary.step_time_us / 1000:.0f} ms, solved in {time.monotonic() - t0:.0f} s"
    )


async def show_history(demo: Demo, workdir: Path) -> None:
    """The routing and plan file the engine and agents now have, and the plan history."""
    routing = await demo.engines.GetRouting(
        engine_pb2.GetRoutingRequest(deployment=DEPLOYMENT), timeout=30
    )
    say(f"engine       routing now v{routing.version}")
    env = parse_env((workdir / "agents" / "h200-0" / DEPLOYMENT / "gpu0.env").read_text())
    say(f"agent files  h200-0 gpu0.env MIXFLEET_PLAN_VERSION={env['MIXFLEET_PLAN_VERSION']}")
    history: plan_pb2.ListPlansResponse = await demo.plans.ListPlans(
        plan_pb2.ListPlansRequest(deployment=DEPLOYMENT), timeout=10
    )
    say()
    say("plan history")
    rows = [["version", "state", "step ms", "moves", "solve s", "reason"]]
    for p in sorted(history.plans, key=lambda p: p.version):
        moves = p.summary.expert_moves if p.summary.HasField("expert_moves") else None
        rows.append(
            [
                f"v{p.version}",
                plan_pb2.PlanState.Name(p.state).removeprefix("PLAN_STATE_").lower(),
                f"{p.summary.step_time_us / 1000:.0f}",
                "-" if moves is None else str(moves),
                f"{p.summary.solve_s:.1f}",
                p.reason[:70],
            ]
        )
    _table(rows)
