"""Builders for the router's end-to-end tests: a real controller with a committed
deployment (fake agents roll it out), test engines, a router, and clients."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from mixfleet.v1 import plan_pb2, plan_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/controlplane helpers

from agent_fakes import FakeAgent, small_inventories, wait_until
from support.waits import hang_guard_s

from apis.wire.deployment import spec_to_proto
from controlplane.router.proxy import Router
from controlplane.router.settings import RouterSettings, check
from controlplane.server.inprocess import RunningController, start_controller
from policies.spec.build import DeploymentSpec, WorkloadSpec

SPEC = DeploymentSpec(
    name="mx",
    model="mixtral-8x7b",
    policy="greedy",
    workload=WorkloadSpec(tokens_per_gpu=32, context_len=2048),
    prepare_timeout_s=5.0,
)

#: Router timings that keep the tests short.
FAST_ROUTER = {
    "health_interval_s": 0.1,
    "health_timeout_s": 0.5,
    "backoff_initial_s": 0.05,
    "backoff_max_s": 0.3,
    "connect_timeout_s": 1.0,
    "read_timeout_s": 10.0,
}


@dataclass
class Controlled:
    """A controller with deployment ``mx`` committed on 6 ranks (3 nodes x 2 GPUs)."""

    ctl: RunningController
    agents: list[FakeAgent]

    def commit_weights(self, weights: Sequence[float]) -> int:
        """Commit a new version of ``mx`` whose ranks carry ``weights``; returns it."""
        c = self.ctl.controller
        stored = c.store.committed_plan("mx")
        assert stored is not None and stored.plan is not None
        gpus = tuple(
            replace(g, dp_weight=w) for g, w in zip(stored.plan.gpus, weights, strict=True)
        )
        now = time.time()
        new = c.store.add_plan(
            "mx",
            replace(stored.plan, gpus=gpus),
            reason="test weights",
            inputs_key=stored.inputs_key,
            now_s=now,
        )
        c.store.set_plan_state("mx", new.version, "preparing", now_s=now)
        c.store.commit_plan("mx", new.version, now_s=now)
        full = c.store.get_plan("mx", new.version)
        assert full is not None
        c.watchers.emit_routing("mx", full)
        return new.version


@asynccontextmanager
async def controlled(tmp_path: Path) -> AsyncIterator[Controlled]:
    async with start_controller(tmp_path) as ctl:
        agents = [FakeAgent(ctl.address, inv) for inv in small_inventories(3)]
        for a in agents:
            await a.start()
        try:
            async with grpc.aio.insecure_channel(ctl.address) as ch:
                await plan_pb2_grpc.PlanServiceStub(ch).ApplyDeployment(
                    plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(SPEC))
                )
            await wait_until(
                lambda: all(a.applied.get("mx", (0,))[0] == 1 for a in agents),
                what="v1 applied everywhere",
            )
            await wait_until(
                lambda: (
                    (d := ctl.controller.store.get_deployment("mx")) is not None
                    and d.committed_version == 1
                ),
                what="v1 committed",
            )
            yield Controlled(ctl, agents)
        finally:
            for a in agents:
                await a.stop()


@asynccontextmanager
async def running_router(**kw: Any) -> AsyncIterator[Router]:
    settings = check(
        RouterSettings(listen_host="127.0.0.1", listen_port=0, **{**FAST_ROUTER, **kw})
    )
    router = Router(settings)
    await router.start()
    try:
        yield router
    finally:
        await router.stop()


async def until(cond: Any, timeout_s: float = 5.0, what: str = "") -> float:
    """Wait for ``cond()``; returns the seconds it took. Gives up after ``timeout_s``, at
    least :data:`support.waits.HANG_GUARD_S` (a hang guard, not a speed claim)."""
    t0 = time.perf_counter()
    timeout_s = hang_guard_s(timeout_s)
    while not cond():
        if time.perf_counter() - t0 > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
    return time.perf_counter() - t0


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    *,
    max_tokens: int = 4,
    stream: bool = False,
    request_id: str = "",
    headers: dict[str, str] | None = None,
    prompt: str = "hello world",
) -> tuple[int, str]:
    """One /v1/completions call; (status, body text)."""
    h = {"X-Request-Id": request_id, **(headers or {})}
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    async with session.post(f"{url}/v1/completions", json=body, headers=h) as r:
        return r.status, await r.text()


async def closed_loop(
    session: aiohttp.ClientSession, url: str, *, clients: int, requests: int, max_tokens: int = 4
) -> list[int]:
    """``clients`` concurrent loops sending ``requests`` requests in all; their statuses."""
    statuses: list[int] = []
    left = [requests]

    async def loop() -> None:
        while left[0] > 0:
            left[0] -= 1
            status, _ = await complete(session, url, max_tokens=max_tokens)
            statuses.append(status)

    await asyncio.gather(*(loop() for _ in range(clients)))
    return statuses
