"""Measured traffic (``ReportTraffic`` and ``/metrics``), the instance set's rules, a
deployment the controller does not know yet, a controller outage, and the ``--deployment``
family of flags."""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from mixfleet.v1 import engine_pb2
from router_world import complete, running_router, until
from support.openai_engine import LoopbackEngine
from support.scripted_controller import ScriptedEngineService, instance, scripted_controller

from controlplane.router.instances import instance_set
from controlplane.router.settings import Watched
from controlplane.router.traffic import Sample, TrafficBook
from policies.serving.traffic import Slo

if TYPE_CHECKING:
    from controlplane.router.proxy import Router

DS = "ds"
W = Watched(DS, "gold")


def _metric(text: str, name: str) -> float:
    """The value of the sample ``name`` (with its labels) in a /metrics page."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_traffic_is_reported_per_window_with_the_right_counts() -> None:
    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[2000.0]).start()
        svc = ScriptedEngineService()
        svc.route("ds-a", [1.0])
        svc.publish(DS, [instance("ds-a", engine.url)])
        slo = svc.sets[DS]  # a generous SLO: every streamed request meets it
        slo.slo_ttft_ms, slo.slo_tpot_ms, slo.slo_percentile = 600_000.0, 600_000.0, 90.0
        try:
            async with (
                scripted_controller(svc) as addr,
                running_router(
                    instances=(),
                    watched=(Watched(DS, "default"),),
                    controller=addr,
                    traffic_report_s=0.2,
                    reporter="r1",
                ) as router,
                aiohttp.ClientSession() as s,
            ):
                url = f"http://127.0.0.1:{router.port}"
                await until(lambda: "ds-a" in router.state.instances, what="instance listed")
                await until(lambda: bool(router.state.instances["ds-a"].planned), what="ranks")
                prompt = "x" * 40  # 10 tokens by the router's estimate (characters / 4)
                for _ in range(5):
                    st, _ = await complete(s, url, max_tokens=4, stream=True, prompt=prompt)
                    assert st == 200
                for _ in range(3):
                    assert (await complete(s, url, max_tokens=2, prompt=prompt))[0] == 200
                await until(lambda: sum(r.requests for r in svc.reports) == 8, what="8 reported")
                # a request's finish may be reported a window after its arrival
                await until(lambda: sum(r.slo_judged for r in svc.reports) >= 5, what="judged")
                metrics = await (await s.get(f"{url}/metrics")).text()
        finally:
            await engine.stop()
        assert {(r.deployment, r.reporter) for r in svc.reports} == {(DS, "r1")}
        assert all(r.end_unix_s > r.start_unix_s for r in svc.reports)
        busy = [r for r in svc.reports if r.output_tokens_mean > 0]
        assert all(r.input_tokens_mean == 10 for r in busy)
        lab = '{deployment="ds"}'
        assert _metric(metrics, f"mixfleet_router_traffic_requests_total{lab}") == 8
        assert _metric(metrics, f"mixfleet_router_traffic_input_tokens_total{lab}") == 80
        # streamed: 4 events each (the [DONE] line not counted); not streamed and no usage:
        # the request's max_tokens
        assert _metric(metrics, f"mixfleet_router_traffic_output_tokens_total{lab}") == 26
        assert _metric(metrics, f"mixfleet_router_traffic_ttft_seconds_count{lab}") == 5
        assert _metric(metrics, f"mixfleet_router_traffic_tpot_seconds_count{lab}") == 5
        assert max(r.ttft_ms_p99 for r in svc.reports) > 0
        # the SLO came with the instances: the 5 streamed requests judged, the others not
        assert sum(r.slo_judged for r in svc.reports) == sum(r.slo_met for r in svc.reports) == 5

    asyncio.run(main())


def test_a_failing_report_never_touches_requests_and_reports_resume() -> None:
    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[2000.0]).start()
        svc = ScriptedEngineService()
        svc.route("ds-a", [1.0])
        svc.publish(DS, [instance("ds-a", engine.url)])
        svc.refuse_reports = True
        try:
            async with (
                scripted_controller(svc) as addr,
                running_router(
                    instances=(),
                    watched=(Watched(DS, "default"),),
                    controller=addr,
                    traffic_report_s=0.1,
                ) as router,
                aiohttp.ClientSession() as s,
            ):
                url = f"http://127.0.0.1:{router.port}"
                await until(lambda: bool(router.state.instances.get("ds-a")), what="listed")
                await until(lambda: bool(router.state.instances["ds-a"].planned), what="ranks")
                failed = router.fleet.traffic.reports.labels(DS, "failed")
                await until(lambda: failed._value.get() >= 2, what="two failed reports")
                for _ in range(4):
                    assert (await complete(s, url))[0] == 200
                svc.refuse_reports = False
                await until(lambda: sum(r.requests for r in svc.reports) == 4, what="resumed")
        finally:
            await engine.stop()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_deployment_created_later_is_picked_up_and_an_outage_keeps_the_last_set() -> None:
    async def main() -> None:
        a = await LoopbackEngine(tokens_per_s=[2000.0]).start()
        b = await LoopbackEngine(tokens_per_s=[2000.0]).start()
        port = _free_port()
        svc = ScriptedEngineService()
        svc.route("ds-a", [1.0])
        try:
            async with (
                running_router(
                    instances=(), watched=(Watched(DS, "default"),), controller=f"127.0.0.1:{port}"
                ) as router,
                aiohttp.ClientSession() as s,
            ):
                url = f"http://127.0.0.1:{router.port}"
                async with scripted_controller(svc, port):
                    assert (await complete(s, url))[0] == 503  # NOT_FOUND: nothing to route
                    svc.publish(DS, [instance("ds-a", a.url)])
                    await until(lambda: bool(router.state.instances.get("ds-a")), what="found")
                    await until(lambda: bool(router.state.instances["ds-a"].planned))
                    assert (await complete(s, url))[0] == 200
                await until(lambda: not router.connected["instances/ds"], what="watch down")
                for _ in range(3):  # the last set and weights route meanwhile
                    assert (await complete(s, url))[0] == 200
                again = ScriptedEngineService()
                again.route("ds-a", [1.0])
                again.route("ds-b", [1.0])
                again.publish(DS, [instance("ds-a", a.url), instance("ds-b", b.url)])
                async with scripted_controller(again, port):
                    await until(
                        lambda: (
                            bool(router.state.instances.get("ds-b"))
                            and bool(router.state.instances["ds-b"].planned)
                        ),
                        what="the new set after reconnecting",
                    )
                    for _ in range(4):
                        assert (await complete(s, url))[0] == 200
            assert (len(a.records), len(b.records)) == (6, 2)
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


def test_instance_set_rules() -> None:
    def inst(name: str, role: str, pool: str, **kw: Any) -> engine_pb2.Instance:
        return instance(name, f"http://10.0.0.{len(name)}:30000", role=role, pool=pool, **kw)

    msg = engine_pb2.Instances(
        deployment=DS,
        engine="sglang",
        generation=7,
        instances=[
            inst("a", "aggregated", "agg", rps=2.0, batch_limit=8),
            inst("p1", "prefill", "p", bootstrap_port=9001),
            inst("p22", "prefill", "p", bootstrap_port=9002, ready=False),
            inst("d1", "decode", "p", rps=3.0, batch_limit=4),
            inst("d22", "decode", "p", rps=5.0, batch_limit=6),
            inst("d333", "decode", "p", rps=7.0, batch_limit=9, draining=True),
            engine_pb2.Instance(name="d4444", role="decode", pool="p"),  # not placed: no url
            inst("x", "prefill", "only-prefill"),
            inst("y", "encode", "z"),
        ],
    )
    got = instance_set(msg, W)
    by = {i.spec.name: i for i in got.listed}
    assert set(by) == {"a", "ds/p"} and got.generation == 7
    a, pair = by["a"].spec, by["ds/p"].spec
    assert (a.tier, a.deployment, a.source, a.share, a.batch_limit) == ("gold", "a", DS, 2.0, 8)
    assert pair.prefill == ("http://10.0.0.2:30000",) and pair.bootstrap_ports == (9001,)
    assert pair.decode == ("http://10.0.0.2:30000", "http://10.0.0.3:30000")
    assert (pair.pd, pair.deployment, pair.share, pair.batch_limit) == ("sglang", "d1", 8.0, 10)
    assert by["ds/p"].routable and len(got.skipped) == 2  # no decode side; unknown role
    trt = instance_set(
        engine_pb2.Instances(deployment=DS, engine="trtllm", instances=msg.instances[1:4]), W
    )
    assert not trt.listed and "TensorRT-LLM" in trt.skipped[0]
    idle = engine_pb2.Instances(
        deployment=DS,
        engine="vllm",
        instances=[inst("a", "aggregated", "agg"), inst("b", "aggregated", "agg", ready=False)],
    )
    shares = {i.spec.name: (i.spec.share, i.routable) for i in instance_set(idle, W).listed}
    assert shares == {"a": (None, True), "b": (None, False)}  # all 0 req/s: by ranks


def test_sample_counts_usage_then_events_then_the_expected_output() -> None:
    s = Sample(DS, 0.0, prompt_tokens=10, expected_output=50)
    s.answer(200, "text/event-stream")
    for i in range(1, 4):
        s.body(
            b'data: {"text": "t", "meta_info": {"prompt_tokens": 7, "completion_tokens": %d}}\n\n'
            % i
        )
    s.body(b"data: [DONE]\n\n")
    assert s.counts() == (7, 3)  # SGLang's cumulative meta_info: the last one
    s = Sample(DS, 0.0, prompt_tokens=10, expected_output=50)
    s.answer(200, "text/event-stream")
    s.body(b'data: {"choices": []}\n\ndata: {"choices": []}\n\ndata: [DONE]\n\n')
    assert s.counts() == (10, 2)  # no usage: the events but [DONE]; the router's estimate
    s = Sample(DS, 0.0, prompt_tokens=10, expected_output=50)
    s.answer(200, "application/json")
    s.body(b'{"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 30}}')
    assert s.counts() == (12, 30)
    s = Sample(DS, 0.0, prompt_tokens=10, expected_output=50)
    s.answer(200, "application/json")
    s.body(b'{"choices": []}')
    assert s.counts() == (10, 50)


def test_a_window_report_has_the_window_figures() -> None:
    from prometheus_client import CollectorRegistry

    now = [100.0]
    book = TrafficBook([DS], CollectorRegistry(), clock=lambda: now[0])
    for i in range(10):
        book.arrive(DS)
        s = Sample(DS, 0.0, prompt_tokens=10 * (i + 1), expected_output=4)
        s.answer(200, "text/event-stream")
        s.first_s, s.last_s, s.events = 0.05, 0.05 + 0.01 * 3, 5  # 4 tokens, then [DONE]
        s.last = b"data: [DONE]\n\n"
        book.finish(s)
    book.arrive("other")  # not watched: ignored
    now[0] = 110.0
    r = book.close(DS, "me")
    assert (r.start_unix_s, r.end_unix_s, r.requests) == (100.0, 110.0, 10)
    assert r.input_tokens_mean == 55 and r.input_tokens_p90 == pytest.approx(91)
    assert (r.output_tokens_mean, r.output_tokens_p90) == (4, 4)
    assert r.ttft_ms_p50 == pytest.approx(50) and r.tpot_ms_p99 == pytest.approx(10)
    now[0] = 120.0
    empty = book.close(DS, "me")
    assert (empty.start_unix_s, empty.requests, empty.ttft_ms_p50) == (110.0, 0, 0)


def _streamed(first_s: float, last_s: float, tokens: int, *, stream: bool = True) -> Sample:
    """A finished answer of ``tokens`` output tokens, arrived at 0 (seconds)."""
    s = Sample(DS, 0.0, prompt_tokens=8, expected_output=tokens)
    s.answer(200, "text/event-stream" if stream else "application/json")
    s.first_s, s.last_s = first_s, last_s
    s.last = f'{{"usage": {{"completion_tokens": {tokens}}}}}'.encode()
    return s


def test_slo_counts_streamed_requests_meeting_each_target() -> None:
    from prometheus_client import CollectorRegistry

    book = TrafficBook([DS], CollectorRegistry(), clock=lambda: 100.0)
    book.finish(_streamed(0.05, 0.35, 4))  # before any SLO: not judged
    book.set_slo(DS, Slo(ttft_ms=100, tpot_ms=20))
    book.finish(_streamed(0.05, 0.08, 4))  # TTFT 50 ms, TPOT 10 ms: met
    book.finish(_streamed(0.15, 0.18, 4))  # TTFT 150 ms: missed
    book.finish(_streamed(0.05, 0.35, 4))  # TPOT 100 ms: missed
    book.finish(_streamed(0.05, 0.05, 1))  # one token, no TPOT, TTFT met: met
    book.finish(_streamed(0.0, 0.0, 4, stream=False))  # not streamed: not judged
    failed = _streamed(0.05, 0.08, 4)
    failed.status = 500
    book.finish(failed)  # no answer counts: not judged
    r = book.close(DS, "me")
    assert (r.slo_judged, r.slo_met) == (4, 2)
    book.set_slo(DS, Slo(ttft_ms=0, tpot_ms=20, percentile=90))  # TTFT without target
    book.finish(_streamed(0.15, 0.18, 4))
    book.set_slo(DS, Slo(ttft_ms=100, tpot_ms=20, percentile=0))  # no SLO any more
    book.finish(_streamed(0.05, 0.08, 4))
    r = book.close(DS, "me")
    assert (r.slo_judged, r.slo_met) == (1, 1)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--deployment", "ds"], "--controller"),
        (["--deployment", "", "--controller", "c:1"], "--deployment"),
        (["--deployment", "ds,pool=x", "--controller", "c:1"], "tier=TIER"),
        (["--deployment", "ds", "--deployment", "ds", "--controller", "c:1"], "twice"),
        (["--deployment", "ds", "--controller", "c:1", "--batch-wait-s", "0"], "--batch-wait-s"),
        (["--deployment", "ds", "--controller", "c:1", "--batch-queue", "-1"], "--batch-queue"),
        (["--deployment", "ds", "--controller", "c:1", "--traffic-report-s", "x"], "traffic"),
        (["--deployment", "ds", "--controller", "c:1", "--reporter", ""], "--reporter"),
    ],
)
def test_bad_deployment_flags_are_one_error_line(argv: list[str], expected: str) -> None:
    from controlplane.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["router", "run", *argv])
    lines = err.getvalue().strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error:"), err.getvalue()
    assert expected in lines[0], lines[0]


def test_slot_queue_wakes_in_arrival_order_is_bounded_and_passes_an_unused_wake_on() -> None:
    from controlplane.router.fleet import SlotQueue

    async def main() -> None:
        q = SlotQueue(limit=3)
        far = asyncio.get_running_loop().time() + 60.0
        order: list[int] = []

        async def waiter(i: int) -> None:
            if await q.wait("t", far):
                order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
        await until(lambda: q.waiting("t") == 3, what="three waiting")
        assert not await q.wait("t", far)  # the fourth: the queue is full
        q.wake("t")
        q.wake("t")
        await until(lambda: len(order) == 2, what="two woken")
        assert order == [0, 1]
        late = asyncio.create_task(waiter(3))
        await until(lambda: q.waiting("t") == 2)
        q.wake("t")  # wakes waiter 2, which is cancelled before it runs: 3 gets the slot
        tasks[2].cancel()
        await until(lambda: order == [0, 1, 3], what="the wake passed on")
        await asyncio.gather(*tasks, late, return_exceptions=True)
        assert q.waiting("t") == 0

    asyncio.run(main())


def test_a_woken_request_that_found_no_slot_goes_back_to_its_place_even_in_a_full_queue() -> None:
    from controlplane.router.fleet import SlotQueue

    async def main() -> None:
        q = SlotQueue(limit=1)
        far = asyncio.get_running_loop().time() + 60.0
        first = q.place()
        woken = asyncio.create_task(q.wait("t", far, first))
        await until(lambda: q.waiting("t") == 1, what="the first waiting")
        q.wake("t")
        assert await woken
        later = asyncio.create_task(q.wait("t", far))  # came later; fills the queue
        await until(lambda: q.waiting("t") == 1, what="the later one waiting")
        assert not await q.wait("t", far)  # a new request: the queue is full
        back = asyncio.create_task(q.wait("t", far, first, again=True))
        await until(lambda: q.waiting("t") == 2, what="back in the queue, over its limit")
        q.wake("t")
        assert await back and not later.done()  # its place was ahead of the later one
        q.wake("t")
        assert await later and q.waiting("t") == 0

    asyncio.run(main())


def _capped_router(batch_limit: int) -> Router:
    """A router (not started: no socket, no engine) with one static instance ``x`` of
    ``batch_limit`` slots, admitted, for driving its slot queue by hand."""
    from controlplane.router.proxy import Router
    from controlplane.router.settings import InstanceSpec, RouterSettings, check

    spec = InstanceSpec("x", "http://127.0.0.1:9", "t", batch_limit=batch_limit)
    router = Router(check(RouterSettings(instances=(spec,), default_tier="t", batch_wait_s=600)))
    router.health.admit_all(router.state.instances)
    return router


def test_every_freed_slot_wakes_a_waiting_request_even_two_before_the_first_one_runs() -> None:
    """Issue 23: two requests end before the waiter woken by the first runs; the second
    freed slot must wake the next waiter too (else it waits while the instance is idle)."""
    from controlplane.router.fleet import Turn

    async def main() -> None:
        router = _capped_router(batch_limit=2)
        fleet, x = router.fleet, router.state.instances["x"]
        held = [await fleet.claim("t", 10.0, (), Turn()) for _ in range(2)]
        assert x.open_requests == 2 and router.state.full == {"x"}
        waiters = [asyncio.create_task(fleet.claim("t", 10.0, (), Turn())) for _ in range(3)]
        await until(lambda: fleet.slots.waiting("t") == 3, what="three waiting")
        for c in held:  # both end in one go: no waiter runs in between
            assert c.rank is not None
            fleet.finished(c.rank, 10.0)
        await until(lambda: waiters[0].done() and waiters[1].done(), what="two slots, two go")
        await asyncio.sleep(0)
        assert not waiters[2].done() and fleet.slots.waiting("t") == 1  # in arrival order
        got = [w.result() for w in waiters[:2]]
        assert all(c.rank is not None for c in got)
        assert x.open_requests == 2 and router.state.full == {"x"}  # no slot given twice
        # a new arrival queues behind waiter 2; waiter 2 is woken by a freed slot and
        # cancelled before it runs: the slot passes on to the new arrival
        late = asyncio.create_task(fleet.claim("t", 10.0, (), Turn()))
        await until(lambda: fleet.slots.waiting("t") == 2, what="the late one queued")
        assert got[0].rank is not None
        fleet.finished(got[0].rank, 10.0)
        waiters[2].cancel()
        passed = await asyncio.wait_for(late, 60)  # a hang guard, not a speed claim
        assert passed.rank is not None and x.open_requests == 2
        assert fleet.slots.waiting("t") == 0
        for c in (got[1], passed):
            assert c.rank is not None
            fleet.finished(c.rank, 10.0)
        assert x.open_requests == 0 and not router.state.full

    asyncio.run(main())


def test_each_worker_reports_under_its_own_name() -> None:
    from controlplane.router.settings import RouterSettings
    from controlplane.router.workers import as_worker

    base = RouterSettings(instances=(), watched=(W,), reporter="edge-1")
    assert [as_worker(base, i).reporter for i in range(3)] == ["edge-1/0", "edge-1/1", "edge-1/2"]
    assert as_worker(base, 1).watched == base.watched
