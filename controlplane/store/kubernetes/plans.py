"""PartitionPlans as the store's plan versions: reading them and moving their rollout state."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

from apis.kube.client import MODEL_DEPLOYMENTS, PARTITION_PLANS, Json
from apis.kube.plancodec import decode_plan
from apis.kube.schema import from_wire
from apis.kube.v1alpha1 import PartitionPlanSpec
from controlplane.errors import NotFoundError, PreconditionError, StoreError
from controlplane.store.base import PlanState, StoredPlan
from controlplane.store.kubernetes.common import (
    ALLOWED_MOVES,
    ANNOTATION_CREATED,
    ANNOTATION_INPUTS,
    ANNOTATION_SUMMARY,
    LABEL_DEPLOYMENT,
    STATE_FROM_K8S,
    STATE_TO_K8S,
    KubeBase,
    from_time,
    plan_name,
    to_time,
)
from policies.errors import InputError
from policies.plan import Plan


class PlansMixin(KubeBase):
    """The store's plan versions on PartitionPlan objects (the committed one is in
    :class:`~controlplane.store.kubernetes.deployments.DeploymentsMixin`)."""

    def _plan_objects(self, deployment: str | None) -> list[Json]:
        sel = f"{LABEL_DEPLOYMENT}={deployment}" if deployment else LABEL_DEPLOYMENT
        items, _ = self._call(
            "list plans",
            lambda: self._kube.list(PARTITION_PLANS, self.namespace, label_selector=sel),
        )
        return cast(list[Json], items)

    def add_plan(
        self,
        deployment: str,
        plan: Plan,
        *,
        reason: str,
        inputs_key: str,
        now_s: float,
        document: Mapping[str, Any] | None = None,
    ) -> StoredPlan:
        """Refused: in Kubernetes mode the operator alone decides and writes PartitionPlans
        (``plan_author``); the controller rolls them out.

        Raises:
            PreconditionError: always.
        """
        raise PreconditionError(
            f"plans of {deployment!r} are made by the mixfleet operator in Kubernetes mode. "
            "To fix: change the ModelDeployment; the operator writes the new PartitionPlan",
            field="deployment",
        )

    def _get_plan_obj(self, deployment: str, version: int) -> Json | None:
        obj = self._call(
            f"get plan {deployment} v{version}",
            lambda: self._kube.get(PARTITION_PLANS, plan_name(deployment, version), self.namespace),
        )
        if obj is None or (obj.get("spec") or {}).get("deployment") != deployment:
            return None
        return cast(Json, obj)

    @staticmethod
    def _state_of(obj: Json) -> str:
        return STATE_FROM_K8S.get(str((obj.get("status") or {}).get("state")), "proposed")

    def _set_state(
        self,
        deployment: str,
        version: int,
        state: str,
        reason: str | None,
        now_s: float,
        prepare_deadline_s: float | None,
    ) -> None:
        """Write a plan's rollout state (callers check that the move is allowed)."""
        obj = self._get_plan_obj(deployment, version)
        if obj is None:
            raise NotFoundError(
                f"deployment {deployment!r} has no version {version}", field="version"
            )
        old = obj.get("status") or {}
        status: Json = {
            "state": STATE_TO_K8S[state],
            "reason": (reason if reason is not None else old.get("reason", ""))[:4096],
            "stateChangedTime": to_time(now_s),
        }
        deadline = prepare_deadline_s
        if deadline is None and old.get("prepareDeadline"):
            deadline = from_time(old["prepareDeadline"])
        if deadline is not None:
            status["prepareDeadline"] = to_time(deadline)
        name = obj["metadata"]["name"]
        self._call(
            f"state of {deployment} v{version}",
            lambda: self._kube.apply(
                PARTITION_PLANS,
                {"metadata": {"name": name, "namespace": self.namespace}, "status": status},
                subresource="status",
                force=True,  # the controller alone writes the rollout state
            ),
        )

    def set_plan_state(
        self,
        deployment: str,
        version: int,
        state: PlanState,
        *,
        reason: str | None = None,
        now_s: float,
        prepare_deadline_s: float | None = None,
    ) -> None:
        obj = self._get_plan_obj(deployment, version)
        if obj is None:
            raise NotFoundError(
                f"deployment {deployment!r} has no version {version}", field="version"
            )
        current = self._state_of(obj)
        if state not in ALLOWED_MOVES.get(current, set()):
            raise PreconditionError(
                f"version {version} of {deployment!r} is {current}; it cannot become {state}",
                field="version",
            )
        self._set_state(deployment, version, state, reason, now_s, prepare_deadline_s)

    def commit_plan(self, deployment: str, version: int, *, now_s: float) -> None:
        obj = self._get_plan_obj(deployment, version)
        if obj is None:
            raise NotFoundError(
                f"deployment {deployment!r} has no version {version}", field="version"
            )
        current = self._state_of(obj)
        if current == "committed":
            return
        if current not in ("proposed", "preparing"):
            raise PreconditionError(
                f"version {version} of {deployment!r} is {current}; it cannot be committed",
                field="version",
            )
        # 1. The pointer (one object, atomic) is the truth.
        self._call(
            f"commit pointer of {deployment}",
            lambda: self._pointer.apply(
                MODEL_DEPLOYMENTS,
                {
                    "metadata": {"name": deployment, "namespace": self.namespace},
                    "status": {"committedVersion": version},
                },
                subresource="status",
                force=True,  # the committed pointer is the controller's alone
            ),
        )
        # 2. The new plan, 3. every other committed one.
        self._set_state(deployment, version, "committed", None, now_s, None)
        for p in self._plan_objects(deployment):
            v = (p.get("spec") or {}).get("version")
            if isinstance(v, int) and v != version and self._state_of(p) == "committed":
                self._set_state(deployment, v, "superseded", None, now_s, None)

    def _stored_plan(self, obj: Json, *, with_plan: bool) -> StoredPlan:
        spec = from_wire(PartitionPlanSpec, obj["spec"], "spec")
        ann = obj["metadata"].get("annotations") or {}
        status = obj.get("status") or {}
        created = from_time(ann.get(ANNOTATION_CREATED) or obj["metadata"].get("creationTimestamp"))
        try:
            summary = json.loads(ann.get(ANNOTATION_SUMMARY) or "{}")
        except ValueError:
            summary = {}
        plan = decode_plan(spec) if with_plan or not summary else None
        if not summary and plan is not None:
            summary = dataclasses.asdict(plan.summary)
        deadline = status.get("prepareDeadline")
        return StoredPlan(
            deployment=spec.deployment,
            version=spec.version,
            plan_id=spec.plan_id,
            state=cast(PlanState, self._state_of(obj)),
            reason=str(status.get("reason") or spec.reason),
            inputs_key=str(ann.get(ANNOTATION_INPUTS) or spec.inputs_digest),
            nodes=spec.nodes,
            summary=summary,
            created_at_s=created,
            state_changed_at_s=from_time(status.get("stateChangedTime"), created),
            prepare_deadline_s=from_time(deadline) if deadline else None,
            plan=plan if with_plan else None,
        )

    def _readable(self, obj: Json, *, with_plan: bool) -> StoredPlan:
        """:meth:`_stored_plan`, a PartitionPlan that does not parse a :class:`StoreError`
        naming it."""
        try:
            return self._stored_plan(obj, with_plan=with_plan)
        except InputError as exc:
            name = (obj.get("metadata") or {}).get("name")
            raise StoreError(
                f"PartitionPlan {name} does not parse: {exc}. To fix: delete it (the operator "
                "writes plans above its version)",
                field="plan",
            ) from exc

    def get_plan(
        self, deployment: str, version: int, *, with_plan: bool = True
    ) -> StoredPlan | None:
        obj = self._get_plan_obj(deployment, version)
        return self._readable(obj, with_plan=with_plan) if obj is not None else None

    def list_plans(
        self,
        deployment: str | None = None,
        *,
        states: Sequence[PlanState] | None = None,
        limit: int = 50,
    ) -> list[StoredPlan]:
        out = []
        for o in self._plan_objects(deployment):
            # One plan that does not parse must not hide the others (or stop every
            # reconcile tick); the operator reports it in its deployment's conditions.
            with contextlib.suppress(StoreError):
                out.append(self._readable(o, with_plan=False))
        if states:
            out = [p for p in out if p.state in states]
        out.sort(key=lambda p: (p.deployment, -p.version))
        return out[:limit]
