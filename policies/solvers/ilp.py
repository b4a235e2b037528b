"""``ilp``: heterogeneity-aware placement by mixed-integer programming (PuLP + HiGHS).

The step time is ``L_dense * A_dense + sum over MoE layers l of (A_moe + C_l + E_l)`` where
A, C and E are the attention, dispatch/combine and expert phases, each costing its slowest
GPU (see :mod:`policies.estimate.costmodel`). Attention shares are global and every MoE layer's
experts are independent given them, so the problem is solved in three stages.

Notation: GPUs i; classes c of interchangeable GPUs (same node, same spec; ``n_c`` GPUs);
experts e with token-expert pairs ``p_e`` per step in the layer and load fraction
``w_e = p_e / sum p``; channels ch (NVLink, PCIe, RDMA, cross-fabric RDMA); ``T`` tokens per
step; coefficients ``f_i`` (us per pair), ``r_i`` (us per replica read), ``b_i`` (us per
pair of activation traffic), ``o_i`` (fixed us), ``V`` (bytes of all pairs),
``bw_i,ch`` (bytes/us).

The three stages, each formulated in its own module's docstring (the constraint labels in
the code point back to those lines):

- stage 1, attention LP (1a)-(1f): :mod:`policies.solvers.ilp_attention`;
- stage 2, per-layer class-level MILP (2a)-(2k): :mod:`policies.solvers.ilp_layers`;
- stage 3, replicas onto the GPUs of each class: :mod:`policies.solvers.ilp_assign`.

This module drives them (:func:`place`): stage 1, the greedy warm start, one stage-2
problem per layer, stage 3, then the safety nets (greedy per layer and whole plan, and the
previous plan when re-planning).

Bounds (:mod:`policies.solvers.ilp_bound`; the plan's ``lower_bound_us`` and
``conditional_bound_us``): the stage-2 MILPs' own bounds hold only for their class-level
model at the stage-1 shares, so the plan reports two bounds of a separate relaxation instead:

- ``lower_bound_us``, global: no placement of the request has a shorter step - any attention
  shares that fit memory (equal ones when the engine balances DP ranks), any replicas, any
  split of an expert's tokens over its replicas, so whatever the engine's replica choice;
  ``bound_scope`` says it in words. The gap is measured against it and is never clipped.
- ``conditional_bound_us``: no placement with the plan's attention shares has a shorter step.

When the relaxation's own attention shares have a conditional bound more than 2% below the
stage-1 LP's, the plan takes them (:meth:`~policies.solvers.ilp_budget.Bounds.better_shares`).

Budgets and determinism (:mod:`policies.solvers.ilp_budget`): ``time_limit_s`` is the whole
call's wall clock. The stage-2 work is planned from the request alone: as many layers as the
budget pays for get a MILP (the others take the first layer's answer mapped by load rank),
each stopping on a node limit that follows from its size, with one thread and a fixed seed,
so neither the machine's load nor the worker count changes the plan; the global bound's
branch and bound is limited by a box count the same way. Wall-clock limits remain as safety nets: a layer solve the clock stops,
or a layer not started by ``LAYER_FRACTION`` of the limit (it keeps the greedy warm start),
is reported in the plan's notes, since its answer depends on the machine's speed. Warm
start: the greedy plan's class counts.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import replace

from policies.estimate.costmodel import CostTable
from policies.estimate.evaluation import Evaluation, LayerPlacement, evaluate, layer_exchange_us
from policies.hardware.topology import Channel
from policies.request import (
    Infeasible,
    PlacementRequest,
    RawPlacement,
    count_moves,
    migration_weight_us,
)
from policies.solvers import greedy
from policies.solvers.common import replicate_capped, slots_per_gpu
from policies.solvers.ilp_assign import assign_class, rebalance_native
from policies.solvers.ilp_attention import (
    choose_attention,
    class_frac,
    class_of,
    heads_rounding,
)
from policies.solvers.ilp_budget import (
    FIRST_WEIGHT,
    Bounds,
    WorkBudget,
    limit_notes,
    slot_reservations,
    work_budget,
)
from policies.solvers.ilp_layers import ClassCost, LayerProblem, LayerSolution, solve_layers


def _recv_us_per_pair(table: CostTable, cls: ClassCost, share: Sequence[float]) -> float:
    """Receive time per token-expert pair served by a GPU of ``cls``, us (slowest channel)."""
    i = cls.members[0]
    by_channel = [0.0] * len(Channel)
    for j, ch in enumerate(table.topology.channel[i]):
        if ch != Channel.LOCAL:
            by_channel[ch] += share[j]
    return max(
        (
            table.bytes_per_copy * by_channel[ch] / cls.bw[ch]
            for ch in range(1, len(Channel))
            if cls.bw[ch] > 0
        ),
        default=0.0,
    )


def _previous_layers(req: PlacementRequest, table: CostTable) -> list[LayerPlacement] | None:
    """The previous plan's placement on this fleet, or None when its GPUs differ."""
    prev = req.previous
    if prev is None or [g.gpu for g in prev.gpus] != list(table.gpu_ids):
        return None
    if any(len(g.experts) != table.num_moe_layers for g in prev.gpus):
        return None
    return [
        LayerPlacement(tuple(tuple((s.expert, s.share) for s in g.experts[li]) for g in prev.gpus))
        for li in range(table.num_moe_layers)
    ]


def _previous_start(
    req: PlacementRequest,
    table: CostTable,
    classes: Sequence[ClassCost],
    prev_counts: Sequence[tuple[tuple[int, ...], ...] | None],
    caps: Sequence[int],
    engine: bool,
) -> tuple[list[tuple[int, ...]], list[bool]]:
    """Per layer: most replicas on one GPU of each class in the previous plan, and whether
    that plan is a valid start here (every expert still covered, slots within the caps)."""
    ks: list[tuple[int, ...]] = []
    fits: list[bool] = []
    held = {}
    if req.previous is not None:
        held = {g.gpu: g.experts for g in req.previous.gpus}
    for li, counts in enumerate(prev_counts):
        if counts is None:
            ks.append(())
            fits.append(False)
            continue
        per_gpu = [len(held[gid][li]) if gid in held else 0 for gid in table.gpu_ids]
        k = tuple(max(per_gpu[i] for i in c.members) for c in classes)
        covered = all(
            sum(counts[c][e] for c in range(len(classes))) >= 1 for e in range(table.num_experts)
        )
        within = all(per_gpu[i] <= caps[i] for i in range(table.num_gpus))
        if engine:
            within = within and all(per_gpu[i] == caps[i] for i in range(table.num_gpus))
        ks.append(k)
        fits.append(covered and within)
    return ks, fits


def _warm_counts(
    classes: Sequence[ClassCost], placement: LayerPlacement, num_experts: int
) -> tuple[tuple[int, ...], ...]:
    out = []
    for cls in classes:
        row = [0] * num_experts
        for i in cls.members:
            for e, _ in placement.per_gpu[i]:
                row[e] += 1
        out.append(tuple(row))
    return tuple(out)


def _prev_counts(
    req: PlacementRequest, table: CostTable, classes: Sequence[ClassCost], layer: int
) -> tuple[tuple[int, ...], ...] | None:
    if req.previous is None:
        return None
    held = {
        g.gpu: {s.expert for s in g.experts[layer]}
        for g in req.previous.gpus
        if layer < len(g.experts)
    }
    out = []
    for cls in classes:
        row = [0] * table.num_experts
        for i in cls.members:
            for e in held.get(table.gpu_ids[i], set()):
                row[e] += 1
        out.append(tuple(row))
    return tuple(out)


def place(req: PlacementRequest, table: CostTable) -> RawPlacement | Infeasible:
    """Solve the three stages (see module docstring) and prove the bounds."""
    started = time.monotonic()
    groups = class_of(table, req)
    attention = choose_attention(req, table, groups)
    if isinstance(attention, Infeasible):
        return attention
    share, reserve, _ = attention
    notes = [f"{len(groups)} classes of identical GPUs; attention by LP, experts per layer by MILP"]
    budget = work_budget(req, table, started)
    bounds = Bounds(req, table, budget)
    picked = bounds.better_shares(share)
    if picked is not None:
        share, reserve = picked, slot_reservations(table, picked)
        notes.append(
            "attention shares from the global bound's relaxation: their conditional bound "
            "beat the stage-1 LP's shares' by more than 2%"
        )
    heads: list[int] | None = None
    if req.form == "native":
        share, heads = heads_rounding(req, share)
    if table.num_moe_layers == 0:
        raw = RawPlacement(
            tuple(share),
            (),
            tuple(heads) if heads else None,
            None,
            "HiGHS optimal (LP)",
            tuple(notes),
        )
        return bounds.attach(raw)
    warm = _warm_start(req, table, share, reserve)
    S, warm_layers = warm.slots, warm.layers
    classes = _class_costs(table, groups, share, warm.caps)
    workers = req.options.workers or (os.cpu_count() or 1)
    problems = _layer_problems(req, table, groups, share, classes, warm, budget)
    solutions = solve_layers(problems, workers, FIRST_WEIGHT, budget.milp_s)
    if isinstance(solutions, Infeasible):
        return solutions
    layers = [
        _realise(req, table, classes, sol, S) if sol.replicas else warm_layers[sol.layer]
        for sol in solutions
    ]
    notes += limit_notes(solutions)
    statuses: dict[str, int] = {}
    for sol in solutions:
        statuses[sol.status] = statuses.get(sol.status, 0) + 1
    status = ", ".join(f"{k} x{v}" for k, v in sorted(statuses.items()))
    solver_name = next((sol.solver for sol in solutions if sol.replicas), "HiGHS")
    kept = _safety_nets(req, table, share, heads, layers, warm_layers, notes, solver_name, status)
    if isinstance(kept, Infeasible):
        return kept
    return bounds.attach(kept)


def _warm_start(
    req: PlacementRequest, table: CostTable, share: Sequence[float], reserve: Sequence[float]
) -> _WarmStart:
    """The warm start and upper bound: the greedy plan with these attention shares."""
    n = table.num_gpus
    S = slots_per_gpu(table.num_experts, req.redundant_experts, n)
    caps = [S] * n if req.form == "engine" else [max(1, math.floor(r + 1e-6)) for r in reserve]
    slot_budget = min(table.num_experts + req.redundant_experts, sum(caps))
    layers = []
    for li in range(table.num_moe_layers):
        weight = [table.pairs(li, e) for e in range(table.num_experts)]
        phy = replicate_capped(weight, slot_budget, table.num_gpus)
        layers.append(greedy.pack_layer(table, li, phy, caps))
    return _WarmStart(caps, slot_budget, S, layers, evaluate(table, share, layers))


class _WarmStart:
    """The greedy plan under the stage-1 shares: per-GPU slot caps, the slot budget per
    layer, engine-form slots per GPU, its layers and their evaluation."""

    def __init__(
        self,
        caps: list[int],
        budget: int,
        slots: int,
        layers: list[LayerPlacement],
        evaluation: Evaluation,
    ) -> None:
        self.caps, self.budget, self.slots = caps, budget, slots
        self.layers, self.evaluation = layers, evaluation


def _class_costs(
    table: CostTable, groups: Sequence[Sequence[int]], share: Sequence[float], caps: Sequence[int]
) -> tuple[ClassCost, ...]:
    """Stage-2 coefficients of each class of identical GPUs (its first GPU's figures)."""
    classes = tuple(
        ClassCost(
            members=tuple(m),
            share_each=share[m[0]],
            cap=caps[m[0]],
            flop=table.gpus[m[0]].expert_flop_us_per_pair,
            read=table.gpus[m[0]].expert_read_us_per_replica,
            act=table.gpus[m[0]].expert_act_us_per_pair,
            overhead=table.gpus[m[0]].expert_overhead_us,
            alpha=table.gpus[m[0]].comm_alpha_us,
            bw=tuple(min(x, 1e12) for x in table.gpus[m[0]].comm_bw_bytes_per_us),
        )
        for m in groups
    )
    return tuple(replace(c, recv_us_per_pair=_recv_us_per_pair(table, c, share)) for c in classes)


def _layer_problems(
    req: PlacementRequest,
    table: CostTable,
    groups: Sequence[Sequence[int]],
    share: Sequence[float],
    classes: tuple[ClassCost, ...],
    warm: _WarmStart,
    budget: WorkBudget,
) -> list[LayerProblem]:
    """One stage-2 problem per MoE layer, warm-started from the previous plan when it still
    fits, else from the greedy plan."""
    engine = req.form == "engine"
    frac = class_frac(table, groups)
    seg_share: dict[int, float] = {}
    for i, seg in enumerate(table.segment):
        seg_share[seg] = seg_share.get(seg, 0.0) + share[i]
    # An all-gather backend moves every token to every GPU whatever the placement: no
    # dispatch volume to optimise (its fixed time is in the cost model, not the MILP).
    gather = table.exchange == "allgather"
    volume = 0.0 if gather else table.total_tokens * table.top_k * table.bytes_per_copy
    prev_counts = [_prev_counts(req, table, classes, li) for li in range(table.num_moe_layers)]
    prev_k, prev_fits = _previous_start(req, table, classes, prev_counts, warm.caps, engine)
    problems = []
    for li in range(table.num_moe_layers):
        lt = warm.evaluation.moe_layers[li]
        ub = max(lt.expert_us) + max(max(lt.comm_us), lt.link_us) - min(c.alpha for c in classes)
        # The most pairs one replica on class c may carry and still beat the warm start. A
        # degenerate estimate (ub at or below the fixed terms, e.g. one GPU with no load) prunes
        # nothing rather than everything.
        pair_cap = tuple(
            _positive_or_inf(min((ub - c.overhead) / c.flop, (ub - c.overhead - c.read) / c.act))
            for c in classes
        )
        counts = prev_counts[li]
        # re-planning starts from the previous placement (zero moves) when it still fits the
        # slots; otherwise from the greedy plan
        if prev_fits[li] and counts is not None:
            start, start_k = counts, prev_k[li]
        else:
            start = _warm_counts(classes, warm.layers[li], table.num_experts)
            start_k = tuple(
                max(len(warm.layers[li].per_gpu[i]) for i in c.members) for c in classes
            )
        problems.append(
            LayerProblem(
                layer=li,
                engine=engine,
                pairs=tuple(table.pairs(li, e) for e in range(table.num_experts)),
                classes=classes,
                frac=frac,
                class_segment=tuple(table.segment[c.members[0]] for c in classes),
                segment_share=tuple(seg_share.items()),
                segment_links=() if gather else table.segment_links,
                volume_bytes=volume,
                budget=warm.budget,
                slots=warm.slots,
                pair_cap=pair_cap,
                prev=counts,
                warm=start,
                warm_k=start_k,
                migration_weight_us=migration_weight_us(req),
                work_s=budget.layer_work_s,
                wall_s=budget.layer_wall_s,
                deadline=budget.deadline,
                mip_gap=req.options.mip_gap,
                solver=req.options.solver,
            )
        )
    return problems


def _realise(
    req: PlacementRequest,
    table: CostTable,
    classes: Sequence[ClassCost],
    sol: LayerSolution,
    S: int,
) -> LayerPlacement:
    """Stage 3 for one solved layer: each class's replicas onto its GPUs, as shares of each
    expert's pairs."""
    engine = req.form == "engine"
    prev_sets = None
    if req.previous is not None:
        prev_sets = {
            g.gpu: [{s.expert for s in layer} for layer in g.experts] for g in req.previous.gpus
        }
    per_gpu: list[tuple[tuple[int, float], ...]] = [() for _ in range(table.num_gpus)]
    for c, cls in enumerate(classes):
        items = []
        for e in range(table.num_experts):
            cnt = sol.replicas[c][e]
            if cnt <= 0:
                continue
            pe = table.pairs(sol.layer, e) * sol.share[c][e]
            items.extend([(pe / cnt, e)] * cnt)
        members = cls.members
        prev_held = [
            (
                prev_sets.get(table.gpu_ids[i], [set()] * (sol.layer + 1))[sol.layer]
                if prev_sets
                else set()
            )
            for i in members
        ]
        slots = [S if engine else cls.cap for _ in members]
        if not engine:
            total = len(items)
            base, extra = divmod(total, len(members))
            slots = [min(cls.cap, base + (1 if g < extra else 0)) for g in range(len(members))]
            if sum(slots) < total:
                slots = [cls.cap] * len(members)
        penalty = migration_weight_us(req) / cls.flop if req.previous is not None else 0.0
        held = assign_class(members, items, slots, prev_held, penalty, merge=not engine)
        if not engine:
            held = rebalance_native(table, members, held, cls.recv_us_per_pair, req.options.solver)
        for g, i in enumerate(members):
            per_gpu[i] = tuple((e, pp) for e, pp in held[g])
    return _as_shares(table, sol.layer, per_gpu, engine)


def _as_shares(
    table: CostTable,
    layer: int,
    per_gpu: Sequence[tuple[tuple[int, float], ...]],
    engine: bool,
) -> LayerPlacement:
    """Per GPU (expert, pairs) converted to shares of each expert's pairs."""
    out_gpu = []
    replicas_of: dict[int, int] = {}
    for slots_i in per_gpu:
        for e, _ in slots_i:
            replicas_of[e] = replicas_of.get(e, 0) + 1
    for slots_i in per_gpu:
        row = []
        for e, pp in slots_i:
            pe = table.pairs(layer, e)
            s = (1.0 / replicas_of[e]) if engine or pe <= 0 else pp / pe
            row.append((e, s))
        out_gpu.append(tuple(row))
    if not engine:  # a replica the share LP left idle only costs memory: drop it
        out_gpu = [tuple((e, x) for e, x in row if x > 1e-9) for row in out_gpu]
    return LayerPlacement(_normalise(tuple(out_gpu), table.num_experts))


def _safety_nets(
    req: PlacementRequest,
    table: CostTable,
    share: list[float],
    heads: list[int] | None,
    layers: list[LayerPlacement],
    warm_layers: Sequence[LayerPlacement],
    notes: list[str],
    solver_name: str,
    status: str,
) -> RawPlacement | Infeasible:
    """The MILP's plan, unless per layer the greedy warm start, the previous plan (when
    re-planning) or the whole greedy plan realises better."""
    # Per layer keep the better of the MILP's realisation and the greedy warm start under
    # the same attention shares (moves priced in when re-planning).
    fallback = 0
    for li in range(len(layers)):
        mine = _layer_cost(req, table, share, li, layers[li])
        theirs = _layer_cost(req, table, share, li, warm_layers[li])
        if theirs < mine - 1e-9:
            layers[li] = warm_layers[li]
            fallback += 1
    if fallback:
        notes.append(f"{fallback} layer(s) kept the greedy warm start, which realised better")
    if req.previous is not None:
        kept = _keep_previous(req, table, share, heads, layers, notes)
        if kept is not None:
            return kept
    if req.previous is None:
        # Whole-plan safety net: the greedy plan with its own attention shares.
        ours = evaluate(table, share, layers)
        fallback_raw = greedy.place(req, table)
        if isinstance(fallback_raw, Infeasible):  # stage 1 already placed these capacities
            return fallback_raw
        alt = evaluate(table, fallback_raw.attention_share, fallback_raw.layers)
        if alt.feasible and (alt.step_time_us < ours.step_time_us - 1e-9 or not ours.feasible):
            return replace_raw(
                fallback_raw,
                solver=f"{solver_name} ({status}); greedy plan kept",
                notes=(*notes, "the greedy plan realised better than the MILP's"),
            )
    return RawPlacement(
        tuple(share),
        tuple(layers),
        tuple(heads) if heads else None,
        None,
        f"{solver_name} ({status})",
        tuple(notes),
    )


def _keep_previous(
    req: PlacementRequest,
    table: CostTable,
    share: Sequence[float],
    heads: list[int] | None,
    layers: Sequence[LayerPlacement],
    notes: Sequence[str],
) -> RawPlacement | None:
    """Re-planning: the previous plan as it is (no moves) when it is feasible here and no
    re-placement pays for its moves; else None."""
    assert req.previous is not None
    kept = _previous_layers(req, table)
    if kept is None:
        return None
    old_share = [g.attention_share for g in req.previous.gpus]
    lam = migration_weight_us(req)
    new_cost = evaluate(table, share, layers).step_time_us + lam * (
        count_moves(req.previous, table.gpu_ids, layers) or 0
    )
    old_eval = evaluate(table, old_share, kept)
    if old_eval.feasible and old_eval.step_time_us <= new_cost:
        return RawPlacement(
            tuple(old_share),
            tuple(kept),
            tuple(g.attention_heads or 0 for g in req.previous.gpus) if heads else None,
            None,
            "previous plan kept",
            (*notes, "no re-placement paid for its moves; the previous placement stands"),
        )
    return None


def replace_raw(raw: RawPlacement, *, solver: str, notes: tuple[str, ...]) -> RawPlacement:
    """``raw`` with another solver label and notes."""
    return RawPlacement(raw.attention_share, raw.layers, raw.attention_heads, None, solver, notes)


def _layer_cost(
    req: PlacementRequest, table: CostTable, share: Sequence[float], li: int, layer: LayerPlacement
) -> float:
    """Comm + expert phase time of one layer, plus the move penalty when re-planning, us."""
    cost = layer_exchange_us(table, share, li, layer)
    if req.previous is not None:
        empty = LayerPlacement(tuple(() for _ in table.gpu_ids))
        moves = count_moves(req.previous, table.gpu_ids, [empty] * li + [layer]) or 0
        cost += migration_weight_us(req) * moves
    return cost


def _normalise(
    per_gpu: tuple[tuple[tuple[int, float], ...], ...], num_experts: int
) -> tuple[tuple[tuple[int, float], ...], ...]:
    """Make each expert's shares sum to exactly 1 (solver round-off) and drop empty slots
    in native form."""
    total = [0.0] * num_experts
    for slots in per_gpu:
        for e, s in slots:
            total[e] += s
    return tuple(
        tuple((e, s / total[e] if total[e] > 0 else s) for e, s in slots) for slots in per_gpu
    )


def _positive_or_inf(cap: float) -> float:
    """A pruning cap in pairs: ``cap`` when positive, else no pruning (infinity)."""
    return cap if cap > 0.0 else math.inf
