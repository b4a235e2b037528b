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

from policies.hardware.topology import Channel
from policies.request import Infeasible
from policies.solvers.milp import Limits, Model

Terms = list[tuple[int, float]]
"""A linear expression: ``(column, coefficient)`` pairs of a :class:`~policies.solvers.milp.Model`."""


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
    """Stage-2 input for one MoE layer; plain data so it pickles cheaply to a worker.

    ``work_s`` is the solve's planned work in reference seconds, turned into a node limit
    from the model's size (the same answer on any machine); ``wall_s`` is the wall-clock
    safety net of this layer and ``deadline`` (``time.monotonic()`` seconds) the whole
    solve's: a layer not started by then is skipped."""

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
    work_s: float
    wall_s: float
    deadline: float
    mip_gap: float
    solver: str


@dataclass(frozen=True)
class LayerSolution:
    """Stage-2 output: replicas and pair shares per class and expert.

    ``status`` is ``optimal``, ``work_limit``, ``wall_clock`` (the safety net stopped it: the
    answer depends on the machine's speed) or ``skipped`` (the whole solve's deadline had
    passed: no answer, ``replicas`` empty); ``bound_us`` is HiGHS's bound of this layer's
    model (:mod:`policies.solvers.ilp_bound` says what is proven for the plan)."""

    layer: int
    replicas: tuple[tuple[int, ...], ...]  # [class][expert]
    share: tuple[tuple[float, ...], ...]  # [class][expert], fraction of the expert's pairs
    bound_us: float
    objective_us: float
    status: str
    solver: str
    nodes: int = -1
    nonzeros: int = 0


@dataclass
class _Model:
    """The stage-2 MILP of one layer while it is being built (column indices of ``m``)."""

    m: Model
    tau_e: int
    tau_c: int
    k: list[int]
    h: list[int]
    rep: list[list[Terms]]  # replicas[c][e]
    pairs_on: list[list[Terms]]  # pairs[c][e]
    served: list[Terms]  # served fraction per class
    warm_vars: list[tuple[int, float]] = field(default_factory=list)


def _value(values: Sequence[float], terms: Terms) -> float:
    return sum(coef * values[col] for col, coef in terms)


def solve_layer(p: LayerProblem) -> LayerSolution | Infeasible:
    """Stage 2 for one layer (runs in a worker process). An :class:`Infeasible` when the
    solver finds no placement."""
    if time.monotonic() >= p.deadline:
        return LayerSolution(p.layer, (), (), -math.inf, math.inf, "skipped", "none")
    E = len(p.pairs)
    C = len(p.classes)
    m = Model(f"layer{p.layer}")
    md = _Model(
        m=m,
        tau_e=m.var(0.0),
        tau_c=m.var(0.0),
        k=[m.var(0, cls.cap if not p.engine else p.slots, integer=True) for cls in p.classes],
        # h_c: pairs of the heaviest single replica in class c (2j): the GPU holding it
        # receives and computes at least that much, which the class average alone would hide.
        h=[m.var(0.0) for _ in range(C)],
        rep=[[[] for _ in range(E)] for _ in range(C)],
        pairs_on=[[[] for _ in range(E)] for _ in range(C)],
        served=[[] for _ in range(C)],
    )
    lightest = _engine_replicas(p, md) if p.engine else _native_replicas(p, md)
    moves = _class_rows(p, md, lightest)
    # (2k) links between fabric segments carry every pair that crosses them, shared
    share_of = dict(p.segment_share)
    for sa, sb, bw, alpha in p.segment_links:
        cross: Terms = [(md.tau_c, 1.0)]
        for c in range(C):
            w = share_of.get(sa, 0.0) * (p.class_segment[c] == sb) + share_of.get(sb, 0.0) * (
                p.class_segment[c] == sa
            )
            if w:
                cross += [(col, -p.volume_bytes / (2 * bw) * w * x) for col, x in md.served[c]]
        m.ge(cross, alpha)
    m.minimise([(md.tau_e, 1.0), (md.tau_c, 1.0)] + [(mv, p.migration_weight_us) for mv in moves])
    for c in range(C):  # warm k_c: most replicas on one GPU of c
        md.warm_vars.append((md.k[c], float(p.warm_k[c])))
    # A warm start outside a variable's bounds is not a feasible point (the greedy layout
    # can hold more replicas of an expert than the formulation allows): solve cold then.
    if all(m.within_bounds(col, value) for col, value in md.warm_vars):
        for col, value in md.warm_vars:
            m.set_start(col, value)
    wall = max(0.05, min(p.wall_s, p.deadline - time.monotonic()))
    nodes = round(p.work_s / (SECONDS_PER_NODE_PER_NONZERO * max(1, len(m.index))))
    limits = Limits(max_nodes=max(10, min(1_000_000, nodes)), mip_gap=p.mip_gap, wall_s=wall)
    out = m.solve(solver=p.solver, limits=limits)
    if not out.values:
        return Infeasible(f"MoE layer {p.layer}: {out.solver} found no placement ({out.status})")
    replicas = tuple(
        tuple(round(_value(out.values, md.rep[c][e])) for e in range(E)) for c in range(C)
    )
    share = []
    for c in range(C):
        row = []
        for e in range(E):
            pe = p.pairs[e]
            val = _value(out.values, md.pairs_on[c][e])
            row.append(
                val / pe
                if pe > 0
                else (1.0 if replicas[c][e] and c == _first(replicas, e) else 0.0)
            )
        share.append(tuple(row))
    return LayerSolution(
        p.layer,
        replicas,
        tuple(share),
        out.bound,
        out.objective,
        out.status,
        out.solver,
        out.nodes,
        len(m.index),
    )


def _native_replicas(p: LayerProblem, md: _Model) -> float:
    """Native form: integer replicas ``y`` and pair shares ``t`` per expert and class
    (2a)-(2c), (2j). Returns the lightest replica's pairs the (2j) rows assume: 0."""
    E = len(p.pairs)
    C = len(p.classes)
    total_pairs = sum(p.pairs) or 1.0
    w = [x / total_pairs for x in p.pairs]
    m, h, rep = md.m, md.h, md.rep
    for e in range(E):
        ts = []
        for c, cls in enumerate(p.classes):
            ub = min(len(cls.members), cls.cap)
            u = min(1.0, p.pair_cap[c] / p.pairs[e]) if p.pairs[e] > 0 else 1.0
            y = m.var(0, ub, integer=True)
            t = m.var(0.0, 1.0)
            m.le([(t, 1.0), (y, -u)], 0.0)  # (2b)
            if p.pairs[e] > 0:  # (2j), binds when y = 1
                m.ge([(h[c], 1.0), (t, -p.pairs[e]), (y, p.pairs[e])], p.pairs[e])
            ts.append((t, 1.0))
            rep[c][e].append((y, 1.0))
            md.pairs_on[c][e].append((t, p.pairs[e]))
            md.served[c].append((t, w[e]))
            md.warm_vars.append((y, float(p.warm[c][e])))
        m.eq(ts, 1.0)  # (2a)
    m.le([t for c in range(C) for e in range(E) for t in rep[c][e]], p.budget)  # (2c)
    for c, cls in enumerate(p.classes):
        m.le([t for e in range(E) for t in rep[c][e]], len(cls.members) * cls.cap)  # (2c)
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
    m, h, rep = md.m, md.h, md.rep
    warm_count = [sum(p.warm[c][e] for c in range(C)) for e in range(E)]
    all_options = _replica_options(p)
    r_max = [1] * E
    for e in range(E):
        options = all_options[e]
        r_max[e] = max(options)
        zs: Terms = []
        for r in options:
            z = m.var(0, 1, integer=True)
            zs.append((z, 1.0))
            md.warm_vars.append((z, 1.0 if warm_count[e] == r else 0.0))
            ys: Terms = []
            for c, cls in enumerate(p.classes):
                fits = p.pairs[e] / r <= p.pair_cap[c] + 1e-9
                ub = min(len(cls.members), r) if fits else 0
                if ub == 0:
                    continue
                y = m.var(0, ub, integer=True)
                m.le([(y, 1.0), (z, -float(ub))], 0.0)
                if ub == 1:
                    m.ge([(h[c], 1.0), (y, -p.pairs[e] / r)], 0.0)  # (2j)
                ys.append((y, 1.0))
                rep[c][e].append((y, 1.0))
                md.pairs_on[c][e].append((y, p.pairs[e] / r))
                md.served[c].append((y, w[e] / r))
                md.warm_vars.append((y, float(p.warm[c][e]) if warm_count[e] == r else 0.0))
            m.eq([*ys, (z, -float(r))], 0.0)
        m.eq(zs, 1.0)
    for c, cls in enumerate(p.classes):  # equal slots
        m.eq([t for e in range(E) for t in rep[c][e]], p.slots * len(cls.members))
    return min(p.pairs[e] / max(r_max[e], 1) for e in range(E))


def _class_rows(p: LayerProblem, md: _Model, lightest: float) -> list[int]:
    """Per class: (2d)-(2h), the heaviest-replica rows of (2j) and the move variables of
    (2i). Returns the move variables."""
    E = len(p.pairs)
    m, tau_e, tau_c, k, h = md.m, md.tau_e, md.tau_c, md.k, md.h
    moves = []
    for c, cls in enumerate(p.classes):
        n_c = len(cls.members)
        P_c = [t for e in range(E) for t in md.pairs_on[c][e]]
        reps = [t for e in range(E) for t in md.rep[c][e]]
        m.ge([(k[c], float(n_c)), *((col, -x) for col, x in reps)], 0.0)  # (2d)
        m.ge([(tau_e, 1.0), *((col, -cls.flop / n_c * x) for col, x in P_c)], cls.overhead)  # (2e)
        m.ge(  # (2f)
            [(tau_e, 1.0), (k[c], -cls.read), *((col, -cls.act / n_c * x) for col, x in P_c)],
            cls.overhead,
        )
        # (2j) the GPU holding the heaviest lone replica; in engine form it also holds S - 1
        # other replicas of at least the lightest possible load.
        rest = (p.slots - 1) * lightest if p.engine else 0.0
        m.ge([(tau_e, 1.0), (h[c], -cls.flop)], cls.overhead + cls.flop * rest)
        m.ge(
            [(tau_c, 1.0), (h[c], -cls.recv_us_per_pair)],
            cls.alpha + cls.recv_us_per_pair * rest,
        )
        _channel_rows(p, md, c)
        if p.prev is not None:
            for e in range(E):
                mv = m.var(0.0)
                m.ge([(mv, 1.0), *((col, -x) for col, x in md.rep[c][e])], -p.prev[c][e])  # (2i)
                moves.append(mv)
    return moves


def _channel_rows(p: LayerProblem, md: _Model, c: int) -> None:
    """(2g), (2h): per channel, receive and send volumes of one GPU of class ``c``."""
    cls = p.classes[c]
    n_c = len(cls.members)
    for ch in range(1, len(Channel) - 1):
        src = 0.0
        dst: Terms = []
        for c2, cls2 in enumerate(p.classes):
            f = p.frac[c][c2][ch]
            if f <= 0:
                continue
            src += cls2.share_each * len(cls2.members) * f
            dst += [(col, f * x) for col, x in md.served[c2]]
        bw = cls.bw[ch]
        if bw <= 0:
            continue
        if src > 0:
            coef = p.volume_bytes / bw * src / n_c
            md.m.ge([(md.tau_c, 1.0), *((col, -coef * x) for col, x in md.served[c])], cls.alpha)
        if cls.share_each > 0 and dst:
            coef = p.volume_bytes / bw * cls.share_each
            md.m.ge([(md.tau_c, 1.0), *((col, -coef * x) for col, x in dst)], cls.alpha)


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


def _mapped_solution(
    reference: LayerSolution, ref_pairs: Sequence[float], p: LayerProblem
) -> LayerSolution:
    """The reference layer's answer for layer ``p`` without a solve of its own: the expert
    of load rank k gets the replicas and class shares of the reference's expert of rank k."""
    ref_order = sorted(range(len(ref_pairs)), key=lambda e: -ref_pairs[e])
    order = sorted(range(len(p.pairs)), key=lambda e: -p.pairs[e])
    C = len(p.classes)
    replicas = [[0] * len(p.pairs) for _ in range(C)]
    share = [[0.0] * len(p.pairs) for _ in range(C)]
    for rank, e in enumerate(order):
        e_ref = ref_order[rank]
        for c in range(C):
            replicas[c][e] = reference.replicas[c][e_ref]
            share[c][e] = reference.share[c][e_ref]
    return LayerSolution(
        p.layer,
        tuple(tuple(r) for r in replicas),
        tuple(tuple(r) for r in share),
        -math.inf,
        math.inf,
        "mapped",
        reference.solver,
    )


def _keeps_previous(p: LayerProblem) -> bool:
    """The previous plan's counts still fit this layer (they are its warm start) and cover
    every expert."""
    if p.prev is None or p.warm != p.prev:
        return False
    return all(any(row[e] for row in p.prev) for e in range(len(p.pairs)))


def _previous_solution(p: LayerProblem) -> LayerSolution:
    """Layer ``p`` as the previous plan placed it (its replicas per class, each replica an
    equal share of its expert): what re-planning keeps for a layer it does not solve."""
    assert p.prev is not None
    C, E = len(p.classes), len(p.pairs)
    totals = [sum(p.prev[c][e] for c in range(C)) for e in range(E)]
    share = [[p.prev[c][e] / totals[e] if totals[e] else 0.0 for e in range(E)] for c in range(C)]
    return LayerSolution(
        p.layer,
        tuple(tuple(r) for r in p.prev),
        tuple(tuple(r) for r in share),
        -math.inf,
        math.inf,
        "previous",
        "none",
    )


SECONDS_PER_NODE_PER_NONZERO = 0.7e-6
"""Planned branch-and-bound time per node and constraint-matrix nonzero, seconds (a
reference rate, measured on a 2-core x86 machine with HiGHS 1.16)."""

SECONDS_PER_NONZERO_COLD = 100e-6
"""Planned solve time of the first (cold) layer per constraint-matrix nonzero, seconds: a
reference rate (a 2-core x86 machine, HiGHS 1.16: 45-165 us measured), not a clock."""

SECONDS_PER_NONZERO_WARM = 10e-6
"""Planned solve time of a layer warm-started from the first, per nonzero (5-12 us measured
on the same machine)."""


def solve_layers(
    problems: Sequence[LayerProblem],
    workers: int,
    first_weight: float = 1.0,
    budget_s: float = math.inf,
) -> list[LayerSolution] | Infeasible:
    """Solve one layer (with ``first_weight`` times the per-layer work, since every other
    layer starts from its answer), warm-start the others from it by load rank, and solve
    them, ``workers`` processes at a time.

    ``budget_s`` is the planned work in reference seconds: from the first layer's size and
    the rates above, as many further layers as fit are solved, spread evenly; the others take
    the first layer's answer mapped by load rank (status ``mapped``). Each layer's answer
    depends on its problem and this plan alone - never on the worker count, the clock or
    the order the workers finish in. The first :class:`Infeasible`, if any layer has one."""
    if not problems:
        return []
    p0 = problems[0]
    first = solve_layer(
        replace(
            p0,
            work_s=p0.work_s * first_weight,
            wall_s=p0.wall_s * first_weight,
        )
    )
    if isinstance(first, Infeasible):
        return first
    rest = list(problems[1:])
    if first.replicas and p0.prev is None:
        rest = [_rank_mapped(first, p0.pairs, p) for p in rest]
    chosen = _planned(len(rest), first, budget_s)
    # A layer without a MILP of its own keeps the previous plan's counts when re-planning
    # (no moves for it), else takes the first layer's answer by load rank.
    mapped = {
        k: _previous_solution(rest[k])
        if _keeps_previous(rest[k])
        else _mapped_solution(first, p0.pairs, rest[k])
        for k in range(len(rest))
        if k not in chosen and (first.replicas or _keeps_previous(rest[k]))
    }
    todo = [p for k, p in enumerate(rest) if k not in mapped]
    solved_rest: list[LayerSolution | Infeasible]
    if workers > 1 and len(todo) > 1:
        # fork is cheap and safe while this process runs no other thread; a threaded host
        # (the gRPC controller) gets spawn, which needs its main module import-guarded.
        method = "fork" if threading.active_count() == 1 and os.name == "posix" else "spawn"
        ctx = multiprocessing.get_context(method)
        with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=ctx) as pool:
            solved_rest = list(pool.map(solve_layer, todo, chunksize=1))
    else:
        solved_rest = [solve_layer(p) for p in todo]
    by_layer = {sol.layer: sol for sol in mapped.values()}
    for sol in solved_rest:
        if isinstance(sol, Infeasible):
            return sol
        by_layer[sol.layer] = sol
    return [first, *(by_layer[p.layer] for p in rest)]


def _planned(count: int, first: LayerSolution, budget_s: float) -> set[int]:
    """Indices of the further layers the budget pays a solve for, spread evenly."""
    if not math.isfinite(budget_s) or not first.replicas:
        return set(range(count))
    cold = SECONDS_PER_NONZERO_COLD * first.nonzeros
    warm = max(1e-9, SECONDS_PER_NONZERO_WARM * first.nonzeros)
    fits = max(0, math.floor((budget_s - cold) / warm))
    if fits >= count:
        return set(range(count))
    return {k for k in range(count) if (k * fits) // count != ((k + 1) * fits) // count}
