"""The objects the operator writes for a deployment: the PartitionPlan body (name, labels,
owner reference, immutable spec and why it was made) and the ConfigMap of the engine
export (one file per engine format plus the sidecar). Pure: bodies for server-side apply.
"""

from __future__ import annotations

import dataclasses
import json

from apis.kube.names import (
    ANNOTATION_PLAN,
    ANNOTATION_PLAN_ID,
    ANNOTATION_PLAN_VERSION,
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    config_map_name,
    plan_name,
)
from apis.kube.plancodec import decode_plan, plan_spec
from apis.kube.schema import Json, to_wire
from apis.kube.v1alpha1 import (
    API_VERSION,
    PartitionPlanStatus,
)
from operators.inputs import (
    SolveInputs,
)
from operators.observe import (
    DeploymentView,
    Observed,
    PlanView,
    next_version,
)
from policies.exports import export_plan, export_sidecar
from policies.plan import Plan

#: ConfigMap key of each engine format's file (mount the ConfigMap; pass the file path).
ENGINE_FILES = {
    "sglang": "expert-location.json",
    "vllm": "eplb-state.json",
    "trtllm": "moe-load-balancer.json",
}


SIDECAR_FILE = "placement-sidecar.json"


def owner_reference(d: DeploymentView) -> Json:
    return {
        "apiVersion": API_VERSION,
        "kind": "ModelDeployment",
        "name": d.name,
        "uid": d.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_labels(d: DeploymentView) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: d.name, LABEL_MANAGED_BY: MANAGED_BY}


def plan_reason(observed: Observed, ours: PlanView | None, inputs: SolveInputs) -> str:
    """Why a new plan is made, for the PartitionPlan's ``reason``."""
    d = observed.deployment
    if ours is None:
        return "first plan"
    if ours.spec.deployment_generation != d.generation:
        return f"spec changed (generation {d.generation})"
    now_nodes = {n.name for n in inputs.request.fleet.nodes}
    gone = sorted(set(ours.spec.nodes) - now_nodes)
    new = sorted(now_nodes - set(ours.spec.nodes))
    if gone or new:
        why = {**inputs.fleet_view.excluded, **inputs.reserved}
        parts = [f"-{n} ({why.get(n, 'not selected')})" for n in gone]
        parts += [f"+{n}" for n in new]
        return "fleet changed: " + ", ".join(parts)
    return "fleet or policy changed"


def plan_object(
    observed: Observed, plan: Plan, inputs_digest: str, reason: str
) -> tuple[Json, PlanView]:
    d = observed.deployment
    version = next_version(observed)
    plan = dataclasses.replace(plan, version=version)
    spec = dataclasses.replace(
        plan_spec(
            plan,
            deployment=d.name,
            inputs_digest=inputs_digest,
            deployment_generation=d.generation,
        ),
        made_by="operator",
        reason=reason[:1024],
    )
    name = plan_name(d.name, version)
    body: Json = {
        "metadata": {
            "name": name,
            "namespace": d.namespace,
            "labels": object_labels(d),
            "annotations": {ANNOTATION_PLAN_ID: plan.id},
            "ownerReferences": [owner_reference(d)],
        },
        "spec": to_wire(spec),
    }
    return body, PlanView(name, "", spec, PartitionPlanStatus())


def config_map_object(observed: Observed, current: PlanView, engine_format: str) -> Json:
    """The ConfigMap of the current plan's engine export.

    Raises:
        InputError: the plan cannot be exported (native form, dense model).
    """
    d = observed.deployment
    plan = decode_plan(current.spec)
    doc = export_plan(plan, engine_format)
    data = {
        ENGINE_FILES[engine_format]: json.dumps(doc, separators=(",", ":")),
        SIDECAR_FILE: json.dumps(export_sidecar(plan), separators=(",", ":")),
    }
    return {
        "metadata": {
            "name": config_map_name(d.name),
            "namespace": d.namespace,
            "labels": object_labels(d),
            "annotations": {
                ANNOTATION_PLAN: current.name,
                ANNOTATION_PLAN_VERSION: str(current.spec.version),
                ANNOTATION_PLAN_ID: current.spec.plan_id,
            },
            "ownerReferences": [owner_reference(d)],
        },
        "data": data,
    }
