"""The agent's side of the AgentService protocol, against a scripted controller."""

from __future__ import annotations

import asyncio
import json
import socket
import zlib
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from agent_builders import small_fleet, small_plan
from fake_controller import FakeAgentService, start_fake, wait_for
from mixfleet.v1 import agent_pb2
from support.waits import HANG_GUARD_S

from agents.agent import Agent, AgentFatalError, AgentSettings, AssignmentEvent
from agents.applier import (
    ApplierSettings,
    MemoryApplier,
    NodeAssignment,
    PlanApplier,
    assignment_from_plan,
)
from agents.backoff import BackoffSettings
from policies.hardware.inventory import GpuHealth, NodeInventory, inventory_from_node

FAST = BackoffSettings(initial_s=0.02, max_s=0.1, jitter=0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _settings(port: int, **kw: object) -> AgentSettings:
    base = AgentSettings(controller=f"127.0.0.1:{port}", insecure=True, backoff=FAST)
    return replace(base, **kw)  # type: ignore[arg-type]


def _inventory(node: str = "n0") -> NodeInventory:
    return inventory_from_node(small_fleet().node(node))


def _msg(
    a: NodeAssignment, phase: agent_pb2.AssignmentPhase.ValueType, part: bytes | None = None
) -> agent_pb2.Assignment:
    return agent_pb2.Assignment(
        deployment=a.deployment,
        plan_id=a.plan_id,
        version=a.version,
        phase=phase,
        world_size=a.world_size,
        part_json=json.dumps(a.to_dict()).encode() if part is None else part,
        expert_location_zlib=zlib.compress(a.expert_location_json),
    )


def _acks(svc: FakeAgentService) -> list[tuple[int, str, int]]:
    return [(a.version, agent_pb2.AckState.Name(a.state), len(a.reason)) for a in svc.acks]


def test_register_heartbeat_prepare_commit_over_grpc(tmp_path: Path) -> None:
    plan = small_plan()
    a = assignment_from_plan("mixtral", plan, "n0")
    events: list[AssignmentEvent] = []

    async def go() -> None:
        svc = FakeAgentService()
        server, port = await start_fake(svc)
        applier = PlanApplier(ApplierSettings(plan_dir=tmp_path, node="n0"))
        agent = Agent(
            _settings(port, token="t0k"),
            lambda: _inventory(),
            applier,
            observer=events.append,
        )
        task = asyncio.create_task(agent.run())
        try:
            await wait_for(lambda: len(svc.heartbeats) >= 3, what="heartbeats")
            assert svc.registers[0].inventory.node == "n0"
            assert len(svc.registers[0].inventory.gpus) == 2
            assert svc.metadata_seen[0]["authorization"] == "Bearer t0k"
            assert svc.heartbeats[0].session_id == "s1"
            assert svc.heartbeats[0].state == agent_pb2.NODE_STATE_READY
            assert agent.interval_s == pytest.approx(0.05)  # from the Register reply

            await svc.queue("n0").put(_msg(a, agent_pb2.ASSIGNMENT_PHASE_PREPARE))
            await wait_for(lambda: len(svc.acks) == 1, what="prepared ack")
            assert _acks(svc) == [(1, "ACK_STATE_PREPARED", 0)]
            assert applier.is_staged("mixtral", 1) and applier.committed("mixtral") is None

            await svc.queue("n0").put(_msg(a, agent_pb2.ASSIGNMENT_PHASE_COMMIT, b""))
            await wait_for(lambda: len(svc.acks) == 2, what="committed ack")
            assert _acks(svc)[1] == (1, "ACK_STATE_COMMITTED", 0)
            assert (tmp_path / "mixtral" / "gpu1.env").is_file()
            await wait_for(lambda: svc.heartbeats[-1].applied.get("mixtral") == 1, what="applied")
        finally:
            agent.stop()
            await asyncio.wait_for(task, HANG_GUARD_S)
            await server.stop(None)
        assert [e.phase for e in events] == ["prepare", "commit"]
        assert all(e.ok and e.node == "n0" for e in events)

    asyncio.run(go())


def test_bad_part_is_acked_failed_with_reason_and_commit_carries_part() -> None:
    plan = small_plan()
    a = assignment_from_plan("mixtral", plan, "n0")

    async def go() -> None:
        svc = FakeAgentService()
        server, port = await start_fake(svc)
        applier = MemoryApplier("n0")
        agent = Agent(_settings(port), lambda: _inventory(), applier)
        task = asyncio.create_task(agent.run())
        try:
            q = svc.queue("n0")
            await q.put(_msg(a, agent_pb2.ASSIGNMENT_PHASE_PREPARE, b"{not json"))
            await wait_for(lambda: len(svc.acks) == 1)
            assert svc.acks[0].state == agent_pb2.ACK_STATE_FAILED
            assert "part_json" in svc.acks[0].reason
            # A COMMIT for a version never prepared applies the part it carries.
            a2 = replace(a, version=2)
            await q.put(_msg(a2, agent_pb2.ASSIGNMENT_PHASE_COMMIT))
            await wait_for(lambda: len(svc.acks) == 2)
            assert svc.acks[1].state == agent_pb2.ACK_STATE_COMMITTED
            assert applier.committed("mixtral") is not None
            # A replayed COMMIT (reconnect) is acked again without re-applying.
            await q.put(_msg(a2, agent_pb2.ASSIGNMENT_PHASE_COMMIT, b""))
            await wait_for(lambda: len(svc.acks) == 3)
            assert svc.acks[2].state == agent_pb2.ACK_STATE_COMMITTED
            # A prepare that is aborted leaves version 2 in force.
            a3 = replace(a, version=3)
            await q.put(_msg(a3, agent_pb2.ASSIGNMENT_PHASE_PREPARE))
            await wait_for(lambda: len(svc.acks) == 4)
            await q.put(_msg(a3, agent_pb2.ASSIGNMENT_PHASE_ABORT, b""))
            await wait_for(lambda: not applier.is_staged("mixtral", 3))
            assert applier.applied() == {"mixtral": 2}
            await q.put(_msg(a3, agent_pb2.ASSIGNMENT_PHASE_REMOVE, b""))
            await wait_for(lambda: applier.applied() == {})
        finally:
            agent.stop()
            await asyncio.wait_for(task, HANG_GUARD_S)
            await server.stop(None)

    asyncio.run(go())


def test_agent_waits_for_a_controller_that_starts_late() -> None:
    port = _free_port()

    async def go() -> None:
        svc = FakeAgentService()
        agent = Agent(_settings(port), lambda: _inventory(), MemoryApplier("n0"))
        task = asyncio.create_task(agent.run())
        await asyncio.sleep(0.4)  # several failed attempts with backoff
        assert agent.stats.registrations == 0 and "UNAVAILABLE" in agent.stats.last_error
        server, _ = await start_fake(svc, port)
        try:
            await wait_for(lambda: len(svc.heartbeats) >= 1, what="first heartbeat")
            assert agent.stats.registrations == 1
        finally:
            agent.stop()
            await asyncio.wait_for(task, HANG_GUARD_S)
            await server.stop(None)

    asyncio.run(go())


def test_controller_restart_reopens_stream_and_reregister_is_obeyed() -> None:
    plan = small_plan()
    a = assignment_from_plan("mixtral", plan, "n0")

    async def go() -> None:
        svc = FakeAgentService()
        server, port = await start_fake(svc)
        applier = MemoryApplier("n0")
        agent = Agent(_settings(port), lambda: _inventory(), applier)
        task = asyncio.create_task(agent.run())
        try:
            await wait_for(lambda: agent.stats.stream_opens == 1)
            await server.stop(None)  # the controller dies ...
            await asyncio.sleep(0.3)
            assert agent.stats.heartbeat_failures > 0
            svc2 = FakeAgentService(reregister_next=True)
            server, _ = await start_fake(svc2, port)  # ... and comes back empty
            await wait_for(lambda: len(svc2.registers) >= 1, what="re-register")
            await wait_for(lambda: agent.session_id == f"s{svc2.sessions}")
            await svc2.queue("n0").put(_msg(a, agent_pb2.ASSIGNMENT_PHASE_COMMIT))
            await wait_for(lambda: applier.applied() == {"mixtral": 1}, what="commit after restart")
        finally:
            agent.stop()
            await asyncio.wait_for(task, HANG_GUARD_S)
            await server.stop(None)

    asyncio.run(go())


def test_refused_credentials_are_fatal_not_retried() -> None:
    async def go() -> None:
        svc = FakeAgentService(refuse_register=grpc.StatusCode.UNAUTHENTICATED)
        server, port = await start_fake(svc)
        agent = Agent(_settings(port), lambda: _inventory(), MemoryApplier("n0"))
        try:
            with pytest.raises(AgentFatalError, match=r"UNAUTHENTICATED.*To fix"):
                await asyncio.wait_for(agent.run(), 5)
        finally:
            await server.stop(None)
        assert len(svc.metadata_seen) == 1  # asked once

    asyncio.run(go())


def test_failed_precondition_on_prepared_ack_discards_staged_part() -> None:
    plan = small_plan()
    a = assignment_from_plan("mixtral", plan, "n0")

    async def go() -> None:
        svc = FakeAgentService(ack_error=grpc.StatusCode.FAILED_PRECONDITION)
        server, port = await start_fake(svc)
        applier = MemoryApplier("n0")
        agent = Agent(_settings(port), lambda: _inventory(), applier)
        task = asyncio.create_task(agent.run())
        try:
            await svc.queue("n0").put(_msg(a, agent_pb2.ASSIGNMENT_PHASE_PREPARE))
            await wait_for(lambda: agent.stats.assignments.get("prepare") == 1)
            await wait_for(lambda: not applier.is_staged("mixtral", 1), what="discarded")
        finally:
            agent.stop()
            await asyncio.wait_for(task, HANG_GUARD_S)
            await server.stop(None)

    asyncio.run(go())


def test_unhealthy_gpu_is_reported_degraded() -> None:
    async def go() -> None:
        svc = FakeAgentService()
        server, port = await start_fake(svc)
        inv = _inventory()
        agent = Agent(_settings(port), lambda: inv, MemoryApplier("n0"))
        task = asyncio.create_task(agent.run())
        try:
            await wait_for(lambda: len(svc.heartbeats) >= 1)
            sick = replace(inv.gpus[1], health=GpuHealth(xid_errors=(79,)))
            agent.update_inventory(replace(inv, gpus=(inv.gpus[0], sick)))
            await wait_for(lambda: svc.heartbeats[-1].state == agent_pb2.NODE_STATE_DEGRADED)
            last = svc.heartbeats[-1]
            assert list(last.gpu_health[1].health.xid_errors) == [79]
            assert "[1]" in last.message
        finally:
            agent.stop()
            await asyncio.wait_for(task, HANG_GUARD_S)
            await server.stop(None)

    asyncio.run(go())


def test_partless_commit_with_nothing_staged_makes_the_agent_resync() -> None:
    """A COMMIT that relies on a staged part the agent no longer has: the agent registers
    again (a new stream replays the committed part in full) instead of acking a guess."""
    plan = small_plan()
    a = assignment_from_plan("mixtral", plan, "n0")

    async def go() -> None:
        svc = FakeAgentService()
        server, port = await start_fake(svc)
        applier = MemoryApplier("n0")
        agent = Agent(_settings(port), lambda: _inventory(), applier)
        task = asyncio.create_task(agent.run())
        try:
            await wait_for(lambda: agent.stats.stream_opens == 1)
            await svc.queue("n0").put(_msg(a, agent_pb2.ASSIGNMENT_PHASE_COMMIT, part=b""))
            await wait_for(lambda: agent.stats.registrations == 2, what="re-register")
            assert applier.applied() == {} and svc.acks == []
            await svc.queue("n0").put(_msg(a, agent_pb2.ASSIGNMENT_PHASE_COMMIT))
            await wait_for(lambda: applier.applied() == {"mixtral": 1}, what="full replay")
        finally:
            agent.stop()
            await asyncio.wait_for(task, HANG_GUARD_S)
            await server.stop(None)

    asyncio.run(go())


def test_heartbeats_use_one_stream_and_fall_back_to_unary_calls() -> None:
    async def go(streaming: bool) -> FakeAgentService:
        svc = FakeAgentService(heartbeat_stream=streaming)
        server, port = await start_fake(svc)
        agent = Agent(_settings(port), lambda: _inventory(), MemoryApplier("n0"))
        task = asyncio.create_task(agent.run())
        try:
            await wait_for(lambda: agent.stats.heartbeats >= 5, what="five heartbeats")
        finally:
            agent.stop()
            await asyncio.wait_for(task, HANG_GUARD_S)
            await server.stop(None)
        return svc

    streamed = asyncio.run(go(True))
    assert streamed.stream_opens == 1 and len(streamed.heartbeats) >= 5  # one stream, many beats
    unary = asyncio.run(go(False))
    assert unary.stream_opens == 0 and len(unary.heartbeats) >= 5  # UNIMPLEMENTED -> unary


def test_heartbeat_stream_is_reopened_after_the_controller_restarts() -> None:
    """The controller goes away and comes back with the session (a restart on the same
    store): the agent's heartbeat stream has ended, so it opens a new one and carries on."""

    async def go() -> None:
        svc = FakeAgentService()
        server, port = await start_fake(svc)
        agent = Agent(_settings(port), lambda: _inventory(), MemoryApplier("n0"))
        task = asyncio.create_task(agent.run())
        try:
            await wait_for(lambda: len(svc.heartbeats) >= 3, what="heartbeats")
            await server.stop(None)
            await asyncio.sleep(0.3)
            svc2 = FakeAgentService()
            server, _ = await start_fake(svc2, port)
            await wait_for(lambda: len(svc2.heartbeats) >= 3, what="heartbeats after restart")
            assert svc2.stream_opens >= 1 and svc2.registers == []  # same session, new stream
            assert agent.stats.heartbeat_failures >= 1
        finally:
            agent.stop()
            await asyncio.wait_for(task, HANG_GUARD_S)
            await server.stop(None)

    asyncio.run(go())


def test_acks_use_one_stream_and_fall_back_to_unary_calls() -> None:
    plan = small_plan()
    a = assignment_from_plan("mixtral", plan, "n0")

    async def go(streaming: bool) -> FakeAgentService:
        svc = FakeAgentService(ack_stream=streaming)
        server, port = await start_fake(svc)
        applier = MemoryApplier("n0")
        agent = Agent(_settings(port), lambda: _inventory(), applier)
        task = asyncio.create_task(agent.run())
        try:
            await svc.queue("n0").put(_msg(a, agent_pb2.ASSIGNMENT_PHASE_PREPARE))
            await svc.queue("n0").put(_msg(a, agent_pb2.ASSIGNMENT_PHASE_COMMIT, part=b""))
            await wait_for(lambda: len(svc.acks) == 2, what="two acks")
            assert applier.applied() == {"mixtral": 1}
        finally:
            agent.stop()
            await asyncio.wait_for(task, HANG_GUARD_S)
            await server.stop(None)
        return svc

    streamed = asyncio.run(go(True))
    assert streamed.ack_stream_opens == 1  # both acks on one stream
    assert [x.state for x in streamed.acks] == [
        agent_pb2.ACK_STATE_PREPARED,
        agent_pb2.ACK_STATE_COMMITTED,
    ]
    unary = asyncio.run(go(False))
    assert unary.ack_stream_opens == 0 and len(unary.acks) == 2
