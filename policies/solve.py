"""The planning core's front door: :func:`solve` turns a :class:`PlacementRequest` into a
:class:`PlacementResult`.

Every policy receives the same request (fleet, model, workload, slot budget, cost model)
and returns the same raw answer (attention shares plus expert placement per MoE layer), or
an :class:`~policies.request.Infeasible` with its reasons. :func:`assemble_plan` scores the
answer with the shared cost model and builds the plan, so policies are compared on equal
terms. Infeasibility always comes back in the reply (``result.infeasible``; ``placed`` is
False when no placement exists at all); only an invalid request raises.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import cast

from policies.costmodel import GIB, CostTable, build_cost_table
from policies.evaluation import Evaluation, evaluate
from policies.plan import (
    ExpertSlot,
    GpuPlan,
    Plan,
    PlanSummary,
    RuntimeHints,
    placement_digest,
    validate_plan,
)
from policies.request import (
    Infeasible,
    PlacementRequest,
    PlacementResult,
    PolicyFn,
    PolicyName,
    RawPlacement,
    check_request,
    count_moves,
)
from policies.solvers import eplb, greedy, ilp, uniform
from policies.topology import Channel

PLACE: dict[PolicyName, PolicyFn] = {
    "uniform": uniform.place,
    "eplb": eplb.place,
    "greedy": greedy.place,
    "ilp": ilp.place,
}
"""Each policy's placement function, by name (the keys are :data:`policies.request.POLICIES`)."""


def solve(req: PlacementRequest) -> PlacementResult:
    """Place attention and experts for a request with its policy.

    Returns:
        The plan with its evaluation. When the model cannot fit at all or the policy finds
        no placement, ``placed`` is False, ``message`` and ``infeasible`` say why (naming
        GPUs and amounts) and the plan is the uniform layout with its memory violations.

    Raises:
        InputError: invalid request.
    """
    check_request(req)
    table = build_cost_table(req.fleet, req.model, req.workload, req.settings)
    too_big = fits_at_all(req, table)
    if too_big is not None:
        return _unplaced(req, table, too_big, 0.0)
    t0 = time.perf_counter()
    answer = PLACE[cast(PolicyName, req.policy)](req, table)  # check_request checked the name
    elapsed = time.perf_counter() - t0
    if isinstance(answer, Infeasible):
        return _unplaced(req, table, answer, elapsed)
    return assemble_plan(req, table, answer, elapsed)


def fits_at_all(req: PlacementRequest, table: CostTable) -> Infeasible | None:
    """Why the model cannot fit the fleet under any placement, with the numbers; None when
    it might."""
    usable = sum(c.usable_bytes - c.fixed_bytes for c in table.gpus)
    experts = req.model.num_moe_layers * req.model.num_experts * table.expert_bytes
    kv = table.kv_tokens(table.total_tokens) * table.kv_bytes_per_token if table.decode else 0.0
    short = [
        f"{gid} ({m}): the weights every GPU holds ({c.fixed_bytes / GIB:.1f} GiB) exceed its "
        f"{c.usable_bytes / GIB:.1f} GiB usable"
        for gid, m, c in zip(table.gpu_ids, table.models, table.gpus, strict=True)
        if c.fixed_bytes > c.usable_bytes
    ]
    if short:
        return Infeasible(
            "the model does not fit: data-parallel attention needs the shared weights on every "
            "GPU. To fix: drop these GPUs from the fleet or use GPUs with more memory",
            tuple(short[:8]),
        )
    if experts + kv > usable:
        return Infeasible(
            "the fleet's free memory is too small for this model and batch",
            (
                f"need {experts / GIB:.0f} GiB for routed experts and {kv / GIB:.0f} GiB of KV "
                f"cache, have {usable / GIB:.0f} GiB after shared weights. To fix: add GPUs, "
                "shorten --context, lower --tokens or use --kv-cache-dtype fp8",
            ),
        )
    return None


def _unplaced(
    req: PlacementRequest, table: CostTable, why: Infeasible, solve_s: float
) -> PlacementResult:
    """The reply when no placement exists: ``why`` as the reasons, and the uniform layout,
    scored, as the plan (its violations name the GPUs that overflow)."""
    shown = uniform.place(req, table)
    assert isinstance(shown, RawPlacement)  # uniform ignores memory: it always places
    note = f"no {req.policy} placement: {why.message}; the uniform layout is shown"
    result = assemble_plan(req, table, replace(shown, notes=(note,)), solve_s)
    plan = result.plan
    if plan.summary.feasible:
        plan = replace(plan, summary=replace(plan.summary, feasible=False))
    reasons = why.reasons or (why.message,)
    return PlacementResult(plan, result.evaluation, reasons, placed=False, message=why.message)


# ---------------------------------------------------------------------------- assembly


def _hints(req: PlacementRequest, table: CostTable, i: int, tokens: float) -> RuntimeHints:
    gpu = req.fleet.gpus[i]
    arch = gpu.spec.architecture
    decode = req.workload.decode
    hopper_plus = arch in ("hopper", "blackwell")
    backend = "fa3" if arch == "hopper" else "fa2" if arch in ("ampere", "ada") else "sdpa"
    per_rank = max(1, math.ceil(tokens))
    copies = per_rank * max(req.model.top_k, 1)
    buf = copies * table.bytes_per_copy * 2  # dispatch + combine in flight, double-buffered
    mib = 1 << 20
    nvl = int(math.ceil(buf / mib) * mib)
    remote = bool((table.topology.channel[i] >= Channel.RDMA).any())
    splits = 1
    if decode:
        kv_heads = 1 if req.model.attention == "mla" else req.model.num_kv_heads
        work = max(1, per_rank * kv_heads)
        splits = max(1, min(32, gpu.spec.sms // work, req.workload.context_len // 256))
    return RuntimeHints(
        ep_backend="deepep" if hopper_plus else "nccl",
        deepep_mode="low_latency" if decode else "normal",
        deepep_num_sms=24 if not decode and hopper_plus else 20,
        num_nvl_bytes=nvl,
        num_rdma_bytes=nvl if remote else 0,
        fp8_dispatch=table.bytes_per_copy < req.model.hidden * 4,
        attention_backend=backend,
        decode_num_splits=splits,
    )


def assemble_plan(
    req: PlacementRequest, table: CostTable, raw: RawPlacement, solve_s: float
) -> PlacementResult:
    """Score a policy's raw answer with the cost model and build the plan."""
    ev = evaluate(table, raw.attention_share, raw.layers)
    n = table.num_gpus
    gpus = _gpu_plans(req, table, raw, ev)
    summary = _summary(req, table, raw, ev, solve_s)
    workload = {
        "phase": req.workload.phase,
        "tokens_per_gpu": req.workload.tokens_per_gpu,
        "context_len": req.workload.context_len,
        "kv_cache_dtype": req.workload.kv_cache_dtype,
        "load_source": req.workload.load_source,
    }
    slots = None
    if req.form == "engine" and req.model.is_moe:
        slots = (req.model.num_experts + req.redundant_experts) // n
    pid = placement_digest(
        gpus, {"model": req.model.name, "form": req.form, "fleet": req.fleet.name}
    )
    plan = Plan(
        id=pid,
        version=(req.previous.version + 1) if req.previous else 1,
        fleet=req.fleet.name,
        model=req.model.name,
        workload=workload,
        num_layers=req.model.num_layers,
        moe_layers=req.model.moe_layers,
        num_experts=req.model.num_experts,
        num_redundant=req.redundant_experts,
        slots_per_gpu=slots,
        gpus=tuple(gpus),
        summary=summary,
        violations=ev.violations,
        notes=raw.notes,
    )
    # Structural checks (equal slots, coverage, duplicates) join the cost model's memory and
    # coverage findings, so a plan no engine can load never reports itself feasible.
    problems = tuple(dict.fromkeys([*ev.violations, *validate_plan(plan)]))
    if problems != plan.violations:
        plan = replace(plan, violations=problems, summary=replace(summary, feasible=not problems))
    return PlacementResult(plan, ev, problems)


def _gpu_plans(
    req: PlacementRequest, table: CostTable, raw: RawPlacement, ev: Evaluation
) -> list[GpuPlan]:
    """Per GPU, fleet order: its share, expert slots, runtime hints and predicted figures."""
    n = table.num_gpus
    gpus: list[GpuPlan] = []
    for i, gpu in enumerate(req.fleet.gpus):
        experts = tuple(
            tuple(ExpertSlot(e, s) for e, s in layer.per_gpu[i]) for layer in raw.layers
        )
        tokens = raw.attention_share[i] * table.total_tokens
        gpus.append(
            GpuPlan(
                gpu=gpu.id,
                node=gpu.node,
                model=gpu.spec.model,
                attention_share=raw.attention_share[i],
                attention_heads=raw.attention_heads[i] if raw.attention_heads else None,
                dp_weight=raw.attention_share[i] * n,
                experts=experts,
                hints=_hints(req, table, i, tokens),
                predicted_busy_us=ev.gpu_busy_us(i),
                memory_bytes=dict(ev.memory_bytes[i]),
            )
        )
    return gpus


def _summary(
    req: PlacementRequest, table: CostTable, raw: RawPlacement, ev: Evaluation, solve_s: float
) -> PlanSummary:
    """The plan's headline figures: step time, throughput, bound and gap, imbalance, moves."""
    imb: list[float] = []
    for t in ev.moe_layers:
        active = list(t.expert_us)
        mean = sum(active) / len(active) if active else 0.0
        imb.append((max(active) - mean) / mean if mean > 0 else 0.0)
    bound = raw.lower_bound_us
    gap = None
    if bound is not None and ev.step_time_us > 0:
        gap = max(0.0, (ev.step_time_us - bound) / ev.step_time_us)
    return PlanSummary(
        policy=req.policy,
        form=req.form,
        step_time_us=ev.step_time_us,
        tokens_per_s=ev.tokens_per_s,
        lower_bound_us=bound,
        gap=gap,
        solve_s=solve_s,
        feasible=ev.feasible,
        imbalance=sum(imb) / len(imb) if imb else 0.0,
        expert_moves=count_moves(req.previous, table.gpu_ids, raw.layers),
        solver=raw.solver,
    )
