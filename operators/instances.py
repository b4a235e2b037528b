"""ModelDeployments planned from their traffic and SLOs run as engine instances: the
operator's part of the fleet plan, and the instances' own ModelDeployments.

In Kubernetes mode the operator owns the plan decisions, so it is the one writer of
instances. A ModelDeployment that states ``traffic`` and ``slo``
(:func:`policies.fleetplan.instances.is_planned`) is planned by
:func:`policies.fleetplan.plan_fleet` in the operator's fleet schedule
(:mod:`operators.fleet_schedule`, :func:`plan_part`), the previous plan kept for the move
penalty. Each planned instance (:func:`policies.fleetplan.instances.plan_instances`, names
``<deployment>-<role>-<i>`` kept across re-plans) becomes a ModelDeployment the operator
creates and owns (:func:`child_object`): an ownerReference to the deployment it serves, the
label ``mixfleet.io/instance-of``, and as spec :func:`policies.launch.instance_spec` of the
parent's resolved spec through the CRD codec. The fleet schedule pins it to its planned
GPUNodes; everything downstream (its PartitionPlan, its engine ConfigMap with the
instance's role and KV transfer, the controller's rollout) then works per instance.

Units: requests per second; ports are TCP port numbers. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from apis.kube.demand import Replanned
from apis.kube.errors import PermanentError
from apis.kube.names import LABEL_INSTANCE_OF, LABEL_MANAGED_BY, MANAGED_BY
from apis.kube.schema import Json, from_wire, to_wire
from apis.kube.v1alpha1 import (
    API_VERSION,
    InstanceRecordStatus,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    PlacementPolicySpec,
)
from operators.effective import effective_spec
from operators.observe import ChildView, DeploymentView, ParentPlan
from policies.errors import InputError
from policies.fleetplan import FleetPlan
from policies.fleetplan.instances import plan_instances
from policies.hardware.fleet import Node
from policies.launch import PlannedInstance, instance_spec
from policies.launch.types import SGLANG_BOOTSTRAP_PORT, SGLANG_SERVER_PORT
from policies.spec.build import DeploymentSpec, spec_to_doc

Key = tuple[str, str]

ENGINE_PORT = SGLANG_SERVER_PORT
"""The engine HTTP port of every instance (SGLang's default ``--port``, the lowest port the
standalone controller gives). An instance runs on GPUNodes of its own - the fleet planner
gives whole nodes, and a new instance waits until a draining one has left its nodes - so
one port serves them all."""

BOOTSTRAP_PORT = SGLANG_BOOTSTRAP_PORT
"""A prefill instance's SGLang bootstrap port (the launch recipe's default)."""


def is_child(obj: Json) -> bool:
    """Whether ``obj`` is an engine instance's ModelDeployment (label ``instance-of``)."""
    return bool(((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_INSTANCE_OF))


def parent_of(obj: Json) -> str:
    """The name of the ModelDeployment an instance's object serves ("" for others)."""
    return str(((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_INSTANCE_OF) or "")


@dataclass(frozen=True)
class PlannedEntry:
    """One planned ModelDeployment as the fleet schedule reads its plan (:func:`parent_plans`).

    Attributes:
        key: ``(namespace, name)``.
        spec: its spec resolved against its PlacementPolicy.
        eligible: its eligible GPUNodes.
        running: its instances running now (their names are kept where role and nodes
            stay), from the instances' ModelDeployments.
        replanned: the controller's choice of traffic after a drift, which ``spec``
            carries (None: ``spec`` has its stated traffic).
    """

    key: Key
    spec: DeploymentSpec
    eligible: tuple[Node, ...]
    running: tuple[PlannedInstance, ...] = ()
    replanned: Replanned | None = None


def parent_plans(
    entries: Sequence[PlannedEntry],
    plan: FleetPlan | None,
    names: Mapping[Key, str],
    chunk_tokens: int,
    error: str = "",
) -> dict[Key, ParentPlan]:
    """Per planned entry its :class:`ParentPlan` from the fleet plan (``names``: the name
    the planner knew it by; ``error``: why there is no plan). Instances are named after the
    deployment's own name, kept against its running ones; one planned for the measured
    demand the controller chose (``replanned``) says so (``demand_from``)."""
    out: dict[Key, ParentPlan] = {}
    for e in entries:
        pp = _parent_plan(e, plan, names[e.key], chunk_tokens, error)
        if e.replanned is not None:
            pp = dataclasses.replace(pp, demand_from="Measured", replan_reason=e.replanned.reason)
        out[e.key] = pp
    return out


def _parent_plan(
    e: PlannedEntry, plan: FleetPlan | None, name: str, chunk_tokens: int, error: str
) -> ParentPlan:
    """:func:`parent_plans` of one entry (``name``: the name the planner knew it by)."""
    demand = e.spec.traffic.requests_per_s if e.spec.traffic is not None else 0.0
    if plan is None:
        return ParentPlan((), demand, error=error or "not planned")
    dp = plan.deployments.get(name)
    short = plan.shortfalls.get(name)
    shortfall = (short.resource, short.message) if short is not None else None
    if dp is None:
        return ParentPlan((), demand, 0.0, shortfall, "the fleet plan left it out")
    try:
        mine = dataclasses.replace(dp, deployment=e.key[1])
        insts = plan_instances(mine, chunk_tokens, e.running)
    except InputError as exc:
        return ParentPlan((), demand, 0.0, shortfall, str(exc))
    return ParentPlan(insts, demand, dp.served_requests_per_s, shortfall)


def planner_names(keys: Sequence[Key]) -> dict[Key, str]:
    """The name the planner knows each deployment by: its own, or - when another namespace
    has a planned deployment of that name - the name with a digest of its namespace (the
    planner takes DNS labels only)."""
    import hashlib

    counts: dict[str, int] = {}
    for _, name in keys:
        counts[name] = counts.get(name, 0) + 1
    out = {}
    for ns, name in keys:
        if counts[name] == 1:
            out[(ns, name)] = name
        else:
            tag = hashlib.sha256(ns.encode()).hexdigest()[:8]
            out[(ns, name)] = f"{name[:54]}-{tag}"
    return out


def running_instances(children: Sequence[Json]) -> tuple[PlannedInstance, ...]:
    """The instances running now, read from their ModelDeployments' ``status.instance``
    (what :func:`policies.fleetplan.instances.keep_names` keeps names against)."""
    out = []
    for obj in children:
        rec = child_record(obj)
        if rec is None:
            continue
        name = str((obj.get("metadata") or {}).get("name") or "")
        out.append(PlannedInstance(name, rec.pool, rec.role, rec.nodes, 0, 1))
    return tuple(sorted(out, key=lambda i: i.name))


def child_views(objs: Sequence[Json], key: Key) -> tuple[ChildView, ...]:
    """The ModelDeployments among ``objs`` labelled as instances of ``key``, sorted by name."""
    out = []
    for o in objs:
        meta = o.get("metadata") or {}
        if parent_of(o) != key[1] or str(meta.get("namespace") or "") != key[0]:
            continue
        try:
            status = from_wire(ModelDeploymentStatus, o.get("status") or {}, "status")
        except InputError:
            status = ModelDeploymentStatus()
        owner: Json = next(
            (r for r in meta.get("ownerReferences") or () if r.get("controller")), {}
        )
        out.append(
            ChildView(
                name=str(meta.get("name")),
                uid=str(meta.get("uid") or ""),
                owner_uid=str(owner.get("uid") or ""),
                spec=dict(o.get("spec") or {}),
                status=status,
                deleting=bool(meta.get("deletionTimestamp")),
            )
        )
    return tuple(sorted(out, key=lambda c: c.name))


def child_record(obj: Json) -> InstanceRecordStatus | None:
    """The ``status.instance`` of an instance's ModelDeployment (None when absent or it does
    not read)."""
    doc = (obj.get("status") or {}).get("instance")
    if not isinstance(doc, Mapping):
        return None
    try:
        return from_wire(InstanceRecordStatus, dict(doc), "status.instance")
    except InputError:
        return None


def instance_record(parent: str, inst: PlannedInstance) -> InstanceRecordStatus:
    """The record an instance's ModelDeployment carries in ``status.instance``: the fields of
    the standalone controller's record, so the controller reads it the same in both modes."""
    return InstanceRecordStatus(
        of=parent,
        role=inst.role,
        pool=inst.pool,
        variant=inst.variant,
        nodes=inst.nodes,
        port=ENGINE_PORT,
        bootstrap_port=BOOTSTRAP_PORT if inst.role == "prefill" else 0,
        requests_per_s=round(inst.requests_per_s, 6),
        batch_limit=inst.batch_limit,
        capacity_requests_per_s=round(inst.capacity_requests_per_s, 6),
        ttft_ms=round(inst.ttft_ms, 3),
        tpot_ms=round(inst.tpot_ms, 3),
        kv_path=inst.kv_path,
    )


def child_spec(
    name: str, spec: ModelDeploymentSpec, policy: PlacementPolicySpec, inst: PlannedInstance
) -> ModelDeploymentSpec:
    """The spec of an instance's ModelDeployment: :func:`policies.launch.instance_spec` of the
    parent's spec resolved against its policy, through the CRD codec, with the parent's
    ``policyRef`` and ``engineFormat`` (the CRD's own fields).

    Raises:
        PermanentError: ``InvalidSpec`` when the parent's spec does not resolve.
    """
    resolved = effective_spec(name, spec, policy)
    doc = spec_to_doc(instance_spec(resolved, inst))["spec"]
    doc["engineFormat"] = spec.engine_format
    if spec.policy_ref is not None:
        doc["policyRef"] = to_wire(spec.policy_ref)
    try:
        return from_wire(ModelDeploymentSpec, doc, "spec", strict=True)
    except InputError as exc:
        raise PermanentError("InvalidSpec", f"instance {inst.name}: {exc}") from exc


def child_object(parent: DeploymentView, inst: PlannedInstance, spec: ModelDeploymentSpec) -> Json:
    """The instance's ModelDeployment for server-side apply: owned by ``parent`` (its
    controller; Kubernetes' garbage collector deletes it with the parent), labelled
    ``mixfleet.io/instance-of: <parent>``."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ModelDeployment",
        "metadata": {
            "name": inst.name,
            "namespace": parent.namespace,
            "labels": {LABEL_INSTANCE_OF: parent.name, LABEL_MANAGED_BY: MANAGED_BY},
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "ModelDeployment",
                    "name": parent.name,
                    "uid": parent.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": to_wire(spec),
    }


def extra_fields(live: Any, want: Any) -> Json:
    """A JSON merge patch that removes what ``live`` has beyond ``want`` (keys ``want`` does
    not set, at any depth of objects): what another writer added to an instance's spec,
    which the forced apply of ``want`` leaves in place. Empty when nothing is extra."""
    out: Json = {}
    if not isinstance(live, Mapping) or not isinstance(want, Mapping):
        return out
    for k, v in live.items():
        if k not in want:
            out[k] = None
        else:
            inner = extra_fields(v, want[k])
            if inner:
                out[k] = inner
    return out


def same_spec(live: Mapping[str, Any], want: ModelDeploymentSpec) -> bool:
    """Whether the stored spec reads as ``want`` (defaults filled in by the API server are
    not a difference; a spec that no longer parses is)."""
    try:
        return from_wire(ModelDeploymentSpec, dict(live), "spec", strict=True) == want
    except InputError:
        return False


__all__ = [
    "BOOTSTRAP_PORT",
    "ENGINE_PORT",
    "PlannedEntry",
    "child_object",
    "child_record",
    "child_spec",
    "child_views",
    "extra_fields",
    "instance_record",
    "is_child",
    "parent_of",
    "parent_plans",
    "planner_names",
    "running_instances",
    "same_spec",
]
