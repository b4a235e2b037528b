"""Calibration figures, their path into the cost model and the planner (CPU only)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from support.nvml_replay import ReplayNvml

from agents.calibrate import (
    CalibrationOptions,
    add_arguments,
    apply_calibration,
    figures_from_curves,
    main,
    planning_inputs,
    runtime_overheads,
    stable_figures,
)
from agents.discovery.nvml import NvmlDiscovery
from agents.runtime.bench_config import BenchConfig, bench_model, workloads
from policies.estimate.costmodel import (
    CostSettings,
    MeasuredFigures,
    active_fraction,
    build_cost_table,
)
from policies.request import PlacementRequest, SolverOptions
from policies.solve import solve

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "nvml" / "h200x2.json"
RATES = {
    "gemm_bf16_tflops": 800.0,
    "gemm_fp8_tflops": 1370.0,
    "hbm_gbytes_per_s": 4200.0,
    "attn_prefill_tflops": 250.0,
    "attn_decode_gbytes_per_s": 2500.0,
    "nvlink_per_direction_gbytes_per_s": 330.0,
    "gemm_launch_us": 7.0,
    "expert_gemm_tflops": 590.0,
    "expert_read_gbytes_per_s": 3050.0,
}
OPTS = replace(CalibrationOptions(), fp8_dispatch=False)


def _inventory() -> Any:
    rec = json.loads(FIXTURE.read_text())
    return NvmlDiscovery(node_name="h200-node", nvml=ReplayNvml(rec)).discover()


def _calibration(inv: Any, slow: float = 1.0) -> dict[str, Any]:
    gpus = []
    for g in inv.gpus:
        f = 1.0 if g.index == 0 else slow
        gpus.append(
            {"index": g.index, "uuid": g.uuid, "measured": {k: v * f for k, v in RATES.items()}}
        )
    return {"gpus": gpus}


def test_new_measured_fields_default_to_the_old_model() -> None:
    inv = _inventory()
    model = bench_model(BenchConfig())
    wl = workloads(BenchConfig(), model)["decode"]
    fleet, _ = planning_inputs([inv])
    old = {k: v for k, v in RATES.items() if not k.startswith("expert_")}
    ids = [g.id for g in fleet.gpus]
    a = build_cost_table(
        fleet, model, wl, CostSettings(measured={i: MeasuredFigures(**old) for i in ids})
    )
    c = a.gpus[0]
    assert c.attn_overhead_us == pytest.approx(4 * 7.0)
    assert c.expert_overhead_us == pytest.approx(2 * 7.0)
    assert c.comm_alpha_us == pytest.approx(2 * 15.0)  # Efficiency.alpha_nvlink_us
    assert a.bytes_per_copy == pytest.approx(model.hidden * (1 + 4 / 128) + model.hidden * 2)
    new = MeasuredFigures(
        **RATES,
        attn_overhead_us=600.0,
        attn_extra_us_per_token=0.2,
        expert_overhead_us=150.0,
        expert_extra_us_per_pair=0.1,
        a2a_latency_us=250.0,
    )
    b = build_cost_table(
        fleet, model, wl, CostSettings(measured=dict.fromkeys(ids, new), fp8_dispatch=False)
    )
    d = b.gpus[0]
    assert d.attn_overhead_us == 600.0
    assert d.expert_overhead_us == 150.0
    assert d.comm_alpha_us == 500.0
    assert d.attn_core_us_per_token == pytest.approx(c.attn_core_us_per_token * 2500 / 2500 + 0.2)
    # Weights are read for the replicas that get pairs: 1 - exp(-pairs per expert) of them.
    pairs_per_expert = b.total_tokens * model.top_k / model.num_experts
    assert d.expert_read_us_per_replica == pytest.approx(
        model.expert_bytes / 3050e3 * active_fraction(pairs_per_expert)
    )
    assert d.expert_flop_us_per_pair == pytest.approx(2 * model.expert_params / 590e6 + 0.1)
    assert d.expert_act_us_per_pair == pytest.approx(c.expert_act_us_per_pair + 0.1)
    assert b.bytes_per_copy == model.hidden * 4.0  # BF16 dispatch and combine


def test_calibrated_specs_differ_so_the_ilp_plans_each_gpu_on_its_own() -> None:
    inv = apply_calibration(_inventory(), _calibration(_inventory(), slow=0.4))
    assert inv.gpus[1].measured["gemm_bf16_tflops"] == pytest.approx(320.0)
    fleet, settings = planning_inputs([inv], fp8_dispatch=False)
    assert fleet.gpus[0].spec != fleet.gpus[1].spec
    assert settings.measured[fleet.gpus[1].id].hbm_gbytes_per_s == pytest.approx(1680.0)
    model = bench_model(BenchConfig())
    wl = workloads(BenchConfig(), model)["prefill"]
    plans = {}
    for policy in ("uniform", "ilp"):
        req = PlacementRequest(
            fleet,
            model,
            wl,
            policy=policy,
            form="native",
            options=SolverOptions(time_limit_s=30, workers=1),
            settings=settings,
        )
        plans[policy] = solve(req)
    ilp = plans["ilp"].plan
    assert ilp.gpus[1].attention_share < 0.4
    assert len(ilp.gpus[1].experts[0]) < len(ilp.gpus[0].experts[0])
    gain = plans["uniform"].evaluation.step_time_us / plans["ilp"].evaluation.step_time_us
    assert gain > 1.3


def test_runtime_figures_are_measured_terms_only() -> None:
    runtime = {
        "launch_us": 2.5,
        "attn_gap_us": 120.0,  # graph replay time minus the kernels' durations
        "expert_gap_us": None,  # not positive: no fixed cost from this calibration
        "attn_decode_gbytes_per_s": 4300.0,
        "dense_read_gbytes_per_s": 3500.0,
        "dense_gemm_tflops": 730.0,
        "expert_read_gbytes_per_s": 4000.0,
        "expert_gemm_tflops": 600.0,
        "expert_extra_us_per_pair": 0.04,
        "attn_prefill_tflops": 0.0,  # not measured: left out, never a zero figure
    }
    got = runtime_overheads(runtime)
    assert got["attn_overhead_us"] == 120.0
    assert "expert_overhead_us" not in got and "attn_prefill_tflops" not in got
    assert got["hbm_gbytes_per_s"] == 3500.0 and got["gemm_bf16_tflops"] == 730.0
    assert got["expert_extra_us_per_pair"] == 0.04
    assert all(v > 0 for v in got.values())
    MeasuredFigures(**got)


def test_repeated_calibrations_keep_only_figures_within_five_percent() -> None:
    runs = [
        {"hbm_gbytes_per_s": 4270.0, "attn_overhead_us": 630.0, "gemm_launch_us": 2.0},
        {"hbm_gbytes_per_s": 4280.0, "attn_overhead_us": 1054.0, "gemm_launch_us": 2.05},
        {"hbm_gbytes_per_s": 4260.0, "attn_overhead_us": 900.0},
    ]
    kept, dropped = stable_figures(runs)
    assert kept == {"hbm_gbytes_per_s": pytest.approx(4270.0)}
    assert "67.3%" in dropped["attn_overhead_us"]
    assert dropped["gemm_launch_us"] == "measured in 2 of 3 runs"
    kept, dropped = stable_figures([{"x": 1.0}, {"x": -1.0}])
    assert not kept and "not positive" in dropped["x"]


def test_figures_from_curves() -> None:
    gemm: dict[str, Any] = {
        "flops_per_token": 6.0 * 7168 * 2048,
        "bf16": [
            {"m": m, "us": 6.0 * m * 7168 * 2048 / 800e6 + 10.0, "tflops": 0.0}
            for m in (1024, 4096, 8192)
        ],
        "fp8": [{"m": 8192, "us": 1.0, "tflops": 1370.0}],
    }
    for p in gemm["bf16"]:
        p["tflops"] = 6.0 * p["m"] * 7168 * 2048 / p["us"] / 1e6
    curves = {
        "gemm": gemm,
        "hbm_copy": {"gbytes_per_s": 4200.0},
        "attention": {"prefill": {"tflops": 250.0}, "decode": {"gbytes_per_s": 2500.0}},
        "grouped_experts": {
            "points": [
                {"rows_per_expert": 8, "tflops": 20.0, "weight_gbytes_per_s": 3000.0},
                {"rows_per_expert": 256, "tflops": 560.0, "weight_gbytes_per_s": 2000.0},
                {"rows_per_expert": 512, "tflops": 590.0, "weight_gbytes_per_s": 1000.0},
            ]
        },
    }
    nccl = {
        "world": 2,
        "hidden": 7168,
        "points": [
            {"tokens_per_rank": 1, "us": 50.0},
            {"tokens_per_rank": 16384, "us": 50.0 + 16384 * 7168 * 2 / 300e3},
        ],
    }
    f = figures_from_curves(curves, nccl)
    assert f["gemm_bf16_tflops"] == pytest.approx(800.0 * 0.99, rel=0.02)
    assert f["gemm_fp8_tflops"] == 1370.0
    assert f["nvlink_per_direction_gbytes_per_s"] == pytest.approx(300.0)
    assert f["expert_gemm_tflops"] == 590.0
    assert f["expert_read_gbytes_per_s"] == 3000.0
    assert 2.0 < f["gemm_launch_us"] < 5.0  # 10 us beyond the roofline per GEMM pair
    MeasuredFigures(**f)  # every key is a field


def test_calibrate_without_torch_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "cal.json")])
    assert main(args) == 2
    assert "pip install 'mixfleet[gpu]'" in capsys.readouterr().err
    assert not (tmp_path / "cal.json").exists()
