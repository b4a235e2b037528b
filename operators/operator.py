"""The ModelDeployment operator: its settings, and the observe -> reconcile -> act loop
around :func:`operators.decide.reconcile`, fed by informers through a work queue.

* Informers (:mod:`operators.informer`) list and watch ModelDeployments, GPUNodes,
  PlacementPolicies, and the PartitionPlans and ConfigMaps the operator manages,
  re-listing when a watch's resourceVersion is too old (410 Gone). Events turn into
  deployment keys on the queue: a deployment's own events, its plans' and ConfigMap's (by
  the ``mixfleet.io/deployment`` label), every deployment on a GPUNode change that matters
  to placement (heartbeat-only updates do not), and the deployments using a
  PlacementPolicy when it changes.
* Workers take keys one at a time per key. A tick observes (a fresh GET of the deployment,
  a LIST of its PartitionPlans, a GET of its ConfigMap; GPUNodes and policies from the
  informers' caches), decides, solves when told to, and acts (:mod:`operators.act`):
  server-side apply under the operator's field manager, deletes with uid preconditions,
  the finalizer through a JSON merge patch guarded by resourceVersion and retried on 409.
* Only the leader (Lease election, :mod:`apis.kube.leader`) works the queue, and every
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import structlog
from prometheus_client import Counter, Gauge

from apis.curvecache import open_curve_cache
from apis.kube.client import (
    CONFIGMAPS,
    GPUNODES,
    MODEL_DEPLOYMENTS,
    PARTITION_PLANS,
    PLACEMENT_POLICIES,
    Json,
    Kube,
)
from apis.kube.errors import NotLeaderError, TemporaryError
from apis.kube.leader import LeaderElector, LeaderSettings
from apis.kube.names import (
    FINALIZER,
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    config_map_name,
)
from apis.kube.schema import from_wire
from apis.kube.v1alpha1 import PlacementPolicySpec
from apis.kube.versions import read_floor
from operators.act import act, run_solve, run_tiers, set_finalizer
from operators.decide import (
    Action,
    Requeue,
    SetFinalizer,
    SolveAction,
    TierAction,
    reconcile,
)
from operators.fleet_schedule import FleetAssignments
from operators.informer import Informer, Key, key_of, placement_relevant
from operators.instances import child_views, parent_of
from operators.observe import (
    ChildView,
    ConfigMapView,
    NodeView,
    Observed,
    PlanView,
    ReconcileSettings,
    SolveOutcome,
    TierOutcome,
    config_map_view,
    deployment_view,
    held_version,
    node_view,
    plan_view,
)
from operators.parent import reconcile_parent
from policies.advice.tier_planner import plan_tiers
from policies.advice.tiers import TierPlan, TierRequest
from policies.defaults import DRAIN_GRACE_S
from policies.errors import InputError
from policies.fleetplan import PlannerSettings
from policies.request import PlacementRequest, PlacementResult
from policies.solve import solve

RECONCILES = Counter("mixfleet_operator_reconciles_total", "Reconcile ticks by result", ["result"])
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
        fleet_scheduler: assign GPUNodes to ModelDeployments exclusively
            (:mod:`operators.fleet_schedule`); off, each plans on every eligible GPUNode.
        namespace_quotas_gpus: Kubernetes namespace -> most GPUs its ModelDeployments may
            hold together (the fleet scheduler's quotas); a namespace not named has none.
        fleet_planner: the fleet planner's settings, for ModelDeployments that state traffic
            and SLOs (they run as engine instances: :mod:`operators.instances`).
        drain_grace_s: how long an engine instance the fleet plan dropped drains - routers
            send it no new request, its open ones finish - before its ModelDeployment is
            deleted, s (``mixfleet-operator run --drain-grace``; the standalone
            controller's ``drain_grace_s``).
        curve_cache_dir: directory of the fleet planner's step curves
            (:class:`apis.curvecache.FileCurveCache`, ``mixfleet-operator run
            --curve-cache``): a restarted operator reads them instead of computing them again;
            "" keeps them in memory only.
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
    fleet_scheduler: bool = True
    namespace_quotas_gpus: Mapping[str, int] = field(default_factory=dict)
    fleet_planner: PlannerSettings = field(default_factory=PlannerSettings)
    drain_grace_s: float = DRAIN_GRACE_S
    curve_cache_dir: str = ""


class Operator:
    """The ModelDeployment operator.

    Args:
        kube: API access for the operator's work (its write guard is set to leadership).
        settings: operator settings.
        clock: wall clock, UTC (injectable for tests).
        solver: the placement solve (``policies.solve.solve``; injectable for tests).
        lease_kube: API access for the Lease (default: a copy of ``kube`` without guard).
        tier_planner: the interactive / batch split (``policies.advice.tier_planner.plan_tiers``;
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
        self.fleet = self._fleet_assignments()

    def _fleet_assignments(self) -> FleetAssignments:
        """The fleet schedule; its step curves on disk when ``curve_cache_dir`` is set."""
        s = self.settings
        return FleetAssignments(
            s.namespace_quotas_gpus, s.fleet_planner, open_curve_cache(s.curve_cache_dir)
        )

    # ------------------------------------------------------------------- events

    @property
    def informers(self) -> list[Informer]:
        return [*self.deployments, *self.plans, *self.config_maps, self.nodes, self.policies]

    def deployment_keys(self) -> list[Key]:
        return [key_of(o) for inf in self.deployments for o in inf.items()]

    def enqueue_all(self) -> None:
        for k in self.deployment_keys():
            self.queue.add(k)

    def _on_leading(self) -> None:
        LEADER.set(1)
        self.enqueue_all()

    def _on_deployment(self, _type: str, old: Json | None, new: Json | None) -> None:
        obj = new or old or {}
        self.queue.add(key_of(obj))
        parent = parent_of(obj)
        if parent:  # an engine instance: its parent reports it (and puts back an edit)
            self.queue.add((key_of(obj)[0], parent))
            # and a dropped instance may drain now that another one is ready
            for k in self.fleet.dropped():
                self.queue.add(k)

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
        name = key_of(new or old or {})[1]
        for inf in self.deployments:
            for obj in inf.items():
                ref = ((obj.get("spec") or {}).get("policyRef") or {}).get("name")
                if ref == name or (ref is None and name == self.settings.default_policy):
                    self.queue.add(key_of(obj))

    # ------------------------------------------------------------------ observe

    def observe(self, key: Key) -> Observed | None:
        """Gather what one reconcile of ``key`` looks at; None when the deployment is gone."""
        ns, name = key
        obj = self.kube.get(MODEL_DEPLOYMENTS, name, ns)
        if obj is None:
            return None
        d = deployment_view(obj, ns, name)
        spec = d.spec
        policy_name = (
            spec.policy_ref.name if spec and spec.policy_ref else self.settings.default_policy
        )
        policy = PlacementPolicySpec()
        missing = policy_error = ""
        pobj = self.policies.get(("", policy_name))
        if pobj is not None:
            try:
                policy = from_wire(PlacementPolicySpec, pobj.get("spec") or {}, "spec", strict=True)
            except InputError as exc:  # reported on the deployments that use it
                policy_error = str(exc)
        elif spec is not None and spec.policy_ref is not None:
            missing = policy_name
        nodes = tuple(node_view(o) for o in self.nodes.items())
        plan_objs, _ = self.kube.list(
            PARTITION_PLANS, ns, label_selector=f"{LABEL_DEPLOYMENT}={name}"
        )
        views = [(o, self._plan_view(o)) for o in plan_objs]
        plans = tuple(v for _, v in views if isinstance(v, PlanView))
        unreadable = [(o, v) for o, v in views if isinstance(v, str)]
        cm_view = self._config_map(ns, name)
        assigned, unschedulable = self._assignment(key, nodes)
        planned = self.fleet.parent(key) if self.settings.fleet_scheduler else None
        now = self.clock()
        instance = (
            self.fleet.record(key, now.timestamp()) if self.settings.fleet_scheduler else None
        )
        return Observed(
            planned=planned,
            instance=instance,
            children=self._children(key),
            assigned_nodes=assigned,
            unschedulable=unschedulable,
            deployment=d,
            nodes=nodes,
            plans=plans,
            config_map=cm_view,
            policy=policy,
            now=now,
            policy_name=policy_name if pobj is not None else "",
            policy_missing=missing,
            policy_error=policy_error,
            # A plan that does not parse still holds its name: new versions go above it.
            version_floor=max(
                [read_floor(self.kube, ns, name), *(held_version(o) for o, _ in unreadable)]
            ),
            unreadable_plans=tuple(
                f"{(o.get('metadata') or {}).get('name')}: {why}" for o, why in unreadable
            ),
        )

    def _config_map(self, ns: str, name: str) -> ConfigMapView | None:
        """The deployment's ConfigMap (a fresh GET), or None."""
        cm = self.kube.get(CONFIGMAPS, config_map_name(name), ns)
        return config_map_view(cm) if cm is not None else None

    def _children(self, key: Key) -> tuple[ChildView, ...]:
        """The engine instances' ModelDeployments labelled as serving ``key`` (from the
        informers' cache)."""
        return child_views([o for inf in self.deployments for o in inf.items()], key)

    def _assignment(
        self, key: Key, nodes: tuple[NodeView, ...]
    ) -> tuple[tuple[str, ...] | None, str]:
        """The fleet scheduler's GPUNodes for ``key`` and its Pending reason (None, "" when
        the scheduler is off); a new assignment re-queues every deployment."""
        if not self.settings.fleet_scheduler:
            return None, ""
        objs = [o for inf in self.deployments for o in inf.items()]
        assigned, why, changed = self.fleet.of(
            key,
            objs,
            nodes,
            self._policy_spec,
            self.clock(),
            self.settings.reconcile.node_stale_after_s,
        )
        if changed:
            self.enqueue_all()
        return assigned, why

    def _policy_spec(self, ref: str) -> PlacementPolicySpec:
        """The PlacementPolicy ``ref`` (the default one for ""), or the built-in defaults."""
        pobj = self.policies.get(("", ref or self.settings.default_policy))
        if pobj is None:
            return PlacementPolicySpec()
        try:
            return from_wire(PlacementPolicySpec, pobj.get("spec") or {}, "spec", strict=True)
        except InputError:
            return PlacementPolicySpec()

    _node_view = staticmethod(node_view)

    def _plan_view(self, obj: Json) -> PlanView | str:
        """The PartitionPlan, or why it does not parse (it is then left alone, logged)."""
        view = plan_view(obj)
        if isinstance(view, str):
            name = (obj.get("metadata") or {}).get("name")
            self.log.warning("unreadable PartitionPlan", plan=name, error=view)
        return view

    # -------------------------------------------------------------------- solve

    def run_solve(self, action: SolveAction) -> SolveOutcome:
        """Run one placement solve (:func:`operators.act.run_solve`), counted in ``solves``."""
        self.solves += 1
        return run_solve(self.solver, action)

    def run_tiers(self, action: TierAction) -> TierOutcome:
        """Run one tier split (:func:`operators.act.run_tiers`), counted in ``tier_splits``."""
        self.tier_splits += 1
        return run_tiers(self.tier_planner, action)

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
        if observed.planned is not None:  # runs as engine instances
            actions = reconcile_parent(observed, self.settings.drain_grace_s)
            self.act(observed, actions)
            return actions
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
                    set_finalizer(
                        self.kube,
                        observed.deployment,
                        a.present,
                        conflict_retries=self.settings.conflict_retries,
                    )
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
        """Carry out the actions in order (:func:`operators.act.act`)."""
        act(
            self.kube,
            observed,
            actions,
            requeue=self.queue.add_after,
            conflict_retries=self.settings.conflict_retries,
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
