"""The fleet scheduler: one fleet, many deployments, exclusive GPUs.

Estimate, then build, then solve: :mod:`policies.scheduling.table` predicts each
deployment's candidate engine instances on counts of whole nodes per node group through the
one cost model (:func:`policies.solve.solve`); :mod:`policies.scheduling.ilp` assigns nodes to
deployments by an integer program over that table (priorities, min/max GPUs, namespace
quotas, node selectors, memory-fraction sharing, a move penalty against the previous
assignment); :mod:`policies.scheduling.baselines` holds first fit and
every-deployment-on-every-node; :mod:`policies.scheduling.explain` says why a deployment is
pending or has its nodes. The front door is :func:`schedule`.

This package module imports nothing at import time (:mod:`policies.spec.build` reads the spec's
scheduling fields from :mod:`policies.scheduling.fields`).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from policies.hardware.fleet import Fleet
    from policies.scheduling.table import EstimateCache, TableSettings
    from policies.scheduling.types import Schedule, ScheduleRequest
    from policies.spec.build import DeploymentSpec


def schedule(
    fleet: Fleet,
    specs: Sequence[tuple[DeploymentSpec, Collection[str]]],
    *,
    previous: Mapping[str, frozenset[str]] | None = None,
    quotas_gpus: Mapping[str, int] | None = None,
    settings: TableSettings | None = None,
    cache: EstimateCache | None = None,
    move_weight: float = 0.25,
    pool: Executor | None = None,
) -> tuple[ScheduleRequest, Schedule]:
    """Assign ``fleet``'s nodes to deployments.

    Args:
        fleet: the usable nodes (healthy GPUs only).
        specs: each deployment with the node names it may use (usable, matching its node
            selector).
        previous: deployment -> nodes it holds now (moves against it are penalised).
        quotas_gpus: namespace -> most GPUs its deployments may hold.
        settings: how candidates are estimated (:class:`~policies.scheduling.table.TableSettings`).
        cache: estimates kept between calls.
        move_weight: cost of moving one node, in average node values.
        pool: the caller's executor for the estimate solves not cached (a process pool
            runs them in parallel; the answer is the same without it).

    Returns:
        The request (the cost table, for :func:`policies.scheduling.explain.explain`) and
        the schedule.

    Raises:
        InputError: an invalid spec (the field is named).
    """
    from policies.scheduling.ilp import solve_schedule
    from policies.scheduling.table import TableSettings, build_table

    req = build_table(
        fleet,
        specs,
        settings=settings or TableSettings(),
        cache=cache,
        previous=previous,
        quotas_gpus=quotas_gpus,
        move_weight=move_weight,
        pool=pool,
    )
    return req, solve_schedule(req)
