"""The fleet scheduler end to end: a real in-process controller (SQLite store, gRPC) and
fake agents (tests/controlplane/agent_fakes.py). Three deployments get disjoint nodes; a lost
node makes the lowest priority go Pending with the reason; a deleted deployment's node is
reused without moving the others."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from agent_fakes import FakeAgent, small_inventories, wait_until
from mixfleet.v1 import plan_pb2, plan_pb2_grpc
from test_rebalance import MINI_MOE  # the small Qwen3-MoE-shaped model

from apis.wire.deployment import spec_to_proto
from controlplane.server.inprocess import start_controller
from controlplane.store import Store
from policies.spec.build import DeploymentSpec, WorkloadSpec

BASE = DeploymentSpec(
    name="x",
    model_config=MINI_MOE,
    workload=WorkloadSpec(phase="prefill", tokens_per_gpu=2048, context_len=2048),
    policy="greedy",
    prepare_timeout_s=5.0,
    min_gpus=2,
    max_gpus=2,  # one 2-GPU node each
)
SPECS = {
    "high": replace(BASE, name="high", priority=10),
    "mid": replace(BASE, name="mid", priority=5),
    "low": replace(BASE, name="low", priority=1),
}


def _ready_on(store: Store, name: str) -> tuple[str, ...] | None:
    """The nodes of the deployment's committed plan once it is ready, else None."""
    d = store.get_deployment(name)
    if d is None or d.status.get("phase") != "ready" or d.committed_version is None:
        return None
    return tuple(d.status.get("nodes") or ())


async def _apply_three_and_see_disjoint_nodes(
    ch: grpc.aio.Channel, store: Any, agents: dict[str, FakeAgent]
) -> dict[str, Any]:
    """Apply the three deployments; each gets its own node. Returns deployment -> nodes."""
    plans = plan_pb2_grpc.PlanServiceStub(ch)
    for spec in SPECS.values():
        await plans.ApplyDeployment(plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(spec)))
    await wait_until(
        lambda: all(_ready_on(store, n) for n in SPECS), timeout_s=30, what="all ready"
    )
    where = {n: _ready_on(store, n) for n in SPECS}
    flat = [x for ns in where.values() for x in ns or ()]
    assert sorted(flat) == ["n0", "n1", "n2"], where  # disjoint, all used
    high = store.get_deployment("high")
    assert high is not None and high.status["assigned_gpus"] == 2
    assert high.status["assigned_nodes"] == list(where["high"] or ())
    assert "throughput objective" in high.status["scheduling"]["reason"]
    await wait_until(  # every agent serves one deployment: its own
        lambda: all(
            list(a.applied) == [n for n, ns in where.items() if a.node in (ns or ())]
            for a in agents.values()
        ),
        what="one deployment per agent",
    )
    return where


async def _lose_high_node(
    where: dict[str, Any], store: Any, scheduler: Any, agents: dict[str, FakeAgent]
) -> None:
    """Lose the high-priority deployment's node: the lowest goes Pending."""
    await agents[where["high"][0]].stop()
    await wait_until(
        lambda: (
            (_ready_on(store, "high") or ("?",))[0] == where["low"][0]
            and _ready_on(store, "mid") == where["mid"]
        ),
        timeout_s=30,
        what="high moved onto low's node",
    )
    low = store.get_deployment("low")
    assert low is not None and low.status["phase"] == "pending"
    assert low.committed_version is None  # withdrawn
    assert "held by high (priority 10)" in low.status["message"], low.status
    assert low.status["scheduling"]["resource"] == "gpus"
    assert low.status["scheduling"]["missing"] == 2
    await wait_until(
        lambda: list(agents[where["low"][0]].applied) == ["high"],
        what="low removed from its node, high applied there",
    )
    assert scheduler.schedule is not None
    kinds = [d.kind for d in scheduler.schedule.decisions if d.deployment == "low"]
    assert kinds == ["preempted"]


async def _delete_mid(
    where: dict[str, Any], ctl: Any, store: Any, scheduler: Any, agents: dict[str, FakeAgent]
) -> None:
    """Delete mid: its node goes to low; high is not moved."""
    assert ctl.controller.delete_deployment("mid")
    await wait_until(
        lambda: _ready_on(store, "low") == where["mid"],
        timeout_s=30,
        what="low on mid's freed node",
    )
    assert _ready_on(store, "high") == where["low"]
    assert scheduler.schedule is not None and scheduler.schedule.nodes_moved == 0
    final = {d.deployment: d.kind for d in scheduler.schedule.decisions}
    assert final == {"low": "placed", "mid": "released"}, final
    await wait_until(
        lambda: list(agents[where["mid"][0]].applied) == ["low"],
        what="low applied on mid's node, mid removed",
    )


def test_disjoint_nodes_priority_pending_and_reuse_with_few_moves(tmp_path: Path) -> None:
    async def main() -> None:
        async with start_controller(tmp_path) as ctl:
            agents = {
                a.node: a for a in (FakeAgent(ctl.address, inv) for inv in small_inventories(3))
            }
            for a in agents.values():
                await a.start()
            store = ctl.controller.store
            scheduler = ctl.controller.scheduler
            try:
                async with grpc.aio.insecure_channel(ctl.address) as ch:
                    where = await _apply_three_and_see_disjoint_nodes(ch, store, agents)
                    await _lose_high_node(where, store, scheduler, agents)
                    await _delete_mid(where, ctl, store, scheduler, agents)
            finally:
                for a in agents.values():
                    await a.stop()

    asyncio.run(main())
