"""The control-plane benchmark's harness: the controller process, the fleet and probes.

:class:`ControllerProcess` runs ``mixfleetctl controller run`` in a child process on a fresh
SQLite file; :func:`bench_fleet` and :func:`deployment` build the inputs; :class:`Events`
records the simulated agents' prepare/commit times; :func:`percentiles` (milliseconds),
:func:`cpu_seconds`, :func:`poll` and the plan watcher measure. :func:`node_loss` kills one
agent and times the controller's re-plan. Used by :mod:`bench.controlplane`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
from grpc import aio
from mixfleet.v1 import plan_pb2, plan_pb2_grpc

from agents.agent import AssignmentEvent
from agents.simulate import SimulatedFleet
from policies.hardware.fleet import Fleet, parse_fleet

if TYPE_CHECKING:
    PlanStub: TypeAlias = plan_pb2_grpc.PlanServiceAsyncStub


REPO = Path(__file__).resolve().parents[1]
WIDE = "wide"
SLICE = "slice"


def bench_fleet(n: int, slice_nodes: int) -> Fleet:
    """``n`` single-GPU H100 nodes; the last ``slice_nodes`` form pool ``slice``."""
    nodes = []
    for i in range(n):
        pool = SLICE if i >= n - slice_nodes else WIDE
        nodes.append(
            {
                "name": f"node-{i:05d}",
                "labels": {"pool": pool},
                "gpus": [{"model": "H100-SXM5-80GB", "count": 1}],
                "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib0"}],
            }
        )
    return parse_fleet({"metadata": {"name": f"bench-{n}"}, "spec": {"nodes": nodes}})


def deployment(name: str, pool: str, policy: str) -> plan_pb2.DeploymentSpec:
    spec = plan_pb2.DeploymentSpec(
        name=name,
        model="mixtral-8x7b",
        workload=plan_pb2.WorkloadSpec(phase="decode", tokens_per_gpu=64, context_len=2048),
        policy=policy,
        solver_time_limit_s=60.0,
        prepare_timeout_s=60.0,
    )
    spec.node_selector["pool"] = pool
    return spec


def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    """p50 / p99 / max in milliseconds of latencies in seconds."""
    if not values:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    xs = sorted(values)

    def q(p: float) -> float:
        return 1000.0 * xs[min(len(xs) - 1, max(0, round(p * (len(xs) - 1))))]

    return {
        "count": len(xs),
        "p50_ms": round(q(0.50), 2),
        "p99_ms": round(q(0.99), 2),
        "max_ms": round(1000.0 * xs[-1], 2),
        "mean_ms": round(1000.0 * statistics.fmean(xs), 2),
    }


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc), seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def self_cpu() -> float:
    """User + system CPU time of this process (the agents), seconds."""
    t = os.times()
    return t.user + t.system


@dataclass
class Events:
    """Assignment events of every agent, for fan-out times."""

    items: list[AssignmentEvent] = field(default_factory=list)

    def __call__(self, e: AssignmentEvent) -> None:
        self.items.append(e)

    def of(self, deployment: str, version: int, phase: str) -> list[AssignmentEvent]:
        return [
            e
            for e in self.items
            if e.deployment == deployment and e.version == version and e.phase == phase
        ]


class ControllerProcess:
    """``mixfleetctl controller run`` in a child process."""

    def __init__(
        self,
        workdir: Path,
        heartbeat_s: float,
        lost_after_s: float,
        profile: Path | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        self.log_path = workdir / "controller.log"
        prof = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
        self.cmd = [
            sys.executable,
            *prof,
            "-m",
            "controlplane.cli",
            "controller",
            "run",
            "--listen",
            "127.0.0.1:0",
            "--store",
            f"sqlite:{workdir / 'state.db'}",
            "--store-new",
            "--insecure",
            "--heartbeat-interval",
            str(heartbeat_s),
            "--node-lost-after",
            str(lost_after_s),
            "--max-message-mib",
            "64",
            "--log-level",
            "warning",
            *extra,
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""

    def start(self, timeout_s: float = 60.0) -> str:
        log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.search(r"listening on (\S+)", line)
            if m:
                self.address = m.group(1)
                return self.address
        raise RuntimeError(f"controller did not start; see {self.log_path}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def poll(probe: Any, *, timeout_s: float, every_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await probe()
        if value:
            return value
        await asyncio.sleep(every_s)
    return None


async def watch_plans(stub: PlanStub, out: list[tuple[str, int, int, float]]) -> None:
    """Record (deployment, version, state, state_changed_unix_s) of every plan event."""
    try:
        async for ev in stub.WatchPlans(plan_pb2.WatchPlansRequest()):
            p = ev.plan
            out.append((p.deployment, int(p.version), int(p.state), p.state_changed_unix_s))
    except aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            raise


def state_time(
    events: list[tuple[str, int, int, float]], dep: str, version: int, state: int
) -> float | None:
    for d, v, s, t in events:
        if d == dep and v == version and s == state:
            return t
    return None


def marks_of(sim: SimulatedFleet) -> dict[str, int]:
    return {n: len(a.stats.heartbeat_latency_s) for n, a in sim.agents.items()}


def since(sim: SimulatedFleet, marks: dict[str, int]) -> list[float]:
    """Heartbeat latencies recorded since ``marks`` (a :func:`_marks` result)."""
    out: list[float] = []
    for n, a in sim.agents.items():
        out.extend(a.stats.heartbeat_latency_s[marks.get(n, 0) :])
    return out


async def sample_latencies(sim: SimulatedFleet, seconds: float) -> list[float]:
    """Heartbeat latencies of every agent recorded during the next ``seconds``."""
    marks = marks_of(sim)
    await asyncio.sleep(seconds)
    return since(sim, marks)


async def node_loss(
    sim: SimulatedFleet,
    stub: PlanStub,
    plan_events: list[tuple[str, int, int, float]],
    dep: str,
    victim: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    d = await stub.GetDeployment(plan_pb2.GetDeploymentRequest(name=dep), timeout=30)
    before = int(d.status.committed_version)
    if before == 0:
        return {"deployment": dep, "skipped": "nothing committed to re-plan"}
    t_kill = time.time()
    await sim.kill(victim)

    async def lost() -> float | None:
        node = await stub.GetNode(plan_pb2.GetNodeRequest(name=victim), timeout=30)
        return time.time() if node.health == plan_pb2.NODE_HEALTH_LOST else None

    t_lost = await poll(lost, timeout_s=args.node_lost_after * 4 + 30, every_s=0.05)

    async def replanned() -> bool:
        dd = await stub.GetDeployment(plan_pb2.GetDeploymentRequest(name=dep), timeout=30)
        return bool(dd.status.committed_version > before)

    await poll(replanned, timeout_s=args.timeout_s, every_s=0.1)
    d = await stub.GetDeployment(plan_pb2.GetDeploymentRequest(name=dep), timeout=30)
    version = int(d.status.committed_version)
    out: dict[str, Any] = {
        "deployment": dep,
        "node": victim,
        "kill_to_lost_s": round(t_lost - t_kill, 2) if t_lost else None,
        "loss_to_commit_s": None,
        "new_version": version if version > before else None,
    }
    if version > before and t_lost is not None:
        rec = await stub.GetPlan(plan_pb2.GetPlanRequest(deployment=dep, version=version))
        t_commit = state_time(plan_events, dep, version, plan_pb2.PLAN_STATE_COMMITTED)
        t_commit = t_commit or rec.state_changed_unix_s
        out["loss_to_commit_s"] = round(t_commit - t_lost, 2)
        out["solve_s"] = round(rec.summary.solve_s, 2)
        out["gpus"] = rec.summary.num_gpus
        out["reason"] = rec.reason
        t_prep = state_time(plan_events, dep, version, plan_pb2.PLAN_STATE_PREPARING)
        if t_prep is not None:
            out["rollout_s"] = round(t_commit - t_prep, 3)
    return out
