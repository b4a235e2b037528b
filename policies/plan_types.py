"""Partition plan types: :class:`Plan` and its parts, and their JSON-ready form
(:meth:`Plan.to_dict`, :func:`gpu_plan_to_dict`, :func:`placement_digest`).

Re-exported by :mod:`policies.plan`, the plans' front door; import from there.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ExpertSlot:
    """One physical expert slot: the logical expert it holds and the share of that
    expert's tokens it serves (0..1)."""

    expert: int
    share: float


@dataclass(frozen=True)
class RuntimeHints:
    """Settings the node runtime applies for this GPU.

    Attributes:
        ep_backend: the EP group's one all-to-all backend (every GPU of a group the same;
            :func:`policies.estimate.engines.resolve_runtime`).
        deepep_mode: ``normal`` (prefill) or ``low_latency`` (decode).
        deepep_num_sms: SMs given to communication kernels (even; DeepEP default 20).
        num_nvl_bytes: intra-node communication buffer, bytes.
        num_rdma_bytes: inter-node communication buffer, bytes.
        fp8_dispatch: dispatch activations in FP8.
        attention_backend: ``fa3`` (Hopper), ``fa2`` (Ampere, Ada) or ``sdpa``.
        decode_num_splits: FlashAttention split-KV factor for decode (1 in prefill).
    """

    ep_backend: str
    deepep_mode: str
    deepep_num_sms: int
    num_nvl_bytes: int
    num_rdma_bytes: int
    fp8_dispatch: bool
    attention_backend: str
    decode_num_splits: int


@dataclass(frozen=True)
class GpuPlan:
    """One GPU's part of a plan.

    Attributes:
        gpu: GPU id (``node/gpuN``).
        node: node name.
        model: GPU catalog model.
        attention_share: fraction of the step's tokens whose attention this GPU computes.
        attention_heads: native form: query heads of its node's tensor-parallel attention;
            None in engine form.
        dp_weight: engine form: data-parallel router weight (mean 1 over ranks).
        experts: per MoE layer, the GPU's slots in physical order.
        hints: runtime settings.
        predicted_busy_us: the GPU's own work in one step, us.
        memory_bytes: ``weights, experts, kv_cache, activations, total, usable``.
        attention_tp: size of its tensor-parallel attention group (1: data-parallel alone).
        dp_group: index of its DP attention group (its GPUs share a node, a model and a
            share); None in plans from before groups were recorded (every GPU its own).
    """

    gpu: str
    node: str
    model: str
    attention_share: float
    attention_heads: int | None
    dp_weight: float
    experts: tuple[tuple[ExpertSlot, ...], ...]
    hints: RuntimeHints
    predicted_busy_us: float
    memory_bytes: Mapping[str, float]
    attention_tp: int = 1
    dp_group: int | None = None


@dataclass(frozen=True)
class PlanSummary:
    """Headline figures of a plan.

    Attributes:
        policy: ``uniform`` | ``eplb`` | ``greedy`` | ``ilp``.
        form: ``native`` | ``engine``.
        step_time_us: predicted time of one forward step.
        tokens_per_s: predicted throughput.
        lower_bound_us: proven lower bound on the step time of every placement of the
            request that ``bound_scope`` names (ilp), else None.
        gap: ``(step - lower_bound_us) / step`` for a feasible plan with a bound, else None;
            never negative, never clipped.
        solve_s: wall time of the solve.
        feasible: no constraint violated.
        imbalance: mean over MoE layers of (max - mean) / mean expert-phase time.
        expert_moves: replicas placed on a GPU that did not hold them in the previous plan.
        solver: solver and status, e.g. ``HiGHS optimal``.
        conditional_bound_us: proven lower bound on the step time of every placement with
            this plan's attention shares (ilp), else None (also in plans written before it).
        bound_scope: the placements ``lower_bound_us`` covers, in words ("" before it).
    """

    policy: str
    form: str
    step_time_us: float
    tokens_per_s: float
    lower_bound_us: float | None
    gap: float | None
    solve_s: float
    feasible: bool
    imbalance: float
    expert_moves: int | None
    solver: str
    conditional_bound_us: float | None = None
    bound_scope: str = ""


@dataclass(frozen=True)
class PlanEngine:
    """The engine a plan was made for and the runtime its EP group gets.

    Attributes:
        name: ``native`` | ``sglang`` | ``vllm`` | ``trtllm``.
        version: engine version the behaviour was modelled on.
        a2a_backend: the one all-to-all backend of the EP group.
        dispatch: replica choice: ``static`` | ``dynamic`` | ``even`` | ``planned``.
        dp_balance: ``router`` (planned DP weights) or ``engine`` (equal shares).
        gpus_per_node: ranks per node as the engine counts them.
        why: how the backend was chosen.
    """

    name: str = "native"
    version: str = ""
    a2a_backend: str = "nccl"
    dispatch: str = "planned"
    dp_balance: str = "router"
    gpus_per_node: int = 0
    why: str = ""


@dataclass(frozen=True)
class Plan:
    """An immutable partition plan.

    Attributes:
        id: content hash of the placement (same placement, same id).
        version: monotonically increasing per deployment; 1 for a stand-alone solve.
        fleet: fleet name.
        model: model name.
        workload: ``phase, tokens_per_gpu, context_len, kv_cache_dtype, load_source``.
        num_layers: decoder layers of the model.
        moe_layers: model layer index of each MoE layer (rows of ``GpuPlan.experts``).
        num_experts: logical experts per MoE layer.
        num_redundant: extra slots beyond one per expert (slot budget).
        slots_per_gpu: engine form: slots on every GPU; native: None.
        gpus: per-GPU parts, fleet order (rank order).
        summary: headline figures.
        violations: constraint violations (empty when feasible).
        notes: solver remarks (decomposition, time limit hit...).
        engine: the engine and runtime the plan's shares are predicted under.
    """

    id: str
    version: int
    fleet: str
    model: str
    workload: Mapping[str, Any]
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    num_redundant: int
    slots_per_gpu: int | None
    gpus: tuple[GpuPlan, ...]
    summary: PlanSummary
    violations: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    engine: PlanEngine = field(default_factory=PlanEngine)

    @property
    def form(self) -> str:
        return self.summary.form

    def layer(self, moe_layer: int) -> list[tuple[ExpertSlot, ...]]:
        """Slots of every GPU for one MoE layer."""
        return [g.experts[moe_layer] for g in self.gpus]

    def physical_to_logical(self) -> list[list[int]]:
        """``[moe_layer][physical_slot] -> logical expert`` (GPU-major physical order)."""
        return [
            [s.expert for g in self.gpus for s in g.experts[li]]
            for li in range(len(self.moe_layers))
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (inverse of :func:`policies.plan_doc.plan_from_dict`).

        Built field by field for the GPUs (``dataclasses.asdict`` deep-copies every expert
        slot and took most of a second for a 2,000-GPU plan)."""
        d = asdict(replace(self, gpus=()))
        d["gpus"] = [gpu_plan_to_dict(g) for g in self.gpus]
        d["schema_version"] = PLAN_SCHEMA_VERSION
        return d


def gpu_plan_to_dict(g: GpuPlan) -> dict[str, Any]:
    """One GPU of :meth:`Plan.to_dict` and of a node's assignment (slots as ``[expert,
    share]`` pairs; every field of :class:`GpuPlan`, in declaration order - a test compares
    it with ``asdict``). The inverse is :func:`policies.plan_doc.gpu_plan_from_dict`."""
    return {
        "gpu": g.gpu,
        "node": g.node,
        "model": g.model,
        "attention_share": g.attention_share,
        "attention_heads": g.attention_heads,
        "dp_weight": g.dp_weight,
        "experts": [[[s.expert, round(s.share, 9)] for s in layer] for layer in g.experts],
        "hints": asdict(g.hints),
        "predicted_busy_us": g.predicted_busy_us,
        "memory_bytes": dict(g.memory_bytes),
        "attention_tp": g.attention_tp,
        "dp_group": g.dp_group,
    }


def placement_digest(gpus: Sequence[GpuPlan], extra: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit id of a placement (attention shares, TP sizes and expert slots)."""
    h = hashlib.sha256()
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    for g in gpus:
        h.update(f"{g.gpu}|{g.attention_share:.9f}|{g.attention_heads}".encode())
        if g.attention_tp != 1:  # ids of data-parallel plans stay what they were
            h.update(f"|tp{g.attention_tp}".encode())
        for layer in g.experts:
            h.update(b"L")
            for s in layer:
                h.update(f"{s.expert}:{s.share:.9f},".encode())
    return h.hexdigest()[:16]
