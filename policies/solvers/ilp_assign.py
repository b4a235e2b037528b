"""Stage 3 of the ``ilp`` policy: a class's replicas onto its GPUs.

Stage 3 - per class, GPUs: replicas go heaviest first to the least-loaded GPU of the
class with a free slot that does not hold that expert (preferring the GPU that held it
before, when re-planning), then pairwise swaps reduce the most-loaded GPU. Native form
finally re-splits each expert's class share over its replicas with an LP that minimises
the class's most-loaded GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pulp

from policies.estimate.costmodel import CostTable
from policies.solvers.common import make_room
from policies.solvers.milp import solve_milp


@dataclass
class _Held:
    """A class's GPUs while replicas are assigned: per GPU the (expert, pairs) held, the
    experts held and the pairs served."""

    held: list[list[tuple[int, float]]]
    has: list[set[int]]
    load: list[float]

    def put(self, g: int, e: int, pairs: float) -> None:
        """Give GPU ``g`` a replica of expert ``e`` serving ``pairs``."""
        self.held[g].append((e, pairs))
        self.has[g].add(e)
        self.load[g] += pairs


def assign_class(
    members: Sequence[int],
    items: list[tuple[float, int]],
    slots: Sequence[int],
    prev_held: Sequence[set[int]],
    penalty: float,
    merge: bool,
) -> list[list[tuple[int, float]]]:
    """Place replicas (pairs, expert) on a class's GPUs: heaviest first onto the GPU with the
    lowest load plus re-planning penalty, then pairwise swaps to lower the maximum.

    When re-planning (``penalty > 0``), replicas first stay on GPUs that held their expert
    before, as far as the class keeps that many replicas, and no swap moves them: the moves
    are then exactly the new replicas the MILP priced.

    Returns per member GPU a list of (expert, pairs)."""
    n = len(members)
    st = _Held([[] for _ in range(n)], [set() for _ in range(n)], [0.0] * n)
    todo = sorted(items, key=lambda x: (-x[0], x[1]))
    if penalty > 0:
        todo = _keep_previous(st, todo, slots, prev_held)
    for pairs, e in todo:
        _place_one(st, pairs, e, slots, prev_held, penalty, merge)
    _swap_down(st, slots, prev_held, penalty)
    return st.held


def _keep_previous(
    st: _Held, todo: list[tuple[float, int]], slots: Sequence[int], prev_held: Sequence[set[int]]
) -> list[tuple[float, int]]:
    """Re-planning: pin replicas on GPUs that held their expert before; returns the rest."""
    n = len(st.held)
    rest = []
    for pairs, e in todo:
        keep = [
            g
            for g in range(n)
            if e in prev_held[g] and e not in st.has[g] and len(st.held[g]) < slots[g]
        ]
        if keep:
            g = min(keep, key=lambda x: st.load[x])
            st.put(g, e, pairs)
        else:
            rest.append((pairs, e))
    return rest


def _place_one(
    st: _Held,
    pairs: float,
    e: int,
    slots: Sequence[int],
    prev_held: Sequence[set[int]],
    penalty: float,
    merge: bool,
) -> None:
    """One replica onto the GPU with the lowest load plus re-planning penalty."""
    n = len(st.held)
    held, has, load = st.held, st.has, st.load
    best, best_cost = -1, math.inf
    for g in range(n):
        if len(held[g]) >= slots[g] or e in has[g]:
            continue
        cost = load[g] + pairs + (0.0 if e in prev_held[g] else penalty)
        if cost < best_cost - 1e-12:
            best, best_cost = g, cost
    if best < 0:  # every GPU with room already holds e
        holders = [g for g in range(n) if e in has[g]]
        if merge and holders:  # native form: one replica per GPU takes the extra pairs
            g = min(holders, key=lambda x: load[x])
            held[g] = [(ee, pp + pairs if ee == e else pp) for ee, pp in held[g]]
            load[g] += pairs
            return
        best = make_room(held, has, load, slots, e)
        if best < 0:  # cannot happen with a feasible class solution; keep it visible
            best = max(range(n), key=lambda g: slots[g] - len(held[g]))
    st.put(best, e, pairs)


def _swap_down(
    st: _Held, slots: Sequence[int], prev_held: Sequence[set[int]], penalty: float
) -> None:
    """Pairwise swaps between the most-loaded GPU and the others while one helps."""
    n = len(st.held)
    held, has, load = st.held, st.has, st.load
    for _ in range(4 * n * max(1, max(slots, default=1))):
        g_max = max(range(n), key=lambda g: load[g])
        improved = False
        for g in sorted(range(n), key=lambda g: load[g]):
            if g == g_max:
                continue
            best_swap = _best_swap(st, g_max, g, prev_held, penalty)
            if best_swap is not None:
                a_idx, b_idx = best_swap
                ea, pa = held[g_max][a_idx]
                eb, pb = held[g][b_idx]
                held[g_max][a_idx], held[g][b_idx] = (eb, pb), (ea, pa)
                has[g_max].discard(ea)
                has[g_max].add(eb)
                has[g].discard(eb)
                has[g].add(ea)
                load[g_max] += pb - pa
                load[g] += pa - pb
                improved = True
                break
        if not improved:
            break


def _best_swap(
    st: _Held, g_max: int, g: int, prev_held: Sequence[set[int]], penalty: float
) -> tuple[int, int] | None:
    """The swap of a replica on ``g_max`` with one on ``g`` that most lowers the maximum
    (net of re-planning price), as (index on g_max, index on g); None when none helps."""
    held, has, load = st.held, st.has, st.load
    gap = load[g_max] - load[g]
    best_swap: tuple[float, int, int] | None = None
    for a_idx, (ea, pa) in enumerate(held[g_max]):
        if ea in has[g]:
            continue
        for b_idx, (eb, pb) in enumerate(held[g]):
            delta = pa - pb
            if not 0 < delta < gap or eb in has[g_max]:
                continue
            # pairs off the busiest GPU, less the re-planning price of the replicas
            # this swap takes away from GPUs that held them before
            away = int(ea not in prev_held[g]) + int(eb not in prev_held[g_max])
            home = int(ea not in prev_held[g_max]) + int(eb not in prev_held[g])
            value = min(delta, gap - delta) - penalty * (away - home)
            if value > 1e-9 and (best_swap is None or value > best_swap[0]):
                best_swap = (value, a_idx, b_idx)
    return None if best_swap is None else (best_swap[1], best_swap[2])


def rebalance_native(
    table: CostTable,
    members: Sequence[int],
    held: list[list[tuple[int, float]]],
    comm_us_per_pair: float,
    solver: str,
) -> list[list[tuple[int, float]]]:
    """LP: re-split each expert's class pairs over its replicas in the class to minimise
    the most-loaded GPU's expert time plus its receive time (``comm_us_per_pair`` per pair
    served), so a class whose expert time sits on its weight-read floor still spreads
    traffic evenly."""
    by_expert: dict[int, list[int]] = {}
    for g, slots in enumerate(held):
        for e, _ in slots:
            by_expert.setdefault(e, []).append(g)
    if all(len(gs) == 1 for gs in by_expert.values()):
        return held
    prob = pulp.LpProblem("split", pulp.LpMinimize)
    tau = pulp.LpVariable("tau", 0)
    most = pulp.LpVariable("most_pairs", 0)
    x: dict[tuple[int, int], pulp.LpVariable] = {}
    class_pairs = {
        e: sum(pp for g2 in gs for ee, pp in held[g2] if ee == e) for e, gs in by_expert.items()
    }
    for e, gs in by_expert.items():
        for g in gs:
            x[e, g] = pulp.LpVariable(f"x{e}_{g}", 0)
        prob += pulp.lpSum(x[e, g] for g in gs) == class_pairs[e]
    for g, slots in enumerate(held):
        c = table.gpus[members[g]]
        P = pulp.lpSum(x[e, g] for e, _ in slots)
        prob += tau >= c.expert_flop_us_per_pair * P
        prob += tau >= c.expert_read_us_per_replica * len(slots) + c.expert_act_us_per_pair * P
        prob += most >= P
    prob += tau + comm_us_per_pair * most
    out = solve_milp(prob, solver=solver, time_limit_s=2, mip_gap=0, warm=False)
    if out.status != "optimal":
        return held
    return [[(e, float(x[e, g].varValue or 0.0)) for e, _ in slots] for g, slots in enumerate(held)]
