"""ModelDeployments as the store's deployments, and their committed pointer."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

from apis.kube.client import MODEL_DEPLOYMENTS, Json
from apis.kube.errors import ConflictError
from apis.kube.errors import NotFoundError as ApiNotFound
from apis.kube.v1alpha1 import API_VERSION, MODEL_DEPLOYMENT
from apis.kube.versions import read_floor
from controlplane.errors import AlreadyExistsError, NotFoundError, PreconditionError, StoreError
from controlplane.store.base import StoredDeployment, StoredPlan
from controlplane.store.kubernetes.common import (
    ANNOTATION_CREATED,
    ANNOTATION_UPDATED,
    OPERATOR_ONLY_KEYS,
    from_time,
    to_time,
)
from controlplane.store.kubernetes.plans import PlansMixin
from policies.errors import InputError
from policies.spec.build import DeploymentSpec, parse_deployment, spec_to_doc


class DeploymentsMixin(PlansMixin):
    """The store's deployments on ModelDeployment objects; deleting one ends its plans."""

    def _deployment_doc(self, obj: Json) -> Json:
        spec = {k: v for k, v in (obj.get("spec") or {}).items() if k not in OPERATOR_ONLY_KEYS}
        if not spec.get("nodeSelector"):
            spec.pop("nodeSelector", None)
        return {
            "apiVersion": API_VERSION,
            "kind": "ModelDeployment",
            "metadata": {"name": obj["metadata"]["name"]},
            "spec": spec,
        }

    def _stored_deployment(self, obj: Json) -> StoredDeployment:
        meta = obj["metadata"]
        ann = meta.get("annotations") or {}
        status = obj.get("status") or {}
        created = from_time(ann.get(ANNOTATION_CREATED) or meta.get("creationTimestamp"))
        try:
            spec = parse_deployment(self._deployment_doc(obj))
        except InputError as exc:
            raise StoreError(f"ModelDeployment {meta['name']}: {exc}", field="spec") from exc
        return StoredDeployment(
            spec=spec,
            generation=int(meta.get("generation") or 1),
            created_at_s=created,
            updated_at_s=from_time(ann.get(ANNOTATION_UPDATED), created),
            deleted=bool(meta.get("deletionTimestamp")),
            committed_version=status.get("committedVersion"),
            status=controller_status(status),
            rollout_hold=rollout_hold(status),
        )

    def put_deployment(
        self,
        spec: DeploymentSpec,
        *,
        now_s: float,
        create_only: bool = False,
        update_only: bool = False,
    ) -> StoredDeployment:
        doc = spec_to_doc(spec)

        def run() -> Json:
            obj = self._kube.get(MODEL_DEPLOYMENTS, spec.name, self.namespace)
            live = obj is not None and not obj["metadata"].get("deletionTimestamp")
            if create_only and live:
                raise AlreadyExistsError(
                    f"deployment {spec.name!r} exists. To fix: use UpdateDeployment or "
                    "ApplyDeployment, or delete it first",
                    field="spec.name",
                )
            if update_only and not live:
                raise NotFoundError(f"no deployment {spec.name!r}", field="spec.name")
            if obj is not None and not live:
                raise PreconditionError(
                    f"deployment {spec.name!r} is being deleted. To fix: wait until it is gone",
                    field="spec.name",
                )
            if obj is not None and _same_spec(self._deployment_doc(obj), spec):
                return obj  # unchanged: no write, no generation bump
            old_annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
            body = {
                "metadata": {
                    "name": spec.name,
                    "namespace": self.namespace,
                    "annotations": {
                        ANNOTATION_CREATED: old_annotations.get(ANNOTATION_CREATED, to_time(now_s)),
                        ANNOTATION_UPDATED: to_time(now_s),
                    },
                },
                "spec": unclaimed_defaults_removed(doc["spec"], (obj or {}).get("spec"), SPEC),
            }
            try:
                out: Json = self._kube.apply(MODEL_DEPLOYMENTS, body)
            except ConflictError as exc:
                raise PreconditionError(
                    f"deployment {spec.name!r}: fields of its spec are managed by another "
                    f"writer ({exc}). To fix: change them where they were set (kubectl apply "
                    "of the ModelDeployment), or have that writer stop applying them; "
                    "mixfleet does not take them over",
                    field="spec",
                ) from exc
            return out

        return self._stored_deployment(self._call(f"put deployment {spec.name}", run))

    def get_deployment(
        self, name: str, *, include_deleted: bool = False
    ) -> StoredDeployment | None:
        obj = self._call(
            f"get deployment {name}",
            lambda: self._kube.get(MODEL_DEPLOYMENTS, name, self.namespace),
        )
        if obj is None or (obj["metadata"].get("deletionTimestamp") and not include_deleted):
            return None
        return self._stored_deployment(obj)

    def list_deployments(self, *, include_deleted: bool = False) -> list[StoredDeployment]:
        items, _ = self._call(
            "list deployments", lambda: self._kube.list(MODEL_DEPLOYMENTS, self.namespace)
        )
        out: list[StoredDeployment] = []
        for o in items:
            if o["metadata"].get("deletionTimestamp") and not include_deleted:
                continue
            try:
                out.append(self._stored_deployment(o))
            except StoreError:
                # A spec that does not parse (an unknown preset, say) is left out: one bad
                # object must not stop every other deployment. The operator, which owns
                # the decision, reports it in that ModelDeployment's status conditions.
                continue
        return sorted(out, key=lambda d: d.name)

    def delete_deployment(self, name: str, *, now_s: float) -> bool:
        obj = self._call(
            f"get deployment {name}",
            lambda: self._kube.get(MODEL_DEPLOYMENTS, name, self.namespace),
        )
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            return False
        for p in self.list_plans(name, limit=1_000_000):
            if p.state == "committed":
                self._set_state(name, p.version, "superseded", None, now_s, None)
            elif p.state in ("proposed", "preparing"):
                self._set_state(name, p.version, "aborted", "deployment deleted", now_s, None)
        self._call(
            f"clear pointer of {name}",
            lambda: self._pointer.apply(
                MODEL_DEPLOYMENTS,
                {"metadata": {"name": name, "namespace": self.namespace}, "status": {}},
                subresource="status",
                force=True,
            ),
        )
        uid = obj["metadata"].get("uid")
        return bool(
            self._call(
                f"delete deployment {name}",
                lambda: self._kube.delete(MODEL_DEPLOYMENTS, name, self.namespace, uid=uid),
            )
        )

    def deleted_here(self, deployment: str, version: int) -> bool:
        """:class:`controlplane.store.base.DeletionRecord`: the ModelDeployment is gone or
        being deleted, and the namespace's version counter (apis.kube.versions) went up to
        ``version`` - so this store allocated it."""

        def run() -> bool:
            obj = self._kube.get(MODEL_DEPLOYMENTS, deployment, self.namespace)
            if obj is not None and not obj["metadata"].get("deletionTimestamp"):
                return False
            return 0 < version <= read_floor(self._kube, self.namespace, deployment)

        return bool(self._call(f"deleted deployment {deployment}", run))

    def set_deployment_status(self, name: str, status: Mapping[str, Any]) -> None:
        own = {k: v for k, v in status.items() if k != INSTANCE_KEY}  # the operator's
        body = {
            "metadata": {"name": name, "namespace": self.namespace},
            "status": {"controller": json.loads(json.dumps(own))},
        }

        def run() -> None:
            with contextlib.suppress(ApiNotFound):  # deleted meanwhile
                self._kube.apply(MODEL_DEPLOYMENTS, body, subresource="status", force=True)

        self._call(f"status of {name}", run)

    def committed_plan(self, deployment: str) -> StoredPlan | None:
        d = self.get_deployment(deployment)
        if d is None or d.committed_version is None:
            return None
        return self.get_plan(deployment, d.committed_version)


SPEC = MODEL_DEPLOYMENT.schema()["properties"]["spec"]


def _same_spec(doc: Json, spec: DeploymentSpec) -> bool:
    """Whether the stored document reads as ``spec`` (a stored spec that no longer parses
    differs)."""
    try:
        return parse_deployment(doc) == spec
    except InputError:
        return False


def unclaimed_defaults_removed(want: Json, live: Json | None, schema: Json) -> Json:
    """``want`` (a document the controller applies) less the fields it need not own: those
    at the CRD's default whose live value is the default as well (or absent), and objects
    left empty by that. Owning them would make a user's later server-side apply of the same
    field conflict with mixfleet. A field whose live value differs is kept, so that applying
    the default back is a real change (and a conflict when another writer set it)."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    out: Json = {}
    for key, value in want.items():
        sub = props.get(key) or {}
        lv = live.get(key) if isinstance(live, dict) else None
        if isinstance(value, dict) and sub.get("properties"):
            inner = unclaimed_defaults_removed(value, lv if isinstance(lv, dict) else None, sub)
            if inner or key in required or (value == {} and lv not in (None, {})):
                out[key] = inner
        elif "default" in sub and value == sub["default"] and lv in (None, value):
            continue
        else:
            out[key] = value
    return out


INSTANCE_KEY = "instance"
"""The key of an engine instance's record: ``status.instance`` of its ModelDeployment, which
the operator writes, and the same key in :attr:`StoredDeployment.status` (the standalone
controller's ``instance_records.INSTANCE_KEY``)."""


def controller_status(status: Json) -> dict[str, Any]:
    """The deployment's status as the controller keeps it: its own document
    (``status.controller``) and, on an engine instance's ModelDeployment, the operator's
    record of the instance (``status.instance``) under :data:`INSTANCE_KEY`, so the
    controller reads instances the same way as from its SQLite store."""
    out = dict(status.get("controller") or {})
    out.pop(INSTANCE_KEY, None)
    if isinstance(status.get(INSTANCE_KEY), dict):
        out[INSTANCE_KEY] = dict(status[INSTANCE_KEY])
    return out


def rollout_hold(status: Json) -> str:
    """Why no plan of the deployment may start rolling out: the operator (the one decision
    maker) reports ``Solved=False`` - the current spec and fleet cannot be planned (a
    missing PlacementPolicy, no eligible GPUNode, an infeasible spec...), so a proposed
    plan made for earlier inputs is not what it stands behind. Empty: no hold."""
    for c in status.get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == "Solved" and c.get("status") == "False":
            return f"{c.get('reason') or 'NotSolved'}: {c.get('message') or ''}".strip()
    return ""
