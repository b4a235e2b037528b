"""A placement as its engine executes it: the bridge from :mod:`policies.estimate.engines` to scoring.

:func:`executed` takes a policy's raw answer (planned attention shares and slots) and returns
the shares the target engine really produces: each DP rank's token share from its balancer
and each replica's share of its expert's tokens from its replica-choice rule. Every plan is
scored on this, so a prediction is a prediction of what the named engine will do.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from policies.errors import InputError
from policies.estimate.costmodel import CostTable
from policies.estimate.engines import Runtime, full_rows, rank_shares, resolve_runtime
from policies.estimate.evaluation import LayerPlacement
from policies.estimate.replica_choice import dispatch
from policies.request import PlacementRequest, RawPlacement

SGLANG_PLACEMENT_FAMILIES = frozenset(
    {"deepseek_v3", "deepseek_v32", "qwen3_moe", "qwen2_moe", "glm4_moe", "minimax_m2", "gpt_oss"}
)
"""Model families whose SGLang model class has ``get_model_config_for_expert_location``
(0.5.23): only these accept ``--init-expert-location`` and redundant slots."""


def runtime_of(req: PlacementRequest) -> Runtime:
    """The runtime the request's engine gives its one EP group (all its GPUs, fleet order);
    for a screening estimate (``SolverOptions.screen``) SGLang's ``static`` replica choice
    as its expectation, the ``dynamic`` rule.

    Raises:
        InputError: no coherent backend; an engine that needs equal slots with a native
            form request; a model the engine cannot place.
    """
    engine = req.engine
    if engine.name != "native" and req.model.is_moe and req.form != "engine":
        raise InputError(
            f"{engine.name} needs equal expert slots on every rank, the request asks for "
            "native form. To fix: use --form engine (or --engine native for the idealised form)",
            field="form",
        )
    if (
        engine.name == "sglang"
        and req.model.is_moe
        and req.model.family not in SGLANG_PLACEMENT_FAMILIES
    ):
        raise InputError(
            f"SGLang {engine.resolved_version} cannot load an expert placement for "
            f"{req.model.name} ({req.model.family}): its model class has no expert-location "
            "support, so --init-expert-location fails at the first MoE forward and it has no "
            "redundant slots. To fix: serve it with --engine vllm or trtllm, or run SGLang "
            "without a mixfleet placement",
            field="engine",
        )
    gpus = req.fleet.gpus
    runtime = resolve_runtime(engine, [g.spec.architecture for g in gpus], [g.node for g in gpus])
    if req.options.screen and runtime.dispatch == "static":  # its expectation (SolverOptions)
        return replace(
            runtime, dispatch="dynamic", why=f"{runtime.why}; screen: static as expected"
        )
    return runtime


def layer_rows(layers: Sequence[LayerPlacement]) -> list[list[int]]:
    """``[moe_layer][physical slot] -> expert``, rank-major (slot p on rank p // slots)."""
    return [[e for slots in layer.per_gpu for e, _ in slots] for layer in layers]


def executed(
    req: PlacementRequest, runtime: Runtime, raw: RawPlacement, table: CostTable | None = None
) -> RawPlacement:
    """``raw`` with the attention shares and replica shares the runtime really produces;
    with ``table`` (for the experts' loads) a locality-based rule also records who sends
    what to whom (:attr:`policies.estimate.evaluation.LayerPlacement.traffic`)."""
    share = tuple(rank_shares(runtime, raw.attention_share))
    if not raw.layers or runtime.dispatch == "planned":
        return replace(raw, attention_share=share)
    m = req.model
    rows = layer_rows(raw.layers)
    weights = None
    if table is not None:
        weights = [_fractions(row) for row in table.load]
    if runtime.dispatch == "static":  # the seeded spread runs over the whole loaded map
        rows = full_rows(rows, m.moe_layers, m.num_layers, m.num_experts)
        if weights is not None:
            by_layer = dict(zip(m.moe_layers, weights, strict=True))
            flat = [0.0] * m.num_experts
            weights = [by_layer.get(layer, flat) for layer in range(m.num_layers)]
    served, traffic = dispatch(runtime, rows, m.num_experts, share, weights=weights)
    if runtime.dispatch == "static":
        served = [served[layer] for layer in m.moe_layers]
        if traffic is not None:
            traffic = [traffic[layer] for layer in m.moe_layers]
    layers = []
    for li, (layer, per_slot) in enumerate(zip(raw.layers, served, strict=True)):
        p = 0
        per_gpu = []
        for slots in layer.per_gpu:
            per_gpu.append(tuple((e, per_slot[p + k]) for k, (e, _) in enumerate(slots)))
            p += len(slots)
        flows = np.asarray(traffic[li], dtype=float) if traffic is not None else None
        layers.append(LayerPlacement(tuple(per_gpu), flows))
    return replace(raw, attention_share=share, layers=tuple(layers))


def _fractions(row: Sequence[float]) -> list[float]:
    total = float(sum(row))
    return [float(v) / total if total > 0 else 0.0 for v in row]
