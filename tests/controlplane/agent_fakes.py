"""A minimal agent that speaks AgentService over real gRPC, for controller tests.

It follows the rollout protocol of ``proto/mixfleet/v1/agent.proto``: PREPARE -> stage and
ack PREPARED (or FAILED when told to), COMMIT -> switch and ack COMMITTED, ABORT -> drop the
staged part, REMOVE -> drop the applied part; it heartbeats every ``interval_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import zlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from mixfleet.v1 import agent_pb2, agent_pb2_grpc
from support.waits import hang_guard_s

from apis.wire.inventory import inventory_to_proto
from policies.hardware.inventory import NodeInventory

if TYPE_CHECKING:
    from controlplane.server.inprocess import RunningController


@dataclass
class FakeAgent:
    """One node's agent.

    Attributes:
        fail_prepare: reason to ack FAILED with on PREPARE ("" = prepare succeeds).
        silent_prepare: never ack a PREPARE (to make the rollout time out).
        applied: deployment -> (version, part document, expert location JSON) now applied.
        staged: deployment -> (version, part document, expert location JSON) staged by
            PREPARE.
        events: (phase name, deployment, version) of every message received.
    """

    address: str
    inventory: NodeInventory
    credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    interval_s: float = 0.2
    fail_prepare: str = ""
    silent_prepare: bool = False
    applied: dict[str, tuple[int, dict[str, Any], bytes]] = field(default_factory=dict)
    staged: dict[str, tuple[int, dict[str, Any], bytes]] = field(default_factory=dict)
    events: list[tuple[str, str, int]] = field(default_factory=list)
    session_id: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _channel: grpc.aio.Channel | None = None

    @property
    def node(self) -> str:
        return self.inventory.node

    def _stub(self) -> agent_pb2_grpc.AgentServiceAsyncStub:
        if self._channel is None:
            if self.credentials is not None:
                self._channel = grpc.aio.secure_channel(self.address, self.credentials)
            else:
                self._channel = grpc.aio.insecure_channel(self.address)
        return agent_pb2_grpc.AgentServiceStub(self._channel)

    async def register(self) -> agent_pb2.RegisterResponse:
        reply: agent_pb2.RegisterResponse = await self._stub().Register(
            agent_pb2.RegisterRequest(inventory=inventory_to_proto(self.inventory)),
            metadata=self.metadata,
        )
        self.session_id = reply.session_id
        return reply

    async def start(self) -> None:
        """Register, then heartbeat and watch in the background."""
        await self.register()
        self._tasks = [
            asyncio.create_task(self._heartbeats()),
            asyncio.create_task(self._watch()),
        ]

    async def stop(self) -> None:
        """Die: stop heartbeating and close the stream (like a lost node)."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

    async def heartbeat(self) -> agent_pb2.HeartbeatResponse:
        reply: agent_pb2.HeartbeatResponse = await self._stub().Heartbeat(
            agent_pb2.HeartbeatRequest(
                node=self.node,
                session_id=self.session_id,
                state=agent_pb2.NODE_STATE_READY,
                applied={d: v for d, (v, _, _) in self.applied.items()},
            ),
            metadata=self.metadata,
        )
        return reply

    async def _heartbeats(self) -> None:
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await self.heartbeat()
                if reply.reregister:
                    await self.register()
            await asyncio.sleep(self.interval_s)

    async def _watch(self) -> None:
        while True:
            try:
                call = self._stub().WatchAssignments(
                    agent_pb2.WatchAssignmentsRequest(node=self.node, session_id=self.session_id),
                    metadata=self.metadata,
                )
                async for a in call:
                    await self._handle(a)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self.register()
            await asyncio.sleep(self.interval_s)

    async def _ack(
        self, a: agent_pb2.Assignment, state: agent_pb2.AckState.ValueType, reason: str = ""
    ) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub().Ack(
                agent_pb2.AckRequest(
                    node=self.node,
                    session_id=self.session_id,
                    deployment=a.deployment,
                    plan_id=a.plan_id,
                    version=a.version,
                    state=state,
                    reason=reason,
                ),
                metadata=self.metadata,
            )

    async def _handle(self, a: agent_pb2.Assignment) -> None:
        phase = agent_pb2.AssignmentPhase.Name(a.phase).removeprefix("ASSIGNMENT_PHASE_").lower()
        self.events.append((phase, a.deployment, a.version))
        if a.phase == agent_pb2.ASSIGNMENT_PHASE_PREPARE:
            if self.silent_prepare:
                pass
            elif self.fail_prepare:
                await self._ack(a, agent_pb2.ACK_STATE_FAILED, self.fail_prepare)
            else:
                self.staged[a.deployment] = (
                    a.version,
                    json.loads(a.part_json),
                    zlib.decompress(a.expert_location_zlib),
                )
                await self._ack(a, agent_pb2.ACK_STATE_PREPARED)
        elif a.phase == agent_pb2.ASSIGNMENT_PHASE_COMMIT:
            staged = self.staged.pop(a.deployment, None)
            if a.part_json:  # replayed on a new stream: the part comes with it
                self.applied[a.deployment] = (
                    a.version,
                    json.loads(a.part_json),
                    zlib.decompress(a.expert_location_zlib),
                )
            else:  # switch to what this stream's PREPARE staged
                assert staged is not None and staged[0] == a.version, (staged, a.version)
                self.applied[a.deployment] = staged
            await self._ack(a, agent_pb2.ACK_STATE_COMMITTED)
        elif a.phase == agent_pb2.ASSIGNMENT_PHASE_ABORT:
            if (self.staged.get(a.deployment) or (0,))[0] == a.version:
                del self.staged[a.deployment]
        elif a.phase == agent_pb2.ASSIGNMENT_PHASE_REMOVE:
            self.applied.pop(a.deployment, None)
        self.changed.set()


async def wait_until(predicate: Any, timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll ``predicate()`` every 20 ms until it is true (AssertionError after ``timeout_s``,
    at least :data:`support.waits.HANG_GUARD_S`: a hang guard, not a speed claim)."""
    loop = asyncio.get_running_loop()
    timeout_s = hang_guard_s(timeout_s)
    end = loop.time() + timeout_s
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


def small_fleet_doc(nodes: int = 3, gpus_per_node: int = 2) -> dict[str, Any]:
    """A Fleet document of ``nodes`` nodes (H100, H200, A100, ... in turn) with NVLink and
    one 400 Gb/s NIC each."""
    models = ["H100-SXM5-80GB", "H200-SXM-141GB", "A100-SXM4-80GB"]
    return {
        "apiVersion": "mixfleet.io/v1alpha1",
        "kind": "Fleet",
        "metadata": {"name": "small"},
        "spec": {
            "nodes": [
                {
                    "name": f"n{i}",
                    "labels": {"rack": f"r{i % 2}"},
                    "gpus": [{"model": models[i % len(models)], "count": gpus_per_node}],
                    "nvlink": {"domain": f"n{i}", "per_gpu_bidir_gbytes_per_s": 900},
                    "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib0"}],
                }
                for i in range(nodes)
            ]
        },
    }


def small_inventories(nodes: int = 3, gpus_per_node: int = 2) -> list[NodeInventory]:
    """Simulated inventories of :func:`small_fleet_doc`."""
    from policies.hardware.fleet import parse_fleet
    from policies.hardware.inventory import inventory_from_node

    fleet = parse_fleet(small_fleet_doc(nodes, gpus_per_node))
    return [inventory_from_node(n) for n in fleet.nodes]


def controller_in_thread(
    tmp_path: Path,
    inventories: list[NodeInventory],
    setup: Callable[[RunningController], Awaitable[None]] | None = None,
    ready_timeout_s: float = 30.0,
    **controller_options: Any,
) -> Iterator[RunningController]:
    """A real in-process controller with one :class:`FakeAgent` per inventory, on its own
    event loop in a thread (for tests that call the synchronous CLI against it). ``setup``
    runs once the agents are up; the controller is yielded after it, and stopped after the
    ``yield`` returns. Use it as the body of a pytest fixture: ``yield from
    controller_in_thread(...)``. ``controller_options`` go to ``start_controller`` (e.g.
    ``tls=`` and ``token_file=``; the fake agents speak plaintext, so pass no inventories
    with TLS)."""
    from controlplane.server.inprocess import start_controller

    ready = threading.Event()
    stop: list[asyncio.Event] = []
    box: list[RunningController] = []

    async def serve() -> None:
        async with start_controller(tmp_path, **controller_options) as ctl:
            agents = [FakeAgent(ctl.address, inv) for inv in inventories]
            for a in agents:
                await a.start()
            if setup is not None:
                await setup(ctl)
            box.append(ctl)
            stop.append(asyncio.Event())
            ready.set()
            await stop[0].wait()
            for a in agents:
                await a.stop()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(ready_timeout_s)
    yield box[0]
    loop.call_soon_threadsafe(stop[0].set)
    thread.join(30)
