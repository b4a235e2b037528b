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

from collections.abc import Iterable, Sequence
from dataclasses import replace

from policies.errors import InputError
from policies.fleetplan.report import deployment_doc
from policies.fleetplan.types import ROLES, DeploymentPlan
from policies.launch.fleet import PlannedInstance, planned_instances
from policies.spec import DeploymentSpec

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


def _lowest_free(deployment: str, role: str, taken: Iterable[str]) -> str:
    used = set(taken)
    i = 0
    while instance_name(deployment, role, i) in used:
        i += 1
    return instance_name(deployment, role, i)


__all__ = [
    "MAX_NAME",
    "ROLES",
    "instance_name",
    "is_planned",
    "keep_names",
    "plan_instances",
]
