"""What the reconcile loop decides each tick: the deployments whose observation changed and
the ones waiting on a clock - not every deployment.

A tick used to re-read and re-parse every deployment, list its plans and decide it again, so
its cost grew with the number of deployments (at ~1,600 every tick overran). A
:class:`DeploymentViews` keeps each deployment's record and its last
:class:`~controlplane.server.reconcile.DeploymentObs` and rebuilds them only when something
marked the deployment changed (:meth:`mark`: an apply or delete, an action taken on it, an
ack, a finished solve, an imbalance sample, a contingency plan) or when a node the
deployment may use changed how the decision sees it (joined, left, alive, lost, draining,
cordoned, GPU health, labels). Deployments whose decision depends on the clock (a rollout
with a deadline, a retry after a failure or an abort, rebalancing windows) are decided again
every tick from their cached observation, without reading the store.

The controller is the only writer of a SQLite store (one writer per store), so its marks
see every change. A store that other components write (Kubernetes: the operator writes the
plans) is read in full every tick, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from controlplane.server import reconcile as rc
from controlplane.server.controller.common import Context
from controlplane.store import RowHealth, Store, StoredDeployment, StoredPlan
from policies.spec.build import selects

if TYPE_CHECKING:
    from controlplane.server.controller.contingency import Contingencies
    from controlplane.server.controller.loads import Loads
    from controlplane.server.controller.rollout import Rollouts
    from controlplane.server.controller.solves import Solves

#: How the decision sees a node, for change detection: alive, state, cordoned, lost mark,
#: healthy GPUs, labels.
_NodeSig = tuple[bool, str, bool, bool, tuple[str, ...], tuple[tuple[str, str], ...]]


class DeploymentViews:
    """Deployment records and observations, kept up to date by marks (see the module
    docstring).

    Args:
        ctx: the controller's shared dependencies.
        observe_one: builds a deployment's observation from its record.
    """

    def __init__(
        self, ctx: Context, observe_one: Callable[[StoredDeployment], rc.DeploymentObs]
    ) -> None:
        self.ctx = ctx
        self._observe_one = observe_one
        #: Other components write the store: read it in full every tick.
        self.external = ctx.store.plan_author != "controller"
        self._records: dict[str, StoredDeployment] = {}
        self._obs: dict[str, rc.DeploymentObs] = {}
        self._dirty: set[str] = set()
        self._timed: set[str] = set()
        self._loaded = False
        self._node_sigs: dict[str, _NodeSig] = {}
        self._fresh: set[str] = set()  # observed by warm(), not decided yet
        #: Every deployment was observed once (so its committed plan is in memory).
        self.warmed = False

    def mark(self, name: str) -> None:
        """What the decision observes of ``name`` changed: observe and decide it again."""
        self._dirty.add(name)

    def record(self, name: str) -> StoredDeployment | None:
        """The deployment's record as last read (None when unknown or gone)."""
        return self._records.get(name)

    def records(self) -> list[StoredDeployment]:
        """Every live deployment's record as last read."""
        if not self._loaded:
            self.load()
        return list(self._records.values())

    def load(self) -> None:
        """Read every deployment (at start; every tick for a store others write)."""
        self._records = {d.name: d for d in self.ctx.store.list_deployments()}
        self._obs = {k: v for k, v in self._obs.items() if k in self._records}
        self._dirty |= set(self._records)
        self._loaded = True

    def warm(
        self,
        nodes: Sequence[rc.NodeObs] = (),
        now_s: float = 0.0,
        settings: rc.ReconcileSettings | None = None,
    ) -> None:
        """Load and observe every deployment, and take the nodes as they are now as the
        baseline for node changes (before the loop starts; run in a thread). The first tick
        decides every deployment from these observations."""
        if settings is not None:
            self._node_sigs = {n.name: _sig(n, now_s, settings) for n in nodes}
        self.load()
        todo, self._dirty = self._dirty, set()  # marks made meanwhile stay for the next tick
        for name in sorted(todo):
            d = self._records.get(name)
            if d is not None:
                self._obs[name] = self._observe_one(d)
                self._fresh.add(name)
        self.warmed = True

    def all(self) -> tuple[rc.DeploymentObs, ...]:
        """Every deployment's last observation (by name), without refreshing any."""
        if not self._loaded:
            self.warm()
        return tuple(self._obs[n] for n in sorted(self._obs))

    def due(
        self, nodes: Sequence[rc.NodeObs], now_s: float, settings: rc.ReconcileSettings
    ) -> tuple[rc.DeploymentObs, ...]:
        """The deployments to decide now (by name): changed ones observed afresh, and the
        ones waiting on a clock as last observed."""
        first = not self._loaded
        if first or self.external:
            self.load()
        self._mark_node_changes(nodes, now_s, settings)
        dirty, self._dirty = self._dirty, set()
        for name in dirty:
            d = self._records.get(name) if self.external else self.ctx.store.get_deployment(name)
            if d is None:
                self._records.pop(name, None)
                self._obs.pop(name, None)
                self._timed.discard(name)
                continue
            self._records[name] = d
            self._obs[name] = self._observe_one(d)
        self.warmed = self.warmed or first  # every deployment observed once
        fresh, self._fresh = self._fresh, set()
        names = (dirty | self._timed | fresh) & self._obs.keys()
        return tuple(self._obs[n] for n in sorted(names))

    def decided(self, decided: Sequence[rc.DeploymentObs]) -> None:
        """After a tick: remember which of the decided deployments wait on a clock."""
        for d in decided:
            if _waits_on_clock(d):
                self._timed.add(d.name)
            else:
                self._timed.discard(d.name)

    def _mark_node_changes(
        self, nodes: Sequence[rc.NodeObs], now_s: float, settings: rc.ReconcileSettings
    ) -> None:
        """Mark the deployments that may use a node whose signature changed."""
        sigs = {n.name: _sig(n, now_s, settings) for n in nodes}
        if sigs == self._node_sigs:
            return
        labels: list[dict[str, str]] = []
        for name in sigs.keys() | self._node_sigs.keys():
            old, new = self._node_sigs.get(name), sigs.get(name)
            if old != new:
                labels.extend(dict(s[5]) for s in (old, new) if s is not None)
        self._node_sigs = sigs
        for name, d in self._records.items():
            if any(selects(d.spec, lab) for lab in labels):
                self._dirty.add(name)


def _sig(n: rc.NodeObs, now_s: float, settings: rc.ReconcileSettings) -> _NodeSig:
    return (
        rc.alive(n, now_s, settings),
        n.state,
        n.cordoned,
        n.marked_lost,
        n.healthy_gpus,
        tuple(sorted(n.labels.items())),
    )


def _waits_on_clock(d: rc.DeploymentObs) -> bool:
    """Whether the decision of ``d`` can change with time alone: a rollout's deadline, a
    retry after a temporary failure or an abort, rebalancing windows over its samples, a
    solve running."""
    f = d.failure
    return (
        d.rollout is not None
        or d.solving
        or (f is not None and not f.permanent)
        or (d.pending is not None and d.pending.state in ("aborted", "proposed"))
        or (d.spec.rebalance.enabled and bool(d.imbalance_samples))
    )


def quarantine_conditions(store: Store, deployment: str) -> tuple[str, ...]:
    """Conditions of a deployment beside its phase: its quarantined store rows."""
    if not isinstance(store, RowHealth):
        return ()
    mine = [
        q for q in store.quarantined() if q.key == deployment or q.key.startswith(f"{deployment}/")
    ]
    return tuple(f"StoreRowQuarantined: {q.table} {q.key}: {q.error}"[:500] for q in mine)


def status_key(d: StoredDeployment) -> tuple[str, str, tuple[str, ...]]:
    """(phase, message, conditions) of a stored status."""
    st = d.status
    return (
        str(st.get("phase", "")),
        str(st.get("message", "")),
        tuple(str(c) for c in st.get("conditions", ()) or ()),
    )


def observe_deployment(
    store: Store,
    d: StoredDeployment,
    rollouts: Rollouts,
    solves: Solves,
    loads: Loads,
    contingencies: Contingencies,
) -> rc.DeploymentObs:
    """What the decision sees of ``d``: its newest plans (the committed one, a pending one,
    older proposed ones), its rollout, solve, failure, imbalance samples and contingency
    plans, from the store and the controller's parts."""
    committed = None
    pending = None
    older: list[int] = []
    plans = store.list_plans(d.name, limit=5)
    if d.committed_version is not None and all(p.state != "committed" for p in plans):
        row = store.get_plan(d.name, d.committed_version, with_plan=False)
        plans += [row] if row is not None else []  # committed before 5 newer versions
    for p in plans:
        if p.state == "committed" and committed is None:
            c = rollouts.committed_state(d.name, d)
            if c is None:  # its document does not decode (quarantined): plan again
                committed = replace(_plan_obs(p), inputs_key="")
            else:
                committed = _plan_obs(p, tuple(g.gpu for g in c.plan.gpus))
        elif p.state in ("proposed", "aborted") and pending is None and committed is None:
            pending = _plan_obs(p)
        elif p.state == "proposed" and pending is not None:
            older.append(p.version)
    return rc.DeploymentObs(
        spec=d.spec,
        generation=d.generation,
        committed=committed,
        pending=pending,
        rollout=rollouts.observed(d.name),
        solving=solves.solving(d.name),
        failure=solves.failure(d.name),
        imbalance_samples=loads.samples(d.name),
        last_rebalance_s=loads.last_rebalance_s(d.name),
        older_proposed=tuple(older),
        rollout_hold=d.rollout_hold,
        contingency_keys=contingencies.keys(d.name),
        contingencies_for=contingencies.planned_for(d.name),
    )


def _plan_obs(p: StoredPlan, gpus: tuple[str, ...] = ()) -> rc.PlanObs:
    return rc.PlanObs(
        version=p.version,
        state=p.state,
        inputs_key=p.inputs_key,
        gpus=gpus,
        state_changed_s=p.state_changed_at_s,
        planned_imbalance=float(p.summary.get("imbalance", 0.0)),
        nodes=tuple(p.nodes),
    )
