"""Engine instances of planned deployments in the standalone controller.

A deployment that states its traffic and SLOs
(:func:`~policies.fleetplan.instances.is_planned`) - a *planned* deployment - is never solved
as one engine. The fleet scheduler plans it with the fleet planner
(:func:`policies.fleetplan.combined.plan_and_schedule`) and :class:`Instances` runs what the
plan says: each engine instance (:func:`policies.fleetplan.instances.plan_instances`) is a
stored deployment of its own, its spec :func:`policies.launch.instance_spec` of the planned
deployment, its status carrying an
:class:`~controlplane.server.controller.instance_records.InstanceRecord` under
``INSTANCE_KEY``. So each instance has its own solve, versions, two-phase rollout,
contingency plans and routing, through the machinery every deployment uses. This module is
the one writer of instance specs and records:

* **Sync** (:meth:`Instances.adopt`, at each new fleet plan): an instance the plan keeps
  (same role and nodes) keeps its name and ports; its spec is written only when it
  changed. A new instance gets the lowest free engine port at or above the controller's
  ``engine_base_port`` among every instance of the controller, a prefill instance also a
  bootstrap port from ``bootstrap_base_port`` (:class:`~.common.ControllerSettings`). An
  instance the plan drops is marked *retiring*: it keeps its nodes and its committed plan
  and keeps serving (WatchInstances lists it ready) - a surge first.
* **Drain** (:meth:`Instances.tick`, every tick): a retiring instance starts *draining*
  (routers send it no new request; open streams finish) once every live instance of its
  deployment - new or changed - is committed, and a draining instance is deleted (its
  parts REMOVEd from the agents through the controller's delete path) once
  ``drain_grace_s`` has passed since it began draining (kept in its record, so a restart
  keeps the grace). Routers do not tell the controller when their streams are done: the
  grace is the contract. When every live instance not committed yet (and not failed) waits
  for nodes that retiring or draining instances hold (the fleet scheduler's drain view: a
  full fleet), one of the retiring instances they wait for drains early - the one whose
  loss costs the least planned capacity (:func:`capacity_lost`), then by name - and the
  next only once no early drain of that deployment is left, so the others keep serving. A
  dropped instance that never had a committed plan serves nothing: it is deleted at once.
* **Status** (:mod:`~controlplane.server.controller.instance_status`): the planned
  deployment's status lists its instances under
  ``INSTANCES_KEY`` (live, retiring and draining) and the plan's summary under ``fleet_plan``
  (``demand_requests_per_s``, ``served_requests_per_s``, predicted ``ttft_ms`` /
  ``tpot_ms``, ``usd_per_hour``, ``gpus``, ``solver`` and ``shortfalls``: ``resource``,
  ``missing_requests_per_s``, ``fix``, ``message``); its phase is ``ready`` when every
  live (neither retiring nor draining) instance is committed and the plan serves its demand, ``rolling_out`` while
  instances are not committed yet (``2 of 3 instances committed``), ``degraded`` when all
  are but the plan is short (or some instance cannot be planned while others serve),
  ``failed`` when an instance cannot be planned and none serves, ``pending`` when nothing
  serves it.

The traffic a deployment is planned for is :attr:`Instances.traffic_for` of its stored
record (default: its spec's ``traffic``); demand measurement replaces the hook, and its value
is part of the fleet scheduler's fingerprint, so a changed planning traffic re-plans.

State survives a restart: instance records (names, ports, retiring, draining and when it
began) are read back from the
stored statuses, and the first plan after it is made against the plan they run
(:meth:`Instances.running_plan`, for the move penalty); with nothing changed, a re-plan
rewrites nothing and rolls nothing out.

Units: requests per second, milliseconds (``_ms``), USD per hour, Unix seconds (``_s``);
ports are TCP ports.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from controlplane.errors import PreconditionError
from controlplane.server.controller.common import Context
from controlplane.server.controller.instance_records import InstanceRecord
from controlplane.server.controller.instance_status import (
    FLEET_PLAN_KEY,
    WAITING_PLAN,
    instance_status,
    parent_phase,
    parent_status,
)
from controlplane.store import StoredDeployment
from policies.errors import InputError
from policies.fleetplan.curves import CurveCache
from policies.fleetplan.instances import (
    ServingInstance,
    first_to_drain,
    is_planned,
    plan_instances,
)
from policies.fleetplan.instances import capacity_lost as instance_capacity_lost
from policies.fleetplan.types import (
    DeploymentPlan,
    FleetPlan,
    PlannedGroup,
    PlannedPool,
    PlannerSettings,
)
from policies.launch import PlannedInstance, instance_spec
from policies.serving.traffic import Traffic, traffic_to_doc
from policies.spec.build import DeploymentSpec

#: Why a retiring instance drains once its replacements are committed (log field).
REPLACED = "the instances that replace it are committed"

TrafficFor = Callable[[StoredDeployment], Traffic]
"""The traffic a planned deployment is planned for, from its stored record."""


def curve_cache(directory: str) -> CurveCache:
    """The fleet planner's step curves: on disk under ``directory``
    (:func:`apis.curvecache.open_curve_cache`), in memory when it is ""."""
    from apis.curvecache import open_curve_cache

    return open_curve_cache(directory)


def spec_traffic(d: StoredDeployment) -> Traffic:
    """The default :data:`TrafficFor`: the deployment's own ``spec.traffic``."""
    if d.spec.traffic is None:
        raise InputError("a planned deployment states its traffic", field="spec.traffic")
    return d.spec.traffic


class Instances:
    """The engine instances of every planned deployment (see the module docstring).

    Args:
        ctx: the controller's shared dependencies.
        remove: deletes a deployment the controller's way (rollout aborted, parts REMOVEd
            from the agents, solves cancelled); True when it existed.
        settings: the fleet planner's settings (its chunk size reads the plan's instances).
    """

    def __init__(
        self,
        ctx: Context,
        remove: Callable[[str], bool],
        settings: PlannerSettings | None = None,
    ) -> None:
        self.ctx = ctx
        self._remove = remove
        self.settings = settings or PlannerSettings()
        self.traffic_for: TrafficFor = spec_traffic
        #: Every instance (live, retiring and draining) by name.
        self.records: dict[str, InstanceRecord] = {}
        #: The last fleet plan adopted (None before the first).
        self.plan: FleetPlan | None = None
        #: Why the last fleet plan failed ("" when it did not).
        self.failure = ""
        #: Planned deployment -> why its instances cannot be written ("" for none).
        self._errors: dict[str, str] = {}
        #: Planned deployment -> (phase, message) as of the last tick.
        self.phases: dict[str, tuple[str, str]] = {}
        #: Instances removed by the last :meth:`tick` (the decision skips them).
        self.removed: set[str] = set()
        #: (instance, version) -> (inputs key, nodes) of a committed plan (never change).
        self._plans: dict[tuple[str, int], tuple[str, frozenset[str]]] = {}
        if ctx.store.plan_author == "controller":  # known before the first tick
            self.recover(ctx.store.list_deployments())

    # ------------------------------------------------------------------ reading

    def recover(self, deps: Iterable[StoredDeployment]) -> None:
        """The instances from their stored records (after a restart)."""
        for d in deps:
            r = InstanceRecord.from_status(d.status)
            if r is not None:
                self.records[d.name] = r

    def is_instance(self, name: str) -> bool:
        """Whether ``name`` is an instance the controller runs."""
        return name in self.records

    def refuse_user_change(self, name: str) -> None:
        """Refuse a user's apply or delete of an engine instance.

        Raises:
            PreconditionError: ``name`` is an instance (the controller writes it).
        """
        of = self.parent_of(name)
        if of:
            raise PreconditionError(
                f"{name} is an instance of {of}, written by the controller: change {of}",
                field="name",
            )

    def parent_of(self, name: str) -> str:
        """The planned deployment an instance serves ("" when ``name`` is none)."""
        r = self.records.get(name)
        return r.of if r is not None else ""

    def of(self, parent: str) -> list[str]:
        """The instances (live, retiring and draining) of ``parent``, by name."""
        return sorted(n for n, r in self.records.items() if r.of == parent)

    def draining(self, name: str) -> bool:
        """Whether ``name`` is a draining instance."""
        r = self.records.get(name)
        return r is not None and r.draining

    def dropped(self, name: str) -> bool:
        """Whether ``name`` is an instance the current plan no longer has (retiring or
        draining): it holds its nodes until it is deleted."""
        r = self.records.get(name)
        return r is not None and r.dropped

    def assigned(self) -> dict[str, tuple[str, ...]]:
        """Every instance's nodes (a retiring or draining instance keeps its own)."""
        return {n: r.nodes for n, r in self.records.items()}

    def planning_spec(self, d: StoredDeployment) -> DeploymentSpec:
        """``d``'s spec with the traffic it is planned for (:attr:`traffic_for`)."""
        return replace(d.spec, traffic=self.traffic_for(d))

    def traffic_key(self, d: StoredDeployment) -> str:
        """The planning traffic of ``d`` as text (part of the scheduler's fingerprint)."""
        return json.dumps(traffic_to_doc(self.traffic_for(d)), sort_keys=True)

    def running_plan(self, fresh: FleetPlan) -> FleetPlan | None:
        """The plan the live instances run, read back from their records with the variants
        of ``fresh`` (a plan of the same deployments): after a restart, the previous plan
        of the next one, so its move penalty keeps what runs. None when no instance's
        variant is among ``fresh``'s."""
        deployments = dict(fresh.deployments)
        found = False
        for parent, dp in fresh.deployments.items():
            variants = {v.key: v for v in fresh.variants.get(parent, ())}
            pools: dict[str, dict[str, list[InstanceRecord]]] = {}
            for r in sorted(self.records.values(), key=lambda r: r.nodes):
                if r.of == parent and not r.dropped and r.variant in variants:
                    pools.setdefault(r.pool, {}).setdefault(r.role, []).append(r)
            planned = []
            for pool, roles in sorted(pools.items()):
                groups = {
                    role: PlannedGroup(
                        variants[rs[0].variant],
                        len(rs),
                        tuple(r.nodes for r in rs),
                        rs[0].batch_limit,
                    )
                    for role, rs in roles.items()
                }
                rate = sum(
                    r.requests_per_s for r in roles.get("decode", roles.get("aggregated", []))
                )
                if "aggregated" in groups:
                    planned.append(PlannedPool(pool, rate, instances=groups["aggregated"]))
                elif "prefill" in groups and "decode" in groups:
                    planned.append(
                        PlannedPool(pool, rate, prefill=groups["prefill"], decode=groups["decode"])
                    )
            if planned:
                found = True
                deployments[parent] = replace(dp, pools=tuple(planned))
        return replace(fresh, deployments=deployments) if found else None

    # ------------------------------------------------------------------ a new plan

    def adopt(self, plan: FleetPlan | None, parents: Sequence[StoredDeployment]) -> None:
        """Run ``plan`` (the planned deployments ``parents``, as last read): write each
        instance's spec and record, mark dropped instances retiring, remove the instances
        of deployments no longer planned, and record each deployment's summary."""
        self.plan, self.failure = plan, ""
        live = {d.name for d in parents}
        for name in sorted(n for n, r in self.records.items() if r.of not in live):
            self._drop(name, "its deployment is no longer planned")
        for d in parents:
            current = self.ctx.store.get_deployment(d.name)
            if current is None or not is_planned(current.spec):
                continue
            dp = plan.deployments.get(d.name) if plan is not None else None
            try:
                self._sync(current, dp)
                self._errors.pop(d.name, None)
            except InputError as exc:
                self._errors[d.name] = str(exc)
            self._write_parent(d.name)
            self.ctx.changed(d.name)

    def _sync(self, parent: StoredDeployment, dp: DeploymentPlan | None) -> None:
        """Make ``parent``'s instances those of ``dp``."""
        mine = {n: r for n, r in self.records.items() if r.of == parent.name}
        previous = [PlannedInstance(n, r.pool, r.role, r.nodes, 0, 1) for n, r in mine.items()]
        fresh = plan_instances(dp, self.settings.chunk_tokens, previous) if dp else ()
        store, settings = self.ctx.store, self.ctx.settings
        for inst in fresh:
            stored = store.get_deployment(inst.name)
            if stored is not None and inst.name not in mine:
                raise InputError(
                    f"deployment {inst.name!r} exists and is not an instance of "
                    f"{parent.name}. To fix: delete or rename {inst.name}",
                    field="metadata.name",
                )
        for inst in fresh:
            spec = instance_spec(parent.spec, inst)
            stored = store.get_deployment(inst.name)
            if stored is None or stored.spec != spec:
                store.put_deployment(spec, now_s=self.ctx.clock())
                self.ctx.log.info(
                    "instance written",
                    deployment=parent.name,
                    instance=inst.name,
                    role=inst.role,
                    nodes=list(inst.nodes),
                )
            old = mine.get(inst.name)
            rec = InstanceRecord(
                of=parent.name,
                role=inst.role,
                pool=inst.pool,
                variant=inst.variant,
                nodes=inst.nodes,
                port=old.port if old is not None else self._free_port(settings.engine_base_port),
                bootstrap_port=self._bootstrap_port(inst.role, old),
                requests_per_s=inst.requests_per_s,
                batch_limit=inst.batch_limit,
                capacity_requests_per_s=inst.capacity_requests_per_s,
                ttft_ms=inst.ttft_ms,
                tpot_ms=inst.tpot_ms,
            )
            self.records[inst.name] = rec
            self._write_instance(inst.name, rec, inst.gpus)
        kept = {i.name for i in fresh}
        for name, r in sorted(mine.items()):
            if name not in kept and not r.dropped:
                rec = replace(r, retiring=True)
                self.records[name] = rec
                self._write_instance(name, rec, None)
                self.ctx.log.info("instance retiring", deployment=parent.name, instance=name)

    def _free_port(self, base: int, *, bootstrap: bool = False) -> int:
        """The lowest port at or above ``base`` no instance of the controller uses."""
        used = {r.bootstrap_port if bootstrap else r.port for r in self.records.values()}
        port = base
        while port in used:
            port += 1
        return port

    def _bootstrap_port(self, role: str, old: InstanceRecord | None) -> int:
        if role != "prefill":
            return 0
        if old is not None and old.bootstrap_port:
            return old.bootstrap_port
        return self._free_port(self.ctx.settings.bootstrap_base_port, bootstrap=True)

    # ------------------------------------------------------------------ every tick

    def tick(
        self, parents: Collection[str], waiting: Mapping[str, Collection[str]]
    ) -> dict[str, tuple[str, str]]:
        """Move retiring instances to draining, delete the draining instances whose grace
        has passed (see the module docstring) and return each planned deployment's
        ``(phase, message)``.

        Args:
            parents: the planned deployments now live.
            waiting: deployment -> the deployments whose nodes it waits for (the fleet
                scheduler's drain view).
        """
        self.removed = set()
        now = self.ctx.clock()
        for name, r in sorted(self.records.items()):
            d = self.ctx.store.get_deployment(name) if r.dropped else None
            if d is not None and d.committed_version is None:
                self._drop(name, "dropped before it served: nothing to drain")
        states = {n: self._state(n, r) for n, r in self.records.items() if not r.draining}
        todo: dict[str, list[str]] = {}  # deployment -> its live instances not committed
        for n, r in sorted(self.records.items()):
            if not r.dropped and not states[n][0]:
                todo.setdefault(r.of, []).append(n)
        for name, r in sorted(self.records.items()):
            if r.retiring and r.of not in todo:
                self._start_drain(name, now, REPLACED)
        for _, names in sorted(todo.items()):
            early = self._early_drain(names, todo, states, waiting)
            if early:
                self._start_drain(early, now, "an instance that replaces it needs its nodes")
        grace_s = self.ctx.settings.drain_grace_s
        for name, r in sorted(self.records.items()):
            if r.draining and now - r.draining_since_s >= grace_s:
                self._drop(name, f"drained: its drain grace of {grace_s:g} s has passed")
        self.phases = {p: self._phase(p, states) for p in sorted(parents)}
        return self.phases

    def on_commit(self, name: str) -> None:
        """A plan of ``name`` was committed (the rollout's commit point): when ``name`` is
        a live instance and every live instance of its deployment is now committed, its
        retiring instances start draining in the same step, so that no listing read after
        the commit shows them taking requests beside their committed replacements for
        longer than it takes to write their records."""
        r = self.records.get(name)
        if r is None or r.dropped:
            return
        mine = {n: x for n, x in self.records.items() if x.of == r.of}
        if not any(x.retiring for x in mine.values()):
            return
        if all(self._state(n, x)[0] for n, x in mine.items() if not x.dropped):
            now = self.ctx.clock()
            for n, x in sorted(mine.items()):
                if x.retiring:
                    self._start_drain(n, now, REPLACED)

    def _early_drain(
        self,
        names: Sequence[str],
        todo: Mapping[str, Sequence[str]],
        states: Mapping[str, tuple[bool, str]],
        waiting: Mapping[str, Collection[str]],
    ) -> str:
        """The retiring instance to drain before the instances ``names`` (of one deployment,
        not committed yet) are ("" for none): when every one of them that has not failed
        waits for nodes that retiring or draining instances hold, none of those drains yet,
        and no instance of their deployment drains early already (``todo``: deployment ->
        its live instances not committed), the one whose loss costs the least planned
        capacity (:func:`capacity_lost`), then the first by name."""
        dropped = {n for n, r in self.records.items() if r.dropped}
        early = {r.of for r in self.records.values() if r.draining and r.of in todo}
        movable = [n for n in names if not states[n][1]]
        blockers = {n: dropped & set(waiting.get(n, ())) for n in movable}
        held = {o for os in blockers.values() for o in os}
        return first_to_drain(
            blockers,
            {o for o in held if self.records[o].draining},
            {o: capacity_lost(o, self.records, states) for o in held},
            exclude={o for o in held if self.records[o].of in early},
        )

    def _start_drain(self, name: str, now_s: float, why: str) -> None:
        """Mark the retiring instance ``name`` draining from ``now_s`` (Unix s)."""
        r = replace(self.records[name], retiring=False, draining=True, draining_since_s=now_s)
        self.records[name] = r
        self._write_instance(name, r, None)
        self.ctx.log.info("instance draining", deployment=r.of, instance=name, reason=why)
        self._write_parent(r.of)

    def _state(self, name: str, r: InstanceRecord) -> tuple[bool, str]:
        """``(committed, failure)`` of an instance: whether it serves a committed plan made
        for its current spec on its nodes, and why it cannot be planned ("" unless its
        phase is ``failed``: a bad spec or infeasible on its nodes)."""
        store = self.ctx.store
        d = store.get_deployment(name)
        if d is None:
            return False, ""
        failure = str(d.status.get("message", "")) if d.status.get("phase") == "failed" else ""
        if d.committed_version is None:
            return False, failure
        key = (name, d.committed_version)
        if key not in self._plans:
            p = store.get_plan(name, d.committed_version, with_plan=False)
            if p is None:
                return False, failure
            self._plans[key] = (p.inputs_key, frozenset(p.nodes))
        inputs, nodes = self._plans[key]
        return inputs.startswith(f"g{d.generation}:") and nodes <= set(r.nodes), failure

    def _phase(self, parent: str, states: Mapping[str, tuple[bool, str]]) -> tuple[str, str]:
        """``(phase, message)`` of ``parent`` (:func:`.instance_status.parent_phase`)."""
        return parent_phase(
            parent,
            self.plan,
            self.records,
            states,
            error=self._errors.get(parent, ""),
            failure=self.failure,
        )

    # ------------------------------------------------------------------ removal

    def _drop(self, name: str, why: str) -> None:
        """Delete the instance ``name`` (parts REMOVEd from the agents)."""
        r = self.records.pop(name, None)
        self._remove(name)
        self.removed.add(name)
        self._plans = {k: v for k, v in self._plans.items() if k[0] != name}
        self.ctx.log.info("instance removed", instance=name, reason=why)
        if r is not None and self.ctx.store.get_deployment(r.of) is not None:
            self._write_parent(r.of)

    def forget(self, parent: str) -> list[str]:
        """``parent`` was deleted: delete its instances; returns their names."""
        gone = self.of(parent)
        for name in gone:
            self.records.pop(name, None)
            self._remove(name)
            self._plans = {k: v for k, v in self._plans.items() if k[0] != name}
            self.ctx.log.info(
                "instance deleted with its deployment", deployment=parent, instance=name
            )
        self._errors.pop(parent, None)
        self.phases.pop(parent, None)
        return gone

    # ------------------------------------------------------------------ status

    def _write_instance(self, name: str, r: InstanceRecord, gpus: int | None) -> None:
        """The instance's record and assignment in its status."""
        self._update_status(name, instance_status(r, self.plan, gpus))

    def _write_parent(self, parent: str) -> None:
        """The planned deployment's instances and its fleet plan summary in its status."""
        self._update_status(parent, parent_status(parent, self.plan, self.records))

    def _update_status(self, name: str, updates: Mapping[str, Any]) -> None:
        """Merge ``updates`` into the deployment's stored status (written only when it
        changes)."""
        d = self.ctx.store.get_deployment(name)
        if d is None:
            return
        status = dict(d.status)
        status.update(updates)
        if status != dict(d.status):
            self.ctx.store.set_deployment_status(name, status)
            self.ctx.changed(name)


def capacity_lost(
    name: str,
    records: Mapping[str, InstanceRecord],
    states: Mapping[str, tuple[bool, str]],
) -> float:
    """What serving capacity its deployment loses when instance ``name`` stops taking
    requests, requests/s (:func:`policies.fleetplan.instances.capacity_lost` over the
    instances of its deployment that serve now: committed, not draining)."""
    of = records[name].of
    mine = {
        n: ServingInstance(x.role, x.pool, x.capacity_requests_per_s)
        for n, x in records.items()
        if x.of == of
    }
    serving = {n for n in mine if n in states and states[n][0] and not records[n].draining}
    return instance_capacity_lost(name, mine, serving)


__all__ = [
    "FLEET_PLAN_KEY",
    "WAITING_PLAN",
    "Instances",
    "TrafficFor",
    "capacity_lost",
    "curve_cache",
    "spec_traffic",
]
