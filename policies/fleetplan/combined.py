"""One fleet, two kinds of deployment, one order of priority.

Deployments that state their traffic and SLOs (:func:`~policies.fleetplan.instances.is_planned`)
are planned as engine instances by the fleet planner (:func:`policies.fleetplan.plan_fleet`);
the others get whole nodes from the fleet scheduler (:func:`policies.scheduling.schedule`).
``mixfleetctl schedule show --fleet``, the standalone controller and the Kubernetes operator
all decide a fleet through :func:`plan_and_schedule`.

**Priority decides the order, whatever the kind**, with the fleet scheduler's rules: a
higher priority comes first and may take the nodes of a lower one; an equal priority never
takes a running deployment's nodes. :func:`plan_and_schedule` walks the priority levels from
high to low; at each level the planned deployments of that level are planned on the nodes
the levels above left, then the unplanned ones of that level are scheduled on what is
still free. Consecutive steps of one kind are one call (:func:`steps`): both solvers
already order by priority inside a call - the planner level by level (each level's served
share of demand kept before the next), the scheduler by its priority weights
(:func:`policies.scheduling.scoring.priority_weights`) - so a fleet of one kind, or one whose
planned deployments all rank at or above its unplanned ones, is decided by exactly the
calls it was before (the planner once, then the scheduler once on what the plan leaves).

* **Equal priority.** At one level the planned deployments go first, but not onto the nodes
  an unplanned deployment of the same priority holds now (its ``previous`` nodes in
  :class:`ScheduleOptions`): only a strictly higher priority preempts. A running planned
  deployment's nodes are safe from an unplanned one of its level because the plan is made
  first. Between two new deployments of one level the planned one is served first.
* **Planning after a scheduler step.** When an unplanned level ranks above a planned one,
  the scheduler is solved for the unplanned deployments of the levels above (on the nodes
  still free) and the nodes it gives them are kept from the planned ones below.
* **One schedule.** The assignment of the unplanned deployments is then made by ONE
  scheduler call over all of them on the nodes no planned instance uses (so
  :func:`policies.scheduling.explain.explain` and the decisions against ``previous`` see one
  request): the nodes a scheduler step took stay eligible for its deployments only (a lower
  unplanned level never gets nodes a planned level between was denied), the other nodes
  are the scheduler's to share by its own priorities. When the last step is the only
  scheduler step (the usual case) that call is the step itself.
* **One plan.** The plans of the planner steps are merged into one :class:`FleetPlan`
  (:func:`merge_plans`): deployments and shortfalls of every step, ``free_nodes`` the fleet's
  nodes no planned instance uses, curve counts and solve times summed. A planned
  deployment short because an unplanned deployment of a higher (or running at its own)
  priority holds nodes it may use has those holders named in its shortfall.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace

from policies.errors import InputError
from policies.fleetplan.curves import CurveCache
from policies.fleetplan.instances import is_planned
from policies.fleetplan.planner import plan_fleet
from policies.fleetplan.types import (
    FleetDeployment,
    FleetPlan,
    PlannerSettings,
    PlanRequest,
    Shortfall,
)
from policies.hardware.fleet import Fleet
from policies.scheduling import schedule
from policies.scheduling.table import EstimateCache, TableSettings
from policies.scheduling.types import Schedule, ScheduleRequest
from policies.spec.build import DeploymentSpec


@dataclass(frozen=True)
class Step:
    """One call of :func:`plan_and_schedule`'s walk down the priority levels.

    Attributes:
        kind: ``plan`` (the fleet planner) or ``schedule`` (the fleet scheduler).
        priorities: the priority levels it covers, highest first.
        deployments: the deployments it decides, in the caller's order.
        nodes: the nodes it took (planned instances' nodes; for a scheduler step the nodes
            kept from the planner steps below it), fleet order; empty for the final
            scheduler call, whose nodes are in :attr:`FleetDecision.schedule`.
    """

    kind: str
    priorities: tuple[int, ...]
    deployments: tuple[str, ...]
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class FleetDecision:
    """What :func:`plan_and_schedule` decided.

    Attributes:
        plan: the fleet planner's plan of the planned deployments, every planner step merged
            (None when there is none).
        request: the fleet scheduler's request of the others (None when there is none).
        schedule: the fleet scheduler's assignment of the others (None with ``request``).
        steps: the walk down the priority levels that produced them, in order.
    """

    plan: FleetPlan | None = None
    request: ScheduleRequest | None = None
    schedule: Schedule | None = None
    steps: tuple[Step, ...] = ()


@dataclass(frozen=True)
class ScheduleOptions:
    """How the fleet scheduler part runs (the arguments of :func:`policies.scheduling.schedule`).

    Attributes:
        previous: deployment -> nodes it holds now (moves are penalised).
        quotas_gpus: namespace -> most GPUs its deployments may hold, GPUs.
        settings: how candidates are estimated.
        cache: estimates kept between calls.
    """

    previous: Mapping[str, frozenset[str]] | None = None
    quotas_gpus: Mapping[str, int] | None = None
    settings: TableSettings | None = None
    cache: EstimateCache | None = None


@dataclass(frozen=True)
class PlanOptions:
    """How the fleet planner part runs.

    Attributes:
        previous: the plan running now (instance changes are penalised), or None.
        settings: how the planner enumerates and solves.
        cache: step curves kept between calls (in memory when None).
    """

    previous: FleetPlan | None = None
    settings: PlannerSettings = field(default_factory=PlannerSettings)
    cache: CurveCache | None = None


Specs = Sequence[tuple[DeploymentSpec, Collection[str]]]


def steps(specs: Specs) -> list[tuple[str, list[int]]]:
    """The walk of the module docstring: ``(kind, indexes into specs)`` in order. Priority
    levels from high to low, at each level its planned deployments, then its unplanned
    ones; a step of the kind of the one before it joins that one."""
    out: list[tuple[str, list[int]]] = []
    for level in sorted({s.priority for s, _ in specs}, reverse=True):
        for kind in ("plan", "schedule"):
            mine = [
                i
                for i, (s, _) in enumerate(specs)
                if s.priority == level and is_planned(s) == (kind == "plan")
            ]
            if not mine:
                continue
            if out and out[-1][0] == kind:
                out[-1][1].extend(mine)
            else:
                out.append((kind, mine))
    return out


def plan_and_schedule(
    fleet: Fleet,
    specs: Specs,
    *,
    planning: PlanOptions | None = None,
    scheduling: ScheduleOptions | None = None,
    pool: Executor | None = None,
) -> FleetDecision:
    """Decide ``fleet`` for ``specs`` by priority: the deployments that state traffic and
    SLOs (:func:`~policies.fleetplan.instances.is_planned`) through the fleet planner, the
    others through the fleet scheduler, walking the priority levels from high to low (see
    the module docstring).

    Args:
        fleet: the usable nodes (healthy GPUs only).
        specs: each deployment with the node names it may use (usable, matching its node
            selector); a planned deployment's ``traffic`` is the demand it is planned for.
            Names are unique.
        planning: the planner's previous plan, settings and curve cache.
        scheduling: the scheduler's previous assignment (also what makes an unplanned
            deployment running, so that a planned one of its priority leaves its nodes),
            quotas, settings and cache.
        pool: the caller's executor for curves and estimates not cached (the answer is the
            same without it).

    Raises:
        InputError: an invalid deployment (the field is named), or a name given twice.
    """
    po = planning or PlanOptions()
    so = scheduling or ScheduleOptions()
    if so.cache is None:  # the scheduler steps share their estimates
        so = replace(so, cache=EstimateCache())
    _check_names(specs)
    previous = so.previous or {}
    walk = steps(specs)
    taken: dict[str, str] = {}  # node -> the unplanned deployment a scheduler step gave it
    step_of: dict[str, int] = {}  # unplanned deployment -> its scheduler step
    planned_nodes: set[str] = set()
    plans: list[FleetPlan] = []
    done: list[Step] = []
    for n, (kind, idx) in enumerate(walk):
        names = tuple(specs[i][0].name for i in idx)
        levels = tuple(sorted({specs[i][0].priority for i in idx}, reverse=True))
        if kind == "plan":
            plan = _plan_step(fleet, specs, idx, taken, planned_nodes, previous, po, pool)
            used = _plan_nodes(plan)
            planned_nodes |= used
            plans.append(plan)
            order = tuple(x.name for x in fleet.nodes if x.name in used)
            done.append(Step(kind, levels, names, order))
        elif n < len(walk) - 1:  # a planner step follows: keep what this one gets from it
            step_of.update((name, n) for name in names)
            _, sched = _schedule(
                fleet, [specs[i] for i in idx], planned_nodes | set(taken), so, pool
            )
            for name, p in sched.placements.items():
                for x in p.nodes:
                    taken[x] = name
            got = {x for p in sched.placements.values() for x in p.nodes}
            done.append(
                Step(kind, levels, names, tuple(x.name for x in fleet.nodes if x.name in got))
            )
    merged = merge_plans(fleet, plans) if plans else None
    # Nodes a scheduler step took stay its own: a lower unplanned level does not get them
    # where the planned level between was denied them.
    rest = [
        (s, [x for x in nodes if x not in taken or step_of[taken[x]] == step_of.get(s.name)])
        for s, nodes in specs
        if not is_planned(s)
    ]
    if not rest:
        return FleetDecision(merged, steps=tuple(done))
    req_s, sched = _schedule(fleet, rest, planned_nodes, so, pool)
    sched = _planned_holders(fleet, rest, sched, merged)
    levels = tuple(sorted({s.priority for s, _ in rest}, reverse=True))
    done.append(Step("schedule", levels, tuple(s.name for s, _ in rest)))
    return FleetDecision(merged, req_s, sched, tuple(done))


def _check_names(specs: Specs) -> None:
    """Refuse a deployment name given twice (of either kind)."""
    seen: set[str] = set()
    for s, _ in specs:
        if s.name in seen:
            raise InputError(
                f"deployment {s.name!r} appears twice. To fix: give each deployment its own name",
                field=f"deployments.{s.name}.name",
            )
        seen.add(s.name)


def _plan_step(
    fleet: Fleet,
    specs: Specs,
    idx: Sequence[int],
    taken: Mapping[str, str],
    planned: Collection[str],
    previous: Mapping[str, frozenset[str]],
    po: PlanOptions,
    pool: Executor | None,
) -> FleetPlan:
    """Plan the deployments ``idx`` on the nodes neither an earlier planner step nor a
    higher scheduler step (``taken``: node -> holder) took, none of them onto the nodes an
    unplanned deployment of its own priority holds now (``previous``); shortfalls name the
    unplanned holders of nodes kept from them."""
    held_by: dict[int, dict[str, str]] = {}  # priority -> node -> running unplanned holder
    for s, _ in specs:
        if not is_planned(s):
            for x in previous.get(s.name, frozenset()):
                held_by.setdefault(s.priority, {}).setdefault(x, s.name)
    mine: list[FleetDeployment] = []
    kept: dict[str, dict[str, str]] = {}  # deployment -> node kept from it -> holder
    for i in idx:
        s, nodes = specs[i]
        own = held_by.get(s.priority, {})
        eligible = {x for x in nodes if x not in planned}
        kept[s.name] = {x: taken.get(x) or own[x] for x in eligible if x in taken or x in own}
        mine.append(FleetDeployment(s, frozenset(eligible - set(kept[s.name]))))
    part = _without(fleet, set(taken) | set(planned))
    req = PlanRequest(part, tuple(mine), previous=po.previous, settings=po.settings)
    plan = plan_fleet(req, cache=po.cache, pool=pool)
    return replace(plan, shortfalls=_name_holders(plan.shortfalls, kept))


def _without(fleet: Fleet, off: Collection[str]) -> Fleet:
    """``fleet`` without the nodes named in ``off`` (its fabric links kept)."""
    return Fleet(fleet.name, tuple(x for x in fleet.nodes if x.name not in off), fleet.fabric_links)


def _name_holders(
    shortfalls: Mapping[str, Shortfall], kept: Mapping[str, Mapping[str, str]]
) -> dict[str, Shortfall]:
    """``shortfalls`` with the unplanned deployments that hold nodes the planner could not
    offer (``kept``: deployment -> node -> holder) named: in a ``gpus`` shortfall, and in
    place of ``nodes`` (none eligible) when they hold every node it may use."""
    out: dict[str, Shortfall] = {}
    for name, sf in shortfalls.items():
        nodes = kept.get(name, {})
        if nodes and sf.resource in ("gpus", "nodes"):
            who = ", ".join(sorted(set(nodes.values())))
            listed = ", ".join(sorted(nodes)[:5]) + (", ..." if len(nodes) > 5 else "")
            held = (
                f"nodes it may use ({listed}) are held by {who}: deployments without traffic "
                "and SLOs of a higher priority, or of its own and running"
            )
            if sf.resource == "gpus":
                sf = replace(sf, message=f"{sf.message.rstrip('.')}. N{held[1:]}.")
            else:
                sf = replace(
                    sf,
                    resource="gpus",
                    fix=f"the nodes {who} hold",
                    message=(
                        f"{name} misses {sf.missing_requests_per_s:.3g} requests/s: the {held}. "
                        "To fix: raise its priority, lower theirs or add nodes"
                    ),
                )
        out[name] = sf
    return out


def _schedule(
    fleet: Fleet,
    specs: Specs,
    off: Collection[str],
    so: ScheduleOptions,
    pool: Executor | None,
) -> tuple[ScheduleRequest, Schedule]:
    """The fleet scheduler over ``specs`` on ``fleet``'s nodes less ``off``."""
    off = set(off)
    if off:
        fleet = _without(fleet, off)
        specs = [(s, [x for x in nodes if x not in off]) for s, nodes in specs]
    return schedule(
        fleet,
        specs,
        previous=so.previous,
        quotas_gpus=so.quotas_gpus,
        settings=so.settings,
        cache=so.cache,
        pool=pool,
    )


def _planned_holders(
    fleet: Fleet, specs: Specs, sched: Schedule, plan: FleetPlan | None
) -> Schedule:
    """``sched`` with the pending deployments that have no node left because planned
    instances hold them (the scheduler only saw the nodes the plan left: "no usable node")
    told so, resource ``priority``, the planned holders named."""
    if plan is None:
        return sched
    holder = {
        x: name
        for name, d in plan.deployments.items()
        for p in d.pools
        for g in p.groups()
        for inst in g.nodes
        for x in inst
    }
    gpus = {x.name: len(x.gpus) for x in fleet.nodes}
    pending = dict(sched.pending)
    for s, nodes in specs:
        pend = pending.get(s.name)
        held = sorted(x for x in nodes if x in holder)
        if pend is None or pend.resource != "nodes" or not held:
            continue
        who = ", ".join(sorted({holder[x] for x in held}))
        pending[s.name] = replace(
            pend,
            resource="priority",
            nodes=tuple(held),
            missing=float(sum(gpus.get(x, 0) for x in held)),
            unit="GPUs",
            message=(
                f"the {len(held)} node(s) it may use serve the instances of {who} (deployments "
                "with traffic and SLOs of a higher priority, or of its own and planned first). "
                "To fix: raise its priority, add nodes or widen its node selector"
            ),
        )
    return replace(sched, pending=pending)


def _plan_nodes(plan: FleetPlan) -> set[str]:
    """The nodes ``plan``'s instances use."""
    return {
        x
        for d in plan.deployments.values()
        for p in d.pools
        for g in p.groups()
        for inst in g.nodes
        for x in inst
    }


def merge_plans(fleet: Fleet, plans: Sequence[FleetPlan]) -> FleetPlan:
    """One plan of the planner steps' ``plans`` (on disjoint nodes of ``fleet``): every
    deployment, shortfall and variant; ``free_nodes`` the fleet's nodes no instance uses;
    the first solver status that is not optimal, else the last; curves and solve times
    summed."""
    used = set().union(*(_plan_nodes(p) for p in plans))
    free = tuple(x.name for x in fleet.nodes if x.name not in used)
    if len(plans) == 1:
        only = plans[0]
        return only if only.free_nodes == free else replace(only, free_nodes=free)
    statuses = [p.solver for p in plans]
    return FleetPlan(
        deployments={k: v for p in plans for k, v in p.deployments.items()},
        shortfalls={k: v for p in plans for k, v in p.shortfalls.items()},
        free_nodes=free,
        solver=next((st for st in statuses if not st.endswith("optimal")), statuses[-1]),
        variants={k: v for p in plans for k, v in p.variants.items()},
        curves_computed=sum(p.curves_computed for p in plans),
        curves_cached=sum(p.curves_cached for p in plans),
        solve_s=sum(p.solve_s for p in plans),
    )


__all__ = [
    "FleetDecision",
    "PlanOptions",
    "ScheduleOptions",
    "Step",
    "merge_plans",
    "plan_and_schedule",
    "steps",
]
