"""Crash safety of the real controller process (``mixfleetctl controller run``): SIGKILL at
several points of a rollout with simulated agents, restart on the same store, and check that
every agent converges on one committed version and the store is whole (``store check``).
Also: a second controller on the same store is refused, and agents that backed off while
the controller was down are not declared lost after its restart."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from e2e_support import Client, agent_settings, eventually, fleet, read_part, spec
from grpc import aio
from mixfleet.v1 import plan_pb2

from agents.backoff import BackoffSettings
from agents.simulate import SimulatedFleet
from controlplane.server.inprocess import FAST, start_controller
from controlplane.store.sqlite.check import check_store

REPO = Path(__file__).resolve().parents[2]
#: Prepare takes a while (an engine checking its part), so the rollout can be caught open.
SLOW_PREPARE = ("sh", "-c", 'if [ "$MIXFLEET_HOOK_PHASE" = prepare ]; then sleep 1; fi')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Controller:
    """``mixfleetctl controller run`` in a child process on a fixed port."""

    def __init__(self, db: Path, port: int, log: Path) -> None:
        self.db, self.port, self.log = db, port, log
        self.proc: subprocess.Popen[str] | None = None

    def command(self, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "controlplane.cli",
            "controller",
            "run",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--store",
            f"sqlite:{self.db}",
            "--insecure",
            "--heartbeat-interval",
            "0.2",
            "--node-lost-after",
            "3",
            "--log-level",
            "warning",
            *extra,
        ]

    async def start(self, *extra: str) -> None:
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                self.command(*extra), stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO
            )
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 30)
        assert line.startswith("listening on"), (line, self.log.read_text()[-2000:])

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


async def _state(c: Client, name: str, version: int) -> int:
    for p in await c.history(name):
        if p.version == version:
            return int(p.state)
    return 0


def test_sigkill_at_each_point_of_a_rollout_converges(tmp_path: Path) -> None:
    plan_dir = tmp_path / "plans"
    port = _free_port()
    ctl = Controller(tmp_path / "state.db", port, tmp_path / "controller.log")
    address = f"127.0.0.1:{port}"

    async def restart(c: Client) -> None:
        ctl.kill9()
        await ctl.start()
        await eventually(lambda: _registered(c, 3), what="agents back")

    async def go() -> None:
        await ctl.start("--store-new")
        sim = SimulatedFleet(
            fleet(3, 2), agent_settings(address), plan_dir=plan_dir, hook=SLOW_PREPARE
        )
        sim.start()
        channel = aio.insecure_channel(address)
        c = Client(channel)
        try:
            await eventually(lambda: _registered(c, 3), what="3 nodes")
            # 1. Killed right after the apply returned (the solve has not been stored).
            await c.apply(spec())
            await restart(c)
            # 2. Killed while the agents prepare version 1.
            preparing = plan_pb2.PLAN_STATE_PREPARING
            await eventually(lambda: _is(c, "mixtral", 1, preparing), what="v1 preparing")
            await restart(c)
            await c.wait_committed("mixtral", 1, timeout_s=20)
            # 3. A spec change; killed right after its commit point.
            await c.apply(spec(tokens_per_gpu=32))
            committed = plan_pb2.PLAN_STATE_COMMITTED
            await eventually(lambda: _is(c, "mixtral", 2, committed, 0.01), what="v2 commit")
            await restart(c)

            final = await c.wait_committed("mixtral", 2, timeout_s=20)

            async def converged() -> bool:
                return all(a.applied().get("mixtral") == final for a in sim.appliers.values())

            await eventually(converged, what=f"every agent on v{final}")
            record = await c.plan("mixtral")
            for node in ("n0", "n1", "n2"):
                part = read_part(plan_dir, node, "mixtral")
                assert part is not None and (part["plan_id"], part["version"]) == (
                    record.plan_id,
                    final,
                )
                assert list((plan_dir / node / ".staging").iterdir()) == []
            history = {p.version: p.state for p in await c.history("mixtral")}
            assert sorted(history) == list(range(1, max(history) + 1))  # versions only grow
            assert [v for v, s in history.items() if s == committed] == [final]
            assert sim.errors == {}
        finally:
            await sim.stop()
            await channel.close(None)
            ctl.stop()
        report = check_store(tmp_path / "state.db")
        assert report.ok, report.problems

    asyncio.run(go())


def test_a_second_controller_on_the_same_store_is_refused(tmp_path: Path) -> None:
    first = Controller(tmp_path / "state.db", _free_port(), tmp_path / "first.log")
    second = Controller(tmp_path / "state.db", _free_port(), tmp_path / "second.log")

    async def go() -> None:
        await first.start("--store-new")
        try:
            assert first.proc is not None
            proc = subprocess.run(
                second.command(), capture_output=True, text=True, cwd=REPO, timeout=60
            )
            assert proc.returncode != 0
            assert f"in use by the controller pid {first.proc.pid} on " in proc.stderr
            assert "Only one controller may write a store" in proc.stderr
            assert first.proc.poll() is None  # the first one is untouched
        finally:
            first.stop()

    asyncio.run(go())


def test_agents_that_backed_off_are_not_declared_lost_after_a_restart(tmp_path: Path) -> None:
    """Agents back off while the controller is away (deterministic 1, 2, 4 s here): the first
    attempt after a 4 s outage comes ~3 s after the restart, twice ``node_lost_after_s``."""
    settings = replace(FAST, node_lost_after_s=1.5, restart_grace_max_s=30.0)
    backoff = BackoffSettings(initial_s=1.0, max_s=4.0, multiplier=2.0, jitter=0.0)

    async def go() -> None:
        async with start_controller(tmp_path, settings=settings) as ctl:
            port = ctl.port
            sim = SimulatedFleet(fleet(3, 1), replace(agent_settings(ctl.address), backoff=backoff))
            sim.start()
            channel = aio.insecure_channel(ctl.address)
            await eventually(lambda: _registered(Client(channel), 3), what="3 nodes")
            await channel.close(None)
            await ctl.crash()
        await asyncio.sleep(4.0)
        beats = {n: a.stats.heartbeats for n, a in sim.agents.items()}
        async with start_controller(tmp_path, settings=settings, port=port) as ctl2:
            c = ctl2.controller
            t0 = time.monotonic()

            def back() -> bool:
                return all(a.stats.heartbeats > beats[n] + 2 for n, a in sim.agents.items())

            while not back() and time.monotonic() - t0 < 120:  # a hang guard only
                assert not c.nodes.lost, "a node that only backed off was declared lost"
                await asyncio.sleep(0.05)
            assert back() and not c.nodes.lost
            # the scenario held: they took longer than a node may stay silent (a lower
            # bound, which a slower machine only makes truer)
            assert time.monotonic() - t0 > settings.node_lost_after_s
            await sim.stop()

    asyncio.run(go())


async def _registered(c: Client, n: int) -> bool:
    return len(await c.nodes()) == n


async def _is(c: Client, name: str, version: int, state: int, every_s: float = 0.0) -> bool:
    if every_s:
        await asyncio.sleep(every_s)
    return await _state(c, name, version) == state
