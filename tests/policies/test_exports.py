"""Engine exports of plans (policies/exports/engine.py, policies/exports/manifest.py): shapes, replica
counts, round trip, the refusals (infeasible, invalid, other engine, unplaceable model), the
TensorRT-LLM MTP rows and the manifest's rank -> GPU order.

The engines' own loaders read these files in tests/conformance (``make conformance``)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.errors import InputError
from policies.estimate.engines import EngineSpec
from policies.estimate.workload import make_workload, synthetic_zipf
from policies.exports.engine import (
    EXPORT_FORMATS,
    VLLM_NO_REBALANCE_STEP_INTERVAL,
    export_plan,
    export_sidecar,
    placement_document,
)
from policies.exports.manifest import export_manifest
from policies.hardware.fleet import Fleet, parse_fleet
from policies.model.architecture import ModelSpec, from_hf_config, preset
from policies.plan import ExpertSlot, Plan, validate_plan
from policies.request import PlacementRequest
from policies.solve import solve

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
    engine: str = "native",
) -> Plan:
    m = model or mini_model()
    load = synthetic_zipf(m, f"synthetic:zipf:{skew}:seed={seed}") if m.is_moe else None
    workload = make_workload(m, phase="decode", tokens_per_gpu=32, context_len=1024, load=load)
    req = PlacementRequest(
        mixed_fleet(),
        m,
        workload,
        policy=policy,
        form=form,
        redundant_experts=redundant,
        engine=EngineSpec(engine),  # type: ignore[arg-type]
    )
    return solve(req).plan


def exportable(plan: Plan) -> bool:
    """What an export checks before it writes anything."""
    return not plan.violations and not validate_plan(plan) and plan.summary.feasible


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


def test_vllm_is_the_eplb_map_and_replica_counts() -> None:
    plan = make_plan(redundant=8)
    doc = export_plan(plan, "vllm", mini_model())
    # No logical_to_physical_map: vLLM derives it, 1024 wide, from physical_to_logical_map.
    assert set(doc) == {"physical_to_logical_map", "logical_replica_count"}
    n_moe, experts, physical = len(plan.moe_layers), plan.num_experts, 24
    phy2log, counts = doc["physical_to_logical_map"], doc["logical_replica_count"]
    assert phy2log == plan.physical_to_logical()
    assert len(phy2log) == n_moe and all(len(r) == physical for r in phy2log)
    assert len(counts) == n_moe and all(len(r) == experts for r in counts)
    for li in range(n_moe):
        assert counts[li] == [phy2log[li].count(e) for e in range(experts)]
        assert sum(counts[li]) == physical and min(counts[li]) >= 1
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
    assert vllm["logical_replica_count"] == [[1] * 16] * 3


# ------------------------------------------------------------------ round trip


def _rebuild_slots(plan: Plan, doc: dict[str, Any]) -> list[list[list[int]]]:
    """Per MoE layer, per GPU, the experts on its slots as the engine lays them out (slot p on
    rank p // slots_per_gpu)."""
    slots = plan.slots_per_gpu
    assert slots is not None
    return [
        [row[g * slots : (g + 1) * slots] for g in range(len(plan.gpus))]
        for row in doc["physical_to_logical_map"]
    ]


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
    if not exportable(plan):  # refused cleanly, never exported half-right
        with pytest.raises(InputError, match="cannot be exported"):
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


# ------------------------------------------------------- validity and engine refusals


def test_infeasible_plan_is_refused_for_every_format() -> None:
    plan = make_plan()
    broken = replace(
        plan,
        violations=("a100-0/gpu0: needs 90.0 GiB, 79.0 GiB usable",),
        summary=replace(plan.summary, feasible=False),
    )
    for fmt in EXPORT_FORMATS:
        with pytest.raises(InputError, match=r"cannot be exported.*90\.0 GiB") as info:
            export_plan(broken, fmt)
        assert info.value.field == "plan"
        with pytest.raises(InputError, match="cannot be exported"):
            export_manifest(broken, fmt)
    # a summary that calls itself infeasible is enough, even without a listed violation
    with pytest.raises(InputError, match="summary says it is infeasible"):
        export_plan(replace(plan, summary=replace(plan.summary, feasible=False)), "sglang")


def test_a_replica_share_that_is_not_the_engines_is_refused() -> None:
    """A 0.9 share on one replica is no split any even-dispatch engine produces."""
    plan = make_plan(redundant=8)
    layer0 = plan.physical_to_logical()[0]
    shared = next(e for e in range(plan.num_experts) if layer0.count(e) > 1)
    gpus = []
    done = False
    for g in plan.gpus:
        first = []
        for s in g.experts[0]:
            if s.expert == shared and not done:
                s, done = ExpertSlot(s.expert, 0.9), True
            first.append(s)
        gpus.append(replace(g, experts=(tuple(first), *g.experts[1:])))
    broken = replace(plan, gpus=tuple(gpus))
    assert any(f"expert {shared} replica share 0.9000" in p for p in validate_plan(broken))
    for fmt in EXPORT_FORMATS:
        with pytest.raises(InputError, match=rf"cannot be exported to {fmt}.*layer 0"):
            export_plan(broken, fmt)


def test_a_plan_for_one_engine_is_not_exported_for_another() -> None:
    plan = make_plan(engine="vllm")
    assert plan.engine.name == "vllm" and plan.engine.dispatch == "even"
    assert exportable(plan)
    assert export_plan(plan, "vllm", mini_model())["physical_to_logical_map"]
    for fmt in ("sglang", "trtllm"):
        with pytest.raises(InputError, match=rf"solved for vllm.*--engine {fmt}") as info:
            export_plan(plan, fmt, mini_model())
        assert info.value.field == "engine"
    # the node-side carrier of the map does not second-guess the engine
    assert placement_document(plan, "sglang")["physical_to_logical_map"]


def test_a_native_plan_goes_to_any_engine_and_the_manifest_says_it_is_idealised() -> None:
    plan = make_plan()
    assert plan.engine.name == "native"
    for fmt in EXPORT_FORMATS:
        export_plan(plan, fmt, mini_model())
        notes = " ".join(export_manifest(plan, fmt, mini_model())["notes"])
        assert "predicted step time is idealised" in notes and f"--engine {fmt}" in notes


def test_a_model_other_than_the_plans_is_refused() -> None:
    other = from_hf_config({**MINI_DEEPSEEK, "n_routed_experts": 32}, "mini-32")
    with pytest.raises(InputError, match=r"is not plan .* model mini-deepseek"):
        export_plan(make_plan(), "sglang", other)


MINI_MIXTRAL: dict[str, Any] = {
    "model_type": "mixtral",
    "num_hidden_layers": 2,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 1024,
    "vocab_size": 32000,
}


def test_models_an_engine_cannot_place_are_refused_with_the_reason() -> None:
    mixtral = from_hf_config(MINI_MIXTRAL, "mini-mixtral")
    plan = make_plan("uniform", redundant=0, model=mixtral)
    with pytest.raises(InputError, match="get_model_config_for_expert_location"):
        export_plan(plan, "sglang", mixtral)
    assert export_plan(plan, "vllm", mixtral)["logical_replica_count"] == [[1] * 8] * 2
    assert export_plan(plan, "trtllm", mixtral)["num_slots"] == 8
    gpt = replace(mixtral, family="gpt_oss", name="mini-gpt-oss")
    gpt_plan = replace(plan, model=gpt.name)
    with pytest.raises(InputError, match="GptOssForCausalLM is not a MixtureOfExperts"):
        export_plan(gpt_plan, "vllm", gpt)
    with pytest.raises(InputError, match="not in moe_model_arch_list"):
        export_plan(gpt_plan, "trtllm", gpt)


def test_trtllm_refuses_a_single_rank() -> None:
    plan = make_plan("uniform", redundant=0)
    one = replace(plan, gpus=plan.gpus[:1], slots_per_gpu=16)
    full = tuple(ExpertSlot(e, 1.0) for e in range(16))
    one = replace(one, gpus=(replace(one.gpus[0], experts=(full,) * 3, attention_share=1.0),))
    assert export_plan(one, "sglang", mini_model())
    with pytest.raises(InputError, match="more than one rank"):
        export_plan(one, "trtllm", mini_model())


def test_ranks_of_a_node_must_be_contiguous() -> None:
    plan = make_plan()
    g = plan.gpus
    shuffled = replace(plan, gpus=(g[0], g[2], g[1], g[3]))
    with pytest.raises(InputError, match="not contiguous"):
        export_plan(shuffled, "vllm")


# ------------------------------------------------------------------- MTP layers


def test_deepseek_v3_has_one_mtp_layer() -> None:
    assert preset("deepseek-v3").mtp_layers == 1
    assert preset("qwen3-235b-a22b").mtp_layers == 0
    assert mini_model().mtp_layers == 0


def test_trtllm_gives_the_mtp_layer_the_last_moe_layers_row() -> None:
    mtp = from_hf_config({**MINI_DEEPSEEK, "num_nextn_predict_layers": 1}, "mini-deepseek")
    plan = make_plan()
    doc = export_plan(plan, "trtllm", mtp)
    assignments = doc["initial_global_assignments"]
    assert list(assignments) == [1, 2, 3, 4]  # MoE layers, then MTP layer_idx = num_layers
    assert assignments[4] == assignments[3] == plan.physical_to_logical()[-1]
    # the SGLang map stays num_hidden_layers rows: its draft layer does not read it
    assert len(export_plan(plan, "sglang", mtp)["physical_to_logical_map"]) == 4
    notes = " ".join(export_manifest(plan, "trtllm", mtp)["notes"])
    assert "layer(s) 4 take the last MoE layer's (3) row" in notes
    assert export_manifest(plan, "trtllm", mtp)["mtp_layers"] == 1
    # without the model the MTP layer cannot be known, and the manifest says so
    assert list(export_plan(plan, "trtllm")["initial_global_assignments"]) == [1, 2, 3]
    assert export_manifest(plan, "trtllm")["mtp_layers"] is None
    assert "were not checked" in " ".join(export_manifest(plan, "trtllm")["notes"])


# --------------------------------------------------------------------- manifest


def test_manifest_records_engine_r_slots_and_the_rank_to_gpu_order() -> None:
    plan = make_plan(redundant=4)
    man = export_manifest(plan, "sglang", mini_model(), file="loc.json", file_sha256="ab" * 32)
    assert man["format"] == "sglang" and man["engine"] == {"name": "sglang", "version": "0.5.23"}
    assert man["world_size"] == 4 and man["num_redundant"] == 4
    assert man["num_physical_slots"] == 20 and man["slots_per_rank"] == 5
    assert man["file"] == "loc.json" and man["file_sha256"] == "ab" * 32
    assert [r["gpu"] for r in man["ranks"]] == [g.gpu for g in plan.gpus]
    assert [r["node_rank"] for r in man["ranks"]] == [0, 0, 1, 1]
    assert [r["local_rank"] for r in man["ranks"]] == [0, 1, 0, 1]
    assert [r["physical_slots"] for r in man["ranks"]] == [[0, 5], [5, 10], [10, 15], [15, 20]]
    assert [n["node"] for n in man["nodes"]] == ["a100-0", "h100-0"]
    assert [n["ranks"] for n in man["nodes"]] == [[0, 1], [2, 3]]
    assert man["nodes"][1]["cuda_visible_devices"] == "0,1"
    assert man["load"]["requires"]["--ep-num-redundant-experts"] == 4
    assert man["load"]["requires"]["--init-expert-location"] == "loc.json"
    assert man["plan"]["id"] == plan.id and man["plan"]["engine"] == "native"


def test_vllm_manifest_says_how_a_launcher_installs_the_state() -> None:
    man = export_manifest(make_plan(), "vllm", mini_model())
    req = man["load"]["requires"]
    assert req["--enable-eplb"] is True
    assert req["--eplb-config"]["step_interval"] == VLLM_NO_REBALANCE_STEP_INTERVAL
    steps = " ".join(man["load"]["launcher_steps"])
    assert "rearrange_expert_weights_inplace" in steps and "update_mapping" in steps
    assert "padded to 1024" in steps


def test_trtllm_refuses_a_plan_that_overflows_at_its_equal_dp_shares() -> None:
    """TensorRT-LLM balances attention-DP ranks equally whatever the plan's router weights:
    a native plan that gives the smaller GPUs less attention (and KV) fits as planned but
    not at 1/N each, and the export names the GPU and by how much."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    fleet = parse_fleet(yaml.safe_load((root / "examples/fleets/mixed-24.yaml").read_text()))
    model = preset("qwen3-235b-a22b")
    req = PlacementRequest(
        fleet,
        model,
        make_workload(model, phase="decode", tokens_per_gpu=64, context_len=4096),
        policy="greedy",
        redundant_experts=16,
    )
    plan = solve(req).plan
    assert plan.engine.name == "native" and not plan.violations  # fits as planned
    assert len({round(g.attention_share, 6) for g in plan.gpus}) > 1
    export_plan(plan, "sglang", model)  # SGLang's router pins the plan's ranks: fine
    with pytest.raises(InputError) as err:
        export_plan(plan, "trtllm", model)
    text = str(err.value)
    assert "equal share of the tokens (1/24)" in text
    assert re.search(r"[a-z0-9-]+/gpu\d+ \(\S+\) needs [\d.]+ GiB of its [\d.]+ GiB usable", text)
    assert "GiB too much" in text and "--engine trtllm" in text
