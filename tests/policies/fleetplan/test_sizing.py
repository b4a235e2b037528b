"""Sizing one instance from its step curve: batch limits and capacities checked against the
closed forms of linear curves (decode step 10 ms + 0.1 ms per sequence; prefill 10 ms +
10 us per token), constant lengths."""

from __future__ import annotations

import math

import pytest

from policies.fleetplan.sizing import (
    Lengths,
    aggregated_step_us,
    decode_capacity,
    prefill_extra_us,
    size_aggregated,
    size_pair,
)
from policies.serving.curves import StepCurve
from policies.serving.traffic import LengthDist, Slo, Traffic

BATCHES = (1, 100, 1000)
PREFILL = (1, 10_000, 100_000)


def linear_curve(capacity_tokens: int = 10**9) -> StepCurve:
    """decode_us(b) = 10,000 + 100 b (any context); prefill_time_us(t) = 10,000 + 10 t."""
    return StepCurve(
        batch_grid=BATCHES,
        context_grid=(1024, 8192),
        decode_step_us=tuple((10_000.0 + 100 * b, 10_000.0 + 100 * b) for b in BATCHES),
        prefill_grid=PREFILL,
        prefill_us=tuple(10_000.0 + 10 * t for t in PREFILL),
        max_batch=1000,
        kv_bytes_per_token=1000.0,
        kv_capacity_tokens=capacity_tokens,
    )


def constant_traffic(isl: int = 1000, osl: int = 100) -> Traffic:
    return Traffic(1.0, LengthDist.constant(isl), LengthDist.constant(osl))


def test_prefill_extra_is_the_mean_over_poisson_arrivals() -> None:
    c = linear_curve()
    n = Lengths.of(constant_traffic(), Slo(0, 50))
    # k prompts of 1,000 tokens cost 10,000 k + 10,000 - 10,010 (the fixed cost counted once).
    m = 1.5
    want = sum(
        math.exp(-m) * m**k / math.factorial(k) * (10_000.0 * k - 10.0) for k in range(1, 60)
    )
    assert prefill_extra_us(c, n, m, 10**6) == pytest.approx(want, rel=1e-9)
    assert prefill_extra_us(c, n, 0.0, 10**6) == 0.0


def test_aggregated_batch_limit_is_the_largest_meeting_tpot() -> None:
    c = linear_curve()
    tr = constant_traffic()
    slo = Slo(ttft_ms=0, tpot_ms=50)  # no TTFT target
    sz = size_aggregated(c, tr, slo, chunk_tokens=10**6, utilisation=1.0)
    # t(B) = 10,000 + 100 B + 100 B - 10 (1 - e^(-B/100)) <= 50,000 -> B = 200.
    assert sz.batch_limit == 200
    n = Lengths.of(tr, slo)
    assert aggregated_step_us(c, n, 200, 10**6) <= 50_000 < aggregated_step_us(c, n, 201, 10**6)
    t = aggregated_step_us(c, n, 200, 10**6)
    assert sz.requests_per_s == pytest.approx(200 / (100 * t * 1e-6))
    assert sz.tpot_ms == pytest.approx(t / 1e3)
    half = size_aggregated(c, tr, slo, chunk_tokens=10**6, utilisation=0.5)
    assert half.batch_limit == 200 and half.requests_per_s == pytest.approx(sz.requests_per_s / 2)


def test_memory_and_chunk_budget_cap_the_batch() -> None:
    tr = constant_traffic()
    slo = Slo(0, 50)
    # 110,000 KV tokens hold 100 sequences of 1,000 + 100 reserved tokens.
    assert size_aggregated(linear_curve(110_000), tr, slo, utilisation=1.0).batch_limit == 100
    # A 5,000-token chunk budget prefills 5 prompts per step: at most 5 x 100 = 500 sequences
    # finish their prompts per OSL steps; below 200 it does not bind.
    assert size_aggregated(linear_curve(), tr, slo, chunk_tokens=1000).batch_limit == 100
    one = size_aggregated(linear_curve(500), tr, slo)
    assert not one.ok and "does not fit" in one.reason


def test_a_target_no_batch_meets_is_refused_with_the_figures() -> None:
    sz = size_aggregated(linear_curve(), constant_traffic(), Slo(0, 5))
    assert not sz.ok and sz.batch_limit == 0 and sz.requests_per_s == 0
    assert "TPOT" in sz.reason and "10.2 ms" in sz.reason
    tight = size_aggregated(linear_curve(), constant_traffic(), Slo(ttft_ms=40, tpot_ms=0))
    # TTFT = t(B) + the step with its own 1,000-token prompt ~ 30 ms + 0.3 ms x B.
    assert 30 <= tight.batch_limit <= 34 and tight.ttft_ms <= 40


def test_decode_capacity_has_no_prefill_in_its_steps() -> None:
    sz = decode_capacity(linear_curve(), constant_traffic(), Slo(0, 50), utilisation=1.0)
    assert sz.batch_limit == 400  # 10,000 + 100 B <= 50,000
    assert sz.requests_per_s == pytest.approx(400 / (100 * 0.05))


def test_pair_charges_the_kv_transfer_and_the_nic() -> None:
    c = linear_curve()
    tr = constant_traffic()
    slo = Slo(ttft_ms=1000, tpot_ms=50)
    fast = size_pair(
        c,
        c,
        tr,
        slo,
        kv_gbytes_per_s=1.0,
        kv_latency_us=0.0,
        prefill_nic_gbytes_per_s=100.0,
        decode_nic_gbytes_per_s=100.0,
        utilisation=1.0,
    )
    # One prompt's KV: 1,000 tokens x 1,000 bytes = 1 MB at 1 GB/s = 1 ms.
    assert fast.kv_transfer_ms == pytest.approx(1.0)
    # 2 P(T) + 1 ms + one decode step at the decode batch (50 ms) <= 1,000 ms.
    budget = fast.prefill.batch_limit
    assert 2 * (10_000 + 10 * budget) / 1e3 + 1.0 + 50.0 <= 1000.0
    assert fast.prefill.requests_per_s == pytest.approx(
        budget / (1000 * (10_000 + 10 * budget) * 1e-6)
    )
    slow_nic = size_pair(
        c,
        c,
        tr,
        slo,
        kv_gbytes_per_s=1.0,
        kv_latency_us=0.0,
        prefill_nic_gbytes_per_s=0.01,  # 10 MB/s: 10 prompts' KV per second
        decode_nic_gbytes_per_s=100.0,
        utilisation=1.0,
    )
    assert slow_nic.prefill.requests_per_s == pytest.approx(10.0)
    slow_path = size_pair(
        c,
        c,
        tr,
        slo,
        kv_gbytes_per_s=0.001,  # 1 MB/s: a second per prompt
        kv_latency_us=0.0,
        prefill_nic_gbytes_per_s=100.0,
        decode_nic_gbytes_per_s=100.0,
    )
    assert not slow_path.prefill.ok and "KV transfer" in slow_path.prefill.reason


def test_prefill_budget_is_the_fastest_not_the_largest() -> None:
    """A forward's cost per token falls to 16,384 tokens and rises past it (the attention of
    the prompts batched): the budget is the one of the highest rate, below the largest the
    TTFT target allows."""
    grid = (1, 4096, 16_384, 65_536)
    c = StepCurve(
        batch_grid=BATCHES,
        context_grid=(1024, 8192),
        decode_step_us=tuple((10_000.0 + 100 * b, 10_000.0 + 100 * b) for b in BATCHES),
        prefill_grid=grid,
        prefill_us=(10_000.0, 30_000.0, 100_000.0, 550_000.0),
        max_batch=1000,
        kv_bytes_per_token=1000.0,
        kv_capacity_tokens=10**9,
    )
    pair = size_pair(
        c,
        c,
        constant_traffic(),
        Slo(ttft_ms=10_000, tpot_ms=50),  # 2 P(65,536) = 1.1 s: every budget meets it
        kv_gbytes_per_s=100.0,
        kv_latency_us=0.0,
        prefill_nic_gbytes_per_s=1e6,
        decode_nic_gbytes_per_s=1e6,
        utilisation=1.0,
    )
    budget = pair.prefill.batch_limit
    assert 4096 < budget <= 16_384
    peak = 16_384 / (1000 * 100_000 * 1e-6)  # 163.8 requests/s at 16,384 tokens
    largest = 65_536 / (1000 * 550_000 * 1e-6)  # 119.2 at 65,536
    assert 0.95 * peak <= pair.prefill.requests_per_s <= peak
    assert pair.prefill.requests_per_s > 1.3 * largest
    assert pair.prefill.requests_per_s == pytest.approx(
        budget / (1000 * c.prefill_time_us(budget) * 1e-6)
    )
