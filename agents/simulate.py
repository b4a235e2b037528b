"""Simulated agents: one :class:`~agents.agent.Agent` per node of a Fleet, in one process.

For demos, end-to-end tests and the control-plane benchmark. Every simulated inventory is
marked ``simulated`` (the controller and ``mixfleetctl nodes list`` show it) and every log
line carries ``simulated: true``. Agents share a few gRPC channels (one per
``agents_per_channel`` agents) instead of opening one connection each.

Plans go to ``<plan_dir>/<node>/`` through the disk applier when a plan directory is given,
else they are only checked and kept in memory.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from grpc import aio

from agents.agent import Agent, AgentSettings, AssignmentEvent, make_channel
from agents.applier import Applier, ApplierSettings, MemoryApplier, PlanApplier
from policies.hardware.fleet import Fleet
from policies.hardware.inventory import GpuHealth, NodeInventory, inventory_from_node


class SimulatedFleet:
    """Simulated agents for every node of ``fleet``.

    Args:
        fleet: nodes to simulate.
        settings: controller address and credentials (shared by all agents).
        plan_dir: write plans under ``plan_dir/<node>``; None = keep them in memory.
        hook: applier hook command (argv), run per node; None = none.
        agents_per_channel: agents multiplexed on one gRPC connection.
        observer: called after every handled assignment of any agent.
        seed: seed of the agents' jitter (reproducible runs).
        address: host name or IP address every simulated node advertises for its engines
            (``--advertise-address``; a loopback demo says ``127.0.0.1``); ``""`` = each
            node's name.
    """

    def __init__(
        self,
        fleet: Fleet,
        settings: AgentSettings,
        *,
        plan_dir: Path | None = None,
        hook: tuple[str, ...] | None = None,
        agents_per_channel: int = 100,
        observer: Callable[[AssignmentEvent], None] | None = None,
        seed: int = 0,
        address: str = "",
    ) -> None:
        self.fleet = fleet
        self.settings = settings
        self.plan_dir = plan_dir
        self.hook = hook
        self.agents_per_channel = max(1, agents_per_channel)
        self.observer = observer
        self._rng = random.Random(seed)
        self.inventories: dict[str, NodeInventory] = {
            n.name: replace(inventory_from_node(n, simulated=True), address=address)
            for n in fleet.nodes
        }
        self.appliers: dict[str, Applier] = {}
        self.agents: dict[str, Agent] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.errors: dict[str, BaseException] = {}
        self._channels: list[aio.Channel] = []

    @property
    def channels(self) -> int:
        """gRPC connections open to the controller."""
        return len(self._channels)

    def _applier(self, node: str) -> Applier:
        if node not in self.appliers:
            if self.plan_dir is None:
                self.appliers[node] = MemoryApplier(node)
            else:
                ap = PlanApplier(
                    ApplierSettings(plan_dir=self.plan_dir / node, node=node, hook=self.hook)
                )
                ap.recover()
                self.appliers[node] = ap
        return self.appliers[node]

    def _channel(self, k: int) -> aio.Channel:
        while len(self._channels) <= k // self.agents_per_channel:
            # A channel of its own subchannel pool: its own TCP connection. Channels with equal
            # arguments otherwise share one connection, and every simulated agent would
            # multiplex on a single HTTP/2 connection (flow control, stream limits) as no
            # real fleet does.
            self._channels.append(make_channel(self.settings, own_connection=True))
        return self._channels[k // self.agents_per_channel]

    def start(self) -> None:
        """Start every agent at once (call inside a running event loop)."""
        for k, node in enumerate(self.inventories):
            self._start(node, k)

    async def start_over(self, ramp_s: float) -> None:
        """Start the agents evenly over ``ramp_s`` seconds, like nodes booting over time
        rather than all registering in the same instant."""
        nodes = list(self.inventories)
        if ramp_s <= 0 or len(nodes) < 2:
            self.start()
            return
        step = ramp_s / len(nodes)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for k, node in enumerate(nodes):
            self._start(node, k)
            delay = t0 + (k + 1) * step - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)

    def _start(self, node: str, k: int) -> None:
        agent = Agent(
            self.settings,
            self._discover_for(node),
            self._applier(node),
            channel=self._channel(k),
            rand=random.Random(self._rng.random()).random,
            observer=self.observer,
        )
        self.agents[node] = agent
        task = asyncio.create_task(agent.run(), name=f"sim-agent-{node}")
        task.add_done_callback(self._on_done(node))
        self.tasks[node] = task

    def _discover_for(self, node: str) -> Callable[[], NodeInventory]:
        def discover() -> NodeInventory:
            return self.inventories[node]

        return discover

    def _on_done(self, node: str) -> Callable[[asyncio.Task[None]], None]:
        def done(task: asyncio.Task[None]) -> None:
            if not task.cancelled():
                exc = task.exception()
                if exc is not None:
                    self.errors[node] = exc

        return done

    async def kill(self, node: str) -> None:
        """The node dies: its agent stops without a word (heartbeats and stream end)."""
        task = self.tasks.pop(node, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def revive(self, node: str) -> None:
        """Start a fresh agent for a killed node (its plan files, if on disk, survive)."""
        if node in self.tasks:
            return
        self._start(node, list(self.inventories).index(node))

    def set_gpu_health(self, node: str, index: int, health: GpuHealth) -> None:
        """Inject a GPU health change; it travels with the node's next heartbeat."""
        inv = self.inventories[node]
        gpus = tuple(replace(g, health=health) if g.index == index else g for g in inv.gpus)
        self.inventories[node] = replace(inv, gpus=gpus)
        if node in self.agents:
            self.agents[node].update_inventory(self.inventories[node])

    async def stop(self) -> None:
        """Stop every agent and close the channels."""
        for a in self.agents.values():
            a.stop()
        tasks = list(self.tasks.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=5.0)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()
        for ch in self._channels:
            await ch.close(None)
        self._channels.clear()

    async def wait(self) -> None:
        """Wait until every agent task has ended (all stopped or refused)."""
        while self.tasks:
            await asyncio.wait(list(self.tasks.values()))
            self.tasks = {n: t for n, t in self.tasks.items() if not t.done()}
