"""Shared pieces of the end-to-end tests: a real controller (controlplane.server.inprocess), real
simulated agents (agents.simulate) and real gRPC on loopback; nothing mocked."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from mixfleet.v1 import engine_pb2, engine_pb2_grpc, plan_pb2, plan_pb2_grpc
from support.waits import hang_guard_s

from agents.agent import AgentSettings, TlsFiles
from agents.applier import parse_env
from agents.backoff import BackoffSettings
from policies.hardware.fleet import Fleet, parse_fleet

#: Agents retry quickly in tests.
FAST_BACKOFF = BackoffSettings(initial_s=0.05, max_s=0.3, jitter=0.5)


def fleet(nodes: int = 3, gpus_per_node: int = 2, model: str = "H100-SXM5-80GB") -> Fleet:
    return parse_fleet(
        {
            "metadata": {"name": "e2e"},
            "spec": {
                "nodes": [
                    {
                        "name": f"n{i}",
                        "labels": {"pool": "e2e"},
                        "gpus": [{"model": model, "count": gpus_per_node}],
                        "nvlink": {"domain": f"n{i}", "per_gpu_bidir_gbytes_per_s": 900},
                        "nics": [{"count": 2, "per_direction_gbits_per_s": 400, "fabric": "ib0"}],
                    }
                    for i in range(nodes)
                ]
            },
        }
    )


def agent_settings(address: str, **kw: Any) -> AgentSettings:
    tls: TlsFiles | None = kw.pop("tls", None)
    return AgentSettings(
        controller=address,
        insecure=tls is None,
        tls=tls,
        backoff=FAST_BACKOFF,
        rpc_timeout_s=5.0,
        **kw,
    )


def spec(
    name: str = "mixtral",
    *,
    model: str = "mixtral-8x7b",
    policy: str = "greedy",
    phase: str = "decode",
    tokens_per_gpu: int = 64,
    context_len: int = 2048,
    time_limit_s: float = 20.0,
    rebalance: plan_pb2.RebalanceSpec | None = None,
    prepare_timeout_s: float = 10.0,
) -> plan_pb2.DeploymentSpec:
    s = plan_pb2.DeploymentSpec(
        name=name,
        model=model,
        workload=plan_pb2.WorkloadSpec(
            phase=phase, tokens_per_gpu=tokens_per_gpu, context_len=context_len
        ),
        policy=policy,
        solver_time_limit_s=time_limit_s,
        prepare_timeout_s=prepare_timeout_s,
    )
    if rebalance is not None:
        s.rebalance.CopyFrom(rebalance)
    return s


async def eventually(
    probe: Callable[[], Awaitable[Any]], *, timeout_s: float = 20.0, what: str = ""
) -> Any:
    """Call ``probe`` every 50 ms until it returns something truthy; return that. Gives up
    after ``timeout_s``, at least :data:`support.waits.HANG_GUARD_S` (a hang guard)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + hang_guard_s(timeout_s)
    last: Any = None
    while loop.time() < deadline:
        try:
            last = await probe()
        except aio.AioRpcError as exc:
            last = exc
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
                raise
        else:
            if last:
                return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last: {last!r}")


class Client:
    """PlanService and EngineService stubs on one channel."""

    def __init__(self, channel: aio.Channel) -> None:
        self.channel = channel
        self.plans = plan_pb2_grpc.PlanServiceStub(channel)
        self.engines = engine_pb2_grpc.EngineServiceStub(channel)

    async def apply(self, s: plan_pb2.DeploymentSpec) -> plan_pb2.Deployment:
        reply: plan_pb2.Deployment = await self.plans.ApplyDeployment(
            plan_pb2.ApplyDeploymentRequest(spec=s), timeout=10
        )
        return reply

    async def deployment(self, name: str) -> plan_pb2.Deployment:
        reply: plan_pb2.Deployment = await self.plans.GetDeployment(
            plan_pb2.GetDeploymentRequest(name=name), timeout=10
        )
        return reply

    async def committed_version(self, name: str) -> int:
        return int((await self.deployment(name)).status.committed_version)

    async def wait_committed(self, name: str, version: int, timeout_s: float = 30.0) -> int:
        async def probe() -> int:
            v = await self.committed_version(name)
            return v if v >= version else 0

        result: int = await eventually(
            probe, timeout_s=timeout_s, what=f"{name} v>={version} committed"
        )
        return result

    async def plan(self, name: str, version: int = 0) -> plan_pb2.PlanRecord:
        reply: plan_pb2.PlanRecord = await self.plans.GetPlan(
            plan_pb2.GetPlanRequest(deployment=name, version=version), timeout=10
        )
        return reply

    async def history(self, name: str) -> list[plan_pb2.PlanRecord]:
        reply = await self.plans.ListPlans(plan_pb2.ListPlansRequest(deployment=name), timeout=10)
        return list(reply.plans)

    async def nodes(self) -> dict[str, plan_pb2.NodeRecord]:
        reply = await self.plans.ListNodes(plan_pb2.ListNodesRequest(), timeout=10)
        return {n.inventory.node: n for n in reply.nodes}

    async def report_load(
        self, name: str, counts: Sequence[Sequence[float]], *, windows: int, version: int = 0
    ) -> int:
        """Stream ``windows`` load windows of ``counts`` ([moe_layers][experts])."""
        import time

        now = time.time()
        rows = len(counts)
        experts = len(counts[0])
        flat = [float(x) for row in counts for x in row]

        async def gen() -> Any:
            for k in range(windows):
                yield engine_pb2.ExpertLoadWindow(
                    deployment=name,
                    engine_id="sim-engine",
                    start_unix_s=now + k - windows,
                    end_unix_s=now + k - windows + 1,
                    num_layers=rows,
                    num_experts=experts,
                    counts=flat,
                    plan_version=version,
                )

        reply = await self.engines.ReportExpertLoad(gen(), timeout=30)
        return int(reply.windows_accepted)


def read_part(plan_dir: Path, node: str, deployment: str) -> dict[str, Any] | None:
    """The node part an agent has in force (``<plan_dir>/<node>/<deployment>.json``)."""
    path = plan_dir / node / f"{deployment}.json"
    if not path.exists():
        return None
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def read_env(plan_dir: Path, node: str, deployment: str, index: int) -> dict[str, str]:
    return parse_env((plan_dir / node / deployment / f"gpu{index}.env").read_text())
