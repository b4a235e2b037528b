"""The issue-3 demo: the whole control plane on one machine, end to end.

1. a controller on SQLite in a temporary directory (real gRPC on loopback);
2. simulated agents for examples/fleets/mixed-24.yaml (A100, H100 and H200 nodes), writing
   their plan files like real agents would;
3. a DeepSeek-V3 prefill deployment (ILP), rolled out in two phases to every agent;
4. ``mixfleet-router`` (its own process) in front of a loopback engine with the deployment's
   DP ranks follows the committed routing (EngineService.WatchRouting); a burst of requests
   through it lands on the ranks in the plan's shares (demo.router_step);
5. a simulated inference engine reads its routing (EngineService.GetRouting), reports its
   expert load every half second, and halfway through the load shifts: a few experts per
   layer get much hotter;
6. the controller sees the imbalance persist and re-plans in the ILP's migration-aware mode;
   the demo shows the diff (expert moves against a plan from scratch), the plan history and
   the new routing the engine receives; the router applies the new weights live and a second
   burst follows them;
7. everything stops cleanly.

Run ``PYTHONPATH=examples python -m demo.e2e`` (about 30 s on 2 cores: three ILP solves of
DeepSeek-V3 on 24 GPUs dominate). ``--keep DIR`` keeps the state and plan files.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc import aio

from agents.agent import AgentSettings
from agents.backoff import BackoffSettings
from agents.discovery.static import load_fleet_file
from agents.logs import configure_logging
from agents.simulate import SimulatedFleet
from controlplane.server.inprocess import start_controller
from demo.router_step import RouterPath, show_live_update, start_router
from demo.session import (
    FLEET_FILE,
    SETTINGS,
    Demo,
    deploy,
    say,
    shift_load,
    show_agents,
    show_history,
    show_replan,
    start_engine,
)


async def _run(workdir: Path, time_limit_s: float) -> int:
    """Every step of the demo against one controller and its simulated agents."""
    t_start = time.monotonic()
    fleet = load_fleet_file(FLEET_FILE)
    async with start_controller(workdir / "controller", settings=SETTINGS) as ctl:
        say(f"controller   {ctl.address}, state in {ctl.db_path}")
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
        path: RouterPath | None = None
        try:
            await show_agents(demo, len(fleet.nodes))
            plan1 = await deploy(demo, workdir, time_limit_s)
            path = await start_router(demo, ctl.address, workdir)
            planned1 = await path.show(1)
            engine_task, shift = await start_engine(demo, stop_engine)
            rec2, plan2 = await shift_load(demo, shift, stop_engine, time_limit_s)
            await show_live_update(path, rec2.version, planned1)
            await show_replan(demo, plan1, rec2, plan2, time_limit_s)
            await show_history(demo, workdir)
        finally:
            stop_engine.set()
            if path is not None:
                await path.stop()
            if engine_task is not None:
                try:
                    accepted = await asyncio.wait_for(engine_task, 10)
                    say(f"engine       {accepted} load windows accepted")
                except (TimeoutError, grpc.RpcError) as exc:
                    say(f"engine       stopped ({type(exc).__name__})")
            await sim.stop()
            await channel.close(None)
    say()
    say(
        f"stopped      controller and {len(fleet.nodes)} agents; "
        f"{time.monotonic() - t_start:.0f} s in all"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status (0 success, 1 a step failed)."""
    parser = argparse.ArgumentParser(prog="python -m demo.e2e", allow_abbrev=False)
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
    except (TimeoutError, RuntimeError, grpc.RpcError) as exc:
        print(f"error: demo step failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
