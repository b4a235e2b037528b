"""``plan render`` (controlplane/cli/render.py): the numbers drawn match the cost model and
the plan."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from cli_builders import TINY_FLEET

from controlplane.cli.render import plan_picture, render_plan, type_colours
from policies.errors import InputError
from policies.estimate.engines import EngineSpec
from policies.estimate.workload import make_workload, synthetic_zipf
from policies.hardware.fleet import Fleet, parse_fleet
from policies.model.architecture import preset
from policies.request import PlacementRequest, PlacementResult, SolverOptions
from policies.solve import solve

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


def _fleet() -> Fleet:
    return parse_fleet(yaml.safe_load(TINY_FLEET))


def test_phases_add_up_to_the_plans_step_and_name_the_slowest_gpu() -> None:
    result = _solve()
    plan, ev = result.plan, result.evaluation
    pic = plan_picture(plan, fleet=_fleet())
    assert [p.name for p in pic.phases] == ["attention", "dispatch+combine", "experts"]
    assert sum(p.total_us for p in pic.phases) == pytest.approx(plan.summary.step_time_us)
    assert pic.step_us == pytest.approx(plan.summary.step_time_us)
    assert not pic.notes
    experts = pic.phases[2]
    assert experts.total_us == pytest.approx(sum(max(t.expert_us) for t in ev.moe_layers))
    # the slowest GPUs of each layer (within 0.5%: tied), counted over the layers
    tied = Counter(
        tuple(plan.gpus[i].gpu for i in range(4) if t.expert_us[i] >= max(t.expert_us) * 0.995)
        for t in ev.moe_layers
    )
    gpus, layers = tied.most_common(1)[0]
    assert experts.setter_layers == layers
    if len(gpus) == 1:
        assert experts.setter == gpus[0]
    else:
        assert experts.setter == f"{gpus[0].split('/')[0]} ({len(gpus)} GPUs tied)"
    for i in range(4):
        attn, comm, exp = pic.busy_us[i]
        assert attn + comm + exp == pytest.approx(ev.gpu_busy_us(i))


def test_without_the_fleet_dispatch_is_left_out_and_said_so() -> None:
    pic = plan_picture(_solve().plan)
    comm = next(p for p in pic.phases if p.name == "dispatch+combine")
    assert not comm.known and comm.total_us == 0.0
    assert any("--fleet" in n for n in pic.notes)
    assert pic.links is not None and pic.links.channel[0][1] == "link: --fleet"


def test_memory_is_the_plans_own() -> None:
    plan = _solve().plan
    pic = plan_picture(plan)
    for g, row in zip(plan.gpus, pic.memory_bytes, strict=True):
        m = g.memory_bytes
        assert row == (m["weights"], m["experts"], m["kv_cache"], m["activations"], m["usable"])


def test_link_traffic_adds_up_to_the_pairs_that_leave_a_gpu() -> None:
    result = _solve()
    plan = result.plan
    pic = plan_picture(plan, fleet=_fleet())
    links = pic.links
    assert links is not None and links.nodes == ("a100-0", "h100-0")
    assert links.channel == (("NVLink", "RDMA"), ("RDMA", "NVLink"))
    model = preset("qwen3-30b-a3b")
    per_pair = model.hidden * 2.0 * 2  # BF16 dispatch (the A100s lack FP8) + BF16 combine
    share = [g.attention_share for g in plan.gpus]
    expected = 0.0
    for li in range(len(plan.moe_layers)):
        served = [pic.load[j][li] for j in range(4)]  # pairs each GPU serves
        expected += sum(share[i] * served[j] for i in range(4) for j in range(4) if i != j)
    total = sum(sum(row) for row in links.bytes_per_step)
    assert total == pytest.approx(expected * per_pair, rel=1e-9)


def test_expert_panel_puts_replicated_experts_first_where_they_sit() -> None:
    plan = _solve().plan
    pic = plan_picture(plan, layer=plan.moe_layers[2])
    view = pic.experts
    assert view is not None and view.layer == plan.moe_layers[2]
    hot = [r for r in view.replicas if r > 1]
    assert hot and view.replicas[: len(hot)] == tuple(hot)
    e = view.experts[0]
    holders = [i for i, g in enumerate(plan.gpus) if any(s.expert == e for s in g.experts[2])]
    assert [i for i in range(4) if view.grid[i][0] > 0] == holders
    assert view.hidden == plan.num_experts - len(view.experts)


def test_static_dispatch_is_replayed_from_the_plan() -> None:
    fleet = parse_fleet(yaml.safe_load(TINY_FLEET.replace("A100-SXM4-80GB", "H100-SXM5-80GB")))
    model = preset("qwen3-30b-a3b")
    workload = make_workload(
        model, phase="decode", tokens_per_gpu=64, context_len=2048,
        load=synthetic_zipf(model, LOAD), load_source=LOAD,
    )  # fmt: skip
    req = PlacementRequest(
        fleet, model, workload, policy="greedy", redundant_experts=4,
        options=SolverOptions(), engine=EngineSpec(name="sglang"),
    )  # fmt: skip
    plan = solve(req).plan
    assert plan.engine.dispatch == "static"
    pic = plan_picture(plan, fleet=fleet)
    assert pic.step_us == pytest.approx(plan.summary.step_time_us)
    assert pic.links is not None and "replayed" in pic.links.note


def test_gpu_type_colours_do_not_depend_on_order() -> None:
    a = type_colours(["H100-SXM5-80GB", "A100-SXM4-80GB"])
    b = type_colours(["A100-SXM4-80GB", "Custom-GPU", "H100-SXM5-80GB"])
    assert a["H100-SXM5-80GB"] == b["H100-SXM5-80GB"]
    assert a["A100-SXM4-80GB"] == b["A100-SXM4-80GB"]
    assert len(set(b.values())) == 3


def test_layer_that_is_not_a_moe_layer_is_refused() -> None:
    plan = _solve().plan
    with pytest.raises(InputError, match="not a MoE layer"):
        plan_picture(plan, layer=10_000)


def test_render_svg(tmp_path: Path) -> None:
    out = render_plan(_solve().plan, tmp_path / "p.svg", fleet=_fleet())
    assert out.read_text()[:200].lstrip().startswith("<?xml")
