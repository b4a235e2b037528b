"""The demo's wait for the router (:func:`demo.instances_serving.routed`) against a real
HTTP server on loopback that answers ``GET /router/status`` as the router does while an
instance's ranks have not arrived yet.

The router learns an instance from ``WatchInstances`` and its DP ranks from that instance's
own ``WatchRouting`` stream. In between, the instance is healthy and routable but has no
rank: every request gets 503 ("no admitted rank"). The wait must not end there (a CI run
sent its whole burst into that window: 240 of 240 requests 503).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from demo.instances_serving import Router, routed
from mixfleet.v1 import engine_pb2

from controlplane.router.settings import InstanceSpec
from controlplane.router.state import RouterState

#: status documents served before the ranks arrive
WITHOUT_RANKS = 3


NAME = "dep-aggregated-0"


def _status(ranks: int) -> dict[str, Any]:
    """The router's own status document (:meth:`RouterState.status`) of a healthy, ready
    instance of a watched deployment, before its routing came (``ranks`` 0) or after."""
    state = RouterState()
    spec = InstanceSpec(NAME, "http://127.0.0.1:1", "default", deployment=NAME, source="dep")
    state.sync("dep", [(spec, True)])
    if ranks:
        state.apply_routing(
            engine_pb2.Routing(deployment=NAME, version=1, dp_weights=[1.0] * ranks)
        )
    doc = state.status({NAME}, {}, {})
    assert doc["instances"][0]["ranks"] == ranks
    return doc


async def _wait(tmp_path: Path) -> tuple[list[int], float]:
    served: list[int] = []

    async def status(_: web.Request) -> web.Response:
        ranks = 0 if len(served) < WITHOUT_RANKS else 2
        served.append(ranks)
        return web.json_response(_status(ranks))

    app = web.Application()
    app.router.add_get("/router/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    # a live process in the router's place (routed() stops waiting when it exits)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(120)"
    )
    msg = engine_pb2.Instances(
        deployment="dep",
        instances=[engine_pb2.Instance(name=NAME, role="aggregated", ready=True)],
    )
    try:
        router = Router(proc, f"http://127.0.0.1:{port}", tmp_path / "router.log")
        async with aiohttp.ClientSession() as session:
            waited = await routed(router, session, msg, 60.0)
        return served, waited
    finally:
        proc.kill()
        await proc.wait()
        await runner.cleanup()


def test_the_wait_for_the_router_ends_only_once_the_instances_have_ranks(
    tmp_path: Path,
) -> None:
    served, _ = asyncio.run(_wait(tmp_path))
    assert served == [0] * WITHOUT_RANKS + [2]
