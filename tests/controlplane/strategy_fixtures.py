"""Shared by the strategy RPC tests (test_strategy_api*.py): the deployment they ask about, the
same deployment built for the pure planners, and a controller with three small nodes
registered over gRPC (no reconcile loop, a long node-lost timeout)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from agent_fakes import small_inventories
from google.protobuf.message import Message
from mixfleet.v1 import agent_pb2, agent_pb2_grpc, plan_pb2_grpc

from apis.wire.inventory import inventory_to_proto
from controlplane.server.inprocess import FAST, RunningController, start_controller
from policies.deployment import Deployment
from policies.hardware.fleet import Fleet
from policies.model.architecture import preset
from policies.request import SolverOptions
from policies.spec.build import DeploymentSpec, WorkloadSpec

#: Nodes stay usable for 10 minutes after registering: no heartbeats needed.
SETTINGS = replace(FAST, node_lost_after_s=600.0)
MODEL = "mixtral-8x7b"
NAME = "adv"
ADMIN = "admin-token-0123456789abcdef"
VIEWER = "viewer-token-0123456789abcdef"
ENGINE = "engine-token-0123456789abcdef"
AGENT = "agent-token-0123456789abcdefg"
ALL_NODES = ("n0", "n1", "n2")  # H100, H200, A100 (2 GPUs each); racks r0, r1, r0


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def spec(tokens_per_gpu: int = 32, **changes: Any) -> DeploymentSpec:
    """The deployment every test asks about: mixtral-8x7b decode, greedy."""
    base = DeploymentSpec(
        name=NAME,
        model=MODEL,
        policy="greedy",
        workload=WorkloadSpec(tokens_per_gpu=tokens_per_gpu, context_len=4096),
    )
    return replace(base, **changes)


def expected(nodes: tuple[str, ...] = ALL_NODES, **changes: Any) -> Deployment:
    """The same deployment built by hand for the pure planners: the registered inventories'
    nodes (in name order, as the controller plans), the preset, a 60 s solver limit."""
    inventories = {inv.node: inv for inv in small_inventories()}
    fleet = Fleet(NAME, tuple(inventories[n].to_node() for n in nodes))
    dep = Deployment(
        fleet=fleet,
        model=preset(MODEL),
        policy="greedy",
        options=SolverOptions(time_limit_s=60.0),
    )
    return replace(dep, **changes)


def opt(msg: Message, name: str) -> Any:
    """An optional field's value, None when unset."""
    return getattr(msg, name) if msg.HasField(name) else None


@dataclass
class Api:
    ctl: RunningController
    plans: plan_pb2_grpc.PlanServiceAsyncStub


@asynccontextmanager
async def controller_with_nodes(
    tmp_path: Path, *, token_file: Path | None = None
) -> AsyncIterator[Api]:
    """A controller (no reconcile loop) with the three small nodes registered over gRPC."""
    md = (("authorization", f"Bearer {AGENT}"),) if token_file else ()
    async with (
        start_controller(tmp_path, settings=SETTINGS, token_file=token_file, run_loop=False) as ctl,
        grpc.aio.insecure_channel(ctl.address) as ch,
    ):
        agent = agent_pb2_grpc.AgentServiceStub(ch)
        for inv in small_inventories():
            await agent.Register(
                agent_pb2.RegisterRequest(inventory=inventory_to_proto(inv)), metadata=md
            )
        yield Api(ctl, plan_pb2_grpc.PlanServiceStub(ch))


async def expect(code: grpc.StatusCode, call: Awaitable[Any], *needles: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    details = err.value.details() or ""
    for needle in needles:
        assert needle in details, details
    return details
