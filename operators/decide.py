"""The ModelDeployment reconciler's decision: a pure function from what was observed to the
actions that make the world match the spec.

One tick of the control loop (:mod:`operators.operator`) is::

    observed = observe(key)                      # the deployment, GPUNodes, policy, plans
    actions = reconcile(observed, settings)      # pure: this module
    if a SolveAction is among them:              # the one expensive step
        outcome = run_solve(action)              # policies.solve, also pure
        actions = reconcile(replace(observed, solve=outcome), settings)
    act(actions)                                 # server-side apply, deletes, finalizers

Nothing here does I/O, reads a clock or keeps state: the time is ``observed.now``, and the
status is rebuilt from the observations on every tick (the previous status is read only to
keep ``lastTransitionTime`` of unchanged conditions and the record of the last failed
solve, so a bad spec is not re-solved in a hot loop).

Errors in the spec are *permanent* (kopf's term): they become ``Solved=False`` with a reason
(``UnknownModel``, ``InvalidModelConfig``, ``InvalidWorkload``, ``InvalidPrices``,
``PolicyNotFound``, ``NoEligibleNodes``, ``Unschedulable`` (the fleet scheduler gives it no
GPUNode: the reason says which resource, nodes and amount), ``MixedVendors``, ``NothingToExport``,
``Infeasible``, ``PlanTooLarge``) and a message that says how to fix it; the deployment is
solved again only when its inputs change.

Tiers. When the PlacementPolicy defines an ``interactive`` tier, a tick first asks for a
:class:`TierAction`: :func:`policies.advice.tier_planner.plan_tiers` splits the eligible nodes into
interactive replicas (each one NVLink domain, an independent copy of the model sized to the
SLO) and a batch tier. The split is recorded in ``status.tiers`` (with the digest of its
inputs, so it is planned again only when they change) and reported by the
``InteractiveSLO`` condition. The deployment's own plan - its PartitionPlan, ConfigMap and
agent rollout - is then the batch tier: the deployment's workload solved on the batch
nodes only, the interactive nodes left out of its fleet. Interactive replicas run the
model on their nodes at the batches ``status.tiers.replicas`` gives (one domain of
identical GPUs needs no heterogeneous placement).

Cost. ``status.costPerMillionTokensUSD`` prices the current plan's GPUs at the
deployment's ``gpuHourPrices`` over the policy's over the built-in assumed prices
(:mod:`policies.advice.cost`).

This module owns the actions and the order of the rules; the inputs of a solve are built
in :mod:`operators.inputs`, the status in :mod:`operators.status`, the objects written in
:mod:`operators.objects`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from apis.kube.errors import PermanentError
from apis.kube.names import (
    FINALIZER,
    config_map_name,
    parse_time,
    rfc3339,
)
from apis.kube.schema import Json, to_wire
from apis.kube.v1alpha1 import (
    ModelDeploymentStatus,
    SolveRecord,
    TiersStatus,
)
from operators.inputs import (
    SolveInputs,
    TierInputs,
    check_vendor_mix,
    eligible_fleet,
    reserved_nodes,
    solve_inputs,
    tier_inputs,
)
from operators.objects import (
    config_map_keys,
    config_map_object,
    plan_object,
    plan_reason,
)
from operators.observe import (
    Observed,
    PlanView,
    ReconcileSettings,
    SolveOutcome,
    current_plan,
    newest_plan,
    next_version,
)
from operators.status import (
    deployment_status,
    tiers_status,
)
from policies.advice.tiers import TierRequest
from policies.errors import InputError
from policies.request import PlacementRequest

#: Solve failures that re-solving the same inputs cannot fix.
PERMANENT_SOLVE_REASONS = frozenset({"Infeasible", "InvalidSpec", "PlanTooLarge"})


#: Tier-split failures that planning the same inputs again cannot fix.
PERMANENT_TIER_REASONS = frozenset({"InvalidTier"})


@dataclass(frozen=True)
class SetFinalizer:
    """Add (``present``) or remove this operator's finalizer on the deployment."""

    present: bool


@dataclass(frozen=True)
class SolveAction:
    """Solve ``request``; feed the outcome back into :func:`reconcile`.

    Attributes:
        request: the placement request.
        inputs_digest: digest of the inputs, recorded in the PartitionPlan.
        version: version the new plan gets.
    """

    request: PlacementRequest
    inputs_digest: str
    version: int


@dataclass(frozen=True)
class TierAction:
    """Split the eligible nodes between the interactive and the batch tier
    (:func:`policies.advice.tier_planner.plan_tiers`); feed the outcome back into :func:`reconcile`.

    Attributes:
        request: the tier request (the whole eligible fleet).
        inputs_digest: digest of the inputs, recorded in ``status.tiers``.
    """

    request: TierRequest
    inputs_digest: str


@dataclass(frozen=True)
class ApplyPlan:
    """Create a PartitionPlan (server-side apply of metadata and immutable spec)."""

    body: Json = field(repr=False)
    name: str = ""


@dataclass(frozen=True)
class DeletePlan:
    """Delete an old or orphaned PartitionPlan."""

    name: str
    uid: str


@dataclass(frozen=True)
class ApplyConfigMap:
    """Publish the engine export of the current plan."""

    body: Json = field(repr=False)
    name: str = ""


@dataclass(frozen=True)
class DeleteConfigMap:
    """Remove the deployment's ConfigMap."""

    name: str


@dataclass(frozen=True)
class ApplyChild:
    """Server-side apply (forced: the operator is its one writer) an engine instance's
    ModelDeployment; then remove ``remove`` (a JSON merge patch of its spec: what another
    writer added) when not empty."""

    body: Json = field(repr=False)
    name: str = ""
    remove: Json = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class DeleteChild:
    """Delete an engine instance's ModelDeployment (uid as precondition)."""

    name: str
    uid: str


@dataclass(frozen=True)
class ApplyStatus:
    """Server-side apply of the deployment's status subresource."""

    status: Json


@dataclass(frozen=True)
class Requeue:
    """Reconcile this deployment again after ``after_s`` seconds."""

    after_s: float


Action = (
    SetFinalizer
    | TierAction
    | SolveAction
    | ApplyPlan
    | DeletePlan
    | ApplyConfigMap
    | DeleteConfigMap
    | ApplyChild
    | DeleteChild
    | ApplyStatus
    | Requeue
)


def reconcile(observed: Observed, settings: ReconcileSettings) -> tuple[Action, ...]:
    """Decide what to do for one ModelDeployment.

    Returns the actions in the order they must run. When a solve is needed and
    ``observed.solve`` is None, the result is the finalizer action (if any) and one
    :class:`SolveAction`: run it and call again with the outcome in ``observed.solve``
    (likewise a :class:`TierAction` and ``observed.tiers``).

    The rules, in order: finalizer; inputs and tier split (:func:`_prepare_inputs`);
    solve (:func:`_solve_rule`); engine export (:func:`_export_rule`); plan history
    (:func:`_prune_plans`); the instances of a deployment no longer planned from its traffic
    and SLOs deleted; status (:func:`status_apply`); requeue. A planned deployment is
    decided by :func:`operators.parent.reconcile_parent` instead.
    """
    d = observed.deployment
    if d.deleting:
        return finalize(observed)
    actions: list[Action] = []
    if FINALIZER not in d.finalizers:
        actions.append(SetFinalizer(True))

    prepared = _prepare_inputs(observed, settings)
    if isinstance(prepared, TierAction):
        return (*actions, prepared)
    inputs, input_error = prepared.inputs, prepared.error
    requeue: list[float] = []
    if prepared.retry_tiers_in_s > 0:
        requeue.append(prepared.retry_tiers_in_s)

    plans = [p for p in observed.plans if not p.deleting]
    if input_error is not None and input_error.reason == "Unschedulable":
        # The fleet scheduler gave it no GPUNode (preempted, or moved and waiting for its
        # new nodes to drain): withdraw its plans so its nodes free at once.
        actions += [DeletePlan(p.name, p.uid) for p in plans]
        plans = []
    current = current_plan(plans)
    solved = _solve_rule(observed, settings, inputs, plans)
    if isinstance(solved, SolveAction):
        return (*actions, solved)
    if solved.created is not None:
        body, view = solved.created
        actions.append(ApplyPlan(body, view.name))
        plans.append(view)
        current = view
    if solved.retry_in_s is not None:
        requeue.append(solved.retry_in_s)

    export, cm_wanted, export_error = _export_rule(observed, current)
    actions += export
    input_error = input_error or export_error
    actions += _prune_plans(plans, current, settings)

    # Instances of a deployment no longer planned from traffic and SLOs: it runs as itself.
    actions += [DeleteChild(c.name, c.uid) for c in observed.children if not c.deleting]
    ours = newest_plan([p for p in plans if p.spec.made_by == "operator"])
    status = deployment_status(
        observed,
        inputs,
        input_error,
        current,
        ours,
        solved.record,
        solved.solve,
        cm_wanted,
        prepared.tiers,
    )
    if observed.instance is not None:  # an engine instance says what it is
        status = dataclasses.replace(status, instance=observed.instance)
    status_action = status_apply(observed, status)
    if status_action is not None:
        actions.append(status_action)
    if inputs is not None and inputs.fleet_view.next_stale_s is not None:
        requeue.append(max(1.0, inputs.fleet_view.next_stale_s + 1.0))
    if requeue:
        actions.append(Requeue(min(requeue)))
    return tuple(actions)


@dataclass(frozen=True)
class _Prepared:
    """The inputs of this tick's solve, after the tier split.

    Attributes:
        inputs: the solve's inputs; None when the spec cannot be solved.
        error: why not (a permanent error, reported in the status).
        tiers: the tier split in use; None without an interactive tier.
        retry_tiers_in_s: seconds until a failed tier split is planned again (0: none).
    """

    inputs: SolveInputs | None
    error: PermanentError | None
    tiers: TiersStatus | None
    retry_tiers_in_s: float


def _prepare_inputs(observed: Observed, settings: ReconcileSettings) -> TierAction | _Prepared:
    """The solve's inputs; with an interactive tier, split first (or ask for the split):
    the deployment's plan is then the batch tier, the interactive nodes reserved."""
    inputs: SolveInputs | None = None
    input_error: PermanentError | None = None
    scheduled = _not_assigned(observed, settings)
    if observed.assigned_nodes is not None and not observed.assigned_nodes and scheduled:
        why = observed.unschedulable or "the fleet scheduler assigned it no GPUNode"
        return _Prepared(None, PermanentError("Unschedulable", why), None, 0.0)
    try:
        inputs = solve_inputs(observed, settings, reserved=scheduled or None)
    except PermanentError as exc:
        input_error = exc
    tiers: TiersStatus | None = None
    retry_tiers_in_s = 0.0
    t_in = tier_inputs(observed, inputs) if inputs is not None else None
    if t_in is not None:
        step = _tier_step(observed, settings, t_in)
        if isinstance(step, TierAction):
            return step
        tiers, retry_tiers_in_s = step
        reserved = {**scheduled, **reserved_nodes(tiers)}
        if reserved:
            try:
                inputs = solve_inputs(observed, settings, reserved=reserved)
            except PermanentError as exc:
                inputs, input_error = None, exc
    if inputs is not None:
        try:
            check_vendor_mix(inputs.request)
        except PermanentError as exc:
            inputs, input_error = None, exc
    return _Prepared(inputs, input_error, tiers, retry_tiers_in_s)


def _not_assigned(observed: Observed, settings: ReconcileSettings) -> dict[str, str]:
    """Eligible GPUNodes the fleet scheduler gives other deployments (left out of this
    one's plan; nodes left out for their own reasons keep them)."""
    spec = observed.deployment.spec
    if observed.assigned_nodes is None or spec is None:
        return {}
    view = eligible_fleet(
        observed.nodes,
        spec.node_selector,
        observed.policy,
        observed.now,
        settings.node_stale_after_s,
    )
    mine = set(observed.assigned_nodes)
    return {
        n.name: "the fleet scheduler assigned it to another deployment"
        for n in view.fleet.nodes
        if n.name not in mine
    }


@dataclass(frozen=True)
class _Solved:
    """What the solve rule leaves for the rest of the tick.

    Attributes:
        record: ``status.lastSolve`` to write.
        solve: the solve outcome the status reports (None: no solve this tick).
        created: the PartitionPlan to create (body and its view), if a solve placed it.
        retry_in_s: requeue after this many seconds to retry a failed solve (None: no).
    """

    record: SolveRecord | None
    solve: SolveOutcome | None
    created: tuple[Json, PlanView] | None = None
    retry_in_s: float | None = None


def _solve_rule(
    observed: Observed,
    settings: ReconcileSettings,
    inputs: SolveInputs | None,
    plans: list[PlanView],
) -> SolveAction | _Solved:
    """Solve when the inputs of the operator's own newest plan no longer match. The
    operator is the only writer of PartitionPlans: the controller rolls them out and
    commits them."""
    last = observed.deployment.status.last_solve
    solve = observed.solve
    ours = newest_plan([p for p in plans if p.spec.made_by == "operator"])
    if inputs is None or (ours is not None and ours.spec.inputs_digest == inputs.digest):
        return _Solved(last, solve)
    if solve is None or solve.inputs_digest != inputs.digest:
        return _solve_or_wait(observed, settings, inputs, last)
    return _record_solve(observed, settings, inputs, ours, solve)


def _solve_or_wait(
    observed: Observed,
    settings: ReconcileSettings,
    inputs: SolveInputs,
    last: SolveRecord | None,
) -> SolveAction | _Solved:
    """Ask for a solve, unless the same inputs failed before: permanently (never again) or
    transiently less than ``solver_error_retry_s`` ago (wait for the rest of it)."""
    failed_before = (
        last is not None and last.outcome == "Failed" and last.inputs_digest == inputs.digest
    )
    retry_in = 0.0
    if failed_before and last is not None and last.reason not in PERMANENT_SOLVE_REASONS:
        t = parse_time(last.time)
        elapsed = (observed.now - t).total_seconds() if t else settings.solver_error_retry_s
        retry_in = max(0.0, settings.solver_error_retry_s - elapsed)
    if not failed_before or (
        last is not None and last.reason not in PERMANENT_SOLVE_REASONS and retry_in <= 0
    ):
        return SolveAction(inputs.request, inputs.digest, next_version(observed))
    return _Solved(last, observed.solve, retry_in_s=retry_in if retry_in > 0 else None)


def _record_solve(
    observed: Observed,
    settings: ReconcileSettings,
    inputs: SolveInputs,
    ours: PlanView | None,
    solve: SolveOutcome,
) -> _Solved:
    """Record the outcome of this tick's solve and build the PartitionPlan it placed; a
    plan that cannot be written (``PlanTooLarge``) turns the outcome into a failure."""
    record = SolveRecord(
        inputs_digest=solve.inputs_digest,
        outcome="Succeeded" if solve.plan is not None else "Failed",
        reason=solve.reason,
        time=rfc3339(observed.now),
        duration_s=round(solve.duration_s, 3),
    )
    created: tuple[Json, PlanView] | None = None
    if solve.plan is not None:
        try:
            created = plan_object(
                observed, solve.plan, solve.inputs_digest, plan_reason(observed, ours, inputs)
            )
        except PermanentError as exc:
            record = dataclasses.replace(record, outcome="Failed", reason=exc.reason)
            solve = dataclasses.replace(solve, plan=None, reason=exc.reason, message=str(exc))
    retry_in_s = (
        settings.solver_error_retry_s
        if solve.plan is None and solve.reason not in PERMANENT_SOLVE_REASONS
        else None
    )
    return _Solved(record, solve, created, retry_in_s)


def _export_rule(
    observed: Observed, current: PlanView | None
) -> tuple[list[Action], bool, PermanentError | None]:
    """The engine export of the current plan: ``(actions, wanted, error)`` - the ConfigMap
    applied when it is missing or stale, deleted when no longer wanted; ``wanted`` when the
    deployment asks for an export and has a plan; ``error`` when the export failed."""
    d = observed.deployment
    spec = d.spec
    cm_wanted = current is not None and spec is not None and spec.engine_format != "none"
    if cm_wanted and current is not None and spec is not None:
        cm = observed.config_map
        wanted_keys = config_map_keys(spec)
        if cm is None or cm.plan != current.name or tuple(sorted(cm.keys)) != wanted_keys:
            try:
                body = config_map_object(observed, current, spec.engine_format)
            except InputError as exc:
                return [], cm_wanted, PermanentError("ExportFailed", str(exc))
            return [ApplyConfigMap(body, config_map_name(d.name))], cm_wanted, None
    elif observed.config_map is not None:
        return [DeleteConfigMap(observed.config_map.name)], cm_wanted, None
    return [], cm_wanted, None


def _prune_plans(
    plans: list[PlanView], current: PlanView | None, settings: ReconcileSettings
) -> list[Action]:
    """Delete all but the ``plan_history`` newest plans; the current one always survives."""
    keep = {
        p.name
        for p in sorted(plans, key=lambda p: -p.spec.version)[: max(1, settings.plan_history)]
    }
    return [
        DeletePlan(p.name, p.uid)
        for p in sorted(plans, key=lambda p: p.spec.version)
        if p.name not in keep and (current is None or p.name != current.name)
    ]


def status_apply(observed: Observed, status: ModelDeploymentStatus) -> ApplyStatus | None:
    """Apply the status when it differs from the observed one. ``committedVersion`` and
    ``controller`` belong to the controller's field manager: compare with them carried
    over, apply without them."""
    d = observed.deployment
    seen = dataclasses.replace(
        status, committed_version=d.status.committed_version, controller=d.status.controller
    )
    if to_wire(seen) != to_wire(d.status):
        return ApplyStatus(to_wire(status))
    return None


def _tier_step(
    observed: Observed, settings: ReconcileSettings, t_in: TierInputs
) -> TierAction | tuple[TiersStatus, float]:
    """The split to use this tick and seconds until a failed one is retried (0: none), or
    the action that plans it. A split recorded for the same inputs is reused."""
    now = observed.now
    fresh = observed.tiers
    if fresh is not None and fresh.inputs_digest == t_in.digest:
        st = tiers_status(fresh, observed, now)
        transient = st.outcome == "Failed" and st.reason not in PERMANENT_TIER_REASONS
        return st, settings.solver_error_retry_s if transient else 0.0
    prev = observed.deployment.status.tiers
    if prev is not None and prev.inputs_digest == t_in.digest:
        if prev.outcome == "Succeeded" or prev.reason in PERMANENT_TIER_REASONS:
            return prev, 0.0
        t = parse_time(prev.time)
        elapsed = (now - t).total_seconds() if t else settings.solver_error_retry_s
        if elapsed < settings.solver_error_retry_s:
            return prev, settings.solver_error_retry_s - elapsed
    if t_in.error is not None:
        failed = TiersStatus(
            inputs_digest=t_in.digest,
            outcome="Failed",
            reason=t_in.error.reason,
            message=str(t_in.error)[:8192],
            time=rfc3339(now),
        )
        return failed, 0.0
    assert t_in.request is not None  # built whenever there is no error
    return TierAction(t_in.request, t_in.digest)


def finalize(observed: Observed) -> tuple[Action, ...]:
    """Deletion: remove the ConfigMap and the PartitionPlans, then the finalizer."""
    d = observed.deployment
    if FINALIZER not in d.finalizers:
        return ()
    actions: list[Action] = []
    if observed.config_map is not None:
        actions.append(DeleteConfigMap(observed.config_map.name))
    actions += [DeletePlan(p.name, p.uid) for p in observed.plans if not p.deleting]
    if observed.config_map is None and not observed.plans:
        actions.append(SetFinalizer(False))
    else:
        actions.append(Requeue(1.0))
    return tuple(actions)
