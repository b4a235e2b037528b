"""The serving simulator against hand-computed timelines, queueing theory and conservation
laws; determinism, overload, the router's split and input checks."""

from __future__ import annotations

import dataclasses

import pytest
from serving_builders import aggregated, disaggregated, flat_curve, linear_curve

from policies.errors import InputError
from policies.serving.plan import InstanceGroup, KvPath, Pool, ServingPlan
from policies.serving.simulate import SimOptions, SimReport, percentiles, simulate
from policies.serving.traffic import LengthDist, Slo, Traffic

SLO = Slo(ttft_ms=2000.0, tpot_ms=50.0)


def _traffic(rps: float, inp: LengthDist, out: LengthDist, **kw: object) -> Traffic:
    return Traffic(rps, inp, out, **kw)  # type: ignore[arg-type]


def _one(plan: ServingPlan, inp: int, out: int) -> SimReport:
    t = _traffic(1.0, LengthDist.constant(inp), LengthDist.constant(out))
    return simulate(plan, t, SLO, SimOptions(requests=1, seed=3))


def test_one_request_prefills_then_decodes_one_token_per_step() -> None:
    rec = _one(aggregated(flat_curve(decode_us=1000.0, prefill_us=5000.0)), 100, 5).records[0]
    assert rec.admitted_us == rec.arrival_us
    assert rec.first_token_us - rec.arrival_us == pytest.approx(5000.0)
    assert rec.finish_us - rec.first_token_us == pytest.approx(4 * 1000.0)
    assert rec.ttft_ms == pytest.approx(5.0)
    assert rec.tpot_ms == pytest.approx(1.0)


def test_a_long_prompt_is_prefilled_in_chunks() -> None:
    # chunks of 100, 100 and 50 tokens on a prefill of 2000 + 10 t us
    plan = aggregated(linear_curve(), chunk=100)
    rec = _one(plan, 250, 3).records[0]
    assert rec.ttft_ms * 1e3 == pytest.approx(2 * (2000 + 1000) + (2000 + 500))
    # then two decode steps of one sequence at contexts 251 and 252
    c = linear_curve()
    assert rec.finish_us - rec.first_token_us == pytest.approx(
        c.decode_us(1, 251) + c.decode_us(1, 252)
    )


def test_prefill_decode_adds_the_kv_transfer_exactly() -> None:
    pre, dec = flat_curve(prefill_us=5000.0), flat_curve(decode_us=1000.0)
    # 1000 tokens x 1e5 bytes = 1e8 bytes: 2000 us at 50 GB/s, 4000 us at 25 GB/s
    fast = _one(disaggregated(pre, dec, gbytes_per_s=50.0, latency_us=20.0), 1000, 4).records[0]
    slow = _one(disaggregated(pre, dec, gbytes_per_s=25.0, latency_us=20.0), 1000, 4).records[0]
    assert fast.ttft_ms * 1e3 == pytest.approx(5000.0 + 20.0 + 2000.0)
    assert slow.ttft_ms * 1e3 == pytest.approx(5000.0 + 20.0 + 4000.0)
    assert fast.finish_us - fast.first_token_us == pytest.approx(3 * 1000.0)
    assert fast.tpot_ms == slow.tpot_ms == pytest.approx(1.0)


def test_transfers_out_of_one_prefill_instance_take_turns_on_its_path() -> None:
    # three prompts of 1000 tokens (1e8 bytes of KV each, 2000 us at 50 GB/s) arriving
    # within microseconds: the first is prefilled alone (5000 us), the other two together
    # in the next forward; their transfers leave one after the other, each arriving 20 us
    # after its last byte; the decode steps are too short to delay an admission
    plan = disaggregated(flat_curve(prefill_us=5000.0), flat_curve(decode_us=1e-3), latency_us=20.0)
    t = _traffic(1e6, LengthDist.constant(1000), LengthDist.constant(2))
    r = simulate(plan, t, SLO, SimOptions(requests=3, seed=1))
    a, b, c = r.records
    assert a.first_token_us == pytest.approx(a.arrival_us + 5000.0 + 2000.0 + 20.0)
    second_forward_end = a.arrival_us + 2 * 5000.0
    assert b.admitted_us == c.admitted_us == pytest.approx(a.arrival_us + 5000.0)
    assert b.first_token_us == pytest.approx(second_forward_end + 2000.0 + 20.0, abs=0.01)
    assert c.first_token_us == pytest.approx(second_forward_end + 4000.0 + 20.0, abs=0.01)
    assert r.pools[0].kv_link_utilisation == pytest.approx(6000.0 / (r.duration_s * 1e6))


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_one_prompt_at_a_time_is_an_md1_queue(rho: float) -> None:
    # service S = 10 ms per request (one prompt per step, one output token): M/D/1, whose
    # mean wait is rho S / (2 (1 - rho)) (Pollaczek-Khinchine)
    s_ms = 10.0
    plan = aggregated(flat_curve(prefill_us=s_ms * 1e3), chunk=100, batch_limit=1)
    t = _traffic(rho / (s_ms / 1e3), LengthDist.constant(100), LengthDist.constant(1))
    r = simulate(plan, t, SLO, SimOptions(requests=40_000, seed=1, warmup_requests=1000))
    expected = s_ms + rho * s_ms / (2 * (1 - rho))
    assert r.ttft_ms.mean == pytest.approx(expected, rel=0.05)
    assert r.pools[0].groups[0].utilisation == pytest.approx(rho, rel=0.03)
    assert r.ttft_ms.p50 >= s_ms
    assert r.tpot_ms == percentiles([])  # one output token: no time per output token


def _busy_traffic(rps: float = 6.0, **kw: object) -> Traffic:
    return _traffic(rps, LengthDist(2000.0, 3500.0), LengthDist(200.0, 350.0), **kw)


def test_sequence_time_is_conserved_between_steps_and_requests() -> None:
    # time-weighted running sequences (summed over steps) = summed residence of requests
    plan = aggregated(linear_curve(), count=2, chunk=1024)
    r = simulate(plan, _busy_traffic(), SLO, SimOptions(requests=3000, seed=2))
    g = r.pools[0].groups[0]
    from_steps = g.mean_running * r.duration_s * 1e6 * g.instances
    from_requests = sum(x.finish_us - x.admitted_us for x in r.records)
    assert from_steps == pytest.approx(from_requests, rel=1e-9)
    assert r.completed == r.requests == 3000
    pd = ServingPlan(
        pools=(
            Pool(
                "pd",
                1.0,
                prefill=InstanceGroup(1, linear_curve()),
                decode=InstanceGroup(2, linear_curve()),
                kv_path=KvPath(50.0, 10.0),
            ),
        )
    )
    r = simulate(pd, _busy_traffic(), SLO, SimOptions(requests=3000, seed=2))
    dec = r.pools[0].groups[1]
    assert dec.role == "decode"
    assert dec.mean_running * r.duration_s * 1e6 * dec.instances == pytest.approx(
        sum(x.finish_us - x.first_token_us for x in r.records if x.output_tokens > 1),
        rel=1e-9,
    )


def test_littles_law_holds_for_the_requests_in_the_system() -> None:
    plan = aggregated(linear_curve(), count=2, chunk=2048)
    r = simulate(plan, _busy_traffic(), SLO, SimOptions(requests=20_000, seed=4))
    # L = lambda W with L measured by sweeping the arrivals and finishes over time
    events = sorted([(x.arrival_us, 1) for x in r.records] + [(x.finish_us, -1) for x in r.records])
    area, n, last = 0.0, 0, events[0][0]
    for t, step in events:
        area += n * (t - last)
        n, last = n + step, t
    span = events[-1][0] - events[0][0]
    mean_in_system = area / span
    lam = len(r.records) / span
    mean_sojourn = sum(x.finish_us - x.arrival_us for x in r.records) / len(r.records)
    assert mean_in_system == pytest.approx(lam * mean_sojourn, rel=1e-9)
    assert r.offered_rps == pytest.approx(6.0, rel=0.03)


def test_kv_capacity_bounds_the_sequences_admitted_at_once() -> None:
    # room for exactly two requests of 100 + 10 tokens
    plan = aggregated(flat_curve(kv_capacity_tokens=220, max_batch=2), chunk=8192)
    t = _traffic(2000.0, LengthDist.constant(100), LengthDist.constant(10))
    r = simulate(plan, t, SLO, SimOptions(requests=500, seed=1))
    edges = sorted([(x.admitted_us, 1) for x in r.records] + [(x.finish_us, -1) for x in r.records])
    running, most = 0, 0
    for _, step in edges:  # a finish and an admission at the same instant: finish first
        running += step
        most = max(most, running)
    assert most == 2
    assert r.pools[0].groups[0].max_queue > 100


def test_the_same_seed_gives_the_same_run_and_another_seed_another() -> None:
    plan = aggregated(linear_curve(), count=2)
    a = simulate(plan, _busy_traffic(), SLO, SimOptions(requests=500, seed=9))
    b = simulate(plan, _busy_traffic(), SLO, SimOptions(requests=500, seed=9))
    c = simulate(plan, _busy_traffic(), SLO, SimOptions(requests=500, seed=10))
    assert a == b
    assert a.records != c.records


def test_overload_grows_the_queue_and_loses_attainment() -> None:
    plan = aggregated(linear_curve(), batch_limit=16, chunk=2048)
    light = simulate(plan, _busy_traffic(0.5), SLO, SimOptions(requests=1000, seed=1))
    heavy = [
        simulate(plan, _busy_traffic(40.0), SLO, SimOptions(requests=n, seed=1))
        for n in (1000, 2000)
    ]
    assert light.attainment > 0.95 and light.slo_met
    assert heavy[1].pools[0].groups[0].max_queue > 1.5 * heavy[0].pools[0].groups[0].max_queue
    assert heavy[1].attainment < heavy[0].attainment < 0.5
    assert not heavy[0].slo_met
    assert heavy[1].ttft_ms.p90 > heavy[0].ttft_ms.p90 > 10 * light.ttft_ms.p90
    assert heavy[1].goodput_rps < light.goodput_rps
    # throughput saturates at what the instance serves; light load is served in full
    offered = 40.0 * 200.0
    assert heavy[1].throughput_tokens_per_s == pytest.approx(
        heavy[0].throughput_tokens_per_s, rel=0.1
    )
    assert heavy[1].throughput_tokens_per_s < 0.5 * offered
    assert light.throughput_tokens_per_s == pytest.approx(0.5 * 200.0, rel=0.15)


def test_bursty_arrivals_wait_longer_than_poisson_at_the_same_rate() -> None:
    plan = aggregated(linear_curve(), chunk=2048)
    opts = SimOptions(requests=4000, seed=5)
    poisson = simulate(plan, _busy_traffic(3.0), SLO, opts)
    bursty = simulate(plan, _busy_traffic(3.0, arrival="bursty", burst_cv=4.0), SLO, opts)
    assert bursty.ttft_ms.p99 > 2 * poisson.ttft_ms.p99
    assert bursty.offered_rps == pytest.approx(3.0, rel=0.15)


def test_the_router_splits_by_share_and_balances_instances() -> None:
    c = linear_curve()
    plan = ServingPlan(
        pools=(
            Pool("a", 3.0, instances=InstanceGroup(2, c, usd_per_hour=10.0)),
            Pool("b", 1.0, instances=InstanceGroup(1, c, usd_per_hour=30.0)),
        )
    )
    r = simulate(plan, _busy_traffic(4.0), SLO, SimOptions(requests=4000, seed=1))
    assert [p.requests for p in r.pools] == [3000, 1000]
    a = r.pools[0].groups[0]
    assert a.instances == 2 and a.steps > 0
    assert r.usd_per_hour == 2 * 10.0 + 30.0
    assert r.usd_per_million_tokens == pytest.approx(50.0 / 3600 / r.throughput_tokens_per_s * 1e6)


def test_goodput_counts_the_requests_within_both_slos() -> None:
    plan = aggregated(linear_curve(), batch_limit=32, chunk=2048)
    t = _busy_traffic(8.0)
    opts = SimOptions(requests=3000, seed=3, warmup_requests=200)
    first = simulate(plan, t, SLO, opts)  # the SLO does not change the run: set it at medians
    slo = Slo(ttft_ms=first.ttft_ms.p50, tpot_ms=first.tpot_ms.p50)
    r = simulate(plan, t, slo, opts)
    assert r.records == first.records
    measured = r.records[200:]
    good = [x for x in measured if x.ttft_ms <= slo.ttft_ms and x.tpot_ms <= slo.tpot_ms]
    assert r.requests == 2800 and r.met == len(good)
    assert 0 < r.met < r.requests
    assert r.attainment == pytest.approx(len(good) / 2800)
    assert r.goodput_rps == pytest.approx(len(good) / r.window_s)
    assert r.goodput_tokens_per_s == pytest.approx(sum(x.output_tokens for x in good) / r.window_s)
    assert r.window_s * 1e6 == pytest.approx(r.records[-1].arrival_us - r.records[199].arrival_us)


def test_a_time_limit_leaves_requests_unfinished_and_missed() -> None:
    plan = aggregated(linear_curve(), batch_limit=4)
    r = simulate(plan, _busy_traffic(20.0), SLO, SimOptions(requests=400, seed=1, max_sim_s=5.0))
    assert r.duration_s <= 5.0
    assert r.completed < r.requests
    assert any(x.finish_us < 0 for x in r.records)
    assert r.met <= r.completed


def _plan_with(**change: object) -> ServingPlan:
    pool = dataclasses.replace(aggregated(linear_curve()).pools[0], **change)  # type: ignore[arg-type]
    return ServingPlan(pools=(pool,))


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((ServingPlan(pools=()),), "plan.pools"),
        ((_plan_with(share=0.0),), "plan.pools[0].share"),
        ((_plan_with(name=""),), "plan.pools[0].name"),
        (
            (_plan_with(prefill=InstanceGroup(1, linear_curve())),),
            "plan.pools[0].instances",
        ),
        (
            (_plan_with(instances=InstanceGroup(0, linear_curve())),),
            "plan.pools[0].instances.count",
        ),
        (
            (_plan_with(instances=None, prefill=InstanceGroup(1, linear_curve())),),
            "plan.pools[0].decode",
        ),
    ],
)
def test_a_bad_plan_is_refused_naming_the_field(args: tuple[ServingPlan], field: str) -> None:
    with pytest.raises(InputError) as err:
        simulate(args[0], _busy_traffic(), SLO)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (SimOptions(requests=0), "options.requests"),
        (SimOptions(requests=10, warmup_requests=10), "options.warmupRequests"),
        (SimOptions(max_sim_s=-1.0), "options.maxSimS"),
        (SimOptions(seed=1.5), "options.seed"),  # type: ignore[arg-type]
    ],
)
def test_bad_options_are_refused(options: SimOptions, field: str) -> None:
    with pytest.raises(InputError) as err:
        simulate(aggregated(linear_curve()), _busy_traffic(), SLO, options)
    assert err.value.field == field


def test_bad_traffic_and_slo_are_refused() -> None:
    plan = aggregated(linear_curve())
    with pytest.raises(InputError) as err:
        simulate(plan, dataclasses.replace(_busy_traffic(), requests_per_s=-1.0), SLO)
    assert err.value.field == "traffic.requestsPerS"
    with pytest.raises(InputError) as err:
        simulate(plan, _busy_traffic(), Slo(ttft_ms=1.0, tpot_ms=1.0, percentile=100.0))
    assert err.value.field == "slo.percentile"
