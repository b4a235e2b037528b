"""Measured expert load and the imbalance it causes.

:class:`Loads` owns what the rebalancing decision reads: the load windows engines report
(stored, pruned after ``load_window_retention_s``), the imbalance samples per deployment
(the committed plan's imbalance under each window minus its predicted imbalance, measured
in the background), and when each deployment was last rebalanced.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque

from controlplane.errors import NotFoundError
from controlplane.server.controller.common import Context
from controlplane.server.controller.nodes import NodeRegistry
from controlplane.server.controller.rollout import Rollouts
from controlplane.store import LoadWindow, StoredDeployment
from policies.assignment import aggregate_load, imbalance_under_load
from policies.errors import InputError
from policies.model.architecture import ModelSpec
from policies.spec.build import DeploymentSpec, resolve_model, workload_for


class Loads:
    """Load windows, imbalance samples and rebalance timing (see the module docstring).

    Args:
        ctx: the controller's shared dependencies.
        nodes: the node registry (the fleet a committed plan runs on).
        rollouts: the committed plans.
    """

    def __init__(self, ctx: Context, nodes: NodeRegistry, rollouts: Rollouts) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self.rollouts = rollouts
        self._samples: dict[str, deque[tuple[float, float]]] = {}
        self._last_rebalance: dict[str, float] = {}
        self._background: set[asyncio.Task[None]] = set()

    def samples(self, deployment: str) -> tuple[tuple[float, float], ...]:
        """(Unix s, excess imbalance) samples since the committed plan was committed."""
        return tuple(self._samples.get(deployment, ()))

    def last_rebalance_s(self, deployment: str) -> float | None:
        """When a rebalancing solve of the deployment last started, Unix s."""
        return self._last_rebalance.get(deployment)

    def rebalanced(self, deployment: str, at_s: float) -> None:
        """Record that a rebalancing solve started at ``at_s`` (Unix s)."""
        self._last_rebalance[deployment] = at_s

    def forget_samples(self, deployment: str) -> None:
        """Drop the samples (a new plan was committed, or the deployment is gone)."""
        self._samples.pop(deployment, None)

    def background_tasks(self) -> list[asyncio.Task[None]]:
        """Imbalance measurements still running."""
        return list(self._background)

    def measured(self, spec: DeploymentSpec, since_s: float) -> list[list[float]] | None:
        """Per-layer expert load reported since ``since_s`` (Unix s), or None without any."""
        windows = self.ctx.store.load_windows(spec.name, since_s=since_s)
        if not windows:
            return None
        return aggregate_load([w.counts for w in windows], resolve_model(spec))

    def report_load(self, window: LoadWindow) -> None:
        """Store a load window and, in the background, measure the committed plan's
        imbalance under it.

        Raises:
            NotFoundError: unknown deployment. InputError: naming the field (shape, values).
        """
        store = self.ctx.store
        d = store.get_deployment(window.deployment)
        if d is None:
            raise NotFoundError(f"no deployment {window.deployment!r}", field="deployment")
        _check_window(window, resolve_model(d.spec))
        now = self.ctx.clock()
        store.add_load_window(window, now_s=now)
        store.prune_load_windows(before_s=now - self.ctx.settings.load_window_retention_s)
        task = asyncio.create_task(self._measure(d, window, now), name="measure-imbalance")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _measure(self, d: StoredDeployment, window: LoadWindow, at_s: float) -> None:
        c = self.rollouts.committed_state(d.name)
        if c is None:
            return
        model = resolve_model(d.spec)
        load = aggregate_load([window.counts], model)
        if load is None:
            return
        nodes = list(dict.fromkeys(g.node for g in c.plan.gpus))
        fleet = self.nodes.fleet_for(d.name, nodes)
        try:
            workload = workload_for(d.spec, model, measured=load)
            value = await asyncio.to_thread(imbalance_under_load, c.plan, fleet, model, workload)
        except InputError as exc:
            self.ctx.log.info("imbalance not measured", deployment=d.name, why=str(exc))
            return
        current = self.rollouts.committed_cached(d.name)
        if current is None or current.version != c.version:
            return
        self.record_imbalance(d.name, at_s, value - c.plan.summary.imbalance)
        self.ctx.metrics.observed_imbalance.labels(d.name).set(value)
        status = dict(d.status)
        status["observed_imbalance"] = value
        self.ctx.store.set_deployment_status(d.name, status)

    def record_imbalance(self, deployment: str, at_s: float, excess: float) -> None:
        """Add an imbalance sample (measured minus the plan's predicted imbalance) taken at
        ``at_s`` (Unix s)."""
        samples = self._samples.setdefault(
            deployment, deque(maxlen=self.ctx.settings.max_imbalance_samples)
        )
        samples.append((at_s, excess))
        self.ctx.changed(deployment)


def _check_window(window: LoadWindow, model: ModelSpec) -> None:
    """Check a load window against the deployment's model.

    Raises:
        InputError: naming the field (a dense model, times, shape, values).
    """
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
                raise InputError(f"[{i}][{j}] must be a finite count >= 0, got {v}", field="counts")
