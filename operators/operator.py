"""The ModelDeployment operator: informers, a work queue, and the observe -> reconcile ->
act loop around :func:`operators.decide.reconcile`.

* Informers list and watch ModelDeployments, GPUNodes, PlacementPolicies, and the
  PartitionPlans and ConfigMaps the operator manages, re-listing when a watch's
  resourceVersion is too old (410 Gone). Events turn into deployment keys on the queue: a
  deployment's own events, its plans' and ConfigMap's (by the ``mixfleet.io/deployment``
  label), every deployment on a GPUNode change that matters to placement (heartbeat-only
  updates do not), and the deployments using a PlacementPolicy when it changes.
* Workers take keys one at a time per key. A tick observes (a fresh GET of the deployment,
  a LIST of its PartitionPlans, a GET of its ConfigMap; GPUNodes and policies from the
  informers' caches), decides, solves when told to, and acts: server-side apply under the
  operator's field manager, deletes with uid preconditions, the finalizer through a JSON
  merge patch guarded by resourceVersion and retried on 409.
* Only the leader (Lease election, :mod:`operators.leader`) works the queue, and every
  write checks leadership again (:class:`apis.kube.client.Kube` ``write_guard``).

Temporary errors (API unavailable, conflicts) requeue the key with exponential backoff;
permanent ones are already conditions in the status (see :mod:`operators.status`).
Broad ``except`` only at the loop boundary, where an unexpected error is logged and the
key retried with backoff.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import structlog
from prometheus_client import Counter, Gauge, Histogram

from apis.kube.client import (
    CONFIGMAPS,
    GPUNODES,
    MODEL_DEPLOYMENTS,
    PARTITION_PLANS,
    PLACEMENT_POLICIES,
    Json,
    Kube,
    Resource,
)
from apis.kube.errors import (
    ApiError,
    ConflictError,
    GoneError,
    InvalidError,
    NotFoundError,
    NotLeaderError,
    OperatorError,
    TemporaryError,
)
from apis.kube.names import (
    FINALIZER,
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    config_map_name,
)
from apis.kube.schema import from_wire
from apis.kube.v1alpha1 import (
    GPUNodeSpec,
    GPUNodeStatus,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    PartitionPlanSpec,
    PartitionPlanStatus,
    PlacementPolicySpec,
)
from apis.kube.versions import read_floor, record_version
from operators.decide import (
    Action,
    ApplyConfigMap,
    ApplyPlan,
    ApplyStatus,
    DeleteConfigMap,
    DeletePlan,
    Requeue,
    SetFinalizer,
    SolveAction,
    TierAction,
    reconcile,
)
from operators.leader import LeaderElector, LeaderSettings
from operators.observe import (
    ConfigMapView,
    DeploymentView,
    NodeView,
    Observed,
    PlanView,
    ReconcileSettings,
    SolveOutcome,
    TierOutcome,
)
from policies.errors import InfeasibleError, InputError, SolverError
from policies.request import PlacementRequest, PlacementResult
from policies.solve import solve
from policies.tier_planner import plan_tiers
from policies.tiers import TierPlan, TierRequest

Key = tuple[str, str]
"""A ModelDeployment key: (namespace, name)."""

RECONCILES = Counter("mixfleet_operator_reconciles_total", "Reconcile ticks by result", ["result"])
SOLVES = Histogram(
    "mixfleet_operator_solve_seconds",
    "Wall time of placement solves, seconds",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
TIER_SPLITS = Histogram(
    "mixfleet_operator_tier_split_seconds",
    "Wall time of interactive / batch tier splits, seconds",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)
LEADER = Gauge("mixfleet_operator_leader", "1 while this replica holds the leader lease")


@dataclass(frozen=True)
class OperatorSettings:
    """Settings of the operator process.

    Attributes:
        field_manager: server-side apply field manager.
        namespaces: namespaces whose ModelDeployments to serve; empty = all.
        default_policy: PlacementPolicy used by deployments without ``policyRef`` (built-in
            defaults when it does not exist).
        workers: reconciles that may run at once (each may be solving).
        resync_period_s: every deployment is reconciled at least this often, seconds.
        watch_timeout_s: server-side timeout of one watch request, seconds.
        retry_base_delay_s: first retry delay after a temporary error, seconds.
        retry_max_delay_s: longest retry delay, seconds.
        conflict_retries: attempts of a read-modify-write that meets 409 Conflict.
        reconcile: knobs of the decision.
        leader: lease settings; None runs without election (one replica, tests).
    """

    field_manager: str = "mixfleet-operator"
    namespaces: tuple[str, ...] = ()
    default_policy: str = "default"
    workers: int = 2
    resync_period_s: float = 300.0
    watch_timeout_s: int = 300
    retry_base_delay_s: float = 0.5
    retry_max_delay_s: float = 60.0
    conflict_retries: int = 5
    reconcile: ReconcileSettings = field(default_factory=ReconcileSettings)
    leader: LeaderSettings | None = field(default_factory=LeaderSettings)


def _key(obj: Json) -> Key:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class Informer:
    """Keeps a cache of one resource up to date with list + watch.

    Args:
        kube: API access.
        res: the resource.
        namespace: one namespace, or None for all (cluster-scoped: None).
        label_selector: only objects matching it.
        on_event: ``(type, old, new)`` for ADDED / MODIFIED / DELETED (old or new None).
        watch_timeout_s: server-side watch timeout, seconds.
        retry_delay_s: wait after an error before listing again, seconds.
    """

    def __init__(
        self,
        kube: Kube,
        res: Resource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        on_event: Callable[[str, Json | None, Json | None], None] = lambda t, o, n: None,
        watch_timeout_s: int = 300,
        retry_delay_s: float = 1.0,
    ) -> None:
        self.kube = kube
        self.res = res
        self.namespace = namespace
        self.label_selector = label_selector
        self.on_event = on_event
        self.watch_timeout_s = watch_timeout_s
        self.retry_delay_s = retry_delay_s
        self.synced = threading.Event()
        self._cache: dict[Key, Json] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.log = structlog.get_logger("mixfleet.operator").bind(resource=res.plural)
        #: lists done (1 + re-lists after errors or 410 Gone).
        self.lists = 0

    def items(self) -> list[Json]:
        """A snapshot of the cached objects."""
        with self._lock:
            return list(self._cache.values())

    def get(self, key: Key) -> Json | None:
        with self._lock:
            return self._cache.get(key)

    def _relist(self) -> str:
        items, rv = self.kube.list(self.res, self.namespace, label_selector=self.label_selector)
        self.lists += 1
        fresh = {_key(o): o for o in items}
        with self._lock:
            old = self._cache
            self._cache = fresh
        for k, obj in fresh.items():
            prev = old.get(k)
            if prev is None:
                self.on_event("ADDED", None, obj)
            elif prev.get("metadata", {}).get("resourceVersion") != obj["metadata"].get(
                "resourceVersion"
            ):
                self.on_event("MODIFIED", prev, obj)
        for k, prev in old.items():
            if k not in fresh:
                self.on_event("DELETED", prev, None)
        self.synced.set()
        return rv

    def run(self) -> None:
        """List, then watch from the list's resourceVersion; re-list on 410 or errors."""
        rv = ""
        while not self._stop.is_set():
            try:
                if not rv:
                    rv = self._relist()
                for ev in self.kube.watch(
                    self.res,
                    rv,
                    self.namespace,
                    label_selector=self.label_selector,
                    timeout_s=self.watch_timeout_s,
                    stop=self._stop,
                ):
                    if self._stop.is_set():
                        return
                    rv = ev.resource_version or rv
                    if ev.type == "BOOKMARK":
                        continue
                    k = _key(ev.object)
                    with self._lock:
                        prev = self._cache.get(k)
                        if ev.type == "DELETED":
                            self._cache.pop(k, None)
                        else:
                            self._cache[k] = ev.object
                    if ev.type == "DELETED":
                        self.on_event("DELETED", prev, None)
                    else:
                        self.on_event(ev.type if prev is None else "MODIFIED", prev, ev.object)
            except GoneError:
                self.log.info("watch expired; listing again")
                rv = ""
            except (ApiError, OperatorError) as exc:
                self.log.warning("watch failed; listing again", error=str(exc))
                rv = ""
                self._stop.wait(self.retry_delay_s)
            except Exception as exc:  # loop boundary: keep the informer alive
                self.log.error("informer error", error=repr(exc))
                rv = ""
                self._stop.wait(self.retry_delay_s)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self.run, name=f"informer-{self.res.plural}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


_PLACEMENT_IGNORED_STATUS = ("lastHeartbeatTime",)


def placement_relevant(obj: Json | None) -> Any:
    """The parts of a GPUNode that placement reads (heartbeat time excluded)."""
    if obj is None:
        return None
    meta = obj.get("metadata") or {}
    status = {
        k: v for k, v in (obj.get("status") or {}).items() if k not in _PLACEMENT_IGNORED_STATUS
    }
    return (
        meta.get("labels"),
        meta.get("deletionTimestamp"),
        obj.get("spec"),
        status,
    )


class Operator:
    """The ModelDeployment operator.

    Args:
        kube: API access for the operator's work (its write guard is set to leadership).
        settings: operator settings.
        clock: wall clock, UTC (injectable for tests).
        solver: the placement solve (``policies.solve.solve``; injectable for tests).
        lease_kube: API access for the Lease (default: a copy of ``kube`` without guard).
        tier_planner: the interactive / batch split (``policies.tier_planner.plan_tiers``;
            injectable for tests).
    """

    def __init__(
        self,
        kube: Kube,
        settings: OperatorSettings | None = None,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        solver: Callable[[PlacementRequest], PlacementResult] = solve,
        lease_kube: Kube | None = None,
        tier_planner: Callable[[TierRequest], TierPlan] = plan_tiers,
    ) -> None:
        from operators.workqueue import WorkQueue

        self.settings = settings or OperatorSettings()
        self.kube = kube
        self.clock = clock
        self.solver = solver
        self.tier_planner = tier_planner
        self.log = structlog.get_logger("mixfleet.operator")
        self.queue: WorkQueue[Key] = WorkQueue(
            base_delay_s=self.settings.retry_base_delay_s,
            max_delay_s=self.settings.retry_max_delay_s,
        )
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.elector: LeaderElector | None = None
        if self.settings.leader is not None:
            lk = lease_kube or Kube(kube.api_client, field_manager=self.settings.field_manager)
            self.elector = LeaderElector(
                lk,
                self.settings.leader,
                on_started_leading=self._on_leading,
                on_stopped_leading=lambda: LEADER.set(0),
            )
            kube.write_guard = self.elector.is_leader
        #: solves and tier splits run, for tests and metrics.
        self.solves = 0
        self.tier_splits = 0
        self._last_beat = time.monotonic()
        ns_list: list[str | None] = list(self.settings.namespaces) or [None]
        managed = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
        t = self.settings.watch_timeout_s
        self.deployments = [
            Informer(
                kube,
                MODEL_DEPLOYMENTS,
                namespace=ns,
                on_event=self._on_deployment,
                watch_timeout_s=t,
            )
            for ns in ns_list
        ]
        self.plans = [
            Informer(
                kube,
                PARTITION_PLANS,
                namespace=ns,
                label_selector=managed,
                on_event=self._on_owned,
                watch_timeout_s=t,
            )
            for ns in ns_list
        ]
        self.config_maps = [
            Informer(
                kube,
                CONFIGMAPS,
                namespace=ns,
                label_selector=managed,
                on_event=self._on_owned,
                watch_timeout_s=t,
            )
            for ns in ns_list
        ]
        self.nodes = Informer(kube, GPUNODES, on_event=self._on_node, watch_timeout_s=t)
        self.policies = Informer(
            kube, PLACEMENT_POLICIES, on_event=self._on_policy, watch_timeout_s=t
        )

    # ------------------------------------------------------------------- events

    @property
    def informers(self) -> list[Informer]:
        return [*self.deployments, *self.plans, *self.config_maps, self.nodes, self.policies]

    def deployment_keys(self) -> list[Key]:
        return [_key(o) for inf in self.deployments for o in inf.items()]

    def enqueue_all(self) -> None:
        for k in self.deployment_keys():
            self.queue.add(k)

    def _on_leading(self) -> None:
        LEADER.set(1)
        self.enqueue_all()

    def _on_deployment(self, _type: str, old: Json | None, new: Json | None) -> None:
        self.queue.add(_key(new or old or {}))

    def _on_owned(self, _type: str, old: Json | None, new: Json | None) -> None:
        obj = new or old or {}
        meta = obj.get("metadata") or {}
        name = (meta.get("labels") or {}).get(LABEL_DEPLOYMENT)
        if name:
            self.queue.add((str(meta.get("namespace") or ""), str(name)))

    def _on_node(self, _type: str, old: Json | None, new: Json | None) -> None:
        if placement_relevant(old) != placement_relevant(new):
            self.enqueue_all()

    def _on_policy(self, _type: str, old: Json | None, new: Json | None) -> None:
        name = _key(new or old or {})[1]
        for inf in self.deployments:
            for obj in inf.items():
                ref = ((obj.get("spec") or {}).get("policyRef") or {}).get("name")
                if ref == name or (ref is None and name == self.settings.default_policy):
                    self.queue.add(_key(obj))

    # ------------------------------------------------------------------ observe

    def observe(self, key: Key) -> Observed | None:
        """Gather what one reconcile of ``key`` looks at; None when the deployment is gone."""
        ns, name = key
        obj = self.kube.get(MODEL_DEPLOYMENTS, name, ns)
        if obj is None:
            return None
        meta = obj.get("metadata") or {}
        spec: ModelDeploymentSpec | None = None
        spec_error = ""
        try:
            spec = from_wire(ModelDeploymentSpec, obj.get("spec") or {}, "spec")
        except InputError as exc:
            spec_error = str(exc)
        try:
            status = from_wire(ModelDeploymentStatus, obj.get("status") or {}, "status")
        except InputError:
            status = ModelDeploymentStatus()
        d = DeploymentView(
            name=name,
            namespace=ns,
            uid=str(meta.get("uid") or ""),
            generation=int(meta.get("generation") or 0),
            finalizers=tuple(meta.get("finalizers") or ()),
            deleting=bool(meta.get("deletionTimestamp")),
            spec=spec,
            status=status,
            spec_error=spec_error,
        )
        policy_name = (
            spec.policy_ref.name if spec and spec.policy_ref else self.settings.default_policy
        )
        policy = PlacementPolicySpec()
        missing = ""
        pobj = self.policies.get(("", policy_name))
        if pobj is not None:
            try:
                policy = from_wire(PlacementPolicySpec, pobj.get("spec") or {}, "spec")
            except InputError:
                missing = policy_name
        elif spec is not None and spec.policy_ref is not None:
            missing = policy_name
        nodes = tuple(self._node_view(o) for o in self.nodes.items())
        plan_objs, _ = self.kube.list(
            PARTITION_PLANS, ns, label_selector=f"{LABEL_DEPLOYMENT}={name}"
        )
        plans = tuple(p for p in (self._plan_view(o) for o in plan_objs) if p is not None)
        cm = self.kube.get(CONFIGMAPS, config_map_name(name), ns)
        cm_view = None
        if cm is not None:
            cm_meta = cm.get("metadata") or {}
            cm_view = ConfigMapView(
                name=str(cm_meta.get("name")),
                plan=str((cm_meta.get("annotations") or {}).get("mixfleet.io/plan", "")),
                keys=tuple(sorted((cm.get("data") or {}).keys())),
            )
        return Observed(
            deployment=d,
            nodes=nodes,
            plans=plans,
            config_map=cm_view,
            policy=policy,
            now=self.clock(),
            policy_name=policy_name if pobj is not None else "",
            policy_missing=missing,
            version_floor=read_floor(self.kube, ns, name),
        )

    @staticmethod
    def _node_view(obj: Json) -> NodeView:
        meta = obj.get("metadata") or {}
        try:
            spec = from_wire(GPUNodeSpec, obj.get("spec") or {}, "spec")
        except InputError:
            spec = GPUNodeSpec(cordon=True)
        try:
            status = from_wire(GPUNodeStatus, obj.get("status") or {}, "status")
        except InputError:
            status = GPUNodeStatus()
        return NodeView(
            name=str(meta.get("name")),
            labels=dict(meta.get("labels") or {}),
            spec=spec,
            status=status,
            deleting=bool(meta.get("deletionTimestamp")),
        )

    def _plan_view(self, obj: Json) -> PlanView | None:
        meta = obj.get("metadata") or {}
        try:
            spec = from_wire(PartitionPlanSpec, obj.get("spec") or {}, "spec")
        except InputError as exc:
            self.log.warning("unreadable PartitionPlan", plan=meta.get("name"), error=str(exc))
            return None
        try:
            status = from_wire(PartitionPlanStatus, obj.get("status") or {}, "status")
        except InputError:
            status = PartitionPlanStatus()
        return PlanView(
            name=str(meta.get("name")),
            uid=str(meta.get("uid") or ""),
            spec=spec,
            status=status,
            deleting=bool(meta.get("deletionTimestamp")),
        )

    # -------------------------------------------------------------------- solve

    def run_solve(self, action: SolveAction) -> SolveOutcome:
        """Run one placement solve; spec errors become a failed outcome, not an exception."""
        self.solves += 1
        t0 = time.monotonic()
        try:
            result = self.solver(action.request).require_placed()
        except InfeasibleError as exc:
            return SolveOutcome(
                action.inputs_digest, None, "Infeasible", str(exc), time.monotonic() - t0
            )
        except InputError as exc:
            return SolveOutcome(
                action.inputs_digest, None, "InvalidSpec", str(exc), time.monotonic() - t0
            )
        except SolverError as exc:
            return SolveOutcome(
                action.inputs_digest, None, "SolverError", str(exc), time.monotonic() - t0
            )
        elapsed = time.monotonic() - t0
        SOLVES.observe(elapsed)
        if result.infeasible:
            reasons = "; ".join(result.infeasible[:8])
            return SolveOutcome(
                action.inputs_digest,
                None,
                "Infeasible",
                f"no placement satisfies every constraint: {reasons}. To fix: add GPUs, "
                "lower workload.tokensPerGpu or contextLen, or use kvCacheDtype: fp8",
                elapsed,
            )
        return SolveOutcome(action.inputs_digest, result.plan, "Solved", "", elapsed)

    def run_tiers(self, action: TierAction) -> TierOutcome:
        """Split the nodes into interactive and batch tiers; a bad tier becomes a failed
        outcome (``InvalidTier``, permanent), a solver failure ``TierPlanningFailed``
        (retried), never an exception."""
        self.tier_splits += 1
        t0 = time.monotonic()
        try:
            split = self.tier_planner(action.request)
        except InputError as exc:
            return TierOutcome(
                action.inputs_digest,
                None,
                "InvalidTier",
                f"{exc}. To fix: correct the PlacementPolicy's interactive tier or the "
                "deployment's spec",
                time.monotonic() - t0,
            )
        except (InfeasibleError, SolverError) as exc:
            return TierOutcome(
                action.inputs_digest, None, "TierPlanningFailed", str(exc), time.monotonic() - t0
            )
        elapsed = time.monotonic() - t0
        TIER_SPLITS.observe(elapsed)
        return TierOutcome(action.inputs_digest, split, "Planned", "", elapsed)

    # ---------------------------------------------------------------------- act

    def reconcile_key(self, key: Key) -> tuple[Action, ...]:
        """One tick for one deployment: observe, decide, solve if needed, act.

        Returns the actions taken (for tests and logs).

        Raises:
            TemporaryError: retry later (API unavailable, conflict, lost leadership).
        """
        observed = self.observe(key)
        if observed is None:
            return ()
        rs = self.settings.reconcile
        actions = reconcile(observed, rs)
        # At most a tier split, then a solve (and one more round if the inputs moved on
        # meanwhile); each outcome goes back into the decision.
        for _ in range(3):
            step = next((a for a in actions if isinstance(a, TierAction | SolveAction)), None)
            if step is None:
                break
            for a in actions:
                if isinstance(a, SetFinalizer):
                    self._set_finalizer(observed.deployment, a.present)
            deployment = dataclasses.replace(
                observed.deployment,
                finalizers=tuple({*observed.deployment.finalizers, FINALIZER}),
            )
            if isinstance(step, TierAction):
                tiers = self.run_tiers(step)
                self.log.info(
                    "tiers split",
                    deployment=f"{key[0]}/{key[1]}",
                    reason=tiers.reason,
                    seconds=round(tiers.duration_s, 3),
                )
                observed = dataclasses.replace(
                    observed, tiers=tiers, now=self.clock(), deployment=deployment
                )
            else:
                outcome = self.run_solve(step)
                self.log.info(
                    "solved",
                    deployment=f"{key[0]}/{key[1]}",
                    reason=outcome.reason,
                    seconds=round(outcome.duration_s, 3),
                    plan=outcome.plan.id if outcome.plan else None,
                )
                observed = dataclasses.replace(
                    observed, solve=outcome, now=self.clock(), deployment=deployment
                )
            actions = reconcile(observed, rs)
        if any(isinstance(a, TierAction | SolveAction) for a in actions):
            actions = (*actions, Requeue(0.1))  # inputs kept moving: look again
        self.act(observed, actions)
        return actions

    def act(self, observed: Observed, actions: Iterable[Action]) -> None:
        """Carry out the actions in order."""
        d = observed.deployment
        ns = d.namespace
        for a in actions:
            if isinstance(a, SetFinalizer):
                self._set_finalizer(d, a.present)
            elif isinstance(a, ApplyPlan):
                self._create_plan(a.body)
            elif isinstance(a, DeletePlan):
                self.kube.delete(PARTITION_PLANS, a.name, ns, uid=a.uid or None)
            elif isinstance(a, ApplyConfigMap):
                self.kube.apply(CONFIGMAPS, a.body)
            elif isinstance(a, DeleteConfigMap):
                self.kube.delete(CONFIGMAPS, a.name, ns)
            elif isinstance(a, ApplyStatus):
                body = {"metadata": {"name": d.name, "namespace": ns}, "status": a.status}
                try:
                    self.kube.apply(MODEL_DEPLOYMENTS, body, subresource="status")
                except NotFoundError:
                    return  # deleted meanwhile
            elif isinstance(a, Requeue):
                self.queue.add_after((ns, d.name), a.after_s)

    def _create_plan(self, body: Json) -> None:
        """Create a PartitionPlan and record its version; a name already taken means another
        writer allocated the version first - observe again."""
        meta = body["metadata"]
        try:
            self.kube.create(
                PARTITION_PLANS,
                dict(body, apiVersion=PARTITION_PLANS.api_version, kind=PARTITION_PLANS.kind),
            )
        except ConflictError as exc:
            raise TemporaryError(
                f"PartitionPlan {body['metadata']['name']} exists already; re-observing",
                delay_s=0.1,
            ) from exc
        except InvalidError as exc:
            raise TemporaryError(f"PartitionPlan rejected: {exc}") from exc
        record_version(
            self.kube, meta["namespace"], body["spec"]["deployment"], int(body["spec"]["version"])
        )

    def _set_finalizer(self, d: DeploymentView, present: bool) -> None:
        """Add or remove the finalizer: read, modify, merge patch with resourceVersion as
        precondition; on 409 read again (at most ``conflict_retries`` times)."""
        for attempt in range(self.settings.conflict_retries):
            obj = self.kube.get(MODEL_DEPLOYMENTS, d.name, d.namespace)
            if obj is None or obj["metadata"].get("uid") != d.uid:
                return
            finalizers = list(obj["metadata"].get("finalizers") or [])
            if (FINALIZER in finalizers) == present:
                return
            if present:
                finalizers.append(FINALIZER)
            else:
                finalizers = [f for f in finalizers if f != FINALIZER]
            patch = {
                "metadata": {
                    "finalizers": finalizers or None,
                    "resourceVersion": obj["metadata"]["resourceVersion"],
                }
            }
            try:
                self.kube.merge_patch(MODEL_DEPLOYMENTS, d.name, patch, d.namespace)
                return
            except ConflictError:
                self.log.info(
                    "finalizer conflict; retrying", deployment=d.name, attempt=attempt + 1
                )
            except NotFoundError:
                return
        raise ConflictError(
            409, "Conflict", f"finalizer of {d.namespace}/{d.name}: too many conflicts"
        )

    # -------------------------------------------------------------------- loops

    def _worker(self) -> None:
        while not self._stop.is_set():
            key = self.queue.get(timeout_s=1.0)
            self._last_beat = time.monotonic()
            if key is None:
                continue
            try:
                if self.elector is not None and not self.elector.is_leader():
                    continue  # the new leader enqueues every deployment
                self.reconcile_key(key)
                self.queue.forget(key)
                RECONCILES.labels("ok").inc()
            except NotLeaderError:
                RECONCILES.labels("not_leader").inc()
            except TemporaryError as exc:
                delay = self.queue.retry(key, exc.delay_s)
                RECONCILES.labels("retry").inc()
                self.log.info(
                    "retrying", deployment=f"{key[0]}/{key[1]}", error=str(exc), delay_s=delay
                )
            except Exception as exc:  # loop boundary: log, back off, keep serving others
                delay = self.queue.retry(key)
                RECONCILES.labels("error").inc()
                self.log.error(
                    "reconcile failed",
                    deployment=f"{key[0]}/{key[1]}",
                    error=repr(exc),
                    delay_s=delay,
                )
            finally:
                self.queue.done(key)

    def _resync(self) -> None:
        while not self._stop.wait(self.settings.resync_period_s):
            self.enqueue_all()

    def start(self, *, wait_synced_s: float = 30.0) -> None:
        """Start informers, wait for their first list, then election and workers."""
        for inf in self.informers:
            inf.start()
        deadline = time.monotonic() + wait_synced_s
        for inf in self.informers:
            inf.synced.wait(max(0.0, deadline - time.monotonic()))
        if self.elector is not None:
            self.elector.start()
        else:
            LEADER.set(1)
            self.enqueue_all()
        for i in range(max(1, self.settings.workers)):
            t = threading.Thread(target=self._worker, name=f"reconcile-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._resync, name="resync", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        """Stop workers and informers and release the lease."""
        self._stop.set()
        self.queue.shutdown()
        for inf in self.informers:
            inf.stop()
        for t in self._threads:
            t.join(timeout=5.0)
        if self.elector is not None:
            self.elector.stop()

    def is_leader(self) -> bool:
        return self.elector.is_leader() if self.elector is not None else True

    def healthy(self, *, stall_s: float = 60.0) -> bool:
        """Informers and workers alive, and workers polled the queue recently."""
        return (
            all(inf.alive() for inf in self.informers)
            and all(t.is_alive() for t in self._threads)
            and time.monotonic() - self._last_beat < stall_s
        )

    def ready(self) -> bool:
        """Every informer listed at least once."""
        return all(inf.synced.is_set() for inf in self.informers)
