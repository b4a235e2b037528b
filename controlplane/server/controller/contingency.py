"""Contingency plans: what each committed plan becomes when one of its nodes is lost, solved
before it happens.

A node loss used to cost a full solve before the new plan could roll out (tens of seconds
with the ILP), and an expert-parallel group with a lost member serves nothing meanwhile.
:class:`Contingencies` keeps, for every committed plan of a deployment on 2 to
``contingency_max_nodes`` usable nodes, one plan per single-node loss: the same request a
re-solve after that loss would build (the spec, the fleet without the node, migration-aware
from the committed plan, the measured load), solved in the background in its own niced
worker process so it never delays a real solve. When the loss happens, the decision finds the
matching plan by its inputs key and the controller proposes it at once: node loss to
committed plan is a rollout.

Bounds: one background solve at a time, in FIFO order of the deployments' commits; at most
``MAX_READY_PLANS`` plans kept in all (further cases are skipped until plans are used or
dropped); a new committed version drops the old version's plans and queued cases.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from controlplane.server import reconcile as rc
from controlplane.server.controller.common import Context
from controlplane.server.controller.loads import Loads
from controlplane.server.controller.nodes import NodeRegistry
from controlplane.server.controller.rollout import Rollouts
from controlplane.server.solver_pool import SolverPool, background_timeout_s
from policies.errors import InfeasibleError, InputError
from policies.plan import Plan
from policies.spec.build import build_request

#: Contingency plans kept at most, over every deployment.
MAX_READY_PLANS = 512
#: Niceness of the contingency worker (background work yields the CPU).
CONTINGENCY_NICE = 10


class Contingencies:
    """Contingency plans per deployment (see the module docstring).

    Args:
        ctx: the controller's shared dependencies.
        nodes: the node registry (fleets).
        rollouts: the committed plans.
        loads: the measured load a re-solve would use.
    """

    def __init__(self, ctx: Context, nodes: NodeRegistry, rollouts: Rollouts, loads: Loads):
        self.ctx = ctx
        self.nodes = nodes
        self.rollouts = rollouts
        self.loads = loads
        self.pool = SolverPool(ctx.settings.contingency_processes, nice=CONTINGENCY_NICE)
        self._ready: dict[str, dict[str, Plan]] = {}  # deployment -> inputs key -> plan
        self._for: dict[str, int] = {}  # deployment -> committed version planned for
        self._queue: deque[tuple[str, int, rc.Contingency]] = deque()
        self._task: asyncio.Task[None] | None = None

    def keys(self, deployment: str) -> frozenset[str]:
        """Inputs keys with a ready plan."""
        return frozenset(self._ready.get(deployment, ()))

    def planned_for(self, deployment: str) -> int | None:
        """The committed version whose contingencies were planned (None: none)."""
        return self._for.get(deployment)

    def ready_count(self) -> int:
        """Plans kept, over every deployment."""
        return sum(len(p) for p in self._ready.values())

    def start(self, a: rc.PlanContingencies) -> None:
        """Queue the cases of a committed version (dropping the deployment's older ones)."""
        self.forget(a.deployment)
        self._for[a.deployment] = a.version
        self._ready[a.deployment] = {}
        self._queue.extend((a.deployment, a.version, case) for case in a.cases)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="contingency-plans")

    def take(self, deployment: str, key: str) -> Plan | None:
        """The ready plan for ``key`` (removed from the set), or None."""
        return self._ready.get(deployment, {}).pop(key, None)

    def forget(self, deployment: str) -> None:
        """Drop the deployment's plans and queued cases (a new version, or it is gone)."""
        self._ready.pop(deployment, None)
        self._for.pop(deployment, None)
        self._queue = deque(q for q in self._queue if q[0] != deployment)

    def tasks(self) -> list[asyncio.Task[None]]:
        """The background task, while it runs."""
        return [self._task] if self._task is not None and not self._task.done() else []

    def close(self) -> None:
        """Stop the worker (a solve running in it is dropped)."""
        self._queue.clear()
        self.pool.close()

    async def _drain(self) -> None:
        while self._queue:
            name, version, case = self._queue.popleft()
            if self._for.get(name) != version:
                continue
            if self.ready_count() >= MAX_READY_PLANS:
                self.ctx.log.info("contingency plans at their limit", limit=MAX_READY_PLANS)
                self._queue.clear()
                return
            await self._solve_case(name, version, case)

    async def _solve_case(self, name: str, version: int, case: rc.Contingency) -> None:
        """Solve one case as a re-solve after that loss would, and keep the plan."""
        d = self.ctx.store.get_deployment(name)
        committed = self.rollouts.committed_state(name, d) if d is not None else None
        if d is None or committed is None or committed.version != version:
            return
        fleet = self.nodes.fleet_for(name, case.nodes)
        measured = None
        if d.spec.workload.load == "measured":
            since = self.ctx.clock() - max(d.spec.rebalance.sustain_s, 60.0)
            measured = self.loads.measured(d.spec, since)
        log = self.ctx.log.bind(deployment=name, version=version, lost_node=case.lost_node)
        t0 = time.perf_counter()
        try:
            request = await asyncio.to_thread(
                build_request, d.spec, fleet, previous=committed.plan, measured=measured
            )
            result = await self.pool.solve(
                request, timeout_s=background_timeout_s(d.spec.solver_time_limit_s)
            )
        except (InputError, InfeasibleError) as exc:
            log.info("no contingency plan", why=str(exc)[:300])
            return
        except Exception:  # a background solve must never stop the queue
            log.exception("contingency solve failed")
            return
        if self._for.get(name) != version or result.infeasible:
            return
        self._ready.setdefault(name, {})[case.inputs_key] = result.plan
        log.info("contingency plan ready", solve_s=round(time.perf_counter() - t0, 3))
        self.ctx.changed(name)
