"""Placement solves: started by the reconcile loop, run in the solver pool.

:class:`Solves` owns the solver pool, the solve task running per deployment and the last
failure per deployment (which the decision reads to wait before retrying). A finished solve
stores the plan as the deployment's next version (``proposed``) and hands its node parts to
the rollout; a dry run (PlanService.Solve) stores nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from controlplane.errors import PreconditionError, StoreError
from controlplane.server import reconcile as rc
from controlplane.server.controller.common import Context
from controlplane.server.controller.contingency import Contingencies
from controlplane.server.controller.loads import Loads
from controlplane.server.controller.nodes import NodeRegistry, reachable_or_precondition
from controlplane.server.controller.rollout import Rollouts
from controlplane.server.controller.watchers import Watchers
from controlplane.server.solver_pool import SolverPool, background_timeout_s
from controlplane.store import StoredDeployment, StoredPlan
from policies.assignment import NodePart, split_plan
from policies.errors import InfeasibleError, InputError
from policies.hardware.fleet import Fleet
from policies.plan import Plan
from policies.request import PlacementResult
from policies.spec.build import DeploymentSpec, build_request, check_spec


class Solves:
    """The solver pool, running solves and solve failures (see the module docstring).

    Args:
        ctx: the controller's shared dependencies.
        nodes: the node registry (fleets, GPU UUIDs).
        rollouts: takes each proposed plan's node parts; gives the committed plan a
            migration-aware solve starts from.
        loads: measured load; records when rebalancing solves start.
        watchers: told about each proposed plan.
        contingencies: plans solved in advance for single-node losses.
    """

    def __init__(
        self,
        ctx: Context,
        nodes: NodeRegistry,
        rollouts: Rollouts,
        loads: Loads,
        watchers: Watchers,
        contingencies: Contingencies | None = None,
    ) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self.rollouts = rollouts
        self.loads = loads
        self.watchers = watchers
        self.contingencies = contingencies
        self.solver = SolverPool(ctx.settings.solver_processes)
        self._solving: dict[str, asyncio.Task[None]] = {}
        self._failures: dict[str, rc.FailureObs] = {}

    def solving(self, deployment: str) -> bool:
        """Whether a solve of the deployment is running."""
        return deployment in self._solving

    def failure(self, deployment: str) -> rc.FailureObs | None:
        """The deployment's last solve failure (cleared by a success or a new spec)."""
        return self._failures.get(deployment)

    def forget_failure(self, deployment: str) -> None:
        """Drop the deployment's solve failure (its spec changed, or it is gone)."""
        self._failures.pop(deployment, None)

    def cancel(self, deployment: str) -> None:
        """Cancel the deployment's running solve, if any."""
        task = self._solving.pop(deployment, None)
        if task is not None:
            task.cancel()

    def tasks(self) -> list[asyncio.Task[None]]:
        """The running solve tasks."""
        return list(self._solving.values())

    def start(self, a: rc.Solve) -> None:
        """Start the solve the decision asked for, as a task of the event loop.

        Raises:
            PreconditionError: another component decides the plans on this store.
        """
        store = self.ctx.store
        if store.plan_author != "controller":
            raise PreconditionError(
                f"the {store.plan_author} decides the plans of {a.deployment!r} on this "
                "store; the controller only rolls them out",
                field="deployment",
            )
        d = store.get_deployment(a.deployment)
        if d is None:
            return
        committed = self.rollouts.committed_state(a.deployment) if a.previous_version else None
        previous = committed.plan if committed is not None else None
        measured = None
        if a.rebalance or d.spec.workload.load == "measured":
            since = self.ctx.clock() - max(d.spec.rebalance.sustain_s, 60.0)
            measured = self.loads.measured(d.spec, since)
        fleet = self.nodes.fleet_for(a.deployment, a.nodes)
        log = self.ctx.log.bind(deployment=a.deployment, reason=a.reason)
        if a.rebalance:
            self.loads.rebalanced(a.deployment, self.ctx.clock())
        ready = None
        if a.contingency and self.contingencies is not None:
            ready = self.contingencies.take(a.deployment, a.inputs_key)
        if ready is not None:
            log.info("contingency plan proposed", gpus=len(ready.gpus))
            work = self._adopt(d, ready, a)
        else:
            log.info("solve started", gpus=len(fleet.gpus), migration_aware=previous is not None)
            work = self._solve(d, fleet, previous, measured, a)
        self._solving[a.deployment] = asyncio.create_task(work, name=f"solve-{a.deployment}")

    async def _adopt(self, d: StoredDeployment, plan: Plan, a: rc.Solve) -> None:
        """Propose a plan solved in advance (a contingency) as if it had just been solved."""
        try:
            await self._propose(d, plan, a, 0.0)
        finally:
            self._solving.pop(d.name, None)
            self.ctx.changed(d.name)

    async def _solve(
        self,
        d: StoredDeployment,
        fleet: Fleet,
        previous: Plan | None,
        measured: list[list[float]] | None,
        a: rc.Solve,
    ) -> None:
        name = d.name
        log = self.ctx.log.bind(deployment=name)
        t0 = time.perf_counter()
        try:
            result = await self._run_solver(d, fleet, previous, measured, a)
            if result is None:
                return
            elapsed = time.perf_counter() - t0
            self.ctx.metrics.solve_seconds.labels(name, d.spec.policy).observe(elapsed)
            if result.infeasible:
                msg = "infeasible: " + "; ".join(result.infeasible[:5])
                self._failures[name] = rc.FailureObs(a.inputs_key, self.ctx.clock(), msg, True)
                self.ctx.metrics.solve_failures.labels(name, "infeasible").inc()
                log.warning("solve infeasible", reasons=list(result.infeasible[:5]))
                return
            await self._propose(d, result.plan, a, elapsed)
        finally:
            self._solving.pop(name, None)
            self.ctx.changed(name)

    async def _propose(self, d: StoredDeployment, plan: Plan, a: rc.Solve, elapsed: float) -> None:
        """Store a solved plan as the deployment's next version and hand it to the rollout
        (dropped when the spec changed meanwhile)."""
        name = d.name
        log = self.ctx.log.bind(deployment=name)
        current = self.ctx.store.get_deployment(name)
        if current is None or current.generation != d.generation:
            log.info("solve discarded: the deployment changed meanwhile")
            return
        self._failures.pop(name, None)
        # Storing serialises the whole plan and splitting builds every node's part: both
        # grow with the fleet (about a second at 2,000 GPUs), so they run in a thread.
        try:
            stored, parts = await asyncio.to_thread(
                self._persist, name, plan, a, self.nodes.uuids(plan), self.ctx.clock()
            )
        except StoreError as exc:  # recorded: retried after a pause, not at once in a loop
            msg = f"cannot store the plan: {exc}"
            self._failures[name] = rc.FailureObs(a.inputs_key, self.ctx.clock(), msg, False)
            self.ctx.metrics.solve_failures.labels(name, "temporary").inc()
            log.error("plan not stored", error=str(exc))
            return
        assert stored.plan is not None
        self.rollouts.propose(name, stored.version, stored.plan, parts)
        s = plan.summary
        log.info(
            "plan proposed",
            version=stored.version,
            plan_id=stored.plan_id,
            step_time_us=round(s.step_time_us, 1),
            imbalance=round(s.imbalance, 4),
            expert_moves=s.expert_moves,
            solve_s=round(elapsed, 3),
            solved_in_advance=a.contingency and elapsed == 0.0,
        )
        self.watchers.emit(stored)

    async def _run_solver(
        self,
        d: StoredDeployment,
        fleet: Fleet,
        previous: Plan | None,
        measured: list[list[float]] | None,
        a: rc.Solve,
    ) -> PlacementResult | None:
        """Build the request and solve it; None (the failure recorded) when that raised."""
        name = d.name
        log = self.ctx.log.bind(deployment=name)
        try:
            # Expanding the fleet and parsing the model grow with the input: off the loop.
            request = await asyncio.to_thread(
                build_request, d.spec, fleet, previous=previous, measured=measured
            )
            return await self.solver.solve(request)
        except (InputError, InfeasibleError) as exc:
            self._failures[name] = rc.FailureObs(a.inputs_key, self.ctx.clock(), str(exc), True)
            self.ctx.metrics.solve_failures.labels(name, "permanent").inc()
            log.warning("solve failed", error=str(exc), permanent=True)
            return None
        except Exception as exc:
            self._failures[name] = rc.FailureObs(
                a.inputs_key, self.ctx.clock(), f"solver error: {exc}", False
            )
            self.ctx.metrics.solve_failures.labels(name, "temporary").inc()
            log.exception("solve failed", permanent=False)
            return None

    def _persist(
        self, deployment: str, plan: Plan, a: rc.Solve, uuids: Mapping[str, str], now_s: float
    ) -> tuple[StoredPlan, dict[str, NodePart]]:
        """Store a solved plan as the next version and split it into node parts (run in a
        thread: see :meth:`_solve`). The plan's document is built once for both."""
        doc = plan.to_dict()
        stored = self.ctx.store.add_plan(
            deployment, plan, reason=a.reason, inputs_key=a.inputs_key, now_s=now_s, document=doc
        )
        assert stored.plan is not None
        doc["version"] = stored.version
        return stored, split_plan(stored.plan, deployment, uuids, document=doc)

    async def dry_run(
        self, spec: DeploymentSpec, fleet: Fleet | None, observe: Callable[[], rc.Observed]
    ) -> PlacementResult:
        """Solve ``spec`` without storing anything (PlanService.Solve); without a ``fleet``,
        on the usable nodes of ``observe()``.

        Raises:
            InputError: bad spec. PreconditionError: no usable node matches, or the solve
            ran over twice its time limit and 30 s. InfeasibleError: the model cannot fit.
        """
        await asyncio.to_thread(check_spec, spec)
        if fleet is None:
            obs = observe()
            nodes, _ = rc.usable_gpus(
                spec, obs.nodes, obs.now_s, self.ctx.settings.reconcile_settings()
            )
            fleet = self.nodes.fleet_for(spec.name, nodes)
        if not fleet.gpus:
            raise PreconditionError(
                "no usable node matches the node selector. To fix: start agents on matching "
                "nodes or change spec.node_selector",
                field="spec.node_selector",
            )
        reachable_or_precondition(fleet)
        measured = self.loads.measured(spec, self.ctx.clock() - 3600.0)
        request = await asyncio.to_thread(build_request, spec, fleet, measured=measured)
        # A dry run is a viewer's question: it runs in the background pool (niced; never
        # in the way of a re-plan) and is stopped after twice its time limit and 30 s.
        pool = self.contingencies.pool if self.contingencies is not None else self.solver
        return await pool.solve(request, timeout_s=background_timeout_s(spec.solver_time_limit_s))
