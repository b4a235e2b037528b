"""Builders for small planning inputs used across the policies tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from policies.estimate.workload import Workload, make_workload
from policies.hardware.fleet import Fleet, parse_fleet
from policies.model.architecture import ModelSpec, from_hf_config
from policies.request import PlacementRequest, SolverOptions


def tiny_model(
    experts: int = 8, moe_layers: int = 2, top_k: int = 2, dense_layers: int = 0
) -> ModelSpec:
    """A DeepSeek-shaped MoE small enough to brute-force (FP8 weights, MLA attention)."""
    return from_hf_config(
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": dense_layers + moe_layers,
            "first_k_dense_replace": dense_layers,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "moe_intermediate_size": 512,
            "num_attention_heads": 16,
            "q_lora_rank": 256,
            "kv_lora_rank": 128,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "n_routed_experts": experts,
            "n_shared_experts": 1,
            "num_experts_per_tok": top_k,
            "n_group": 1,
            "topk_group": 1,
            "vocab_size": 32000,
            "quantization_config": {"quant_method": "fp8"},
        },
        name=f"tiny-{experts}x{moe_layers}",
    )


def fleet_doc(
    nodes: Sequence[tuple[str, str, int, float | None]],
    nic_per_direction_gbits_per_s: float = 400.0,
) -> dict[str, Any]:
    """A Fleet document from ``(name, model, count, nvlink_bidir_gbytes_per_s or None)`` tuples, one
    400 Gb/s NIC per node on fabric ib0."""
    out = []
    for name, model, count, nvl in nodes:
        node: dict[str, Any] = {
            "name": name,
            "gpus": [{"model": model, "count": count}],
            "nics": [
                {
                    "count": 1,
                    "per_direction_gbits_per_s": nic_per_direction_gbits_per_s,
                    "fabric": "ib0",
                }
            ],
        }
        if nvl:
            node["nvlink"] = {"domain": name, "per_gpu_bidir_gbytes_per_s": nvl}
        out.append(node)
    return {
        "apiVersion": "mixfleet.io/v1alpha1",
        "kind": "Fleet",
        "metadata": {"name": "t"},
        "spec": {"nodes": out},
    }


def fleet(nodes: Sequence[tuple[str, str, int, float | None]]) -> Fleet:
    return parse_fleet(fleet_doc(nodes))


def workload(
    model: ModelSpec,
    load: Sequence[Sequence[float]] | None = None,
    *,
    phase: str = "decode",
    tokens: int = 64,
    context: int = 1024,
) -> Workload:
    return make_workload(model, phase=phase, tokens_per_gpu=tokens, context_len=context, load=load)


def request(
    f: Fleet,
    m: ModelSpec,
    w: Workload,
    *,
    policy: str = "ilp",
    form: str = "engine",
    redundant: int = 0,
    previous: Any = None,
    time_limit_s: float = 20.0,
    workers: int = 1,
) -> PlacementRequest:
    return PlacementRequest(
        f,
        m,
        w,
        policy=policy,
        form=form,
        redundant_experts=redundant,
        previous=previous,
        options=SolverOptions(time_limit_s=time_limit_s, workers=workers, mip_gap=1e-6),
    )
