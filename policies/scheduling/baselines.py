"""The two baselines the integer program is measured against.

* :func:`first_fit`: deployments in priority order (within a priority running ones first,
  so a newcomer never takes a node from a running deployment of its priority; then name);
  each takes the largest candidate instance that fits on the free nodes it may use, within its quota and GPU
  bounds, keeping the nodes it held before where it can. Exclusive, one instance each, no
  look-ahead. It is also the integer program's warm start.
* :func:`every_on_every`: what mixfleet did before the scheduler: every deployment on every
  node it may use, as if it owned them (GPUs over-committed; :func:`overcommit` says by how
  much).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from policies.scheduling.scoring import (
    Choice,
    build_schedule,
    candidate_values,
    priority_level,
)
from policies.scheduling.types import Demand, Schedule, ScheduleRequest


def first_fit(req: ScheduleRequest) -> Schedule:
    """The first-fit schedule (see the module docstring)."""
    return build_schedule(req, first_fit_choice(req), solver="first-fit")


def first_fit_choice(req: ScheduleRequest) -> Choice:
    """First fit as a choice (the integer program's warm start)."""
    load: dict[str, float] = {n: 0.0 for g in req.groups for n in g.nodes}
    gpus_of = {n: g.gpus_per_node for g in req.groups for n in g.nodes}
    used_quota: dict[str, float] = {}
    choice: dict[str, tuple[tuple[int, tuple[str, ...]], ...]] = {}
    for d in sorted(req.demands, key=lambda d: (*priority_level(req, d), d.name)):
        cands = req.candidates.get(d.name, ())
        vals = candidate_values(d, cands)
        order = sorted(
            (i for i, v in enumerate(vals) if v is not None),
            key=lambda i: (-cands[i].gpus, -(vals[i] or 0.0), i),
        )
        before = req.previous.get(d.name, frozenset())
        for ci in order:
            c = cands[ci]
            if (d.max_gpus and c.gpus > d.max_gpus) or c.gpus < d.min_gpus:
                continue
            quota = req.quotas_gpus.get(d.namespace)
            if (
                quota is not None
                and used_quota.get(d.namespace, 0.0) + c.gpus * d.memory_fraction > quota + 1e-9
            ):
                continue
            nodes = _pick(req, d, c.counts, load, before)
            if nodes is None:
                continue
            for n in nodes:
                load[n] += d.memory_fraction
            used_quota[d.namespace] = (
                used_quota.get(d.namespace, 0.0)
                + sum(gpus_of[n] for n in nodes) * d.memory_fraction
            )
            choice[d.name] = ((ci, nodes),)
            break
    return choice


def _pick(
    req: ScheduleRequest,
    d: Demand,
    counts: tuple[int, ...],
    load: Mapping[str, float],
    before: frozenset[str],
) -> tuple[str, ...] | None:
    """``counts[t]`` free eligible nodes of each group, previously held ones first."""
    out: list[str] = []
    for g, k in zip(req.groups, counts, strict=True):
        free = [n for n in g.nodes if n in d.eligible and load[n] + d.memory_fraction <= 1 + 1e-9]
        free.sort(key=lambda n: n not in before)
        if len(free) < k:
            return None
        out.extend(free[:k])
    return tuple(out)


def every_on_every(req: ScheduleRequest) -> Schedule:
    """Every deployment on all the nodes it may use (its candidate holding every eligible
    node; pending when that candidate cannot run). GPUs are over-committed."""
    choice: dict[str, tuple[tuple[int, tuple[str, ...]], ...]] = {}
    for d in req.demands:
        want = tuple(sum(1 for n in g.nodes if n in d.eligible) for g in req.groups)
        cands = req.candidates.get(d.name, ())
        for ci, c in enumerate(cands):
            if c.counts == want and c.ok:
                nodes = tuple(n for g in req.groups for n in g.nodes if n in d.eligible)
                choice[d.name] = ((ci, nodes),)
                break
    return build_schedule(req, choice, solver="every-on-every")


def overcommit(req: ScheduleRequest, schedule: Schedule) -> Mapping[str, float]:
    """Node -> memory fractions its holders claim together (above 1: over-committed)."""
    frac = {d.name: d.memory_fraction for d in req.demands}
    out: dict[str, float] = {}
    for name, p in schedule.placements.items():
        for n in p.nodes:
            out[n] = out.get(n, 0.0) + frac[name]
    return out
