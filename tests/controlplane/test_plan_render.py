"""``plan render`` (controlplane/render.py): the numbers drawn match the cost model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from cli_builders import TINY_FLEET

from controlplane.cli.render import plan_picture, render_plan
from policies.errors import InputError
from policies.fleet import parse_fleet
from policies.models import preset
from policies.request import PlacementRequest, PlacementResult, SolverOptions
from policies.solve import solve
from policies.workload import make_workload, synthetic_zipf

LOAD = "synthetic:zipf:1.2:seed=5"


def _solve(policy: str = "greedy", load_source: str = LOAD) -> PlacementResult:
    fleet = parse_fleet(yaml.safe_load(TINY_FLEET))
    model = preset("qwen3-30b-a3b")
    load = synthetic_zipf(model, LOAD) if load_source == LOAD else None
    workload = make_workload(
        model,
        phase="decode",
        tokens_per_gpu=64,
        context_len=2048,
        load=load,
        load_source=load_source,
    )
    req = PlacementRequest(
        fleet, model, workload, policy=policy, redundant_experts=4, options=SolverOptions()
    )
    return solve(req)


def test_picture_matches_the_cost_model_evaluation() -> None:
    result = _solve()
    plan = result.plan
    pic = plan_picture(plan, fleet=parse_fleet(yaml.safe_load(TINY_FLEET)))
    assert pic.load_title == "token-expert pairs served per step"
    assert "fleet figures" in pic.time_title
    n_layers = len(plan.moe_layers)
    pairs_per_layer = 64 * 4 * 8  # tokens per GPU x GPUs x top-k
    for li in range(n_layers):
        assert sum(pic.load[i][li] for i in range(4)) == pytest.approx(pairs_per_layer)
        expected = result.evaluation.moe_layers[li].expert_us
        assert [pic.time[i][li] for i in range(4)] == pytest.approx(list(expected))
    assert pic.attention_share == pytest.approx([g.attention_share for g in plan.gpus])
    assert pic.gpu_models[0] == "A100-SXM4-80GB" and pic.gpu_models[3] == "H100-SXM5-80GB"


def test_catalog_figures_equal_fleet_figures_without_overrides() -> None:
    plan = _solve().plan
    with_fleet = plan_picture(plan, fleet=parse_fleet(yaml.safe_load(TINY_FLEET)))
    alone = plan_picture(plan)
    assert "catalog figures" in alone.time_title
    for a, b in zip(alone.time + alone.load, with_fleet.time + with_fleet.load, strict=True):
        assert a == pytest.approx(b)


def test_uniform_load_is_regenerated() -> None:
    plan = _solve("uniform", load_source="uniform").plan
    pic = plan_picture(plan)
    assert pic.load_title == "token-expert pairs served per step"
    # 2048 pairs per layer, 16 per expert; a replica serves its share of them
    for i, g in enumerate(plan.gpus):
        assert pic.load[i][0] == pytest.approx(16 * sum(s.share for s in g.experts[0]))
    assert pic.load[0][0] == pytest.approx(16 * (29 + 4 * 0.5))  # experts 0-3 replicated


def test_unknown_load_falls_back_to_what_the_plan_holds() -> None:
    plan = _solve().plan
    from_file = replace(plan, workload={**plan.workload, "load_source": "file:gone.json"})
    pic = plan_picture(from_file)
    assert "load unknown" in pic.load_title
    assert "replica slots" in pic.time_title
    # engine form: every expert is served once in total, 128 experts over 4 GPUs
    assert sum(pic.load[i][0] for i in range(4)) == pytest.approx(128)
    assert pic.time[0][0] == plan.slots_per_gpu == 33


def test_mismatched_fleet_is_refused() -> None:
    plan = _solve().plan
    other = parse_fleet(yaml.safe_load(TINY_FLEET.replace("h100-0", "h100-9")))
    with pytest.raises(InputError, match="does not have the plan's GPUs"):
        plan_picture(plan, fleet=other)


def test_render_png(tmp_path: Path) -> None:
    out = render_plan(_solve().plan, tmp_path / "deep" / "p.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_render_to_an_unwritable_place(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InputError, match="cannot write the picture"):
        render_plan(_solve().plan, blocker / "p.png")
