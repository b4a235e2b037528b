"""The controller: state behind the gRPC services, the reconcile loop and the rollout.

One :class:`Controller` runs on one asyncio event loop. The servicers
(:mod:`controlplane.server.services`) translate messages and call its plain methods; everything
durable goes through the :class:`controlplane.store.Store`; solves run in a worker process
(:class:`controlplane.server.solver_pool.SolverPool`; the ILP fans its layers out to more processes
from there), so a long solve never stalls heartbeats, acks or streams.

The loop (:meth:`Controller.run`), once per ``tick_s`` or as soon as something changed:

1. observe - build :class:`controlplane.server.reconcile.Observed` from memory and the store;
2. decide - :func:`controlplane.server.reconcile.reconcile` (pure);
3. act - carry out each action (start a solve task, start / commit / abort a rollout,
   mark nodes lost, write status). A failing action is logged and retried next tick; only
   this loop boundary catches broad exceptions.

Two-phase rollout of version V of a deployment (the wire protocol is in
``proto/mixfleet/v1/agent.proto``):

* start: V becomes ``preparing`` with a deadline; every node holding a part of V gets
  PREPARE on its WatchAssignments stream (or on connect, when it is not connected);
* each PREPARED / FAILED ack is stored (idempotently) and wakes the loop;
* commit: the store moves the committed pointer to V in one transaction (the commit point);
  then nodes of V get COMMIT, nodes only in the old plan get REMOVE, engines watching the
  routing get V;
* abort (a FAILED ack, a lost target, the deadline): V becomes ``aborted``; nodes that got
  PREPARE get ABORT; the previous committed version stays.

After a restart the controller rebuilds rollouts from ``preparing`` versions and their
stored acks (giving agents a fresh prepare deadline to reconnect) and treats every known
node as alive until it misses heartbeats again.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import structlog

from controlplane.deployment import (
    DeploymentSpec,
    build_request,
    check_spec,
    resolve_model,
    usd_per_million_tokens,
    workload_for,
)
from controlplane.errors import NotFoundError, PreconditionError
from controlplane.server import reconcile as rc
from controlplane.server.metrics import Metrics
from controlplane.server.solver_pool import SolverPool
from controlplane.store import (
    AckState,
    LoadWindow,
    NodeState,
    Store,
    StoredAck,
    StoredDeployment,
    StoredNode,
    StoredPlan,
)
from policies.assignment import NodePart, aggregate_load, imbalance_under_load, split_plan
from policies.errors import InfeasibleError, InputError
from policies.fleet import Fleet
from policies.inventory import GpuHealth, NodeInventory, check_inventory
from policies.plan import Plan
from policies.request import PlacementResult

Phase = Literal["prepare", "commit", "abort", "remove"]
NodeHealth = Literal["ready", "degraded", "draining", "lost"]


@dataclass(frozen=True)
class ControllerSettings:
    """Timing and limits of the controller.

    Attributes:
        heartbeat_interval_s: period agents are told to heartbeat at, s.
        node_lost_after_s: silence after which a node is lost and planned around, s.
        tick_s: longest pause between two reconcile ticks, s.
        retry_after_abort_s: pause before re-solving inputs whose rollout was aborted, s.
        retry_after_error_s: pause after a temporary solve failure, s.
        heartbeat_persist_s: persist a node's last heartbeat time at most this often, s
            (liveness itself is kept in memory).
        load_window_retention_s: load windows older than this are pruned, s.
        max_imbalance_samples: imbalance samples kept per deployment.
        solver_processes: worker processes for solves (solves that can run at once);
            0 = a thread of the controller process (holds the GIL: tests, tiny fleets).
        min_tick_interval_s: shortest time between two reconcile ticks, s. Acks, heartbeats
            and registrations wake the loop; ticks woken within this interval are merged,
            so a burst of N acks costs a few ticks, not N.
    """

    heartbeat_interval_s: float = 5.0
    node_lost_after_s: float = 15.0
    tick_s: float = 1.0
    retry_after_abort_s: float = 30.0
    retry_after_error_s: float = 30.0
    heartbeat_persist_s: float = 30.0
    load_window_retention_s: float = 3600.0
    max_imbalance_samples: int = 256
    solver_processes: int = 1
    min_tick_interval_s: float = 0.1

    def reconcile_settings(self) -> rc.ReconcileSettings:
        return rc.ReconcileSettings(
            node_lost_after_s=self.node_lost_after_s,
            retry_after_abort_s=self.retry_after_abort_s,
            retry_after_error_s=self.retry_after_error_s,
        )


@dataclass(frozen=True)
class AssignmentEvent:
    """One message on a node's WatchAssignments stream (``mixfleet.v1.Assignment``)."""

    deployment: str
    plan_id: str
    version: int
    phase: Phase
    world_size: int = 0
    part: NodePart | None = None
    prepare_deadline_s: float = 0.0


@dataclass(frozen=True)
class RegisterResult:
    node: str
    session_id: str
    heartbeat_interval_s: float
    node_lost_after_s: float
    controller_id: str


@dataclass(frozen=True)
class NodeView:
    """A node for PlanService: stored record plus live health."""

    stored: StoredNode
    health: NodeHealth
    last_seen_s: float


@dataclass
class _Stream:
    session_id: str
    queue: asyncio.Queue[AssignmentEvent | None] = field(default_factory=asyncio.Queue)


@dataclass
class _Rollout:
    version: int
    plan_id: str
    plan: Plan
    parts: dict[str, NodePart]
    deadline_s: float
    started_s: float
    prepared: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.parts)


@dataclass
class _Committed:
    version: int
    plan: Plan
    parts: dict[str, NodePart]


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
        self.solver = SolverPool(self.settings.solver_processes)
        self.started_s = clock()
        self._nodes: dict[str, StoredNode] = {}  # write-through cache of the store's nodes
        self._streams: dict[str, _Stream] = {}
        self._sessions: dict[str, str] = {}
        self._last_seen: dict[str, float] = {}
        # Liveness credit for the controller's own stalls (see _credit_stall): total stalled
        # seconds so far, and that total when each node was last heard from.
        self._stalled_s = 0.0
        self._stalled_at_seen: dict[str, float] = {}
        self._last_persisted: dict[str, float] = {}
        self._lost: set[str] = set()
        self._names: list[str] = []  # sorted names of self._nodes (nodes are never removed)
        self._obs: dict[str, tuple[StoredNode, float, bool, rc.NodeObs]] = {}
        self._rollouts: dict[str, _Rollout] = {}
        self._ack_buffer: list[StoredAck] = []
        # deployment -> (version, plan, node parts) of its latest proposed plan, split off
        # the event loop
        self._proposed: dict[str, tuple[int, Plan, dict[str, NodePart]]] = {}
        self._ack_cache: dict[tuple[str, int], dict[str, set[AckState]]] = {}
        self._committed: dict[str, _Committed] = {}
        self._solving: dict[str, asyncio.Task[None]] = {}
        self._failures: dict[str, rc.FailureObs] = {}
        self._samples: dict[str, deque[tuple[float, float]]] = {}
        self._last_rebalance: dict[str, float] = {}
        self._status: dict[str, tuple[str, str]] = {}
        self._plan_watchers: set[asyncio.Queue[StoredPlan]] = set()
        self._routing_watchers: dict[str, set[asyncio.Queue[StoredPlan]]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._stopping = False
        self._loop_task: asyncio.Task[None] | None = None
        self._recover()

    # ================================================================= lifecycle

    def _recover(self) -> None:
        """Rebuild memory from the store after a (re)start."""
        now = self.clock()
        for n in self.store.list_nodes():
            self._nodes[n.name] = n
            self._sessions[n.name] = n.session_id
            self._last_seen[n.name] = max(now, n.last_heartbeat_s)
            self._last_persisted[n.name] = n.last_heartbeat_s
        for d in self.store.list_deployments():
            for p in self.store.list_plans(d.name, states=["preparing"], limit=10):
                stored = self.store.get_plan(d.name, p.version)
                if stored is None or stored.plan is None:
                    continue
                deadline = max(p.prepare_deadline_s or 0.0, now + d.spec.prepare_timeout_s)
                r = _Rollout(
                    p.version,
                    p.plan_id,
                    stored.plan,
                    self._split(stored.plan, d.name),
                    deadline,
                    now,
                )
                for a in self.store.acks(d.name, p.version):
                    if a.state == "prepared":
                        r.prepared.add(a.node)
                    elif a.state == "failed":
                        r.failed[a.node] = a.reason
                self._rollouts[d.name] = r
                self.log.info(
                    "rollout resumed",
                    deployment=d.name,
                    version=p.version,
                    plan_id=p.plan_id,
                    prepared=len(r.prepared),
                    targets=len(r.targets),
                )

    async def start(self) -> None:
        """Start the reconcile loop."""
        if self._loop_task is None:
            self.solver.warm_up()
            self._loop_task = asyncio.create_task(self.run(), name="mixfleet-reconcile")

    async def stop(self) -> None:
        """Stop the loop, end every stream and wait for running solves to be dropped."""
        self._stopping = True
        self._wake.set()
        for s in self._streams.values():
            s.queue.put_nowait(None)
        for q in self._plan_watchers:
            q.put_nowait(_STOP)
        for qs in self._routing_watchers.values():
            for q in qs:
                q.put_nowait(_STOP)
        tasks = [t for t in (self._loop_task, *self._solving.values(), *self._background) if t]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.solver.close()
        with contextlib.suppress(Exception):
            self._flush_acks()

    def wake(self) -> None:
        """Run a reconcile tick soon."""
        self._wake.set()

    def _credit_stall(self, gap_s: float) -> None:
        """Account for the event loop having been unable to run the reconcile loop.

        Ticks start at most ``tick_s`` apart while the loop is free; a longer ``gap_s``
        between two tick starts means the loop was stalled (overloaded, or a tick's own work),
        and meanwhile heartbeats waited unread in gRPC's queues. That excess is not counted
        as any node's silence: without this credit an overloaded controller would declare
        healthy nodes lost and re-plan around them, overloading itself further.
        """
        late = gap_s - self.settings.tick_s - _STALL_TOLERANCE_S
        if late > 0:
            self._stalled_s += late
            self.metrics.loop_stall_seconds.inc(late)
            self.log.warning("controller stalled", stalled_s=round(late, 3))

    def _seen(self, name: str, fallback_s: float) -> float:
        """When ``name`` was last heard from for liveness: the last heartbeat, moved later
        by the time this controller has been stalled since (see :meth:`_credit_stall`)."""
        seen = self._last_seen.get(name, fallback_s)
        return seen + (self._stalled_s - self._stalled_at_seen.get(name, self._stalled_s))

    def _heard_from(self, name: str, now: float) -> None:
        self._last_seen[name] = now
        self._stalled_at_seen[name] = self._stalled_s

    async def run(self) -> None:
        """The reconcile loop (until :meth:`stop`)."""
        loop = asyncio.get_running_loop()
        previous: float | None = None
        while not self._stopping:
            started = loop.time()
            if previous is not None:
                self._credit_stall(started - previous)
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
        """One observe -> reconcile -> act round; returns the actions taken."""
        self._flush_acks()
        observed = self.observe()
        actions = rc.reconcile(observed, self.settings.reconcile_settings())
        for action in actions:
            try:
                self._act(action)
            except Exception:
                self.log.exception(
                    "action failed",
                    action=type(action).__name__,
                    deployment=getattr(action, "deployment", None),
                )
        return actions

    # ================================================================= observe

    def observe(self) -> rc.Observed:
        now = self.clock()
        if len(self._names) != len(self._nodes):
            self._names = sorted(self._nodes)
        nodes = [self._node_obs(name) for name in self._names]
        alive = sum(1 for n in nodes if not n.marked_lost and n.state != "draining")
        self.metrics.nodes.set(len(nodes))
        self.metrics.healthy_nodes.set(alive)
        deployments = [self._observe_deployment(d) for d in self.store.list_deployments()]
        return rc.Observed(now, tuple(nodes), tuple(deployments))

    def _node_obs(self, name: str) -> rc.NodeObs:
        """The node as the decision sees it, rebuilt only when its record, liveness or
        lost mark changed (observe runs several times a second over every node)."""
        n = self._nodes[name]
        seen = self._seen(name, n.last_heartbeat_s)
        lost = name in self._lost
        cached = self._obs.get(name)
        if cached is not None and cached[0] is n and cached[1] == seen and cached[2] == lost:
            return cached[3]
        if cached is not None and cached[0].inventory is n.inventory:
            labels, healthy = cached[3].labels, cached[3].healthy_gpus
        else:
            labels, healthy = dict(n.inventory.labels), _healthy_gpu_ids(n.inventory)
        obs = rc.NodeObs(name, labels, seen, n.state, healthy, lost)
        self._obs[name] = (n, seen, lost, obs)
        return obs

    def _observe_deployment(self, d: StoredDeployment) -> rc.DeploymentObs:
        committed = None
        pending = None
        for p in self.store.list_plans(d.name, limit=5):
            if p.state == "committed" and committed is None:
                c = self._committed_state(d.name)
                gpus = tuple(g.gpu for g in c.plan.gpus) if c is not None else ()
                committed = _plan_obs(p, gpus)
            elif p.state in ("proposed", "aborted") and pending is None and committed is None:
                pending = _plan_obs(p)
        r = self._rollouts.get(d.name)
        rollout = None
        if r is not None:
            rollout = rc.RolloutObs(
                r.version, r.deadline_s, r.targets, frozenset(r.prepared), dict(r.failed)
            )
        return rc.DeploymentObs(
            spec=d.spec,
            generation=d.generation,
            committed=committed,
            pending=pending,
            rollout=rollout,
            solving=d.name in self._solving,
            failure=self._failures.get(d.name),
            imbalance_samples=tuple(self._samples.get(d.name, ())),
            last_rebalance_s=self._last_rebalance.get(d.name),
        )

    # ================================================================= act

    def _act(self, action: rc.Action) -> None:
        if isinstance(action, rc.SetNodeLost):
            self._set_lost(action)
        elif isinstance(action, rc.Solve):
            self._start_solve(action)
        elif isinstance(action, rc.StartRollout):
            self._start_rollout(action.deployment, action.version)
        elif isinstance(action, rc.Commit):
            self._commit(action.deployment, action.version)
        elif isinstance(action, rc.Abort):
            self._abort(action.deployment, action.version, action.reason)
        elif isinstance(action, rc.SetStatus):
            self._set_status(action)

    def _set_lost(self, a: rc.SetNodeLost) -> None:
        if a.lost:
            self._lost.add(a.node)
            self.log.warning("node lost", node=a.node, reason=a.reason)
        else:
            self._lost.discard(a.node)
            self.log.info("node back", node=a.node, reason=a.reason)

    def _set_status(self, a: rc.SetStatus) -> None:
        if self._status.get(a.deployment) == (a.phase, a.message):
            return
        self._status[a.deployment] = (a.phase, a.message)
        d = self.store.get_deployment(a.deployment)
        if d is None:
            return
        status = dict(d.status)
        status.update(phase=a.phase, message=a.message)
        self.store.set_deployment_status(a.deployment, status)

    # ----------------------------------------------------------------- solve

    def fleet_for(self, name: str, nodes: Sequence[str]) -> Fleet:
        """The planning core's fleet of the named nodes' healthy GPUs (in the given order)."""
        out = []
        for n in nodes:
            stored = self._nodes.get(n)
            if stored is None:
                continue
            node = stored.inventory.to_node(healthy_only=True)
            if node.gpus:
                out.append(node)
        return Fleet(name, tuple(out))

    def _measured_load(self, spec: DeploymentSpec, since_s: float) -> list[list[float]] | None:
        windows = self.store.load_windows(spec.name, since_s=since_s)
        if not windows:
            return None
        return aggregate_load([w.counts for w in windows], resolve_model(spec))

    def _start_solve(self, a: rc.Solve) -> None:
        d = self.store.get_deployment(a.deployment)
        if d is None:
            return
        committed = self._committed_state(a.deployment) if a.previous_version else None
        previous = committed.plan if committed is not None else None
        measured = None
        if a.rebalance or d.spec.workload.load == "measured":
            since = self.clock() - max(d.spec.rebalance.sustain_s, 60.0)
            measured = self._measured_load(d.spec, since)
        fleet = self.fleet_for(a.deployment, a.nodes)
        log = self.log.bind(deployment=a.deployment, reason=a.reason)
        if a.rebalance:
            self._last_rebalance[a.deployment] = self.clock()
        log.info("solve started", gpus=len(fleet.gpus), migration_aware=previous is not None)
        task = asyncio.create_task(
            self._solve(d, fleet, previous, measured, a), name=f"solve-{a.deployment}"
        )
        self._solving[a.deployment] = task

    async def _solve(
        self,
        d: StoredDeployment,
        fleet: Fleet,
        previous: Plan | None,
        measured: list[list[float]] | None,
        a: rc.Solve,
    ) -> None:
        name = d.name
        log = self.log.bind(deployment=name)
        t0 = time.perf_counter()
        try:
            try:
                request = build_request(d.spec, fleet, previous=previous, measured=measured)
                result = await self.solver.solve(request)
            except (InputError, InfeasibleError) as exc:
                self._failures[name] = rc.FailureObs(a.inputs_key, self.clock(), str(exc), True)
                self.metrics.solve_failures.labels(name, "permanent").inc()
                log.warning("solve failed", error=str(exc), permanent=True)
                return
            except Exception as exc:
                self._failures[name] = rc.FailureObs(
                    a.inputs_key, self.clock(), f"solver error: {exc}", False
                )
                self.metrics.solve_failures.labels(name, "temporary").inc()
                log.exception("solve failed", permanent=False)
                return
            elapsed = time.perf_counter() - t0
            self.metrics.solve_seconds.labels(name, d.spec.policy).observe(elapsed)
            if result.infeasible:
                msg = "infeasible: " + "; ".join(result.infeasible[:5])
                self._failures[name] = rc.FailureObs(a.inputs_key, self.clock(), msg, True)
                self.metrics.solve_failures.labels(name, "infeasible").inc()
                log.warning("solve infeasible", reasons=list(result.infeasible[:5]))
                return
            current = self.store.get_deployment(name)
            if current is None or current.generation != d.generation:
                log.info("solve discarded: the deployment changed meanwhile")
                return
            self._failures.pop(name, None)
            # Storing serialises the whole plan and splitting builds every node's part: both
            # grow with the fleet (about a second at 2,000 GPUs), so they run in a thread.
            stored, parts = await asyncio.to_thread(
                self._persist, name, result.plan, a, self._uuids(result.plan), self.clock()
            )
            assert stored.plan is not None
            self._proposed[name] = (stored.version, stored.plan, parts)
            s = result.plan.summary
            log.info(
                "plan proposed",
                version=stored.version,
                plan_id=stored.plan_id,
                step_time_us=round(s.step_time_us, 1),
                imbalance=round(s.imbalance, 4),
                expert_moves=s.expert_moves,
                solve_s=round(elapsed, 3),
            )
            self._emit(stored)
        finally:
            self._solving.pop(name, None)
            self.wake()

    async def dry_run(self, spec: DeploymentSpec, fleet: Fleet | None = None) -> PlacementResult:
        """Solve ``spec`` without storing anything (PlanService.Solve).

        Raises:
            InputError: bad spec. PreconditionError: no usable node matches.
            InfeasibleError: the model cannot fit.
        """
        check_spec(spec)
        if fleet is None:
            obs = self.observe()
            nodes, _ = rc.usable_gpus(
                spec, obs.nodes, obs.now_s, self.settings.reconcile_settings()
            )
            fleet = self.fleet_for(spec.name, nodes)
        if not fleet.gpus:
            raise PreconditionError(
                "no usable node matches the node selector. To fix: start agents on matching "
                "nodes or change spec.node_selector",
                field="spec.node_selector",
            )
        measured = self._measured_load(spec, self.clock() - 3600.0)
        request = build_request(spec, fleet, measured=measured)
        return await self.solver.solve(request)

    # ----------------------------------------------------------------- rollout

    def _uuids(self, plan: Plan) -> dict[str, str]:
        """GPU id -> hardware UUID of the plan's GPUs, from the nodes' inventories."""
        uuids: dict[str, str] = {}
        for node in {g.node for g in plan.gpus}:
            stored = self._nodes.get(node)
            if stored is not None:
                for g in stored.inventory.gpus:
                    uuids[f"{node}/gpu{g.index}"] = g.uuid
        return uuids

    def _split(self, plan: Plan, deployment: str) -> dict[str, NodePart]:
        return split_plan(plan, deployment, self._uuids(plan))

    def _persist(
        self, deployment: str, plan: Plan, a: rc.Solve, uuids: Mapping[str, str], now_s: float
    ) -> tuple[StoredPlan, dict[str, NodePart]]:
        """Store a solved plan as the next version and split it into node parts (run in a
        thread: see :meth:`_solve`). The plan's document is built once for both."""
        doc = plan.to_dict()
        stored = self.store.add_plan(
            deployment, plan, reason=a.reason, inputs_key=a.inputs_key, now_s=now_s, document=doc
        )
        assert stored.plan is not None
        doc["version"] = stored.version
        return stored, split_plan(stored.plan, deployment, uuids, document=doc)

    def _start_rollout(self, deployment: str, version: int) -> None:
        d = self.store.get_deployment(deployment)
        stored = self.store.get_plan(deployment, version, with_plan=False)
        if d is None or stored is None:
            return
        proposed = self._proposed.pop(deployment, None)
        plan: Plan | None
        if proposed is not None and proposed[0] == version:
            _, plan, parts = proposed
        else:  # proposed before a restart: read it back
            full = self.store.get_plan(deployment, version)
            plan = full.plan if full is not None else None
            parts = self._split(plan, deployment) if plan is not None else {}
        if plan is None:
            return
        now = self.clock()
        deadline = now + d.spec.prepare_timeout_s
        self.store.set_plan_state(
            deployment, version, "preparing", now_s=now, prepare_deadline_s=deadline
        )
        r = _Rollout(version, stored.plan_id, plan, parts, deadline, now)
        self._rollouts[deployment] = r
        self.log.info(
            "rollout started",
            deployment=deployment,
            version=version,
            plan_id=r.plan_id,
            nodes=len(r.targets),
            deadline_s=round(d.spec.prepare_timeout_s, 1),
        )
        for node, part in r.parts.items():
            self._send(node, self._prepare_event(deployment, r, part))
        self._emit_version(deployment, version)

    def _prepare_event(self, deployment: str, r: _Rollout, part: NodePart) -> AssignmentEvent:
        return AssignmentEvent(
            deployment, r.plan_id, r.version, "prepare", len(r.plan.gpus), part, r.deadline_s
        )

    def _commit(self, deployment: str, version: int) -> None:
        r = self._rollouts.get(deployment)
        if r is None or r.version != version:
            return
        now = self.clock()
        before = self._committed_state(deployment)
        self.store.commit_plan(deployment, version, now_s=now)  # the commit point
        del self._rollouts[deployment]
        self._committed[deployment] = _Committed(version, r.plan, r.parts)
        self._samples.pop(deployment, None)
        # Every target acked PREPARED on its current stream, so COMMIT carries no part: the
        # agent switches to what it staged (a stream opened later replays it with the part).
        for node in r.parts:
            self._send(
                node, AssignmentEvent(deployment, r.plan_id, version, "commit", len(r.plan.gpus))
            )
        if before is not None:
            for node in before.parts:
                if node not in r.parts:
                    self._send(node, AssignmentEvent(deployment, r.plan_id, version, "remove"))
        s = r.plan.summary
        self.metrics.rollout_seconds.labels(deployment, "committed").observe(now - r.started_s)
        self.metrics.rollouts.labels(deployment, "committed").inc()
        self.metrics.predicted_step_us.labels(deployment).set(s.step_time_us)
        self.metrics.predicted_imbalance.labels(deployment).set(s.imbalance)
        self.metrics.committed_version.labels(deployment).set(version)
        self.log.info(
            "plan committed",
            deployment=deployment,
            version=version,
            plan_id=r.plan_id,
            nodes=len(r.targets),
            rollout_s=round(now - r.started_s, 3),
        )
        d = self.store.get_deployment(deployment)
        if d is not None:
            status = dict(d.status)
            status.update(
                step_time_us=s.step_time_us,
                imbalance=s.imbalance,
                nodes=list(r.targets),
                committed_plan_id=r.plan_id,
                cost_per_million_tokens_usd=usd_per_million_tokens(d.spec, r.plan),
            )
            self.store.set_deployment_status(deployment, status)
        stored = self._emit_version(deployment, version)
        if stored is not None:
            for q in self._routing_watchers.get(deployment, set()):
                q.put_nowait(stored)

    def _abort(self, deployment: str, version: int, reason: str) -> None:
        now = self.clock()
        r = self._rollouts.pop(deployment, None)
        stored = self.store.get_plan(deployment, version, with_plan=False)
        if stored is not None and stored.state in ("proposed", "preparing"):
            self.store.set_plan_state(deployment, version, "aborted", reason=reason, now_s=now)
        if r is not None and r.version == version:
            for node in r.parts:
                self._send(node, AssignmentEvent(deployment, r.plan_id, version, "abort"))
            self.metrics.rollout_seconds.labels(deployment, "aborted").observe(now - r.started_s)
        self.metrics.rollouts.labels(deployment, "aborted").inc()
        self.log.warning("rollout aborted", deployment=deployment, version=version, reason=reason)
        self._emit_version(deployment, version)

    def _committed_state(self, deployment: str) -> _Committed | None:
        """The committed plan and its parts (cached; loaded from the store once)."""
        d = self.store.get_deployment(deployment)
        if d is None or d.committed_version is None:
            self._committed.pop(deployment, None)
            return None
        cached = self._committed.get(deployment)
        if cached is not None and cached.version == d.committed_version:
            return cached
        plan = self.store.committed_plan(deployment)
        if plan is None or plan.plan is None:
            return None
        c = _Committed(plan.version, plan.plan, self._split(plan.plan, deployment))
        self._committed[deployment] = c
        return c

    # ----------------------------------------------------------------- events

    def _send(self, node: str, event: AssignmentEvent) -> None:
        stream = self._streams.get(node)
        if stream is not None:
            stream.queue.put_nowait(event)

    def _emit(self, stored: StoredPlan) -> None:
        for q in self._plan_watchers:
            q.put_nowait(stored)

    def _emit_version(self, deployment: str, version: int) -> StoredPlan | None:
        stored = self.store.get_plan(deployment, version, with_plan=False)
        if stored is not None:
            self._emit(stored)
        return stored

    # ================================================================= AgentService

    def register(self, inventory: NodeInventory) -> RegisterResult:
        """Register (or re-register) a node; starts a new session.

        Raises:
            InputError: naming the field (``inventory.gpus[1].uuid``...).
        """
        check_inventory(inventory)
        now = self.clock()
        session = secrets.token_hex(8)
        previous = self._nodes.get(inventory.node)
        stored = StoredNode(
            name=inventory.node,
            inventory=inventory,
            session_id=session,
            registered_at_s=now,
            last_heartbeat_s=now,
            state=previous.state if previous is not None else "ready",
            message=previous.message if previous is not None else "",
            applied=previous.applied if previous is not None else {},
        )
        self.store.upsert_node(stored)
        self._nodes[inventory.node] = stored
        self._sessions[inventory.node] = session
        self._heard_from(inventory.node, now)
        self._last_persisted[inventory.node] = now
        old = self._streams.pop(inventory.node, None)
        if old is not None:
            old.queue.put_nowait(None)
        self.log.info(
            "node registered",
            node=inventory.node,
            gpus=len(inventory.gpus),
            simulated=inventory.simulated,
            agent_version=inventory.agent_version,
            rejoined=previous is not None,
        )
        self.wake()
        return RegisterResult(
            inventory.node,
            session,
            self.settings.heartbeat_interval_s,
            self.settings.node_lost_after_s,
            self.store.controller_id(),
        )

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
        if not node:
            raise InputError("node name is empty", field="node")
        if self._sessions.get(node) != session_id:
            return False
        stored = self._nodes.get(node)
        if stored is None:
            return False
        now = self.clock()
        self._heard_from(node, now)
        inventory = None
        if health:
            by_index = {g.index: g for g in stored.inventory.gpus}
            gpus = list(stored.inventory.gpus)
            changed = False
            for index, h in health.items():
                if index not in by_index:
                    raise InputError(f"node {node} has no GPU {index}", field="gpu_health.index")
                if by_index[index].health != h:
                    pos = next(i for i, g in enumerate(gpus) if g.index == index)
                    gpus[pos] = replace(gpus[pos], health=h)
                    changed = True
            if changed:
                inventory = replace(stored.inventory, gpus=tuple(gpus))
                self.log.info(
                    "GPU health changed",
                    node=node,
                    healthy=len(inventory.healthy_gpus()),
                    gpus=len(gpus),
                )
        new_applied = dict(applied) if applied is not None else None
        if new_applied == dict(stored.applied):
            new_applied = None
        persist = now - self._last_persisted.get(node, 0.0) >= self.settings.heartbeat_persist_s
        if (
            inventory is not None
            or new_applied is not None
            or state != stored.state
            or message != stored.message
            or persist
        ):
            self.store.update_node_status(
                node,
                inventory=inventory,
                last_heartbeat_s=now,
                state=state if state != stored.state else None,
                message=message if message != stored.message else None,
                applied=new_applied,
            )
            self._last_persisted[node] = now
            self._nodes[node] = replace(
                stored,
                inventory=inventory or stored.inventory,
                last_heartbeat_s=now,
                state=state,
                message=message,
                applied=new_applied if new_applied is not None else stored.applied,
            )
        if inventory is not None or state != stored.state or node in self._lost:
            self.wake()
        return True

    async def watch_assignments(self, node: str, session_id: str) -> AsyncIterator[AssignmentEvent]:
        """The node's stream: committed parts, an in-flight PREPARE, then new events.

        Raises:
            NotFoundError: unregistered node. PreconditionError: stale session.
        """
        if node not in self._nodes:
            raise NotFoundError(
                f"node {node!r} is not registered. To fix: call Register first", field="node"
            )
        if self._sessions.get(node) != session_id:
            raise PreconditionError(
                "stale session. To fix: call Register again and use its session_id",
                field="session_id",
            )
        old = self._streams.get(node)
        if old is not None:
            old.queue.put_nowait(None)
        stream = _Stream(session_id)
        self._streams[node] = stream
        self._heard_from(node, self.clock())
        try:
            for event in self._snapshot(node):
                yield event
            while True:
                item = await stream.queue.get()
                if item is None:
                    return
                yield item
        finally:
            if self._streams.get(node) is stream:
                del self._streams[node]

    def _snapshot(self, node: str) -> list[AssignmentEvent]:
        events: list[AssignmentEvent] = []
        stored = self._nodes.get(node)
        applied = set(stored.applied) if stored is not None else set()
        with_work: set[str] = set()
        for d in self.store.list_deployments():
            c = self._committed_state(d.name)
            if c is not None and node in c.parts:
                with_work.add(d.name)
                events.append(
                    AssignmentEvent(
                        d.name, c.plan.id, c.version, "commit", len(c.plan.gpus), c.parts[node]
                    )
                )
            r = self._rollouts.get(d.name)
            if r is not None and node in r.parts:
                events.append(self._prepare_event(d.name, r, r.parts[node]))
        for name in sorted(applied - with_work):
            gone = self.store.get_deployment(name, include_deleted=True)
            version = (gone.committed_version or 0) if gone is not None else 0
            events.append(AssignmentEvent(name, "", version, "remove"))
        return events

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
        if node not in self._nodes:
            raise NotFoundError(f"node {node!r} is not registered", field="node")
        if session_id and self._sessions.get(node) != session_id:
            raise PreconditionError(
                "stale session. To fix: call Register again", field="session_id"
            )
        r = self._rollouts.get(deployment)
        c = self._committed.get(deployment)
        if (r is None and c is None) and self.store.get_deployment(
            deployment, include_deleted=True
        ) is None:
            raise NotFoundError(f"no deployment {deployment!r}", field="deployment")
        nodes: Collection[str]
        if r is not None and r.version == version:
            plan_state = "preparing"
            stored_id, nodes = r.plan_id, r.parts
        elif c is not None and c.version == version:  # COMMITTED acks: no store read
            plan_state, stored_id, nodes = "committed", c.plan.id, c.parts
        else:
            stored = self.store.get_plan(deployment, version, with_plan=False)
            if stored is None:
                raise NotFoundError(
                    f"deployment {deployment!r} has no plan version {version}", field="version"
                )
            plan_state, stored_id, nodes = stored.state, stored.plan_id, frozenset(stored.nodes)
        if plan_id and plan_id != stored_id:
            raise PreconditionError(
                f"version {version} of {deployment!r} is plan {stored_id}, not {plan_id}",
                field="plan_id",
            )
        if node not in nodes:
            raise PreconditionError(
                f"node {node} has no part in version {version} of {deployment!r}", field="node"
            )
        if state == "prepared" and plan_state not in ("preparing", "committed"):
            raise PreconditionError(
                f"version {version} of {deployment!r} is {plan_state}; discard the staged part",
                field="version",
            )
        if state == "committed" and plan_state not in ("committed", "superseded"):
            raise PreconditionError(
                f"version {version} of {deployment!r} is {plan_state}, not committed",
                field="version",
            )
        self._heard_from(node, self.clock())  # an ack is as good a sign of life as a heartbeat
        known = self._known_acks(deployment, version)
        duplicate = state in known.get(node, ())
        if not duplicate:
            known.setdefault(node, set()).add(state)
            self._ack_buffer.append(
                StoredAck(deployment, version, node, state, reason, self.clock())
            )
        if r is not None and r.version == version:
            if state == "prepared":
                r.prepared.add(node)
            elif state == "failed":
                r.failed[node] = reason
        self.wake()  # the next tick stores the buffered acks (and commits when all prepared)
        if state == "failed":
            self.log.warning(
                "agent failed", node=node, deployment=deployment, version=version, reason=reason
            )
        return duplicate

    def _known_acks(self, deployment: str, version: int) -> dict[str, set[AckState]]:
        """node -> ack states recorded for a version (stored or buffered), cached for the
        few versions being acked at a time."""
        key = (deployment, version)
        known = self._ack_cache.get(key)
        if known is None:
            self._flush_acks()
            known = {}
            for a in self.store.acks(deployment, version):
                known.setdefault(a.node, set()).add(a.state)
            self._ack_cache[key] = known
            while len(self._ack_cache) > 32:
                self._ack_cache.pop(next(iter(self._ack_cache)))
        return known

    def _flush_acks(self) -> None:
        """Store buffered acks in one transaction. Acks are buffered because a rollout
        brings one per node and phase; an ack lost in a crash before its flush is sent
        again by the agent (a new stream replays the PREPARE, acks are idempotent), and the
        commit point is only reached in a tick, after the flush."""
        if self._ack_buffer:
            batch, self._ack_buffer = self._ack_buffer, []
            self.store.record_acks(batch)

    # ================================================================= PlanService

    def apply_deployment(
        self, spec: DeploymentSpec, *, create_only: bool = False, update_only: bool = False
    ) -> StoredDeployment:
        """Create / update a deployment (the spec was validated by the caller).

        Raises:
            AlreadyExistsError, NotFoundError: see :meth:`Store.put_deployment`.
        """
        check_spec(spec)
        before = self.store.get_deployment(spec.name)
        d = self.store.put_deployment(
            spec, now_s=self.clock(), create_only=create_only, update_only=update_only
        )
        if before is None or before.generation != d.generation:
            self._failures.pop(spec.name, None)
            self._status.pop(spec.name, None)
            self.log.info("deployment applied", deployment=spec.name, generation=d.generation)
            self.wake()
        return d

    def delete_deployment(self, name: str) -> bool:
        """Delete a deployment: abort its rollout, REMOVE its parts from agents."""
        c = self._committed_state(name)
        r = self._rollouts.pop(name, None)
        task = self._solving.pop(name, None)
        if task is not None:
            task.cancel()
        deleted = self.store.delete_deployment(name, now_s=self.clock())
        if not deleted:
            return False
        if r is not None:
            for node in r.parts:
                self._send(node, AssignmentEvent(name, r.plan_id, r.version, "abort"))
        if c is not None:
            for node in c.parts:
                self._send(node, AssignmentEvent(name, c.plan.id, c.version, "remove"))
        self._committed.pop(name, None)
        self._proposed.pop(name, None)
        self._samples.pop(name, None)
        self._failures.pop(name, None)
        self._status.pop(name, None)
        self.log.info("deployment deleted", deployment=name)
        self.wake()
        return True

    def get_deployment(self, name: str) -> StoredDeployment:
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
        self._flush_acks()
        out: dict[str, str] = {}
        for a in self.store.acks(deployment, version):
            out[a.node] = f"failed: {a.reason}" if a.state == "failed" else a.state
        return out

    async def watch_plans(self, deployment: str = "") -> AsyncIterator[StoredPlan]:
        """Latest record of each (matching) deployment, then every change."""
        q: asyncio.Queue[StoredPlan] = asyncio.Queue()
        self._plan_watchers.add(q)
        try:
            names = [deployment] if deployment else [d.name for d in self.store.list_deployments()]
            for name in names:
                latest = self.store.list_plans(name, limit=1)
                if latest:
                    yield latest[0]
            while True:
                item = await q.get()
                if item is _STOP:
                    return
                if not deployment or item.deployment == deployment:
                    yield item
        finally:
            self._plan_watchers.discard(q)

    def node_views(self, only: str | None = None) -> list[NodeView]:
        """Every node (sorted by name), or just the one called ``only`` (none if unknown)."""
        now = self.clock()
        out = []
        if only is not None:
            chosen = [self._nodes[only]] if only in self._nodes else []
        else:
            chosen = sorted(self._nodes.values(), key=lambda n: n.name)
        for n in chosen:
            seen = self._last_seen.get(n.name, n.last_heartbeat_s)
            health: NodeHealth
            silent = now - self._seen(n.name, n.last_heartbeat_s)
            if n.name in self._lost or silent >= self.settings.node_lost_after_s:
                health = "lost"
            elif n.state == "draining":
                health = "draining"
            elif n.state == "degraded" or len(n.inventory.healthy_gpus()) < len(n.inventory.gpus):
                health = "degraded"
            else:
                health = "ready"
            out.append(NodeView(n, health, seen))
        return out

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

    async def watch_routing(self, deployment: str) -> AsyncIterator[StoredPlan]:
        """The committed plan now (when there is one), then each newly committed one."""
        if self.store.get_deployment(deployment) is None:
            raise NotFoundError(f"no deployment {deployment!r}", field="deployment")
        q: asyncio.Queue[StoredPlan] = asyncio.Queue()
        self._routing_watchers.setdefault(deployment, set()).add(q)
        try:
            current = self.store.committed_plan(deployment)
            if current is not None:
                yield current
            while True:
                item = await q.get()
                if item is _STOP:
                    return
                full = self.store.get_plan(deployment, item.version)
                if full is not None:
                    yield full
        finally:
            self._routing_watchers.get(deployment, set()).discard(q)

    def report_load(self, window: LoadWindow) -> None:
        """Store a load window and, in the background, measure the committed plan's
        imbalance under it.

        Raises:
            NotFoundError: unknown deployment. InputError: naming the field (shape, values).
        """
        d = self.store.get_deployment(window.deployment)
        if d is None:
            raise NotFoundError(f"no deployment {window.deployment!r}", field="deployment")
        model = resolve_model(d.spec)
        if not model.is_moe:
            raise InputError(f"{model.name} has no experts", field="deployment")
        if not (math.isfinite(window.start_s) and math.isfinite(window.end_s)) or (
            window.end_s <= window.start_s
        ):
            raise InputError("must be after start_unix_s", field="end_unix_s")
        rows = len(window.counts)
        if rows not in (model.num_moe_layers, model.num_layers):
            raise InputError(
                f"{rows} layers; {model.name} has {model.num_moe_layers} MoE layers "
                f"({model.num_layers} in all)",
                field="num_layers",
            )
        for i, row in enumerate(window.counts):
            if len(row) != model.num_experts:
                raise InputError(
                    f"{len(row)} experts; {model.name} has {model.num_experts}",
                    field="num_experts",
                )
            for j, v in enumerate(row):
                if not math.isfinite(v) or v < 0:
                    raise InputError(
                        f"[{i}][{j}] must be a finite count >= 0, got {v}", field="counts"
                    )
        now = self.clock()
        self.store.add_load_window(window, now_s=now)
        self.store.prune_load_windows(before_s=now - self.settings.load_window_retention_s)
        task = asyncio.create_task(self._measure(d, window, now), name="measure-imbalance")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _measure(self, d: StoredDeployment, window: LoadWindow, at_s: float) -> None:
        c = self._committed_state(d.name)
        if c is None:
            return
        model = resolve_model(d.spec)
        load = aggregate_load([window.counts], model)
        if load is None:
            return
        nodes = list(dict.fromkeys(g.node for g in c.plan.gpus))
        fleet = self.fleet_for(d.name, nodes)
        try:
            workload = workload_for(d.spec, model, measured=load)
            value = await asyncio.to_thread(imbalance_under_load, c.plan, fleet, model, workload)
        except InputError as exc:
            self.log.info("imbalance not measured", deployment=d.name, why=str(exc))
            return
        current = self._committed.get(d.name)
        if current is None or current.version != c.version:
            return
        self.record_imbalance(d.name, at_s, value - c.plan.summary.imbalance)
        self.metrics.observed_imbalance.labels(d.name).set(value)
        status = dict(d.status)
        status["observed_imbalance"] = value
        self.store.set_deployment_status(d.name, status)

    def record_imbalance(self, deployment: str, at_s: float, excess: float) -> None:
        """Add an imbalance sample (measured minus the plan's predicted imbalance)."""
        samples = self._samples.setdefault(
            deployment, deque(maxlen=self.settings.max_imbalance_samples)
        )
        samples.append((at_s, excess))
        self.wake()


_STOP: Any = object()
#: Lateness of a tick beyond ``tick_s`` that still counts as on time, s.
_STALL_TOLERANCE_S = 0.25


def _healthy_gpu_ids(inv: NodeInventory) -> tuple[str, ...]:
    return tuple(f"{inv.node}/gpu{g.index}" for g in inv.healthy_gpus())


def _plan_obs(p: StoredPlan, gpus: tuple[str, ...] = ()) -> rc.PlanObs:
    return rc.PlanObs(
        version=p.version,
        state=p.state,
        inputs_key=p.inputs_key,
        gpus=gpus,
        state_changed_s=p.state_changed_at_s,
        planned_imbalance=float(p.summary.get("imbalance", 0.0)),
    )
