"""Standalone mode (SQLite store): the controller is the one decision maker. One plan per
spec generation, committed on the agents; a spec change makes exactly one new plan, which
replaces it; the deployment's status and the plan history name the committed plan."""

from __future__ import annotations

import asyncio
from pathlib import Path

from e2e_support import Client, agent_settings, eventually, fleet, spec
from grpc import aio
from mixfleet.v1 import plan_pb2

from agents.simulate import SimulatedFleet
from controlplane.server.inprocess import start_controller


def _states(history: list[plan_pb2.PlanRecord]) -> list[tuple[int, str]]:
    return sorted((p.version, plan_pb2.PlanState.Name(p.state)) for p in history)


def test_one_plan_per_generation_and_a_spec_change_replaces_it(tmp_path: Path) -> None:
    async def go() -> None:
        async with start_controller(tmp_path / "ctl") as ctl:
            assert ctl.controller.store.plan_author == "controller"
            sim = SimulatedFleet(fleet(2, 2), agent_settings(ctl.address))
            sim.start()
            c = Client(aio.insecure_channel(ctl.address))
            try:

                async def registered() -> bool:
                    return len(await c.nodes()) == 2

                await eventually(registered, what="both agents registered")
                await c.apply(spec())
                assert await c.wait_committed("mixtral", 1) == 1
                await asyncio.sleep(0.5)  # a few more ticks: no second plan appears
                assert _states(await c.history("mixtral")) == [(1, "PLAN_STATE_COMMITTED")]

                await c.apply(spec(tokens_per_gpu=32))
                assert await c.wait_committed("mixtral", 2) == 2
                await asyncio.sleep(0.5)
                assert _states(await c.history("mixtral")) == [
                    (1, "PLAN_STATE_SUPERSEDED"),
                    (2, "PLAN_STATE_COMMITTED"),
                ]
                d = await c.deployment("mixtral")
                assert d.status.committed_version == 2
                assert (await c.plan("mixtral")).version == 2
            finally:
                await sim.stop()

    asyncio.run(go())
