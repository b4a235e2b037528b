"""The fleet scheduler in the operator: which GPUNodes each ModelDeployment may plan on.

In Kubernetes mode the operator decides the plans, so it is the one writer of the assignment
(the controller's own scheduler is off there: ``ReconcileSettings.solves`` False). It runs
the same :func:`policies.scheduling.schedule` the standalone controller runs, over every
ModelDeployment it serves: each one's spec resolved against its PlacementPolicy
(:func:`operators.effective.effective_spec`) and its eligible GPUNodes
(:func:`operators.inputs.eligible_fleet`). The answer is cached by a fingerprint of every
deployment's generation and eligible nodes, so the workers' reconciles share one solve; a
new answer re-queues every deployment. A deployment without nodes gets the Pending reason,
which :mod:`operators.decide` reports as ``Solved=False``, reason ``Unschedulable`` (and its
PartitionPlans are withdrawn, so its GPUNodes free at once).

Quotas: a ModelDeployment's quota namespace is its own ``metadata.namespace``; the GPUs a
namespace's deployments may hold together come from ``OperatorSettings.namespace_quotas_gpus``
(``mixfleet-operator run --namespace-quota NS=GPUS``).

Graceful drain (:func:`drained`): a GPUNode moves to its new deployment only once every
placed deployment it is taken from no longer has it in its current plan
(``status.nodes``); until then the new holder plans on the assigned nodes it already has.

Planned deployments (:mod:`operators.instances`): ModelDeployments that state traffic and
SLOs go through the fleet planner, the previous plan kept for the move penalty; the others
through :func:`policies.scheduling.schedule` on the GPUNodes the instances still holding
nodes leave; priority orders both kinds (a higher one first, an equal one never takes a
running deployment's GPUNodes) - one decision,
:func:`policies.fleetplan.combined.plan_and_schedule`, as in the standalone controller. A planned deployment gets no nodes
itself: each of its instances' ModelDeployments is assigned its planned nodes (less those a
draining instance or another holder still has in its current plan); an instance the plan
dropped keeps the nodes of its current plan until its parent deletes it, its record retiring
and then draining as in the standalone controller (:meth:`FleetAssignments.record`).

Demand drift: a planned deployment is planned for the traffic the controller chose after a
sustained drift of the demand its routers measured (``status.controller.demand``, read by
:func:`apis.kube.demand.replanned_demand`) while that record stands, else for its spec's.
That traffic is part of the fingerprint, so the controller's choice re-plans the fleet (the
instances then surge and drain as for any re-plan); the measured figures it rewrites every
few seconds are not, and move nothing.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from apis.kube.demand import Replanned, replanned_demand
from apis.kube.errors import PermanentError
from apis.kube.schema import from_wire
from apis.kube.v1alpha1 import InstanceRecordStatus, ModelDeploymentSpec, PlacementPolicySpec
from operators.inputs import effective_spec, eligible_fleet
from operators.instances import (
    PlannedEntry,
    child_record,
    child_views,
    instance_record,
    is_child,
    parent_of,
    parent_plans,
    planner_names,
    running_instances,
)
from operators.observe import ChildView, NodeView, ParentPlan
from operators.parent import is_ready
from policies.errors import InputError
from policies.fleetplan import FleetPlan, MemoryCurveCache, PlannerSettings
from policies.fleetplan.combined import (
    FleetDecision,
    PlanOptions,
    ScheduleOptions,
    plan_and_schedule,
)
from policies.fleetplan.curves import CurveCache
from policies.fleetplan.instances import (
    ServingInstance,
    capacity_lost,
    first_to_drain,
    is_planned,
)
from policies.hardware.fleet import Fleet, Node
from policies.launch import PlannedInstance
from policies.scheduling.table import EstimateCache
from policies.serving.traffic import traffic_to_doc
from policies.spec.build import DeploymentSpec, check_spec

Key = tuple[str, str]
Json = dict[str, Any]
#: key, generation, resolved spec, eligible nodes, nodes of its current plan
Entry = tuple[Key, int, DeploymentSpec, tuple[Node, ...], tuple[str, ...]]


@dataclass(frozen=True)
class Child:
    """An engine instance's ModelDeployment as the fleet schedule sees it.

    Attributes:
        parent: the deployment it serves (same namespace).
        held: the GPUNodes of its current plan (``status.nodes``).
        record: its ``status.instance`` (None before the first one is written).
        obj: the object.
    """

    parent: str
    held: tuple[str, ...]
    record: InstanceRecordStatus | None
    obj: Json


class FleetAssignments:
    """One assignment of GPUNodes to the operator's ModelDeployments (thread-safe).

    Args:
        quotas_gpus: Kubernetes namespace -> most GPUs its deployments may hold together.
        planner: the fleet planner's settings (planned deployments).
        curves: the planner's step curves kept between plans (in memory when None).
    """

    def __init__(
        self,
        quotas_gpus: Mapping[str, int] | None = None,
        planner: PlannerSettings | None = None,
        curves: CurveCache | None = None,
    ) -> None:
        self.quotas_gpus = dict(quotas_gpus or {})
        self.planner = planner or PlannerSettings()
        self.curves: CurveCache = curves if curves is not None else MemoryCurveCache()
        self.cache = EstimateCache()
        self.assigned: dict[Key, tuple[str, ...]] = {}
        self.reasons: dict[Key, str] = {}
        self.unplaceable: set[Key] = set()
        self.fleet_plan: FleetPlan | None = None
        self.parents: dict[Key, ParentPlan] = {}
        self.records: dict[Key, InstanceRecordStatus] = {}
        self.children: dict[Key, Child] = {}
        self._key = ""
        self._held: dict[Key, tuple[str, ...]] = {}
        self._lock = threading.Lock()

    def of(
        self,
        key: Key,
        deployments: Sequence[Json],
        nodes: Sequence[NodeView],
        policy_of: Callable[[str], PlacementPolicySpec],
        now: datetime,
        stale_after_s: float,
    ) -> tuple[tuple[str, ...] | None, str, bool]:
        """``(assigned nodes, Pending reason, changed)`` of ``key``; ``changed``: a new
        assignment was solved or a current plan's nodes changed (re-queue every
        deployment). None when ``key`` is not a deployment the scheduler could read (its
        own reconcile reports why)."""
        entries, children, replanned = _entries(deployments, nodes, policy_of, now, stale_after_s)
        text = "\n".join(
            f"{k}:{gen}:{','.join(n.name for n in ns)}:{_demand_key(replanned.get(k))}"
            for k, gen, _, ns, _ in entries
        )
        changed = False
        with self._lock:
            # Instances the plan dropped hold nodes until deleted: their going frees nodes.
            dropped = sorted(k for k in children if k not in self.records)
            text += "\n" + ",".join(f"{k[0]}/{k[1]}" for k in dropped)
            fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
            self.children = children
            if fingerprint != self._key:
                self._solve(entries, replanned)
                self._key, changed = fingerprint, True
            held = {e[0]: e[4] for e in entries} | {k: c.held for k, c in children.items()}
            if held != self._held:  # a drain may have ended: re-queue the waiting ones
                self._held, changed = held, True
            if key in self.records:
                mine, why = self._instance_nodes(key, held)
                return mine, why, changed
            if key in children:  # dropped by the plan: keeps its nodes until deleted
                kept = children[key].held
                return kept, "" if kept else "the fleet plan no longer has this instance", changed
            if key in self.parents:
                return None, "", changed  # runs as its instances
            if key not in {e[0] for e in entries} or key in self.unplaceable:
                return None, "", changed
            if key in self.reasons:
                return (), self.reasons[key], changed
            mine, why = drained(key, self.assigned, held)
            return mine, why, changed

    def parent(self, key: Key) -> ParentPlan | None:
        """The fleet plan of ``key`` when it is a planned deployment (after :meth:`of`)."""
        with self._lock:
            return self.parents.get(key)

    def record(self, key: Key, now_s: float) -> InstanceRecordStatus | None:
        """The ``status.instance`` of ``key`` when it is an instance's ModelDeployment: what
        the plan wants of it, or - dropped by the plan - its last record, retiring or
        draining (:meth:`_drains`); ``now_s``: the time, Unix s, a drain that starts now
        records as ``drainingSinceS``."""
        with self._lock:
            if key in self.records:
                return self.records[key]
            child = self.children.get(key)
            if child is None or child.record is None:
                return None
            rec = child.record
            if rec.draining and rec.draining_since_s > 0:
                return rec  # the grace runs from when it began, across restarts
            if rec.draining or self._drains(key):
                return replace(rec, retiring=False, draining=True, draining_since_s=now_s)
            return replace(rec, retiring=True, draining=False, draining_since_s=0.0)

    def dropped(self) -> tuple[Key, ...]:
        """The instances' ModelDeployments the plan dropped (retiring or draining)."""
        with self._lock:
            return tuple(sorted(k for k in self.children if k not in self.records))

    def _drains(self, key: Key) -> bool:
        """Whether the dropped instance ``key`` starts draining now, as in the standalone
        controller: once every instance of its parent's plan is ready (committed on every
        node), or early on a full fleet - when every new or changed instance of a parent
        that is neither ready nor failed waits for GPUNodes that dropped instances hold, it
        is the one of those :func:`policies.fleetplan.instances.first_to_drain` picks."""
        views = _child_views(self.children)
        parent = (key[0], self.children[key].parent)
        pp = self.parents.get(parent)
        if (
            pp is not None
            and not pp.error
            and all(is_ready(views.get((key[0], i.name))) for i in pp.instances)
        ):
            return True  # its replacements are committed
        return key in self._early_drains(views)

    def _early_drains(self, views: Mapping[Key, ChildView]) -> set[Key]:
        """The dropped instances that drain early (see :meth:`_drains`)."""
        dropped = {k: c for k, c in self.children.items() if k not in self.records}
        draining = {_name(k) for k, c in dropped.items() if c.record and c.record.draining}
        waiting: dict[Key, dict[str, set[str]]] = {}  # parent -> its waiting instances' blockers
        for parent, pp in sorted(self.parents.items()):
            if pp.error:
                continue
            for i in pp.instances:
                v = views.get((parent[0], i.name))
                if is_ready(v) or (v is not None and _failed(v)):
                    continue
                waiting.setdefault(parent, {})[i.name] = {
                    _name(k) for k, c in dropped.items() if set(c.held) & set(i.nodes)
                }
        # A parent whose own dropped instance drains while it still waits: no second one.
        early = {
            (k[0], c.parent)
            for k, c in dropped.items()
            if _name(k) in draining and (k[0], c.parent) in waiting
        }
        held = {o for bs in waiting.values() for os in bs.values() for o in os}
        lost = {o: _capacity_lost(o, self.children, self.records, views) for o in held}
        exclude = {_name(k) for k, c in dropped.items() if (k[0], c.parent) in early}
        out = set()
        for _, blockers in sorted(waiting.items()):
            choice = first_to_drain(blockers, draining, lost, exclude)
            if choice:
                ns, _, name = choice.partition("/")
                out.add((ns, name))
        return out

    def _instance_nodes(
        self, key: Key, held: Mapping[Key, tuple[str, ...]]
    ) -> tuple[tuple[str, ...], str]:
        """A planned instance's nodes it may plan on now: :func:`drained`, and none that an
        instance the plan dropped still has in its current plan."""
        mine, why = drained(key, self.assigned, held)
        draining = {
            k: c.held for k, c in self.children.items() if k not in self.records and k != key
        }
        blocked = {n: k for n in mine for k, ns in draining.items() if n in ns}
        if not blocked:
            return mine, why
        have = set(held.get(key, ()))
        keep = tuple(n for n in mine if n in have and n not in blocked)
        who = "; ".join(f"{n} by {k[0]}/{k[1]}" for n, k in sorted(blocked.items())[:5])
        return keep, f"waiting for GPUNodes to drain ({who})"

    def _solve(self, entries: list[Entry], replanned: Mapping[Key, Replanned]) -> None:
        """One decision for every deployment: the planned ones through the fleet planner
        (``replanned``: those planned for the controller's measured traffic), the others
        through the fleet scheduler on the GPUNodes left - neither those the plan's
        instances take nor those any instance still has in its current plan
        (:func:`policies.fleetplan.combined.plan_and_schedule`)."""
        planned = [
            PlannedEntry(k, spec, ns, self._running(k), replanned.get(k))
            for k, _, spec, ns, _ in entries
            if is_planned(spec)
        ]
        names = planner_names([e.key for e in planned])
        # The scheduler (and its reasons) sees NAMESPACE/NAME: names repeat across namespaces.
        names |= {e[0]: f"{e[0][0]}/{e[0][1]}" for e in entries if e[0] not in names}
        back = {v: k for k, v in names.items()}
        held = {n for c in self.children.values() for n in c.held}
        specs = [
            (
                _renamed(spec, names[k], k[0]),
                [n.name for n in ns if is_planned(spec) or n.name not in held],
            )
            for k, _, spec, ns, _ in entries
        ]
        decision, error = self._decide(entries, specs, names)
        self.fleet_plan = decision.plan or self.fleet_plan
        self.parents = parent_plans(planned, decision.plan, names, self.planner.chunk_tokens, error)
        insts = {(k[0], i.name): (k[1], i) for k, pp in self.parents.items() for i in pp.instances}
        self.records = {ck: instance_record(p, i) for ck, (p, i) in insts.items()}
        s = decision.schedule
        self.assigned = {back[d]: p.nodes for d, p in s.placements.items()} if s else {}
        self.reasons = {back[d]: p.message for d, p in s.pending.items()} if s else {}
        # Fits nowhere or has no eligible node: its own solve reports Infeasible or
        # NoEligibleNodes, as without the scheduler.
        self.unplaceable = (
            {back[d] for d, p in s.pending.items() if p.resource in ("memory", "nodes")}
            if s
            else set()
        )
        self.assigned |= {ck: i.nodes for ck, (_, i) in insts.items()}
        free = set(decision.plan.free_nodes) if decision.plan is not None else None
        for k, _, spec, ns, _ in entries:
            left = [n for n in ns if n.name not in held and (free is None or n.name in free)]
            lost = len(ns) - len(left)
            if is_planned(spec) or not lost or (k not in self.unplaceable and left):
                continue
            # Its own solve would plan on every eligible node, the instances' too.
            self.unplaceable.discard(k)
            self.reasons[k] = (
                f"{lost} of its {len(ns)} eligible GPUNodes serve planned deployments' "
                "instances (deployments with traffic and SLOs of a higher priority, or of its "
                "own and planned first) and the rest cannot hold it. To fix: raise its "
                "priority, add GPUNodes, or widen spec.nodeSelector"
            )

    def _decide(
        self,
        entries: list[Entry],
        specs: list[tuple[DeploymentSpec, list[str]]],
        names: Mapping[Key, str],
    ) -> tuple[FleetDecision, str]:
        """:func:`plan_and_schedule` over every deployment; when the planner refuses the
        planned ones, the others alone, and why."""
        by_name: dict[str, Node] = {}
        for _, _, _, ns, _ in entries:
            for n in ns:
                by_name.setdefault(n.name, n)
        fleet = Fleet("gpunodes", tuple(by_name[n] for n in sorted(by_name)))
        previous = {names[k]: frozenset(v) for k, v in self.assigned.items() if k in names}
        planning = PlanOptions(self.fleet_plan, self.planner, self.curves)
        scheduling = ScheduleOptions(
            previous=previous, quotas_gpus=self.quotas_gpus, cache=self.cache
        )
        try:
            return plan_and_schedule(fleet, specs, planning=planning, scheduling=scheduling), ""
        except InputError as exc:
            rest = [(sp, ns) for sp, ns in specs if not is_planned(sp)]
            decision = plan_and_schedule(fleet, rest, scheduling=scheduling)
            return decision, f"the fleet planner refused the planned deployments: {exc}"

    def _running(self, key: Key) -> tuple[PlannedInstance, ...]:
        """The instances of planned ``key`` running now (their ModelDeployments' records)."""
        mine = [c.obj for k, c in self.children.items() if k[0] == key[0] and c.parent == key[1]]
        return running_instances(mine)


def _name(key: Key) -> str:
    return f"{key[0]}/{key[1]}"


def _failed(view: ChildView) -> bool:
    """Whether an instance cannot be planned (``Solved=False`` for another reason than
    waiting for GPUNodes, ``Unschedulable``): it will not come up."""
    return any(
        c.type == "Solved" and c.status == "False" and c.reason != "Unschedulable"
        for c in view.status.conditions
    )


def _child_views(children: Mapping[Key, Child]) -> dict[Key, ChildView]:
    """Every instance's ModelDeployment as its parent's reconcile sees it, by key."""
    out: dict[Key, ChildView] = {}
    for k, c in children.items():
        for v in child_views([c.obj], (k[0], c.parent)):
            out[k] = v
    return out


def _capacity_lost(
    name: str,
    children: Mapping[Key, Child],
    records: Mapping[Key, InstanceRecordStatus],
    views: Mapping[Key, ChildView],
) -> float:
    """What its parent loses when the dropped instance ``name`` (``NAMESPACE/NAME``) stops
    taking requests, requests/s (:func:`policies.fleetplan.instances.capacity_lost` over the
    parent's instances that serve now: ready, not draining)."""
    ns, _, short = name.partition("/")
    parent = children[(ns, short)].parent
    mine: dict[str, ServingInstance] = {}
    serving: set[str] = set()
    for k, c in children.items():
        rec = records.get(k) or c.record
        if k[0] != ns or c.parent != parent or rec is None:
            continue
        mine[_name(k)] = ServingInstance(rec.role, rec.pool, rec.capacity_requests_per_s)
        dropped_draining = k not in records and c.record is not None and c.record.draining
        if is_ready(views.get(k)) and not dropped_draining:
            serving.add(_name(k))
    return capacity_lost(name, mine, serving)


def drained(
    key: Key, assigned: Mapping[Key, tuple[str, ...]], held: Mapping[Key, tuple[str, ...]]
) -> tuple[tuple[str, ...], str]:
    """The GPUNodes of ``assigned[key]`` it may plan on now, and why fewer (or ""): while a
    placed deployment whose new assignment leaves a node out still has it in its current
    plan (``held``: key -> ``status.nodes``), ``key`` keeps only the assigned nodes it
    already holds; it grows once they are free."""
    mine = assigned.get(key, ())
    blocked: dict[str, list[str]] = {}
    for n in mine:
        for other, nodes in held.items():
            if other != key and other in assigned and n in nodes and n not in assigned[other]:
                blocked.setdefault(n, []).append(f"{other[0]}/{other[1]}")
    if not blocked:
        return mine, ""
    have = set(held.get(key, ()))
    keep = tuple(n for n in mine if n in have and n not in blocked)
    who = "; ".join(f"{n} by {', '.join(o)}" for n, o in sorted(blocked.items())[:5])
    return keep, f"waiting for GPUNodes to drain ({who})"


def _renamed(spec: DeploymentSpec, name: str, namespace: str) -> DeploymentSpec:
    """The spec under its scheduler name, its quota namespace its Kubernetes namespace."""
    return replace(spec, name=name, namespace=namespace or "default")


def _demand_key(replanned: Replanned | None) -> str:
    """The part of the fingerprint that the controller's choice of traffic sets."""
    if replanned is None:
        return ""
    return json.dumps(traffic_to_doc(replanned.traffic), sort_keys=True)


def _entries(
    deployments: Sequence[Json],
    nodes: Sequence[NodeView],
    policy_of: Callable[[str], PlacementPolicySpec],
    now: datetime,
    stale_after_s: float,
) -> tuple[list[Entry], dict[Key, Child], dict[Key, Replanned]]:
    """Every readable, live deployment: key, generation, resolved spec (a planned one's with
    the traffic it is planned for), eligible nodes, the nodes of its current plan (sorted by
    key); the instances' ModelDeployments apart (the plan assigns them); and the planned
    deployments the controller re-planned for their measured traffic. A spec that does not
    parse or validate is left out."""
    out = []
    children: dict[Key, Child] = {}
    replanned: dict[Key, Replanned] = {}
    for obj in deployments:
        meta = obj.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        held = tuple(str(n) for n in (obj.get("status") or {}).get("nodes") or ())
        if is_child(obj):
            children[key] = Child(parent_of(obj), held, child_record(obj), obj)
            continue
        try:
            spec = from_wire(ModelDeploymentSpec, obj.get("spec") or {}, "spec", strict=True)
            ref = spec.policy_ref.name if spec.policy_ref else ""
            policy = policy_of(ref)
            resolved = effective_spec(key[1], spec, policy)
            check_spec(resolved)
        except (InputError, PermanentError):  # reported by the deployment's own reconcile
            continue
        drift = (
            replanned_demand(resolved.traffic, obj.get("status")) if is_planned(resolved) else None
        )
        if drift is not None:
            replanned[key] = drift
            resolved = replace(resolved, traffic=drift.traffic)
        view = eligible_fleet(nodes, spec.node_selector, policy, now, stale_after_s)
        out.append((key, int(meta.get("generation") or 0), resolved, view.fleet.nodes, held))
    return sorted(out, key=lambda e: e[0]), children, replanned
