"""Bad inputs and bad callers get the right gRPC status, with a message naming the field.
Real gRPC on loopback, port 0, SQLite in tmp_path."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterable, AsyncIterator, Awaitable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from agent_fakes import small_inventories
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from mixfleet.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    plan_pb2,
    plan_pb2_grpc,
)

from apis.wire.deployment import spec_to_proto
from apis.wire.inventory import inventory_to_proto
from controlplane.server.controller import Controller
from controlplane.server.inprocess import start_controller
from controlplane.server.services import ServerOptions, create_server
from controlplane.store.sqlite import SqliteStore
from policies.errors import InputError
from policies.spec.build import DeploymentSpec

ADMIN = "admin-token-0123456789abcdef"
VIEWER = "viewer-token-0123456789abcdef"
ENGINE = "engine-token-0123456789abcdef"


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


async def expect(code: grpc.StatusCode, call: Awaitable[Any], *needles: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    details = err.value.details() or ""
    for needle in needles:
        assert needle in details, details
    return details


def register_request(**gpu_changes: Any) -> agent_pb2.RegisterRequest:
    inv = small_inventories()[0]
    if gpu_changes:
        inv = replace(inv, gpus=(replace(inv.gpus[0], **gpu_changes), *inv.gpus[1:]))
    return agent_pb2.RegisterRequest(inventory=inventory_to_proto(inv))


def test_bad_inventories_are_invalid_argument_naming_the_field(tmp_path: Path) -> None:
    async def main() -> None:
        async with start_controller(tmp_path) as ctl, grpc.aio.insecure_channel(ctl.address) as ch:
            agent = agent_pb2_grpc.AgentServiceStub(ch)
            code = grpc.StatusCode.INVALID_ARGUMENT
            await expect(
                code,
                agent.Register(register_request(hbm_bandwidth_gbytes_per_s=math.nan)),
                "inventory.gpus[0].hbm_bandwidth_gbytes_per_s",
                "finite",
            )
            await expect(
                code,
                agent.Register(register_request(hbm_bandwidth_gbytes_per_s=-1.0)),
                "inventory.gpus[0].hbm_bandwidth_gbytes_per_s",
            )
            await expect(
                code,
                agent.Register(register_request(memory_bytes=-5)),
                "inventory.gpus[0]",
                "memory_bytes",
            )
            inv = small_inventories()[0]
            dup = replace(inv, gpus=(inv.gpus[0], replace(inv.gpus[1], uuid=inv.gpus[0].uuid)))
            await expect(
                code,
                agent.Register(agent_pb2.RegisterRequest(inventory=inventory_to_proto(dup))),
                "inventory.gpus[1].uuid",
                "duplicate",
            )
            nic = replace(inv, nics=(replace(inv.nics[0], rate_per_direction_gbits_per_s=-400.0),))
            await expect(
                code,
                agent.Register(agent_pb2.RegisterRequest(inventory=inventory_to_proto(nic))),
                "inventory.nics[0].rate_per_direction_gbits_per_s",
            )
            await expect(code, agent.Register(agent_pb2.RegisterRequest()), "inventory")
            assert ctl.controller.store.list_nodes() == []

    run(main())


def test_oversized_messages_are_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            start_controller(tmp_path, max_receive_message_bytes=32 * 1024) as ctl,
            grpc.aio.insecure_channel(ctl.address) as ch,
        ):
            agent = agent_pb2_grpc.AgentServiceStub(ch)
            req = register_request()
            req.inventory.labels["padding"] = "x" * 64 * 1024
            await expect(grpc.StatusCode.RESOURCE_EXHAUSTED, agent.Register(req), "larger than max")
            ok = await agent.Register(register_request())
            assert ok.session_id

    run(main())


async def _registered(
    ch: grpc.aio.Channel,
) -> tuple[agent_pb2_grpc.AgentServiceAsyncStub, agent_pb2.RegisterResponse]:
    """An AgentService stub and the registration of node n0 through it."""
    agent = agent_pb2_grpc.AgentServiceStub(ch)
    return agent, await agent.Register(register_request())


def test_acks_for_unknown_things(tmp_path: Path) -> None:
    async def main() -> None:
        async with start_controller(tmp_path) as ctl, grpc.aio.insecure_channel(ctl.address) as ch:
            agent, reg = await _registered(ch)
            plans = plan_pb2_grpc.PlanServiceStub(ch)
            prepared = agent_pb2.ACK_STATE_PREPARED
            await expect(
                grpc.StatusCode.NOT_FOUND,
                agent.Ack(
                    agent_pb2.AckRequest(
                        node="n0",
                        session_id=reg.session_id,
                        deployment="ghost",
                        version=1,
                        state=prepared,
                    )
                ),
                "deployment",
                "ghost",
            )
            spec = DeploymentSpec(
                name="mx", model="mixtral-8x7b", policy="greedy", node_selector={"never": "matches"}
            )
            await plans.ApplyDeployment(plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(spec)))
            await expect(
                grpc.StatusCode.NOT_FOUND,
                agent.Ack(
                    agent_pb2.AckRequest(
                        node="n0",
                        session_id=reg.session_id,
                        deployment="mx",
                        version=7,
                        state=prepared,
                    )
                ),
                "version",
                "no plan version 7",
            )
            await expect(
                grpc.StatusCode.INVALID_ARGUMENT,
                agent.Ack(agent_pb2.AckRequest(node="n0", deployment="mx", version=1)),
                "state",
            )
            await expect(
                grpc.StatusCode.INVALID_ARGUMENT,
                agent.Ack(
                    agent_pb2.AckRequest(
                        node="n0", deployment="mx", version=1, state=agent_pb2.ACK_STATE_FAILED
                    )
                ),
                "reason",
            )
            await expect(
                grpc.StatusCode.NOT_FOUND,
                agent.Ack(
                    agent_pb2.AckRequest(node="ghost", deployment="mx", version=1, state=prepared)
                ),
                "node",
            )

    run(main())


def test_heartbeats_and_streams_of_unknown_sessions(tmp_path: Path) -> None:
    async def main() -> None:
        async with start_controller(tmp_path) as ctl, grpc.aio.insecure_channel(ctl.address) as ch:
            agent, reg = await _registered(ch)
            hb = await agent.Heartbeat(agent_pb2.HeartbeatRequest(node="n0", session_id="stale"))
            assert hb.reregister
            hb = await agent.Heartbeat(
                agent_pb2.HeartbeatRequest(node="n0", session_id=reg.session_id)
            )
            assert not hb.reregister
            stream = agent.WatchAssignments(
                agent_pb2.WatchAssignmentsRequest(node="ghost", session_id="x")
            )
            await expect(grpc.StatusCode.NOT_FOUND, _first(stream), "node", "Register")
            stream = agent.WatchAssignments(
                agent_pb2.WatchAssignmentsRequest(node="n0", session_id="stale")
            )
            await expect(grpc.StatusCode.FAILED_PRECONDITION, _first(stream), "session_id")

    run(main())


def test_ack_and_heartbeat_streams_refuse_in_band(tmp_path: Path) -> None:
    """The same refusals on an AckStream come back in-band and the stream goes on."""

    async def main() -> None:
        async with start_controller(tmp_path) as ctl, grpc.aio.insecure_channel(ctl.address) as ch:
            agent, reg = await _registered(ch)
            prepared = agent_pb2.ACK_STATE_PREPARED
            acks: Any = cast(Any, agent).AckStream()
            await acks.write(
                agent_pb2.AckRequest(
                    node="n0",
                    session_id=reg.session_id,
                    deployment="ghost",
                    version=1,
                    state=prepared,
                )
            )
            refused = await acks.read()
            assert refused.code == grpc.StatusCode.NOT_FOUND.value[0]
            assert "deployment" in refused.message and "ghost" in refused.message
            await acks.write(agent_pb2.AckRequest(node="n0", deployment="mx", version=1))
            refused = await acks.read()
            assert refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "state" in refused.message
            await acks.done_writing()
            assert await acks.read() is grpc.aio.EOF  # type: ignore[attr-defined]
            assert await acks.code() == grpc.StatusCode.OK
            beats: Any = cast(Any, agent).HeartbeatStream()
            for session, again in (("stale", True), (reg.session_id, False)):
                await beats.write(agent_pb2.HeartbeatRequest(node="n0", session_id=session))
                assert (await beats.read()).reregister is again
            await beats.done_writing()

    run(main())


async def _first(stream: AsyncIterable[Any]) -> Any:
    async for item in stream:
        return item
    return None


def test_plan_service_errors(tmp_path: Path) -> None:
    async def main() -> None:
        async with start_controller(tmp_path) as ctl, grpc.aio.insecure_channel(ctl.address) as ch:
            plans = plan_pb2_grpc.PlanServiceStub(ch)
            bad = spec_to_proto(DeploymentSpec(name="mx", model="mixtral-8x7b"))
            bad.policy = "magic"
            await expect(
                grpc.StatusCode.INVALID_ARGUMENT,
                plans.ApplyDeployment(plan_pb2.ApplyDeploymentRequest(spec=bad)),
                "spec.policy",
            )
            bad = spec_to_proto(DeploymentSpec(name="mx", model="mixtral-8x7b"))
            bad.workload.tokens_per_gpu = -3
            await expect(
                grpc.StatusCode.INVALID_ARGUMENT,
                plans.ApplyDeployment(plan_pb2.ApplyDeploymentRequest(spec=bad)),
                "tokensPerGpu",
            )
            bad = spec_to_proto(DeploymentSpec(name="mx", model="mixtral-8x7b"))
            bad.solver_time_limit_s = math.nan
            await expect(
                grpc.StatusCode.INVALID_ARGUMENT,
                plans.ApplyDeployment(plan_pb2.ApplyDeploymentRequest(spec=bad)),
                "solverTimeLimitS",
            )
            bad = spec_to_proto(DeploymentSpec(name="mx", model="mixtral-8x7b"))
            bad.engine.name = "vllm"
            bad.engine.options.dispatch = "static"
            for call in (
                plans.ApplyDeployment(plan_pb2.ApplyDeploymentRequest(spec=bad)),
                plans.Solve(plan_pb2.SolveRequest(spec=bad)),
            ):
                await expect(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    call,
                    "spec.engine.options.dispatch",
                    "vLLM always hashes tokens evenly",
                )
            bad.engine.name = "tgi"
            await expect(
                grpc.StatusCode.INVALID_ARGUMENT,
                plans.Solve(plan_pb2.SolveRequest(spec=bad)),
                "spec.engine.name",
                "choose one of native, sglang, vllm, trtllm",
            )
            good = plan_pb2.ApplyDeploymentRequest(
                spec=spec_to_proto(DeploymentSpec(name="mx", model="mixtral-8x7b"))
            )
            await plans.CreateDeployment(good)
            await expect(grpc.StatusCode.ALREADY_EXISTS, plans.CreateDeployment(good), "spec.name")
            other = plan_pb2.ApplyDeploymentRequest(
                spec=spec_to_proto(DeploymentSpec(name="other", model="mixtral-8x7b"))
            )
            await expect(grpc.StatusCode.NOT_FOUND, plans.UpdateDeployment(other), "spec.name")
            await expect(
                grpc.StatusCode.NOT_FOUND,
                plans.GetPlan(plan_pb2.GetPlanRequest(deployment="mx", version=3)),
                "version",
            )
            await expect(
                grpc.StatusCode.NOT_FOUND,
                plans.GetDeployment(plan_pb2.GetDeploymentRequest(name="zz")),
                "name",
            )
            await expect(
                grpc.StatusCode.FAILED_PRECONDITION,
                plans.Solve(plan_pb2.SolveRequest(spec=good.spec)),
                "node_selector",
            )

    run(main())


def test_engine_service_errors(tmp_path: Path) -> None:
    async def main() -> None:
        async with start_controller(tmp_path) as ctl, grpc.aio.insecure_channel(ctl.address) as ch:
            plans = plan_pb2_grpc.PlanServiceStub(ch)
            engine = engine_pb2_grpc.EngineServiceStub(ch)
            good = plan_pb2.ApplyDeploymentRequest(
                spec=spec_to_proto(DeploymentSpec(name="mx", model="mixtral-8x7b"))
            )
            await plans.CreateDeployment(good)
            await expect(
                grpc.StatusCode.FAILED_PRECONDITION,
                engine.GetRouting(engine_pb2.GetRoutingRequest(deployment="mx")),
                "no committed plan",
            )
            await expect(
                grpc.StatusCode.NOT_FOUND,
                engine.GetRouting(engine_pb2.GetRoutingRequest(deployment="zz")),
                "deployment",
            )
            window = engine_pb2.ExpertLoadWindow(
                deployment="mx",
                start_unix_s=1.0,
                end_unix_s=2.0,
                num_layers=32,
                num_experts=8,
                counts=[1.0] * 256,
            )
            window.counts[5] = math.nan
            await expect(
                grpc.StatusCode.INVALID_ARGUMENT,
                engine.ReportExpertLoad(_windows(window)),
                "windows[0].counts",
            )
            window.counts[5] = 1.0
            window.num_experts = 7
            await expect(
                grpc.StatusCode.INVALID_ARGUMENT,
                engine.ReportExpertLoad(_windows(window)),
                "windows[0].counts",
            )
            window.num_experts, window.num_layers = 4, 64
            await expect(
                grpc.StatusCode.INVALID_ARGUMENT,
                engine.ReportExpertLoad(_windows(window)),
                "windows[0].num_layers",
            )
            window.num_experts, window.num_layers = 8, 32
            reply = await engine.ReportExpertLoad(_windows(window, window))
            assert reply.windows_accepted == 2

    run(main())


async def _windows(*ws: engine_pb2.ExpertLoadWindow) -> AsyncIterator[engine_pb2.ExpertLoadWindow]:
    for w in ws:
        yield w


def test_wrong_or_missing_credentials_are_refused(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} admin cli\n{VIEWER} viewer dash\n{ENGINE} engine eng\n")

    def md(token: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {token}"),)

    async def main() -> None:
        async with (
            start_controller(tmp_path, token_file=tokens) as ctl,
            grpc.aio.insecure_channel(ctl.address) as ch,
        ):
            plans = plan_pb2_grpc.PlanServiceStub(ch)
            agent = agent_pb2_grpc.AgentServiceStub(ch)
            engine = engine_pb2_grpc.EngineServiceStub(ch)
            req = plan_pb2.ListDeploymentsRequest()
            unauth = grpc.StatusCode.UNAUTHENTICATED
            denied = grpc.StatusCode.PERMISSION_DENIED
            await expect(unauth, plans.ListDeployments(req), "authorization", "no credentials")
            await expect(
                unauth,
                plans.ListDeployments(req, metadata=md("wrong-token-xxxxxxxx")),
                "authorization",
                "unknown bearer token",
            )
            await expect(unauth, agent.Register(register_request()), "authorization")
            assert (await plans.ListDeployments(req, metadata=md(VIEWER))).deployments == []
            spec = plan_pb2.ApplyDeploymentRequest(
                spec=spec_to_proto(DeploymentSpec(name="mx", model="mixtral-8x7b"))
            )
            await expect(
                denied, plans.ApplyDeployment(spec, metadata=md(VIEWER)), "authorization", "viewer"
            )
            await expect(denied, plans.ListDeployments(req, metadata=md(ENGINE)), "engine")
            await expect(denied, agent.Register(register_request(), metadata=md(ADMIN)), "admin")
            await plans.ApplyDeployment(spec, metadata=md(ADMIN))
            await expect(
                grpc.StatusCode.FAILED_PRECONDITION,
                engine.GetRouting(
                    engine_pb2.GetRoutingRequest(deployment="mx"), metadata=md(ENGINE)
                ),
            )
            health = health_pb2_grpc.HealthStub(ch)  # open to everyone
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

    run(main())


def test_health_and_reflection(tmp_path: Path) -> None:
    async def main() -> None:
        async with start_controller(tmp_path) as ctl, grpc.aio.insecure_channel(ctl.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "mixfleet.v1.AgentService", "mixfleet.v1.PlanService"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)

            async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            names: set[str] = set()
            async for r in refl.ServerReflectionInfo(ask()):
                names |= {s.name for s in r.list_services_response.service}
            assert {
                "mixfleet.v1.AgentService",
                "mixfleet.v1.PlanService",
                "mixfleet.v1.EngineService",
                "grpc.health.v1.Health",
            } <= names

    run(main())


def test_plaintext_needs_insecure_and_loopback(tmp_path: Path) -> None:
    async def main() -> None:
        store = SqliteStore(tmp_path / "s.db")
        c = Controller(store)
        with pytest.raises(InputError, match="no TLS configured"):
            create_server("127.0.0.1:0", c, ServerOptions())
        with pytest.raises(InputError, match="only allowed on loopback"):
            create_server("0.0.0.0:0", c, ServerOptions(insecure=True))
        server, port = create_server("[::1]:0", c, ServerOptions(insecure=True))
        assert port > 0
        await server.stop(None)
        store.close()

    run(main())
