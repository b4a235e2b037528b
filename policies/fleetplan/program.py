"""The fleet planner's integer program: columns and constraints (1)-(5) of
:mod:`policies.fleetplan.planner` (its docstring holds the formulation), solved
lexicographically by priority and then for least cost (HiGHS through
:class:`policies.solvers.milp.Model`: one thread, fixed seed, a node limit).

Units: requests per second, USD per hour. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.fleetplan.candidates import Candidates
from policies.fleetplan.types import PlanRequest, Variant
from policies.solvers.milp import Limits, Model


@dataclass
class _Program:
    """The integer program's columns (indices into ``model``)."""

    model: Model
    x: dict[tuple[str, str], int]  # (deployment, aggregated variant key) -> instances
    y: dict[tuple[str, str], int]  # (deployment, pair key) -> prefill instances
    z: dict[tuple[str, str], int]  # (deployment, pair key) -> decode instances
    served: dict[str, int]  # deployment -> requests/s served
    cost: list[tuple[int, float]]  # instance column -> USD per hour


Counts = dict[tuple[str, str, str], int]
"""``(deployment, kind, key) -> instances``; kind ``agg`` (variant key), ``pre`` or ``dec``
(pair key)."""


def _build(req: PlanRequest, c: Candidates) -> _Program:
    """Columns and constraints (1)-(5) of the formulation (:mod:`policies.fleetplan.planner`)."""
    m = Model("fleet_plan")
    x: dict[tuple[str, str], int] = {}
    y: dict[tuple[str, str], int] = {}
    z: dict[tuple[str, str], int] = {}
    served: dict[str, int] = {}
    sizes = [len(g.nodes) for g in c.groups]
    use: list[list[tuple[int, float]]] = [[] for _ in c.groups]
    cost: list[tuple[int, float]] = []

    def ub(vec: Sequence[int]) -> int:
        return min(sizes[t] // k for t, k in enumerate(vec) if k)

    for d in req.deployments:
        placed: list[tuple[int, Variant]] = []
        rates: list[tuple[int, float]] = []
        for v in c.aggregated[d.name]:
            xv = m.var(0, ub(v.counts), integer=True)
            rv = m.var(0)
            m.le([(rv, 1.0), (xv, -v.sizing.requests_per_s)], 0.0)  # (1)
            x[d.name, v.key] = xv
            placed.append((xv, v))
            rates.append((rv, 1.0))
        for k in c.pairs[d.name]:
            yk = m.var(0, ub(k.prefill.counts), integer=True)
            zk = m.var(0, ub(k.decode.counts), integer=True)
            fk = m.var(0)
            m.le([(fk, 1.0), (yk, -k.prefill.sizing.requests_per_s)], 0.0)  # (1)
            m.le([(fk, 1.0), (zk, -k.decode.sizing.requests_per_s)], 0.0)  # (1)
            y[d.name, k.key], z[d.name, k.key] = yk, zk
            placed += [(yk, k.prefill), (zk, k.decode)]
            rates.append((fk, 1.0))
        sd = m.var(0, d.traffic.requests_per_s)  # (2)
        m.eq([(sd, 1.0), *((r, -1.0) for r, _ in rates)], 0.0)  # (2)
        served[d.name] = sd
        mine: list[list[tuple[int, float]]] = [[] for _ in c.groups]
        for col, v in placed:
            for t, cnt in enumerate(v.counts):
                if cnt:
                    mine[t].append((col, float(cnt)))
                    use[t].append((col, float(cnt)))
            cost.append((col, v.usd_per_hour))
        for t, terms in enumerate(mine):  # (4)
            if terms and c.eligible[d.name][t] < sizes[t]:
                m.le(terms, c.eligible[d.name][t])
        if d.budget_usd_per_hour > 0 and placed:  # (5)
            m.le([(col, v.usd_per_hour) for col, v in placed], d.budget_usd_per_hour)
        if d.budget_gpus > 0 and placed:  # (5)
            m.le([(col, float(v.gpus)) for col, v in placed], d.budget_gpus)
    for t, terms in enumerate(use):  # (3)
        if terms:
            m.le(terms, sizes[t])
    return _Program(m, x, y, z, served, cost)


def _previous_counts(req: PlanRequest) -> Counts:
    out: Counts = {}
    prev = req.previous
    if prev is None:
        return out
    for name, dp in prev.deployments.items():
        for p in dp.pools:
            if p.instances is not None:
                out[name, "agg", p.instances.variant.key] = p.instances.count
            elif p.prefill is not None and p.decode is not None:
                key = f"{p.prefill.variant.key}+{p.decode.variant.key}"
                out[name, "pre", key] = p.prefill.count
                out[name, "dec", key] = p.decode.count
    return out


def solve(req: PlanRequest, c: Candidates) -> tuple[Counts, str]:
    """Instance counts by the lexicographic integer programs (the formulation in
    :mod:`policies.fleetplan.planner`); each solve
    starts from the previous one's answer (which stays feasible), so a work-limited solve
    never ends without one."""
    p = _build(req, c)
    m = p.model
    status = "HiGHS optimal"
    values: tuple[float, ...] = ()
    ints = [col for col, _ in p.cost]

    def run(gap: float) -> None:
        nonlocal status, values
        if values:
            for col in ints:
                m.set_start(col, round(values[col]))
        limits = Limits(max_nodes=req.settings.max_solver_nodes, mip_gap=gap)
        out = m.solve(solver="highs", limits=limits)
        if out.values:
            values = out.values
        if out.status != "optimal":
            status = f"{out.solver} {out.status}"

    for level in sorted({d.priority for d in req.deployments}, reverse=True):
        at = [d for d in req.deployments if d.priority == level]
        share = [(p.served[d.name], 1.0 / d.traffic.requests_per_s) for d in at]
        m.minimise([(col, -w) for col, w in share])
        run(req.settings.mip_gap)
        reached = sum(values[col] * w for col, w in share) if values else 0.0
        m.ge(share, reached - 1e-6 * max(1.0, len(at)))
    prev = _previous_counts(req)
    w = req.settings.move_weight
    terms = list(p.cost)
    if prev and w > 0:
        cols: list[tuple[tuple[str, str, str], int, float]] = []
        for d in req.deployments:
            for v in c.aggregated[d.name]:
                cols.append(((d.name, "agg", v.key), p.x[d.name, v.key], v.usd_per_hour))
            for k in c.pairs[d.name]:
                cols.append(((d.name, "pre", k.key), p.y[d.name, k.key], k.prefill.usd_per_hour))
                cols.append(((d.name, "dec", k.key), p.z[d.name, k.key], k.decode.usd_per_hour))
        for ident, col, usd in cols:
            before = prev.get(ident, 0)
            dev = m.var(0)
            m.ge([(dev, 1.0), (col, -1.0)], -before)
            m.ge([(dev, 1.0), (col, 1.0)], before)
            terms.append((dev, w * usd))
            if values:
                values = (*values, abs(round(values[col]) - before))
    m.minimise(terms)
    run(req.settings.cost_gap)
    counts: Counts = {}

    def count(col: int) -> int:
        return round(values[col]) if values else 0

    for (name, key), col in p.x.items():
        counts[name, "agg", key] = count(col)
    for (name, key), col in p.y.items():
        counts[name, "pre", key] = count(col)
    for (name, key), col in p.z.items():
        counts[name, "dec", key] = count(col)
    return counts, status
