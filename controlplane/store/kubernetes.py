"""The controller's store on the Kubernetes API (``kubernetes:NAMESPACE``).

In a cluster the controller keeps its state in the mixfleet.io custom resources, so
``kubectl`` shows what the controller knows and the operator (operators/) and the controller
work on the same objects:

===================  ====================================================================
store                Kubernetes
===================  ====================================================================
node                 GPUNode (cluster-scoped): status.inventory, health, heartbeat and
                     status.agent (session, registration time, state, message, applied)
deployment           ModelDeployment in NAMESPACE: spec is the deployment document
                     (controlplane.deployment), metadata.generation the generation,
                     status.controller the controller's status, status.committedVersion
                     the committed pointer
plan version         PartitionPlan ``<deployment>-v<version>`` (madeBy: controller), owned
                     by its ModelDeployment; status.state / reason / stateChangedTime /
                     prepareDeadline the rollout state
ack                  PartitionPlan status.acks (one entry per node and state) and
                     status.nodes (each node's latest state, what the operator reads)
load window          ConfigMap ``<deployment>-expert-load`` (owned by the deployment),
                     the newest windows up to about 900 KB
controller id        ConfigMap ``mixfleet-controller``
version counter      ConfigMap ``mixfleet-plan-versions`` (apis.kube.versions)
===================  ====================================================================

Differences from the SQLite store, all forced by Kubernetes semantics:

* Deleting a deployment deletes the ModelDeployment: its PartitionPlans and ConfigMaps are
  garbage-collected, so ``include_deleted`` finds nothing. Versions still only grow across
  delete and re-create (the version counter survives).
* :meth:`KubernetesStore.commit_plan` writes several objects; the committed pointer
  (ModelDeployment ``status.committedVersion``) is written first and is the truth. Plan
  states that a crash left stale are repaired by the next commit.
* Times are stored as RFC 3339 with microseconds (exact to 1 us).

Every write is a server-side apply under the field manager ``mixfleet-controller`` (status
writes of acks and counters are resourceVersion-guarded merge patches retried on 409), so
the operator's fields and the controller's never overwrite each other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, cast

from apis.kube.client import (
    CONFIGMAPS,
    GPUNODES,
    MODEL_DEPLOYMENTS,
    PARTITION_PLANS,
    Json,
    Kube,
    api_client_from,
)
from apis.kube.errors import ApiError, ConflictError, OperatorError
from apis.kube.errors import NotFoundError as ApiNotFound
from apis.kube.gpunode import gpu_summary, node_health
from apis.kube.plancodec import decode_plan, plan_spec
from apis.kube.schema import from_wire, to_wire
from apis.kube.v1alpha1 import (
    API_VERSION,
    AgentSession,
    GPUNodeStatus,
    PartitionPlanSpec,
)
from apis.kube.versions import read_floor, record_version
from controlplane.deployment import DeploymentSpec, parse_deployment, spec_to_doc
from controlplane.errors import AlreadyExistsError, NotFoundError, PreconditionError, StoreError
from controlplane.store.base import (
    AckState,
    LoadWindow,
    NodeState,
    PlanState,
    StoredAck,
    StoredDeployment,
    StoredNode,
    StoredPlan,
)
from operators.reconcile import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, plan_name
from policies.errors import InputError
from policies.inventory import NodeInventory
from policies.plan import Plan

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
_OPERATOR_ONLY_KEYS = ("policyRef", "engineFormat")

_STATE_TO_K8S: dict[str, str] = {
    "proposed": "Proposed",
    "preparing": "Preparing",
    "committed": "Committed",
    "aborted": "Aborted",
    "superseded": "Superseded",
}
_STATE_FROM_K8S = {v: k for k, v in _STATE_TO_K8S.items()}
_ACK_TO_K8S = {"prepared": "Prepared", "committed": "Committed", "failed": "Failed"}
_ACK_FROM_K8S = {v: k for k, v in _ACK_TO_K8S.items()}
_ALLOWED_MOVES: dict[str, set[str]] = {
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


class KubernetesStore:
    """:class:`controlplane.store.base.Store` on the Kubernetes API.

    Args:
        kube: API access (any field manager; the store uses its own per kind of write).
        namespace: namespace of the ModelDeployments, PartitionPlans and ConfigMaps.
        conflict_retries: attempts of a read-modify-write that meets 409 Conflict.
    """

    def __init__(self, kube: Kube, namespace: str, *, conflict_retries: int = 8) -> None:
        self.namespace = namespace
        self.conflict_retries = conflict_retries
        self._kube = Kube(
            kube.api_client, field_manager=FIELD_MANAGER, write_guard=kube.write_guard
        )
        # The committed pointer has its own field manager so that applying the controller's
        # status document never removes it (and vice versa).
        self._pointer = Kube(
            kube.api_client, field_manager=f"{FIELD_MANAGER}-commit", write_guard=kube.write_guard
        )
        self._closed = False

    @classmethod
    def from_url(cls, rest: str, *, kubeconfig: str | None = None) -> KubernetesStore:
        """``kubernetes:NAMESPACE`` (``kubernetes:`` = $POD_NAMESPACE, else ``default``).

        Raises:
            StoreError: no Kubernetes configuration found.
        """
        namespace = rest.strip("/") or os.environ.get("POD_NAMESPACE", "default")
        try:
            api = api_client_from(kubeconfig)
        except Exception as exc:  # the loaders raise several unrelated types
            raise StoreError(
                f"cannot reach Kubernetes: {exc}. To fix: run in a pod with a service account "
                "or set KUBECONFIG",
                field="store",
            ) from exc
        return cls(Kube(api, field_manager=FIELD_MANAGER), namespace)

    # ---------------------------------------------------------------- plumbing

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        if self._closed:
            raise StoreError("the store is closed", field="store")
        try:
            return fn()
        except (ApiError, OperatorError) as exc:
            raise StoreError(f"{what}: {exc}", field="store") from exc

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

    # ------------------------------------------------------------------- nodes

    def _node_status(self, node: StoredNode) -> Json:
        inv = dataclasses.replace(node.inventory, node=node.name)
        status = GPUNodeStatus(
            inventory=inv,
            health=node_health(inv),
            last_heartbeat_time=to_time(node.last_heartbeat_s),
            gpu_count=len(inv.gpus),
            gpu_summary=gpu_summary(inv),
            agent=AgentSession(
                session_id=node.session_id,
                registered_time=to_time(node.registered_at_s),
                state=node.state,
                message=node.message[:4096],
                applied=dict(node.applied),
            ),
        )
        return to_wire(status)

    def upsert_node(self, node: StoredNode) -> None:
        def run() -> None:
            if self._kube.get(GPUNODES, node.name) is None:
                body = {
                    "apiVersion": API_VERSION,
                    "kind": "GPUNode",
                    "metadata": {"name": node.name, "labels": dict(node.inventory.labels)},
                    "spec": {},
                }
                # Created meanwhile by another writer: the status write below still applies.
                with contextlib.suppress(ConflictError):
                    self._kube.create(GPUNODES, body)
            self._kube.apply(
                GPUNODES,
                {"metadata": {"name": node.name}, "status": self._node_status(node)},
                subresource="status",
            )

        self._call(f"upsert node {node.name}", run)

    def update_node_status(
        self,
        name: str,
        *,
        inventory: NodeInventory | None = None,
        last_heartbeat_s: float | None = None,
        state: NodeState | None = None,
        message: str | None = None,
        applied: Mapping[str, int] | None = None,
    ) -> None:
        current = self.get_node(name)
        if current is None:
            return
        updated = dataclasses.replace(
            current,
            inventory=inventory if inventory is not None else current.inventory,
            last_heartbeat_s=(
                last_heartbeat_s if last_heartbeat_s is not None else current.last_heartbeat_s
            ),
            state=state if state is not None else current.state,
            message=message if message is not None else current.message,
            applied=dict(applied) if applied is not None else current.applied,
        )
        self._call(
            f"update node {name}",
            lambda: self._kube.apply(
                GPUNODES,
                {"metadata": {"name": name}, "status": self._node_status(updated)},
                subresource="status",
            ),
        )

    @staticmethod
    def _stored_node(obj: Json) -> StoredNode | None:
        try:
            status = from_wire(GPUNodeStatus, obj.get("status") or {}, "status")
        except InputError:
            return None
        if status.inventory is None or status.agent is None:
            return None
        a = status.agent
        return StoredNode(
            name=str(obj["metadata"]["name"]),
            inventory=status.inventory,
            session_id=a.session_id,
            registered_at_s=from_time(a.registered_time),
            last_heartbeat_s=from_time(status.last_heartbeat_time),
            state=cast(NodeState, a.state),
            message=a.message,
            applied=dict(a.applied),
        )

    def get_node(self, name: str) -> StoredNode | None:
        obj = self._call(f"get node {name}", lambda: self._kube.get(GPUNODES, name))
        return self._stored_node(obj) if obj is not None else None

    def list_nodes(self) -> list[StoredNode]:
        items, _ = self._call("list nodes", lambda: self._kube.list(GPUNODES))
        nodes = [n for n in (self._stored_node(o) for o in items) if n is not None]
        return sorted(nodes, key=lambda n: n.name)

    def delete_node(self, name: str) -> bool:
        return bool(self._call(f"delete node {name}", lambda: self._kube.delete(GPUNODES, name)))

    # ------------------------------------------------------------- deployments

    def _deployment_doc(self, obj: Json) -> Json:
        spec = {k: v for k, v in (obj.get("spec") or {}).items() if k not in _OPERATOR_ONLY_KEYS}
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
            status=dict(status.get("controller") or {}),
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
            if obj is not None and self._deployment_doc(obj)["spec"] == _normalized(doc["spec"]):
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
                "spec": doc["spec"],
            }
            out: Json = self._kube.apply(MODEL_DEPLOYMENTS, body)
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
        out = [
            self._stored_deployment(o)
            for o in items
            if include_deleted or not o["metadata"].get("deletionTimestamp")
        ]
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
            ),
        )
        uid = obj["metadata"].get("uid")
        return bool(
            self._call(
                f"delete deployment {name}",
                lambda: self._kube.delete(MODEL_DEPLOYMENTS, name, self.namespace, uid=uid),
            )
        )

    def set_deployment_status(self, name: str, status: Mapping[str, Any]) -> None:
        body = {
            "metadata": {"name": name, "namespace": self.namespace},
            "status": {"controller": json.loads(json.dumps(dict(status)))},
        }

        def run() -> None:
            with contextlib.suppress(ApiNotFound):  # deleted meanwhile
                self._kube.apply(MODEL_DEPLOYMENTS, body, subresource="status")

        self._call(f"status of {name}", run)

    # ------------------------------------------------------------------- plans

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
        md = self._call(
            f"get deployment {deployment}",
            lambda: self._kube.get(MODEL_DEPLOYMENTS, deployment, self.namespace),
        )
        if md is None or md["metadata"].get("deletionTimestamp"):
            raise NotFoundError(f"no deployment {deployment!r}", field="deployment")
        existing = max(
            (int(p["spec"]["version"]) for p in self._plan_objects(deployment)), default=0
        )
        version = (
            max(
                existing,
                self._call("versions", lambda: read_floor(self._kube, self.namespace, deployment)),
            )
            + 1
        )
        summary = dict(document["summary"]) if document else dataclasses.asdict(plan.summary)
        for _ in range(self.conflict_retries):
            versioned = dataclasses.replace(plan, version=version)
            spec = dataclasses.replace(
                plan_spec(
                    versioned,
                    deployment=deployment,
                    inputs_digest=inputs_key[:256],
                    deployment_generation=int(md["metadata"].get("generation") or 1),
                ),
                made_by="controller",
                reason=reason[:1024],
            )
            body = {
                "apiVersion": API_VERSION,
                "kind": "PartitionPlan",
                "metadata": {
                    "name": plan_name(deployment, version),
                    "namespace": self.namespace,
                    "labels": {LABEL_DEPLOYMENT: deployment, LABEL_MANAGED_BY: MANAGED_BY},
                    "annotations": {
                        ANNOTATION_CREATED: to_time(now_s),
                        ANNOTATION_SUMMARY: json.dumps(summary, separators=(",", ":")),
                        ANNOTATION_INPUTS: inputs_key,
                    },
                    "ownerReferences": [
                        {
                            "apiVersion": API_VERSION,
                            "kind": "ModelDeployment",
                            "name": deployment,
                            "uid": md["metadata"]["uid"],
                            "controller": True,
                            "blockOwnerDeletion": True,
                        }
                    ],
                },
                "spec": to_wire(spec),
            }
            try:
                self._kube.create(PARTITION_PLANS, body)
            except ConflictError:
                version += 1  # another writer (the operator) took this version
                continue
            except (ApiError, OperatorError) as exc:
                raise StoreError(f"cannot store version {version}: {exc}", field="version") from exc
            self._call(
                "record version",
                functools.partial(record_version, self._kube, self.namespace, deployment, version),
            )
            self._set_state(deployment, version, "proposed", reason, now_s, None)
            return StoredPlan(
                deployment, version, plan.id, "proposed", reason, inputs_key,
                spec.nodes, summary, now_s, now_s, None, versioned,
            )  # fmt: skip
        raise StoreError(f"cannot allocate a version for {deployment!r}", field="version")

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
        return _STATE_FROM_K8S.get(str((obj.get("status") or {}).get("state")), "proposed")

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
            "state": _STATE_TO_K8S[state],
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
        if state not in _ALLOWED_MOVES.get(current, set()):
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
            ),
        )
        # 2. The new plan, 3. every other committed one.
        self._set_state(deployment, version, "committed", None, now_s, None)
        for p in self._plan_objects(deployment):
            v = int(p["spec"]["version"])
            if v != version and self._state_of(p) == "committed":
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

    def get_plan(
        self, deployment: str, version: int, *, with_plan: bool = True
    ) -> StoredPlan | None:
        obj = self._get_plan_obj(deployment, version)
        return self._stored_plan(obj, with_plan=with_plan) if obj is not None else None

    def committed_plan(self, deployment: str) -> StoredPlan | None:
        d = self.get_deployment(deployment)
        if d is None or d.committed_version is None:
            return None
        return self.get_plan(deployment, d.committed_version)

    def list_plans(
        self,
        deployment: str | None = None,
        *,
        states: Sequence[PlanState] | None = None,
        limit: int = 50,
    ) -> list[StoredPlan]:
        out = [self._stored_plan(o, with_plan=False) for o in self._plan_objects(deployment)]
        if states:
            out = [p for p in out if p.state in states]
        out.sort(key=lambda p: (p.deployment, -p.version))
        return out[:limit]

    # -------------------------------------------------------------------- acks

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
                k8s_state = _ACK_TO_K8S[a.state]
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
                cast(AckState, _ACK_FROM_K8S[a["state"]]),
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


def _normalized(spec: Json) -> Json:
    """``spec`` as the API server would store it (with the CRD's defaults), for comparison
    with the stored spec."""
    from support.structural import apply_defaults

    from apis.kube.v1alpha1 import MODEL_DEPLOYMENT

    schema = MODEL_DEPLOYMENT.schema()["properties"]["spec"]
    out = apply_defaults(json.loads(json.dumps(spec)), schema)
    out = {k: v for k, v in out.items() if k not in _OPERATOR_ONLY_KEYS}
    if not out.get("nodeSelector"):
        out.pop("nodeSelector", None)
    return cast(Json, out)
