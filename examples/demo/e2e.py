"""The issue-3 demo: the whole control plane on one machine, end to end.

1. a controller on SQLite in a temporary directory (real gRPC on loopback);
2. simulated agents for examples/fleets/mixed-24.yaml (A100, H100 and H200 nodes), writing
   their plan files like real agents would;
3. a DeepSeek-V3 prefill deployment (ILP), rolled out in two phases to every agent;
4. a simulated inference engine reads its routing (EngineService.GetRouting), reports its
   expert load every half second, and halfway through the load shifts: a few experts per
   layer get much hotter;
5. the controller sees the imbalance persist and re-plans in the ILP's migration-aware mode;
   the demo shows the diff (expert moves against a plan from scratch), the plan history and
   the new routing the engine receives;
6. everything stops cleanly.

Run ``python -m demo.e2e`` (about 30 s on 2 cores: three ILP solves of
DeepSeek-V3 on 24 GPUs dominate). ``--keep DIR`` keeps the state and plan files.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from mixfleet.v1 import engine_pb2, engine_pb2_grpc, plan_pb2, plan_pb2_grpc

from agents.agent import AgentSettings
from agents.applier import parse_env
from agents.backoff import BackoffSettings
from agents.discovery.static import load_fleet_file
from agents.logs import configure_logging
from agents.simulate import SimulatedFleet
from controlplane.server.controller import ControllerSettings
from controlplane.server.inprocess import start_controller
from policies.assignment import diff_plans
from policies.models import preset
from policies.plan import plan_from_dict

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
UNIFORM_S = 3.0  # load before the shift, s
HOT_EXPERTS = 8  # per MoE layer, after the shift
HOT_FACTOR = 4.0  # their load relative to the others


def _say(text: str = "") -> None:
    print(text, flush=True)


def _spec(time_limit_s: float) -> plan_pb2.DeploymentSpec:
    return plan_pb2.DeploymentSpec(
        name=DEPLOYMENT,
        model=MODEL,
        workload=plan_pb2.WorkloadSpec(phase="prefill", tokens_per_gpu=4096, context_len=4096),
        policy="ilp",
        form="engine",
        solver_time_limit_s=time_limit_s,
        prepare_timeout_s=30.0,
        rebalance=plan_pb2.RebalanceSpec(
            enabled=True,
            imbalance_threshold=0.2,
            sustain_s=2.0,
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
    def __init__(self, channel: aio.Channel) -> None:
        self.plans = plan_pb2_grpc.PlanServiceStub(channel)
        self.engines = engine_pb2_grpc.EngineServiceStub(channel)

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


async def _engine(
    demo: Demo, stop: asyncio.Event, shift_at: asyncio.Event, rng: random.Random
) -> int:
    """A simulated engine: streams one load window every WINDOW_S until stopped."""
    sent = 0

    async def windows() -> AsyncIterator[engine_pb2.ExpertLoadWindow]:
        nonlocal sent
        model = preset(MODEL)
        while not stop.is_set():
            end = time.time()
            counts = _load(shift_at.is_set(), rng)
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
        _say(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


async def _run(workdir: Path, time_limit_s: float) -> int:
    t_start = time.monotonic()
    fleet = load_fleet_file(FLEET_FILE)
    async with start_controller(workdir / "controller", settings=SETTINGS) as ctl:
        _say(f"controller   {ctl.address}, state in {ctl.db_path}")
        agent_settings = AgentSettings(
            controller=ctl.address,
            insecure=True,
            backoff=BackoffSettings(initial_s=0.2, max_s=2.0),
        )
        sim = SimulatedFleet(fleet, agent_settings, plan_dir=workdir / "agents")
        sim.start()
        channel = aio.insecure_channel(
            ctl.address, options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        demo = Demo(channel)
        stop_engine = asyncio.Event()
        engine_task: asyncio.Task[int] | None = None
        try:
            # ---------------------------------------------------------------- agents
            nodes: plan_pb2.ListNodesResponse = plan_pb2.ListNodesResponse()
            for _ in range(100):
                nodes = await demo.plans.ListNodes(plan_pb2.ListNodesRequest(), timeout=10)
                if len(nodes.nodes) == len(fleet.nodes):
                    break
                await asyncio.sleep(0.1)
            _say(f"agents       {len(nodes.nodes)} simulated agents registered:")
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
                        f"{len(inv.nics)}x{inv.nics[0].rate_per_direction_gbits_per_s:.0f} Gb/s" if inv.nics else "-",
                        str(inv.simulated).lower(),
                    ]
                )
            _table(rows)

            # ---------------------------------------------------------------- deploy
            _say()
            _say(
                f"deploy       {MODEL}, prefill 4096 tokens/GPU, policy ilp "
                f"(time limit {time_limit_s:.0f} s), rebalance on"
            )
            t0 = time.monotonic()
            await demo.plans.ApplyDeployment(
                plan_pb2.ApplyDeploymentRequest(spec=_spec(time_limit_s)), timeout=10
            )
            d = await demo.wait_version(1, timeout_s=time_limit_s * 4 + 30)
            rec1, plan1 = await demo.plan_doc(1)
            _say(
                f"committed    v1 {rec1.plan_id} in {time.monotonic() - t0:.1f} s "
                f"(solve {plan1.summary.solve_s:.1f} s, {plan1.summary.solver}); predicted step "
                f"{plan1.summary.step_time_us / 1000:.0f} ms; acks {_acks(rec1)}"
            )
            env = parse_env((workdir / "agents" / "h200-0" / DEPLOYMENT / "gpu0.env").read_text())
            _say("agent files  h200-0 gpu0.env (excerpt):")
            for key in (
                "MIXFLEET_PLAN_VERSION",
                "MIXFLEET_RANK",
                "MIXFLEET_ATTENTION_SHARE",
                "MIXFLEET_DP_WEIGHT",
                "MIXFLEET_EP_BACKEND",
                "MIXFLEET_DEEPEP_NUM_SMS",
                "MIXFLEET_ATTENTION_BACKEND",
            ):
                _say(f"  {key}={env.get(key, '')}")
            _say("attention    share per node: " + _shares(plan1))

            # ---------------------------------------------------------------- engine
            routing: engine_pb2.Routing = await demo.engines.GetRouting(
                engine_pb2.GetRoutingRequest(
                    deployment=DEPLOYMENT, format=engine_pb2.ROUTING_FORMAT_SGLANG
                ),
                timeout=30,
            )
            _say()
            _say(
                f"engine       GetRouting: v{routing.version}, {routing.world_size} ranks x "
                f"{routing.slots_per_rank} expert slots, {len(routing.layers)} MoE layers "
                f"(SGLang document {len(routing.engine_json) // 1024} KiB)"
            )
            shift = asyncio.Event()
            engine_task = asyncio.create_task(
                _engine(demo, stop_engine, shift, random.Random(1)), name="engine"
            )
            await asyncio.sleep(UNIFORM_S)
            d = await demo.deployment()
            _say(
                f"load         uniform: observed imbalance {d.status.observed_imbalance:+.2f} "
                f"(plan predicted {d.status.imbalance:+.2f}); no re-plan"
            )
            shift.set()
            _say(
                f"load         SHIFT: {HOT_EXPERTS} experts per layer now get "
                f"{HOT_FACTOR:.0f}x the tokens"
            )
            t_shift = time.monotonic()
            seen = ""
            while True:
                d = await demo.deployment()
                if d.status.committed_version >= 2:
                    break
                phase = plan_pb2.DeploymentPhase.Name(d.status.phase).removeprefix(
                    "DEPLOYMENT_PHASE_"
                )
                line = f"{phase.lower()}: {d.status.message.splitlines()[0] if d.status.message else ''}"
                if (
                    d.status.phase == plan_pb2.DEPLOYMENT_PHASE_PLANNING
                    and not stop_engine.is_set()
                ):
                    # The re-plan has started; stop reporting so that the from-scratch
                    # comparison below plans for exactly the same measured load.
                    stop_engine.set()
                if line != seen:
                    _say(
                        f"controller   t+{time.monotonic() - t_shift:4.1f} s observed imbalance "
                        f"{d.status.observed_imbalance:+.2f}; {line}"
                    )
                    seen = line
                if time.monotonic() - t_shift > time_limit_s * 4 + 60:
                    raise TimeoutError("no rebalance")
                await asyncio.sleep(0.25)
            rec2, plan2 = await demo.plan_doc(d.status.committed_version)
            _say(
                f"committed    v{rec2.version} {rec2.plan_id} {time.monotonic() - t_shift:.1f} s "
                f"after the shift: {rec2.reason}"
            )

            # ---------------------------------------------------------------- diff
            diff: plan_pb2.PlanDiff = await demo.plans.DiffPlans(
                plan_pb2.DiffPlansRequest(
                    deployment=DEPLOYMENT, from_version=1, to_version=rec2.version
                ),
                timeout=30,
            )
            _say()
            _say("re-plan      migration-aware ILP (previous plan as the starting point):")
            _say(
                f"  expert moves  {diff.expert_moves} of {diff.total_slots} slots "
                f"({diff.expert_moves / max(1, diff.total_slots):.0%})"
            )
            _say(
                f"  step time     {diff.step_time_us_before / 1000:.0f} ms predicted for v1 "
                f"under uniform load -> {diff.step_time_us_after / 1000:.0f} ms for "
                f"v{rec2.version} under the shifted load"
            )
            changed = sorted(diff.gpus, key=lambda g: -(g.experts_added + g.experts_removed))
            _say(f"  GPUs changed  {len(diff.gpus)} of {len(plan2.gpus)}; most churn:")
            _table(
                [["gpu", "attention", "+experts", "-experts"]]
                + [
                    [
                        g.gpu,
                        f"{g.attention_share_before:.3f}->{g.attention_share_after:.3f}",
                        str(g.experts_added),
                        str(g.experts_removed),
                    ]
                    for g in changed[:4]
                ],
                indent="    ",
            )
            # The same measured load planned from scratch (a dry run: nothing stored or
            # rolled out).
            scratch_spec = _spec(time_limit_s)
            scratch_spec.workload.load = "measured"
            t0 = time.monotonic()
            reply: plan_pb2.SolveResponse = await demo.plans.Solve(
                plan_pb2.SolveRequest(spec=scratch_spec, include_plan=True),
                timeout=time_limit_s * 4 + 60,
            )
            scratch = plan_from_dict(json.loads(reply.plan.plan_json))
            scratch_diff = diff_plans(plan1, scratch)
            _say(
                f"  from scratch  {scratch_diff.expert_moves} moves "
                f"({scratch_diff.expert_moves / max(1, scratch_diff.total_slots):.0%}) for "
                f"{scratch.summary.step_time_us / 1000:.0f} ms (dry run, "
                f"{time.monotonic() - t0:.0f} s)"
            )

            # ---------------------------------------------------------------- history
            routing = await demo.engines.GetRouting(
                engine_pb2.GetRoutingRequest(deployment=DEPLOYMENT), timeout=30
            )
            _say(f"engine       routing now v{routing.version}")
            env = parse_env((workdir / "agents" / "h200-0" / DEPLOYMENT / "gpu0.env").read_text())
            _say(
                f"agent files  h200-0 gpu0.env MIXFLEET_PLAN_VERSION={env['MIXFLEET_PLAN_VERSION']}"
            )
            history: plan_pb2.ListPlansResponse = await demo.plans.ListPlans(
                plan_pb2.ListPlansRequest(deployment=DEPLOYMENT), timeout=10
            )
            _say()
            _say("plan history")
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
        finally:
            stop_engine.set()
            if engine_task is not None:
                try:
                    accepted = await asyncio.wait_for(engine_task, 10)
                    _say(f"engine       {accepted} load windows accepted")
                except (TimeoutError, grpc.RpcError) as exc:
                    _say(f"engine       stopped ({type(exc).__name__})")
            await sim.stop()
            await channel.close(None)
    _say()
    _say(
        f"stopped      controller and {len(fleet.nodes)} agents; {time.monotonic() - t_start:.0f} s in all"
    )
    return 0


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status (0 success, 1 a step failed)."""
    parser = argparse.ArgumentParser(prog="python -m demo.e2e")
    parser.add_argument("--keep", type=Path, default=None, help="keep state and files here")
    parser.add_argument(
        "--time-limit", type=float, default=25.0, help="ILP time limit per solve, seconds"
    )
    parser.add_argument(
        "--log-level", default="error", choices=("debug", "info", "warning", "error")
    )
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            return asyncio.run(_run(args.keep, args.time_limit))
        with tempfile.TemporaryDirectory(prefix="mixfleet-demo-") as tmp:
            return asyncio.run(_run(Path(tmp), args.time_limit))
    except (TimeoutError, grpc.RpcError) as exc:
        print(f"error: demo step failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
