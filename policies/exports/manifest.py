"""The manifest beside an engine export: what the engine file cannot say.

An engine file is a bare placement: physical slot ``p`` on rank ``p // slots_per_rank``. Which
GPU is rank ``r``, how many redundant slots the engine must be started with, which flags load
the file and what the plan's prediction assumed are in the manifest, for the launcher that
starts the engine (docs/engines.md). Launching the ranks in another order than the manifest's
permutes the placement without any engine noticing.

Pure: builds dictionaries, does no I/O.
"""

from __future__ import annotations

from typing import Any

from policies.estimate.engines import PINNED_VERSIONS
from policies.exports.engine import (
    VLLM_LIVE_MAP_WIDTH,
    check_export,
    node_order,
    vllm_eplb_config,
)
from policies.model.architecture import ModelSpec
from policies.plan import Plan

MANIFEST_SCHEMA_VERSION = 1


def _gpu_index(gpu_id: str) -> int | None:
    """The node-local GPU index in a ``node/gpuN`` id (NVML numbering), else None."""
    digits = gpu_id.rsplit("/", 1)[-1].removeprefix("gpu")
    return int(digits) if digits.isdigit() else None


def _ranks_and_nodes(plan: Plan, fmt: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per rank: its GPU, node, node rank, local rank and physical slots; per node, in launch
    order: its ranks and the ``CUDA_VISIBLE_DEVICES`` that lists them in rank order."""
    order = node_order(plan, fmt)
    slots = plan.slots_per_gpu or 0
    ranks: list[dict[str, Any]] = []
    local: dict[str, int] = {}
    for rank, g in enumerate(plan.gpus):
        lr = local.get(g.node, 0)
        local[g.node] = lr + 1
        ranks.append(
            {
                "rank": rank,
                "gpu": g.gpu,
                "node": g.node,
                "node_rank": order.index(g.node),
                "local_rank": lr,
                "gpu_index": _gpu_index(g.gpu),
                "gpu_model": g.model,
                "physical_slots": [rank * slots, (rank + 1) * slots],
            }
        )
    nodes: list[dict[str, Any]] = []
    for i, node in enumerate(order):
        mine = [r for r in ranks if r["node"] == node]
        indices = [r["gpu_index"] for r in mine]
        nodes.append(
            {
                "node": node,
                "node_rank": i,
                "ranks": [r["rank"] for r in mine],
                "gpus": [r["gpu"] for r in mine],
                "cuda_visible_devices": (
                    ",".join(str(x) for x in indices) if None not in indices else None
                ),
            }
        )
    return ranks, nodes


def _load(plan: Plan, fmt: str, file: str) -> dict[str, Any]:
    """How the engine consumes the file: the settings it must be started with for the file to
    mean what the plan says, and for vLLM the launcher's steps. Whole command lines per node
    are ``mixfleetctl plan launch``'s."""
    n, r = len(plan.gpus), plan.num_redundant
    path = file or f"<the {fmt} file>"
    nnodes = len(dict.fromkeys(g.node for g in plan.gpus))
    launch = "mixfleetctl plan launch writes each node's whole command line"
    if fmt == "sglang":
        requires: dict[str, Any] = {
            "--init-expert-location": path,
            "--ep-num-redundant-experts": r,
            "--ep-size": n,
            "--nnodes": nnodes,
        }
        if plan.engine.name == "sglang":
            requires["--moe-a2a-backend"] = plan.engine.a2a_backend
        return {"requires": requires, "command_lines": launch}
    if fmt == "vllm":
        eplb = vllm_eplb_config(r)
        return {
            "requires": {
                "--enable-expert-parallel": True,
                "--enable-eplb": True,
                "--eplb-config": eplb,
                "expert parallel size": n,
            },
            "command_lines": launch,
            "launcher_steps": [
                "vLLM loads expert weights in its default layout "
                "(EplbState.build_initial_global_physical_to_logical_map: slot p holds expert p "
                "for p < E, then (p - E) % E); no flag loads this file",
                "on every worker, before the first request: rearrange_expert_weights_inplace("
                "state.physical_to_logical_map, new_map, model.expert_weights, "
                "state.expert_buffer, ep_group, state.communicator) moves the weights "
                "(vllm/distributed/eplb/rebalance_execute.py)",
                "then EplbState.update_mapping(model_config, new_map) installs the maps; it "
                "derives logical_to_physical_map itself, padded to "
                f"{VLLM_LIVE_MAP_WIDTH} (vllm/distributed/eplb/eplb_state.py)",
                "installing the map without moving the weights routes tokens to the wrong experts",
            ],
        }
    return {
        "requires": {
            "tensor_parallel_size": n,
            "moe_expert_parallel_size": n,
            "enable_attention_dp": True,
            "moe_config": {"load_balancer": path},
        },
        "command_lines": launch,
    }


def _notes(plan: Plan, fmt: str, model: ModelSpec | None) -> list[str]:
    """What a reader of the manifest must know about this export."""
    notes = [
        f"launch rank r on ranks[r].gpu, nodes in nodes[] order: the file puts physical slots "
        f"[r * {plan.slots_per_gpu}, (r + 1) * {plan.slots_per_gpu}) on rank r, so another "
        "rank order permutes the placement silently",
        "cuda_visible_devices lists NVML indices: set CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA "
        "numbers the GPUs the same way",
    ]
    pinned = PINNED_VERSIONS[fmt]
    if plan.engine.name == "native":
        notes.append(
            f"the plan was solved for native (idealised shares); {fmt} {pinned} picks replicas "
            f"and balances ranks its own way, so the predicted step time is idealised. For a "
            f"prediction of what {fmt} runs, re-solve with --engine {fmt}"
        )
    elif plan.engine.version and plan.engine.version != pinned:
        notes.append(
            f"the plan was modelled on {fmt} {plan.engine.version}; this file's format is the "
            f"one {fmt} {pinned} loads (checked by make conformance)"
        )
    if model is None:
        notes.append(
            "no model was given: the engine's support for the model family and the model's "
            "multi-token-prediction layers were not checked"
        )
    elif model.mtp_layers:
        notes.append(_mtp_note(plan, fmt, model.mtp_layers))
    return notes


def _mtp_note(plan: Plan, fmt: str, mtp_layers: int) -> str:
    first, last = plan.num_layers, plan.num_layers + mtp_layers - 1
    span = f"{first}" if first == last else f"{first}..{last}"
    if fmt == "trtllm":
        return (
            f"multi-token-prediction layer(s) {span} take the last MoE layer's "
            f"({plan.moe_layers[-1]}) row: TensorRT-LLM's MTP layer is an MoE layer over the "
            "same experts and needs an entry (KeyError: layer_idx otherwise)"
        )
    if fmt == "sglang":
        return (
            f"SGLang's draft (MTP) layer {span} does not read this map: "
            "ExpertLocationDispatchInfo.init_new returns None for draft layers"
        )
    return (
        f"vLLM's MTP drafter (layer {span}) keeps its own EPLB state (DeepSeekMTP); this file "
        "places the target model's MoE layers only"
    )


def export_manifest(
    plan: Plan,
    fmt: str,
    model: ModelSpec | None = None,
    *,
    file: str = "",
    file_sha256: str = "",
) -> dict[str, Any]:
    """What an engine file cannot say, for the launcher that starts the engine on it.

    Args:
        plan: the exported plan (the same checks as :func:`export_plan`).
        fmt: the engine format.
        model: the plan's model (None: model checks skipped, and the manifest says so).
        file: the engine file's name, as the launcher will pass it.
        file_sha256: hex SHA-256 of the engine file's bytes.

    Returns:
        ``{kind, schema_version, format, file, file_sha256, engine {name, version}, plan {id,
        version, fleet, model, form, engine, engine_version, a2a_backend, dispatch,
        dp_balance}, world_size, num_experts, num_redundant, num_physical_slots,
        slots_per_rank, num_layers, moe_layers, mtp_layers (None when unknown), ranks [...],
        nodes [...], load {...}, notes [...]}``.

    Raises:
        InputError: see :func:`check_export`.
    """
    rows = check_export(plan, fmt, model)
    ranks, nodes = _ranks_and_nodes(plan, fmt)
    e = plan.engine
    return {
        "kind": "mixfleet-engine-export",
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "format": fmt,
        "file": file,
        "file_sha256": file_sha256,
        "engine": {"name": fmt, "version": PINNED_VERSIONS[fmt]},
        "plan": {
            "id": plan.id,
            "version": plan.version,
            "fleet": plan.fleet,
            "model": plan.model,
            "form": plan.form,
            "engine": e.name,
            "engine_version": e.version,
            "a2a_backend": e.a2a_backend,
            "dispatch": e.dispatch,
            "dp_balance": e.dp_balance,
        },
        "world_size": len(plan.gpus),
        "num_experts": plan.num_experts,
        "num_redundant": plan.num_redundant,
        "num_physical_slots": len(rows[0]),
        "slots_per_rank": plan.slots_per_gpu,
        "num_layers": plan.num_layers,
        "moe_layers": list(plan.moe_layers),
        "mtp_layers": model.mtp_layers if model is not None else None,
        "ranks": ranks,
        "nodes": nodes,
        "load": _load(plan, fmt, file),
        "notes": _notes(plan, fmt, model),
    }
