"""What every part of the Kubernetes store shares: names, annotations, state spellings, time
format, and :class:`KubeBase` (API access and error wrapping)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from apis.kube.client import Kube
from apis.kube.errors import ApiError, OperatorError
from apis.kube.names import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, plan_name
from controlplane.errors import StoreError

__all__ = [
    "ACK_FROM_K8S",
    "ACK_TO_K8S",
    "ALLOWED_MOVES",
    "ANNOTATION_CREATED",
    "ANNOTATION_INPUTS",
    "ANNOTATION_SUMMARY",
    "ANNOTATION_UPDATED",
    "CONTROLLER_CONFIGMAP",
    "FIELD_MANAGER",
    "LABEL_DEPLOYMENT",
    "LABEL_LOAD",
    "LABEL_MANAGED_BY",
    "LOAD_SUFFIX",
    "MANAGED_BY",
    "MAX_LOAD_BYTES",
    "OPERATOR_ONLY_KEYS",
    "STATE_FROM_K8S",
    "STATE_TO_K8S",
    "KubeBase",
    "from_time",
    "plan_name",
    "to_time",
]

FIELD_MANAGER = "mixfleet-controller"
MANAGED_BY = "mixfleet-controller"
CONTROLLER_CONFIGMAP = "mixfleet-controller"
LOAD_SUFFIX = "-expert-load"
LABEL_LOAD = "mixfleet.io/expert-load"
ANNOTATION_CREATED = "mixfleet.io/created-at"
ANNOTATION_UPDATED = "mixfleet.io/updated-at"
ANNOTATION_SUMMARY = "mixfleet.io/summary"
ANNOTATION_INPUTS = "mixfleet.io/inputs-key"
#: Largest load-window document kept per deployment, bytes (ConfigMaps hold 1 MiB).
MAX_LOAD_BYTES = 900_000
#: The CRD keys the controller's deployment document does not have.
OPERATOR_ONLY_KEYS = ("policyRef", "engineFormat")

STATE_TO_K8S: dict[str, str] = {
    "proposed": "Proposed",
    "preparing": "Preparing",
    "committed": "Committed",
    "aborted": "Aborted",
    "superseded": "Superseded",
}
STATE_FROM_K8S = {v: k for k, v in STATE_TO_K8S.items()}
ACK_TO_K8S = {"prepared": "Prepared", "committed": "Committed", "failed": "Failed"}
ACK_FROM_K8S = {v: k for k, v in ACK_TO_K8S.items()}
ALLOWED_MOVES: dict[str, set[str]] = {
    "proposed": {"preparing", "aborted"},
    "preparing": {"preparing", "aborted"},
}


def to_time(s: float) -> str:
    """Unix seconds as RFC 3339 with microseconds, UTC."""
    return datetime.fromtimestamp(s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def from_time(text: str | None, default: float = 0.0) -> float:
    """RFC 3339 as Unix seconds (``default`` when absent or malformed)."""
    if not text:
        return default
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return default
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return round(t.timestamp(), 6)


class KubeBase:
    """API access of the Kubernetes store's parts.

    Args:
        kube: API access (any field manager; the store uses its own per kind of write) and
            its write guard (leadership), which every write of the store keeps.
        namespace: namespace of the ModelDeployments, PartitionPlans and ConfigMaps.
        conflict_retries: attempts of a read-modify-write that meets 409 Conflict.
        cordon_refresh_s: the cordoned GPUNodes are listed again at most this often, s.
    """

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        *,
        conflict_retries: int = 8,
        cordon_refresh_s: float = 2.0,
    ) -> None:
        self.namespace = namespace
        self.conflict_retries = conflict_retries
        self.cordon_refresh_s = cordon_refresh_s
        self._cordoned: tuple[float, frozenset[str]] | None = None
        self._kube = Kube(
            kube.api_client, field_manager=FIELD_MANAGER, write_guard=kube.write_guard
        )
        # The committed pointer has its own field manager so that applying the controller's
        # status document never removes it (and vice versa).
        self._pointer = Kube(
            kube.api_client, field_manager=f"{FIELD_MANAGER}-commit", write_guard=kube.write_guard
        )
        self._closed = False

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        if self._closed:
            raise StoreError("the store is closed", field="store")
        try:
            return fn()
        except (ApiError, OperatorError) as exc:
            raise StoreError(f"{what}: {exc}", field="store") from exc
