"""The queueing bound the planner sizes capacity with: Erlang C against its closed forms and
the textbook recursion, the SLO rate against its own tail, and one aggregated instance's
sized capacity against the serving simulator run to steady state."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from policies.fleetplan import queueing
from policies.fleetplan.queueing import (
    EXACT_UP_TO,
    delay_chance,
    erlang_c,
    peakedness,
    slo_rate,
    wait_tail,
)
from policies.fleetplan.sizing import size_aggregated
from policies.serving.curves import StepCurve
from policies.serving.plan import InstanceGroup, Pool, ServingPlan
from policies.serving.simulate import SimOptions, simulate
from policies.serving.traffic import LengthDist, Slo, Traffic


def _recursion(c: int, a: float) -> float:
    """Erlang C by the Erlang B recursion B(k) = a B(k-1) / (k + a B(k-1))."""
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1.0 - rho + rho * b)


def test_erlang_c_closed_forms_and_recursion(monkeypatch: pytest.MonkeyPatch) -> None:
    assert erlang_c(1, 0.7) == pytest.approx(0.7)  # M/M/1: an arrival waits w.p. rho
    assert erlang_c(2, 1.0) == pytest.approx(1.0 / 3.0)  # B = 0.2, C = 0.2 / 0.6
    for c, a in ((8, 6.5), (50, 45.0)):
        assert erlang_c(c, a) == pytest.approx(_recursion(c, a), rel=1e-9)
    assert erlang_c(10, 0.0) == 0.0 and erlang_c(10, 10.0) == 1.0
    with monkeypatch.context() as m:  # the exact sum at any size
        m.setattr(queueing, "EXACT_UP_TO", 1 << 20)
        for c, a in ((700, 690.0), (3000, 2950.0), (3000, 1200.0)):
            assert erlang_c(c, a) == pytest.approx(_recursion(c, a), rel=1e-9)
    # Above EXACT_UP_TO slots, the Halfin-Whitt limit: close to the recursion near full load.
    for c in (2 * EXACT_UP_TO, 4096):
        for rho in (0.98, 0.99, 0.995):
            assert erlang_c(c, rho * c) == pytest.approx(_recursion(c, rho * c), rel=0.02)


def test_slo_rate_above_the_exact_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SLO rate by the Halfin-Whitt limit is within 0.3% of the exact one."""
    approx = [slo_rate(c, 50.0, 1.8, 0.1, 0.04) for c in (128, 512, 2048)]
    monkeypatch.setattr(queueing, "EXACT_UP_TO", 1 << 20)
    exact = [slo_rate(c, 50.0, 1.8, 0.1, 0.04) for c in (128, 512, 2048)]
    assert approx == pytest.approx(exact, rel=0.003)
    assert approx != exact


def test_slo_rate_is_the_largest_rate_within_the_tail() -> None:
    c, hold, wait, miss = 64, 20.0, 1.0, 0.1
    r = slo_rate(c, hold, wait, miss, cv2=0.05)
    assert wait_tail(c, hold, r, wait, 0.05) <= miss
    assert wait_tail(c, hold, r * 1.001, wait, 0.05) > miss
    assert r < c / hold
    # Many slots queue later than few at the same utilisation.
    share = [slo_rate(n, hold, wait, miss, 0.05) * hold / n for n in (32, 256, 4096)]
    assert share[0] < share[1] < share[2] < 1.0
    assert share[0] < 0.9 and share[2] > 0.98
    # A larger slack or a looser percentile takes more.
    assert slo_rate(c, hold, 2 * wait, miss, 0.05) > r
    assert slo_rate(c, hold, wait, 0.2, 0.05) > r
    assert slo_rate(c, hold, wait, 1.0, 0.05) == pytest.approx(c / hold)


def _curve() -> StepCurve:
    """Step 20 ms + 0.5 ms per sequence; prefill 10 ms + 10 us per token."""
    batches = (1, 64, 256)
    return StepCurve(
        batch_grid=batches,
        context_grid=(128, 2048),
        decode_step_us=tuple((20_000.0 + 500 * b, 20_000.0 + 500 * b) for b in batches),
        prefill_grid=(1, 8192),
        prefill_us=(10_000.0, 10_000.0 + 10 * 8192),
        max_batch=256,
        kv_bytes_per_token=1000.0,
        kv_capacity_tokens=24 * (256 + 64),  # 24 sequences of 256 + 64 tokens
    )


def _max_rate(plan: ServingPlan, tr: Traffic, slo: Slo, hi: float) -> float:
    """The largest rate at which the simulator keeps the SLO's percentile, a long run (a
    warm-up and a measured window of many request lifetimes), bisected."""
    lo = 0.0
    for _ in range(12):
        mid = (lo + hi) / 2
        rep = simulate(plan, replace(tr, requests_per_s=mid), slo, SimOptions(30_000, 1, 10_000))
        if rep.attainment >= slo.percentile / 100.0:
            lo = mid
        else:
            hi = mid
    return lo


def test_queueing_capacity_of_a_small_instance_against_the_simulator() -> None:
    """24 slots (its KV room): the flat 85% of the rate at the batch limit overstates
    what it holds within the TTFT target, the queueing bound is within 6% of the
    simulator's steady state."""
    tr = Traffic(1.0, LengthDist(256, 320), LengthDist(64, 80))
    slo = Slo(ttft_ms=300, tpot_ms=50, percentile=90)
    flat = size_aggregated(_curve(), tr, slo, utilisation=1.0)
    queued = size_aggregated(_curve(), tr, slo, utilisation=1.0, queueing=True)
    assert flat.batch_limit == queued.batch_limit == 24
    assert queued.requests_per_s < 0.85 * flat.requests_per_s
    g = InstanceGroup(1, _curve(), batch_limit=24)
    sim = _max_rate(ServingPlan((Pool("p", 1.0, instances=g),)), tr, slo, flat.requests_per_s)
    assert sim < 0.85 * flat.requests_per_s
    assert queued.requests_per_s == pytest.approx(sim, rel=0.06)
    assert not math.isclose(queued.requests_per_s, flat.requests_per_s)


def test_a_prefill_limited_pair_against_the_simulator() -> None:
    """A prefill instance is one server working through the prompts, a share of a forward
    each: a prompt waits past its TTFT target when the prompts ahead outlast its own
    forward's spare budget. The bound counts that wait (Poisson, then bursty arrivals,
    which wait longer) and stays within 6% of the simulator's steady state; without it the
    pair was rated at the prefill's full rate."""
    from policies.fleetplan.sizing import size_pair
    from policies.serving.plan import KvPath

    tr = Traffic(1.0, LengthDist(2048, 2560), LengthDist(32, 40))
    slo = Slo(ttft_ms=400, tpot_ms=50, percentile=90)
    batches = (1, 64, 1024)
    decode = replace(  # 5 ms + 10 us per sequence: far from limiting
        _curve(),
        batch_grid=batches,
        decode_step_us=tuple((5_000.0 + 10 * b, 5_000.0 + 10 * b) for b in batches),
        max_batch=1024,
        kv_capacity_tokens=10**8,
    )
    rates = []
    for traffic in (tr, replace(tr, arrival="bursty", burst_cv=2.0)):
        flat, sized = (
            size_pair(
                _curve(),
                decode,
                traffic,
                slo,
                kv_gbytes_per_s=50.0,
                kv_latency_us=0.0,
                prefill_nic_gbytes_per_s=1e3,
                decode_nic_gbytes_per_s=1e3,
                utilisation=1.0,
                queueing=queueing,
            )
            for queueing in (False, True)
        )
        assert sized.prefill.batch_limit == flat.prefill.batch_limit
        assert sized.prefill.requests_per_s < flat.prefill.requests_per_s
        assert sized.prefill.requests_per_s < sized.decode.requests_per_s  # prefill-limited
        budget = sized.prefill.batch_limit
        pool = Pool(
            "p",
            1.0,
            prefill=InstanceGroup(1, _curve(), chunk_tokens=budget),
            decode=InstanceGroup(1, decode, batch_limit=sized.decode.batch_limit),
            kv_path=KvPath(50.0),
        )
        sim = _max_rate(ServingPlan((pool,)), traffic, slo, flat.prefill.requests_per_s)
        assert sized.prefill.requests_per_s == pytest.approx(sim, rel=0.06)
        rates.append(sized.prefill.requests_per_s)
    assert rates[1] < rates[0]


def test_bursty_arrivals_wait_longer_and_poisson_ones_as_before() -> None:
    args = (24, 2.0, 0.5, 0.1, 0.05)
    assert slo_rate(*args) == slo_rate(*args, 1.0)
    assert slo_rate(*args, 4.0) < slo_rate(*args) < slo_rate(*args, 0.25)
    assert wait_tail(24, 2.0, 10.0, 0.5, 0.05, 4.0) > wait_tail(24, 2.0, 10.0, 0.5, 0.05)


def test_bursty_arrivals_wait_more_often_as_fewer_slots_would() -> None:
    """Hayward's approximation: Erlang C at ``c / z`` slots and the same utilisation."""
    assert peakedness(1.0, 0.05) == 1.0  # Poisson
    assert peakedness(4.0, 0.0) == 4.0  # fixed hold times: the gaps' own variation
    assert peakedness(4.0, 1.0) == 2.5  # exponential ones: (1 + ca^2) / 2
    assert delay_chance(24, 20.0) == erlang_c(24, 20.0)
    assert delay_chance(24, 20.0, 4.0) == pytest.approx(erlang_c(6, 5.0))
    between = delay_chance(24, 20.0, 24 / 6.5)
    assert erlang_c(7, 7 * 20.0 / 24) < between < erlang_c(6, 5.0)
    assert delay_chance(1, 0.7, 9.0) == pytest.approx(0.7)  # one slot: waits w.p. rho
    assert delay_chance(8, 8.0, 2.0) == 1.0
    chances = [delay_chance(64, 56.0, z) for z in (1.0, 2.0, 4.0, 9.0)]
    assert chances == sorted(chances) and chances[0] < chances[-1]


def test_bursty_capacity_of_a_small_instance_against_the_simulator() -> None:
    """24 slots at burst CV 2: the bound was 34% above the simulator's steady state when
    bursts changed only how long a waiting request waits; counting how often they wait it
    is within 6%."""
    tr = Traffic(1.0, LengthDist(256, 320), LengthDist(64, 80), arrival="bursty", burst_cv=2.0)
    slo = Slo(ttft_ms=300, tpot_ms=50, percentile=90)
    queued = size_aggregated(_curve(), tr, slo, utilisation=1.0, queueing=True)
    poisson = size_aggregated(
        _curve(), replace(tr, arrival="poisson", burst_cv=1.0), slo, utilisation=1.0, queueing=True
    )
    assert queued.batch_limit == 24 and queued.requests_per_s < 0.8 * poisson.requests_per_s
    g = InstanceGroup(1, _curve(), batch_limit=24)
    sim = _max_rate(ServingPlan((Pool("p", 1.0, instances=g),)), tr, slo, poisson.requests_per_s)
    assert queued.requests_per_s == pytest.approx(sim, rel=0.06)
