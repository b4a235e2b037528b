"""The issue-3 demo: the whole control plane on one machine, end to end.

1. a controller on SQLite in a temporary directory (real gRPC on loopback);
2. simulated agents for examples/fleets/mixed-24.yaml (A100, H100 and H200 nodes), writing
   their plan files like real agents would;
3. a DeepSeek-V3 prefill deployment (ILP), rolled out in two phases to every agent;
4. ``mixfleet-router`` (its own process) in front of a loopback engine with the deployment's
   DP ranks follows the committed routing (EngineService.WatchRouting); a burst of requests
   through it lands on the ranks in the plan's shares (demo.router_step);
5. the controller solves, in the background, what the plan becomes if a node is lost (one
   contingency plan per node);
6. a simulated inference engine reads its routing (EngineService.GetRouting), reports its
   expert load every half second, and after a while the load shifts for good: a few experts
   per layer get six times the tokens;
7. the controller sees the imbalance persist and re-plans in the ILP's migration-aware mode;
   the demo shows what changed (the predicted step under the measured load before and
   after, the expert moves, the router weights) against a plan from scratch, the plan
   history and the new routing the engine receives; the router applies the new plan live
   and a second burst follows it;
8. everything stops cleanly;
9. then a deployment stated by its demand and SLOs (Qwen3-30B-A3B on a small mixed fleet,
   its own controller and agents) served as several engine instances, one of them a
   prefill/decode pair, with one loopback engine per instance, ``mixfleet-router
   --deployment``, a client load at the planned demand, per-instance shares and predicted
   vs simulated vs measured latencies, then a demand shift that adds instances
   (:mod:`demo.instances_step`).

Every step that takes more than a few seconds prints progress. The controller's, agents'
and router's logs go to files (``--log-dir``, default ``out/demo/``), never to the screen.

Run ``PYTHONPATH=examples python -m demo.e2e`` (a few minutes on 2 idle cores: the ILP
solves of DeepSeek-V3 on 24 GPUs and the instances step's load dominate). ``--keep DIR``
keeps the state and plan files; ``--only mixed-24`` runs steps 1-8, ``--only instances``
step 9.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import grpc
from grpc import aio

from agents.agent import AgentSettings
from agents.backoff import BackoffSettings
from agents.discovery.static import load_fleet_file
from agents.logs import configure_logging
from agents.simulate import SimulatedFleet
from controlplane.server.inprocess import start_controller
from demo import instances_step
from demo.router_step import RouterPath, show_live_update, start_router
from demo.session import (
    FLEET_FILE,
    SETTINGS,
    Demo,
    deploy,
    say,
    shift_load,
    show_agents,
    show_contingencies,
    show_history,
    show_replan,
    start_engine,
)

REPO = Path(__file__).resolve().parents[2]


def _log_dir(requested: Path | None) -> Path:
    """``--log-dir``, else ``out/demo`` in the repository (git-ignored), else a new
    temporary directory (kept: the logs outlive the demo)."""
    candidate = requested or REPO / "out" / "demo"
    try:
        candidate.mkdir(parents=True, exist_ok=True)
        (candidate / "e2e.log").open("a").close()
    except OSError:
        if requested is not None:
            raise
        return Path(tempfile.mkdtemp(prefix="mixfleet-demo-logs-"))
    return candidate


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


async def _run(workdir: Path, time_limit_s: float, logs: Path, only: str = "") -> int:
    """The steps of the demo: those of mixed-24 against one controller and its simulated
    agents, then the instances step against its own (``only``: one part)."""
    if only != "instances":
        await _mixed24(workdir, time_limit_s, logs)
    if only != "mixed-24":
        t_start = time.monotonic()
        await instances_step.run(workdir, logs)
        say()
        say(
            "stopped      the instances step's controller, agents, router and engines; "
            f"{time.monotonic() - t_start:.0f} s"
        )
    return 0


async def _mixed24(workdir: Path, time_limit_s: float, logs: Path) -> None:
    """Steps 1-8 against one controller and its simulated agents."""
    t_start = time.monotonic()
    fleet = load_fleet_file(FLEET_FILE)
    async with start_controller(workdir / "controller", settings=SETTINGS) as ctl:
        say(f"controller   {ctl.address}, state in {ctl.db_path}")
        say(f"logs         {_shown(logs)}/: e2e.log (controller, agents), router.log")
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
            path = await start_router(demo, ctl.address, logs)
            planned1 = await path.show(1)
            await show_contingencies(ctl, 1, len(fleet.nodes), limit_s=time_limit_s * 12 + 60)
            engine_task, shift = await start_engine(demo, stop_engine)
            replan = await shift_load(demo, shift, stop_engine, time_limit_s)
            await show_live_update(path, replan.record.version, planned1)
            await show_replan(demo, ctl, plan1, replan, time_limit_s)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status (0 success, 1 a step failed)."""
    parser = argparse.ArgumentParser(prog="python -m demo.e2e", allow_abbrev=False)
    parser.add_argument("--keep", type=Path, default=None, help="keep state and files here")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=25.0,
        help="ILP time limit per solve, seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where the logs go (default: out/demo in the repository)",
    )
    parser.add_argument(
        "--only",
        choices=("mixed-24", "instances"),
        default="",
        help="run one part: the mixed-24 steps or the instances step (default: both)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="level of the log file (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    logs = _log_dir(args.log_dir)
    with (logs / "e2e.log").open("w", encoding="utf-8") as log:
        try:
            return _main(args, logs, log)
        finally:
            configure_logging("error")  # the log file closes here: later logs to stderr


def _main(args: argparse.Namespace, logs: Path, log: TextIO) -> int:
    """The demo with its logs in ``log``: structlog's, the standard library's and whatever
    else writes to stderr meanwhile (gRPC prints the tracebacks of the RPCs it cancels at
    shutdown); the demo's own error line goes to the real stderr."""
    err = sys.stderr
    configure_logging(args.log_level, stream=log)
    handler = logging.StreamHandler(log)
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stderr(log):
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                return asyncio.run(_run(args.keep, args.time_limit, logs, args.only))
            with tempfile.TemporaryDirectory(prefix="mixfleet-demo-") as tmp:
                return asyncio.run(_run(Path(tmp), args.time_limit, logs, args.only))
    except (TimeoutError, RuntimeError, grpc.RpcError) as exc:
        print(f"error: demo step failed: {exc} (logs: {_shown(logs)}/)", file=err)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=err)
        return 130
    except Exception as exc:  # the program's boundary: one line here, the traceback logged
        traceback.print_exc(file=log)
        print(
            f"error: demo failed: {type(exc).__name__}: {exc} "
            f"(traceback in {_shown(logs / 'e2e.log')})",
            file=err,
        )
        return 1
    finally:
        logging.getLogger().removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
