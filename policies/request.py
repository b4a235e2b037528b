"""The planning core's front door: :func:`solve` turns a :class:`PlacementRequest` into a
:class:`PlacementResult`.

Every policy receives the same request (fleet, model, workload, slot budget, cost model)
and returns the same raw answer (attention shares plus expert placement per MoE layer);
:func:`assemble_plan` scores that answer with the shared cost model and builds the plan,
so policies are compared on equal terms.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from policies.costmodel import (
    GIB,
    CostSettings,
    CostTable,
    Evaluation,
    LayerPlacement,
    build_cost_table,
    evaluate,
)
from policies.errors import InfeasibleError, InputError
from policies.fleet import Fleet
from policies.models import ModelSpec
from policies.plan import (
    FORMS,
    ExpertSlot,
    GpuPlan,
    Plan,
    PlanSummary,
    RuntimeHints,
    placement_digest,
    validate_plan,
)
from policies.topology import Channel
from policies.vendors import check_vendors
from policies.workload import Workload

POLICIES = ("uniform", "eplb", "greedy", "ilp")


@dataclass(frozen=True)
class SolverOptions:
    """Knobs of the MILP solver.

    Attributes:
        time_limit_s: wall-clock limit for the whole solve, seconds.
        mip_gap: relative MIP gap at which a layer's solve stops (0.01 = 1%).
        solver: ``highs`` (default) or ``cbc`` (fallback, also used when HiGHS is missing).
        workers: processes solving layers in parallel; 0 = one per CPU.
        migration_weight_us: objective cost of moving one expert replica, us per move
            (used only with a previous plan); None = 30% of the previous plan's mean time
            per MoE layer divided by its slots per layer: a move must buy back a third of
            what one slot's share of the layer costs.
    """

    time_limit_s: float = 60.0
    mip_gap: float = 0.005
    solver: str = "highs"
    workers: int = 0
    migration_weight_us: float | None = None


@dataclass(frozen=True)
class PlacementRequest:
    """Everything a policy needs.

    Attributes:
        fleet: GPUs and links.
        model: model architecture.
        workload: phase, batch, context and expert load.
        policy: ``uniform`` | ``eplb`` | ``greedy`` | ``ilp``.
        form: ``engine`` (equal slots, equal replica shares) or ``native``.
        redundant_experts: extra expert slots per MoE layer beyond one per expert
            (engine form: ``num_experts + redundant_experts`` must divide by the GPU count).
        options: solver options.
        previous: plan to stay close to (re-planning); None for a fresh plan.
        settings: cost-model settings (efficiencies, measured figures, headroom).
        allow_cross_vendor: let one expert-parallel group span GPU vendors (NVIDIA and AMD
            all-to-all in one group); off by default.
    """

    fleet: Fleet
    model: ModelSpec
    workload: Workload
    policy: str = "ilp"
    form: str = "engine"
    redundant_experts: int = 32
    options: SolverOptions = field(default_factory=SolverOptions)
    previous: Plan | None = None
    settings: CostSettings = field(default_factory=CostSettings)
    allow_cross_vendor: bool = False


@dataclass(frozen=True)
class RawPlacement:
    """What a policy decides, before scoring.

    Attributes:
        attention_share: per GPU, fraction of the step's tokens (sums to 1).
        layers: per MoE layer the placement (per GPU ``(expert, share)`` lists).
        attention_heads: native form: query heads per GPU, or None.
        lower_bound_us: proven lower bound on the step time, or None.
        solver: solver name and status.
        notes: remarks for the plan.
    """

    attention_share: tuple[float, ...]
    layers: tuple[LayerPlacement, ...]
    attention_heads: tuple[int, ...] | None = None
    lower_bound_us: float | None = None
    solver: str = "heuristic"
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlacementResult:
    """A solve's reply: the plan when one was found, else the reasons it is infeasible.

    Attributes:
        plan: the plan (also when it violates a constraint; see ``plan.violations``).
        evaluation: its cost-model evaluation.
        infeasible: reasons no valid plan exists (empty when ``plan.violations`` is empty).
    """

    plan: Plan
    evaluation: Evaluation
    infeasible: tuple[str, ...] = ()


PolicyFn = Callable[[PlacementRequest, CostTable], RawPlacement]


def check_request(req: PlacementRequest) -> None:
    """Validate the request's options.

    Raises:
        InputError: unknown policy or form, bad slot budget, bad solver options.
    """
    if req.policy not in POLICIES:
        raise InputError(f"unknown policy {req.policy!r}; choose one of {POLICIES}", field="policy")
    if req.form not in FORMS:
        raise InputError(f"unknown form {req.form!r}; choose one of {FORMS}", field="form")
    r = req.redundant_experts
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise InputError(f"must be an integer >= 0, got {r!r}", field="redundant_experts")
    o = req.options
    if not (o.time_limit_s > 0 and math.isfinite(o.time_limit_s)):
        raise InputError(f"must be > 0 seconds, got {o.time_limit_s!r}", field="time_limit")
    if not 0 <= o.mip_gap < 1:
        raise InputError(f"must be in [0, 1), got {o.mip_gap!r}", field="mip_gap")
    if o.solver not in ("highs", "cbc"):
        raise InputError(f"must be 'highs' or 'cbc', got {o.solver!r}", field="solver")
    if o.workers < 0:
        raise InputError(f"must be >= 0, got {o.workers}", field="workers")
    if o.migration_weight_us is not None and not o.migration_weight_us >= 0:
        raise InputError("must be >= 0", field="migration_weight_us")
    g = len(req.fleet.gpus)
    e = req.model.num_experts
    if req.model.is_moe and req.form == "engine" and (e + r) % g != 0:
        lo = (e + r) // g * g - e
        hi = lo + g
        options = [x for x in (lo, hi) if x >= 0]
        raise InputError(
            f"engine form needs num_experts + redundant_experts ({e} + {r}) divisible by the "
            f"{g} GPUs (every rank holds the same number of slots). To fix: use "
            f"--redundant-experts {' or '.join(map(str, options))}, or --form native",
            field="redundant_experts",
        )
    if req.model.is_moe and req.form == "engine" and (e + r) // g > e:
        raise InputError(
            f"engine form would give every GPU {(e + r) // g} slots but {req.model.name} has only "
            f"{e} experts per layer. To fix: use fewer --redundant-experts (at most "
            f"{e * g - e}) or more GPUs",
            field="redundant_experts",
        )
    check_vendors(req.fleet, req.model, allow_cross_vendor=req.allow_cross_vendor)
    if req.previous is not None and len(req.previous.moe_layers) != req.model.num_moe_layers:
        raise InputError(
            "previous plan is for a different model (MoE layer count differs)", field="previous"
        )


def migration_weight_us(req: PlacementRequest) -> float:
    """Price of one expert move in the re-planning objective, us (see SolverOptions)."""
    if req.options.migration_weight_us is not None:
        return req.options.migration_weight_us
    if req.previous is None or not req.previous.moe_layers:
        return 0.0
    prev = req.previous
    slots = sum(len(g.experts[0]) for g in prev.gpus) or 1
    return 0.3 * prev.summary.step_time_us / len(prev.moe_layers) / slots


def solve(req: PlacementRequest) -> PlacementResult:
    """Place attention and experts for a request with its policy.

    Raises:
        InputError: invalid request.
        InfeasibleError: no placement fits (memory); the reasons name GPUs and amounts.
    """
    from policies.solvers import eplb, greedy, ilp, uniform

    check_request(req)
    table = build_cost_table(req.fleet, req.model, req.workload, req.settings)
    _check_fits_at_all(req, table)
    fns: dict[str, PolicyFn] = {
        "uniform": uniform.place,
        "eplb": eplb.place,
        "greedy": greedy.place,
        "ilp": ilp.place,
    }
    t0 = time.perf_counter()
    raw = fns[req.policy](req, table)
    elapsed = time.perf_counter() - t0
    return assemble_plan(req, table, raw, elapsed)


def _check_fits_at_all(req: PlacementRequest, table: CostTable) -> None:
    """Fail early, with the numbers, when the model cannot fit the fleet at all."""
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
        raise InfeasibleError(
            "the model does not fit: data-parallel attention needs the shared weights on every "
            "GPU. To fix: drop these GPUs from the fleet or use GPUs with more memory",
            tuple(short[:8]),
        )
    if experts + kv > usable:
        raise InfeasibleError(
            "the fleet's free memory is too small for this model and batch",
            (
                f"need {experts / GIB:.0f} GiB for routed experts and {kv / GIB:.0f} GiB of KV "
                f"cache, have {usable / GIB:.0f} GiB after shared weights. To fix: add GPUs, "
                "shorten --context, lower --tokens or use --kv-cache-dtype fp8",
            ),
        )


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


def count_moves(
    previous: Plan | None, gpu_ids: Sequence[str], layers: Sequence[LayerPlacement]
) -> int | None:
    """Replicas placed on a GPU that did not hold that expert in ``previous`` (same layer)."""
    if previous is None:
        return None
    before: dict[str, list[set[int]]] = {
        g.gpu: [{s.expert for s in layer} for layer in g.experts] for g in previous.gpus
    }
    moves = 0
    for li, placement in enumerate(layers):
        for gid, slots in zip(gpu_ids, placement.per_gpu, strict=True):
            held = before.get(gid)
            had = held[li] if held is not None and li < len(held) else set()
            moves += sum(1 for e, _ in slots if e not in had)
    return moves


def assemble_plan(
    req: PlacementRequest, table: CostTable, raw: RawPlacement, solve_s: float
) -> PlacementResult:
    """Score a policy's raw answer with the cost model and build the plan."""
    ev = evaluate(table, raw.attention_share, raw.layers)
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
    imb: list[float] = []
    for t in ev.moe_layers:
        active = list(t.expert_us)
        mean = sum(active) / len(active) if active else 0.0
        imb.append((max(active) - mean) / mean if mean > 0 else 0.0)
    bound = raw.lower_bound_us
    gap = None
    if bound is not None and ev.step_time_us > 0:
        gap = max(0.0, (ev.step_time_us - bound) / ev.step_time_us)
    summary = PlanSummary(
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
