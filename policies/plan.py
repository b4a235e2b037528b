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
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from policies.defaults import FORMS as FORMS  # one default: policies.defaults
from policies.errors import InputError
from policies.keys import check_keys
from policies.limits import (
    MAX_ABS_INTEGER,
    MAX_EXPERTS,
    MAX_FLEET_GPUS,
    MAX_GPUS_PER_NODE,
    MAX_LAYER_EXPERTS,
    MAX_LAYERS,
    MAX_VERSION,
    bounded_int,
    key_path,
)

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


# ----------------------------------------------------------------- reading a plan document
# A plan document comes from a file or a store row, so every field and nesting level is
# checked before anything is sized by it (the limits of policies.limits, as for a model
# config): a count sizes a table, a string where a number belongs fails late, a GPU whose
# layers disagree with the plan's indexes past its end.


#: What a list of the document may be (JSON and YAML give lists; Plan.to_dict keeps tuples).
_SEQ = (list, tuple)


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise InputError(f"must be a string, got {v!r:.60}", field=path)
    return v


def _num(v: Any, path: str) -> float:
    """A finite number (an integer is one; a boolean is not)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"must be a number, got {v!r:.60}", field=path)
    x = float(v) if not isinstance(v, int) or abs(v) <= MAX_ABS_INTEGER else math.inf
    if not math.isfinite(x):
        raise InputError(f"must be a finite number, got {v!r:.60}", field=path)
    return x


def _int(v: Any, path: str) -> int:
    return bounded_int(v, path, minimum=-MAX_ABS_INTEGER, maximum=MAX_ABS_INTEGER)


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise InputError(f"must be true or false, got {v!r:.60}", field=path)
    return v


_SCALARS = {"str": _str, "float": _num, "int": _int, "bool": _bool}


def _typed(cls: type, doc: Any, path: str) -> dict[str, Any]:
    """The fields of the dataclass ``cls`` from the mapping ``doc``, each checked against its
    annotation (``str``, ``int``, ``float``, ``bool``, optionally ``| None``); fields with a
    default may be left out; unknown keys are refused.

    Raises:
        InputError: naming the field.
    """
    if not isinstance(doc, Mapping):
        raise InputError(f"must be an object, got {doc!r:.60}", field=path)
    known = fields(cls)
    check_keys(doc, {f.name for f in known}, path)
    out: dict[str, Any] = {}
    for f in known:
        where = f"{path}.{f.name}"
        if f.name not in doc:
            if f.default is MISSING and f.default_factory is MISSING:
                raise InputError(f"missing field {f.name!r}", field=path)
            continue
        v = doc[f.name]
        kind = str(f.type)
        if kind.endswith(" | None"):
            if v is None:
                out[f.name] = None
                continue
            kind = kind.removesuffix(" | None")
        out[f.name] = _SCALARS[kind](v, where)
    return out


def _slots(layers: Any, path: str, num_experts: int) -> tuple[tuple[ExpertSlot, ...], ...]:
    """A GPU's ``experts``: per MoE layer, ``[expert, share]`` pairs with experts below
    ``num_experts`` and finite shares."""
    if not isinstance(layers, _SEQ):
        raise InputError(f"must be a list of MoE layers, got {layers!r:.60}", field=path)
    out = []
    for li, layer in enumerate(layers):
        if not isinstance(layer, _SEQ) or len(layer) > MAX_EXPERTS:
            raise InputError(
                f"must be a list of at most {MAX_EXPERTS:,} [expert, share] slots, got "
                f"{f'{len(layer):,} slots' if isinstance(layer, _SEQ) else repr(layer)[:60]}",
                field=f"{path}[{li}]",
            )
        row = []
        for si, slot in enumerate(layer):
            if not isinstance(slot, _SEQ) or len(slot) != 2:
                raise InputError(
                    f"must be an [expert, share] pair, got {slot!r:.60}",
                    field=f"{path}[{li}][{si}]",
                )
            e, share = slot
            if type(e) is not int or not 0 <= e < num_experts:
                raise InputError(
                    f"expert must be an integer from 0 to {num_experts - 1:,} (the plan's "
                    f"num_experts - 1), got {e!r:.60}",
                    field=f"{path}[{li}][{si}]",
                )
            row.append(ExpertSlot(e, _num(share, f"{path}[{li}][{si}] share")))
        out.append(tuple(row))
    return tuple(out)


def gpu_plan_from_dict(
    g: Any, path: str, *, num_experts: int = MAX_EXPERTS, moe_layers: int | None = None
) -> GpuPlan:
    """The one decoder of a :class:`GpuPlan` (:func:`gpu_plan_to_dict`'s form), used for
    whole plans and for node assignments alike.

    ``predicted_busy_us`` and ``memory_bytes`` may be omitted (0 and empty: assignments
    written before they were sent), and ``attention_tp`` and ``dp_group`` (1 and None: plans
    from before tensor-parallel attention); every other field is required. Every field is
    checked (type, range; see :mod:`policies.limits`).

    Args:
        num_experts: experts per MoE layer of the plan (slots name experts below it).
        moe_layers: MoE layers of the plan (the GPU must list exactly that many); None:
            any number up to :data:`~policies.limits.MAX_LAYERS`.

    Raises:
        InputError: ``field`` is ``path`` plus the missing or malformed key.
    """
    if not isinstance(g, Mapping):
        raise InputError(
            f"missing fields: a GPU entry is a JSON object with gpu, node, model and the rest "
            f"(malformed: got {type(g).__name__} {g!r:.40})",
            field=path,
        )
    hints = RuntimeHints(**_typed(RuntimeHints, _f(g, "hints", path), f"{path}.hints"))
    heads = g.get("attention_heads")
    if heads is not None:
        heads = bounded_int(heads, f"{path}.attention_heads", minimum=0, maximum=1 << 24)
    tp = bounded_int(g.get("attention_tp", 1), f"{path}.attention_tp", maximum=MAX_GPUS_PER_NODE)
    group = g.get("dp_group")
    if group is not None:
        group = bounded_int(group, f"{path}.dp_group", minimum=0, maximum=MAX_FLEET_GPUS)
    memory = g.get("memory_bytes", {})
    if not isinstance(memory, Mapping):
        raise InputError(f"must be an object, got {memory!r:.60}", field=f"{path}.memory_bytes")
    layers = _f(g, "experts", path)
    count = len(layers) if isinstance(layers, _SEQ) else 0
    if (moe_layers is not None and count != moe_layers) or count > MAX_LAYERS:
        want = (
            f"{moe_layers} (the plan's MoE layers)"
            if moe_layers is not None
            else f"at most {MAX_LAYERS}"
        )
        raise InputError(f"lists {count} MoE layers, must be {want}", field=f"{path}.experts")
    return GpuPlan(
        gpu=_str(_f(g, "gpu", path), f"{path}.gpu"),
        node=_str(_f(g, "node", path), f"{path}.node"),
        model=_str(_f(g, "model", path), f"{path}.model"),
        attention_share=_num(_f(g, "attention_share", path), f"{path}.attention_share"),
        attention_heads=heads,
        dp_weight=_num(_f(g, "dp_weight", path), f"{path}.dp_weight"),
        experts=_slots(layers, f"{path}.experts", num_experts),
        hints=hints,
        predicted_busy_us=_num(g.get("predicted_busy_us", 0.0), f"{path}.predicted_busy_us"),
        memory_bytes={
            _str(k, f"{path}.memory_bytes"): _num(v, key_path(f"{path}.memory_bytes", k))
            for k, v in memory.items()
        },
        attention_tp=tp,
        dp_group=group,
    )


def _strings(v: Any, path: str) -> tuple[str, ...]:
    if not isinstance(v, _SEQ):
        raise InputError(f"must be a list of strings, got {v!r:.60}", field=path)
    return tuple(_str(x, f"{path}[{i}]") for i, x in enumerate(v))


def plan_from_dict(d: Any) -> Plan:
    """Rebuild a :class:`Plan` from :meth:`Plan.to_dict` output, checking every field and
    nesting level (types, ranges, the limits of :mod:`policies.limits`: at most
    :data:`~policies.limits.MAX_EXPERTS` experts and :data:`~policies.limits.MAX_LAYERS`
    layers, every GPU listing every MoE layer, slots naming experts of the plan).

    Raises:
        InputError: not a plan document, or a field is missing or malformed (naming it).
    """
    if not isinstance(d, Mapping):
        raise InputError("a plan must be a JSON object", field="plan")
    if d.get("schema_version") != PLAN_SCHEMA_VERSION:
        raise InputError(
            f"unsupported plan schema_version {d.get('schema_version')!r:.60}; this mixfleet "
            f"reads {PLAN_SCHEMA_VERSION}. To fix: re-solve with this version",
            field="schema_version",
        )
    check_keys(d, {*(f.name for f in fields(Plan)), "schema_version"}, "", what="plan field")
    gpus = _f(d, "gpus", "plan")
    if not isinstance(gpus, _SEQ) or not 0 < len(gpus) <= MAX_FLEET_GPUS:
        raise InputError(
            f"must be a list of 1 to {MAX_FLEET_GPUS:,} GPU entries, got "
            f"{f'{len(gpus):,}' if isinstance(gpus, _SEQ) else repr(gpus)[:60]}",
            field="gpus",
        )
    for i, g in enumerate(gpus):  # the shape of each entry before the counts that size it
        if not isinstance(g, Mapping):
            gpu_plan_from_dict(g, f"gpus[{i}]")
    num_layers = bounded_int(_f(d, "num_layers", "plan"), "num_layers", maximum=MAX_LAYERS)
    moe = _f(d, "moe_layers", "plan")
    if not isinstance(moe, _SEQ) or len(moe) > num_layers:
        raise InputError(
            f"must be a list of at most num_layers ({num_layers}) layer indexes, got "
            f"{f'{len(moe):,} entries' if isinstance(moe, _SEQ) else repr(moe)[:60]}",
            field="moe_layers",
        )
    moe_layers = tuple(
        bounded_int(x, f"moe_layers[{i}]", minimum=0, maximum=num_layers - 1)
        for i, x in enumerate(moe)
    )
    if len(set(moe_layers)) != len(moe_layers):
        raise InputError("lists a layer twice", field="moe_layers")
    num_experts = bounded_int(
        _f(d, "num_experts", "plan"), "num_experts", minimum=0, maximum=MAX_EXPERTS
    )
    if len(moe_layers) * num_experts > MAX_LAYER_EXPERTS:
        raise InputError(
            f"{len(moe_layers)} MoE layers x {num_experts} experts = "
            f"{len(moe_layers) * num_experts:,} (layer, expert) pairs, over the limit of "
            f"{MAX_LAYER_EXPERTS:,}",
            field="num_experts",
        )
    slots = d.get("slots_per_gpu")
    if slots is not None:
        slots = bounded_int(slots, "slots_per_gpu", maximum=MAX_EXPERTS)
    gpu_keys = {f.name for f in fields(GpuPlan)}
    parts = []
    for i, g in enumerate(gpus):
        if isinstance(g, Mapping):
            check_keys(g, gpu_keys, f"gpus[{i}]", what="GPU field")
        parts.append(
            gpu_plan_from_dict(g, f"gpus[{i}]", num_experts=num_experts, moe_layers=len(moe_layers))
        )
    workload = _f(d, "workload", "plan")
    if not isinstance(workload, Mapping) or not all(
        isinstance(k, str) and (v is None or isinstance(v, (str, int, float)))
        for k, v in workload.items()
    ):
        raise InputError(
            f"must be an object of names to strings or numbers, got {workload!r:.100}",
            field="workload",
        )
    return Plan(
        id=_str(_f(d, "id", "plan"), "id"),
        version=bounded_int(_f(d, "version", "plan"), "version", minimum=0, maximum=MAX_VERSION),
        fleet=_str(_f(d, "fleet", "plan"), "fleet"),
        model=_str(_f(d, "model", "plan"), "model"),
        workload=dict(workload),
        num_layers=num_layers,
        moe_layers=moe_layers,
        num_experts=num_experts,
        num_redundant=bounded_int(
            _f(d, "num_redundant", "plan"), "num_redundant", minimum=0, maximum=MAX_LAYER_EXPERTS
        ),
        slots_per_gpu=slots,
        gpus=tuple(parts),
        summary=PlanSummary(**_typed(PlanSummary, _f(d, "summary", "plan"), "summary")),
        violations=_strings(d.get("violations", []), "violations"),
        notes=_strings(d.get("notes", []), "notes"),
        engine=PlanEngine(**_typed(PlanEngine, d.get("engine", {}), "engine")),
    )


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
