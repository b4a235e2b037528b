"""Tensor-parallel attention groups (policies.estimate.tensor_parallel): dense models place, memory
and time follow the documented formulas, groups are well formed, engines get one TP size,
and MoE plans where data-parallel attention is best do not change."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import cast

import pytest
import yaml
from builders import fleet, tiny_model

from policies.errors import InputError
from policies.estimate.costmodel import GIB, CostSettings, build_cost_table
from policies.estimate.engines import EngineName, EngineSpec
from policies.estimate.tensor_parallel import (
    candidates,
    choose,
    dp_groups,
    kv_shards,
    tp_cost_table,
    with_attention_tp,
)
from policies.estimate.workload import make_workload, synthetic_zipf
from policies.hardware.fleet import Fleet, parse_fleet
from policies.hardware.topology import Channel
from policies.model.architecture import ModelSpec, preset
from policies.plan import Plan, dp_group_problems, gpu_plan_from_dict, gpu_plan_to_dict
from policies.request import PlacementRequest, RawPlacement
from policies.solve import PLACE, assemble_plan, fits_at_all, solve
from policies.solvers import greedy

ROOT = Path(__file__).resolve().parents[2]
LLAMA_KV_BYTES_PER_TOKEN = 80 * 2 * 8 * 128 * 2  # layers x (K, V) x kv heads x head dim x BF16


def _fleet(name: str) -> Fleet:
    return parse_fleet(yaml.safe_load((ROOT / f"examples/fleets/{name}.yaml").read_text()))


def _llama_request(f: Fleet, policy: str = "ilp", engine: str = "native") -> PlacementRequest:
    m = preset("llama-3.1-70b")
    w = make_workload(m, phase="decode", tokens_per_gpu=16, context_len=4096, load=None)
    return PlacementRequest(f, m, w, policy=policy, engine=EngineSpec(cast(EngineName, engine)))


def _groups(plan: Plan) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, g in enumerate(plan.gpus):
        assert g.dp_group is not None
        out.setdefault(g.dp_group, []).append(i)
    return out


# --------------------------------------------------------------------------- dense models


def test_llama_70b_does_not_fit_data_parallel_on_mixed_24() -> None:
    """The problem being fixed: every GPU would hold all 133 GiB of shared weights."""
    req = _llama_request(_fleet("mixed-24"))
    dp = build_cost_table(req.fleet, req.model, req.workload, req.settings)
    why = fits_at_all(req, dp)
    assert why is not None and "a100-0/gpu0" in why.reasons[0]


@pytest.mark.parametrize("policy", ["ilp", "greedy", "uniform"])
def test_llama_70b_places_on_mixed_24_with_tensor_parallel_groups(policy: str) -> None:
    result = solve(_llama_request(_fleet("mixed-24"), policy))
    plan = result.plan
    assert result.placed and plan.summary.feasible, result.infeasible
    assert all(g.attention_tp >= 2 for g in plan.gpus)
    a100 = [g for g in plan.gpus if g.node == "a100-0"]
    assert all(g.attention_tp >= 4 for g in a100)  # 133 GiB / 2 + KV exceeds 73.6 GiB usable
    assert any("attention tensor-parallel" in n for n in plan.notes)


def test_dp_groups_get_unequal_shares_across_gpu_generations() -> None:
    plan = solve(_llama_request(_fleet("mixed-24"))).plan
    share = {g.node: g.attention_share for g in plan.gpus}
    assert share["a100-0"] < share["h100-0"] < share["h200-0"]


def test_llama_70b_places_on_one_node_of_8_a100() -> None:
    result = solve(_llama_request(fleet([("a100-0", "A100-SXM4-80GB", 8, 600.0)])))
    assert result.placed and result.plan.summary.feasible, result.infeasible
    assert {g.attention_tp for g in result.plan.gpus} <= {4, 8}


def test_a_model_too_big_for_the_largest_group_names_it() -> None:
    result = solve(_llama_request(fleet([("l4-0", "L4", 2, None)])))
    assert not result.placed
    assert "attention TP 2" in result.infeasible[0]


# --------------------------------------------------------------------------- cost and memory


def _llama_shared_bytes(m: ModelSpec) -> float:
    """Attention, dense FFN and embedding bytes of Llama-3.1-70B, from its config figures."""
    h, layers, heads, kv_heads, head_dim, ffn, vocab = 8192, 80, 64, 8, 128, 28672, 128256
    attn = h * heads * head_dim * 2 + 2 * h * kv_heads * head_dim
    assert (m.hidden, m.num_layers, m.vocab) == (h, layers, vocab)
    return (layers * (attn + 3 * h * ffn) + 2 * vocab * h) * 2.0


def test_memory_per_gpu_is_what_the_formula_says() -> None:
    plan = solve(_llama_request(_fleet("mixed-24"))).plan
    m = preset("llama-3.1-70b")
    buffers = CostSettings().comm_buffer_gib * GIB
    total_tokens = 16 * 24
    for g in plan.gpus:
        k = g.attention_tp
        assert g.memory_bytes["weights"] == pytest.approx(_llama_shared_bytes(m) / k + buffers)
        tokens = g.attention_share * total_tokens  # this GPU's 1/k of its group's tokens
        kv = tokens * k * 4096 * LLAMA_KV_BYTES_PER_TOKEN / min(k, 8)
        assert g.memory_bytes["kv_cache"] == pytest.approx(kv)


def test_kv_is_replicated_past_the_kv_heads_and_for_mla() -> None:
    assert kv_shards(preset("llama-3.1-70b"), 8) == 8
    assert kv_shards(preset("qwen3-235b-a22b"), 8) == 4  # 4 KV heads: replicated twice
    assert kv_shards(tiny_model(), 8) == 1  # MLA: the latent is whole on every rank
    f = fleet([("h100-0", "H100-SXM5-80GB", 8, 900.0)])
    for m, factor in ((preset("qwen3-235b-a22b"), 2.0), (tiny_model(), 8.0)):
        w = make_workload(m, phase="decode", tokens_per_gpu=8, context_len=2048, load=None)
        dp = build_cost_table(f, m, w)
        tp = tp_cost_table(f, m, w, None, (8,) * 8)
        assert tp.kv_cache_bytes(0, 8.0) == pytest.approx(factor * dp.kv_cache_bytes(0, 8.0))
    with pytest.raises(InputError) as err:
        tp_cost_table(f, m, w, None, (2,))
    assert err.value.field == "attention_tp"


def test_attention_time_gains_the_all_reduces_and_loses_weight_reads() -> None:
    f = fleet([("h100-0", "H100-SXM5-80GB", 8, 900.0)])
    m = preset("llama-3.1-70b")
    w = make_workload(m, phase="decode", tokens_per_gpu=16, context_len=4096, load=None)
    s = CostSettings()
    dp = build_cost_table(f, m, w, s)
    k = 4
    tp = with_attention_tp(dp, f, m, w, s, (k,) * 8)
    a, b = dp.gpus[0], tp.gpus[0]
    bw = a.comm_bw_bytes_per_us[Channel.NVLINK]
    assert b.attn_weight_read_us["dense"] == pytest.approx(a.attn_weight_read_us["dense"] / k)
    assert b.attn_gemm_us_per_token == a.attn_gemm_us_per_token
    # two ring all-reduces of 2 (k-1)/k x (k x tokens x hidden x 2 B) each, per GPU token
    per_token = 2 * 2 * (k - 1) * m.hidden * 2.0 / bw
    assert b.attn_core_us_per_token - a.attn_core_us_per_token == pytest.approx(per_token)
    assert b.attn_overhead_us - a.attn_overhead_us == pytest.approx(
        2 * s.efficiency.allreduce_latency_us
    )


# --------------------------------------------------------------------------- groups


def test_a_groups_gpus_share_one_node_model_and_share() -> None:
    plan = solve(_llama_request(_fleet("mixed-24"))).plan
    for index, members in _groups(plan).items():
        gs = [plan.gpus[i] for i in members]
        assert len(gs) == gs[0].attention_tp, index
        assert len({(g.node, g.model, g.attention_tp) for g in gs}) == 1
        assert max(g.attention_share for g in gs) - min(g.attention_share for g in gs) < 1e-9
    assert dp_group_problems(plan) == []


def test_the_validator_catches_a_broken_group() -> None:
    plan = solve(_llama_request(_fleet("mixed-24"))).plan
    gpus = list(plan.gpus)
    gpus[0] = dataclasses.replace(gpus[0], attention_share=gpus[0].attention_share * 2)
    gpus[9] = dataclasses.replace(gpus[9], dp_group=gpus[0].dp_group)
    problems = dp_group_problems(dataclasses.replace(plan, gpus=tuple(gpus)))
    assert any("unequal attention shares" in p for p in problems)
    assert any("differ in node" in p for p in problems)


def test_groups_follow_fleet_order_inside_a_node_and_model() -> None:
    f = parse_fleet(
        {
            "apiVersion": "mixfleet.io/v1alpha1",
            "kind": "Fleet",
            "metadata": {"name": "t"},
            "spec": {
                "nodes": [
                    {
                        "name": "n0",
                        "gpus": [
                            {"model": "H100-SXM5-80GB", "count": 4},
                            {"model": "A100-SXM4-80GB", "count": 4},
                        ],
                    }
                ]
            },
        }
    )
    assert dp_groups(f, (2, 2, 2, 2, 4, 4, 4, 4)) == (0, 0, 1, 1, 2, 2, 2, 2)
    assert dp_groups(f, (1, 1, 2, 2, 1, 1, 1, 1)) == (0, 1, 2, 2, 3, 4, 5, 6)


def test_plans_from_before_groups_read_with_defaults() -> None:
    plan = solve(_llama_request(_fleet("mixed-24"))).plan
    doc = gpu_plan_to_dict(plan.gpus[0])
    assert doc["attention_tp"] == 8
    del doc["attention_tp"], doc["dp_group"]
    old = gpu_plan_from_dict(doc, "gpus[0]")
    assert (old.attention_tp, old.dp_group) == (1, None)
    doc["attention_tp"] = 0
    with pytest.raises(InputError) as err:
        gpu_plan_from_dict(doc, "gpus[0]")
    assert err.value.field == "gpus[0].attention_tp"


# --------------------------------------------------------------------------- engines


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_an_engine_runs_one_tp_size_in_consecutive_blocks(engine: str) -> None:
    req = _llama_request(_fleet("mixed-24"), engine=engine)
    base = build_cost_table(req.fleet, req.model, req.workload, req.settings)
    assert all(len(set(v)) == 1 for v in candidates(req, base))
    plan = solve(req).plan
    sizes = {g.attention_tp for g in plan.gpus}
    assert len(sizes) == 1 and plan.summary.feasible
    k = sizes.pop()
    assert [g.dp_group for g in plan.gpus] == [r // k for r in range(24)]  # dp_rank = rank // k
    native = dataclasses.replace(
        plan.gpus[0], attention_tp=1, dp_group=1000
    )  # one GPU alone: two sizes in one server
    mixed = dataclasses.replace(plan, gpus=(native, *plan.gpus[1:]))
    assert any("one attention TP size" in p for p in dp_group_problems(mixed))


def test_native_may_vary_the_size_per_class() -> None:
    req = _llama_request(_fleet("mixed-24"))
    base = build_cost_table(req.fleet, req.model, req.workload, req.settings)
    assert any(len(set(v)) > 1 for v in candidates(req, base))


def test_trtllm_keeps_data_parallel_attention_for_moe() -> None:
    m = preset("deepseek-v3")
    f = _fleet("mixed-24")
    w = make_workload(m, phase="decode", tokens_per_gpu=8, context_len=4096, load=None)
    req = PlacementRequest(f, m, w, engine=EngineSpec(name="trtllm"))
    base = build_cost_table(f, m, w, req.settings)
    assert candidates(req, base) == [(1,) * 24]


# --------------------------------------------------------------------------- MoE models


def _deepseek(f: Fleet, tokens: int, context: int, policy: str = "greedy") -> PlacementRequest:
    m = preset("deepseek-v3")
    w = make_workload(
        m,
        phase="decode",
        tokens_per_gpu=tokens,
        context_len=context,
        load=synthetic_zipf(m, "synthetic:zipf:0.5:seed=1"),
        kv_cache_dtype="fp8",
    )
    return PlacementRequest(f, m, w, policy=policy, redundant_experts=32)


@pytest.mark.parametrize("form", ["engine", "native"])
def test_tp_does_not_change_the_mixed_24_decode_benchmark_plan(form: str) -> None:
    """DeepSeek-V3's MLA latent is whole on every TP rank: data-parallel attention stays best
    and the plan is exactly the data-parallel one."""
    req = dataclasses.replace(_deepseek(_fleet("mixed-24"), 128, 4096), form=form)
    plan = solve(req).plan
    assert {g.attention_tp for g in plan.gpus} == {1}
    dp = build_cost_table(req.fleet, req.model, req.workload, req.settings)
    raw = greedy.place(req, dp)
    assert isinstance(raw, RawPlacement)
    assert plan.id == assemble_plan(req, dp, raw, 0.0).plan.id


def test_long_context_deepseek_places_only_with_tensor_parallel_groups() -> None:
    """DeepSeek-V3 decode at 131072 tokens of context on 16 L40S + 8 H100: with every GPU
    holding all shared weights the experts and KV do not fit; L40S groups of 2 free it."""
    req = _deepseek(_fleet("ada-hopper"), 2, 131072)
    dp = build_cost_table(req.fleet, req.model, req.workload, req.settings)
    assert fits_at_all(req, dp) is not None
    result = solve(req)
    assert result.placed and result.plan.summary.feasible, result.infeasible
    assert {(g.node, g.attention_tp) for g in result.plan.gpus if g.node.startswith("l40s")} == {
        ("l40s-0", 2),
        ("l40s-1", 2),
    }


def test_the_choice_is_never_slower_than_data_parallel_attention() -> None:
    """Qwen3-235B on L40S + H100 (the ada-hopper benchmark): the kept choice is never slower
    than the data-parallel plan of the same policy. The L40S are not grouped: their
    all-reduces go over PCIe at the measured NCCL rate (1.43 GB/s bus bandwidth on 8 L40S,
    policies.estimate.reference), not the link's 25.6 GB/s, so at 32 tokens per GPU a group's two
    all-reduces per layer cost more than halving its weight reads saves. (Priced at the link
    peak, groups of 2 were chosen.)"""
    m = preset("qwen3-235b-a22b")
    load = synthetic_zipf(m, "synthetic:zipf:0.5:seed=1")
    w = make_workload(
        m, phase="decode", tokens_per_gpu=32, context_len=2048, load=load, kv_cache_dtype="fp8"
    )
    req = PlacementRequest(_fleet("ada-hopper"), m, w, policy="greedy", redundant_experts=16)
    chosen = choose(req, PLACE["greedy"], fits_at_all)
    assert isinstance(chosen.answer, RawPlacement)
    mine = assemble_plan(req, chosen.table, chosen.answer, 0.0).evaluation
    dp = build_cost_table(req.fleet, req.model, req.workload, req.settings)
    raw = greedy.place(req, dp)
    assert isinstance(raw, RawPlacement)
    base = assemble_plan(req, dp, raw, 0.0).evaluation
    assert mine.feasible and base.feasible
    assert mine.step_time_us <= base.step_time_us
    tp = chosen.attention_tp or (1,) * len(req.fleet.gpus)  # empty: every GPU its own rank
    l40s = [i for i, g in enumerate(req.fleet.gpus) if g.spec.model == "L40S"]
    assert l40s and all(tp[i] == 1 for i in l40s)
