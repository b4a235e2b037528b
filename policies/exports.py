"""Plan exports: the expert-placement files inference engines read (REFERENCE.md section 4).

Every engine assumes equal expert slots per rank, so only an ``engine``-form plan can be
exported; physical slot ``p`` lives on rank ``p // slots_per_gpu`` (ranks in plan GPU
order). The engine files are written exactly in each engine's own format; what an engine
cannot express in that file (data-parallel attention weights, DeepEP/FlashAttention hints)
goes to a separate sidecar document, :func:`export_sidecar`.

Formats (``P`` physical slots = ``num_experts + num_redundant``, ``E`` logical experts,
``R`` redundant slots, ``L`` decoder layers, ``L_moe`` MoE layers):

* ``sglang`` - ``--init-expert-location`` JSON: ``{"physical_to_logical_map": [L][P]}``
  over *all* decoder layers; a dense layer gets SGLang's trivial row ``p % E``.
* ``vllm`` - EPLB state: ``physical_to_logical_map [L_moe][P]``, ``logical_to_physical_map
  [L_moe][E][R + 1]`` (physical slots of each expert ascending, padded with -1) and
  ``logical_replica_count [L_moe][E]``. vLLM has no flag that loads it; a launcher or a patched
  ``EplbState`` does.
* ``trtllm`` - the MoE load balancer YAML (``MoeLoadBalancerConfig``): ``num_slots`` (P),
  ``initial_global_assignments {decoder layer index: [expert per slot]}`` and
  ``layer_updates_per_iter: 0`` (static placement).

Pure: builds dictionaries, does no I/O.
"""

from __future__ import annotations

from typing import Any

from policies.errors import InputError
from policies.plan import Plan

EXPORT_FORMATS = ("sglang", "vllm", "trtllm")


def _engine_rows(plan: Plan, fmt: str) -> list[list[int]]:
    """``[moe_layer][physical_slot] -> logical expert`` of an engine-form plan, checked.

    Raises:
        InputError: native plan, dense model, unequal slots, expert out of range or missing.
    """
    if not plan.moe_layers or plan.num_experts <= 0:
        raise InputError(
            f"plan {plan.id} is for a dense model ({plan.model}); there is no expert placement "
            f"to export to {fmt}",
            field="model",
        )
    if plan.form != "engine" or plan.slots_per_gpu is None:
        raise InputError(
            f"plan {plan.id} is in {plan.form} form; {fmt} needs equal expert slots on every "
            "GPU. To fix: re-solve with --form engine (mixfleetctl plan solve ... --form engine)",
            field="form",
        )
    slots = plan.slots_per_gpu
    for g in plan.gpus:
        if len(g.experts) != len(plan.moe_layers):
            raise InputError(
                f"{g.gpu} has {len(g.experts)} expert layers, the plan has "
                f"{len(plan.moe_layers)} MoE layers. To fix: re-solve the plan",
                field="gpus",
            )
        for li, layer in enumerate(g.experts):
            if len(layer) != slots:
                raise InputError(
                    f"{g.gpu} holds {len(layer)} slots in MoE layer {li}; engine form needs "
                    f"{slots} on every GPU, so the plan is invalid. To fix: re-solve it "
                    "(mixfleetctl plan show lists its problems)",
                    field="gpus",
                )
    rows = plan.physical_to_logical()
    for li, row in enumerate(rows):
        held = set(row)
        bad = sorted(e for e in held if not 0 <= e < plan.num_experts)
        if bad:
            raise InputError(
                f"MoE layer {li} holds experts {bad[:8]} outside 0..{plan.num_experts - 1}",
                field="gpus",
            )
        missing = [e for e in range(plan.num_experts) if e not in held]
        if missing:
            raise InputError(
                f"MoE layer {li} places no replica of experts {missing[:8]}; an engine would "
                "route their tokens nowhere. To fix: re-solve the plan",
                field="gpus",
            )
    return rows


def _sglang(plan: Plan, rows: list[list[int]]) -> dict[str, Any]:
    num_physical = len(rows[0])
    by_layer = dict(zip(plan.moe_layers, rows, strict=True))
    trivial = [p % plan.num_experts for p in range(num_physical)]
    return {
        "physical_to_logical_map": [
            list(by_layer.get(layer, trivial)) for layer in range(plan.num_layers)
        ]
    }


def _vllm(plan: Plan, rows: list[list[int]]) -> dict[str, Any]:
    width = plan.num_redundant + 1
    log2phy: list[list[list[int]]] = []
    counts: list[list[int]] = []
    for li, row in enumerate(rows):
        replicas: list[list[int]] = [[] for _ in range(plan.num_experts)]
        for p, e in enumerate(row):
            replicas[e].append(p)
        widest = max(len(r) for r in replicas)
        if widest > width:  # cannot happen when P == E + R; guards a hand-edited plan
            raise InputError(
                f"MoE layer {li} has an expert with {widest} replicas; vLLM allows at most "
                f"num_redundant + 1 = {width}",
                field="num_redundant",
            )
        log2phy.append([r + [-1] * (width - len(r)) for r in replicas])
        counts.append([len(r) for r in replicas])
    return {
        "physical_to_logical_map": [list(row) for row in rows],
        "logical_to_physical_map": log2phy,
        "logical_replica_count": counts,
    }


def _trtllm(plan: Plan, rows: list[list[int]]) -> dict[str, Any]:
    return {
        "num_slots": len(rows[0]),
        "initial_global_assignments": {
            layer: list(row) for layer, row in zip(plan.moe_layers, rows, strict=True)
        },
        "layer_updates_per_iter": 0,
    }


def export_plan(plan: Plan, fmt: str) -> dict[str, Any]:
    """Build an engine's expert-placement document from an engine-form plan.

    Args:
        plan: an ``engine``-form plan of an MoE model.
        fmt: ``sglang`` | ``vllm`` | ``trtllm`` (shapes in the module docstring).

    Returns:
        The engine's document as plain lists and dicts (``trtllm`` keys are int layer
        indices, as its YAML has them).

    Raises:
        InputError: unknown format; native-form plan (re-solve with ``--form engine``);
            dense model; a plan whose slots are not equal per GPU or leave an expert uncovered.
    """
    if fmt not in EXPORT_FORMATS:
        raise InputError(
            f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}",
            field="format",
        )
    rows = _engine_rows(plan, fmt)
    if fmt == "sglang":
        return _sglang(plan, rows)
    if fmt == "vllm":
        return _vllm(plan, rows)
    return _trtllm(plan, rows)


def export_sidecar(plan: Plan) -> dict[str, Any]:
    """What the engine files cannot say: per-rank data-parallel attention weights and
    runtime hints, for a launcher or router to apply next to an engine export.

    Works for both forms (native plans carry attention heads instead of equal ranks).

    Returns:
        ``{"plan_id", "plan_version", "fleet", "model", "form", "slots_per_gpu",
        "dp_attention_weights": [per rank, mean 1], "ranks": [{rank, gpu, node, gpu_model,
        attention_share, dp_weight, attention_heads, num_slots per MoE layer (list),
        predicted_busy_us, hints}]}``.
    """
    ranks: list[dict[str, Any]] = []
    for rank, g in enumerate(plan.gpus):
        h = g.hints
        ranks.append(
            {
                "rank": rank,
                "gpu": g.gpu,
                "node": g.node,
                "gpu_model": g.model,
                "attention_share": g.attention_share,
                "dp_weight": g.dp_weight,
                "attention_heads": g.attention_heads,
                "num_slots": [len(layer) for layer in g.experts],
                "predicted_busy_us": g.predicted_busy_us,
                "hints": {
                    "ep_backend": h.ep_backend,
                    "deepep_mode": h.deepep_mode,
                    "deepep_num_sms": h.deepep_num_sms,
                    "num_nvl_bytes": h.num_nvl_bytes,
                    "num_rdma_bytes": h.num_rdma_bytes,
                    "fp8_dispatch": h.fp8_dispatch,
                    "attention_backend": h.attention_backend,
                    "decode_num_splits": h.decode_num_splits,
                },
            }
        )
    return {
        "plan_id": plan.id,
        "plan_version": plan.version,
        "fleet": plan.fleet,
        "model": plan.model,
        "form": plan.form,
        "slots_per_gpu": plan.slots_per_gpu,
        "dp_attention_weights": [g.dp_weight for g in plan.gpus],
        "ranks": ranks,
    }
