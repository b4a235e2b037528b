"""Control-plane benchmark: N simulated agents at 1 Hz against one controller.

    python -m bench.controlplane --agents 100,500,2000 [--out bench/results/controlplane.json]

For each N it starts a real controller (``mixfleetctl controller run`` in its own process, on
a fresh SQLite file, plaintext loopback) and N simulated agents in this process (one gRPC
connection per ``--agents-per-channel`` agents; plans checked and kept in memory), then
measures:

* **heartbeat latency**: the round trip of every Heartbeat RPC as the agent sees it
  (``time.perf_counter`` around the call), over ``--steady-s`` seconds of steady state, and
  separately during the plan rollout below. p50 / p99 / max.
* **plan fan-out**: one deployment spanning every node but the slice below (each node has
  one GPU, so every agent gets a part): from the moment the controller starts the rollout
  (plan state PREPARING, the controller's clock) until the last agent has committed and
  acked. The solve before it is reported separately (``solve_s``).
* **node loss -> committed new plan**: an agent is killed (stops heartbeating, its stream
  dies). Time from the controller declaring the node lost (first time ``GetNode`` shows
  LOST; polled every 50 ms) to the controller's commit of the new plan. Measured twice: for a
  small deployment (``--slice-nodes`` nodes, what a real fleet of many deployments sees) and
  for the fleet-wide deployment (its re-solve covers every GPU).

Both processes share the machine (``os.cpu_count()`` is recorded). The plan is Mixtral-8x7B
(small; policy ``uniform`` for the wide deployment, ``greedy`` for the slice) so the planning
core's solve does not hide the control plane, but for the wide deployment it still grows
with the square of the GPU count (the cost model's all-pairs communication terms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpc import aio
from mixfleet.v1 import plan_pb2, plan_pb2_grpc

from agents.agent import AgentSettings
from agents.backoff import BackoffSettings
from agents.logs import configure_logging
from agents.simulate import SimulatedFleet
from bench.controlplane_harness import (
    SLICE,
    WIDE,
    ControllerProcess,
    Events,
    bench_fleet,
    cpu_seconds,
    deployment,
    marks_of,
    node_loss,
    percentiles,
    poll,
    sample_latencies,
    self_cpu,
    since,
    state_time,
    watch_plans,
)
from bench.controlplane_report import (
    TARGETS,
    check_targets,
    machine,
    render_markdown,
    summary_line,
)
from policies.hardware.fleet import Fleet

if TYPE_CHECKING:
    from bench.controlplane_harness import PlanStub

__all__ = [
    "TARGETS",
    "bench_fleet",
    "check_targets",
    "main",
    "measure",
    "percentiles",
    "render_markdown",
]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "controlplane.json"


@dataclass
class _Run:
    """One run's connections and what it has recorded so far.

    Attributes:
        n: number of simulated agents (one node, one GPU each).
        args: the benchmark's options.
        fleet: the simulated fleet.
        ctl: the controller process.
        sim: the simulated agents.
        stub: PlanService client of the benchmark.
        events: prepare/commit times the agents saw.
        plan_events: (deployment, version, state, controller unix s) from WatchPlans.
        result: the run's JSON record, filled phase by phase.
    """

    n: int
    args: argparse.Namespace
    fleet: Fleet
    ctl: ControllerProcess
    sim: SimulatedFleet
    stub: PlanStub
    events: Events
    plan_events: list[tuple[str, int, int, float]] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)


async def measure(n: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One benchmark run with ``n`` agents: registration, steady heartbeats, the slice
    deployment and its node loss, the wide rollout, then the wide node loss."""
    fleet = bench_fleet(n, args.slice_nodes)
    profile = args.profile_controller
    if profile is not None:
        profile = profile.with_name(f"{profile.stem}-n{n}{profile.suffix}")
    ctl = ControllerProcess(
        workdir, args.heartbeat_interval, args.node_lost_after, profile, args.controller_arg
    )
    address = ctl.start()
    settings = AgentSettings(
        controller=address,
        insecure=True,
        heartbeat_interval_s=args.heartbeat_interval,
        rpc_timeout_s=10.0,
        backoff=BackoffSettings(initial_s=0.5, max_s=5.0),
    )
    events = Events()
    sim = SimulatedFleet(
        fleet, settings, agents_per_channel=args.agents_per_channel, observer=events
    )
    channel = aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 28)])
    run = _Run(n, args, fleet, ctl, sim, plan_pb2_grpc.PlanServiceStub(channel), events)
    run.result["agents"] = n
    watcher = asyncio.create_task(watch_plans(run.stub, run.plan_events))
    try:
        await _register(run)
        await _steady(run)
        await _slice(run)
        # Node loss of the slice is measured before the wide rollout, on a quiet controller.
        run.result["node_loss_slice"] = await node_loss(
            sim, run.stub, run.plan_events, SLICE, fleet.nodes[-1].name, args
        )
        await _fanout(run)
        run.result["node_loss_wide"] = await node_loss(
            sim, run.stub, run.plan_events, WIDE, fleet.nodes[0].name, args
        )
        run.result["agent_errors"] = len(sim.errors)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await sim.stop()
        await channel.close(None)
        ctl.stop()
    return run.result


async def _register(run: _Run) -> None:
    """Start the agents over the ramp and wait until every one heartbeats."""
    sim, args, result = run.sim, run.args, run.result
    t0 = time.monotonic()
    ramp_s = args.ramp_s if args.ramp_s is not None else run.n / 100.0
    result["start_ramp_s"] = ramp_s
    await sim.start_over(ramp_s)

    async def all_registered() -> bool:
        return sum(1 for a in sim.agents.values() if a.stats.heartbeats > 0) == run.n

    ok = await poll(all_registered, timeout_s=120, every_s=0.2)
    result["all_heartbeating_s"] = round(time.monotonic() - t0, 2) if ok else None
    await asyncio.sleep(2 * args.heartbeat_interval)  # let the start-up burst pass


async def _steady(run: _Run) -> None:
    """Heartbeat latencies and CPU over ``--steady-s`` seconds of steady state."""
    sim, args, result, ctl = run.sim, run.args, run.result, run.ctl
    cpu0, self0 = cpu_seconds(ctl.pid), self_cpu()
    t_steady = time.monotonic()
    steady = await sample_latencies(sim, args.steady_s)
    cpu1, self1 = cpu_seconds(ctl.pid), self_cpu()
    elapsed = time.monotonic() - t_steady
    result["heartbeat_steady"] = percentiles(steady)
    result["heartbeat_steady"]["rate_per_s"] = round(len(steady) / elapsed, 1)
    result["heartbeat_failures"] = sum(a.stats.heartbeat_failures for a in sim.agents.values())
    if cpu0 is not None and cpu1 is not None:
        result["controller_cpu_percent_steady"] = round(100 * (cpu1 - cpu0) / elapsed, 1)
    result["agents_process_cpu_percent_steady"] = round(100 * (self1 - self0) / elapsed, 1)


async def _slice(run: _Run) -> None:
    """Apply the small deployment and wait for its first commit."""
    stub = run.stub
    await stub.ApplyDeployment(
        plan_pb2.ApplyDeploymentRequest(spec=deployment(SLICE, SLICE, run.args.slice_policy)),
        timeout=30,
    )

    async def slice_committed() -> bool:
        d = await stub.GetDeployment(plan_pb2.GetDeploymentRequest(name=SLICE), timeout=30)
        return bool(d.status.committed_version >= 1)

    await poll(slice_committed, timeout_s=run.args.timeout_s, every_s=0.1)


async def _fanout(run: _Run) -> None:
    """Apply the wide deployment; time its rollout and sample heartbeats meanwhile."""
    sim, stub, args, ctl = run.sim, run.stub, run.args, run.ctl
    marks = marks_of(sim)
    t_apply = time.time()
    await stub.ApplyDeployment(
        plan_pb2.ApplyDeploymentRequest(spec=deployment(WIDE, WIDE, args.wide_policy)),
        timeout=30,
    )
    wide_nodes: int = run.n - int(args.slice_nodes)

    async def rollout_started() -> bool:
        return state_time(run.plan_events, WIDE, 1, plan_pb2.PLAN_STATE_PREPARING) is not None

    await poll(rollout_started, timeout_s=args.timeout_s, every_s=0.02)
    run.result["heartbeat_during_solve"] = percentiles(since(sim, marks))
    during = asyncio.create_task(sample_latencies(sim, args.rollout_sample_s))
    cpu_ctl0, cpu_self0, t_cpu0 = cpu_seconds(ctl.pid), self_cpu(), time.monotonic()

    async def wide_committed() -> bool:
        return len(run.events.of(WIDE, 1, "commit")) >= wide_nodes

    await poll(wide_committed, timeout_s=args.timeout_s, every_s=0.1)
    cpu_ctl1, cpu_self1, t_cpu1 = cpu_seconds(ctl.pid), self_cpu(), time.monotonic()
    fan = await _fanout_record(run, wide_nodes, t_apply)
    if cpu_ctl0 is not None and cpu_ctl1 is not None:
        fan["controller_cpu_percent"] = round(100 * (cpu_ctl1 - cpu_ctl0) / (t_cpu1 - t_cpu0), 1)
    fan["agents_process_cpu_percent"] = round(100 * (cpu_self1 - cpu_self0) / (t_cpu1 - t_cpu0), 1)
    run.result["fanout"] = fan
    run.result["heartbeat_during_rollout"] = percentiles(await during)


async def _fanout_record(run: _Run, wide_nodes: int, t_apply: float) -> dict[str, Any]:
    """The wide rollout's record: phase, solve, fan-out times (s) and part sizes (bytes)."""
    stub, sim = run.stub, run.sim
    t_prep = state_time(run.plan_events, WIDE, 1, plan_pb2.PLAN_STATE_PREPARING)
    t_commit = state_time(run.plan_events, WIDE, 1, plan_pb2.PLAN_STATE_COMMITTED)
    prepares = run.events.of(WIDE, 1, "prepare")
    commits = run.events.of(WIDE, 1, "commit")
    d_wide = await stub.GetDeployment(plan_pb2.GetDeploymentRequest(name=WIDE), timeout=60)
    try:
        rec = await stub.GetPlan(plan_pb2.GetPlanRequest(deployment=WIDE, version=1), timeout=60)
    except aio.AioRpcError:
        rec = plan_pb2.PlanRecord()
    fan: dict[str, Any] = {
        "deployment_phase": plan_pb2.DeploymentPhase.Name(d_wide.status.phase),
        "deployment_message": d_wide.status.message[:500],
        "v1_state": plan_pb2.PlanState.Name(rec.state),
        "nodes": wide_nodes,
        "gpus": rec.summary.num_gpus,
        "policy": run.args.wide_policy,
        "solve_s": round(rec.summary.solve_s, 2),
        "apply_to_rollout_start_s": round(t_prep - t_apply, 2) if t_prep else None,
        "prepared_everywhere_s": None,
        "fanout_s": None,
        "commits_received": len(commits),
        "part_json_bytes_per_node": None,
    }
    if t_prep is not None and prepares:
        fan["prepared_everywhere_s"] = round(max(e.done_unix_s for e in prepares) - t_prep, 3)
    if t_prep is not None and len(commits) >= wide_nodes:
        fan["fanout_s"] = round(max(e.done_unix_s for e in commits) - t_prep, 3)
    if t_commit is not None and commits:
        fan["commit_point_to_last_commit_s"] = round(
            max(e.done_unix_s for e in commits) - t_commit, 3
        )
    some = next(iter(sim.appliers.values()))
    current = getattr(some, "current", {}).get(WIDE)
    if current is not None:
        fan["part_json_bytes_per_node"] = len(json.dumps(current.to_dict()))
        fan["expert_location_bytes"] = current.expert_location_bytes
        agent = next(iter(sim.agents.values()))
        fan["expert_location_wire_bytes"] = agent.stats.expert_location_wire_bytes
    return fan


async def _measure_all(ns: Sequence[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    for n in ns:
        if args.keep_dir is not None:
            workdir = args.keep_dir / f"n{n}"
            workdir.mkdir(parents=True, exist_ok=True)
            run = await measure(n, args, workdir)
        else:
            with tempfile.TemporaryDirectory(prefix=f"mixfleet-bench-{n}-") as tmp:
                run = await measure(n, args, Path(tmp))
        run["targets"] = check_targets(run)
        runs.append(run)
        print(summary_line(run), flush=True)
    return runs


def _parser() -> argparse.ArgumentParser:
    """Options of ``python -m bench.controlplane``."""
    p = argparse.ArgumentParser(
        prog="python -m bench.controlplane", description=__doc__, allow_abbrev=False
    )
    p.add_argument("--agents", default="100,500,2000", help="comma-separated N values")
    p.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="S")
    p.add_argument("--node-lost-after", type=float, default=10.0, metavar="S")
    p.add_argument("--steady-s", type=float, default=15.0, help="steady-state sample, s")
    p.add_argument("--rollout-sample-s", type=float, default=10.0, help="sample after apply, s")
    p.add_argument("--slice-nodes", type=int, default=8)
    p.add_argument(
        "--ramp-s",
        type=float,
        default=None,
        help="start the agents over this many seconds (default N/100)",
    )
    p.add_argument("--wide-policy", default="uniform", choices=("uniform", "greedy", "eplb", "ilp"))
    p.add_argument("--slice-policy", default="greedy", choices=("uniform", "greedy", "eplb", "ilp"))
    p.add_argument(
        "--controller-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument of `controller run` (repeat; e.g. --controller-arg=--contingency-max-nodes=0)",
    )
    p.add_argument("--agents-per-channel", type=int, default=100)
    p.add_argument("--timeout-s", type=float, default=180.0, help="longest wait for one step")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--docs", type=Path, default=None, help="also write a Markdown summary")
    p.add_argument("--keep-dir", type=Path, default=None, help="keep state and controller logs")
    p.add_argument(
        "--profile-controller",
        type=Path,
        default=None,
        metavar="FILE",
        help="run the controller under cProfile, writing FILE (suffixed -nN per run)",
    )
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="RESULTS",
        help="only write --docs from an existing results file (no run)",
    )
    return p


def _document(
    args: argparse.Namespace, argv: Sequence[str] | None, runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """The results document: command, machine, setup, targets and runs."""
    doc = {
        "benchmark": "controlplane",
        "command": " ".join(["python -m bench.controlplane", *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "setup": {
            "controller": "mixfleetctl controller run (separate process, SQLite WAL, plaintext)",
            "agents": "agents.simulate.SimulatedFleet in the benchmark process, MemoryApplier "
            "(parts checked, expert location received but not inflated)",
            "heartbeat_interval_s": args.heartbeat_interval,
            "node_lost_after_s": args.node_lost_after,
            "fleet": "N nodes x 1 H100-SXM5-80GB, 1x400 Gb/s NIC each",
            "wide_deployment": f"mixtral-8x7b decode, policy {args.wide_policy}, all but "
            f"{args.slice_nodes} nodes",
            "slice_deployment": f"mixtral-8x7b decode, policy greedy, {args.slice_nodes} nodes",
        },
        "targets_at_2000": TARGETS,
        "runs": runs,
    }
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.controlplane``: run (or ``--render``) and write the results."""
    args = _parser().parse_args(argv)
    if args.render is not None:
        if args.docs is None:
            print("error: --render needs --docs FILE to write", file=sys.stderr)
            return 2
        try:
            rendered = render_markdown(json.loads(args.render.read_text()))
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: --render {args.render}: {exc}", file=sys.stderr)
            return 2
        args.docs.write_text(rendered)
        print(f"wrote {args.docs}")
        return 0
    try:
        ns = [int(x) for x in args.agents.split(",") if x]
    except ValueError:
        print(f"error: --agents: expected numbers, got {args.agents!r}", file=sys.stderr)
        return 2
    if not ns or min(ns) <= args.slice_nodes:
        print(
            f"error: --agents: each N must exceed --slice-nodes {args.slice_nodes}", file=sys.stderr
        )
        return 2
    configure_logging("error")
    # One event loop for every run: grpc.aio binds to the first loop of the process.
    runs = asyncio.run(_measure_all(ns, args))
    doc = _document(args, argv, runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.docs is not None:
        args.docs.parent.mkdir(parents=True, exist_ok=True)
        args.docs.write_text(render_markdown(doc))
        print(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
