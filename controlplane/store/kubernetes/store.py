"""The :class:`KubernetesStore`: its parts put together, plus opening and the controller id."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any, cast

from apis.kube.client import CONFIGMAPS, Kube, api_client_from
from apis.kube.errors import ConflictError, KubeConfigError
from controlplane.errors import StoreError
from controlplane.store.base import PlanAuthor
from controlplane.store.kubernetes.acks_loads import AcksLoadsMixin
from controlplane.store.kubernetes.common import (
    CONTROLLER_CONFIGMAP,
    FIELD_MANAGER,
    LABEL_MANAGED_BY,
    MANAGED_BY,
)
from controlplane.store.kubernetes.deployments import DeploymentsMixin
from controlplane.store.kubernetes.nodes import NodesMixin


class KubernetesStore(NodesMixin, DeploymentsMixin, AcksLoadsMixin):
    """:class:`controlplane.store.base.Store` on the Kubernetes API.

    Args:
        kube: API access (any field manager; the store uses its own per kind of write).
        namespace: namespace of the ModelDeployments, PartitionPlans and ConfigMaps.
        conflict_retries: attempts of a read-modify-write that meets 409 Conflict.
    """

    plan_author: PlanAuthor = "operator"

    @classmethod
    def from_url(
        cls, rest: str, *, kubeconfig: str | None = None, context: str | None = None
    ) -> KubernetesStore:
        """``kubernetes:NAMESPACE`` (``kubernetes:`` = $POD_NAMESPACE, else ``default``).

        Args:
            kubeconfig: kubeconfig file (None: in-cluster, then $KUBECONFIG or
                ~/.kube/config).
            context: its context (None: the current one).

        Raises:
            StoreError: no Kubernetes configuration found.
        """
        namespace = rest.strip("/") or os.environ.get("POD_NAMESPACE", "default")
        try:
            api = api_client_from(kubeconfig, context=context)
        except KubeConfigError as exc:
            raise StoreError(f"store kubernetes:{namespace}: {exc}", field="store") from exc
        return cls(Kube(api, field_manager=FIELD_MANAGER), namespace)

    # ---------------------------------------------------------------- plumbing

    @property
    def api_client(self) -> Any:
        """The configured ``kubernetes.client.ApiClient`` (for a leader elector)."""
        return self._kube.api_client

    def guard_writes(self, guard: Callable[[], bool]) -> None:
        """Refuse every later write unless ``guard()`` holds (a leader elector's
        ``is_leader``): a replica that lost its lease cannot write even mid-tick."""
        self._kube.write_guard = guard
        self._pointer.write_guard = guard

    def close(self) -> None:
        if not self._closed:
            self._closed = True

    def controller_id(self) -> str:
        def get_or_make() -> str:
            for _ in range(self.conflict_retries):
                cm = self._kube.get(CONFIGMAPS, CONTROLLER_CONFIGMAP, self.namespace)
                if cm is not None:
                    return str((cm.get("data") or {}).get("controllerID", ""))
                body = {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {
                        "name": CONTROLLER_CONFIGMAP,
                        "namespace": self.namespace,
                        "labels": {LABEL_MANAGED_BY: MANAGED_BY},
                    },
                    "data": {"controllerID": uuid.uuid4().hex},
                }
                try:
                    self._kube.create(CONFIGMAPS, body)
                except ConflictError:
                    continue
            raise StoreError("cannot create the controller id ConfigMap", field="store")

        return cast(str, self._call("controller id", get_or_make))
