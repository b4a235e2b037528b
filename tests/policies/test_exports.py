"""Engine exports of plans (policies/exports.py): shapes, padding, replica counts, round trip."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.errors import InputError
from policies.exports import EXPORT_FORMATS, export_plan, export_sidecar
from policies.fleet import Fleet, parse_fleet
from policies.models import ModelSpec, from_hf_config
from policies.plan import ExpertSlot, Plan, validate_plan
from policies.request import PlacementRequest
from policies.solve import solve
from policies.workload import make_workload, synthetic_zipf

# A DeepSeek-shaped model small enough to solve in milliseconds: 1 dense layer, then 3 MoE
# layers of 16 experts.
MINI_DEEPSEEK: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "moe_intermediate_size": 512,
    "num_attention_heads": 16,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "vocab_size": 32000,
    "quantization_config": {"quant_method": "fp8"},
}


def mixed_fleet(per_node: int = 2) -> Fleet:
    """One A100 node and one H100 node, ``per_node`` GPUs each, on one IB fabric."""
    nic = [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib0"}]
    return parse_fleet(
        {
            "metadata": {"name": "mini"},
            "spec": {
                "nodes": [
                    {
                        "name": "a100-0",
                        "gpus": [{"model": "A100-SXM4-80GB", "count": per_node}],
                        "nvlink": {"per_gpu_bidir_gbytes_per_s": 600},
                        "nics": nic,
                    },
                    {
                        "name": "h100-0",
                        "gpus": [{"model": "H100-SXM5-80GB", "count": per_node}],
                        "nvlink": {"per_gpu_bidir_gbytes_per_s": 900},
                        "nics": nic,
                    },
                ]
            },
        }
    )


def mini_model() -> ModelSpec:
    return from_hf_config(MINI_DEEPSEEK, "mini-deepseek")


def make_plan(
    policy: str = "eplb",
    *,
    form: str = "engine",
    redundant: int = 4,
    seed: int = 1,
    skew: float = 1.2,
    model: ModelSpec | None = None,
) -> Plan:
    m = model or mini_model()
    load = synthetic_zipf(m, f"synthetic:zipf:{skew}:seed={seed}") if m.is_moe else None
    workload = make_workload(m, phase="decode", tokens_per_gpu=32, context_len=1024, load=load)
    req = PlacementRequest(
        mixed_fleet(), m, workload, policy=policy, form=form, redundant_experts=redundant
    )
    return solve(req).plan


# --------------------------------------------------------------------------- shapes


def test_sglang_covers_every_decoder_layer_with_trivial_dense_rows() -> None:
    plan = make_plan()
    doc = export_plan(plan, "sglang")
    assert list(doc) == ["physical_to_logical_map"]
    rows = doc["physical_to_logical_map"]
    physical = plan.num_experts + plan.num_redundant
    assert len(rows) == plan.num_layers == 4
    assert all(len(r) == physical for r in rows)
    assert rows[0] == [p % plan.num_experts for p in range(physical)]  # dense layer 0
    assert [rows[layer] for layer in plan.moe_layers] == plan.physical_to_logical()


def test_vllm_shapes_padding_and_counts() -> None:
    plan = make_plan(redundant=8)
    doc = export_plan(plan, "vllm")
    assert set(doc) == {
        "physical_to_logical_map",
        "logical_to_physical_map",
        "logical_replica_count",
    }
    n_moe, experts, physical = len(plan.moe_layers), plan.num_experts, 24
    phy2log = doc["physical_to_logical_map"]
    log2phy = doc["logical_to_physical_map"]
    counts = doc["logical_replica_count"]
    assert len(phy2log) == n_moe and all(len(r) == physical for r in phy2log)
    assert len(log2phy) == n_moe
    assert all(len(layer) == experts for layer in log2phy)
    assert all(len(row) == plan.num_redundant + 1 for layer in log2phy for row in layer)
    assert len(counts) == n_moe and all(len(r) == experts for r in counts)
    padded = 0
    for li in range(n_moe):
        for e in range(experts):
            row = log2phy[li][e]
            real = row[: counts[li][e]]
            assert counts[li][e] >= 1
            assert all(p >= 0 for p in real)
            assert row[counts[li][e] :] == [-1] * (len(row) - counts[li][e])
            assert real == sorted(real)
            assert all(phy2log[li][p] == e for p in real)
            padded += len(row) - counts[li][e]
        assert sum(counts[li]) == physical
    assert padded > 0  # some experts have fewer than R + 1 replicas: -1 padding is exercised
    assert max(c for layer in counts for c in layer) > 1  # the skewed load got replicas


def test_trtllm_is_exactly_the_load_balancer_config() -> None:
    plan = make_plan()
    doc = export_plan(plan, "trtllm")
    assert set(doc) == {"num_slots", "initial_global_assignments", "layer_updates_per_iter"}
    assert doc["num_slots"] == plan.num_experts + plan.num_redundant == 20
    assert doc["layer_updates_per_iter"] == 0
    assignments = doc["initial_global_assignments"]
    assert list(assignments) == [1, 2, 3]  # decoder layer indices, dense layer 0 left out
    assert [assignments[k] for k in plan.moe_layers] == plan.physical_to_logical()


def test_uniform_plan_exports_the_trivial_placement() -> None:
    plan = make_plan("uniform", redundant=0)
    rows = export_plan(plan, "sglang")["physical_to_logical_map"]
    assert rows == [list(range(16))] * 4
    vllm = export_plan(plan, "vllm")
    assert vllm["logical_to_physical_map"][0] == [[e] for e in range(16)]
    assert vllm["logical_replica_count"] == [[1] * 16] * 3


# ------------------------------------------------------------------ round trip


def _rebuild_slots(plan: Plan, doc: dict[str, Any]) -> list[list[list[int]]]:
    """Per MoE layer, per GPU, the experts on its slots as the engine would lay them out."""
    slots = plan.slots_per_gpu
    assert slots is not None
    log2phy = doc["logical_to_physical_map"]
    out: list[list[list[int]]] = []
    for layer in log2phy:
        phy = [-1] * (slots * len(plan.gpus))
        for e, row in enumerate(layer):
            for p in row:
                if p >= 0:
                    assert phy[p] == -1, "physical slot listed twice"
                    phy[p] = e
        assert -1 not in phy
        out.append([phy[g * slots : (g + 1) * slots] for g in range(len(plan.gpus))])
    return out


@settings(max_examples=20, deadline=None)
@given(
    policy=st.sampled_from(["eplb", "greedy", "uniform"]),
    redundant=st.sampled_from([0, 4, 8, 12]),
    seed=st.integers(0, 1000),
    skew=st.sampled_from([0.0, 0.8, 1.5]),
)
def test_round_trip_recovers_every_gpus_slots(
    policy: str, redundant: int, seed: int, skew: float
) -> None:
    plan = make_plan(policy, redundant=redundant, seed=seed, skew=skew)
    if validate_plan(plan):  # an invalid plan is refused cleanly, never exported half-right
        with pytest.raises(InputError):
            export_plan(plan, "vllm")
        return
    vllm = export_plan(plan, "vllm")
    rebuilt = _rebuild_slots(plan, vllm)
    for li in range(len(plan.moe_layers)):
        assert rebuilt[li] == [[s.expert for s in g.experts[li]] for g in plan.gpus]
    sglang = export_plan(plan, "sglang")["physical_to_logical_map"]
    trt = export_plan(plan, "trtllm")["initial_global_assignments"]
    for li, layer in enumerate(plan.moe_layers):
        assert sglang[layer] == vllm["physical_to_logical_map"][li] == trt[layer]
        # replica counts agree with the plan's equal shares (engine form: 1 / replicas)
        for g in plan.gpus:
            for s in g.experts[li]:
                assert s.share == pytest.approx(1.0 / vllm["logical_replica_count"][li][s.expert])


# ------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_native_plan_is_refused_with_the_fix(fmt: str) -> None:
    plan = make_plan("greedy", form="native", redundant=3)
    with pytest.raises(InputError, match="--form engine"):
        export_plan(plan, fmt)


def test_unknown_format_is_refused() -> None:
    with pytest.raises(InputError, match="sglang, vllm, trtllm"):
        export_plan(make_plan(), "deepspeed")


def test_dense_model_has_nothing_to_export() -> None:
    dense = from_hf_config(
        {
            "model_type": "llama",
            "num_hidden_layers": 4,
            "hidden_size": 1024,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "intermediate_size": 4096,
            "vocab_size": 32000,
        },
        "mini-llama",
    )
    plan = make_plan("uniform", redundant=0, model=dense)
    with pytest.raises(InputError, match="dense model"):
        export_plan(plan, "sglang")


def test_unequal_slots_are_refused() -> None:
    plan = make_plan()
    first = plan.gpus[0]
    shorter = replace(first, experts=(first.experts[0][:-1], *first.experts[1:]))
    broken = replace(plan, gpus=(shorter, *plan.gpus[1:]))
    with pytest.raises(InputError, match="slots in MoE layer 0"):
        export_plan(broken, "vllm")


def test_uncovered_expert_is_refused() -> None:
    plan = make_plan("uniform", redundant=0)
    first = plan.gpus[0]
    layer0 = tuple(ExpertSlot(1, s.share) for s in first.experts[0])  # expert 0 vanishes
    broken = replace(
        plan, gpus=(replace(first, experts=(layer0, *first.experts[1:])), *plan.gpus[1:])
    )
    with pytest.raises(InputError, match=r"no replica of experts \[0, 2, 3\]"):
        export_plan(broken, "trtllm")


# ------------------------------------------------------------------------- sidecar


def test_sidecar_carries_dp_weights_and_hints_per_rank() -> None:
    plan = make_plan("greedy")
    side = export_sidecar(plan)
    weights = side["dp_attention_weights"]
    assert len(weights) == len(plan.gpus) == len(side["ranks"])
    assert sum(weights) / len(weights) == pytest.approx(1.0)
    assert weights[2] > weights[0]  # H100 ranks take more tokens than A100 ranks
    ranks = side["ranks"]
    assert [r["rank"] for r in ranks] == list(range(4))
    assert ranks[0]["hints"]["attention_backend"] == "fa2"
    assert ranks[2]["hints"]["attention_backend"] == "fa3"
    assert ranks[0]["num_slots"] == [plan.slots_per_gpu] * 3
    assert side["plan_id"] == plan.id and side["form"] == "engine"
    # the engine file itself stays free of the sidecar's keys
    assert "dp_attention_weights" not in export_plan(plan, "sglang")
