"""The objects the operator writes for a deployment: the PartitionPlan body (name, labels,
owner reference, immutable spec and why it was made) and the ConfigMap of the engine
export (one file per engine format plus the sidecar) and, for a deployment whose
``spec.engine`` is that engine, the launch recipe (:mod:`policies.launch`: ``launch.sh``,
``launch.json``, and TensorRT-LLM's options YAML) with its paths under :data:`MOUNT_DIR`,
which ``examples/k8s/sglang-engine.yaml`` runs; an engine instance's ConfigMap launches it
as its role (prefill or decode with its pool's KV transfer: its ``status.instance``). Pure:
bodies for server-side apply.
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
    ModelDeploymentSpec,
    PartitionPlanStatus,
)
from operators.inputs import (
    SolveInputs,
    model_of,
)
from operators.observe import (
    DeploymentView,
    Observed,
    PlanView,
    next_version,
)
from policies.errors import InputError
from policies.exports.engine import export_plan, export_sidecar
from policies.launch import (
    KvTransfer,
    failing_script,
    launch_recipe,
    launch_script,
    recipe_to_doc,
)
from policies.launch.types import SGLANG_BOOTSTRAP_PORT as BOOTSTRAP_PORT
from policies.plan import Plan

#: ConfigMap key of each engine format's file (mount the ConfigMap; pass the file path).
ENGINE_FILES = {
    "sglang": "expert-location.json",
    "vllm": "eplb-state.json",
    "trtllm": "moe-load-balancer.json",
}


SIDECAR_FILE = "placement-sidecar.json"
LAUNCH_SCRIPT = "launch.sh"
LAUNCH_FILE = "launch.json"
#: TensorRT-LLM's LLM API options (written as JSON, which is YAML).
TRTLLM_OPTIONS_KEY = "llm-api-options.yaml"
MOUNT_DIR = "/etc/mixfleet"
"""Where an engine pod mounts the ConfigMap: the launch recipe's file paths point here."""


def launch_engine(spec: ModelDeploymentSpec) -> str | None:
    """The engine whose launch recipe the ConfigMap carries: ``spec.engine`` when it is the
    engine of the exported file, else None (a native deployment publishes the file alone)."""
    name = spec.engine.name if spec.engine is not None else "native"
    return name if name == spec.engine_format else None


def config_map_keys(spec: ModelDeploymentSpec) -> tuple[str, ...]:
    """The keys of the deployment's ConfigMap, sorted."""
    keys = [ENGINE_FILES[spec.engine_format], SIDECAR_FILE]
    engine = launch_engine(spec)
    if engine is not None:
        keys += [LAUNCH_SCRIPT, LAUNCH_FILE]
    if engine == "trtllm":
        keys.append(TRTLLM_OPTIONS_KEY)
    return tuple(sorted(keys))


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
    model = model_of(d.spec, d.name) if d.spec is not None else None
    doc = export_plan(plan, engine_format, model)
    data = {
        ENGINE_FILES[engine_format]: json.dumps(doc, separators=(",", ":")),
        SIDECAR_FILE: json.dumps(export_sidecar(plan), separators=(",", ":")),
    }
    if d.spec is not None and launch_engine(d.spec) is not None:
        rec = observed.instance  # an engine instance launches as its role
        role = rec.role if rec is not None else "aggregated"
        kv = None
        if rec is not None and role != "aggregated":
            kv = KvTransfer(rec.kv_path, bootstrap_port=rec.bootstrap_port or BOOTSTRAP_PORT)
        data.update(launch_data(plan, d.spec, d.name, role=role, kv=kv))
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


def launch_data(
    plan: Plan,
    spec: ModelDeploymentSpec,
    name: str,
    *,
    role: str = "aggregated",
    kv: KvTransfer | None = None,
) -> dict[str, str]:
    """The launch recipe's ConfigMap entries, for an instance of ``role`` (a prefill or
    decode instance with its pool's ``kv``: :func:`policies.launch.launch_recipe`). A plan
    the engine cannot run as predicted (made for another engine, say, while a re-plan is
    pending, or a pool whose KV path the engine's transfer backend cannot use) gets a
    ``launch.sh`` that exits saying why, so an engine pod never starts on the wrong
    placement."""
    engine = launch_engine(spec)
    try:
        recipe = launch_recipe(
            plan,
            model_of(spec, name),
            engine=engine,
            placement_path=f"{MOUNT_DIR}/{ENGINE_FILES[spec.engine_format]}",
            options_path=f"{MOUNT_DIR}/{TRTLLM_OPTIONS_KEY}",
            role=role,
            kv=kv,
        )
    except InputError as exc:
        out = {
            LAUNCH_SCRIPT: failing_script(str(exc)),
            LAUNCH_FILE: json.dumps({"error": str(exc)}),
        }
        if engine == "trtllm":
            out[TRTLLM_OPTIONS_KEY] = "{}"
        return out
    out = {
        LAUNCH_SCRIPT: launch_script(recipe),
        LAUNCH_FILE: json.dumps(recipe_to_doc(recipe), separators=(",", ":")),
    }
    for path, doc in recipe.files.items():
        out[path.removeprefix(f"{MOUNT_DIR}/")] = json.dumps(doc, separators=(",", ":"))
    return out
