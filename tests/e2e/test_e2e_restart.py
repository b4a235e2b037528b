"""The controller is killed mid-rollout and restarted on the same SQLite file: agents
reconnect, the rollout is finished (or aborted and redone), and the end state is
consistent - one committed version, served by every agent, nothing committed lost."""

from __future__ import annotations

import asyncio
from pathlib import Path

from e2e_support import Client, agent_settings, eventually, fleet, read_part, spec
from grpc import aio
from mixfleet.v1 import plan_pb2

from agents.simulate import SimulatedFleet
from controlplane.server.inprocess import start_controller

#: Prepare takes a while (an engine checking its part), so the rollout can be caught open.
SLOW_PREPARE = ("sh", "-c", 'if [ "$MIXFLEET_HOOK_PHASE" = prepare ]; then sleep 1; fi')


def test_controller_killed_mid_rollout_restarts_to_a_consistent_state(tmp_path: Path) -> None:
    plan_dir = tmp_path / "plans"
    ctl_dir = tmp_path / "ctl"

    async def go() -> None:
        sim: SimulatedFleet | None = None
        async with start_controller(ctl_dir) as ctl:
            port = ctl.port
            sim = SimulatedFleet(
                fleet(3, 2), agent_settings(ctl.address), plan_dir=plan_dir, hook=SLOW_PREPARE
            )
            sim.start()
            channel = aio.insecure_channel(ctl.address)
            c = Client(channel)
            await eventually(lambda: _registered(c, 3), what="3 nodes")
            await c.apply(spec())
            await c.wait_committed("mixtral", 1)
            v1 = await c.plan("mixtral", 1)

            # A spec change starts version 2; kill the controller while agents prepare it.
            await c.apply(spec(tokens_per_gpu=32))

            async def preparing() -> bool:
                return any(
                    p.version == 2 and p.state == plan_pb2.PLAN_STATE_PREPARING
                    for p in await c.history("mixtral")
                )

            await eventually(preparing, what="v2 preparing")
            await channel.close(None)
            await ctl.crash()

        assert sim is not None
        # While the controller is down, agents keep serving version 1.
        await asyncio.sleep(0.5)
        assert all(a.applied().get("mixtral") == 1 for a in sim.appliers.values())

        async with start_controller(ctl_dir, port=port) as ctl2:
            channel = aio.insecure_channel(ctl2.address)
            c = Client(channel)
            try:
                d = await c.deployment("mixtral")
                assert d.generation == 2  # the spec change survived
                assert d.status.committed_version >= 1  # so did the committed plan
                final = await c.wait_committed("mixtral", 2, timeout_s=30)

                async def converged() -> bool:
                    return all(a.applied().get("mixtral") == final for a in sim.appliers.values())

                await eventually(converged, what=f"every agent on v{final}")
                record = await c.plan("mixtral")
                assert record.version == final
                for node in ("n0", "n1", "n2"):
                    part = read_part(plan_dir, node, "mixtral")
                    assert part is not None
                    assert (part["plan_id"], part["version"]) == (record.plan_id, final)

                history = {p.version: p for p in await c.history("mixtral")}
                assert sorted(history) == list(range(1, max(history) + 1))  # no gaps
                assert history[1].plan_id == v1.plan_id
                committed = [
                    v for v, p in history.items() if p.state == plan_pb2.PLAN_STATE_COMMITTED
                ]
                assert committed == [final]
                for v, p in history.items():
                    if v != final:
                        assert p.state in (
                            plan_pb2.PLAN_STATE_SUPERSEDED,
                            plan_pb2.PLAN_STATE_ABORTED,
                        ), (v, plan_pb2.PlanState.Name(p.state))
                assert history[1].state == plan_pb2.PLAN_STATE_SUPERSEDED
                assert sorted(await c.nodes()) == ["n0", "n1", "n2"]
                assert sim.errors == {}
                # Every agent reconnected its assignment stream to the new process.
                assert all(a.stats.stream_opens >= 2 for a in sim.agents.values())
            finally:
                await sim.stop()
                await channel.close(None)

    asyncio.run(go())


async def _registered(c: Client, n: int) -> bool:
    return len(await c.nodes()) == n
