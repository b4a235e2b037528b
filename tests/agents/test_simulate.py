"""Simulated fleets: one agent per Fleet node, shared channels, kill and revive."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fake_controller import FakeAgentService, start_fake, wait_for

from agents.agent import AgentSettings
from agents.backoff import BackoffSettings
from agents.discovery.static import load_fleet_file
from agents.simulate import SimulatedFleet

REPO = Path(__file__).resolve().parents[2]


def test_simulated_fleet_registers_every_node_marked_simulated() -> None:
    fleet = load_fleet_file(REPO / "examples" / "fleets" / "mixed-24.yaml")

    async def go() -> None:
        svc = FakeAgentService(heartbeat_interval_s=0.05)
        server, port = await start_fake(svc)
        settings = AgentSettings(
            controller=f"127.0.0.1:{port}",
            insecure=True,
            backoff=BackoffSettings(initial_s=0.02, max_s=0.1),
        )
        sim = SimulatedFleet(fleet, settings, agents_per_channel=2)
        sim.start()
        try:
            await wait_for(lambda: len(svc.registers) == 3, what="3 registrations")
            assert sorted(r.inventory.node for r in svc.registers) == ["a100-0", "h100-0", "h200-0"]
            assert all(r.inventory.simulated for r in svc.registers)
            assert sim.channels == 2  # 3 agents, 2 per channel

            await sim.kill("h100-0")
            await asyncio.sleep(0.2)
            before = sum(1 for h in svc.heartbeats if h.node == "h100-0")
            await asyncio.sleep(0.3)
            assert sum(1 for h in svc.heartbeats if h.node == "h100-0") == before  # silent

            sim.revive("h100-0")
            await wait_for(lambda: len(svc.registers) == 4, what="re-registration")
            assert sim.errors == {}
        finally:
            await sim.stop()
            await server.stop(None)

    asyncio.run(go())
