"""An unplaceable request names only fixes that work: each one the reply names is checked by
re-solving with it (policies.solve.verified_fixes). TensorRT-LLM on a mixed fleet used to be
told to route with the mixfleet router (refused for TensorRT-LLM), to use an FP8 KV cache
when it already did, and to lower the tokens when that did not help."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import yaml

from policies.estimate.engines import EngineOptions, EngineSpec
from policies.estimate.workload import make_workload
from policies.hardware.fleet import parse_fleet
from policies.model.architecture import preset
from policies.request import PlacementRequest, PlacementResult, SolverOptions
from policies.solve import solve

ROOT = Path(__file__).resolve().parents[2]
QWEN235 = preset("qwen3-235b-a22b")


def _request(kv: str = "bf16", context: int = 4096) -> PlacementRequest:
    fleet = parse_fleet(yaml.safe_load((ROOT / "examples/fleets/mixed-24.yaml").read_text()))
    wl = make_workload(
        QWEN235, phase="decode", tokens_per_gpu=64, context_len=context, kv_cache_dtype=kv
    )
    return PlacementRequest(
        fleet,
        QWEN235,
        wl,
        policy="ilp",
        redundant_experts=16,
        engine=EngineSpec("trtllm"),
        options=SolverOptions(time_limit_s=20.0, workers=1),
    )


def _fix_line(r: PlacementResult) -> str:
    assert not r.placed
    return next(x for x in r.infeasible if "To fix" in x)


def test_trtllm_hints_name_only_fixes_that_work() -> None:
    req = _request()
    line = _fix_line(solve(req))
    assert "dpBalance router" not in line  # TensorRT-LLM's HTTP server takes no DP rank
    assert "--kv-cache-dtype fp8" in line
    m = re.search(r"--tokens (\d+) or fewer", line)
    assert m is not None, line
    wl, greedy = req.workload, replace(req, policy="greedy")  # a placement exists: enough
    fp8 = solve(replace(greedy, workload=replace(wl, kv_cache_dtype="fp8")))
    assert fp8.placed and not fp8.plan.violations
    fewer = solve(replace(greedy, workload=replace(wl, tokens_per_gpu=int(m.group(1)))))
    assert fewer.placed and not fewer.plan.violations


def test_an_fp8_kv_cache_is_not_suggested_when_already_set() -> None:
    line = _fix_line(solve(_request(kv="fp8", context=32768)))
    assert "--kv-cache-dtype fp8" not in line and "dpBalance router" not in line


def test_the_router_is_not_named_where_it_would_not_fit_either() -> None:
    """SGLang told to balance ranks itself could be routed by the mixfleet router instead,
    but at 96 tokens per GPU the router's shares do not fit this fleet either: not named."""
    req = _request()
    req = replace(
        req,
        engine=EngineSpec("sglang", options=EngineOptions(dp_balance="engine")),
        workload=replace(req.workload, tokens_per_gpu=96),
    )
    line = _fix_line(solve(req))
    assert "dpBalance router" not in line and "--tokens 48 or fewer" in line
    routed = EngineSpec("sglang", options=EngineOptions(dp_balance="router"))
    r = solve(replace(req, engine=routed, policy="greedy"))
    assert not r.placed or r.plan.violations
