"""The controller: the reconcile loop, and the one object the gRPC services talk to.

One :class:`Controller` runs on one asyncio event loop. The servicers
(:mod:`controlplane.server.services`) translate messages and call its plain methods; everything
durable goes through the :class:`controlplane.store.Store`; solves run in a worker process
(:class:`controlplane.server.solver_pool.SolverPool`; the ILP fans its layers out to more processes
from there), so a long solve never stalls heartbeats, acks or streams.

The controller is a thin front over parts that each own their state:

* :class:`~controlplane.server.controller.nodes.NodeRegistry` (``nodes``): registry,
  sessions, liveness, the lost set;
* :class:`~controlplane.server.controller.solves.Solves` (``solves``): solver pool,
  running solves, failures, dry runs;
* :class:`~controlplane.server.controller.rollout.Rollouts` (``rollouts``): two-phase
  rollout, proposed and committed plans, acks;
* :class:`~controlplane.server.controller.loads.Loads` (``loads``): load windows,
  imbalance samples, rebalance timing;
* :class:`~controlplane.server.controller.watchers.Watchers` (``watchers``): assignment
  streams, plan and routing watchers.

What it keeps itself: the loop, and the last status written per deployment.

The loop (:meth:`Controller.run`), once per ``tick_s`` or as soon as something changed:

1. observe - build :class:`controlplane.server.reconcile.Observed` from memory and the store;
2. decide - :func:`controlplane.server.reconcile.reconcile` (pure);
3. act - carry out each action (start a solve task, start / commit / abort a rollout,
   mark nodes lost, write status). A failing action is logged and retried next tick; only
   this loop boundary catches broad exceptions.

After a restart the controller rebuilds rollouts from ``preparing`` versions and their
stored acks (giving agents a fresh prepare deadline to reconnect) and treats every known
node as alive until it misses heartbeats again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace

import structlog

from controlplane.errors import NotFoundError, PreconditionError
from controlplane.server import reconcile as rc
from controlplane.server.controller.common import (
    AssignmentEvent,
    Context,
    ControllerSettings,
    NodeView,
    RegisterResult,
)
from controlplane.server.controller.contingency import Contingencies
from controlplane.server.controller.demand import Demands
from controlplane.server.controller.endpoints import Endpoints
from controlplane.server.controller.instances import curve_cache
from controlplane.server.controller.loads import Loads
from controlplane.server.controller.nodes import NodeRegistry
from controlplane.server.controller.rollout import Rollouts
from controlplane.server.controller.scheduler import FleetScheduler
from controlplane.server.controller.solves import Solves
from controlplane.server.controller.views import (
    DeploymentViews,
    observe_deployment,
    quarantine_conditions,
    status_key,
)
from controlplane.server.controller.watchers import Watchers
from controlplane.server.metrics import Metrics
from controlplane.server.solver_pool import SolverPool
from controlplane.store import (
    AckState,
    AliveRecord,
    LoadWindow,
    NodeState,
    RowHealth,
    Store,
    StoredDeployment,
    StoredPlan,
)
from policies.errors import InputError
from policies.hardware.fleet import Fleet
from policies.hardware.inventory import GpuHealth, NodeInventory
from policies.request import PlacementResult
from policies.spec.build import DeploymentSpec, check_spec


class Controller:
    """State and behaviour of the control plane (see the module docstring).

    Args:
        store: the state store (the controller does not close it).
        settings: timing.
        clock: Unix time source (tests inject a fake one).
        metrics: Prometheus metrics (a fresh registry when None).
    """

    def __init__(
        self,
        store: Store,
        *,
        settings: ControllerSettings | None = None,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        self.settings = settings or ControllerSettings()
        self.clock = clock
        self.metrics = metrics or Metrics()
        self.log = structlog.get_logger("mixfleet.controller")
        self.started_s = clock()
        ctx = Context(store, self.settings, clock, self.metrics, self.log, self.wake, self.changed)
        self.nodes = NodeRegistry(ctx)
        self.watchers = Watchers(ctx)
        self.rollouts = Rollouts(ctx, self.nodes, self.watchers, on_commit=self._on_commit)
        self.loads = Loads(ctx, self.nodes, self.rollouts)
        self.contingencies = Contingencies(ctx, self.nodes, self.rollouts, self.loads)
        self.solves = Solves(
            ctx, self.nodes, self.rollouts, self.loads, self.watchers, self.contingencies
        )
        self.views = DeploymentViews(ctx, self._observe_deployment)
        self.scheduler = FleetScheduler(
            ctx,
            self.nodes,
            self.rollouts,
            self.watchers,
            remove=self._remove_deployment,
            curves=curve_cache(self.settings.curve_cache_dir),
        )
        self.demands = Demands(ctx)  # ReportTraffic
        self.endpoints = Endpoints(ctx, self.nodes, self.watchers)  # WatchInstances
        # a planned deployment is planned for the demand measured after a sustained drift
        self.scheduler.instances.traffic_for = self.demands.traffic_for
        self._status: dict[str, tuple[str, str, tuple[str, ...]]] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self._loop_task: asyncio.Task[None] | None = None
        now = clock()
        last_alive = store.last_alive_s() if isinstance(store, AliveRecord) else None
        self._alive_recorded_s = 0.0
        self.nodes.recover(now, None if last_alive is None else now - last_alive)
        self.rollouts.recover(now)

    @property
    def solver(self) -> SolverPool:
        """The pool solves run in."""
        return self.solves.solver

    # ================================================================= lifecycle

    async def start(self) -> None:
        """Observe every deployment once (in a thread: it reads every committed plan), then
        start the reconcile loop."""
        if self._loop_task is None:
            self.solver.warm_up()
            settings = self.settings.reconcile_settings()
            nodes = self._observe_nodes()
            await asyncio.to_thread(self.views.warm, nodes, self.clock(), settings)
            self._loop_task = asyncio.create_task(self.run(), name="mixfleet-reconcile")

    async def stop(self) -> None:
        """Stop the loop, end every stream and wait for running solves to be dropped."""
        self._stopping = True
        self._wake.set()
        self.watchers.stop()
        background = (*self.solves.tasks(), *self.loads.background_tasks())
        tasks = [t for t in (self._loop_task, *background, *self.contingencies.tasks()) if t]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.solver.close()
        self.contingencies.close()
        with contextlib.suppress(Exception):
            self.rollouts.flush_acks()

    def wake(self) -> None:
        """Run a reconcile tick soon."""
        self._wake.set()

    def changed(self, deployment: str) -> None:
        """What the decision observes of ``deployment`` changed: decide it at the next tick
        (soon). Instance watchers read again: an instance or its record may have changed."""
        self.views.mark(deployment)
        self._wake.set()
        self.watchers.instances_changed()

    async def run(self) -> None:
        """The reconcile loop (until :meth:`stop`)."""
        loop = asyncio.get_running_loop()
        previous: float | None = None
        while not self._stopping:
            started = loop.time()
            if previous is not None:
                self.nodes.credit_stall(started - previous)
            previous = started
            try:
                self.tick()
            except Exception:  # the loop boundary: log, keep going
                self.log.exception("reconcile tick failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.settings.tick_s)
            # Merge wake-ups that arrive in a burst (acks of a rollout) into one tick.
            pause = self.settings.min_tick_interval_s - (loop.time() - started)
            if pause > 0 and not self._stopping:
                await asyncio.sleep(pause)

    def tick(self) -> list[rc.Action]:
        """One observe -> reconcile -> act round over the deployments that changed or wait
        on a clock (:class:`~.views.DeploymentViews`); returns the actions taken."""
        self.rollouts.flush_acks()
        now = self.clock()
        self._record_alive(now)
        nodes = self._observe_nodes()
        settings = self.settings.reconcile_settings(solves=self.store.plan_author == "controller")
        due = self.views.due(nodes, now, settings)
        assigned: dict[str, tuple[str, ...]] | None = None
        unscheduled: dict[str, str] = {}
        planned: dict[str, tuple[str, str]] = {}
        if settings.solves and self.settings.fleet_scheduler:
            assigned, unscheduled = self.scheduler.view(nodes, now, settings, self.views.records())
            # A deployment served by engine instances is never solved as one engine.
            planned = self.scheduler.instances.phases
            skip = planned.keys() | self.scheduler.instances.removed  # drained this tick
            due = tuple(d for d in due if d.name not in skip)
        elif not settings.solves:  # the operator withdraws by deleting PartitionPlans
            self.scheduler.sweep_withdrawn(self.views.records(), now)
        actions = rc.reconcile(rc.Observed(now, nodes, due, assigned, unscheduled), settings)
        actions += [rc.SetStatus(n, phase, why) for n, (phase, why) in planned.items()]
        for action in actions:
            try:
                self._act(action)
            except Exception:
                self.log.exception(
                    "action failed",
                    action=type(action).__name__,
                    deployment=getattr(action, "deployment", None),
                )
        self.views.decided(due)
        return actions

    def _record_alive(self, now_s: float) -> None:
        """Tell the store the controller is alive (rate-limited), so a restart knows how
        long it was down."""
        if now_s - self._alive_recorded_s < self.settings.alive_record_s:
            return
        self._alive_recorded_s = now_s
        if isinstance(self.store, AliveRecord):
            self.store.record_alive(now_s)
        if isinstance(self.store, RowHealth):
            self.metrics.store_quarantined_rows.set(len(self.store.quarantined()))

    # ================================================================= observe

    def observe(self) -> rc.Observed:
        """What the decision sees: every node, and every deployment as last observed."""
        return rc.Observed(self.clock(), self._observe_nodes(), self.views.all())

    def _observe_nodes(self) -> tuple[rc.NodeObs, ...]:
        nodes = self.nodes.observe()
        cordoned = self.store.cordoned_nodes()  # an administrator's, not the agents'
        return tuple(replace(n, cordoned=True) if n.name in cordoned else n for n in nodes)

    def _observe_deployment(self, d: StoredDeployment) -> rc.DeploymentObs:
        parts = (self.rollouts, self.solves, self.loads, self.contingencies)
        return observe_deployment(self.store, d, *parts)

    # ================================================================= act

    def _act(self, action: rc.Action) -> None:
        if isinstance(action, rc.SetNodeLost):
            self.nodes.set_lost(action)
        elif isinstance(action, rc.Solve):
            self.solves.start(action)
        elif isinstance(action, rc.StartRollout):
            self.rollouts.start(action.deployment, action.version)
        elif isinstance(action, rc.Commit):
            self.rollouts.commit(action.deployment, action.version)
        elif isinstance(action, rc.Abort):
            self.rollouts.abort(action.deployment, action.version, action.reason)
        elif isinstance(action, rc.PlanContingencies):
            self.contingencies.start(action)
        elif isinstance(action, rc.SetStatus):
            self._set_status(action)
            return
        if not isinstance(action, rc.SetNodeLost):
            self.views.mark(action.deployment)

    def _set_status(self, a: rc.SetStatus) -> None:
        conditions = quarantine_conditions(self.store, a.deployment)
        key = (a.phase, a.message, conditions)
        if self._status.get(a.deployment) == key:
            return
        known = self.views.record(a.deployment)
        if a.deployment not in self._status and known is not None and status_key(known) == key:
            self._status[a.deployment] = key  # stored before a restart: nothing to write
            return
        self._status[a.deployment] = key
        d = self.store.get_deployment(a.deployment)
        if d is None:
            return
        status = dict(d.status)
        status.update(phase=a.phase, message=a.message, conditions=list(conditions))
        self.store.set_deployment_status(a.deployment, status)

    def _on_commit(self, deployment: str) -> None:
        """A new plan of ``deployment`` was committed: imbalance samples and contingency
        plans start over; the instances it replaces may drain now."""
        self.loads.forget_samples(deployment)
        self.contingencies.forget(deployment)
        self.scheduler.instances.on_commit(deployment)

    # ================================================================= AgentService

    def register(self, inventory: NodeInventory) -> RegisterResult:
        """Register (or re-register) a node; starts a new session and ends its old stream.

        Raises:
            InputError: naming the field (``inventory.gpus[1].uuid``...).
        """
        result = self.nodes.register(inventory)
        self.watchers.end_stream(inventory.node)
        self.watchers.instances_changed()  # its address may be new
        return result

    def heartbeat(
        self,
        node: str,
        session_id: str,
        *,
        state: NodeState = "ready",
        message: str = "",
        health: Mapping[int, GpuHealth] | None = None,
        applied: Mapping[str, int] | None = None,
    ) -> bool:
        """Record a heartbeat; returns False when the agent must register again.

        Raises:
            InputError: a health report names a GPU index the node does not have.
        """
        before = self.nodes.get(node)
        ok = self.nodes.heartbeat(
            node, session_id, state=state, message=message, health=health, applied=applied
        )
        after = self.nodes.get(node)
        if ok and after is not None and (before is None or before.applied != after.applied):
            self.nodes.report_unknown(node, self.rollouts.unknown_of(after.applied))
            self.scheduler.remove_deleted(node, after.applied)
        return ok

    def watch_assignments(self, node: str, session_id: str) -> AsyncIterator[AssignmentEvent]:
        """The node's stream: committed parts, an in-flight PREPARE, then new events.

        Raises (on the first read):
            NotFoundError: unregistered node. PreconditionError: stale session.
        """

        def opened() -> None:
            self.nodes.check_stream(node, session_id)
            self.nodes.heard_from(node, self.clock())

        def snapshot() -> list[AssignmentEvent]:
            stored = self.nodes.get(node)
            applied = dict(stored.applied) if stored is not None else {}
            cached = self.views.warmed and not self.views.external
            events, unknown = self.rollouts.snapshot(node, applied, cached=cached)
            self.nodes.report_unknown(node, unknown)
            return events

        return self.watchers.assignments(node, session_id, opened, snapshot)

    def ack(
        self,
        node: str,
        session_id: str,
        deployment: str,
        plan_id: str,
        version: int,
        state: AckState,
        reason: str = "",
    ) -> bool:
        """Record an agent's ack; returns True when it was a duplicate.

        Raises:
            InputError: FAILED without a reason. NotFoundError: unknown node, deployment or
            version. PreconditionError: stale session, wrong plan id, the node has no part,
            or PREPARED for a rollout that is over.
        """
        if state == "failed" and not reason:
            raise InputError("a FAILED ack needs a reason", field="reason")
        self.nodes.check_ack(node, session_id)
        duplicate = self.rollouts.ack(node, deployment, plan_id, version, state, reason)
        if not duplicate:
            self.views.mark(deployment)
        return duplicate

    # ================================================================= PlanService

    def fleet_for(self, name: str, nodes: Sequence[str]) -> Fleet:
        """The planning core's fleet of the named nodes' healthy GPUs (in the given order)."""
        return self.nodes.fleet_for(name, nodes)

    async def dry_run(self, spec: DeploymentSpec, fleet: Fleet | None = None) -> PlacementResult:
        """Solve ``spec`` without storing anything (PlanService.Solve).

        Raises:
            InputError: bad spec. PreconditionError: no usable node matches.
            InfeasibleError: the model cannot fit.
        """
        return await self.solves.dry_run(spec, fleet, self.observe)

    def apply_deployment(
        self,
        spec: DeploymentSpec,
        *,
        create_only: bool = False,
        update_only: bool = False,
        checked: bool = False,
    ) -> StoredDeployment:
        """Create / update a deployment (the spec was validated by the caller; ``checked``:
        :func:`~policies.spec.build.check_spec` too, off the event loop).

        Raises:
            AlreadyExistsError, NotFoundError: see :meth:`Store.put_deployment`.
        """
        if not checked:
            check_spec(spec)
        self.scheduler.instances.refuse_user_change(spec.name)
        before = self.store.get_deployment(spec.name)
        d = self.store.put_deployment(
            spec, now_s=self.clock(), create_only=create_only, update_only=update_only
        )
        if before is None or before.generation != d.generation:
            self.solves.forget_failure(spec.name)
            self._status.pop(spec.name, None)
            self.log.info("deployment applied", deployment=spec.name, generation=d.generation)
            self.changed(spec.name)
        return d

    def delete_deployment(self, name: str) -> bool:
        """Delete a deployment: abort its rollout, REMOVE its parts from agents; a
        deployment served by engine instances takes its instances with it.

        Raises:
            PreconditionError: ``name`` is an engine instance (the controller writes it).
        """
        self.scheduler.instances.refuse_user_change(name)
        deleted = self._remove_deployment(name)
        self.scheduler.instances.forget(name)
        return deleted

    def _remove_deployment(self, name: str) -> bool:
        """Delete a deployment the controller's way (rollout aborted, parts REMOVEd)."""
        r, c = self.rollouts.delete(name)
        self.solves.cancel(name)
        deleted = self.store.delete_deployment(name, now_s=self.clock())
        if not deleted:
            return False
        self.rollouts.deleted(name, r, c)
        self.loads.forget_samples(name)
        self.solves.forget_failure(name)
        self.contingencies.forget(name)
        self.demands.forget(name)
        self._status.pop(name, None)
        self.log.info("deployment deleted", deployment=name)
        self.changed(name)
        return True

    def delete_node(self, name: str, *, force: bool = False) -> list[str]:
        """Forget a node (``mixfleetctl nodes delete``); returns the deployments that had a
        part on it (they plan again without it).

        Raises:
            NotFoundError: no such node. PreconditionError: it serves a committed plan or
            a rollout, or still heartbeats, and ``force`` is not set.
        """
        if name not in self.nodes:
            raise NotFoundError(f"no node {name!r}", field="name")
        serving = self.rollouts.serving(name)
        silent = self.nodes.silent_s(name)
        alive = silent < self.settings.node_lost_after_s
        if (serving or alive) and not force:
            why = (
                f"it serves {', '.join(serving[:5])}"
                if serving
                else f"it heartbeated {max(silent, 0.0):.0f} s ago (its agent would register "
                "it again)"
            )
            raise PreconditionError(
                f"node {name} is in use: {why}. To fix: stop its agent (or drain it) and wait "
                "for its deployments to move, or pass --force",
                field="name",
            )
        self.nodes.delete(name)
        self.watchers.end_stream(name)
        for d in serving:
            self.changed(d)
        return serving

    def get_deployment(self, name: str) -> StoredDeployment:
        """The deployment called ``name``.

        Raises:
            NotFoundError: no such deployment.
        """
        d = self.store.get_deployment(name)
        if d is None:
            raise NotFoundError(f"no deployment {name!r}", field="name")
        return d

    def get_plan(self, deployment: str, version: int) -> StoredPlan:
        """A version (0 = committed), with its document.

        Raises:
            NotFoundError: no such deployment or version.
        """
        if self.store.get_deployment(deployment, include_deleted=True) is None:
            raise NotFoundError(f"no deployment {deployment!r}", field="deployment")
        stored = (
            self.store.committed_plan(deployment)
            if version == 0
            else self.store.get_plan(deployment, version)
        )
        if stored is None:
            what = "no committed plan" if version == 0 else f"no version {version}"
            raise NotFoundError(f"deployment {deployment!r} has {what}", field="version")
        return stored

    def acks_of(self, deployment: str, version: int) -> dict[str, str]:
        """node -> latest ack state (``failed: reason`` for failures)."""
        return self.rollouts.acks_of(deployment, version)

    def watch_plans(self, deployment: str = "") -> AsyncIterator[StoredPlan]:
        """Latest record of each (matching) deployment, then every change."""
        return self.watchers.watch_plans(deployment)

    def node_views(self, only: str | None = None) -> list[NodeView]:
        """Every node (sorted by name), or just the one called ``only`` (none if unknown)."""
        return self.nodes.node_views(only)

    # ================================================================= EngineService

    def routing_plan(self, deployment: str) -> StoredPlan:
        """The committed plan of a deployment (for routing).

        Raises:
            NotFoundError: unknown deployment. PreconditionError: nothing committed yet.
        """
        if self.store.get_deployment(deployment) is None:
            raise NotFoundError(f"no deployment {deployment!r}", field="deployment")
        stored = self.store.committed_plan(deployment)
        if stored is None:
            raise PreconditionError(
                f"deployment {deployment!r} has no committed plan yet. To fix: wait for the "
                "rollout (mixfleetctl watch)",
                field="deployment",
            )
        return stored

    def watch_routing(self, deployment: str) -> AsyncIterator[StoredPlan]:
        """The committed plan now (when there is one), then each newly committed one.

        Raises (on the first read):
            NotFoundError: unknown deployment.
        """
        return self.watchers.watch_routing(deployment)

    def report_load(self, window: LoadWindow) -> None:
        """Store a load window and, in the background, measure the committed plan's
        imbalance under it.

        Raises:
            NotFoundError: unknown deployment. InputError: naming the field (shape, values).
        """
        self.loads.report_load(window)

    def record_imbalance(self, deployment: str, at_s: float, excess: float) -> None:
        """Add an imbalance sample (measured minus the plan's predicted imbalance)."""
        self.loads.record_imbalance(deployment, at_s, excess)
