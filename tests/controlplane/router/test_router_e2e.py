"""The router against real HTTP servers on loopback and a real controller: planned shares,
live weight changes, ejection, no half-streamed retry, 429, controller outage."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import aiohttp
import grpc
from mixfleet.v1 import engine_pb2, engine_pb2_grpc
from router_world import closed_loop, complete, controlled, running_router, until
from support.openai_engine import LoopbackEngine

from controlplane.router.settings import InstanceSpec

WEIGHTS = [1.5, 1.0, 0.5, 1.0, 1.5, 0.5]  # mean 1; 24 clients hold 6/4/2/4/6/2 open


def _status_table(url: str) -> str:
    """``mixfleetctl router status`` against a running router; its stdout."""
    import contextlib
    import io

    from controlplane.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["router", "status", "--router", url]) == 0
    return buf.getvalue()


def _planned(weights: list[float]) -> list[float]:
    return [w / sum(weights) for w in weights]


def _mx(engine: LoopbackEngine, name: str = "e0", kind: str = "") -> InstanceSpec:
    return InstanceSpec(name, engine.url, "default", deployment="mx", engine=kind)


def test_shares_follow_the_plan_and_a_new_version_applies_without_dropping_streams(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[2000.0] * 6).start()
        async with (
            controlled(tmp_path) as w,
            running_router(instances=(_mx(engine),), controller=w.ctl.address) as router,
            aiohttp.ClientSession() as s,
        ):
            url = f"http://127.0.0.1:{router.port}"
            w.commit_weights(WEIGHTS)
            await until(lambda: router.state.instances["e0"].version == 2, what="v2 weights")
            statuses = await closed_loop(s, url, clients=24, requests=1200)
            assert set(statuses) == {200}
            assert all(r.pinned for r in engine.records)  # routed_dp_rank in every body
            for got, want in zip(engine.share(), _planned(WEIGHTS), strict=True):
                assert abs(got - want) <= 0.02, (engine.share(), _planned(WEIGHTS))
            status = await (await s.get(f"{url}/router/status")).json()
            achieved = [r["achieved_share"] for r in status["tiers"]["default"]]
            assert max(abs(a - b) for a, b in zip(achieved, engine.share(), strict=True)) < 1e-5
            metrics = await (await s.get(f"{url}/metrics")).text()
            assert (
                'mixfleet_router_share{instance="e0",kind="planned",rank="0",tier="default"}'
                in metrics
            )

            # Streams held open by the engine, then a new version: applied while every one
            # of them is still open, none dropped (how soon: bench/router.py measures it).
            engine.records.clear()
            engine.hold(frozenset(range(6)))
            streams = [
                asyncio.create_task(complete(s, url, max_tokens=30, stream=True)) for _ in range(12)
            ]
            await until(lambda: len(engine.records) == 12, timeout_s=60, what="streams open")
            new = [0.25, 0.25, 0.25, 1.75, 1.75, 1.75]
            w.commit_weights(new)
            await until(lambda: router.state.instances["e0"].version == 3, timeout_s=60, what="v3")
            assert not any(r.done for r in engine.records) and not any(t.done() for t in streams)
            engine.release()
            for status_code, text in await asyncio.gather(*streams):
                assert status_code == 200 and text.count("data: ") == 31
                assert text.endswith("data: [DONE]\n\n")
            engine.records.clear()
            assert set(await closed_loop(s, url, clients=24, requests=600)) == {200}
            for got, want in zip(engine.share(), _planned(new), strict=True):
                assert abs(got - want) <= 0.02, (engine.share(), _planned(new))
        await engine.stop()

    asyncio.run(main())


def test_a_slower_rank_receives_less_work_and_vllm_gets_the_header(tmp_path: Path) -> None:
    # Rank 0 holds every request it gets until the others have served the rest: the slowest
    # a rank can be, so what it receives follows from the backed-up rule alone, not from how
    # fast this machine runs the other ranks.
    total, clients = 300, 12

    async def main() -> None:
        engine = await LoopbackEngine(
            engine="vllm", tokens_per_s=[4000.0] * 6, held=frozenset({0})
        ).start()
        async with (
            controlled(tmp_path) as w,
            running_router(
                instances=(_mx(engine, kind="vllm"),), controller=w.ctl.address
            ) as router,
            aiohttp.ClientSession() as s,
        ):
            w.commit_weights([1.0] * 6)
            await until(lambda: router.state.instances["e0"].version == 2, what="equal weights")
            url = f"http://127.0.0.1:{router.port}"
            load = asyncio.create_task(
                closed_loop(s, url, clients=clients, requests=total, max_tokens=8)
            )

            def others_done() -> bool:
                recs = engine.records
                held = sum(r.rank == 0 for r in recs)
                return len(recs) == total and sum(r.done for r in recs) == total - held

            # a bound on the test's own run only (pytest-timeout is the outer one)
            await until(others_done, timeout_s=240, what="every other request served")
            held = sum(r.rank == 0 for r in engine.records)
            engine.release()
            assert set(await load) == {200}
            share = engine.share()
            assert all(r.pinned for r in engine.records)  # X-data-parallel-rank header
            # the other clients kept being served while rank 0 held its requests ...
            assert 1 <= held < clients, held
            # ... and it received less than half the work of any other rank
            assert share[0] < 0.5 * min(share[1:]), share
        await engine.stop()

    asyncio.run(main())


def test_killed_instance_is_ejected_and_half_streamed_requests_are_not_retried(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        a = await LoopbackEngine(tokens_per_s=[50.0] * 6).start()
        b = await LoopbackEngine(tokens_per_s=[50.0] * 6).start()
        async with (
            controlled(tmp_path) as w,
            running_router(
                instances=(_mx(a, "a"), _mx(b, "b")), controller=w.ctl.address
            ) as router,
            aiohttp.ClientSession() as s,
        ):
            url = f"http://127.0.0.1:{router.port}"
            await until(lambda: router.state.instances["b"].version == 1, what="weights")
            ids = [uuid.uuid4().hex for _ in range(12)]
            streams = [
                asyncio.create_task(complete(s, url, max_tokens=40, stream=True, request_id=i))
                for i in ids
            ]
            await until(
                lambda: sum(r.tokens > 2 for r in a.records + b.records) == 12,
                what="every stream sent tokens",
            )
            on_a = {r.request_id for r in a.records}
            assert on_a and len(on_a) < 12
            a.kill()
            results = await asyncio.gather(*streams, return_exceptions=True)
            for rid, res in zip(ids, results, strict=True):
                if rid in on_a:  # cut: an error, or a truncated stream without [DONE]
                    assert isinstance(res, BaseException) or not res[1].endswith("[DONE]\n\n")
                else:
                    assert not isinstance(res, BaseException) and res[1].endswith("[DONE]\n\n")
            assert not on_a & {r.request_id for r in b.records}  # none generated twice
            await until(lambda: "a" not in router.health.healthy, what="a ejected")
            b.records.clear()
            statuses = [(await complete(s, url))[0] for _ in range(20)]
            assert statuses == [200] * 20 and len(b.records) == 20
            await a.start()  # recovers on its port: re-admitted
            await until(lambda: "a" in router.health.healthy, what="a re-admitted")
        await a.stop()
        await b.stop()

    asyncio.run(main())


def test_request_that_got_nothing_back_is_retried_on_another_instance(tmp_path: Path) -> None:
    async def main() -> None:
        a = await LoopbackEngine(tokens_per_s=[1000.0] * 2).start()
        b = await LoopbackEngine(tokens_per_s=[1000.0] * 2).start()
        specs = (
            InstanceSpec("a", a.url, "default", ranks=2),
            InstanceSpec("b", b.url, "default", ranks=2),
        )
        async with (
            running_router(instances=specs, health_interval_s=30.0) as router,
            aiohttp.ClientSession() as s,
        ):
            url = f"http://127.0.0.1:{router.port}"
            a.kill()  # the health check will not notice for 30 s: requests find out
            statuses = [(await complete(s, url))[0] for _ in range(10)]
            assert statuses == [200] * 10 and len(b.records) == 10
            assert "a" not in router.health.healthy
            assert router.metrics.retries._value.get() >= 1
        await a.stop()
        await b.stop()

    asyncio.run(main())


def test_429_with_retry_after_when_every_rank_is_full() -> None:
    async def main() -> None:
        e = await LoopbackEngine(tokens_per_s=[20.0] * 2).start()
        specs = (InstanceSpec("e", e.url, "default", ranks=2),)
        async with (
            running_router(instances=specs, queue_limit=2, retry_after_s=3) as router,
            aiohttp.ClientSession() as s,
        ):
            url = f"http://127.0.0.1:{router.port}"
            held = [
                asyncio.create_task(complete(s, url, max_tokens=20, stream=True)) for _ in range(4)
            ]
            await until(lambda: len(e.records) == 4, what="4 open")
            body = {"model": "m", "prompt": "x", "max_tokens": 1}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "3"
            assert [x[0] for x in await asyncio.gather(*held)] == [200] * 4
            assert (await complete(s, url))[0] == 200  # room again
            assert router.metrics.rejects.labels("default", "overloaded")._value.get() == 1
            out = await asyncio.to_thread(_status_table, url)
            assert "e" in out and "0.500" in out  # two equal ranks: planned share 0.5 each
        await e.stop()

    asyncio.run(main())


def test_routing_continues_on_the_last_weights_with_the_controller_down(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[2000.0] * 6).start()
        async with (
            controlled(tmp_path) as w,
            running_router(instances=(_mx(engine),), controller=w.ctl.address) as router,
            aiohttp.ClientSession() as s,
        ):
            url = f"http://127.0.0.1:{router.port}"
            async with grpc.aio.insecure_channel(w.ctl.address) as ch:
                routing = await engine_pb2_grpc.EngineServiceStub(ch).GetRouting(
                    engine_pb2.GetRoutingRequest(
                        deployment="mx", format=engine_pb2.ROUTING_FORMAT_NATIVE
                    )
                )
            assert list(routing.dp_ranks) == list(range(6))  # one DP rank per GPU here
            assert (routing.engine, routing.dp_balance) == ("native", "router")
            w.commit_weights(WEIGHTS)
            await until(lambda: router.state.instances["e0"].version == 2, what="v2")
            await w.ctl.server.stop(grace=None)
            await until(lambda: not router.connected["mx"], what="watch dropped")
            assert set(await closed_loop(s, url, clients=24, requests=600)) == {200}
            for got, want in zip(engine.share(), _planned(WEIGHTS), strict=True):
                assert abs(got - want) <= 0.02
        await engine.stop()

    asyncio.run(main())


def test_trtllm_requests_carry_no_rank_field_which_trtllm_serve_would_refuse() -> None:
    async def main() -> None:
        e = await LoopbackEngine(engine="trtllm", tokens_per_s=[2000.0] * 2).start()
        specs = (InstanceSpec("t", e.url, "default", engine="trtllm", ranks=2),)
        async with running_router(instances=specs) as router, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}"
            assert [(await complete(s, url))[0] for _ in range(4)] == [200] * 4
            assert not any(r.pinned for r in e.records)  # the engine balanced them itself
            body = {"model": "m", "prompt": "x", "attention_dp_rank": 0}
            async with s.post(f"{e.url}/v1/completions", json=body) as r:
                assert r.status == 400 and "Extra inputs" in (await r.json())["error"]
        await e.stop()

    asyncio.run(main())
