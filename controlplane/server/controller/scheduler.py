"""The fleet scheduler in the standalone controller: which nodes each deployment may plan on.

:class:`FleetScheduler` is the one writer of the assignment on a store whose plans the
controller decides (``Store.plan_author == "controller"``; in Kubernetes mode the operator
runs the same :func:`policies.scheduling.schedule`). Each tick it fingerprints what the
assignment depends on (every live deployment's spec generation and the usable nodes each
may use); when that changed it solves a new assignment in a thread (the estimates are
cached between solves, so only new deployments or node make-ups are solved), records it in
each deployment's status (``assigned_nodes``, ``assigned_gpus``, ``scheduling``: the reason
and the decisions), logs every decision, and marks every deployment changed.

What the decision sees (:meth:`FleetScheduler.view`): each deployment's assigned nodes less
the nodes another *placed* deployment still holds in its committed plan or rollout - the
graceful drain: a node moves only after its old holder committed a plan without it (the
waiting deployment is marked changed when its view changes, so it is decided then). A
deployment the new assignment leaves Pending has its committed plan withdrawn (its parts
removed from the agents) so its nodes free at once.

Deployments that state their traffic and SLOs are planned by the fleet planner instead, the
others scheduled, priority ordering both kinds
(:func:`policies.fleetplan.combined.plan_and_schedule`); such a deployment runs as engine
instances (:class:`~controlplane.server.controller.instances.Instances`), each a deployment
assigned its planned nodes. A retiring or draining instance (one the plan dropped) holds
its nodes until it is deleted: an instance that needs them waits, as for any other holder,
and is listed among the deployments it waits for (what lets
:meth:`~.instances.Instances.tick` drain such an instance early on a full fleet).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence

from controlplane.errors import StoreError
from controlplane.server import reconcile as rc
from controlplane.server.controller.common import AssignmentEvent, Context
from controlplane.server.controller.instances import Instances
from controlplane.server.controller.nodes import NodeRegistry
from controlplane.server.controller.rollout import Rollouts, deleted_here
from controlplane.server.controller.watchers import Watchers
from controlplane.store import PlanWithdrawal, StoredDeployment
from policies.errors import InputError
from policies.fleetplan.combined import (
    FleetDecision,
    PlanOptions,
    ScheduleOptions,
    plan_and_schedule,
)
from policies.fleetplan.curves import CurveCache, MemoryCurveCache
from policies.fleetplan.instances import is_planned
from policies.fleetplan.types import FleetPlan
from policies.hardware.fleet import Fleet
from policies.scheduling.explain import why_placed
from policies.scheduling.table import EstimateCache
from policies.scheduling.types import Schedule, ScheduleRequest
from policies.spec.build import DeploymentSpec

#: Status message of a deployment the scheduler has not assigned yet.
WAITING = "waiting for the fleet scheduler"
#: Kubernetes mode: how often to look for committed plans their author withdrew, s.
WITHDRAWN_CHECK_S = 1.0


class FleetScheduler:
    """Fleet-level assignment of nodes to deployments (see the module docstring).

    Args:
        remove: deletes a deployment the controller's way (a drained instance).
        curves: the fleet planner's step curves, kept between plans (in memory when None).
    """

    def __init__(
        self,
        ctx: Context,
        nodes: NodeRegistry,
        rollouts: Rollouts,
        watchers: Watchers,
        remove: Callable[[str], bool] = lambda _name: False,
        curves: CurveCache | None = None,
    ) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self.rollouts = rollouts
        self.watchers = watchers
        self.cache = EstimateCache()
        self.curves: CurveCache = curves if curves is not None else MemoryCurveCache()
        self.instances = Instances(ctx, remove)
        self.assigned: dict[str, tuple[str, ...]] = {}
        self.reasons: dict[str, str] = {}
        self.request: ScheduleRequest | None = None
        self.schedule: Schedule | None = None
        self._key = ""
        self._task: asyncio.Task[None] | None = None
        self._recovered = False
        self._swept_s = -math.inf
        #: Deployment -> what :meth:`_drained` gave it at the last view (nodes, reason).
        self._drain_view: dict[str, tuple[tuple[str, ...], str]] = {}

    def view(
        self,
        nodes: Sequence[rc.NodeObs],
        now_s: float,
        settings: rc.ReconcileSettings,
        deps: Sequence[StoredDeployment],
    ) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
        """``(assigned, unscheduled)`` for :class:`~controlplane.server.reconcile.Observed`
        of the live deployments ``deps`` (as last read); starts a new solve when its inputs
        changed."""
        if not self._recovered:
            self._recover(deps)
        inst = self.instances
        deps = [d for d in deps if not inst.is_instance(d.name)]
        eligible = {d.name: rc.usable_gpus(d.spec, nodes, now_s, settings)[0] for d in deps}
        traffic = {d.name: inst.traffic_key(d) for d in deps if is_planned(d.spec)}
        key = _fingerprint(deps, eligible, traffic)
        if key != self._key and self._task is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # ticked outside a loop (tests): solve here
                self._solve_now(key, deps, eligible)
            else:
                self._task = loop.create_task(self._solve(key, deps, eligible), name="schedule")
        assigned: dict[str, tuple[str, ...]] = {}
        unscheduled = {
            d.name: self.reasons.get(d.name, WAITING) for d in deps if d.name not in traffic
        }
        drain_view: dict[str, tuple[tuple[str, ...], str]] = {}
        holders = self.assigned | inst.assigned()
        waiting: dict[str, list[str]] = {}
        for name, mine in holders.items():
            assigned[name], why = self._drained(name, mine, holders, waiting)
            drain_view[name] = (assigned[name], why)
            if why:
                unscheduled[name] = why
            else:
                unscheduled.pop(name, None)
            if name in self._drain_view and self._drain_view[name] != drain_view[name]:
                # A holder committed without a node (or took one again): nothing else marks
                # the waiting deployment, so decide it again now.
                self.ctx.changed(name)
        self._drain_view = drain_view
        inst.tick(traffic, waiting)
        return assigned, unscheduled

    def _drained(
        self,
        name: str,
        mine: Sequence[str],
        holders: Mapping[str, Sequence[str]],
        waiting: dict[str, list[str]],
    ) -> tuple[tuple[str, ...], str]:
        """The deployment's nodes it may plan on now: while another placed deployment still
        holds one of them (a retiring or draining instance holds all of its own), only the
        nodes it already holds (it grows once they are free). ``waiting`` gets, per
        deployment, the holders it waits for."""
        blocked: dict[str, list[str]] = {}
        for n in mine:
            for o in self.rollouts.serving(n):
                if o == name or o not in holders:
                    continue
                if n not in holders[o] or self.instances.dropped(o):
                    blocked.setdefault(n, []).append(o)
        if blocked:
            waiting[name] = sorted({o for os in blocked.values() for o in os})
        if not blocked:
            return tuple(mine), ""
        c = self.rollouts.committed_cached(name)
        have = set(c.nodes()) if c is not None else set()
        keep = tuple(n for n in mine if n in have and n not in blocked)
        who = "; ".join(f"{n} by {', '.join(o)}" for n, o in sorted(blocked.items())[:5])
        return keep, f"waiting for nodes to drain ({who})"

    def _recover(self, deps: Sequence[StoredDeployment]) -> None:
        """The previous assignment and instances from the stored statuses (after a
        restart)."""
        self._recovered = True
        self.instances.recover(deps)
        for d in deps:
            if is_planned(d.spec) or self.instances.is_instance(d.name):
                continue
            nodes = d.status.get("assigned_nodes")
            if isinstance(nodes, list) and nodes:
                self.assigned[d.name] = tuple(str(n) for n in nodes)

    async def _solve(
        self, key: str, deps: Sequence[StoredDeployment], eligible: Mapping[str, tuple[str, ...]]
    ) -> None:
        try:
            fleet, specs, previous = self._inputs(deps, eligible)
            decision = await asyncio.to_thread(self._decide, fleet, specs, previous)
            self._adopt(key, deps, decision)
        except InputError as exc:
            self._failed(key, exc)
        except Exception:  # the scheduler's boundary: keep the old assignment, retry later
            self.ctx.log.exception("fleet schedule failed")
        finally:
            self._task = None
            self.ctx.wake()

    def _solve_now(
        self, key: str, deps: Sequence[StoredDeployment], eligible: Mapping[str, tuple[str, ...]]
    ) -> None:
        """:meth:`_solve` without an event loop (a tick called directly)."""
        try:
            fleet, specs, previous = self._inputs(deps, eligible)
            self._adopt(key, deps, self._decide(fleet, specs, previous))
        except InputError as exc:
            self._failed(key, exc)

    def _failed(self, key: str, exc: InputError) -> None:
        self.ctx.log.warning("fleet schedule failed", error=str(exc))
        self._key = key
        self.instances.failure = str(exc)

    def _decide(
        self,
        fleet: Fleet,
        specs: list[tuple[DeploymentSpec, tuple[str, ...]]],
        previous: dict[str, frozenset[str]],
    ) -> FleetDecision:
        """The fleet plan of the planned deployments and the assignment of the others;
        after a restart (no plan in memory, instances running) planned twice: the second
        time against the plan the instances run."""
        scheduling = ScheduleOptions(
            previous=previous,
            quotas_gpus=self.ctx.settings.namespace_quotas_gpus,
            cache=self.cache,
        )
        inst = self.instances

        def decide(prev: FleetPlan | None) -> FleetDecision:
            planning = PlanOptions(previous=prev, settings=inst.settings, cache=self.curves)
            return plan_and_schedule(fleet, specs, planning=planning, scheduling=scheduling)

        decision = decide(inst.plan)
        if inst.plan is None and inst.records and decision.plan is not None:
            running = inst.running_plan(decision.plan)
            if running is not None:
                decision = decide(running)
        return decision

    def _inputs(
        self, deps: Sequence[StoredDeployment], eligible: Mapping[str, tuple[str, ...]]
    ) -> tuple[Fleet, list[tuple[DeploymentSpec, tuple[str, ...]]], dict[str, frozenset[str]]]:
        """The fleet of every usable node, each spec with its nodes (a planned deployment's
        at the traffic it is planned for), the previous assignment."""
        names = sorted({n for ns in eligible.values() for n in ns})
        fleet = self.nodes.fleet_for("fleet", names)
        previous = {k: frozenset(v) for k, v in self.assigned.items()}
        specs = [
            (self.instances.planning_spec(d) if is_planned(d.spec) else d.spec, eligible[d.name])
            for d in deps
        ]
        return fleet, specs, previous

    def _adopt(self, key: str, deps: Sequence[StoredDeployment], decision: FleetDecision) -> None:
        """Make ``decision`` the assignment: record it, withdraw preempted plans, run the
        planned deployments' instances, re-decide all."""
        s = decision.schedule
        self._key, self.request, self.schedule = key, decision.request, s
        self.assigned = {k: p.nodes for k, p in s.placements.items()} if s else {}
        self.reasons = {k: p.message for k, p in s.pending.items()} if s else {}
        log = self.ctx.log
        for dec in s.decisions if s else ():
            log.info(
                "fleet schedule decision",
                deployment=dec.deployment,
                kind=dec.kind,
                added=list(dec.nodes_added),
                removed=list(dec.nodes_removed),
                reason=dec.reason,
            )
        reasons = {dec.deployment: dec.reason for dec in s.decisions} if s else {}
        now = self.ctx.clock()
        planned = [d for d in deps if is_planned(d.spec)]
        self.instances.adopt(decision.plan, planned)
        for d in planned:
            if d.committed_version is not None:  # solved as one engine before: withdrawn
                self._withdraw(d, "served by its engine instances", now)
        for d in deps:
            if s is None or is_planned(d.spec):
                continue
            self._record(d, s, reasons.get(d.name, ""))
            if d.name in s.pending and d.committed_version is not None:
                self._withdraw(d, s.pending[d.name].message, now)
            self.ctx.changed(d.name)

    def _record(self, d: StoredDeployment, s: Schedule, decision: str) -> None:
        """The deployment's assignment in its status (the store keeps it)."""
        current = self.ctx.store.get_deployment(d.name)
        if current is None:
            return
        status = dict(current.status)
        p = s.placements.get(d.name)
        pend = s.pending.get(d.name)
        status["assigned_nodes"] = list(p.nodes) if p else []
        status["assigned_gpus"] = p.gpus if p else 0
        why = pend.message if pend else ""
        if p is not None and self.request is not None:
            demand = next(x for x in self.request.demands if x.name == d.name)
            why = why_placed(self.request, s, demand, p)
        status["scheduling"] = {
            "placed": p is not None,
            "reason": why,
            "resource": pend.resource if pend else "",
            "missing": pend.missing if pend else 0,
            "missing_unit": pend.unit if pend else "",
            "predicted_tokens_per_s": p.tokens_per_s if p else 0.0,
            "decision": decision,
            "solver": s.solver,
        }
        self.ctx.store.set_deployment_status(d.name, status)

    def sweep_withdrawn(self, deps: Sequence[StoredDeployment], now_s: float) -> list[str]:
        """Kubernetes mode (the operator decides the plans and runs the fleet scheduler):
        the operator withdraws a preempted deployment by deleting its PartitionPlans, and a
        user deletes a deployment by deleting its ModelDeployment. A deployment whose
        committed plan (as loaded) is gone from the store, and one the controller holds a
        plan or a rollout of that no live deployment owns any more (deleted, or being
        deleted), has its parts taken off the agents (REMOVE) and its rollout in flight
        aborted; returns their names. Checked every :data:`WITHDRAWN_CHECK_S` at most (one
        plan read per deployment with a loaded committed plan, one read per held name not
        among ``deps``)."""
        if now_s - self._swept_s < WITHDRAWN_CHECK_S:
            return []
        self._swept_s = now_s
        gone = self._sweep_deleted({d.name for d in deps})
        for d in deps:
            c = self.rollouts.committed_cached(d.name)
            if c is None:
                continue
            if self.ctx.store.get_plan(d.name, c.version, with_plan=False) is not None:
                continue
            r, _ = self.rollouts.delete(d.name)
            self.rollouts.deleted(d.name, r, c)
            self.ctx.log.warning(
                "plan withdrawn by its author", deployment=d.name, version=c.version
            )
            gone.append(d.name)
        return gone

    def _sweep_deleted(self, live: set[str]) -> list[str]:
        """REMOVE (and ABORT) what the controller holds of deployments that are gone from
        the store (``live``: the names it lists). A name the store still has - its spec no
        longer parses, so the listing leaves it out - keeps its parts."""
        gone = []
        for name in sorted(self.rollouts.held() - live):
            try:
                record = self.ctx.store.get_deployment(name, include_deleted=True)
            except StoreError:
                continue  # still there, unreadable: the operator reports it; keep serving
            if record is not None and not record.deleted:
                continue
            c = self.rollouts.committed_cached(name)
            r, _ = self.rollouts.delete(name)
            self.rollouts.deleted(name, r, c)
            self.ctx.log.info(
                "deployment deleted: its parts removed from the agents",
                deployment=name,
                version=c.version if c is not None else None,
            )
            gone.append(name)
        return gone

    def remove_deleted(self, node: str, applied: Mapping[str, int]) -> None:
        """REMOVE what ``node`` reports it runs (``applied``: name -> version) of deployments
        deleted here: a delete while its stream was down (a restart, a drained engine
        instance) reaches it this way when its stream opened before it reported them (the
        stored record of what a node runs lags: heartbeats are persisted at intervals).
        Deleted here: a tombstone, or (Kubernetes) gone at a version this store allocated."""
        store = self.ctx.store
        for name, version in sorted(applied.items()):
            if name in self.rollouts.held():
                continue
            d = store.get_deployment(name, include_deleted=True)
            if (d is not None and d.deleted) or (d is None and deleted_here(store, name, version)):
                self.watchers.send(node, AssignmentEvent(name, "", version, "remove"))

    def _withdraw(self, d: StoredDeployment, reason: str, now_s: float) -> None:
        """Take the preempted deployment's committed plan off its nodes."""
        store = self.ctx.store
        c = self.rollouts.committed_state(d.name, d)
        if not isinstance(store, PlanWithdrawal):
            return
        if not store.withdraw_plan(d.name, reason=f"preempted: {reason}"[:1024], now_s=now_s):
            return
        r, _ = self.rollouts.delete(d.name)
        self.rollouts.deleted(d.name, r, c)
        if c is not None:
            for node in c.parts:
                self.watchers.send(node, AssignmentEvent(d.name, c.plan.id, c.version, "remove"))
        self.ctx.log.warning("plan withdrawn: deployment preempted", deployment=d.name)


def _fingerprint(
    deps: Sequence[StoredDeployment],
    eligible: Mapping[str, tuple[str, ...]],
    traffic: Mapping[str, str],
) -> str:
    """What the assignment depends on: each deployment's generation and usable nodes, and
    each planned deployment's planning traffic."""
    text = "\n".join(
        f"{d.name}:{d.generation}:{','.join(eligible[d.name])}:{traffic.get(d.name, '')}"
        for d in sorted(deps, key=lambda d: d.name)
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]
