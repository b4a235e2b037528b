"""The engine instances a fleet plan runs a deployment as, with names that last.

A controller (or the operator) turns each planned deployment into engine instances: one
per instance of every group of its pools (:func:`plan_instances`, which reads the plan's own
document through :func:`policies.launch.planned_instances`, so ``plan launch --fleet-plan``
and a running controller see the same instances). Each instance runs as its own deployment
(:func:`policies.launch.instance_spec`) with its own plan, version and rollout.

Names are ``<deployment>-<role>-<i>``. Across re-plans an instance that keeps its role and
nodes keeps its name (:func:`keep_names`), so nothing moves that the new plan did not move;
a new instance takes the lowest index of its role no live instance uses. A deployment whose
name leaves no room for its instances' names (63 characters, a DNS label) is refused.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from policies.defaults import DRAIN_GRACE_S
from policies.errors import InputError
from policies.fleetplan.report import deployment_doc
from policies.fleetplan.types import ROLES, DeploymentPlan
from policies.launch.fleet import PlannedInstance, planned_instances
from policies.spec.build import DeploymentSpec

MAX_NAME = 63
"""Longest deployment (and so instance) name: a DNS label, characters."""


def is_planned(spec: DeploymentSpec) -> bool:
    """Whether the fleet planner plans ``spec`` as instances: it states both its traffic
    and its SLOs (an instance's own spec, :func:`policies.launch.instance_spec`, states
    neither)."""
    return spec.traffic is not None and spec.slo is not None


def instance_name(deployment: str, role: str, index: int) -> str:
    """``<deployment>-<role>-<index>``, checked against :data:`MAX_NAME`."""
    name = f"{deployment}-{role}-{index}"
    if len(name) > MAX_NAME:
        room = MAX_NAME - len(f"-{role}-{index}")
        raise InputError(
            f"instance name {name!r} is over {MAX_NAME} characters; a deployment served by "
            f"several instances may have a name of at most {room} characters",
            field="metadata.name",
        )
    return name


def plan_instances(
    dp: DeploymentPlan,
    chunk_tokens: int,
    previous: Sequence[PlannedInstance] = (),
) -> tuple[PlannedInstance, ...]:
    """The engine instances of ``dp``, pool by pool, named as :func:`keep_names` keeps them
    against ``previous`` (the instances running now); empty when nothing serves it.

    Raises:
        InputError: the deployment's name leaves no room for an instance name.
    """
    if not dp.pools:
        return ()
    doc = {"kind": "FleetPlan", "deployments": [deployment_doc(dp, chunk_tokens)]}
    fresh = planned_instances(doc, dp.deployment)
    return keep_names(dp.deployment, fresh, previous)


def keep_names(
    deployment: str,
    fresh: Sequence[PlannedInstance],
    previous: Sequence[PlannedInstance],
) -> tuple[PlannedInstance, ...]:
    """``fresh`` renamed so that an instance with the role and nodes of one in ``previous``
    keeps that one's name; every other takes the lowest index of its role that neither a
    kept name nor another instance of ``previous`` (still live until it is drained) uses.
    Order is ``fresh``'s."""
    unused = {(p.role, p.nodes): p.name for p in previous}
    names: list[str | None] = []
    for inst in fresh:
        names.append(unused.pop((inst.role, inst.nodes), None))
    taken = {n for n in names if n} | {p.name for p in previous}
    out = []
    for inst, name in zip(fresh, names, strict=True):
        if name is None:
            name = _lowest_free(deployment, inst.role, taken)
            taken.add(name)
        else:
            instance_name(deployment, inst.role, 0)  # the deployment's name still fits
        out.append(replace(inst, name=name))
    return tuple(out)


@dataclass(frozen=True)
class ServingInstance:
    """What :func:`capacity_lost` reads of an instance of one deployment.

    Attributes:
        role: ``aggregated`` | ``prefill`` | ``decode``.
        pool: its pool (a prefill/decode pool's instances pair up).
        capacity_requests_per_s: what it serves within the SLO, requests/s.
    """

    role: str
    pool: str
    capacity_requests_per_s: float


def capacity_lost(
    name: str, instances: Mapping[str, ServingInstance], serving: Collection[str]
) -> float:
    """What serving capacity a deployment loses when its instance ``name`` stops taking
    requests, requests/s. ``instances``: the deployment's instances by name; ``serving``:
    those that serve now (committed, not draining). An aggregated instance loses its own
    capacity; a prefill or decode instance what its pool serves - the lesser of its prefill
    and decode instances' summed capacities, as routers pair them by pool - with it less
    without it; 0 for an instance that does not serve."""
    if name not in serving:
        return 0.0
    me = instances[name]
    if me.role not in ("prefill", "decode"):
        return me.capacity_requests_per_s
    pool = [n for n, x in instances.items() if x.pool == me.pool and n in serving]

    def pool_capacity(members: Collection[str]) -> float:
        return min(
            sum(instances[n].capacity_requests_per_s for n in members if instances[n].role == r)
            for r in ("prefill", "decode")
        )

    return pool_capacity(pool) - pool_capacity([n for n in pool if n != name])


def first_to_drain(
    blockers: Mapping[str, Collection[str]],
    draining: Collection[str],
    lost_requests_per_s: Mapping[str, float],
    exclude: Collection[str] = (),
) -> str:
    """Which dropped instance drains early so that new instances can come up on a full fleet
    ("" for none): the early-drain rule of controller and operator alike.

    Args:
        blockers: each new or changed instance of one deployment that is neither committed
            nor failed -> the dropped instances (retiring or draining) holding nodes it waits
            for.
        draining: the dropped instances draining now.
        lost_requests_per_s: per dropped instance, what its deployment loses when it stops
            taking requests (:func:`capacity_lost`), requests/s.
        exclude: dropped instances that may not be chosen (their own deployment drains one
            early already).

    Only when every one of them waits (some can still come up: a surge first) and none of
    the instances they wait for drains already (one at a time): the one whose loss costs the
    least capacity, then the first by name.
    """
    if not blockers or not all(blockers.values()):
        return ""
    held = sorted({o for os in blockers.values() for o in os})
    if any(o in draining for o in held):
        return ""
    choice = [o for o in held if o not in exclude]
    if not choice:
        return ""
    return min(choice, key=lambda o: (lost_requests_per_s.get(o, 0.0), o))


def _lowest_free(deployment: str, role: str, taken: Iterable[str]) -> str:
    used = set(taken)
    i = 0
    while instance_name(deployment, role, i) in used:
        i += 1
    return instance_name(deployment, role, i)


__all__ = [
    "DRAIN_GRACE_S",
    "MAX_NAME",
    "ROLES",
    "ServingInstance",
    "capacity_lost",
    "first_to_drain",
    "instance_name",
    "is_planned",
    "keep_names",
    "plan_instances",
]
