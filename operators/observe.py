"""What one reconcile of one ModelDeployment reads: views of the deployment, its GPUNodes,
PartitionPlans and ConfigMap, the outcomes of a solve or tier split run this tick, and the
knobs of the decision; plus how the plans among them are read (current, newest, next
version) and how the Kubernetes objects are read into the views (:func:`deployment_view`,
:func:`node_view`, :func:`plan_view`, :func:`config_map_view`). Frozen dataclasses, no I/O:
:mod:`operators.operator` fetches the objects and fills them in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from apis.kube.schema import from_wire
from apis.kube.v1alpha1 import (
    GPUNodeSpec,
    GPUNodeStatus,
    InstanceRecordStatus,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    PartitionPlanSpec,
    PartitionPlanStatus,
    PlacementPolicySpec,
)
from policies.advice.tiers import TierPlan
from policies.errors import InputError
from policies.launch import PlannedInstance
from policies.plan import Plan


@dataclass(frozen=True)
class NodeView:
    """A GPUNode as observed.

    Attributes:
        name: GPUNode name (the Kubernetes node name).
        labels: GPUNode metadata labels (what gpuNodeSelector matches).
        spec: cordon and tier.
        status: inventory, health and heartbeat.
        deleting: has a deletionTimestamp.
        error: why its spec or status does not parse ("" when they do): kept out of
            placement with this reason.
    """

    name: str
    labels: Mapping[str, str]
    spec: GPUNodeSpec
    status: GPUNodeStatus
    deleting: bool = False
    error: str = ""


@dataclass(frozen=True)
class PlanView:
    """A PartitionPlan of the deployment as observed.

    Attributes:
        name: object name.
        uid: object uid.
        spec: the immutable plan.
        status: per-node rollout.
        deleting: has a deletionTimestamp.
    """

    name: str
    uid: str
    spec: PartitionPlanSpec
    status: PartitionPlanStatus
    deleting: bool = False


@dataclass(frozen=True)
class ConfigMapView:
    """The deployment's ConfigMap as observed.

    Attributes:
        name: object name.
        plan: PartitionPlan name in its ``mixfleet.io/plan`` annotation.
        keys: data keys it holds.
    """

    name: str
    plan: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class DeploymentView:
    """A ModelDeployment as observed.

    Attributes:
        name, namespace, uid: identity.
        generation: metadata.generation (bumped by spec changes only).
        finalizers: metadata.finalizers.
        deleting: has a deletionTimestamp.
        spec: the parsed spec, or None when it does not parse (see ``spec_error``).
        spec_error: why the spec did not parse.
        status: the status as last written.
    """

    name: str
    namespace: str
    uid: str
    generation: int
    finalizers: tuple[str, ...]
    deleting: bool
    spec: ModelDeploymentSpec | None
    status: ModelDeploymentStatus
    spec_error: str = ""


@dataclass(frozen=True)
class SolveOutcome:
    """The result of running a :class:`SolveAction`.

    Attributes:
        inputs_digest: digest of the inputs solved.
        plan: the plan, or None when the solve failed.
        reason: ``Solved`` or the failure's condition reason.
        message: failure message (with "To fix:"), empty on success.
        duration_s: wall time of the solve, seconds.
    """

    inputs_digest: str
    plan: Plan | None
    reason: str
    message: str = ""
    duration_s: float = 0.0


@dataclass(frozen=True)
class TierOutcome:
    """The result of running a :class:`TierAction`.

    Attributes:
        inputs_digest: digest of the inputs planned.
        plan: the split, or None when planning failed.
        reason: ``Planned`` or the failure's condition reason (``InvalidTier``,
            ``TierPlanningFailed``).
        message: failure message (with "To fix:"), empty on success.
        duration_s: wall time of the planning, seconds.
    """

    inputs_digest: str
    plan: TierPlan | None
    reason: str
    message: str = ""
    duration_s: float = 0.0


@dataclass(frozen=True)
class ChildView:
    """An engine instance's ModelDeployment (label ``mixfleet.io/instance-of``) as its
    parent's reconcile observes it.

    Attributes:
        name: object name (the instance's name).
        uid: object uid.
        owner_uid: uid of its controller ownerReference ("" when none).
        spec: its spec as stored (wire form).
        status: its status as last written.
        deleting: has a deletionTimestamp.
    """

    name: str
    uid: str
    owner_uid: str
    spec: Mapping[str, object]
    status: ModelDeploymentStatus
    deleting: bool = False


@dataclass(frozen=True)
class ParentPlan:
    """What the operator's fleet plan makes of a ModelDeployment that states its traffic and
    SLOs (:func:`policies.fleetplan.instances.is_planned`).

    Attributes:
        instances: its engine instances, pool by pool (names kept across re-plans).
        demand_requests_per_s: the demand it is planned for, requests per second: its
            stated one, or the measured one the controller chose after a drift.
        served_requests_per_s: what the plan serves within the SLO, requests per second.
        shortfall: ``(resource, message)`` when the plan serves only part of the demand
            (resource: gpus, budget, slo or nodes); None when it serves all of it.
        error: why it could not be planned ("" when it was): the condition's message.
        demand_from: ``Spec`` (the stated demand) or ``Measured`` (the controller's choice
            after a sustained drift, ``status.controller.demand``).
        replan_reason: why the controller chose the measured demand ("" for ``Spec``).
    """

    instances: tuple[PlannedInstance, ...] = ()
    demand_requests_per_s: float = 0.0
    served_requests_per_s: float = 0.0
    shortfall: tuple[str, str] | None = None
    error: str = ""
    demand_from: str = "Spec"
    replan_reason: str = ""


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile of one deployment looks at.

    Attributes:
        deployment: the ModelDeployment.
        nodes: every GPUNode.
        plans: the deployment's PartitionPlans (label ``mixfleet.io/deployment``).
        config_map: its ConfigMap, if any.
        policy: the PlacementPolicy spec that applies (referenced, default, or built-in).
        policy_name: its name ("" for built-in defaults).
        policy_missing: name of a referenced policy that does not exist ("" if none).
        policy_error: why the policy that applies does not parse ("" when it does).
        now: the time of the observation (UTC).
        solve: outcome of the solve this tick ran, if any.
        version_floor: highest plan version ever used for this deployment name (also by
            deleted incarnations); new versions are above it.
        tiers: outcome of the tier split this tick ran, if any.
        unreadable_plans: ``name: why`` of the deployment's PartitionPlans that do not
            parse (left alone; reported in the Degraded condition).
        assigned_nodes: the GPUNodes the fleet scheduler (:mod:`policies.scheduling`) gives
            this deployment; None = every eligible GPUNode (no scheduler).
        unschedulable: why the fleet scheduler gives it none (its Pending reason).
        planned: the fleet plan of a deployment planned from its traffic and SLOs (it runs
            as the instances there); None for any other.
        children: the instances' ModelDeployments labelled as serving it.
        instance: the record of an engine instance's ModelDeployment (written into its
            status); None for any other.
    """

    deployment: DeploymentView
    nodes: tuple[NodeView, ...]
    plans: tuple[PlanView, ...]
    config_map: ConfigMapView | None
    policy: PlacementPolicySpec
    now: datetime
    policy_name: str = ""
    policy_missing: str = ""
    policy_error: str = ""
    solve: SolveOutcome | None = None
    version_floor: int = 0
    tiers: TierOutcome | None = None
    unreadable_plans: tuple[str, ...] = ()
    assigned_nodes: tuple[str, ...] | None = None
    unschedulable: str = ""
    planned: ParentPlan | None = None
    children: tuple[ChildView, ...] = ()
    instance: InstanceRecordStatus | None = None


@dataclass(frozen=True)
class ReconcileSettings:
    """Knobs of the decision.

    Attributes:
        node_stale_after_s: a GPUNode whose last heartbeat is older is left out, seconds.
        plan_history: PartitionPlans kept per deployment (newest first, current included).
        solver_error_retry_s: wait before re-solving after a solver failure that may be
            transient, seconds.
        field_manager: server-side apply field manager (recorded nowhere in the decision,
            kept here so all knobs travel together).
    """

    node_stale_after_s: float = 90.0
    plan_history: int = 3
    solver_error_retry_s: float = 60.0
    field_manager: str = "mixfleet-operator"


def newest_plan(plans: Sequence[PlanView]) -> PlanView | None:
    """The newest PartitionPlan that is not being deleted (what the operator compares its
    inputs with: a plan it wrote and the controller has not committed yet still counts)."""
    live = [p for p in plans if not p.deleting]
    return max(live, key=lambda p: p.spec.version) if live else None


def current_plan(plans: Sequence[PlanView]) -> PlanView | None:
    """The plan the deployment serves: the committed PartitionPlan (the controller commits
    it when every agent has prepared it), else - before any commit, or with no controller
    rolling plans out - the newest one that is not being deleted. Status, ConfigMap and
    ``plans history`` all name this plan."""
    live = [p for p in plans if not p.deleting]
    committed = [p for p in live if p.status.state == "Committed"]
    pool = committed or live
    return max(pool, key=lambda p: p.spec.version) if pool else None


def next_version(observed: Observed) -> int:
    """The version a new plan gets: above every existing plan and every recorded version."""
    return max([observed.version_floor, *(p.spec.version for p in observed.plans)]) + 1


def node_view(obj: Mapping[str, Any]) -> NodeView:
    """A GPUNode object as observed; one that does not parse is kept out of placement,
    saying why (cordoned, with ``error`` set)."""
    meta = obj.get("metadata") or {}
    error = ""
    try:
        spec = from_wire(GPUNodeSpec, obj.get("spec") or {}, "spec", strict=True)
    except InputError as exc:
        spec, error = GPUNodeSpec(cordon=True), f"its spec does not parse: {exc}"
    try:
        status = from_wire(GPUNodeStatus, obj.get("status") or {}, "status")
    except InputError as exc:
        status, error = GPUNodeStatus(), error or f"its status does not parse: {exc}"
    return NodeView(
        name=str(meta.get("name")),
        labels=dict(meta.get("labels") or {}),
        spec=spec,
        status=status,
        deleting=bool(meta.get("deletionTimestamp")),
        error=error,
    )


def deployment_view(obj: Mapping[str, Any], namespace: str, name: str) -> DeploymentView:
    """The ModelDeployment ``namespace/name`` (object ``obj``) as observed; a spec that does
    not parse is None with ``spec_error`` saying why, a status that does not parse is empty."""
    meta = obj.get("metadata") or {}
    spec: ModelDeploymentSpec | None = None
    spec_error = ""
    try:
        spec = from_wire(ModelDeploymentSpec, obj.get("spec") or {}, "spec", strict=True)
    except InputError as exc:
        spec_error = str(exc)
    try:
        status = from_wire(ModelDeploymentStatus, obj.get("status") or {}, "status")
    except InputError:
        status = ModelDeploymentStatus()
    return DeploymentView(
        name=name,
        namespace=namespace,
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 0),
        finalizers=tuple(meta.get("finalizers") or ()),
        deleting=bool(meta.get("deletionTimestamp")),
        spec=spec,
        status=status,
        spec_error=spec_error,
    )


def plan_view(obj: Mapping[str, Any]) -> PlanView | str:
    """The PartitionPlan object ``obj`` as observed, or why its spec does not parse (it is
    then left alone); a status that does not parse is empty."""
    meta = obj.get("metadata") or {}
    try:
        spec = from_wire(PartitionPlanSpec, obj.get("spec") or {}, "spec", strict=True)
    except InputError as exc:
        return str(exc)
    try:
        status = from_wire(PartitionPlanStatus, obj.get("status") or {}, "status")
    except InputError:
        status = PartitionPlanStatus()
    return PlanView(
        name=str(meta.get("name")),
        uid=str(meta.get("uid") or ""),
        spec=spec,
        status=status,
        deleting=bool(meta.get("deletionTimestamp")),
    )


def config_map_view(cm: Mapping[str, Any]) -> ConfigMapView:
    """The deployment's ConfigMap object ``cm`` as observed."""
    meta = cm.get("metadata") or {}
    return ConfigMapView(
        name=str(meta.get("name")),
        plan=str((meta.get("annotations") or {}).get("mixfleet.io/plan", "")),
        keys=tuple(sorted((cm.get("data") or {}).keys())),
    )


def held_version(plan: Mapping[str, Any]) -> int:
    """The version a PartitionPlan that does not parse holds: its ``spec.version`` when that
    is a number, else the ``-vN`` of its name (0 when neither says)."""
    raw = (plan.get("spec") or {}).get("version")
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    m = re.search(r"-v(\d+)$", str((plan.get("metadata") or {}).get("name") or ""))
    return int(m.group(1)) if m else 0
