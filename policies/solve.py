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
from collections.abc import Callable
from dataclasses import replace
from typing import cast

from policies.defaults import auto_redundant_experts
from policies.errors import InputError
from policies.estimate import tensor_parallel
from policies.estimate.costmodel import GIB, CostTable
from policies.estimate.engines import Runtime, rank_shares
from policies.estimate.evaluation import Evaluation, LayerPlacement, evaluate
from policies.estimate.execution import executed, runtime_of
from policies.hardware.topology import Channel
from policies.plan import (
    ExpertSlot,
    GpuPlan,
    Plan,
    PlanEngine,
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
from policies.solvers import eplb, greedy, ilp, locality, portfolio, uniform
from policies.solvers.milp import work_only

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
    return _solve(req, fixes=True)


def _solve(req: PlacementRequest, *, fixes: bool) -> PlacementResult:
    """:func:`solve`; ``fixes``: an unplaced reply lists the changes that make it placeable
    (:func:`verified_fixes`; False when checking one of them)."""
    check_request(req)
    t0 = time.perf_counter()
    # The attention TP sizes first (fits_at_all per candidate), the policy under them.
    choice = tensor_parallel.choose(req, PLACE[cast(PolicyName, req.policy)], fits_at_all)
    table, answer, elapsed = choice.table, choice.answer, choice.solve_s
    if isinstance(answer, Infeasible):
        if fixes:
            answer = replace(answer, reasons=(*answer.reasons, _fix_line(req)))
        return _unplaced(req, table, answer, elapsed)
    best = _later_stages(req, table, answer, assemble_plan(req, table, answer, elapsed), t0)
    if best.plan.summary.solve_s != elapsed:  # a later stage won: report the whole time
        best = _with_solve_s(best, time.perf_counter() - t0)
    return best


def rescore(req: PlacementRequest, plan: Plan) -> PlacementResult:
    """``plan``'s placement as ``req``'s engine would execute it: its planned DP weights and
    slots, with the engine's own DP balancing and replica choice (the question "what does
    this plan really do on SGLang?").

    Raises:
        InputError: the plan does not fit the request's fleet and model, or the engine
            cannot run it (see :func:`policies.estimate.execution.runtime_of`).
    """
    check_request(req)
    if [g.gpu for g in plan.gpus] != [g.id for g in req.fleet.gpus]:
        raise InputError(
            f"plan {plan.id} is for other GPUs than the request's fleet {req.fleet.name}. "
            "To fix: rescore it against the fleet it was solved for",
            field="plan",
        )
    if len(plan.moe_layers) != req.model.num_moe_layers:
        raise InputError(f"plan {plan.id} is for another model than {req.model.name}", field="plan")
    table = tensor_parallel.tp_cost_table(
        req.fleet, req.model, req.workload, req.settings, [g.attention_tp for g in plan.gpus]
    )
    table = replace(table, exchange=runtime_of(req).exchange_in(table.decode))
    n = len(plan.gpus)
    weights = [g.dp_weight / n for g in plan.gpus]
    layers = tuple(
        LayerPlacement(tuple(tuple((s.expert, s.share) for s in g.experts[li]) for g in plan.gpus))
        for li in range(len(plan.moe_layers))
    )
    raw = RawPlacement(tuple(weights), layers, solver=plan.summary.solver, notes=plan.notes)
    return assemble_plan(req, table, raw, plan.summary.solve_s)


def _better(a: PlacementResult, b: PlacementResult) -> bool:
    """``a`` beats ``b``: feasible over infeasible, then the lower executed step time."""
    fa, fb = a.evaluation.feasible, b.evaluation.feasible
    if fa != fb:
        return fa
    return a.evaluation.step_time_us < b.evaluation.step_time_us - 1e-9


def _with_solve_s(r: PlacementResult, solve_s: float) -> PlacementResult:
    plan = replace(r.plan, summary=replace(r.plan.summary, solve_s=solve_s))
    return replace(r, plan=plan)


def _later_stages(
    req: PlacementRequest,
    table: CostTable,
    raw: RawPlacement,
    best: PlacementResult,
    t0: float,
) -> PlacementResult:
    """Later stages of our policies, each scored as the engine executes it, the best kept:
    for ``ilp``, layers mixed with the EPLB layout and the EPLB plan itself (the baseline it
    must never lose to); for ``greedy`` and ``ilp`` under a nearest-replica engine, the best
    so far with replicas moved by :func:`policies.solvers.locality.refine` - when at least
    30% of the time limit is left (a note says when it was not)."""
    if req.policy not in ("greedy", "ilp") or not raw.layers or req.previous is not None:
        return best
    if req.options.screen:
        return best
    runtime = runtime_of(req)
    share = rank_shares(runtime, raw.attention_share)
    best_raw = raw

    def consider(cand: RawPlacement) -> None:
        nonlocal best, best_raw
        mine = assemble_plan(req, table, cand, time.perf_counter() - t0)
        if _better(mine, best):
            best, best_raw = mine, cand

    if req.policy == "ilp" and req.form == "engine":
        base = eplb.place(req, table)
        even = runtime.dispatch != "planned"
        mixed = portfolio.mix_layers(table, share, raw, base, even=even, exchange=table.exchange)
        if mixed is not None:
            consider(mixed)
        kept = f"{raw.solver}; EPLB plan kept"
        consider(
            replace(
                base,
                notes=(*base.notes, "the EPLB plan realised better"),
                solver=kept,
                lower_bound_us=raw.lower_bound_us,
                bound_scope=raw.bound_scope,
            )
        )
    if runtime.dispatch in ("static", "dynamic"):
        if not work_only() and time.perf_counter() - t0 > 0.7 * req.options.time_limit_s:
            note = "time limit: the nearest-replica stage was skipped"
            return replace(best, plan=replace(best.plan, notes=(*best.plan.notes, note)))
        layers = locality.refine(table, runtime, share, best_raw.layers)
        note = "replicas moved to where SGLang's nearest-replica rule balances them"
        consider(replace(best_raw, layers=tuple(layers), notes=(*best_raw.notes, note)))
    return best


def fits_at_all(req: PlacementRequest, table: CostTable) -> Infeasible | None:
    """Why the model cannot fit the fleet under any placement at ``table``'s attention TP
    sizes, with the numbers; None when it might (:func:`policies.estimate.tensor_parallel.choose`
    asks it of every TP candidate and, when none fits, replies with the largest sizes')."""
    usable = sum(c.usable_bytes - c.fixed_bytes for c in table.gpus)
    experts = req.model.num_moe_layers * req.model.num_experts * table.expert_bytes
    kv = table.kv_tokens(table.total_tokens) * table.kv_bytes_per_token if table.decode else 0.0
    short = [
        f"{gid} ({m}): its part of the shared weights at attention TP {table.kv_split(i)[0]} "
        f"({c.fixed_bytes / GIB:.1f} GiB) exceeds its {c.usable_bytes / GIB:.1f} GiB usable"
        for i, (gid, m, c) in enumerate(zip(table.gpu_ids, table.models, table.gpus, strict=True))
        if c.fixed_bytes > c.usable_bytes
    ]
    if short:
        return Infeasible(
            "the model does not fit: every GPU holds its attention group's part of the shared "
            "weights (all of them in data-parallel attention, 1/k in a tensor-parallel group of "
            "k GPUs of one node and model, k up to 8), and on these GPUs even the smallest part "
            "is too large. To fix: drop these GPUs from the fleet or use GPUs with more memory",
            tuple(short[:8]),
        )
    if experts + kv > usable:
        return Infeasible(
            "the fleet's free memory is too small for this model and batch",
            (
                f"need {experts / GIB:.0f} GiB for routed experts and {kv / GIB:.0f} GiB of KV "
                f"cache, have {usable / GIB:.0f} GiB after shared weights",
            ),
        )
    return None


#: Smallest --tokens and --context a fix may propose.
_MIN_TOKENS, _MIN_CONTEXT = 1, 512


def _placeable(req: PlacementRequest) -> bool:
    """Whether ``req`` has a placement that fits: a greedy re-solve with no fixes listed."""
    try:
        r = _solve(replace(req, policy="greedy"), fixes=False)
    except InputError:  # the change itself is refused (dpBalance router on trtllm...)
        return False
    return r.placed and r.plan.summary.feasible and not r.plan.violations


def _largest(value: int, floor: int, works: Callable[[int], bool]) -> int | None:
    """The largest of ``value / 2, value / 4, ...`` (down to ``floor``) for which
    ``works``; None when not even ``floor`` works (tried first, so a hopeless change costs
    one re-solve)."""
    if value <= floor or not works(floor):
        return None
    v = value // 2
    while v > floor:
        if works(v):
            return v
        v //= 2
    return floor


def verified_fixes(req: PlacementRequest) -> list[str]:
    """Changes of the request's own settings that make an unplaceable request placeable,
    each checked by re-solving with it (greedy): the KV cache in FP8, the mixfleet router's
    DP weights instead of the engine's equal shares, fewer tokens per GPU, a shorter
    context, the fewest redundant experts. Only what works is named."""
    wl = req.workload
    out: list[str] = []
    if wl.kv_cache_dtype != "fp8" and _placeable(
        replace(req, workload=replace(wl, kv_cache_dtype="fp8"))
    ):
        out.append("--kv-cache-dtype fp8")
    if req.engine.equal_dp:
        router = replace(req.engine, options=replace(req.engine.options, dp_balance="router"))
        if _placeable(replace(req, engine=router)):
            out.append("route with the mixfleet router (engine option dpBalance router)")

    def tokens(t: int) -> bool:
        return _placeable(replace(req, workload=replace(wl, tokens_per_gpu=t)))

    def context(c: int) -> bool:
        return _placeable(replace(req, workload=replace(wl, context_len=c)))

    t = _largest(wl.tokens_per_gpu, _MIN_TOKENS, tokens)
    if t is not None:
        out.append(f"--tokens {t} or fewer")
    c = _largest(wl.context_len, _MIN_CONTEXT, context)
    if c is not None:
        out.append(f"--context {c} or shorter")
    fewest = auto_redundant_experts(req.model.num_experts, len(req.fleet.gpus), req.form)
    fewer = req.model.num_moe_layers and req.redundant_experts > fewest
    if fewer and _placeable(replace(req, redundant_experts=fewest)):
        out.append(f"--redundant-experts {fewest}")
    return out


def _fix_line(req: PlacementRequest) -> str:
    """The reply's "To fix" line: the verified fixes, or that none of them works."""
    fixes = verified_fixes(req)
    if fixes:
        return "To fix (each checked by re-solving with it): " + "; or ".join(fixes)
    return (
        "No change of --kv-cache-dtype, DP balancing, --tokens, --context or "
        "--redundant-experts makes it fit. To fix: add GPUs or use GPUs with more memory"
    )


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


def _hints(
    req: PlacementRequest, table: CostTable, i: int, tokens: float, ep_backend: str
) -> RuntimeHints:
    """GPU i's runtime settings; ``ep_backend`` is its EP group's one all-to-all backend."""
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
        ep_backend=ep_backend,
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
    """Score a policy's raw answer as the request's engine executes it and build the plan.

    The plan's attention shares and replica shares are the executed ones
    (:func:`policies.estimate.execution.executed`); its DP weights are the planned ones, which the
    mixfleet router applies (equal when the engine balances)."""
    runtime = runtime_of(req)
    run = executed(req, runtime, raw, table)
    ev = evaluate(table, run.attention_share, run.layers, runtime.exchange_in(table.decode))
    n = table.num_gpus
    gpus = _gpu_plans(req, table, run, ev, raw.attention_share)
    summary = _summary(req, table, run, ev, solve_s)
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
        gpus,
        {
            "model": req.model.name,
            "form": req.form,
            "fleet": req.fleet.name,
            "engine": [runtime.engine.name, runtime.a2a_backend, runtime.dispatch],
        },
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
        engine=_plan_engine(runtime),
    )
    # Structural checks (equal slots, coverage, duplicates) join the cost model's memory and
    # coverage findings, so a plan no engine can load never reports itself feasible.
    problems = tuple(dict.fromkeys([*ev.violations, *validate_plan(plan)]))
    if problems != plan.violations:
        plan = replace(plan, violations=problems, summary=replace(summary, feasible=not problems))
    return PlacementResult(plan, ev, problems)


def _plan_engine(runtime: Runtime) -> PlanEngine:
    e = runtime.engine
    return PlanEngine(
        name=e.name,
        version=e.resolved_version,
        a2a_backend=runtime.a2a_backend,
        dispatch=runtime.dispatch,
        dp_balance=runtime.dp_balance,
        gpus_per_node=runtime.gpus_per_node,
        why=runtime.why,
    )


def _gpu_plans(
    req: PlacementRequest,
    table: CostTable,
    raw: RawPlacement,
    ev: Evaluation,
    planned_share: tuple[float, ...],
) -> list[GpuPlan]:
    """Per GPU, fleet order: its executed share and slots, the router's DP weight (from the
    planned share), runtime hints and predicted figures."""
    n = table.num_gpus
    runtime = runtime_of(req)
    runtime_weights = not runtime.equal_dp
    backend = runtime.a2a_backend
    tp = table.attention_tp or (1,) * n
    groups = tensor_parallel.dp_groups(req.fleet, tp)
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
                dp_weight=planned_share[i] * n if runtime_weights else 1.0,
                experts=experts,
                hints=_hints(req, table, i, tokens, backend),
                predicted_busy_us=ev.gpu_busy_us(i),
                memory_bytes=dict(ev.memory_bytes[i]),
                attention_tp=tp[i],
                dp_group=groups[i],
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
    gap = None  # against the proven bound, unclipped: a plan below its bound is a bug
    if bound is not None and ev.step_time_us > 0 and ev.feasible:
        gap = (ev.step_time_us - bound) / ev.step_time_us
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
        conditional_bound_us=raw.conditional_bound_us,
        bound_scope=raw.bound_scope,
    )
