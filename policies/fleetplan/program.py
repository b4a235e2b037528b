"""The fleet planner's integer program: columns and constraints (1)-(5) of
:mod:`policies.fleetplan.planner` (its docstring holds the formulation), solved
lexicographically by priority and then for least cost (HiGHS through
:class:`policies.solvers.milp.Model`: one thread, fixed seed, a node limit).

Units: requests per second, USD per hour. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from policies.fleetplan.candidates import Candidates
from policies.fleetplan.types import FleetDeployment, PlanRequest, Variant
from policies.solvers.milp import Limits, Model


@dataclass
class _Program:
    """The integer program's columns (indices into ``model``)."""

    model: Model
    instances: dict[tuple[str, str, str], int]  # (deployment, kind, key) -> instance column
    nodes: dict[int, tuple[int, ...]]  # instance column -> nodes of each group per instance
    served: dict[str, int]  # deployment -> requests/s served
    cost_of: dict[str, list[tuple[int, float]]]  # deployment -> its instance columns' USD/h

    @property
    def cost(self) -> list[tuple[int, float]]:
        """Every instance column with its USD per hour."""
        return [t for terms in self.cost_of.values() for t in terms]


Counts = dict[tuple[str, str, str], int]
"""``(deployment, kind, key) -> instances``; kind ``agg`` (variant key), ``pre`` or ``dec``
(pair key)."""


def _build(req: PlanRequest, c: Candidates, room: Sequence[int] | None = None) -> _Program:
    """Columns and constraints (1)-(5) of the formulation (:mod:`policies.fleetplan.planner`);
    ``room``: nodes of each group the instances may use (all when None)."""
    m = Model("fleet_plan")
    inst: dict[tuple[str, str, str], int] = {}
    nodes: dict[int, tuple[int, ...]] = {}
    served: dict[str, int] = {}
    sizes = list(room) if room is not None else [len(g.nodes) for g in c.groups]
    use: list[list[tuple[int, float]]] = [[] for _ in c.groups]
    cost_of: dict[str, list[tuple[int, float]]] = {}

    def column(ident: tuple[str, str, str], v: Variant) -> int:
        col = m.var(0, min(sizes[t] // k for t, k in enumerate(v.counts) if k), integer=True)
        inst[ident], nodes[col] = col, v.counts
        return col

    for d in req.deployments:
        placed: list[tuple[int, Variant]] = []
        rates: list[tuple[int, float]] = []
        for v in c.aggregated[d.name]:
            xv = column((d.name, "agg", v.key), v)
            rv = m.var(0)
            m.le([(rv, 1.0), (xv, -v.sizing.requests_per_s)], 0.0)  # (1)
            placed.append((xv, v))
            rates.append((rv, 1.0))
        for k in c.pairs[d.name]:
            yk = column((d.name, "pre", k.key), k.prefill)
            zk = column((d.name, "dec", k.key), k.decode)
            fk = m.var(0)
            m.le([(fk, 1.0), (yk, -k.prefill.sizing.requests_per_s)], 0.0)  # (1)
            m.le([(fk, 1.0), (zk, -k.decode.sizing.requests_per_s)], 0.0)  # (1)
            placed += [(yk, k.prefill), (zk, k.decode)]
            rates.append((fk, 1.0))
        sd = m.var(0, d.traffic.requests_per_s)  # (2)
        m.eq([(sd, 1.0), *((r, -1.0) for r, _ in rates)], 0.0)  # (2)
        served[d.name] = sd
        cost_of[d.name] = [(col, v.usd_per_hour) for col, v in placed]
        mine: list[list[tuple[int, float]]] = [[] for _ in c.groups]
        for col, v in placed:
            for t, cnt in enumerate(v.counts):
                if cnt:
                    mine[t].append((col, float(cnt)))
                    use[t].append((col, float(cnt)))
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
    return _Program(m, inst, nodes, served, cost_of)


def _counts(p: _Program, values: Sequence[float]) -> Counts:
    """The instance counts of a solution's column values (all 0 without one)."""
    return {ident: round(values[col]) if values else 0 for ident, col in p.instances.items()}


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


@dataclass(frozen=True)
class _Alone:
    """One deployment's program alone: its cheapest instances that serve a share of its
    demand in the room given."""

    bound: float  # proven lower bound on their cost, USD per hour (0 when none)
    counts: Counts | None  # the best instances found (None when none)
    nodes: tuple[int, ...]  # nodes of each group they use


def _alone(
    req: PlanRequest, c: Candidates, d: FleetDeployment, share: float, room: Sequence[int]
) -> _Alone:
    """Solve ``d``'s program alone (its columns, constraints (1)-(5) over its own
    instances, ``room`` nodes per group) for least cost serving ``share`` of its demand."""
    sub = _build(replace(req, deployments=(d,), previous=None), c, room)
    sub.model.ge([(sub.served[d.name], 1.0)], share * d.traffic.requests_per_s)
    sub.model.minimise(sub.cost)
    limits = Limits(max_nodes=req.settings.max_solver_nodes, mip_gap=req.settings.mip_gap)
    out = sub.model.solve(solver="highs", limits=limits)
    bound = max(0.0, out.bound) if math.isfinite(out.bound) else 0.0
    if not out.values:
        return _Alone(bound, None, ())
    used = [0] * len(room)
    for col, per in sub.nodes.items():
        for t, k in enumerate(per):
            used[t] += k * round(out.values[col])
    return _Alone(bound, _counts(sub, out.values), tuple(used))


def _floors_and_start(
    req: PlanRequest, c: Candidates, floor_share: dict[str, float], start_share: dict[str, float]
) -> tuple[dict[str, float], Counts | None]:
    """Per deployment a proven lower bound on what its instances cost (USD per hour) in any
    plan that serves at least ``floor_share[d]`` of its demand, and a plan of the whole
    program that serves ``start_share[d]`` of each (None when none is found).

    The bound is that of ``d``'s program alone over the whole fleet: every plan of the whole
    program, restricted to ``d``'s columns, is a plan of that program, so the bound holds
    for it too, and the cost stage adds it as a row (a valid inequality). The LP relaxation
    alone prices each deployment's fractional instances, and over many deployments their
    sum leaves a gap the branch-and-bound does not close within its node limit. The start
    takes the deployments by priority, each its cheapest instances in the nodes the ones
    before left (its own from the bound's solve where they serve the share and fit): a plan
    whose cost is near the floors' sum, where the served-demand stages' answer costs what
    it happens to.
    """
    sizes = [len(g.nodes) for g in c.groups]
    room = list(sizes)
    floors: dict[str, float] = {}
    start: Counts | None = {}
    for d in sorted(req.deployments, key=lambda d: -d.priority):
        share = floor_share[d.name]  # <= 0: nothing to bound, no solve
        own = _alone(req, c, d, share, sizes) if share > 0 else _Alone(0.0, None, ())
        floors[d.name] = own.bound
        if start is None:
            continue
        reuse = floor_share[d.name] >= start_share[d.name] and own.counts is not None
        if not reuse or any(u > r for u, r in zip(own.nodes, room, strict=True)):
            own = _alone(req, c, d, start_share[d.name], room)
        if own.counts is None:
            start = None
            continue
        start.update(own.counts)
        room = [r - u for r, u in zip(room, own.nodes, strict=True)]
    return floors, start


def solve(req: PlanRequest, c: Candidates) -> tuple[Counts, str]:
    """Instance counts by the lexicographic integer programs (the formulation in
    :mod:`policies.fleetplan.planner`); each solve
    starts from the previous one's answer (which stays feasible), so a work-limited solve
    never ends without one. With more than one deployment the cost stage also gets each
    deployment's cost floor, and starts from the cheaper (by its own objective; the last
    stage's answer on a tie) of the last stage's answer and a plan built deployment by
    deployment (:func:`_floors_and_start`)."""
    p = _build(req, c)
    m = p.model
    status = "HiGHS optimal"
    values: tuple[float, ...] = ()

    def run(gap: float, start: Counts | None = None) -> None:
        nonlocal status, values
        given = start if start is not None else _counts(p, values) if values else None
        if given is not None:
            for ident, col in p.instances.items():
                m.set_start(col, given.get(ident, 0))
        limits = Limits(max_nodes=req.settings.max_solver_nodes, mip_gap=gap)
        out = m.solve(solver="highs", limits=limits)
        if out.values:
            values = out.values
        if out.status != "optimal":
            status = f"{out.solver} {out.status}"

    floor_share: dict[str, float] = {}
    for level in sorted({d.priority for d in req.deployments}, reverse=True):
        at = [d for d in req.deployments if d.priority == level]
        share = [(p.served[d.name], 1.0 / d.traffic.requests_per_s) for d in at]
        m.minimise([(col, -w) for col, w in share])
        run(req.settings.mip_gap)
        reached = sum(values[col] * w for col, w in share) if values else 0.0
        kept = reached - 1e-6 * max(1.0, len(at))
        m.ge(share, kept)
        for d in at:  # each share is at most 1, so d's is at least what the others leave
            floor_share[d.name] = kept - (len(at) - 1)
    level_size = Counter(d.priority for d in req.deployments)
    start_share = {  # what the last served-demand solve serves, less the rows' tolerance
        d.name: (min(1.0, values[p.served[d.name]] / d.traffic.requests_per_s) if values else 0.0)
        - 1e-6 * level_size[d.priority]
        for d in req.deployments
    }
    floors: dict[str, float] = {}
    start: Counts | None = None
    if len(req.deployments) > 1:  # one deployment's floor would be the cost stage itself
        floors, start = _floors_and_start(req, c, floor_share, start_share)
    for name, floor in floors.items():
        if floor > 0:
            m.ge(p.cost_of[name], floor - 1e-6 * max(1.0, floor))
    prev = _previous_counts(req)
    w = req.settings.move_weight if prev else 0.0
    terms = p.cost
    usd = dict(terms)

    def objective(counts: Counts) -> float:  # the cost stage's, USD per hour
        return sum(
            usd[col] * (counts.get(ident, 0) + w * abs(counts.get(ident, 0) - prev.get(ident, 0)))
            for ident, col in p.instances.items()
        )

    if w > 0:
        for ident, col in p.instances.items():
            before = prev.get(ident, 0)
            dev = m.var(0)
            m.ge([(dev, 1.0), (col, -1.0)], -before)
            m.ge([(dev, 1.0), (col, 1.0)], before)
            terms.append((dev, w * usd[col]))
    # The served-demand stages' answer first: where the two cost the same, it stands.
    starts = [s for s in (_counts(p, values) if values else None, start) if s is not None]
    m.minimise(terms)
    run(req.settings.cost_gap, min(starts, key=objective) if starts else None)
    return _counts(p, values), status
