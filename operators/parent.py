"""The decision for a ModelDeployment planned from its traffic and SLOs: it runs as the
engine instances of the operator's fleet plan (:mod:`operators.instances`), each an
instance's ModelDeployment the operator creates, owns and keeps as planned.

One tick (:func:`reconcile_parent`, pure like :func:`operators.decide.reconcile`):

* the finalizer; the deployment's own PartitionPlans and ConfigMap from before it was
  planned are deleted (its instances have their own);
* every planned instance's ModelDeployment is applied when it is missing or its spec,
  labels or owner differ - a user's edit is put back (one owner);
* an instance the plan dropped lives as in the standalone controller: *retiring* - it
  keeps serving - until every new or changed instance of its parent is ready (its plan
  committed on every node), then *draining* (routers send it no new request) from
  ``drainingSinceS``, both written into its ``status.instance`` by its own reconcile
  (:meth:`operators.fleet_schedule.FleetAssignments.record`, which also drains one early
  on a full fleet); it is deleted once the drain grace (``OperatorSettings.drain_grace_s``)
  has passed since then - or at once when it never had a committed plan;
* the status: ``status.instances`` (name, variant, role, pool, nodes, plan version,
  predicted TTFT/TPOT, capacity, ready), ``instancesReady``, the requests/s the plan serves
  and the demand it is planned for (``demandFrom``: the stated one, or the measured one the
  controller chose after a sustained drift), and the conditions ``Solved`` (planned or why not), ``DemandServed`` (False
  with the shortfall's resource as reason: ``NotEnoughGPUs``, ``OverBudget``,
  ``SLOUnreachable``, ``NoEligibleNodes``), ``Ready`` (every instance committed) and
  ``Degraded`` (an instance that cannot be planned or rolled out).

Units: requests per second, milliseconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from apis.kube.errors import PermanentError
from apis.kube.names import FINALIZER
from apis.kube.v1alpha1 import InstanceSummary, ModelDeploymentStatus
from operators.decide import (
    Action,
    ApplyChild,
    DeleteChild,
    DeleteConfigMap,
    DeletePlan,
    Requeue,
    SetFinalizer,
    finalize,
    status_apply,
)
from operators.instances import child_object, child_spec, extra_fields, same_spec
from operators.observe import ChildView, Observed, ParentPlan
from operators.status import DEGRADED, SOLVED, condition
from policies.defaults import DRAIN_GRACE_S
from policies.launch import PlannedInstance

READY, DEMAND_SERVED = "Ready", "DemandServed"

#: The shortfall's resource (:class:`policies.fleetplan.Shortfall`) as a condition reason.
SHORTFALL_REASONS = {
    "gpus": "NotEnoughGPUs",
    "budget": "OverBudget",
    "slo": "SLOUnreachable",
    "nodes": "NoEligibleNodes",
}


def reconcile_parent(
    observed: Observed, drain_grace_s: float = DRAIN_GRACE_S
) -> tuple[Action, ...]:
    """Decide what to do for a planned ModelDeployment (``observed.planned`` set);
    ``drain_grace_s``: how long a draining instance keeps its engine before it is deleted,
    seconds."""
    d = observed.deployment
    pp = observed.planned or ParentPlan(error="not planned")
    if d.deleting:
        return finalize(observed)
    actions: list[Action] = []
    if FINALIZER not in d.finalizers:
        actions.append(SetFinalizer(True))
    actions += [DeletePlan(p.name, p.uid) for p in observed.plans if not p.deleting]
    if observed.config_map is not None:
        actions.append(DeleteConfigMap(observed.config_map.name))
    live = {c.name: c for c in observed.children if not c.deleting}
    errors: list[str] = []
    for inst in pp.instances:
        try:
            applied = _apply_child(observed, inst, live.get(inst.name))
        except PermanentError as exc:
            errors.append(str(exc))
            continue
        if applied is not None:
            actions.append(applied)
    wanted = {i.name for i in pp.instances}
    dropped = [c for name, c in sorted(live.items()) if name not in wanted]
    waits: list[float] = []
    for c in dropped:
        left_s = drain_left_s(c, observed.now.timestamp(), drain_grace_s)
        # Not planned this time (the planner refused): what runs keeps running.
        if left_s is None and c.status.current_plan is None and not pp.error:
            left_s = 0.0  # dropped before it served: nothing to drain
        if left_s is not None and left_s <= 0:
            actions.append(DeleteChild(c.name, c.uid))
        elif left_s is not None:
            waits.append(left_s)
    if waits:
        actions.append(Requeue(min(waits)))
    status = parent_status(observed, pp, live, dropped, errors)
    applied_status = status_apply(observed, status)
    if applied_status is not None:
        actions.append(applied_status)
    return tuple(actions)


def _apply_child(
    observed: Observed, inst: PlannedInstance, live: ChildView | None
) -> ApplyChild | None:
    """The apply of one instance's ModelDeployment, or None when it is as planned."""
    d = observed.deployment
    assert d.spec is not None  # a planned deployment's spec parsed
    spec = child_spec(d.name, d.spec, observed.policy, inst)
    body = child_object(d, inst, spec)
    if live is not None and live.owner_uid == d.uid and same_spec(live.spec, spec):
        return None
    remove = extra_fields(live.spec, body["spec"]) if live is not None else {}
    return ApplyChild(body, inst.name, remove)


def is_ready(child: ChildView | None) -> bool:
    """An instance is ready when every node of its current plan committed it."""
    if child is None or child.status.current_plan is None:
        return False
    return any(c.type == "RolledOut" and c.status == "True" for c in child.status.conditions)


def drain_left_s(child: ChildView, now_s: float, drain_grace_s: float) -> float | None:
    """Seconds left of a draining instance's drain grace (at most 0: delete it now), from
    its record's ``drainingSinceS`` and ``now_s`` (Unix s); None unless it drains."""
    rec = child.status.instance
    if rec is None or not rec.draining or rec.draining_since_s <= 0:
        return None
    return drain_grace_s - (now_s - rec.draining_since_s)


def parent_status(
    observed: Observed,
    pp: ParentPlan,
    live: dict[str, ChildView],
    dropped: Sequence[ChildView],
    errors: Sequence[str],
) -> ModelDeploymentStatus:
    """The status of a planned deployment for this tick."""
    d = observed.deployment
    summaries = [_summary(i, live.get(i.name)) for i in pp.instances]
    for c in dropped:
        rec = c.status.instance
        summaries.append(
            InstanceSummary(
                name=c.name,
                role=rec.role if rec is not None else "aggregated",
                pool=rec.pool if rec is not None else "",
                variant=rec.variant if rec is not None else "",
                nodes=c.status.nodes,
                version=c.status.current_plan.version if c.status.current_plan else None,
                ready=is_ready(c),
                retiring=not (rec is not None and rec.draining),
                draining=rec is not None and rec.draining,
            )
        )
    ready = sum(1 for s in summaries if s.ready and not (s.draining or s.retiring))
    prev, gen, now = d.status.conditions, d.generation, observed.now
    conditions = (
        condition(prev, SOLVED, *_solved(pp), gen, now),
        condition(prev, DEMAND_SERVED, *_served(pp), gen, now),
        condition(prev, READY, *_ready(pp, live), gen, now),
        condition(prev, DEGRADED, *_degraded(pp, live, errors), gen, now),
    )
    nodes = sorted({n for i in pp.instances for n in i.nodes})
    return ModelDeploymentStatus(
        observed_generation=gen,
        conditions=conditions,
        gpus=sum(i.gpus for i in pp.instances),
        nodes=tuple(nodes),
        instances=tuple(summaries),
        instances_ready=f"{ready}/{len(pp.instances)}",
        planned_requests_per_s=round(pp.served_requests_per_s, 6),
        demand_requests_per_s=round(pp.demand_requests_per_s, 6),
        demand_from=pp.demand_from,
        planned_attainment=(
            round(min(1.0, pp.served_requests_per_s / pp.demand_requests_per_s), 4)
            if pp.demand_requests_per_s > 0
            else None
        ),
    )


def _summary(inst: PlannedInstance, child: ChildView | None) -> InstanceSummary:
    plan = child.status.current_plan if child is not None else None
    return InstanceSummary(
        name=inst.name,
        role=inst.role,
        pool=inst.pool,
        variant=inst.variant,
        nodes=inst.nodes,
        version=plan.version if plan is not None else None,
        requests_per_s=round(inst.requests_per_s, 6),
        capacity_requests_per_s=round(inst.capacity_requests_per_s, 6),
        ttft_ms=round(inst.ttft_ms, 3),
        tpot_ms=round(inst.tpot_ms, 3),
        ready=is_ready(child),
    )


def _solved(pp: ParentPlan) -> tuple[str, str, str]:
    """``(status, reason, message)`` of the Solved condition of a planned deployment."""
    if pp.error:
        return "False", "NotPlanned", pp.error
    if not pp.instances:
        reason = SHORTFALL_REASONS.get(pp.shortfall[0], "NotPlanned") if pp.shortfall else ""
        why = pp.shortfall[1] if pp.shortfall else "the fleet plan gives it no instance"
        return "False", reason or "NotPlanned", why
    roles = Counter(i.role for i in pp.instances)
    parts = ", ".join(f"{n} {r}" for r, n in sorted(roles.items()))
    measured = f" (the measured demand: {pp.replan_reason})" if pp.demand_from == "Measured" else ""
    return (
        "True",
        "Planned",
        f"{len(pp.instances)} engine instances ({parts}) serve "
        f"{pp.served_requests_per_s:.3g} of {pp.demand_requests_per_s:.3g} requests/s within "
        f"the SLO{measured}",
    )


def _served(pp: ParentPlan) -> tuple[str, str, str]:
    """``(status, reason, message)`` of the DemandServed condition."""
    if pp.shortfall is not None:
        resource, message = pp.shortfall
        return "False", SHORTFALL_REASONS.get(resource, "Shortfall"), message
    if pp.error or not pp.instances:
        return "False", "NotPlanned", pp.error or "no instance serves it"
    return (
        "True",
        "DemandServed",
        f"the plan serves the {'measured' if pp.demand_from == 'Measured' else 'stated'} "
        f"{pp.demand_requests_per_s:.3g} requests/s within the SLO",
    )


def _ready(pp: ParentPlan, live: dict[str, ChildView]) -> tuple[str, str, str]:
    """``(status, reason, message)`` of the Ready condition: every instance committed."""
    if not pp.instances:
        return "False", "NoInstances", "no instance is planned"
    waiting = [i for i in pp.instances if not is_ready(live.get(i.name))]
    if not waiting:
        return "True", "InstancesReady", f"all {len(pp.instances)} instances committed their plans"
    details = []
    for i in waiting[:10]:
        c = live.get(i.name)
        rolled = (
            next((x for x in c.status.conditions if x.type == "RolledOut"), None) if c else None
        )
        why = f"{rolled.reason}: {rolled.message}" if rolled is not None else "not created yet"
        details.append(f"{i.name} ({why})")
    return (
        "False",
        "InstancesNotReady",
        f"{len(pp.instances) - len(waiting)}/{len(pp.instances)} instances ready; waiting for "
        + "; ".join(details),
    )


def _degraded(
    pp: ParentPlan, live: dict[str, ChildView], errors: Sequence[str]
) -> tuple[str, str, str]:
    """``(status, reason, message)`` of the Degraded condition: an instance whose spec
    cannot be made, or that cannot be planned or rolled out."""
    if errors:
        return "True", "InvalidInstance", "; ".join(errors[:5])
    bad = []
    for i in pp.instances:
        c = live.get(i.name)
        if c is None:
            continue
        for x in c.status.conditions:
            if (x.type, x.status) in (("Solved", "False"), ("Degraded", "True")):
                bad.append(f"{i.name}: {x.type} {x.reason}: {x.message}")
                break
    if bad:
        return "True", "InstanceDegraded", "; ".join(bad[:5])
    if pp.error or not pp.instances:
        return "True", "NotServing", f"no instance serves it: {_solved(pp)[2]}"
    if pp.shortfall is not None:
        return "True", SHORTFALL_REASONS.get(pp.shortfall[0], "Shortfall"), pp.shortfall[1]
    return "False", "AsExpected", "every instance serves its part of the plan"
