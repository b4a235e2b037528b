"""Two-phase rollout end to end over real gRPC, with fake agents (tests/controlplane/
agent_fakes.py) on a real controller and SQLite store."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
from agent_fakes import FakeAgent, small_inventories, wait_until
from mixfleet.v1 import engine_pb2, engine_pb2_grpc, plan_pb2, plan_pb2_grpc

from apis.wire.deployment import spec_to_proto
from controlplane.server.controller import ControllerSettings
from controlplane.server.inprocess import FAST, RunningController, start_controller
from policies.spec.build import DeploymentSpec, WorkloadSpec

SPEC = DeploymentSpec(
    name="mx",
    model="mixtral-8x7b",
    policy="greedy",
    workload=WorkloadSpec(tokens_per_gpu=32, context_len=2048),
    prepare_timeout_s=5.0,
)


@dataclass
class World:
    ctl: RunningController
    agents: list[FakeAgent]
    plans: plan_pb2_grpc.PlanServiceAsyncStub
    engine: engine_pb2_grpc.EngineServiceAsyncStub

    def states(self) -> dict[int, str]:
        return {p.version: p.state for p in self.ctl.controller.store.list_plans("mx")}

    def committed(self) -> int | None:
        d = self.ctl.controller.store.get_deployment("mx")
        return d.committed_version if d else None

    async def apply(self, spec: DeploymentSpec = SPEC) -> None:
        await self.plans.ApplyDeployment(plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(spec)))


@asynccontextmanager
async def world(
    tmp_path: Path, nodes: int = 3, port: int = 0, settings: ControllerSettings = FAST
) -> AsyncIterator[World]:
    async with start_controller(tmp_path, port=port, settings=settings) as ctl:
        agents = [FakeAgent(ctl.address, inv) for inv in small_inventories(nodes)]
        for a in agents:
            await a.start()
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            try:
                yield World(
                    ctl,
                    agents,
                    plan_pb2_grpc.PlanServiceStub(ch),
                    engine_pb2_grpc.EngineServiceStub(ch),
                )
            finally:
                for a in agents:
                    await a.stop()


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_deploy_commits_on_every_agent_and_engines_get_the_routing(tmp_path: Path) -> None:
    async def main() -> None:
        async with world(tmp_path) as w:
            await w.apply()
            routing_stream = w.engine.WatchRouting(
                engine_pb2.GetRoutingRequest(deployment="mx", format=engine_pb2.ROUTING_FORMAT_VLLM)
            )
            await wait_until(
                lambda: all(a.applied.get("mx", (0,))[0] == 1 for a in w.agents),
                what="v1 applied everywhere",
            )
            assert w.states() == {1: "committed"}
            for a in w.agents:
                assert [e[0] for e in a.events] == ["prepare", "commit"]
                part = a.applied["mx"][1]
                assert part["node"] == a.node and part["world_size"] == 6
                assert [g["gpu"] for g in part["gpus"]] == [f"{a.node}/gpu0", f"{a.node}/gpu1"]
                location = a.applied["mx"][2]
                assert hashlib.sha256(location).hexdigest() == part["expert_location_sha256"]
                assert len(json.loads(location)["physical_to_logical_map"]) == 32
            ranks = sorted(g["rank"] for a in w.agents for g in a.applied["mx"][1]["gpus"])
            assert ranks == list(range(6))
            await wait_until(
                lambda: (
                    set(w.ctl.controller.acks_of("mx", 1).values()) == {"committed"}
                    and len(w.ctl.controller.acks_of("mx", 1)) == 3
                ),
                what="COMMITTED acks",
            )
            record = await w.plans.GetPlan(plan_pb2.GetPlanRequest(deployment="mx"))
            assert record.version == 1 and dict(record.acks) == {
                "n0": "committed",
                "n1": "committed",
                "n2": "committed",
            }
            assert json.loads(record.plan_json)["version"] == 1
            routing = await w.engine.GetRouting(
                engine_pb2.GetRoutingRequest(deployment="mx", format=engine_pb2.ROUTING_FORMAT_VLLM)
            )
            assert routing.version == 1 and routing.world_size == 6
            assert routing.slots_per_rank == 2  # (8 experts + 4 redundant) / 6 GPUs
            assert len(routing.layers) == 32 and len(routing.dp_weights) == 6
            doc = json.loads(routing.engine_json)
            assert len(doc["physical_to_logical_map"]) == 32
            assert len(doc["physical_to_logical_map"][0]) == 12
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # SGLang cannot load Mixtral's
                await w.engine.GetRouting(engine_pb2.GetRoutingRequest(deployment="mx"))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cannot load an expert placement" in str(refused.value.details())
            first = await anext(aiter(routing_stream))
            assert first.version == 1
            routing_stream.cancel()
            d = await w.plans.GetDeployment(plan_pb2.GetDeploymentRequest(name="mx"))
            assert d.status.phase == plan_pb2.DEPLOYMENT_PHASE_READY
            metric = w.ctl.controller.metrics.registry.get_sample_value
            assert (
                metric("mixfleet_rollouts_total", {"deployment": "mx", "outcome": "committed"}) == 1
            )
            assert metric("mixfleet_committed_plan_version", {"deployment": "mx"}) == 1
            assert (
                metric("mixfleet_solve_seconds_count", {"deployment": "mx", "policy": "greedy"})
                == 1
            )
            assert metric("mixfleet_healthy_nodes") == 3
            rpc = {"method": "/mixfleet.v1.AgentService/Register", "code": "OK"}
            assert metric("mixfleet_rpc_seconds_count", rpc) == 3
            assert d.status.committed_version == 1 and sorted(d.status.nodes) == ["n0", "n1", "n2"]

    run(main())


def test_failed_prepare_aborts_and_keeps_the_committed_plan(tmp_path: Path) -> None:
    async def main() -> None:
        async with world(tmp_path) as w:
            await w.apply()
            await wait_until(lambda: w.committed() == 1, what="v1")
            await wait_until(lambda: all("mx" in a.applied for a in w.agents), what="applied")
            w.agents[1].fail_prepare = "disk full"
            changed = replace(SPEC, workload=WorkloadSpec(tokens_per_gpu=64, context_len=2048))
            await w.apply(changed)
            await wait_until(lambda: w.states().get(2) == "aborted", what="v2 aborted")
            record = await w.plans.GetPlan(plan_pb2.GetPlanRequest(deployment="mx", version=2))
            assert "node n1 failed to prepare: disk full" in record.reason
            assert record.acks["n1"] == "failed: disk full"
            assert w.committed() == 1
            await wait_until(
                lambda: all(("abort", "mx", 2) in a.events for a in w.agents),
                what="ABORT everywhere",
            )
            for a in w.agents:
                assert a.applied["mx"][0] == 1 and "mx" not in a.staged
            routing = await w.engine.GetRouting(
                engine_pb2.GetRoutingRequest(deployment="mx", format=engine_pb2.ROUTING_FORMAT_VLLM)
            )
            assert routing.version == 1
            w.agents[1].fail_prepare = ""  # fixed: the retry (a new, higher version) commits
            await wait_until(lambda: (w.committed() or 0) > 2, what="retry committed")
            assert all(v > 2 for v, s in w.states().items() if s == "committed")
            assert w.states()[1] == "superseded"

    run(main())


def test_prepare_timeout_aborts(tmp_path: Path) -> None:
    async def main() -> None:
        async with world(tmp_path) as w:
            w.agents[2].silent_prepare = True
            fast = replace(SPEC, prepare_timeout_s=0.5)
            await w.apply(fast)
            await wait_until(lambda: w.states().get(1) == "aborted", what="v1 timed out")
            record = await w.plans.GetPlan(plan_pb2.GetPlanRequest(deployment="mx", version=1))
            assert "no ack from n2" in record.reason
            assert w.committed() is None
            assert all("mx" not in a.applied for a in w.agents)

    run(main())


def test_lost_agent_replans_without_its_gpus_and_reconnect_gets_committed(tmp_path: Path) -> None:
    async def main() -> None:
        async with world(tmp_path) as w:
            await w.apply()
            await wait_until(lambda: w.committed() == 1, what="v1")
            await w.agents[2].stop()  # n2 dies
            await wait_until(lambda: w.committed() == 2, timeout_s=20, what="re-plan committed")
            record = await w.plans.GetPlan(plan_pb2.GetPlanRequest(deployment="mx"))
            assert record.reason == "node n2 lost" and sorted(record.nodes) == ["n0", "n1"]
            plan = json.loads(record.plan_json)
            assert {g["node"] for g in plan["gpus"]} == {"n0", "n1"}
            nodes = await w.plans.ListNodes(plan_pb2.ListNodesRequest())
            health = {n.inventory.node: n.health for n in nodes.nodes}
            assert health["n2"] == plan_pb2.NODE_HEALTH_LOST
            diff = await w.plans.DiffPlans(plan_pb2.DiffPlansRequest(deployment="mx"))
            assert (diff.from_version, diff.to_version) == (1, 2)
            assert list(diff.gpus_removed) == ["n2/gpu0", "n2/gpu1"]

            # n0 restarts with no memory: on reconnect it is handed the committed plan.
            fresh = FakeAgent(w.ctl.address, w.agents[0].inventory)
            await w.agents[0].stop()
            await fresh.start()
            w.agents[0] = fresh
            await wait_until(lambda: fresh.applied.get("mx", (0,))[0] == 2, what="snapshot")
            assert fresh.events[0] == ("commit", "mx", 2)

    run(main())


def test_controller_restart_mid_rollout_loses_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        ctl_cm = start_controller(tmp_path)
        ctl = await ctl_cm.__aenter__()
        port = ctl.port
        agents = [FakeAgent(ctl.address, inv) for inv in small_inventories()]
        agents[2].silent_prepare = True
        for a in agents:
            await a.start()
        try:
            async with grpc.aio.insecure_channel(ctl.address) as ch:
                plans = plan_pb2_grpc.PlanServiceStub(ch)
                await plans.ApplyDeployment(
                    plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(SPEC))
                )
            store = ctl.controller.store
            await wait_until(
                lambda: len(store.acks("mx", 1)) == 2 if store.list_plans("mx") else False,
                what="two prepared",
            )
            assert store.list_plans("mx")[0].state == "preparing"
            await ctl.crash()  # no clean shutdown of the store
            await ctl_cm.__aexit__(None, None, None)

            agents[2].silent_prepare = False  # n2 will answer the re-sent PREPARE
            async with start_controller(tmp_path, port=port) as again:
                s2 = again.controller.store
                assert s2.list_plans("mx")[0].state in ("preparing", "committed")
                assert {a.node for a in s2.acks("mx", 1)} >= {"n0", "n1"}
                await wait_until(
                    lambda: all(a.applied.get("mx", (0,))[0] == 1 for a in agents),
                    what="v1 committed after restart",
                )
                d = s2.get_deployment("mx")
                assert d is not None and d.committed_version == 1
                assert [p.version for p in s2.list_plans("mx")] == [1]
                assert {n.name for n in s2.list_nodes()} == {"n0", "n1", "n2"}
        finally:
            for a in agents:
                await a.stop()

    run(main())


def test_delete_removes_parts_from_agents(tmp_path: Path) -> None:
    async def main() -> None:
        async with world(tmp_path, nodes=2) as w:
            small = replace(SPEC, model="qwen3-30b-a3b")
            await w.apply(small)
            await wait_until(lambda: all("mx" in a.applied for a in w.agents), what="applied")
            reply = await w.plans.DeleteDeployment(plan_pb2.DeleteDeploymentRequest(name="mx"))
            assert reply.deleted
            await wait_until(lambda: all("mx" not in a.applied for a in w.agents), what="removed")
            history = await w.plans.ListPlans(plan_pb2.ListPlansRequest(deployment="mx"))
            assert [p.state for p in history.plans] == [plan_pb2.PLAN_STATE_SUPERSEDED]

    run(main())
