"""Acks in PartitionPlan status and load windows in ConfigMaps."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import cast

from apis.kube.client import CONFIGMAPS, MODEL_DEPLOYMENTS, PARTITION_PLANS, Json
from apis.kube.errors import ApiError, ConflictError, OperatorError
from apis.kube.v1alpha1 import API_VERSION
from controlplane.errors import NotFoundError, StoreError
from controlplane.store.base import AckState, LoadWindow, StoredAck
from controlplane.store.kubernetes.common import (
    ACK_FROM_K8S,
    ACK_TO_K8S,
    LABEL_DEPLOYMENT,
    LABEL_LOAD,
    LABEL_MANAGED_BY,
    LOAD_SUFFIX,
    MANAGED_BY,
    MAX_LOAD_BYTES,
    from_time,
    to_time,
)
from controlplane.store.kubernetes.plans import PlansMixin


class AcksLoadsMixin(PlansMixin):
    """The store's acks (PartitionPlan ``status.acks`` / ``status.nodes``) and load windows
    (ConfigMap ``<deployment>-expert-load``)."""

    def record_ack(
        self,
        deployment: str,
        version: int,
        node: str,
        state: AckState,
        *,
        reason: str = "",
        now_s: float,
    ) -> bool:
        obj = self._get_plan_obj(deployment, version)
        if obj is None:
            raise NotFoundError(
                f"deployment {deployment!r} has no plan version {version}", field="version"
            )
        ack = StoredAck(deployment, version, node, state, reason, now_s)
        return self._add_acks(deployment, version, [ack], obj) == 1

    def record_acks(self, acks: Sequence[StoredAck]) -> int:
        by_plan: dict[tuple[str, int], list[StoredAck]] = {}
        for a in acks:
            by_plan.setdefault((a.deployment, a.version), []).append(a)
        stored = 0
        for (deployment, version), group in by_plan.items():
            obj = self._get_plan_obj(deployment, version)
            if obj is not None:  # a plan deleted meanwhile: its acks no longer matter
                stored += self._add_acks(deployment, version, group, obj)
        return stored

    def _add_acks(self, deployment: str, version: int, new: Sequence[StoredAck], obj: Json) -> int:
        """Add ``new`` acks to one PartitionPlan's status in one patch (retried on a
        conflict); returns how many were not there yet."""
        for _ in range(self.conflict_retries):
            status = obj.get("status") or {}
            acks = list(status.get("acks") or [])
            nodes = {n.get("node"): n for n in status.get("nodes") or []}
            have = {(a.get("node"), a.get("state")) for a in acks}
            added = 0
            for a in new:
                k8s_state = ACK_TO_K8S[a.state]
                if (a.node, k8s_state) in have:
                    continue
                have.add((a.node, k8s_state))
                at = to_time(a.at_s)
                acks.append(
                    {"node": a.node, "state": k8s_state, "at": at, "reason": a.reason[:4096]}
                )
                nodes[a.node] = {
                    "node": a.node,
                    "state": k8s_state,
                    "reason": a.reason[:1024],
                    "lastTransitionTime": at,
                }
                added += 1
            if not added:
                return 0
            patch = {
                "metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
                "status": {"acks": acks, "nodes": list(nodes.values())},
            }
            try:
                self._kube.merge_patch(
                    PARTITION_PLANS,
                    obj["metadata"]["name"],
                    patch,
                    self.namespace,
                    subresource="status",
                )
                return added
            except ConflictError:
                fresh = self._get_plan_obj(deployment, version)
                if fresh is None:
                    return 0
                obj = fresh
                continue
            except (ApiError, OperatorError) as exc:
                raise StoreError(f"acks for {deployment} v{version}: {exc}", field="store") from exc
        raise StoreError(f"acks for {deployment} v{version}: too many conflicts", field="store")

    def acks(self, deployment: str, version: int) -> list[StoredAck]:
        obj = self._get_plan_obj(deployment, version)
        if obj is None:
            return []
        out = [
            StoredAck(
                deployment,
                version,
                str(a["node"]),
                cast(AckState, ACK_FROM_K8S[a["state"]]),
                str(a.get("reason", "")),
                from_time(a.get("at")),
            )
            for a in (obj.get("status") or {}).get("acks") or []
        ]
        return sorted(out, key=lambda a: (a.at_s, a.node))

    # -------------------------------------------------------------------- load

    def _load_cm(self, deployment: str) -> Json | None:
        return cast(
            "Json | None",
            self._call(
                "get load windows",
                lambda: self._kube.get(CONFIGMAPS, deployment + LOAD_SUFFIX, self.namespace),
            ),
        )

    @staticmethod
    def _windows(cm: Json | None) -> list[Json]:
        try:
            return list(json.loads(((cm or {}).get("data") or {}).get("windows.json", "[]")))
        except ValueError:
            return []

    def _write_windows(
        self, deployment: str, windows: list[Json], cm: Json | None, owner_uid: str
    ) -> None:
        while windows and len(json.dumps(windows)) > MAX_LOAD_BYTES:
            windows.pop(0)
        data = {"windows.json": json.dumps(windows, separators=(",", ":"))}
        if cm is None:
            body = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": deployment + LOAD_SUFFIX,
                    "namespace": self.namespace,
                    "labels": {
                        LABEL_DEPLOYMENT: deployment,
                        LABEL_LOAD: "true",
                        LABEL_MANAGED_BY: MANAGED_BY,
                    },
                    "ownerReferences": [
                        {
                            "apiVersion": API_VERSION,
                            "kind": "ModelDeployment",
                            "name": deployment,
                            "uid": owner_uid,
                        }
                    ],
                },
                "data": data,
            }
            self._kube.create(CONFIGMAPS, body)
        else:
            patch = {
                "metadata": {"resourceVersion": cm["metadata"]["resourceVersion"]},
                "data": data,
            }
            self._kube.merge_patch(CONFIGMAPS, deployment + LOAD_SUFFIX, patch, self.namespace)

    def add_load_window(self, window: LoadWindow, *, now_s: float) -> None:
        md = self._call(
            "get deployment",
            lambda: self._kube.get(MODEL_DEPLOYMENTS, window.deployment, self.namespace),
        )
        if md is None or md["metadata"].get("deletionTimestamp"):
            raise NotFoundError(f"no deployment {window.deployment!r}", field="deployment")
        entry = {
            "engine": window.engine_id,
            "start": window.start_s,
            "end": window.end_s,
            "plan": window.plan_version,
            "counts": [list(r) for r in window.counts],
            "received": now_s,
        }
        for _ in range(self.conflict_retries):
            cm = self._load_cm(window.deployment)
            windows = self._windows(cm)
            windows.append(entry)
            try:
                self._write_windows(window.deployment, windows, cm, md["metadata"]["uid"])
                return
            except ConflictError:
                continue
            except (ApiError, OperatorError) as exc:
                raise StoreError(f"load window: {exc}", field="store") from exc
        raise StoreError("load window: too many conflicts", field="store")

    def load_windows(self, deployment: str, *, since_s: float = 0.0) -> list[LoadWindow]:
        out = [
            LoadWindow(
                deployment,
                str(w["engine"]),
                float(w["start"]),
                float(w["end"]),
                int(w["plan"]),
                tuple(tuple(float(x) for x in row) for row in w["counts"]),
            )
            for w in self._windows(self._load_cm(deployment))
            if float(w["end"]) > since_s
        ]
        return sorted(out, key=lambda w: w.end_s)

    def prune_load_windows(self, *, before_s: float) -> int:
        items, _ = self._call(
            "list load windows",
            lambda: self._kube.list(
                CONFIGMAPS, self.namespace, label_selector=f"{LABEL_LOAD}=true"
            ),
        )
        removed = 0
        for cm in items:
            windows = self._windows(cm)
            keep = [w for w in windows if float(w["end"]) >= before_s]
            if len(keep) == len(windows):
                continue
            deployment = cm["metadata"]["labels"][LABEL_DEPLOYMENT]
            try:
                self._write_windows(deployment, keep, cm, "")
            except ConflictError:
                continue  # the next prune gets it
            except (ApiError, OperatorError) as exc:
                raise StoreError(f"prune load windows: {exc}", field="store") from exc
            removed += len(windows) - len(keep)
        return removed
