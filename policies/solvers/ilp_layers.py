"""Stage 2 of the ``ilp`` policy: one class-level MILP per MoE layer.

Notation as in :mod:`policies.solvers.ilp`; the constraint labels (2a)-(2k) below are the
ones the code of :func:`solve_layer` and its helpers points back to. A layer's problem
(:class:`LayerProblem`) is plain data, so layers solve in worker processes.

Stage 2 - per MoE layer, class-level MILP (layers solved in parallel processes). Identical
GPUs are interchangeable, so variables count replicas per *class* instead of per GPU - this
breaks the symmetry and shrinks the model by the class size. Native form::

    y_e,c in {0..n_c}   replicas of e in class c          t_e,c in [0,1]  share of e's pairs
    k_c   integer       most replicas on one GPU of c      mv_e,c >= 0     moves (re-planning)

    min   tau_C + tau_E + lambda * sum mv_e,c
    s.t.  sum_c t_e,c = 1                                   coverage            (2a)
          t_e,c <= u_e,c * y_e,c                            replica size        (2b)
          sum_e,c y_e,c <= E + R,  sum_e y_e,c <= n_c cap_c  slot budget, memory (2c)
          n_c k_c >= sum_e y_e,c                                                (2d)
          tau_E >= f_c * P_c / n_c + o_c,    P_c = sum_e p_e t_e,c                (2e)
          tau_E >= r_c * k_c + b_c * P_c / n_c + o_c                            (2f)
          tau_C >= alpha_c + V * recv_c,ch / bw_c,ch,  recv_c,ch = s_c / n_c * src_c,ch   (2g)
          tau_C >= alpha_c + V * send_c,ch / bw_c,ch,  send_c,ch = a_c * dst_c,ch(s)      (2h)
          mv_e,c >= y_e,c - y0_e,c                          only with a previous plan (2i)
          tau_C >= alpha_L + V / (2 bw_L) * (A_a S_b + A_b S_a)  per fabric link L
                      joining segments a, b (A: attention share, S: served)  (2k)
          h_c >= p_e t_e,c - p_e (y_e,c - 1),  tau_E >= f_c h_c + o_c,
          tau_C >= alpha_c + rho_c h_c                      heaviest lone replica (2j)
                                    (engine form: h_c + (S - 1) * lightest replica)

``s_c = sum_e w_e t_e,c`` is the class's served fraction, ``src_c,ch`` the attention share
of the GPUs reaching c over ch, ``dst_c,ch(s)`` the served fraction reachable from c over
ch, ``rho_c`` the receive time per pair of a GPU of c. ``u_e,c = min(1, Pmax_c / p_e)`` caps a replica at the pairs a GPU of c can process
within the greedy plan's layer time, a bound any solution better than the warm start obeys.
Engine form replaces ``t`` by a replica count per expert: binaries ``z_e,r`` choose
``r_e = r`` and integers ``y_e,c,r`` place them, each replica serving ``p_e / r`` pairs::

    sum_r z_e,r = 1,  sum_c y_e,c,r = r z_e,r,  y_e,c,r <= min(n_c, r) z_e,r
    sum_e,r y_e,c,r = S n_c  (equal slots),     P_c = sum_e,r (p_e / r) y_e,c,r

with ``r`` ranging over 1..``r_max`` only for the experts heavy enough to need it.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import pulp

from policies.request import Infeasible
from policies.solvers.milp import solve_milp
from policies.topology import Channel


@dataclass(frozen=True)
class ClassCost:
    """Coefficients of one class of identical GPUs (see module docstring)."""

    members: tuple[int, ...]
    share_each: float
    cap: int
    flop: float
    read: float
    act: float
    overhead: float
    alpha: float
    bw: tuple[float, ...]
    recv_us_per_pair: float = 0.0


@dataclass(frozen=True)
class LayerProblem:
    """Stage-2 input for one MoE layer; plain data so it pickles cheaply to a worker."""

    layer: int
    engine: bool
    pairs: tuple[float, ...]
    classes: tuple[ClassCost, ...]
    frac: tuple[tuple[tuple[float, ...], ...], ...]  # [c][d][channel], see ilp_attention.class_frac
    class_segment: tuple[int, ...]  # fabric segment of each class
    segment_share: tuple[tuple[int, float], ...]  # (segment, attention share of its GPUs)
    segment_links: tuple[tuple[int, int, float, float], ...]  # see CostTable.segment_links
    volume_bytes: float
    budget: int
    slots: int
    pair_cap: tuple[float, ...]
    prev: tuple[tuple[int, ...], ...] | None
    warm: tuple[tuple[int, ...], ...]
    warm_k: tuple[int, ...]
    migration_weight_us: float
    time_limit_s: float
    mip_gap: float
    solver: str


@dataclass(frozen=True)
class LayerSolution:
    """Stage-2 output: replicas and pair shares per class and expert."""

    layer: int
    replicas: tuple[tuple[int, ...], ...]  # [class][expert]
    share: tuple[tuple[float, ...], ...]  # [class][expert], fraction of the expert's pairs
    bound_us: float
    objective_us: float
    status: str
    solver: str


@dataclass
class _Model:
    """The stage-2 MILP of one layer while it is being built."""

    prob: pulp.LpProblem
    tau_e: pulp.LpVariable
    tau_c: pulp.LpVariable
    k: list[pulp.LpVariable]
    h: list[pulp.LpVariable]
    rep: list[list[pulp.LpAffineExpression]]  # replicas[c][e]
    pairs_on: list[list[pulp.LpAffineExpression]]  # pairs[c][e]
    served: list[pulp.LpAffineExpression]  # served fraction per class
    warm_vars: list[tuple[pulp.LpVariable, float]] = field(default_factory=list)


def solve_layer(p: LayerProblem) -> LayerSolution | Infeasible:
    """Stage 2 for one layer (runs in a worker process); ``p.time_limit_s`` covers building
    the model too. An :class:`Infeasible` when the solver finds no placement."""
    started = time.perf_counter()
    E = len(p.pairs)
    C = len(p.classes)
    md = _Model(
        prob=pulp.LpProblem(f"layer{p.layer}", pulp.LpMinimize),
        tau_e=pulp.LpVariable("tauE", 0),
        tau_c=pulp.LpVariable("tauC", 0),
        k=[
            pulp.LpVariable(f"k{c}", 0, cls.cap if not p.engine else p.slots, cat="Integer")
            for c, cls in enumerate(p.classes)
        ],
        # h_c: pairs of the heaviest single replica in class c (2j): the GPU holding it
        # receives and computes at least that much, which the class average alone would hide.
        h=[pulp.LpVariable(f"h{c}", 0) for c in range(C)],
        rep=[[pulp.LpAffineExpression() for _ in range(E)] for _ in range(C)],
        pairs_on=[[pulp.LpAffineExpression() for _ in range(E)] for _ in range(C)],
        served=[pulp.LpAffineExpression() for _ in range(C)],
    )
    lightest = _engine_replicas(p, md) if p.engine else _native_replicas(p, md)
    moves = _class_rows(p, md, lightest)
    prob, tau_c = md.prob, md.tau_c
    # (2k) links between fabric segments carry every pair that crosses them, shared
    share_of = dict(p.segment_share)
    for sa, sb, bw, alpha in p.segment_links:
        served_a = pulp.lpSum(md.served[c] for c in range(C) if p.class_segment[c] == sa)
        served_b = pulp.lpSum(md.served[c] for c in range(C) if p.class_segment[c] == sb)
        cross = share_of.get(sa, 0.0) * served_b + share_of.get(sb, 0.0) * served_a
        prob += tau_c >= alpha + p.volume_bytes / (2 * bw) * cross
    prob += md.tau_e + tau_c + p.migration_weight_us * pulp.lpSum(moves)
    for c in range(len(p.classes)):  # warm k_c: most replicas on one GPU of c
        md.warm_vars.append((md.k[c], float(p.warm_k[c])))
    # A warm start outside a variable's bounds is not a feasible point (the greedy layout
    # can hold more replicas of an expert than the formulation allows): solve cold then.
    if all(_within_bounds(var, value) for var, value in md.warm_vars):
        for var, value in md.warm_vars:
            var.setInitialValue(value)
    # HiGHS needs a moment for presolve and the root LP; below that it proves nothing.
    limit = max(0.25, p.time_limit_s - (time.perf_counter() - started))
    out = solve_milp(prob, solver=p.solver, time_limit_s=limit, mip_gap=p.mip_gap, warm=True)
    if not math.isfinite(out.objective):
        return Infeasible(f"MoE layer {p.layer}: {out.solver} found no placement ({out.status})")
    return _read_solution(p, md, out.objective, out.bound, out.status, out.solver)


def _read_solution(
    p: LayerProblem, md: _Model, objective: float, bound: float, status: str, solver: str
) -> LayerSolution:
    """The solved model's replicas and pair shares, with a bound (the LP relaxation's when
    the solver stopped before proving one)."""
    E = len(p.pairs)
    C = len(p.classes)
    rep, pairs_on = md.rep, md.pairs_on
    replicas = tuple(tuple(round(pulp.value(rep[c][e]) or 0.0) for e in range(E)) for c in range(C))
    share = []
    for c in range(C):
        row = []
        for e in range(E):
            pe = p.pairs[e]
            val = float(pulp.value(pairs_on[c][e]) or 0.0)
            row.append(
                val / pe
                if pe > 0
                else (1.0 if replicas[c][e] and c == _first(replicas, e) else 0.0)
            )
        share.append(tuple(row))
    if not math.isfinite(bound):
        # Stopped before the root LP: the LP relaxation is still a valid (weaker) bound.
        # Solving it overwrites the variables, so the answer was read out above.
        relaxed = solve_milp(
            md.prob, solver=p.solver, time_limit_s=5.0, mip_gap=0, warm=False, relax=True
        )
        bound = relaxed.bound if relaxed.status == "optimal" else -math.inf
    return LayerSolution(p.layer, replicas, tuple(share), bound, objective, status, solver)


def _native_replicas(p: LayerProblem, md: _Model) -> float:
    """Native form: integer replicas ``y`` and pair shares ``t`` per expert and class
    (2a)-(2c), (2j). Returns the lightest replica's pairs the (2j) rows assume: 0."""
    E = len(p.pairs)
    C = len(p.classes)
    total_pairs = sum(p.pairs) or 1.0
    w = [x / total_pairs for x in p.pairs]
    prob, h, rep = md.prob, md.h, md.rep
    for e in range(E):
        ts = []
        for c, cls in enumerate(p.classes):
            ub = min(len(cls.members), cls.cap)
            u = min(1.0, p.pair_cap[c] / p.pairs[e]) if p.pairs[e] > 0 else 1.0
            y = pulp.LpVariable(f"y{e}_{c}", 0, ub, cat="Integer")
            t = pulp.LpVariable(f"t{e}_{c}", 0, 1)
            prob += t <= u * y  # (2b)
            if p.pairs[e] > 0:
                prob += h[c] >= p.pairs[e] * t - p.pairs[e] * (y - 1)  # (2j), binds when y = 1
            ts.append(t)
            rep[c][e] += y
            md.pairs_on[c][e] += p.pairs[e] * t
            md.served[c] += w[e] * t
            md.warm_vars.append((y, float(p.warm[c][e])))
        prob += pulp.lpSum(ts) == 1  # (2a)
    prob += pulp.lpSum(rep[c][e] for c in range(C) for e in range(E)) <= p.budget  # (2c)
    for c, cls in enumerate(p.classes):
        prob += pulp.lpSum(rep[c]) <= len(cls.members) * cls.cap  # (2c)
    return 0.0


def _replica_options(p: LayerProblem) -> list[list[int]]:
    """Engine form: the replica counts ``r`` each expert may take (1..r_max, wider for the
    heavy experts, always including the warm start's count)."""
    E = len(p.pairs)
    C = len(p.classes)
    n_total = sum(len(cls.members) for cls in p.classes)
    extra = p.budget - E
    max_cap = max(p.pair_cap)
    avg_slot = sum(p.pairs) / p.budget
    order = sorted(range(E), key=lambda e: -p.pairs[e])
    heavy = set(order[: min(E, 2 * extra + 8)]) if extra > 0 else set()
    warm_count = [sum(p.warm[c][e] for c in range(C)) for e in range(E)]
    out = []
    for e in range(E):
        r_min = max(1, math.ceil(p.pairs[e] / max_cap - 1e-9)) if p.pairs[e] > 0 else 1
        if e in heavy:
            r_hi = max(r_min, math.ceil(p.pairs[e] / max(avg_slot, 1e-9)) + 2, warm_count[e])
            options = list(range(r_min, min(n_total, extra + 1, r_hi) + 1)) or [min(r_min, n_total)]
        else:
            options = [max(1, min(r_min, n_total))]
            if warm_count[e] not in options and warm_count[e] >= 1:
                options.append(warm_count[e])
        out.append(options)
    return out


def _engine_replicas(p: LayerProblem, md: _Model) -> float:
    """Engine form: binaries ``z_e,r`` choose each expert's replica count, integers
    ``y_e,c,r`` place them; equal slots per GPU, (2j). Returns the lightest replica's
    pairs (for the engine-form (2j) rows)."""
    E = len(p.pairs)
    C = len(p.classes)
    total_pairs = sum(p.pairs) or 1.0
    w = [x / total_pairs for x in p.pairs]
    prob, h, rep = md.prob, md.h, md.rep
    warm_count = [sum(p.warm[c][e] for c in range(C)) for e in range(E)]
    all_options = _replica_options(p)
    r_max = [1] * E
    for e in range(E):
        options = all_options[e]
        r_max[e] = max(options)
        zs = []
        for r in options:
            z = pulp.LpVariable(f"z{e}_{r}", 0, 1, cat="Binary")
            zs.append(z)
            md.warm_vars.append((z, 1.0 if warm_count[e] == r else 0.0))
            ys = []
            for c, cls in enumerate(p.classes):
                fits = p.pairs[e] / r <= p.pair_cap[c] + 1e-9
                ub = min(len(cls.members), r) if fits else 0
                if ub == 0:
                    continue
                y = pulp.LpVariable(f"y{e}_{c}_{r}", 0, ub, cat="Integer")
                prob += y <= ub * z
                if ub == 1:
                    prob += h[c] >= (p.pairs[e] / r) * y  # (2j)
                ys.append(y)
                rep[c][e] += y
                md.pairs_on[c][e] += (p.pairs[e] / r) * y
                md.served[c] += (w[e] / r) * y
                md.warm_vars.append((y, float(p.warm[c][e]) if warm_count[e] == r else 0.0))
            prob += pulp.lpSum(ys) == r * z
        prob += pulp.lpSum(zs) == 1
    for c, cls in enumerate(p.classes):
        prob += pulp.lpSum(rep[c]) == p.slots * len(cls.members)  # equal slots
    return min(p.pairs[e] / max(r_max[e], 1) for e in range(E))


def _class_rows(p: LayerProblem, md: _Model, lightest: float) -> list[pulp.LpVariable]:
    """Per class: (2d)-(2h), the heaviest-replica rows of (2j) and the move variables of
    (2i). Returns the move variables."""
    E = len(p.pairs)
    prob, tau_e, tau_c, k, h, rep, served = (
        md.prob,
        md.tau_e,
        md.tau_c,
        md.k,
        md.h,
        md.rep,
        md.served,
    )
    moves = []
    for c, cls in enumerate(p.classes):
        n_c = len(cls.members)
        P_c = pulp.lpSum(md.pairs_on[c])
        prob += n_c * k[c] >= pulp.lpSum(rep[c])  # (2d)
        prob += tau_e >= cls.flop / n_c * P_c + cls.overhead  # (2e)
        prob += tau_e >= cls.read * k[c] + cls.act / n_c * P_c + cls.overhead  # (2f)
        # (2j) the GPU holding the heaviest lone replica; in engine form it also holds S - 1
        # other replicas of at least the lightest possible load.
        rest = (p.slots - 1) * lightest if p.engine else 0.0
        prob += tau_e >= cls.flop * (h[c] + rest) + cls.overhead
        prob += tau_c >= cls.alpha + cls.recv_us_per_pair * (h[c] + rest)
        # (2g), (2h): per channel, receive and send volumes of one GPU of class c
        for ch in range(1, len(Channel) - 1):
            src = 0.0
            dst = pulp.LpAffineExpression()
            for c2, cls2 in enumerate(p.classes):
                f = p.frac[c][c2][ch]
                if f <= 0:
                    continue
                src += cls2.share_each * len(cls2.members) * f
                dst += served[c2] * f
            bw = cls.bw[ch]
            if bw <= 0:
                continue
            if src > 0:
                prob += tau_c >= cls.alpha + p.volume_bytes / bw * src / n_c * served[c]
            if cls.share_each > 0 and dst.keys():
                prob += tau_c >= cls.alpha + p.volume_bytes / bw * cls.share_each * dst
        if p.prev is not None:
            for e in range(E):
                mv = pulp.LpVariable(f"mv{e}_{c}", 0)
                prob += mv >= rep[c][e] - p.prev[c][e]  # (2i)
                moves.append(mv)
    return moves


def _first(replicas: Sequence[Sequence[int]], e: int) -> int:
    """The first class holding a replica of expert ``e``, or -1."""
    for c, row in enumerate(replicas):
        if row[e] > 0:
            return c
    return -1


def _rank_mapped(
    reference: LayerSolution, ref_pairs: Sequence[float], p: LayerProblem
) -> LayerProblem:
    """``p`` warm-started from a solved layer: the expert of load rank k in ``p`` gets the
    replicas per class that the expert of load rank k got in the reference layer. Loads of
    different layers usually have similar sorted profiles, so this start is close to optimal
    and HiGHS often only has to confirm it."""
    ref_order = sorted(range(len(ref_pairs)), key=lambda e: -ref_pairs[e])
    order = sorted(range(len(p.pairs)), key=lambda e: -p.pairs[e])
    warm = [[0] * len(p.pairs) for _ in p.classes]
    for rank, e in enumerate(order):
        e_ref = ref_order[rank]
        for c in range(len(p.classes)):
            warm[c][e] = reference.replicas[c][e_ref]
    warm_k = tuple(
        p.slots if p.engine else -(-sum(warm[c]) // len(cls.members))
        for c, cls in enumerate(p.classes)
    )
    return replace(p, warm=tuple(tuple(r) for r in warm), warm_k=warm_k)


def solve_layers(
    problems: Sequence[LayerProblem], workers: int, first_weight: float = 1.0
) -> list[LayerSolution] | Infeasible:
    """Solve one layer (with ``first_weight`` times the per-layer time, since every other
    layer starts from its answer), warm-start the others from it by load rank, and solve
    them in parallel. The first layer's :class:`Infeasible`, if any layer has one."""
    if not problems:
        return []
    first = solve_layer(replace(problems[0], time_limit_s=problems[0].time_limit_s * first_weight))
    if isinstance(first, Infeasible):
        return first
    rest = list(problems[1:])
    if math.isfinite(first.objective_us) and problems[0].prev is None:
        rest = [_rank_mapped(first, problems[0].pairs, p) for p in rest]
    others: list[LayerSolution | Infeasible]
    if workers > 1 and len(rest) > 1:
        # fork is cheap and safe while this process runs no other thread; a threaded host
        # (the gRPC controller) gets spawn, which needs its main module import-guarded.
        method = "fork" if threading.active_count() == 1 and os.name == "posix" else "spawn"
        ctx = multiprocessing.get_context(method)
        with ProcessPoolExecutor(max_workers=min(workers, len(rest)), mp_context=ctx) as pool:
            others = list(pool.map(solve_layer, rest, chunksize=1))
    else:
        others = [solve_layer(p) for p in rest]
    solved = [first]
    for sol in others:
        if isinstance(sol, Infeasible):
            return sol
        solved.append(sol)
    return solved


def _within_bounds(var: pulp.LpVariable, value: float) -> bool:
    """Whether ``value`` lies within ``var``'s bounds (None is unbounded)."""
    lo, hi = var.lowBound, var.upBound
    return (lo is None or value >= lo) and (hi is None or value <= hi)
