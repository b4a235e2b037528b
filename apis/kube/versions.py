"""Plan versions that only grow, also across delete and re-create of a ModelDeployment.

PartitionPlans are garbage-collected with their ModelDeployment, so the highest version ever
used is kept apart, in one ConfigMap per namespace (``mixfleet-plan-versions``, data:
deployment name -> highest version). Whoever creates a PartitionPlan (the operator, or the
controller through its Kubernetes store) allocates ``max(recorded, existing) + 1``, creates
the plan (a name already taken is a 409: allocate again) and records the version with a
resourceVersion-guarded merge patch, retried on conflict.
"""

from __future__ import annotations

from apis.kube.client import CONFIGMAPS, Json, Kube
from apis.kube.errors import ConflictError

VERSIONS_CONFIGMAP = "mixfleet-plan-versions"
MANAGED_BY = {"app.kubernetes.io/managed-by": "mixfleet", "app.kubernetes.io/part-of": "mixfleet"}


def read_floor(kube: Kube, namespace: str, deployment: str) -> int:
    """The highest version recorded for ``deployment`` (0 when none)."""
    cm = kube.get(CONFIGMAPS, VERSIONS_CONFIGMAP, namespace)
    raw = ((cm or {}).get("data") or {}).get(deployment, "0")
    try:
        return int(raw)
    except ValueError:
        return 0


def record_version(
    kube: Kube, namespace: str, deployment: str, version: int, *, attempts: int = 8
) -> None:
    """Raise the recorded version of ``deployment`` to ``version`` (never lowers it).

    Raises:
        ConflictError: still conflicting after ``attempts`` read-modify-write rounds.
    """
    for _ in range(attempts):
        cm = kube.get(CONFIGMAPS, VERSIONS_CONFIGMAP, namespace)
        if cm is None:
            body: Json = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": VERSIONS_CONFIGMAP,
                    "namespace": namespace,
                    "labels": MANAGED_BY,
                },
                "data": {deployment: str(version)},
            }
            try:
                kube.create(CONFIGMAPS, body)
                return
            except ConflictError:
                continue
        data = cm.get("data") or {}
        try:
            current = int(data.get(deployment, "0"))
        except ValueError:
            current = 0
        if current >= version:
            return
        patch = {
            "metadata": {"resourceVersion": cm["metadata"]["resourceVersion"]},
            "data": {deployment: str(version)},
        }
        try:
            kube.merge_patch(CONFIGMAPS, VERSIONS_CONFIGMAP, patch, namespace)
            return
        except ConflictError:
            continue
    raise ConflictError(
        409, "Conflict", f"recording version {version} of {deployment}: too many conflicts"
    )
