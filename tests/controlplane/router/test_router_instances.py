"""Instances from the controller (``--deployment``): a real router against a real gRPC
EngineService on loopback (scripted Instances / Routing messages, recorded ReportTraffic)
and loopback engines: instances added, drained and removed without cutting a stream,
shares by the plan's requests/s, a prefill/decode pool of each protocol, the batch cap and
its queue, measured traffic reports, a deployment created late and a controller outage."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from router_world import complete, running_router, until
from support.openai_engine import LoopbackEngine
from support.scripted_controller import ScriptedEngineService, instance, scripted_controller

from controlplane.cli import main
from controlplane.router.proxy import Router
from controlplane.router.settings import Watched

DS = "ds"


def _routable(router: Router) -> set[str]:
    """Instances that take requests now (routable, with weights)."""
    return {
        n for n, i in router.state.instances.items() if i.routable and any(w > 0 for w in i.planned)
    }


def _status_table(url: str) -> str:
    """``mixfleetctl router status`` against a running router; its stdout."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["router", "status", "--router", url]) == 0
    return buf.getvalue()


@asynccontextmanager
async def world(
    svc: ScriptedEngineService, **kw: Any
) -> AsyncIterator[tuple[Router, str, aiohttp.ClientSession]]:
    """The scripted controller, a router watching deployment ``ds``, a client session."""
    async with (
        scripted_controller(svc) as addr,
        running_router(instances=(), watched=(Watched(DS, "default"),), controller=addr, **kw) as r,
        aiohttp.ClientSession() as s,
    ):
        yield r, f"http://127.0.0.1:{r.port}", s


async def _engines(n: int, ranks: int = 2) -> list[LoopbackEngine]:
    return [await LoopbackEngine(tokens_per_s=[2000.0] * ranks).start() for _ in range(n)]


async def _stop(engines: Sequence[LoopbackEngine]) -> None:
    for e in engines:
        await e.stop()


def test_an_instance_listed_before_its_routing_shows_no_ranks_and_takes_no_request() -> None:
    """The controller lists ``ds-b`` before its routing exists: ``router status`` says
    ``no-ranks`` for it (not ``serving``) and every request goes to ``ds-a``; once its
    routing comes it serves."""

    async def main() -> None:
        a, b = await _engines(2)
        svc = ScriptedEngineService()
        svc.route("ds-a", [1.0, 1.0])
        svc.publish(DS, [instance("ds-a", a.url), instance("ds-b", b.url)])
        try:
            async with world(svc) as (router, url, s):
                await until(lambda: _routable(router) == {"ds-a"}, what="ds-a routable")
                await until(lambda: "ds-b" in router.state.instances, what="ds-b listed")
                table = await asyncio.to_thread(_status_table, url)
                row = next(line for line in table.splitlines() if line.startswith("ds-b"))
                assert "no-ranks" in row and "serving" not in row, table
                for _ in range(4):
                    assert (await complete(s, url))[0] == 200
                assert (len(a.records), len(b.records)) == (4, 0)
                svc.route("ds-b", [1.0, 1.0])
                await until(lambda: _routable(router) == {"ds-a", "ds-b"}, what="ds-b ranks")
                table = await asyncio.to_thread(_status_table, url)
                row = next(line for line in table.splitlines() if line.startswith("ds-b"))
                assert "serving" in row, table
        finally:
            await _stop([a, b])

    asyncio.run(main())


def test_instances_added_drained_and_removed_follow_the_controller_without_cutting_a_stream() -> (
    None
):
    async def main() -> None:
        a, b = await _engines(2)
        svc = ScriptedEngineService()
        svc.route("ds-a", [1.0, 1.0])
        svc.route("ds-b", [1.0, 1.0])
        svc.publish(DS, [instance("ds-a", a.url), instance("ds-b", b.url, ready=False)])
        try:
            async with world(svc) as (router, url, s):
                await until(lambda: _routable(router) == {"ds-a"}, what="ds-a routable")
                for _ in range(6):
                    assert (await complete(s, url))[0] == 200
                assert (len(a.records), len(b.records)) == (6, 0)  # ds-b is not ready
                svc.publish(DS, [instance("ds-a", a.url), instance("ds-b", b.url)])
                await until(lambda: _routable(router) == {"ds-a", "ds-b"}, what="ds-b added")
                for _ in range(20):
                    assert (await complete(s, url))[0] == 200
                assert len(b.records) == 10, (len(a.records), len(b.records))
                # a stream held open on one instance, which then drains and is removed
                a.hold(frozenset({0, 1}))
                b.hold(frozenset({0, 1}))
                before = {id(e): len(e.records) for e in (a, b)}
                held = asyncio.create_task(complete(s, url, stream=True, max_tokens=5))
                await until(lambda: any(len(e.records) > before[id(e)] for e in (a, b)))
                x, y = (a, b) if len(a.records) > before[id(a)] else (b, a)
                xname, yname = ("ds-a", "ds-b") if x is a else ("ds-b", "ds-a")
                y.release()
                svc.publish(DS, [instance(xname, x.url, draining=True), instance(yname, y.url)])
                await until(lambda: _routable(router) == {yname}, what=f"{xname} draining")
                table = await asyncio.to_thread(_status_table, url)
                row = next(line for line in table.splitlines() if line.startswith(xname))
                assert "draining" in row and " 1/-" in row, table  # its one open stream
                n_x = len(x.records)
                for _ in range(10):
                    assert (await complete(s, url))[0] == 200
                assert len(x.records) == n_x and not held.done()
                svc.publish(DS, [instance(yname, y.url)])
                await until(lambda: not router.state.instances[xname].listed, what="removed")
                assert router.state.instances[xname].open_requests == 1  # kept until it ends
                x.release()
                status, text = await held
                assert status == 200 and text.count("data: {") == 5, text
                assert text.rstrip().endswith("data: [DONE]")
                await until(lambda: xname not in router.state.instances, what="pruned")
                assert router.metrics.stream_aborts._value.get() == 0
        finally:
            await _stop((a, b))

    asyncio.run(main())


def test_traffic_splits_by_the_planned_requests_per_s() -> None:
    async def main() -> None:
        a, b = await _engines(2)
        svc = ScriptedEngineService()
        svc.route("ds-a", [1.0, 1.0])
        svc.route("ds-b", [1.0, 1.0])
        svc.publish(DS, [instance("ds-a", a.url, rps=30.0), instance("ds-b", b.url, rps=10.0)])
        try:
            async with world(svc) as (router, url, s):
                await until(lambda: _routable(router) == {"ds-a", "ds-b"}, what="both routable")
                statuses = await asyncio.gather(*(complete(s, url) for _ in range(200)))
        finally:
            await _stop((a, b))
        assert {st for st, _ in statuses} == {200}
        share = len(a.records) / (len(a.records) + len(b.records))
        assert abs(share - 0.75) <= 0.03, (len(a.records), len(b.records))

    asyncio.run(main())


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_prefill_decode_pool_is_driven_as_one_pair(protocol: str) -> None:
    async def main() -> None:
        p = await LoopbackEngine(engine=protocol, role="prefill", pd_wait_s=5.0).start()
        d = await LoopbackEngine(engine=protocol, role="decode", pd_wait_s=5.0).start()
        svc = ScriptedEngineService()
        svc.route("ds-decode-0", [1.0], engine=protocol)
        pool = [
            instance("ds-prefill-0", p.url, role="prefill", pool="p0", bootstrap_port=p.port),
            instance("ds-decode-0", d.url, role="decode", pool="p0"),
        ]
        svc.publish(DS, pool, engine=protocol)
        try:
            async with world(svc) as (router, url, s):
                await until(lambda: _routable(router) == {"ds/p0"}, what="the pair routable")
                spec = router.state.instances["ds/p0"].spec
                assert (spec.pd, spec.prefill, spec.decode) == (protocol, (p.url,), (d.url,))
                status, text = await complete(s, url, max_tokens=6, stream=True)
        finally:
            await _stop((p, d))
        assert status == 200 and text.count("data: {") == 6, text
        assert [r.done for r in d.records] == [True] and len(p.pd_seen) == 1
        ps, ds = p.pd_seen[0], d.pd_seen[0]
        if protocol == "sglang":
            assert ps["bootstrap_port"] == ds["bootstrap_port"] == p.port
            assert ps["bootstrap_room"] == ds["bootstrap_room"] and ds["routed_dp_rank"] == 0
        else:
            kv = ds["kv_transfer_params"]
            assert isinstance(kv, dict) and kv["remote_port"] == p.port
            assert ps["max_tokens"] == 1 and ps["request_id"] == ds["request_id"]

    asyncio.run(main())


def test_the_batch_limit_caps_open_requests_then_queues_then_answers_429() -> None:
    async def main() -> None:
        (a,) = await _engines(1)
        svc = ScriptedEngineService()
        svc.route("ds-a", [1.0, 1.0])
        svc.publish(DS, [instance("ds-a", a.url, batch_limit=2)])
        a.hold(frozenset({0, 1}))
        try:
            async with world(svc, batch_queue=1, batch_wait_s=60.0) as (router, url, s):
                await until(lambda: _routable(router) == {"ds-a"}, what="ds-a routable")
                open_ = [asyncio.create_task(complete(s, url, stream=True)) for _ in range(2)]
                await until(lambda: len(a.records) == 2, what="two requests at the engine")
                waiting = asyncio.create_task(complete(s, url))
                await until(lambda: router.fleet.slots.waiting("default") == 1, what="queued")
                status, text = await complete(s, url)  # the queue (1) is full: 429 at once
                assert status == 429 and "batch limit" in json.loads(text)["error"]["message"]
                assert len(a.records) == 2 and not waiting.done()
                a.release()
                assert [st for st, _ in await asyncio.gather(*open_)] == [200, 200]
                assert (await waiting)[0] == 200 and len(a.records) == 3
                # demand measured: the refused request arrived too
                assert router.fleet.traffic.arrived.labels(DS)._value.get() == 4
            a.hold(frozenset({0, 1}))
            async with world(svc, batch_queue=4, batch_wait_s=0.2) as (router, url, s):
                await until(lambda: _routable(router) == {"ds-a"}, what="ds-a routable")
                open_ = [asyncio.create_task(complete(s, url, stream=True)) for _ in range(2)]
                await until(lambda: len(a.records) == 5, what="two more at the engine")
                status, text = await complete(s, url)  # waits its 0.2 s, then 429
                assert status == 429 and "waited up to 0.2 s" in text, text
                assert len(a.records) == 5
                rejects = router.metrics.rejects.labels("default", "batch_full")._value.get()
                assert rejects == 1
                a.release()
                await asyncio.gather(*open_)
        finally:
            await a.stop()

    asyncio.run(main())


def test_a_closed_loop_over_small_batch_limits_is_all_answered_none_refused() -> None:
    """Issue 23: many short requests, closed loop, over instances with small batch limits:
    slots free up in bursts (several requests end before a woken waiter runs); every
    request is answered, none gets 429 (the wait of 30 s is a hang guard), and no request
    is left open or waiting."""

    async def main() -> None:
        engines = await _engines(3, ranks=1)
        svc = ScriptedEngineService()
        names = ["ds-a", "ds-b", "ds-c"]
        for name in names:
            svc.route(name, [1.0])
        limits = [2, 3, 2]
        svc.publish(
            DS,
            [
                instance(n, e.url, batch_limit=b)
                for n, e, b in zip(names, engines, limits, strict=True)
            ],
        )
        clients, per_client = 24, 15
        try:
            async with world(svc, batch_wait_s=30.0) as (router, url, s):
                await until(lambda: _routable(router) == set(names), what="all routable")

                async def client() -> list[int]:
                    got: list[int] = []
                    while len(got) < per_client and got.count(200) == len(got):
                        got.append((await complete(s, url, max_tokens=2))[0])
                    return got  # ends at its first refusal

                runs = await asyncio.gather(*(client() for _ in range(clients)))
                statuses = [st for got in runs for st in got]
                rejects = router.metrics.rejects.labels("default", "batch_full")._value.get()
                insts = list(router.state.instances.values())
                waiting = router.fleet.slots.waiting("default")
                served = [len(e.records) for e in engines]
        finally:
            await _stop(engines)
        assert statuses.count(200) == clients * per_client, sorted(set(statuses))
        assert rejects == 0 and waiting == 0
        assert [i.open_requests for i in insts] == [0, 0, 0]
        assert sum(served) == clients * per_client and min(served) > 0, served

    asyncio.run(main())


def test_demand_counts_a_request_when_it_arrives_queued_or_refused_not_a_bad_one() -> None:
    """Issue 23: a request is demand from its arrival (a queued one counts while it waits,
    and shows in ``router status`` and ``/metrics``); a request refused for its own fault
    (400) is not. (A 429 after its wait counts once: the batch-limit test.)"""

    async def main() -> None:
        (a,) = await _engines(1)
        svc = ScriptedEngineService()
        svc.route("ds-a", [1.0, 1.0])
        svc.publish(DS, [instance("ds-a", a.url, batch_limit=1)])
        a.hold(frozenset({0, 1}))
        try:
            async with world(svc, batch_queue=4, batch_wait_s=60.0) as (router, url, s):
                arrived = router.fleet.traffic.arrived.labels(DS)
                await until(lambda: _routable(router) == {"ds-a"}, what="ds-a routable")
                held = asyncio.create_task(complete(s, url, stream=True))
                await until(lambda: len(a.records) == 1, what="one request at the engine")
                queued = asyncio.create_task(complete(s, url))
                await until(lambda: router.fleet.slots.waiting("default") == 1, what="queued")
                assert arrived._value.get() == 2  # the queued one is demand already
                # status and /metrics show it waiting (open requests alone would not)
                table = await asyncio.to_thread(_status_table, url)
                assert "tier default: 1 waiting for a batch slot" in table, table
                async with s.get(url + "/metrics") as r:
                    scrape = await r.text()
                assert 'mixfleet_router_waiting_requests{tier="default"} 1.0' in scrape
                async with s.post(url + "/v1/completions", data=b"{not json") as r:
                    assert r.status == 400
                assert arrived._value.get() == 2
                a.release()
                assert (await held)[0] == 200 and (await queued)[0] == 200
                assert arrived._value.get() == 2 and len(a.records) == 2  # counted once each
                async with s.get(url + "/router/status") as r:
                    assert (await r.json())["waiting"] == {"default": 0}
        finally:
            await a.stop()

    asyncio.run(main())
