"""Partition plans: the immutable output of every policy, its validator and its wire form.

A plan says, per GPU: its attention share (and attention heads in native form, a
data-parallel router weight in engine form), its expert slots per MoE layer (physical slot
-> logical expert, with the share of that expert's tokens the slot serves), runtime hints
for DeepEP and FlashAttention, and the cost model's prediction of its time and memory.

Two forms (docs/engines.md):

* ``native``: any number of experts per GPU, any token share per replica, unequal heads.
* ``engine``: equal slots per GPU, replicas share an expert's tokens equally, attention as
  data-parallel weights - what SGLang, vLLM and DeepEP consume today.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from policies.defaults import FORMS as FORMS  # one default: policies.defaults
from policies.errors import InputError
from policies.keys import check_keys

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
            :func:`policies.engines.resolve_runtime`).
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
        """JSON-ready dictionary (inverse of :func:`plan_from_dict`).

        Built field by field for the GPUs (``dataclasses.asdict`` deep-copies every expert
        slot and took most of a second for a 2,000-GPU plan)."""
        d = asdict(replace(self, gpus=()))
        d["gpus"] = [gpu_plan_to_dict(g) for g in self.gpus]
        d["schema_version"] = PLAN_SCHEMA_VERSION
        return d


def gpu_plan_to_dict(g: GpuPlan) -> dict[str, Any]:
    """One GPU of :meth:`Plan.to_dict` and of a node's assignment (slots as ``[expert,
    share]`` pairs; every field of :class:`GpuPlan`, in declaration order - a test compares
    it with ``asdict``). The inverse is :func:`gpu_plan_from_dict`."""
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


def _f(d: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in d:
        raise InputError(f"missing field {key!r}", field=path)
    return d[key]


_HINT_KEYS = frozenset(RuntimeHints.__dataclass_fields__)


def gpu_plan_from_dict(g: Any, path: str) -> GpuPlan:
    """The one decoder of a :class:`GpuPlan` (:func:`gpu_plan_to_dict`'s form), used for
    whole plans and for node assignments alike.

    ``predicted_busy_us`` and ``memory_bytes`` may be omitted (0 and empty: assignments
    written before they were sent), and ``attention_tp`` and ``dp_group`` (1 and None: plans
    from before tensor-parallel attention); every other field is required.

    Raises:
        InputError: ``field`` is ``path`` plus the missing or malformed key.
    """
    if not isinstance(g, Mapping):
        raise InputError(
            f"missing fields: a GPU entry is a JSON object with gpu, node, model and the rest "
            f"(malformed: got {type(g).__name__} {g!r:.40})",
            field=path,
        )
    hints = _f(g, "hints", path)
    if not isinstance(hints, Mapping) or set(hints) != _HINT_KEYS:
        raise InputError(
            f"must be an object with exactly the keys {sorted(_HINT_KEYS)}, got {hints!r}",
            field=f"{path}.hints",
        )
    heads = g.get("attention_heads")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int)):
        raise InputError(
            f"must be an integer or null, got {heads!r}", field=f"{path}.attention_heads"
        )
    tp, group = g.get("attention_tp", 1), g.get("dp_group")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise InputError(f"must be an integer >= 1, got {tp!r}", field=f"{path}.attention_tp")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
        raise InputError(f"must be an integer or null, got {group!r}", field=f"{path}.dp_group")
    memory = g.get("memory_bytes", {})
    if not isinstance(memory, Mapping):
        raise InputError(f"must be an object, got {memory!r}", field=f"{path}.memory_bytes")
    try:
        return GpuPlan(
            gpu=str(_f(g, "gpu", path)),
            node=str(_f(g, "node", path)),
            model=str(_f(g, "model", path)),
            attention_share=float(_f(g, "attention_share", path)),
            attention_heads=heads,
            dp_weight=float(_f(g, "dp_weight", path)),
            experts=tuple(
                tuple(ExpertSlot(int(e), float(s)) for e, s in layer)
                for layer in _f(g, "experts", path)
            ),
            hints=RuntimeHints(**hints),
            predicted_busy_us=float(g.get("predicted_busy_us", 0.0)),
            memory_bytes={str(k): float(v) for k, v in memory.items()},
            attention_tp=tp,
            dp_group=group,
        )
    except (TypeError, ValueError) as exc:
        raise InputError(f"malformed GPU plan: {exc}", field=path) from exc


def plan_from_dict(d: Any) -> Plan:
    """Rebuild a :class:`Plan` from :meth:`Plan.to_dict` output.

    Raises:
        InputError: not a plan document, or a field is missing or malformed.
    """
    if not isinstance(d, Mapping):
        raise InputError("a plan must be a JSON object", field="plan")
    if d.get("schema_version") != PLAN_SCHEMA_VERSION:
        raise InputError(
            f"unsupported plan schema_version {d.get('schema_version')!r}; this mixfleet reads "
            f"{PLAN_SCHEMA_VERSION}. To fix: re-solve with this version",
            field="schema_version",
        )
    check_keys(d, {*(f.name for f in fields(Plan)), "schema_version"}, "", what="plan field")
    try:
        gpus = [gpu_plan_from_dict(g, f"gpus[{i}]") for i, g in enumerate(_f(d, "gpus", "plan"))]
        return Plan(
            id=str(_f(d, "id", "plan")),
            version=int(_f(d, "version", "plan")),
            fleet=str(_f(d, "fleet", "plan")),
            model=str(_f(d, "model", "plan")),
            workload=dict(_f(d, "workload", "plan")),
            num_layers=int(_f(d, "num_layers", "plan")),
            moe_layers=tuple(int(x) for x in _f(d, "moe_layers", "plan")),
            num_experts=int(_f(d, "num_experts", "plan")),
            num_redundant=int(_f(d, "num_redundant", "plan")),
            slots_per_gpu=d.get("slots_per_gpu"),
            gpus=tuple(gpus),
            summary=PlanSummary(**_f(d, "summary", "plan")),
            violations=tuple(d.get("violations", ())),
            notes=tuple(d.get("notes", ())),
            engine=PlanEngine(**d.get("engine", {})),
        )
    except (TypeError, ValueError) as exc:
        raise InputError(f"malformed plan: {exc}", field="plan") from exc


def dp_group_problems(plan: Plan, tolerance: float = 1e-6) -> list[str]:
    """A DP attention group has ``attention_tp`` GPUs, all on one node, of one model, with one
    share; a GPU outside any group (``dp_group`` None) is data-parallel alone; an engine
    (not ``native``) runs one attention TP size for the whole plan."""
    problems: list[str] = []
    groups: dict[int, list[GpuPlan]] = {}
    for g in plan.gpus:
        if g.dp_group is None:
            if g.attention_tp != 1:
                problems.append(f"{g.gpu}: attention TP {g.attention_tp} but no DP group")
            continue
        groups.setdefault(g.dp_group, []).append(g)
    for index, members in sorted(groups.items()):
        first = members[0]
        where = f"DP group {index} ({', '.join(g.gpu for g in members)})"
        if len({(g.node, g.model, g.attention_tp) for g in members}) > 1:
            problems.append(f"{where}: GPUs differ in node, model or attention TP size")
        if len(members) != first.attention_tp:
            problems.append(f"{where}: {len(members)} GPUs, attention TP {first.attention_tp}")
        shares = [g.attention_share for g in members]
        if max(shares) - min(shares) > tolerance:
            problems.append(f"{where}: unequal attention shares {[round(x, 6) for x in shares]}")
    sizes = sorted({g.attention_tp for g in plan.gpus})
    if plan.engine.name != "native" and len(sizes) > 1:
        problems.append(
            f"{plan.engine.name} runs one attention TP size per server, plan has {sizes}"
        )
    return problems


def validate_plan(plan: Plan, *, tolerance: float = 1e-6) -> list[str]:
    """Check a plan's invariants; returns one line per problem (empty when valid).

    * every expert of every MoE layer is covered: its slots' shares sum to 1;
    * every share is in (0, 1];
    * attention shares are >= 0 and sum to 1;
    * predicted memory fits each GPU;
    * engine form: every GPU has ``slots_per_gpu`` slots, and replicas share equally unless
      the engine's replica choice is locality-based (SGLang ``static``/``dynamic``: a
      replica serves the ranks that pick it, possibly none, so shares are in [0, 1]);
    * DP attention groups (:func:`dp_group_problems`).
    """
    problems: list[str] = dp_group_problems(plan, tolerance)
    by_locality = plan.engine.dispatch in ("static", "dynamic")
    low = -tolerance if by_locality else 0.0
    total_share = sum(g.attention_share for g in plan.gpus)
    if abs(total_share - 1.0) > tolerance:
        problems.append(f"attention shares sum to {total_share:.9f}, not 1")
    for g in plan.gpus:
        if g.attention_share < -tolerance or math.isnan(g.attention_share):
            problems.append(f"{g.gpu}: negative attention share {g.attention_share}")
        mem = g.memory_bytes
        if mem.get("total", 0.0) > mem.get("usable", math.inf) * (1 + 1e-9):
            problems.append(
                f"{g.gpu}: needs {mem['total'] / 2**30:.1f} GiB, {mem['usable'] / 2**30:.1f} GiB usable"
            )
    for li in range(len(plan.moe_layers)):
        cover = [0.0] * plan.num_experts
        count = [0] * plan.num_experts
        for g in plan.gpus:
            seen: set[int] = set()
            for s in g.experts[li]:
                if not 0 <= s.expert < plan.num_experts:
                    problems.append(f"layer {li} {g.gpu}: expert {s.expert} out of range")
                    continue
                if s.expert in seen and plan.form == "native":
                    problems.append(f"layer {li} {g.gpu}: expert {s.expert} placed twice")
                seen.add(s.expert)
                if not low < s.share <= 1 + tolerance:
                    span = "[0, 1]" if by_locality else "(0, 1]"
                    problems.append(
                        f"layer {li} {g.gpu}: expert {s.expert} share {s.share} not in {span}"
                    )
                cover[s.expert] += s.share
                count[s.expert] += 1
            if plan.form == "engine" and len(g.experts[li]) != plan.slots_per_gpu:
                problems.append(
                    f"layer {li} {g.gpu}: {len(g.experts[li])} slots, engine form needs {plan.slots_per_gpu}"
                )
        for e in range(plan.num_experts):
            if abs(cover[e] - 1.0) > 1e-4:
                problems.append(f"layer {li}: expert {e} covered {cover[e]:.6f}, not 1")
        if plan.form == "engine" and not by_locality:
            for g in plan.gpus:
                for s in g.experts[li]:
                    if count[s.expert] and abs(s.share - 1.0 / count[s.expert]) > 1e-6:
                        problems.append(
                            f"layer {li}: expert {s.expert} replica share {s.share:.4f} is not 1/{count[s.expert]}"
                        )
                        break
    return problems
