"""Builders for the operator tests: GPU fleets, GPUNode / ModelDeployment / PlacementPolicy
objects and the pure reconciler's observations."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from apis.kube.gpunode import gpunode_status
from apis.kube.schema import from_wire
from apis.kube.v1alpha1 import (
    API_VERSION,
    GPUNodeSpec,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    PartitionPlanStatus,
    PlacementPolicySpec,
)
from operators.decide import SolveAction
from operators.observe import DeploymentView, NodeView, Observed, PlanView, SolveOutcome
from policies.hardware.fleet import parse_node
from policies.hardware.inventory import NodeInventory, inventory_from_node
from policies.solve import solve

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)

#: Small GPU nodes: two GPUs each, so a qwen3-30b-a3b or mixtral-8x7b plan solves in ~1 s.
NODE_SPECS: dict[str, dict[str, Any]] = {
    "h100-0": {
        "gpus": [{"model": "H100-SXM5-80GB", "count": 2}],
        "nvlink": {"per_gpu_bidir_gbytes_per_s": 900},
    },
    "h100-1": {
        "gpus": [{"model": "H100-SXM5-80GB", "count": 2}],
        "nvlink": {"per_gpu_bidir_gbytes_per_s": 900},
    },
    "a100-0": {
        "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
        "nvlink": {"per_gpu_bidir_gbytes_per_s": 600},
    },
    "l40s-0": {"gpus": [{"model": "L40S", "count": 2}]},
}
TIERS = {"h100-0": "hopper", "h100-1": "hopper", "a100-0": "ampere", "l40s-0": "ada"}


def inventory(name: str, spec_name: str | None = None) -> NodeInventory:
    """The (simulated) inventory an agent on node ``name`` reports."""
    doc = dict(NODE_SPECS[spec_name or name])
    doc["name"] = name
    doc.setdefault("nics", [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib0"}])
    return inventory_from_node(parse_node(doc))


def node_view(
    name: str,
    *,
    heartbeat: datetime = T0,
    cordon: bool = False,
    tier: str | None = None,
    labels: Mapping[str, str] | None = None,
    inv: NodeInventory | None = None,
) -> NodeView:
    """A GPUNode as the reconciler observes it."""
    return NodeView(
        name=name,
        labels=dict(labels or {"rack": "r1"}),
        spec=GPUNodeSpec(cordon=cordon, tier=tier if tier is not None else TIERS.get(name, "")),
        status=gpunode_status(inv or inventory(name), heartbeat),
    )


def md_spec(**spec: Any) -> ModelDeploymentSpec:
    """A ModelDeployment spec from wire fields (defaults: mixtral-8x7b decode, small batch,
    exported for vLLM: SGLang cannot load a Mixtral placement)."""
    doc: dict[str, Any] = {
        "model": "mixtral-8x7b",
        "engineFormat": "vllm",
        "workload": {"phase": "decode", "tokensPerGpu": 16, "contextLen": 2048},
    }
    doc.update(spec)
    return from_wire(ModelDeploymentSpec, doc, "spec")


def deployment(
    spec: ModelDeploymentSpec | None = None,
    *,
    generation: int = 1,
    finalizers: Sequence[str] = ("mixfleet.io/cleanup",),
    deleting: bool = False,
    status: ModelDeploymentStatus | None = None,
) -> DeploymentView:
    return DeploymentView(
        name="mx",
        namespace="team-a",
        uid="uid-mx",
        generation=generation,
        finalizers=tuple(finalizers),
        deleting=deleting,
        spec=spec or md_spec(),
        status=status or ModelDeploymentStatus(),
    )


FAST_POLICY = PlacementPolicySpec(policy="greedy", solver_time_limit_s=5.0)


def observed(
    d: DeploymentView | None = None,
    nodes: Sequence[NodeView] | None = None,
    *,
    plans: Sequence[PlanView] = (),
    policy: PlacementPolicySpec = FAST_POLICY,
    now: datetime = T0 + timedelta(seconds=5),
    **kw: Any,
) -> Observed:
    return Observed(
        deployment=d or deployment(),
        nodes=tuple(nodes if nodes is not None else [node_view("h100-0"), node_view("a100-0")]),
        plans=tuple(plans),
        config_map=kw.pop("config_map", None),
        policy=policy,
        now=now,
        **kw,
    )


def run_solve(action: SolveAction) -> SolveOutcome:
    """Solve for real (small models, greedy: milliseconds)."""
    result = solve(action.request)
    return SolveOutcome(action.inputs_digest, result.plan, "Solved", "", 0.01)


def plan_view_from(
    body: dict[str, Any], *, uid: str = "uid-plan", status: PartitionPlanStatus | None = None
) -> PlanView:
    """The PlanView of an ApplyPlan body (as if the API server stored it)."""
    from apis.kube.v1alpha1 import PartitionPlanSpec

    return PlanView(
        name=body["metadata"]["name"],
        uid=uid,
        spec=from_wire(PartitionPlanSpec, body["spec"], "spec"),
        status=status or PartitionPlanStatus(),
    )


def with_status(d: DeploymentView, status_wire: dict[str, Any]) -> DeploymentView:
    return dataclasses.replace(d, status=from_wire(ModelDeploymentStatus, status_wire, "status"))


def md_object(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    """A ModelDeployment object for the API (Mixtral, so exported for vLLM)."""
    doc: dict[str, Any] = {
        "model": "mixtral-8x7b",
        "engineFormat": "vllm",
        "workload": {"phase": "decode", "tokensPerGpu": 16, "contextLen": 2048},
    }
    doc.update(spec)
    return {
        "apiVersion": API_VERSION,
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": doc,
    }


def policy_object(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "PlacementPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


def propose_plan(kube: Any, namespace: str, deployment: str, plan: Any, *, reason: str = "") -> int:
    """Write a PartitionPlan for ``deployment`` the way the operator does (madeBy operator,
    the next version above every earlier one, owned by its ModelDeployment); returns the
    version. The controller's store only rolls such plans out, it never writes one."""
    import dataclasses

    from apis.kube.client import MODEL_DEPLOYMENTS, PARTITION_PLANS
    from apis.kube.plancodec import plan_spec
    from apis.kube.schema import to_wire
    from apis.kube.versions import read_floor, record_version

    md = kube.get(MODEL_DEPLOYMENTS, deployment, namespace)
    if md is None:
        raise LookupError(f"no ModelDeployment {deployment}")
    items, _ = kube.list(
        PARTITION_PLANS, namespace, label_selector=f"mixfleet.io/deployment={deployment}"
    )
    version = (
        max([int(p["spec"]["version"]) for p in items] + [read_floor(kube, namespace, deployment)])
        + 1
    )
    spec = dataclasses.replace(
        plan_spec(
            dataclasses.replace(plan, version=version),
            deployment=deployment,
            inputs_digest=f"operator-digest-{version}",
            deployment_generation=int(md["metadata"].get("generation") or 1),
        ),
        made_by="operator",
        reason=reason,
    )
    kube.create(
        PARTITION_PLANS,
        {
            "apiVersion": "mixfleet.io/v1alpha1",
            "kind": "PartitionPlan",
            "metadata": {
                "name": f"{deployment}-v{version}",
                "namespace": namespace,
                "labels": {
                    "mixfleet.io/deployment": deployment,
                    "app.kubernetes.io/managed-by": "mixfleet-operator",
                },
                "ownerReferences": [
                    {
                        "apiVersion": "mixfleet.io/v1alpha1",
                        "kind": "ModelDeployment",
                        "name": deployment,
                        "uid": md["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": to_wire(spec),
        },
    )
    record_version(kube, namespace, deployment, version)
    return version
