"""Plan exports: the expert-placement files inference engines load, and the manifest beside them.

Every engine assumes equal expert slots per rank, so only an ``engine``-form plan can be
exported; physical slot ``p`` lives on rank ``p // slots_per_gpu``, ranks in plan GPU order.
The engine files are written exactly in each engine's own format (none of them has room for
anything else: SGLang raises TypeError on an extra key, TensorRT-LLM's pydantic model forbids
extra fields); what they cannot say goes beside them: the manifest
(:func:`policies.exports.manifest.export_manifest`:
engine, version, world size, R, slots per rank, the rank -> GPU order the file assumes, how to
load it) and the sidecar (:func:`export_sidecar`: DP-attention weights, runtime hints).

Formats (``P`` physical slots = ``num_experts + num_redundant``, ``E`` logical experts,
``R`` redundant slots, ``L`` decoder layers, ``L_moe`` MoE layers), each checked against the
engine's own code by ``make conformance`` (docs/engines.md):

* ``sglang`` - ``--init-expert-location`` JSON: ``{"physical_to_logical_map": [L][P]}``
  over *all* decoder layers (``ExpertLocationMetadata.init_by_mapping``); a dense layer gets
  SGLang's trivial row ``p % E``.
* ``vllm`` - EPLB state: ``physical_to_logical_map [L_moe][P]`` (what
  ``EplbState.update_mapping`` and ``rearrange_expert_weights_inplace`` take) and
  ``logical_replica_count [L_moe][E]``. No logical-to-physical map: vLLM derives its own from
  ``physical_to_logical_map``, padded to its live width of 1024 (:data:`VLLM_LIVE_MAP_WIDTH`);
  a narrower copy does not fit that buffer. No vLLM flag loads the file: a launcher moves the
  weights and installs the map before serving (the manifest's ``load`` says how).
* ``trtllm`` - the MoE load balancer YAML (``MoeLoadBalancerConfig``): ``num_slots`` (P),
  ``initial_global_assignments {decoder layer index: [expert per slot]}`` including the
  multi-token-prediction layers (index ``L + k``, which reuse the last MoE layer's row) and
  ``layer_updates_per_iter: 0`` (static placement).

Pure: builds dictionaries, does no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from policies.defaults import EXPORT_FORMATS as EXPORT_FORMATS  # one default: policies.defaults
from policies.errors import InputError
from policies.estimate.engines import PINNED_VERSIONS
from policies.estimate.execution import SGLANG_PLACEMENT_FAMILIES
from policies.estimate.tensor_parallel import tp_cost_table
from policies.estimate.workload import make_workload
from policies.hardware.fleet import Fleet, parse_fleet
from policies.model.architecture import ModelSpec
from policies.plan import Plan, validate_plan

VLLM_EPLB_FAMILIES = frozenset(
    {"deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral", "glm4_moe", "llama4"}
)
"""Families whose vLLM 0.33.0 model class implements ``MixtureOfExperts`` (EPLB): only these
take redundant experts and an EPLB state (gpt-oss fixes ``num_redundant_experts=0``)."""

TRTLLM_BALANCER_FAMILIES = frozenset({"deepseek_v3", "qwen3_moe", "mixtral"})
"""Families in TensorRT-LLM's ``moe_model_arch_list`` (``moe_load_balancer.py``): for any
other architecture ``maybe_create_moe_load_balancer`` creates no balancer and the load-balancer
file is ignored without a word."""

VLLM_LIVE_MAP_WIDTH = 1024
"""Width of vLLM's live ``logical_to_physical_map`` (``MAX_EXPERT_REDUNDANCY + 1`` in
``EplbState.add_model``)."""

VLLM_NO_REBALANCE_STEP_INTERVAL = 2**62
"""``--eplb-config step_interval`` that keeps vLLM's own EPLB from replacing the placement: its
counter starts at ``interval - interval // 4``, so the first rebalance comes after 2**60 steps
(36 million years at 1,000 steps per second); ``step_interval`` has no upper bound."""


def vllm_eplb_config(num_redundant: int) -> dict[str, int]:
    """vLLM's ``--eplb-config``: ``num_redundant`` redundant slots per MoE layer, and a
    ``step_interval`` (:data:`VLLM_NO_REBALANCE_STEP_INTERVAL`) that keeps its own
    rebalancing from replacing the placement."""
    return {
        "num_redundant_experts": num_redundant,
        "step_interval": VLLM_NO_REBALANCE_STEP_INTERVAL,
    }


def vllm_default_rows(num_experts: int, num_slots: int) -> list[int]:
    """vLLM's initial layout of one MoE layer (``build_initial_global_physical_to_logical_map``,
    0.33.0): slot ``p < E`` holds expert ``p``, redundant slot ``E + i`` expert ``i % E``."""
    return [p % num_experts for p in range(num_slots)]


def vllm_needs_eplb(plan: Plan) -> bool:
    """Whether vLLM must run with ``--enable-eplb`` for ``plan``: a placement is installed
    through its ``EplbState``, which vLLM creates only with EPLB enabled (also with no
    redundant slot), and only EPLB gives it redundant slots. Not needed for a dense model or
    a plan that is vLLM's default layout with no redundant slot."""
    if not plan.moe_layers:
        return False
    if plan.num_redundant:
        return True
    rows = plan.physical_to_logical()
    default = vllm_default_rows(plan.num_experts, len(rows[0]) if rows else 0)
    return any(row != default for row in rows)


_VLLM_FAMILY_CLASS = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


# ------------------------------------------------------------------------- checks


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


def _check_valid(plan: Plan, fmt: str) -> None:
    """Refuse a plan that violates constraints, fails validation or calls itself infeasible."""
    problems = list(dict.fromkeys([*plan.violations, *validate_plan(plan)]))
    if not problems and not plan.summary.feasible:
        problems = ["its summary says it is infeasible"]
    if problems:
        more = f"; and {len(problems) - 1} more" if len(problems) > 1 else ""
        shown = problems[0] + more
        raise InputError(
            f"plan {plan.id} cannot be exported to {fmt}: an engine would run a placement that "
            f"breaks its own constraints ({shown}). To fix: re-solve it (mixfleetctl plan solve); "
            "mixfleetctl plan show FILE lists every problem",
            field="plan",
        )


def _check_engine(plan: Plan, fmt: str) -> None:
    """A plan made for one engine is not exported to another; ``native`` plans go anywhere.

    Its predicted shares are the ones that engine's replica choice and DP balancing produce;
    another engine would run the same placement with other shares. A ``native`` plan's
    prediction is idealised for every engine alike, which the manifest says.
    """
    name = plan.engine.name
    if name in ("native", fmt):
        return
    raise InputError(
        f"plan {plan.id} was solved for {name} {plan.engine.version} (replica choice "
        f"{plan.engine.dispatch}, DP balance {plan.engine.dp_balance}); its prediction does not "
        f"hold under {fmt}, which picks replicas and balances ranks its own way. To fix: export "
        f"it with --format {name}, or re-solve for {fmt} (mixfleetctl plan solve ... --engine "
        f"{fmt})",
        field="engine",
    )


def node_order(plan: Plan, fmt: str) -> list[str]:
    """Nodes in rank order, each node's ranks contiguous (engines number ranks node by node).

    Raises:
        InputError: a node's ranks are not contiguous; SGLang with unequal GPUs per node.
    """
    nodes = [g.node for g in plan.gpus]
    order = [n for i, n in enumerate(nodes) if i == 0 or nodes[i - 1] != n]
    if len(order) != len(set(nodes)):
        raise InputError(
            f"the ranks of a node are not contiguous in plan {plan.id}; {fmt} numbers ranks node "
            "by node. To fix: list each node's GPUs together in the fleet and re-solve",
            field="gpus",
        )
    counts = {n: nodes.count(n) for n in order}
    if fmt == "sglang" and len(set(counts.values())) > 1:
        raise InputError(
            f"SGLang runs every node with the same number of GPUs (its same-node replica rule "
            f"counts ep_size // nnodes per node); plan {plan.id} has {counts}. To fix: use equal "
            "GPU counts per node and re-solve",
            field="gpus",
        )
    return order


def _check_model(plan: Plan, fmt: str, model: ModelSpec) -> None:
    """The model is the plan's, and the engine can place its experts.

    Raises:
        InputError: the model's layers or experts differ from the plan's; SGLang, vLLM or
            TensorRT-LLM cannot load a placement for its family; TensorRT-LLM with EP 1.
    """
    if (model.num_layers, model.moe_layers, model.num_experts) != (
        plan.num_layers,
        plan.moe_layers,
        plan.num_experts,
    ):
        raise InputError(
            f"model {model.name} ({model.num_layers} layers, {model.num_moe_layers} MoE layers x "
            f"{model.num_experts} experts) is not plan {plan.id}'s model {plan.model} "
            f"({plan.num_layers} layers, {len(plan.moe_layers)} MoE layers x {plan.num_experts} "
            "experts). To fix: pass the plan's own model config",
            field="model",
        )
    version = PINNED_VERSIONS[fmt]
    if fmt == "sglang" and model.family not in SGLANG_PLACEMENT_FAMILIES:
        raise InputError(
            f"SGLang {version} cannot load an expert placement for {model.name} "
            f"({model.family}): its model class has no get_model_config_for_expert_location, so "
            "--init-expert-location fails at the first MoE forward and it has no redundant "
            "slots. To fix: export for vllm or trtllm (re-solve with --engine vllm or trtllm), "
            "or run SGLang without a mixfleet placement",
            field="engine",
        )
    if fmt == "vllm" and model.family not in VLLM_EPLB_FAMILIES:
        raise InputError(
            f"vLLM {version} has no EPLB for {model.name} ({model.family}): its "
            f"{_VLLM_FAMILY_CLASS.get(model.family, 'model class')} is not a MixtureOfExperts "
            "model, so it takes no redundant experts and no placement. To fix: export for "
            "sglang or trtllm, or serve it without a mixfleet placement",
            field="engine",
        )
    if fmt == "trtllm" and model.family not in TRTLLM_BALANCER_FAMILIES:
        raise InputError(
            f"TensorRT-LLM {version} creates no MoE load balancer for {model.name} "
            f"({model.family}): the family is not in moe_model_arch_list, so the file would be "
            "ignored. To fix: export for sglang or vllm, or serve it without a placement",
            field="engine",
        )
    if fmt == "trtllm" and len(plan.gpus) < 2:
        raise InputError(
            "TensorRT-LLM creates its MoE load balancer only with expert parallelism over more "
            f"than one rank; plan {plan.id} has one GPU. To fix: plan for 2 or more GPUs",
            field="gpus",
        )


def _plan_fleet(plan: Plan) -> Fleet:
    """A fleet with the plan's GPUs in plan order (each node's consecutive runs of one GPU
    model; one NIC per node): what the cost model needs to size a GPU's memory."""
    nodes: list[dict[str, Any]] = []
    for g in plan.gpus:
        if not nodes or nodes[-1]["name"] != g.node:
            nic = {"count": 1, "per_direction_gbits_per_s": 400, "fabric": "f"}
            nodes.append({"name": g.node, "gpus": [], "nics": [nic]})
        runs = nodes[-1]["gpus"]
        if runs and runs[-1]["model"] == g.model:
            runs[-1]["count"] += 1
        else:
            runs.append({"model": g.model, "count": 1})
    return parse_fleet({"metadata": {"name": plan.fleet or "plan"}, "spec": {"nodes": nodes}})


def _check_equal_dp_memory(plan: Plan, fmt: str, model: ModelSpec) -> None:
    """TensorRT-LLM gives every attention-DP rank an equal share of the tokens (its own
    balancer; trtllm-serve takes no per-request rank), whatever DP weights the plan was
    solved with (a ``native`` plan's router weights): every GPU must hold its KV cache and
    activations at ``1 / N`` of the tokens, sized by the cost model, within the plan's own
    usable memory.

    Raises:
        InputError: naming the first GPU that overflows, by how much, and how many do.
    """
    n = len(plan.gpus)
    if all(abs(g.attention_share - 1.0 / n) <= 1e-9 for g in plan.gpus):
        return
    wl = plan.workload
    try:
        workload = make_workload(
            model,
            phase=str(wl["phase"]),
            tokens_per_gpu=int(wl["tokens_per_gpu"]),
            context_len=int(wl["context_len"]),
            kv_cache_dtype=str(wl.get("kv_cache_dtype", "bf16")),
        )
        table = tp_cost_table(_plan_fleet(plan), model, workload, None, [1] * n)
    except (KeyError, TypeError, ValueError, InputError) as exc:
        raise InputError(
            f"plan {plan.id} cannot be checked for {fmt}'s equal DP shares ({exc}). To fix: "
            f"re-solve it for {fmt} (mixfleetctl plan solve ... --engine {fmt})",
            field="plan",
        ) from exc
    tokens = table.total_tokens / n
    over = []
    for i, g in enumerate(plan.gpus):
        mem = g.memory_bytes
        kv = table.kv_cache_bytes(i, tokens)
        need = mem.get("weights", 0.0) + mem.get("experts", 0.0) + kv
        need += tokens * table.act_bytes_per_token
        usable = mem.get("usable", math.inf)
        if need > usable * (1 + 1e-9):
            over.append((g, need, usable, kv))
    if not over:
        return
    g, need, usable, kv = over[0]
    more = f"; {len(over) - 1} more GPUs overflow too" if len(over) > 1 else ""
    raise InputError(
        f"plan {plan.id} cannot be exported to {fmt}: {fmt} gives every attention-DP rank an "
        f"equal share of the tokens (1/{n}), not the plan's DP weights, and at that share "
        f"{g.gpu} ({g.model}) needs {need / 2**30:.1f} GiB of its {usable / 2**30:.1f} GiB "
        f"usable, {(need - usable) / 2**30:.1f} GiB too much (KV cache {kv / 2**30:.1f} GiB)"
        f"{more}. To fix: re-solve it for {fmt} (mixfleetctl plan solve ... --engine {fmt}), "
        "which plans at equal shares",
        field="plan",
    )


def check_export(plan: Plan, fmt: str, model: ModelSpec | None = None) -> list[list[int]]:
    """Every check an export makes, in the order a user would fix them; returns the rows.

    Args:
        plan: the plan to export.
        fmt: ``sglang`` | ``vllm`` | ``trtllm``.
        model: the plan's model; without it the model-dependent checks (family support,
            TensorRT-LLM's MTP layers) cannot run and the manifest says so.

    Returns:
        ``[moe_layer][physical_slot] -> logical expert``.

    Raises:
        InputError: unknown format; dense model; native form; an infeasible or invalid plan;
            a plan solved for another engine; ranks of a node not contiguous; a model other
            than the plan's or one the engine cannot place.
    """
    if fmt not in EXPORT_FORMATS:
        raise InputError(
            f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}",
            field="format",
        )
    rows = _engine_rows(plan, fmt)
    _check_valid(plan, fmt)
    _check_engine(plan, fmt)
    node_order(plan, fmt)
    if model is not None:
        _check_model(plan, fmt, model)
        if fmt == "trtllm":
            _check_equal_dp_memory(plan, fmt, model)
    return rows


# ----------------------------------------------------------------------- documents


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
    counts = []
    for row in rows:
        per_expert = [0] * plan.num_experts
        for e in row:
            per_expert[e] += 1
        counts.append(per_expert)
    return {
        "physical_to_logical_map": [list(row) for row in rows],
        "logical_replica_count": counts,
    }


def _trtllm(plan: Plan, rows: list[list[int]], mtp_layers: int) -> dict[str, Any]:
    assignments: dict[int, list[int]] = {
        layer: list(row) for layer, row in zip(plan.moe_layers, rows, strict=True)
    }
    for k in range(mtp_layers):
        assignments[plan.num_layers + k] = list(rows[-1])
    return {
        "num_slots": len(rows[0]),
        "initial_global_assignments": assignments,
        "layer_updates_per_iter": 0,
    }


def placement_document(plan: Plan, fmt: str, *, mtp_layers: int = 0) -> dict[str, Any]:
    """An engine's placement document with only the structural checks (equal slots, every
    expert covered): for code that carries a plan's map to nodes, not for a user's export
    (that is :func:`export_plan`).

    Raises:
        InputError: unknown format; native-form plan; dense model; unequal slots; an expert
            without a replica.
    """
    if fmt not in EXPORT_FORMATS:
        raise InputError(
            f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}",
            field="format",
        )
    rows = _engine_rows(plan, fmt)
    return _document(plan, fmt, rows, mtp_layers)


def _document(plan: Plan, fmt: str, rows: list[list[int]], mtp_layers: int) -> dict[str, Any]:
    if fmt == "sglang":
        return _sglang(plan, rows)
    if fmt == "vllm":
        return _vllm(plan, rows)
    return _trtllm(plan, rows, mtp_layers)


def export_plan(plan: Plan, fmt: str, model: ModelSpec | None = None) -> dict[str, Any]:
    """The engine's expert-placement document of a plan, after every check of
    :func:`check_export`.

    Args:
        plan: an ``engine``-form, feasible plan of an MoE model.
        fmt: ``sglang`` | ``vllm`` | ``trtllm`` (shapes in the module docstring).
        model: the plan's model (family checks; TensorRT-LLM MTP layers).

    Returns:
        The engine's document as plain lists and dicts (``trtllm`` keys are int layer
        indices, as its YAML has them).

    Raises:
        InputError: see :func:`check_export`.
    """
    rows = check_export(plan, fmt, model)
    return _document(plan, fmt, rows, model.mtp_layers if model is not None else 0)


# ------------------------------------------------------------------------- sidecar


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
