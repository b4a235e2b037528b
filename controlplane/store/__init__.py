"""State stores of the controller: the :class:`Store` contract and its backends."""

from __future__ import annotations

from controlplane.errors import StoreError
from controlplane.store.base import (
    ACK_STATES,
    PLAN_STATES,
    AckState,
    AliveRecord,
    DeletionRecord,
    LoadWindow,
    NodeState,
    PlanState,
    PlanWithdrawal,
    QuarantinedRow,
    RowHealth,
    Store,
    StoredAck,
    StoredDeployment,
    StoredNode,
    StoredPlan,
)

__all__ = [
    "ACK_STATES",
    "PLAN_STATES",
    "AckState",
    "AliveRecord",
    "DeletionRecord",
    "LoadWindow",
    "NodeState",
    "PlanState",
    "PlanWithdrawal",
    "QuarantinedRow",
    "RowHealth",
    "Store",
    "StoreError",
    "StoredAck",
    "StoredDeployment",
    "StoredNode",
    "StoredPlan",
    "open_store",
]


def open_store(
    url: str,
    *,
    new: bool | None = None,
    kubeconfig: str | None = None,
    context: str | None = None,
) -> Store:
    """Open a store from a URL: ``sqlite:PATH`` (``sqlite:///abs/path`` also accepted) or
    ``kubernetes:NAMESPACE`` (the cluster's API as the store).

    Args:
        new: for ``sqlite:``, whether the store is new here (see
            :class:`controlplane.store.sqlite.SqliteStore`); ignored by other backends.
        kubeconfig: for ``kubernetes:``, the kubeconfig file (None: in-cluster, then
            $KUBECONFIG or ~/.kube/config); ``context`` its context.

    Raises:
        StoreError: unknown scheme, the backend cannot open, or the file is refused.
    """
    scheme, _, rest = url.partition(":")
    if scheme == "sqlite" and rest:
        from controlplane.store.sqlite import SqliteStore

        path = rest[2:] if rest.startswith("//") else rest
        return SqliteStore(path, new=new)
    if scheme == "kubernetes":
        from controlplane.store.kubernetes import KubernetesStore

        return KubernetesStore.from_url(rest, kubeconfig=kubeconfig, context=context)
    raise StoreError(
        f"unknown store {url!r}. To fix: use sqlite:PATH (e.g. sqlite:/var/lib/mixfleet/state.db) or kubernetes:NAMESPACE",
        field="store",
    )
