"""The fleet assignment as an integer program (PuLP, solved by HiGHS).

Sets: deployments ``d``, node groups ``t`` (nodes of one make-up), nodes ``n`` (``n in t``),
candidate instances ``c`` of ``d`` (``k_ct`` nodes of group ``t``, ``g_c`` GPUs, value
``v_dc`` from :func:`policies.scheduling.scoring.candidate_values`).

Variables::

    z_dc in {0..I_d}   instances of candidate c run for d        (I_d = max_instances)
    x_dn in {0, 1}     node n serves d (only for n eligible for d)
    p_d  in {0, 1}     d is placed

Maximise (the score of :mod:`policies.scheduling.scoring`)::

    sum_d P_d p_d + (sum_dc v_dc z_dc - mu * vbar * moves) / V
    (P_d: priority weight, lexicographic by priority, then running above new at one
    priority - only a strictly higher priority preempts; scoring.priority_weights)
    moves = sum_{d held before} [ sum_{n in prev_d} (1 - x_dn) + g * sum_{n not in prev_d} x_dn ]
    (g = GROW_WEIGHT: growing onto a node disturbs less than giving one up)

Subject to::

    (1) p_d <= sum_c z_dc <= I_d p_d                      placed iff it runs an instance
    (2) sum_{n in t} x_dn = sum_c k_ct z_dc               its nodes are its instances' nodes
    (3) sum_d f_d x_dn <= 1                               exclusive GPUs (f_d = memory
                                                          fraction, 1 unless shared)
    (4) min_d p_d <= sum_n G_n x_dn <= max_d              min / max GPUs
    (5) sum_{d in ns} f_d sum_n G_n x_dn <= Q_ns          namespace quotas, GPUs
    (6) x_dn absent for n not eligible for d              node selector, usable nodes

A candidate that cannot run (memory, engine group rules) or is larger than ``max_gpus`` has
no ``z``. The solve is warm-started from first fit and deterministic (one thread, fixed seed,
a node limit; the wall-clock limit is only a safety net); when it returns nothing better than
first fit, first fit is kept.

Pure: no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import pulp

from policies.scheduling.baselines import first_fit_choice
from policies.scheduling.scoring import (
    GROW_WEIGHT,
    Choice,
    build_schedule,
    candidate_values,
    priority_weights,
    scales,
    score,
)
from policies.scheduling.types import Schedule, ScheduleRequest
from policies.solvers.milp import Limits, solve_milp


def solve_schedule(
    req: ScheduleRequest, *, exclude: Mapping[str, frozenset[str]] | None = None
) -> Schedule:
    """The fleet assignment of ``req`` (see the module docstring).

    Args:
        req: groups, demands, candidates, previous assignment, quotas, limits.
        exclude: deployment -> a node set it must not get exactly (the next-best answer
            :func:`policies.scheduling.explain.explain` reports).
    """
    t0 = time.perf_counter()
    warm = first_fit_choice(req)
    prob, z, x = _model(req, exclude or {})
    _warm_start(req, warm, z, x)
    out = solve_milp(
        prob,
        solver="highs",
        limits=Limits(max_nodes=req.max_nodes, mip_gap=1e-9, wall_s=req.time_limit_s),
        warm=True,
    )
    elapsed = time.perf_counter() - t0
    choice = _read(req, z, x) if out.status not in ("infeasible",) else None
    warm_ok = not exclude or all(
        frozenset(n for _, ns in warm.get(d, ()) for n in ns) != s for d, s in exclude.items()
    )
    if choice is None or (warm_ok and score(req, warm) > score(req, choice) + 1e-12):
        return build_schedule(req, warm, solver="first-fit", solve_s=elapsed)
    return build_schedule(req, choice, solver=f"{out.solver} {out.status}", solve_s=elapsed)


_Vars = dict[tuple[str, int], pulp.LpVariable]
_XVars = dict[tuple[str, str], pulp.LpVariable]


def _model(
    req: ScheduleRequest, exclude: Mapping[str, frozenset[str]]
) -> tuple[pulp.LpProblem, _Vars, _XVars]:
    """Build the program of the module docstring (a minimisation of the negated score)."""
    prob = pulp.LpProblem("fleet_schedule", pulp.LpMinimize)
    weights = priority_weights(req)
    vbar, bound = scales(req)
    gpus_of = {n: g.gpus_per_node for g in req.groups for n in g.nodes}
    names = {d.name for d in req.demands}
    z: _Vars = {}
    x: _XVars = {}
    p: dict[str, pulp.LpVariable] = {}
    gain: list[tuple[pulp.LpVariable, float]] = []
    move_terms: list[tuple[pulp.LpVariable, float]] = []
    move_const = 0.0
    for di, d in enumerate(req.demands):
        cands = req.candidates.get(d.name, ())
        vals = candidate_values(d, cands)
        p[d.name] = pulp.LpVariable(f"p_{di}", cat="Binary")
        gain.append((p[d.name], weights[d.name]))
        for ci, (c, v) in enumerate(zip(cands, vals, strict=True)):
            if v is None or (d.max_gpus and c.gpus > d.max_gpus):
                continue
            z[d.name, ci] = pulp.LpVariable(f"z_{di}_{ci}", 0, d.max_instances, cat="Integer")
            gain.append((z[d.name, ci], v / bound))
        for ni, n in enumerate(n for g in req.groups for n in g.nodes):
            if n in d.eligible:  # (6)
                x[d.name, n] = pulp.LpVariable(f"x_{di}_{ni}", cat="Binary")
        zs = [z[k] for k in z if k[0] == d.name]
        xs = {n: v for (dn, n), v in x.items() if dn == d.name}
        prob += pulp.lpSum(zs) >= p[d.name]  # (1)
        prob += pulp.lpSum(zs) <= d.max_instances * p[d.name]  # (1)
        for ti, g in enumerate(req.groups):  # (2)
            prob += pulp.lpSum(xs[n] for n in g.nodes if n in xs) == pulp.lpSum(
                cands[ci].counts[ti] * var for (dn, ci), var in z.items() if dn == d.name
            )
        held = pulp.lpSum(gpus_of[n] * v for n, v in xs.items())
        if d.min_gpus:  # (4)
            prob += held >= d.min_gpus * p[d.name]
        if d.max_gpus:  # (4)
            prob += held <= d.max_gpus
        before = req.previous.get(d.name, frozenset())
        if before and d.name in names:  # moves
            for n in before:
                move_const += 1.0
                if n in xs:
                    move_terms.append((xs[n], -1.0))
            move_terms.extend((v, GROW_WEIGHT) for n, v in xs.items() if n not in before)
        if d.name in exclude and xs:
            chosen = exclude[d.name]
            prob += (
                pulp.lpSum(v for n, v in xs.items() if n in chosen)
                - pulp.lpSum(v for n, v in xs.items() if n not in chosen)
                <= len(chosen & set(xs)) - 1
            )
    frac = {d.name: d.memory_fraction for d in req.demands}
    for n in gpus_of:  # (3)
        on = [(dn, v) for (dn, nn), v in x.items() if nn == n]
        if len(on) > 1:
            prob += pulp.lpSum(frac[dn] * v for dn, v in on) <= 1
    for ns, quota in req.quotas_gpus.items():  # (5)
        prob += (
            pulp.lpSum(
                frac[dn] * gpus_of[n] * v
                for (dn, n), v in x.items()
                if next(d for d in req.demands if d.name == dn).namespace == ns
            )
            <= quota
        )
    mu = req.move_weight * vbar / bound
    prob += -pulp.lpSum(c * v for v, c in gain) + mu * (
        pulp.lpSum(c * v for v, c in move_terms) + move_const
    )
    return prob, z, x


def _warm_start(req: ScheduleRequest, warm: Choice, z: _Vars, x: _XVars) -> None:
    """Give the solver first fit as its starting incumbent."""
    for v in (*z.values(), *x.values()):
        v.setInitialValue(0)
    for d, inst in warm.items():
        for ci, nodes in inst:
            if (d, ci) in z:
                z[d, ci].setInitialValue((z[d, ci].varValue or 0) + 1)
            for n in nodes:
                if (d, n) in x:
                    x[d, n].setInitialValue(1)


def _read(req: ScheduleRequest, z: _Vars, x: _XVars) -> Choice | None:
    """The incumbent as a choice: each group's chosen nodes dealt to the instances in
    candidate order. None when the solver left no incumbent."""
    if any(v.varValue is None for v in z.values()):
        return None
    choice: dict[str, tuple[tuple[int, tuple[str, ...]], ...]] = {}
    for d in req.demands:
        pools = [
            [n for n in g.nodes if (d.name, n) in x and (x[d.name, n].varValue or 0) > 0.5]
            for g in req.groups
        ]
        inst: list[tuple[int, tuple[str, ...]]] = []
        for (dn, ci), var in sorted(z.items()):
            if dn != d.name:
                continue
            for _ in range(round(var.varValue or 0)):
                counts = req.candidates[dn][ci].counts
                nodes = _deal(pools, counts)
                if nodes is None:
                    return None
                inst.append((ci, nodes))
        if inst:
            choice[d.name] = tuple(inst)
    return choice


def _deal(pools: list[list[str]], counts: Sequence[int]) -> tuple[str, ...] | None:
    """Take ``counts[t]`` nodes off each group's pool (None when a pool runs short)."""
    out: list[str] = []
    for pool, k in zip(pools, counts, strict=True):
        if len(pool) < k:
            return None
        out.extend(pool[:k])
        del pool[:k]
    return tuple(out)
