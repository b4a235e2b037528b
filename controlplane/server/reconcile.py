"""The controller's decision, as a pure function: :func:`reconcile` maps what the controller
observed (nodes, deployments, plans, rollouts, measured imbalance) and the time to the
actions to take now. The controller (:mod:`controlplane.server.controller`) gathers the
observation, calls this, and carries out the actions; tests call it with hand-built
observations and an explicit clock.

Per deployment, in order (the first rule that applies wins):

1. A solve is running -> wait.
2. A rollout is in progress -> abort it if a node acked FAILED, a target node is lost, or
   the prepare deadline passed; commit it when every target acked PREPARED; else wait.
3. A proposed (solved, not rolled out) version exists -> roll it out when it was solved for
   the current inputs, else abort it ("inputs changed before rollout").
4. No usable node matches -> report it (no action).
5. The committed plan was made for other inputs (new or changed spec, node joined, node
   lost, GPU health changed) -> solve, unless the same inputs already failed permanently
   (bad spec, infeasible: fix the spec) or a retry is not due yet (after an abort or a
   temporary failure). When a contingency plan was solved in advance for exactly these
   inputs (one node of the committed plan's fleet lost) it is proposed at once instead
   (``Solve(contingency=True)``): node loss to committed plan is then a rollout, not a
   solve.
6. Rebalancing is on and the measured imbalance has exceeded the plan's own predicted
   imbalance by more than the threshold for ``sustain_s`` -> solve migration-aware from the
   committed plan with the measured load (at most once per ``min_interval_s``).
7. Otherwise the deployment is ready; when contingencies are on and none were planned for
   the committed version yet, plan them: one solve per usable node, for the fleet without
   it (:class:`PlanContingencies`, run in the background at low priority).

In Kubernetes mode (``ReconcileSettings.solves`` False) the operator owns every plan
decision and rules 3-7 become :func:`_external`: roll out the operator's newest proposed
plan once its nodes are usable, never solve.

"Inputs" are the spec generation and the set of usable GPUs (alive, not draining, not
cordoned, healthy, on nodes matching the node selector); :func:`inputs_key` fingerprints them.
With the fleet scheduler (``Observed.assigned``, standalone mode) a deployment's usable GPUs
are only those on the nodes it assigns it, and rule 4 reports the scheduler's Pending reason.

A call may pass any subset of the deployments (the controller passes the ones whose
observation changed and the ones waiting on a clock): each deployment's decision depends on
its own observation, the nodes and the time only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from policies.spec.build import DeploymentSpec, selects


@dataclass(frozen=True)
class ReconcileSettings:
    """Timing of the decisions.

    Attributes:
        node_lost_after_s: a node silent this long is lost, s.
        retry_after_abort_s: wait this long after an aborted rollout before solving the
            same inputs again, s.
        retry_after_error_s: wait this long after a temporary solve failure, s.
        solves: the controller decides plans (standalone, SQLite store). False in
            Kubernetes mode, where the operator alone solves and writes PartitionPlans:
            the decision then never asks for a Solve and rolls out the operator's newest
            proposed plan (:func:`_external`).
        contingency_max_nodes: plan contingencies (rule 7) for deployments whose fleet has
            2 to this many usable nodes; 0 = never.
    """

    node_lost_after_s: float = 15.0
    retry_after_abort_s: float = 30.0
    retry_after_error_s: float = 30.0
    solves: bool = True
    contingency_max_nodes: int = 0


@dataclass(frozen=True)
class NodeObs:
    """A node as observed.

    Attributes:
        last_seen_s: last heartbeat or registration (controller clock), s.
        state: ``ready`` | ``draining`` | ``degraded`` (from the agent).
        healthy_gpus: GPU ids (``node/gpuN``) whose health is good.
        marked_lost: the controller currently treats the node as lost.
        cordoned: an administrator cordoned it (``GPUNode.spec.cordon``): no rollout onto it.
    """

    name: str
    labels: Mapping[str, str]
    last_seen_s: float
    state: str = "ready"
    healthy_gpus: tuple[str, ...] = ()
    marked_lost: bool = False
    cordoned: bool = False


@dataclass(frozen=True)
class PlanObs:
    """A stored plan version as the decision needs it."""

    version: int
    state: str
    inputs_key: str
    gpus: tuple[str, ...] = ()
    state_changed_s: float = 0.0
    planned_imbalance: float = 0.0
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class RolloutObs:
    """A rollout in progress.

    Attributes:
        targets: nodes that must ack PREPARED.
        prepared: nodes that did.
        failed: node -> reason of a FAILED ack.
    """

    version: int
    deadline_s: float
    targets: tuple[str, ...]
    prepared: frozenset[str] = frozenset()
    failed: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FailureObs:
    """The last failed solve of a deployment.

    Attributes:
        permanent: bad spec or infeasible; not retried until the inputs change.
    """

    inputs_key: str
    at_s: float
    message: str
    permanent: bool


@dataclass(frozen=True)
class DeploymentObs:
    """A deployment and what the controller knows of its plans.

    Attributes:
        committed: the committed version (None before the first commit).
        pending: the newest version above the committed one that is proposed or aborted
            (None when there is none).
        imbalance_samples: ``(time_s, measured - planned imbalance)`` of the committed plan,
            oldest first.
        last_rebalance_s: when the last rebalance solve started.
        older_proposed: proposed versions below ``pending`` (a newer plan replaced them
            before their rollout started).
        rollout_hold: why the plans' decision maker (the Kubernetes operator) holds every
            rollout of this deployment now (it cannot plan the current inputs); empty: none.
        contingency_keys: inputs keys for which a contingency plan of the committed version
            is solved and ready.
        contingencies_for: the committed version contingencies were planned for (None: not
            planned).
    """

    spec: DeploymentSpec
    generation: int
    committed: PlanObs | None = None
    pending: PlanObs | None = None
    rollout: RolloutObs | None = None
    solving: bool = False
    failure: FailureObs | None = None
    imbalance_samples: tuple[tuple[float, float], ...] = ()
    last_rebalance_s: float | None = None
    older_proposed: tuple[int, ...] = ()
    rollout_hold: str = ""
    contingency_keys: frozenset[str] = frozenset()
    contingencies_for: int | None = None

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class Observed:
    """What one decision sees.

    Attributes:
        assigned: the fleet scheduler's nodes per deployment (:mod:`policies.scheduling`):
            a deployment uses only its own (absent: none); None = every usable node
            matching its selector (no scheduler).
        unscheduled: deployment -> why the scheduler gives it no node (its Pending reason).
    """

    now_s: float
    nodes: tuple[NodeObs, ...]
    deployments: tuple[DeploymentObs, ...]
    assigned: Mapping[str, tuple[str, ...]] | None = None
    unscheduled: Mapping[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class SetNodeLost:
    """Mark a node lost (``lost=True``) or back (``lost=False``)."""

    node: str
    lost: bool
    reason: str


@dataclass(frozen=True)
class Solve:
    """Solve the deployment on ``gpus``; ``previous_version`` makes the ILP migration-aware;
    ``rebalance`` plans for the measured load; ``contingency``: propose the contingency plan
    solved in advance for ``inputs_key`` (solve as usual when it is gone)."""

    deployment: str
    reason: str
    inputs_key: str
    nodes: tuple[str, ...]
    previous_version: int | None
    rebalance: bool = False
    contingency: bool = False


@dataclass(frozen=True)
class Contingency:
    """One single-node loss to plan for: the fleet without ``lost_node``."""

    lost_node: str
    inputs_key: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class PlanContingencies:
    """Solve, in the background, a plan for each single-node loss of the committed
    ``version``'s fleet (migration-aware from it)."""

    deployment: str
    version: int
    cases: tuple[Contingency, ...]


@dataclass(frozen=True)
class StartRollout:
    deployment: str
    version: int


@dataclass(frozen=True)
class Commit:
    deployment: str
    version: int


@dataclass(frozen=True)
class Abort:
    deployment: str
    version: int
    reason: str


@dataclass(frozen=True)
class SetStatus:
    """The deployment's phase (``pending`` | ``planning`` | ``rolling_out`` | ``ready`` |
    ``degraded`` | ``failed``) and message, rebuilt every tick."""

    deployment: str
    phase: str
    message: str


Action = SetNodeLost | Solve | StartRollout | Commit | Abort | SetStatus | PlanContingencies


# ---------------------------------------------------------------------------- decision


def alive(node: NodeObs, now_s: float, settings: ReconcileSettings) -> bool:
    return now_s - node.last_seen_s < settings.node_lost_after_s


def usable_gpus(
    spec: DeploymentSpec, nodes: Sequence[NodeObs], now_s: float, settings: ReconcileSettings
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(nodes, gpu ids)`` a deployment may use now, both sorted by node name."""
    use = [
        n
        for n in sorted(nodes, key=lambda n: n.name)
        if alive(n, now_s, settings)
        and n.state != "draining"
        and not n.cordoned
        and n.healthy_gpus
        and selects(spec, n.labels)
    ]
    return tuple(n.name for n in use), tuple(g for n in use for g in n.healthy_gpus)


def inputs_key(generation: int, gpus: Sequence[str]) -> str:
    """Fingerprint of what a plan is solved for: spec generation and usable GPUs."""
    digest = hashlib.sha256("\n".join(gpus).encode()).hexdigest()[:16]
    return f"g{generation}:{digest}"


def _node_of(gpu: str) -> str:
    return gpu.rsplit("/", 1)[0]


def explain(
    d: DeploymentObs,
    gpus: Sequence[str],
    nodes: Sequence[NodeObs],
    now_s: float,
    settings: ReconcileSettings,
) -> str:
    """Why the committed plan no longer fits: the first reasons, in words."""
    c = d.committed
    if c is None:
        return "deployment created"
    if not c.inputs_key:
        return f"committed plan v{c.version} cannot be read from the store"
    if not c.inputs_key.startswith(f"g{d.generation}:"):
        return f"deployment spec changed (generation {d.generation})"
    by_name = {n.name: n for n in nodes}
    before = set(c.gpus)
    now = set(gpus)
    reasons: list[str] = []
    for node in sorted({_node_of(g) for g in before - now}):
        n = by_name.get(node)
        if n is None or not alive(n, now_s, settings):
            reasons.append(f"node {node} lost")
        elif n.state == "draining":
            reasons.append(f"node {node} draining")
        else:
            reasons.append(f"GPU health changed on {node}")
    old_nodes = {_node_of(g) for g in before}
    for node in sorted({_node_of(g) for g in now - before}):
        reasons.append(f"node {node} joined" if node not in old_nodes else f"GPUs back on {node}")
    return ", ".join(reasons) or "fleet changed"


def _sustained(
    samples: Sequence[tuple[float, float]], threshold: float, sustain_s: float, now_s: float
) -> float | None:
    """The mean excess imbalance when every sample of the last ``sustain_s`` exceeded the
    threshold and they span at least ``sustain_s``; else None."""
    if not samples:
        return None
    run: list[tuple[float, float]] = []
    for t, v in samples:
        run = [*run, (t, v)] if v > threshold else []
    if not run:
        return None
    if now_s - run[0][0] < sustain_s or now_s - run[-1][0] > max(sustain_s, 1.0) * 2:
        return None
    return sum(v for _, v in run) / len(run)


def reconcile(
    observed: Observed, settings: ReconcileSettings = ReconcileSettings()
) -> list[Action]:
    """Decide what to do now (see the module docstring for the rules).

    Args:
        observed: nodes and deployments as observed at ``observed.now_s``; the deployments
            are the desired state (their specs) joined with what was observed of them.
        settings: timing.

    Returns:
        Actions in the order to apply them: node liveness first, then per deployment at
        most one of Solve / StartRollout / Commit / Abort, and a SetStatus for each.
    """
    now = observed.now_s
    actions: list[Action] = []
    for n in observed.nodes:
        up = alive(n, now, settings)
        if n.marked_lost and up:
            actions.append(SetNodeLost(n.name, False, "heartbeats resumed"))
        elif not n.marked_lost and not up:
            silent = now - n.last_seen_s
            actions.append(SetNodeLost(n.name, True, f"no heartbeat for {silent:.0f} s"))
    usable = _UsableMemo(observed, settings)
    for d in observed.deployments:
        actions.extend(_deployment(d, observed, settings, usable))
    return actions


class _UsableMemo:
    """:func:`usable_gpus` once per distinct node selector of one decision (deployments
    share selectors; the nodes and the time are the same for all of them)."""

    def __init__(self, o: Observed, s: ReconcileSettings) -> None:
        self.o, self.s = o, s
        self._by_selector: dict[tuple[tuple[str, str], ...], tuple[tuple[str, ...], ...]] = {}

    def __call__(self, spec: DeploymentSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
        key = tuple(sorted(spec.node_selector.items()))
        hit = self._by_selector.get(key)
        if hit is None:
            hit = usable_gpus(spec, self.o.nodes, self.o.now_s, self.s)
            self._by_selector[key] = hit
        if self.o.assigned is not None:  # the fleet scheduler's share only
            mine = set(self.o.assigned.get(spec.name, ()))
            nodes = tuple(n for n in hit[0] if n in mine)
            return nodes, tuple(g for g in hit[1] if _node_of(g) in mine)
        return hit[0], hit[1]


def _deployment(
    d: DeploymentObs, o: Observed, s: ReconcileSettings, usable: _UsableMemo
) -> list[Action]:
    now = o.now_s
    name = d.name
    status = SetStatus(name, "ready", "")
    if d.solving:
        return [SetStatus(name, "planning", "solving")]
    if d.rollout is not None:
        return _rollout(name, d.rollout, o, s)
    if not s.solves:
        return _external(d, o, s, usable)
    nodes, gpus = usable(d.spec)
    key = inputs_key(d.generation, gpus)
    p = d.pending
    if p is not None and p.state == "proposed":
        if p.inputs_key == key:
            return [StartRollout(name, p.version), SetStatus(name, "rolling_out", f"v{p.version}")]
        return [
            Abort(name, p.version, "inputs changed before rollout"),
            SetStatus(name, "planning", "inputs changed"),
        ]
    if not nodes:
        phase = "degraded" if d.committed is not None else "pending"
        why = o.unscheduled.get(name) or "no usable node matches the node selector"
        return [SetStatus(name, phase, why)]
    c = d.committed
    if c is None or c.inputs_key != key:
        f = d.failure
        if f is not None and f.inputs_key == key:
            if f.permanent:
                return [SetStatus(name, "failed", f.message)]
            if now - f.at_s < s.retry_after_error_s:
                return [SetStatus(name, "degraded", f"{f.message}; retrying")]
        if (
            p is not None
            and p.state == "aborted"
            and p.inputs_key == key
            and now - p.state_changed_s < s.retry_after_abort_s
        ):
            phase = "degraded" if c is not None else "pending"
            return [SetStatus(name, phase, f"v{p.version} aborted; retrying")]
        reason = explain(d, gpus, o.nodes, now, s)
        previous = c.version if c is not None else None
        if c is not None and key in d.contingency_keys:
            advance = f"{reason} (plan solved in advance)"
            return [
                Solve(name, advance, key, nodes, previous, contingency=True),
                SetStatus(name, "planning", advance),
            ]
        return [Solve(name, reason, key, nodes, previous), SetStatus(name, "planning", reason)]
    rb = d.spec.rebalance
    if rb.enabled and (d.last_rebalance_s is None or now - d.last_rebalance_s >= rb.min_interval_s):
        excess = _sustained(d.imbalance_samples, rb.imbalance_threshold, rb.sustain_s, now)
        if excess is not None:
            reason = (
                f"load imbalance {excess:+.2f} over plan above {rb.imbalance_threshold:.2f} "
                f"for {rb.sustain_s:.0f} s"
            )
            return [
                Solve(name, reason, key, nodes, c.version, rebalance=True),
                SetStatus(name, "planning", reason),
            ]
    if (
        s.contingency_max_nodes
        and d.contingencies_for != c.version
        and 2 <= len(nodes) <= s.contingency_max_nodes
    ):
        cases = tuple(
            Contingency(
                lost,
                inputs_key(d.generation, [g for g in gpus if _node_of(g) != lost]),
                tuple(n for n in nodes if n != lost),
            )
            for lost in nodes
        )
        return [PlanContingencies(name, c.version, cases), status]
    return [status]


def _rollout(name: str, r: RolloutObs, o: Observed, s: ReconcileSettings) -> list[Action]:
    """Rule 2: abort a rollout on a FAILED ack, a lost target or a passed deadline; commit
    it when every target prepared; else wait."""
    now = o.now_s
    by_name = {n.name: n for n in o.nodes}
    lost = [t for t in r.targets if t not in by_name or not alive(by_name[t], now, s)]
    if r.failed:
        node, why = sorted(r.failed.items())[0]
        return [
            Abort(name, r.version, f"node {node} failed to prepare: {why}"),
            SetStatus(name, "degraded", f"rollout of v{r.version} aborted"),
        ]
    if lost:
        return [
            Abort(name, r.version, f"node {', '.join(lost)} lost during rollout"),
            SetStatus(name, "degraded", f"rollout of v{r.version} aborted"),
        ]
    missing = [t for t in r.targets if t not in r.prepared]
    if not missing:
        return [Commit(name, r.version), SetStatus(name, "ready", "")]
    if now >= r.deadline_s:
        return [
            Abort(name, r.version, f"prepare timed out; no ack from {', '.join(missing[:5])}"),
            SetStatus(name, "degraded", f"rollout of v{r.version} timed out"),
        ]
    return [
        SetStatus(name, "rolling_out", f"v{r.version}: {len(r.prepared)}/{len(r.targets)} prepared")
    ]


def _external(
    d: DeploymentObs, o: Observed, s: ReconcileSettings, usable_of: _UsableMemo
) -> list[Action]:
    """Rules 3-7 when another component (the Kubernetes operator) decides the plans: the
    controller only rolls them out. The newest proposed version is rolled out when every
    node it targets is usable (alive, not draining, not cordoned) and the operator holds no
    rollout (``rollout_hold``: it reports the current inputs cannot be planned); older
    proposed versions are aborted as replaced; nothing is
    ever solved here - a lost node or a changed spec waits for the operator's next plan."""
    name = d.name
    aborts: list[Action] = [
        Abort(name, v, f"replaced by v{d.pending.version} before its rollout")
        for v in d.older_proposed
        if d.pending is not None
    ]
    nodes, gpus = usable_of(d.spec)
    usable = set(gpus)
    p = d.pending
    if p is not None and p.state == "proposed":
        missing = sorted(set(p.nodes) - set(nodes))
        if d.rollout_hold:
            phase = "degraded" if d.committed is not None else "pending"
            why = f"v{p.version} held: the operator reports {d.rollout_hold}"
            return [*aborts, SetStatus(name, phase, why[:1024])]
        if not missing:
            return [
                *aborts,
                StartRollout(name, p.version),
                SetStatus(name, "rolling_out", f"v{p.version}"),
            ]
        phase = "degraded" if d.committed is not None else "pending"
        why = f"v{p.version} targets nodes that are not usable ({', '.join(missing[:5])})"
        return [*aborts, SetStatus(name, phase, f"{why}; waiting for the operator's next plan")]
    c = d.committed
    if c is None:
        return [*aborts, SetStatus(name, "pending", "waiting for the operator's plan")]
    lost = sorted({_node_of(g) for g in c.gpus if g not in usable})
    if lost:
        return [
            *aborts,
            SetStatus(
                name,
                "degraded",
                f"nodes {', '.join(lost[:5])} of v{c.version} are not usable; waiting for "
                "the operator's next plan",
            ),
        ]
    return [*aborts, SetStatus(name, "ready", "")]
