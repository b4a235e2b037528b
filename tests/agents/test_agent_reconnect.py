"""How fast a fleet comes back after its controller restarts: agents retry with jittered
exponential backoff capped at a few seconds (not the 30 s that left nodes looking lost), and
their channel tries to reconnect at least every 2 s."""

from __future__ import annotations

import random

import pytest
from support.waits import HANG_GUARD_S

from agents.agent import AgentSettings
from agents.agent.connection import CHANNEL_OPTIONS, RECONNECT_BACKOFF
from agents.backoff import Backoff
from agents.cli import build_parser


def test_the_default_backoff_is_jittered_and_capped_at_4_s() -> None:
    settings = AgentSettings(controller="h:1", insecure=True)
    assert settings.backoff == RECONNECT_BACKOFF
    b = Backoff(settings.backoff, rand=random.Random(7).random)
    delays = [b.next_delay() for _ in range(60)]  # a minute-long outage and more
    assert max(delays) <= 4.0
    assert min(delays[5:]) >= 2.0  # jitter spreads the fleet over [2, 4] s, never 0
    assert len({round(d, 3) for d in delays[5:]}) > 10


def test_the_channel_reconnects_at_least_every_2_s() -> None:
    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.max_reconnect_backoff_ms"] <= 2_000


def test_the_agent_command_defaults_to_the_same_cap() -> None:
    args = build_parser().parse_args(
        ["run", "--controller", "h:1", "--insecure", "--plan-dir", "p", "--discovery", "static"]
    )
    assert args.max_backoff == 4.0


def test_a_failed_heartbeat_is_retried_after_the_backoff_not_a_whole_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Heartbeat period 2.5 s; the controller is away when the first beat is due and back
    0.2 s later: the agent's next beat waits the backoff (at most 0.2 s), not a period, and
    it is heard from again. The waits are read from what the heartbeat loop asks to sleep,
    not from the clock, so a busy machine cannot change the verdict."""
    import asyncio
    import sys

    from fake_controller import FakeAgentService, start_fake, wait_for
    from test_agent import _free_port, _inventory

    from agents.agent import Agent, session
    from agents.applier import MemoryApplier
    from agents.backoff import BackoffSettings

    waits: list[tuple[float, int]] = []  # the heartbeat loop's sleeps: (s, failures before)
    agents: list[Agent] = []

    class RecordingAsyncio:
        """The session module's ``asyncio``, recording the heartbeat loop's sleeps."""

        def __getattr__(self, name: str) -> object:
            return getattr(asyncio, name)

        def sleep(self, delay: float) -> object:
            if sys._getframe(1).f_code.co_name == "_heartbeat_loop":
                waits.append((delay, agents[0].stats.heartbeat_failures))
            return asyncio.sleep(delay)

    monkeypatch.setattr(session, "asyncio", RecordingAsyncio())

    async def go() -> None:
        port = _free_port()
        svc = FakeAgentService()
        server, _ = await start_fake(svc, port)
        settings = AgentSettings(
            controller=f"127.0.0.1:{port}",
            insecure=True,
            heartbeat_interval_s=2.5,
            heartbeat_jitter=0.0,
            rpc_timeout_s=1.0,
            backoff=BackoffSettings(initial_s=0.1, max_s=0.2, jitter=0.0),
        )
        agent = Agent(settings, _inventory, MemoryApplier("n0"))
        agents.append(agent)
        task = asyncio.create_task(agent.run())
        try:
            await wait_for(lambda: agent.stats.stream_opens == 1, what="session")
            await server.stop(None)  # the controller goes away before the first beat
            await wait_for(lambda: agent.stats.heartbeat_failures >= 1, 30.0, "a failed beat")
            await asyncio.sleep(0.2)
            svc2 = FakeAgentService()
            server, _ = await start_fake(svc2, port)
            await wait_for(lambda: len(svc2.heartbeats) >= 1, 30.0, "a heartbeat")
            after_failure = [s for s, failures in waits if failures >= 1]
            assert waits[0][0] >= 2.5 * 0.9 and after_failure, waits  # a period, then ...
            assert after_failure[0] <= 0.2, waits  # ... the backoff alone, not a period
        finally:
            agent.stop()
            await asyncio.wait_for(task, HANG_GUARD_S)
            await server.stop(None)

    asyncio.run(go())
