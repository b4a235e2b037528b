"""One fleet, two kinds of deployment: those that state their traffic and SLOs are planned as
engine instances by the fleet planner (:func:`policies.fleetplan.plan_fleet`), the others get
whole nodes from the fleet scheduler (:func:`policies.scheduling.schedule`) among the nodes
the plan leaves free. ``mixfleetctl schedule show --fleet`` and the standalone controller
both decide a fleet through :func:`plan_and_schedule`.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from policies.fleet import Fleet
from policies.fleetplan.curves import CurveCache
from policies.fleetplan.instances import is_planned
from policies.fleetplan.planner import plan_fleet
from policies.fleetplan.types import FleetDeployment, FleetPlan, PlannerSettings, PlanRequest
from policies.scheduling import schedule
from policies.scheduling.table import EstimateCache, TableSettings
from policies.scheduling.types import Schedule, ScheduleRequest
from policies.spec import DeploymentSpec


@dataclass(frozen=True)
class FleetDecision:
    """What :func:`plan_and_schedule` decided.

    Attributes:
        plan: the fleet planner's plan of the planned deployments (None when there is none).
        request: the fleet scheduler's request of the others (None when there is none).
        schedule: the fleet scheduler's assignment of the others (None with ``request``).
    """

    plan: FleetPlan | None = None
    request: ScheduleRequest | None = None
    schedule: Schedule | None = None


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


def plan_and_schedule(
    fleet: Fleet,
    specs: Sequence[tuple[DeploymentSpec, Collection[str]]],
    *,
    planning: PlanOptions | None = None,
    scheduling: ScheduleOptions | None = None,
    pool: Executor | None = None,
) -> FleetDecision:
    """Plan the deployments of ``specs`` that state traffic and SLOs
    (:func:`~policies.fleetplan.instances.is_planned`) on ``fleet``, then schedule the others
    on the nodes that plan leaves free.

    Args:
        fleet: the usable nodes (healthy GPUs only).
        specs: each deployment with the node names it may use (usable, matching its node
            selector); a planned deployment's ``traffic`` is the demand it is planned for.
        planning: the planner's previous plan, settings and curve cache.
        scheduling: the scheduler's previous assignment, quotas, settings and cache.
        pool: the caller's executor for curves and estimates not cached (the answer is the
            same without it).

    Raises:
        InputError: an invalid deployment (the field is named).
    """
    po = planning or PlanOptions()
    so = scheduling or ScheduleOptions()
    mine = [FleetDeployment(s, frozenset(nodes)) for s, nodes in specs if is_planned(s)]
    rest = [(s, nodes) for s, nodes in specs if not is_planned(s)]
    plan = None
    if mine:
        req = PlanRequest(fleet, tuple(mine), previous=po.previous, settings=po.settings)
        plan = plan_fleet(req, cache=po.cache, pool=pool)
    if not rest:
        return FleetDecision(plan)
    if plan is not None:
        free = set(plan.free_nodes)
        fleet = Fleet(
            fleet.name, tuple(n for n in fleet.nodes if n.name in free), fleet.fabric_links
        )
        rest = [(s, [n for n in nodes if n in free]) for s, nodes in rest]
    req_s, sched = schedule(
        fleet,
        rest,
        previous=so.previous,
        quotas_gpus=so.quotas_gpus,
        settings=so.settings,
        cache=so.cache,
        pool=pool,
    )
    return FleetDecision(plan, req_s, sched)


__all__ = ["FleetDecision", "PlanOptions", "ScheduleOptions", "plan_and_schedule"]
