"""Calibration from a sweep of measured steps (agents.calibrate.fit.sweep_figures): on steps
the cost model itself generates from known figures (kernel splits consistent with them),
the fit recovers the fixed costs as intercept and slope and the rates, and predicts sizes
it was not fitted on; fixed costs that differ between decode and prefill are told apart."""

from __future__ import annotations

import math

import pytest

from agents.calibrate.fit import (
    NO_FIXED_COSTS,
    PhasePoint,
    fixed_costs,
    kernel_rates,
    layer_phase_times,
    sweep_figures,
)
from bench.gpu_model import layer_model
from policies.estimate.costmodel import active_fraction

TRUE = {
    "hbm_gbytes_per_s": 3600.0,
    "gemm_bf16_tflops": 760.0,
    "attn_decode_gbytes_per_s": 4400.0,
    "attn_prefill_tflops": 280.0,
    "expert_read_gbytes_per_s": 4300.0,
    "expert_gemm_tflops": 650.0,
    "expert_gemm_rows_scale": 120.0,
    "attn_overhead_us": 110.0,
    "attn_decode_extra_us_per_token": 0.3,
    "attn_extra_us_per_token": 0.04,
    "expert_overhead_us": 90.0,
    "expert_decode_extra_us_per_pair": 0.02,
    "expert_extra_us_per_pair": 0.03,
}
DECODE = ((1, 4096), (4, 16384), (16, 1024), (64, 16384), (256, 1024))
PREFILL = ((2048, 2048), (16384, 2048))


def _point(decode: bool, tokens: int, context: int) -> PhasePoint:
    """A step as the cost model with TRUE predicts it, with kernel splits that carry the
    true rates (what a profile of the runtime reports)."""
    m = layer_model("deepseek-v3", "bf16")
    t = layer_phase_times(m, decode=decode, tokens=tokens, context=context, figures=TRUE)
    dense = (m.attn_params_per_layer + m.shared_expert_params + m.hidden * m.num_experts) * 2.0
    p = tokens * m.top_k / m.num_experts
    if decode:
        kv = tokens * m.kv_read_elements_per_token_per_layer(context) * 2.0
        attn = {"gemm_us": dense / TRUE["hbm_gbytes_per_s"] / 1e3, "attention_us": kv / 4.4e6}
        read = m.num_experts * active_fraction(p) * m.expert_bytes
        experts = {"gemm_us": read / TRUE["expert_read_gbytes_per_s"] / 1e3}
    else:
        flops = tokens * m.attn_core_flops_per_token(context / 2.0, decode=False)
        attn = {
            "gemm_us": tokens * dense / (TRUE["gemm_bf16_tflops"] * 1e6),
            "attention_us": flops / (TRUE["attn_prefill_tflops"] * 1e6),
        }
        rate = TRUE["expert_gemm_tflops"] * p / (p + TRUE["expert_gemm_rows_scale"])
        experts = {"gemm_us": 2.0 * m.expert_params * tokens * m.top_k / (rate * 1e6)}
    return PhasePoint(
        m, decode, tokens, context, t["attention_us"], t["expert_us"],
        {"attention": attn, "experts": experts},
    )  # fmt: skip


def _points() -> list[PhasePoint]:
    return [_point(True, t, c) for t, c in DECODE] + [_point(False, t, c) for t, c in PREFILL]


def test_kernel_rates_recover_the_rates_behind_the_kernel_times() -> None:
    got = kernel_rates(_points())
    for key in (
        "hbm_gbytes_per_s",
        "gemm_bf16_tflops",
        "attn_prefill_tflops",
        "expert_read_gbytes_per_s",
        "expert_gemm_tflops",
    ):
        assert got[key] == pytest.approx(TRUE[key], rel=0.02), key
    assert got["attn_decode_gbytes_per_s"] == pytest.approx(4400.0, rel=0.02)


def test_fixed_costs_are_intercept_and_slope_over_the_sizes() -> None:
    rates = {k: v for k, v in TRUE.items() if k not in NO_FIXED_COSTS}
    fixed, detail = fixed_costs(_points(), rates)
    assert fixed["attn_overhead_us"] == pytest.approx(110.0, rel=0.02)
    assert fixed["attn_decode_extra_us_per_token"] == pytest.approx(0.3, rel=0.05)
    assert fixed["attn_extra_us_per_token"] == pytest.approx(0.04, rel=0.05)
    assert fixed["expert_overhead_us"] == pytest.approx(90.0, rel=0.02)
    assert fixed["expert_decode_extra_us_per_pair"] == pytest.approx(0.02, rel=0.05)
    assert fixed["expert_extra_us_per_pair"] == pytest.approx(0.03, rel=0.05)
    assert len(detail["decode_attention_residual_us"]) == len(DECODE)


def test_sweep_figures_predict_sizes_they_were_not_fitted_on() -> None:
    figures, _ = sweep_figures(_points())
    m = layer_model("deepseek-v3", "bf16")
    for decode, tokens, context in ((True, 128, 4096), (True, 32, 32768), (False, 8192, 2048)):
        want = layer_phase_times(m, decode=decode, tokens=tokens, context=context, figures=TRUE)
        got = layer_phase_times(m, decode=decode, tokens=tokens, context=context, figures=figures)
        for key in ("attention_us", "expert_us"):
            assert got[key] == pytest.approx(want[key], rel=0.03), (decode, tokens, key)


def test_a_noisy_point_moves_the_fit_only_in_proportion() -> None:
    pts = _points()
    noisy = pts[2]
    pts[2] = PhasePoint(
        noisy.model, noisy.decode, noisy.tokens, noisy.context,
        noisy.attention_us * 1.2, noisy.expert_us, noisy.kernels,
    )  # fmt: skip
    figures, _ = sweep_figures(pts)
    assert math.isfinite(figures["attn_overhead_us"])
    assert figures["attn_overhead_us"] == pytest.approx(110.0, rel=0.6)


def test_sweep_figures_replace_the_single_shape_figures_of_a_calibration() -> None:
    from agents.calibrate.fit import runtime_overheads

    runtime = {
        "attn_gap_us": 5.0,
        "expert_gap_us": 7.0,
        "dense_read_gbytes_per_s": 3000.0,
        "sweep_figures": {"attn_overhead_us": 110.0, "hbm_gbytes_per_s": 3600.0},
    }
    got = runtime_overheads(runtime)
    assert got["attn_overhead_us"] == 110.0
    assert got["hbm_gbytes_per_s"] == 3600.0
    assert got["expert_overhead_us"] == 7.0  # not in the sweep: the single-shape figure
