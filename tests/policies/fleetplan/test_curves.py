"""Per-variant step curves: the one cost model's figures at every grid point, computed once
per make-up, keyed by what changes them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from policies.deployment import sub_fleet
from policies.errors import InputError
from policies.estimate.engines import EngineName, EngineSpec
from policies.fleetplan.curves import (
    CURVE_VERSION,
    CurveEntry,
    CurveGrid,
    compute_curve,
    curve_key,
)
from policies.hardware.fleet import Fleet, parse_fleet
from policies.solve import rescore, solve
from policies.spec.build import DeploymentSpec, SolverPolicy, WorkloadSpec, to_request

ROOT = Path(__file__).resolve().parents[3]
GRID = CurveGrid(batch_per_gpu=(1, 16, 64), context_tokens=(1024, 4096), prefill_per_gpu=(64, 1024))


def fleet(name: str = "mixed-24") -> Fleet:
    return parse_fleet(yaml.safe_load((ROOT / "examples" / "fleets" / f"{name}.yaml").read_text()))


def qwen30b(engine: EngineName = "native") -> DeploymentSpec:
    return DeploymentSpec(
        "q",
        model="qwen3-30b-a3b",
        workload=WorkloadSpec(kv_cache_dtype="fp8"),
        engine=EngineSpec(name=engine),
    )


@pytest.fixture(scope="module")
def h100_curve() -> CurveEntry:
    return compute_curve(qwen30b(), sub_fleet(fleet(), ["h100-0"]), GRID)


def test_curve_points_are_the_cost_models_figures(h100_curve: CurveEntry) -> None:
    """Each decode point is what :func:`policies.solve.rescore` predicts for the reference
    placement at that batch and context (the one cost model, not a second one)."""
    curve = h100_curve.curve
    assert curve is not None and h100_curve.gpus == 8
    part = sub_fleet(fleet(), ["h100-0"])
    ref_spec = replace(
        qwen30b(),
        policy="eplb",
        workload=replace(qwen30b().workload, tokens_per_gpu=16, context_len=2048),
    )
    ref = solve(to_request(ref_spec, SolverPolicy(workers=1), part))
    assert all(g.attention_tp == 1 for g in ref.plan.gpus)  # the curve's DP attention
    for i, b in enumerate(GRID.batch_per_gpu):
        for j, ctx in enumerate(GRID.context_tokens):
            w = replace(ref_spec.workload, tokens_per_gpu=b, context_len=ctx)
            req = to_request(replace(ref_spec, workload=w), SolverPolicy(workers=1), part)
            want = rescore(req, ref.plan).plan.summary.step_time_us
            assert curve.decode_step_us[i][j] == pytest.approx(want, rel=1e-9)
    assert curve.batch_grid == tuple(8 * b for b in GRID.batch_per_gpu)
    assert curve.prefill_grid == tuple(8 * t for t in GRID.prefill_per_gpu)


def test_curves_grow_with_batch_context_and_prompt(h100_curve: CurveEntry) -> None:
    c = h100_curve.curve
    assert c is not None
    for row in c.decode_step_us:
        assert list(row) == sorted(row)
    for j in range(len(c.context_grid)):
        col = [row[j] for row in c.decode_step_us]
        assert col == sorted(col)
    assert list(c.prefill_us) == sorted(c.prefill_us)
    assert c.kv_capacity_tokens > 0 and c.kv_bytes_per_token > 0
    assert c.max_batch == c.kv_capacity_tokens // c.context_grid[-1]


def test_a_make_up_that_cannot_hold_the_model_says_why() -> None:
    e = compute_curve(replace(qwen30b(), model="deepseek-v3"), sub_fleet(fleet(), ["a100-0"]), GRID)
    assert e.curve is None and "memory" in e.reason
    refused = compute_curve(
        replace(qwen30b(), model="mixtral-8x7b", engine=EngineSpec(name="sglang")),
        sub_fleet(fleet(), ["h100-0"]),
        GRID,
    )
    assert refused.curve is None and "SGLang" in refused.reason


def test_key_names_what_changes_a_curve() -> None:
    f = fleet("mixed-64")
    a = curve_key(qwen30b(), sub_fleet(f, ["h100-0"]), GRID)
    assert a == curve_key(qwen30b(), sub_fleet(f, ["h100-1"]), GRID)  # same make-up
    assert a == curve_key(
        replace(qwen30b(), name="other", priority=7), sub_fleet(f, ["h100-0"]), GRID
    )
    different = [
        curve_key(qwen30b(), sub_fleet(f, ["h200-0"]), GRID),
        curve_key(qwen30b(), sub_fleet(f, ["h100-0", "h100-1"]), GRID),
        curve_key(qwen30b("sglang"), sub_fleet(f, ["h100-0"]), GRID),
        curve_key(
            replace(qwen30b(), workload=WorkloadSpec(kv_cache_dtype="bf16")),
            sub_fleet(f, ["h100-0"]),
            GRID,
        ),
        curve_key(replace(qwen30b(), model="gpt-oss-120b"), sub_fleet(f, ["h100-0"]), GRID),
        curve_key(qwen30b(), sub_fleet(f, ["h100-0"]), replace(GRID, context_tokens=(512, 4096))),
    ]
    assert len({a, *different}) == len(different) + 1


def test_key_changes_with_the_cost_model_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """A curve cached under an older cost model is never looked up again."""
    import policies.fleetplan.curves as curves_module

    part = sub_fleet(fleet("mixed-64"), ["h100-0"])
    before = curve_key(qwen30b(), part, GRID)
    monkeypatch.setattr(curves_module, "COST_MODEL_VERSION", "costmodel-next")
    assert curve_key(qwen30b(), part, GRID) != before


def test_entry_document_round_trip(h100_curve: CurveEntry) -> None:
    doc = h100_curve.to_doc()
    assert CurveEntry.from_doc(doc) == h100_curve
    with pytest.raises(InputError, match="curve version") as info:
        CurveEntry.from_doc(doc | {"version": "old"})
    assert info.value.field == "entry.version"
    assert doc["version"] == CURVE_VERSION
