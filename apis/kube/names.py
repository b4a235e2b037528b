"""Names, labels, annotations and times that the operator and the controller's Kubernetes
store both read or write, so the two agree on them by construction."""

from __future__ import annotations

from datetime import UTC, datetime

FINALIZER = "mixfleet.io/cleanup"
LABEL_DEPLOYMENT = "mixfleet.io/deployment"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "mixfleet-operator"
ANNOTATION_PLAN = "mixfleet.io/plan"
ANNOTATION_PLAN_VERSION = "mixfleet.io/plan-version"
ANNOTATION_PLAN_ID = "mixfleet.io/plan-id"
LABEL_INSTANCE_OF = "mixfleet.io/instance-of"
"""Label of an engine instance's ModelDeployment: the name of the ModelDeployment it serves
(which owns it)."""


def rfc3339(t: datetime) -> str:
    """``2026-01-02T03:04:05Z`` (UTC, whole seconds, as Kubernetes writes times)."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | None) -> datetime | None:
    """An RFC 3339 time, or None."""
    if not s:
        return None
    try:
        t = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def config_map_name(deployment: str) -> str:
    """Name of a deployment's ConfigMap: ``<deployment>-placement``."""
    return f"{deployment}-placement"


def plan_name(deployment: str, version: int) -> str:
    """Name of a PartitionPlan: ``<deployment>-v<version>``."""
    return f"{deployment}-v{version}"
