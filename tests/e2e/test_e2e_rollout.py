"""Deploy -> committed on every agent; an agent dies -> re-plan without its GPUs; it comes
back -> planned on again. Real controller, real agents, real gRPC on loopback."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from e2e_support import Client, agent_settings, eventually, fleet, read_env, read_part, spec
from grpc import aio
from mixfleet.v1 import plan_pb2

from agents.simulate import SimulatedFleet
from controlplane.server.inprocess import start_controller


def test_deploy_commits_on_all_agents_then_replans_around_a_dead_node(tmp_path: Path) -> None:
    plan_dir = tmp_path / "plans"

    async def go() -> None:
        async with start_controller(tmp_path / "ctl") as ctl:
            sim = SimulatedFleet(fleet(3, 2), agent_settings(ctl.address), plan_dir=plan_dir)
            sim.start()
            channel = aio.insecure_channel(ctl.address)
            c = Client(channel)
            try:
                await eventually(lambda: _count_ready(c, 3), what="3 nodes registered and ready")
                nodes = await c.nodes()
                assert all(n.inventory.simulated for n in nodes.values())

                # ---- deploy: every node of the plan commits version 1, files on disk
                await c.apply(spec())
                assert await c.wait_committed("mixtral", 1) == 1
                record = await c.plan("mixtral")
                plan = json.loads(record.plan_json)
                assert sorted(record.nodes) == ["n0", "n1", "n2"]
                assert plan_pb2.PlanState.Name(record.state) == "PLAN_STATE_COMMITTED"

                async def all_applied(version: int, names: list[str]) -> bool:
                    return all(sim.appliers[n].applied().get("mixtral") == version for n in names)

                await eventually(lambda: all_applied(1, ["n0", "n1", "n2"]), what="v1 applied")
                for rank, g in enumerate(plan["gpus"]):
                    part = read_part(plan_dir, g["node"], "mixtral")
                    assert part is not None and part["plan_id"] == record.plan_id
                    env = read_env(plan_dir, g["node"], "mixtral", int(g["gpu"][-1]))
                    assert env["MIXFLEET_PLAN_VERSION"] == "1"
                    assert env["MIXFLEET_RANK"] == str(rank)
                    assert float(env["MIXFLEET_ATTENTION_SHARE"]) == pytest.approx(
                        g["attention_share"], abs=1e-8
                    )
                # Heartbeats carry what each agent applied.
                await eventually(
                    lambda: _applied_everywhere(c, {"n0": 1, "n1": 1, "n2": 1}),
                    what="applied versions in heartbeats",
                )

                # ---- n2 dies: the controller notices and commits a plan without it
                await sim.kill("n2")
                v2 = await c.wait_committed("mixtral", 2)
                record2 = await c.plan("mixtral")
                plan2 = json.loads(record2.plan_json)
                assert sorted(record2.nodes) == ["n0", "n1"]
                assert all(not g["gpu"].startswith("n2/") for g in plan2["gpus"])
                assert "n2" in record2.reason
                assert (await c.nodes())["n2"].health == plan_pb2.NODE_HEALTH_LOST
                await eventually(lambda: all_applied(v2, ["n0", "n1"]), what="v2 applied")
                # The dead node's files were not touched (it could not be told).
                part_n2 = read_part(plan_dir, "n2", "mixtral")
                assert part_n2 is not None and part_n2["version"] == 1

                # ---- n2 comes back: it rejoins and is planned on again
                sim.revive("n2")
                v3 = await c.wait_committed("mixtral", v2 + 1)
                assert sorted((await c.plan("mixtral")).nodes) == ["n0", "n1", "n2"]
                await eventually(
                    lambda: all_applied(v3, ["n0", "n1", "n2"]), what="v3 applied everywhere"
                )
                history = await c.history("mixtral")
                states = {p.version: plan_pb2.PlanState.Name(p.state) for p in history}
                assert states[v3] == "PLAN_STATE_COMMITTED"
                assert states[1] == states[v2] == "PLAN_STATE_SUPERSEDED"
                assert sim.errors == {}
            finally:
                await sim.stop()
                await channel.close(None)

    asyncio.run(go())


async def _count_ready(c: Client, n: int) -> bool:
    nodes = await c.nodes()
    return sum(1 for x in nodes.values() if x.health == plan_pb2.NODE_HEALTH_READY) == n


async def _applied_everywhere(c: Client, want: dict[str, int]) -> bool:
    nodes = await c.nodes()
    return all(dict(nodes[n].applied).get("mixtral") == v for n, v in want.items())
