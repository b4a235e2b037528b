"""Partition plans: the immutable output of every policy, its validator and its wire form.

The front door of plans: the types and their JSON-ready form live in
:mod:`policies.plan_types`, reading a plan document in :mod:`policies.plan_doc`; both are
re-exported here. This module owns the validator (:func:`validate_plan`).

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

import math

from policies.defaults import FORMS as FORMS  # one default: policies.defaults
from policies.plan_doc import gpu_plan_from_dict as gpu_plan_from_dict
from policies.plan_doc import plan_from_dict as plan_from_dict
from policies.plan_types import PLAN_SCHEMA_VERSION as PLAN_SCHEMA_VERSION
from policies.plan_types import ExpertSlot as ExpertSlot
from policies.plan_types import GpuPlan as GpuPlan
from policies.plan_types import Plan as Plan
from policies.plan_types import PlanEngine as PlanEngine
from policies.plan_types import PlanSummary as PlanSummary
from policies.plan_types import RuntimeHints as RuntimeHints
from policies.plan_types import gpu_plan_to_dict as gpu_plan_to_dict
from policies.plan_types import placement_digest as placement_digest


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
