"""GPUNode objects from agent inventories (what the controller's Kubernetes store writes
when an agent registers or heartbeats, and what tests use to stand up a fleet), and the one
CRD codec of a NodeInventory (:func:`inventory_to_crd` / :func:`inventory_from_crd`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from datetime import datetime

from apis.kube.names import rfc3339
from apis.kube.schema import Json, from_wire, to_wire
from apis.kube.v1alpha1 import API_VERSION, AgentSession, GPUNodeSpec, GPUNodeStatus, NodeHealth
from policies.hardware.inventory import NodeInventory


def node_health(inv: NodeInventory) -> NodeHealth:
    """Healthy when every GPU's health signals pass, Unhealthy when none does."""
    bad = tuple(g.index for g in inv.gpus if not g.health.healthy)
    if not inv.gpus:
        return NodeHealth("Unknown", (), "no GPUs reported")
    if not bad:
        return NodeHealth("Healthy")
    state = "Unhealthy" if len(bad) == len(inv.gpus) else "Degraded"
    return NodeHealth(state, bad, f"{len(bad)} of {len(inv.gpus)} GPUs fail health checks")


def gpu_summary(inv: NodeInventory) -> str:
    """``8x H100-SXM5-80GB`` (several models joined by ``, ``)."""
    counts = Counter(g.catalog_model or g.name for g in inv.gpus)
    return ", ".join(f"{n}x {m}" for m, n in sorted(counts.items()))


def gpunode_status(
    inv: NodeInventory, heartbeat: datetime, *, session: AgentSession | None = None
) -> GPUNodeStatus:
    """The status a GPUNode gets from its agent's report at ``heartbeat``."""
    return GPUNodeStatus(
        inventory=inv,
        health=node_health(inv),
        last_heartbeat_time=rfc3339(heartbeat),
        gpu_count=len(inv.gpus),
        gpu_summary=gpu_summary(inv),
        agent=session,
    )


def gpunode_object(
    name: str,
    *,
    spec: GPUNodeSpec | None = None,
    labels: Mapping[str, str] | None = None,
) -> Json:
    """A GPUNode object (metadata and spec; the status goes through ``/status``)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "GPUNode",
        "metadata": {"name": name, "labels": dict(labels or {})},
        "spec": to_wire(spec or GPUNodeSpec()),
    }


def inventory_to_crd(inv: NodeInventory) -> Json:
    """The one CRD form of an inventory (``GPUNode.status.inventory``: camelCase keys,
    written by :func:`apis.kube.schema.to_wire`). Inverse: :func:`inventory_from_crd`."""
    return to_wire(inv)


def inventory_from_crd(doc: Json, path: str = "status.inventory") -> NodeInventory:
    """Read ``GPUNode.status.inventory`` back (unknown keys ignored, as the API server
    prunes them).

    Raises:
        InputError: a required field is missing or malformed; ``field`` is its wire path.
    """
    return from_wire(NodeInventory, doc, path)
