"""The ModelDeployment reconciler's decision: a pure function from what was observed to the
actions that make the world match the spec.

One tick of the control loop (:mod:`operators.operator`) is::

    observed = observe(key)                      # the deployment, GPUNodes, policy, plans
    actions = reconcile(observed, settings)      # pure: this module
    if a SolveAction is among them:              # the one expensive step
        outcome = run_solve(action)              # policies.solve, also pure
        actions = reconcile(replace(observed, solve=outcome), settings)
    act(actions)                                 # server-side apply, deletes, finalizers

Nothing here does I/O, reads a clock or keeps state: the time is ``observed.now``, and the
status is rebuilt from the observations on every tick (the previous status is read only to
keep ``lastTransitionTime`` of unchanged conditions and the record of the last failed
solve, so a bad spec is not re-solved in a hot loop).

Errors in the spec are *permanent* (kopf's term): they become ``Solved=False`` with a reason
(``UnknownModel``, ``InvalidModelConfig``, ``InvalidWorkload``, ``InvalidPrices``,
``PolicyNotFound``, ``NoEligibleNodes``, ``MixedVendors``, ``NothingToExport``,
``Infeasible``, ``PlanTooLarge``) and a message that says how to fix it; the deployment is
solved again only when its inputs change.

Tiers. When the PlacementPolicy defines an ``interactive`` tier, a tick first asks for a
:class:`TierAction`: :func:`policies.tiers.plan_tiers` splits the eligible nodes into
interactive replicas (each one NVLink domain, an independent copy of the model sized to the
SLO) and a batch tier. The split is recorded in ``status.tiers`` (with the digest of its
inputs, so it is planned again only when they change) and reported by the
``InteractiveSLO`` condition. The deployment's own plan - its PartitionPlan, ConfigMap and
agent rollout - is then the batch tier: the deployment's workload solved on the batch
nodes only, the interactive nodes left out of its fleet. Interactive replicas run the
model on their nodes at the batches ``status.tiers.replicas`` gives (one domain of
identical GPUs needs no heterogeneous placement).

Cost. ``status.costPerMillionTokensUSD`` prices the current plan's GPUs at the
deployment's ``gpuHourPrices`` over the policy's over the built-in assumed prices
(:mod:`policies.cost`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from apis.kube.errors import PermanentError
from apis.kube.names import (
    ANNOTATION_PLAN,
    ANNOTATION_PLAN_ID,
    ANNOTATION_PLAN_VERSION,
    FINALIZER,
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    config_map_name,
    parse_time,
    plan_name,
    rfc3339,
)
from apis.kube.plancodec import decode_plan, plan_spec
from apis.kube.schema import Json, to_wire
from apis.kube.v1alpha1 import (
    API_VERSION,
    Condition,
    GPUNodeSpec,
    GPUNodeStatus,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    PartitionPlanSpec,
    PartitionPlanStatus,
    PlacementPolicySpec,
    PlanRef,
    SolveRecord,
    TierAddition,
    TierReplica,
    TiersStatus,
)
from policies.cost import PriceTable, catalog_price_table, usd_per_million_tokens
from policies.costmodel import CostSettings, MeasuredFigures, measured_from_dict
from policies.deployment import Deployment
from policies.errors import InputError
from policies.exports import export_plan, export_sidecar
from policies.fleet import Fleet, Node, fleet_to_doc
from policies.inventory import NodeInventory
from policies.models import ModelSpec, from_hf_config, preset
from policies.plan import Plan
from policies.request import PlacementRequest, SolverOptions
from policies.tiers import BatchTier, InteractiveTier, TierPlan, TierRequest
from policies.workload import make_workload, synthetic_zipf

#: ConfigMap key of each engine format's file (mount the ConfigMap; pass the file path).
ENGINE_FILES = {
    "sglang": "expert-location.json",
    "vllm": "eplb-state.json",
    "trtllm": "moe-load-balancer.json",
}
SIDECAR_FILE = "placement-sidecar.json"

#: Solve failures that re-solving the same inputs cannot fix.
PERMANENT_SOLVE_REASONS = frozenset({"Infeasible", "InvalidSpec", "PlanTooLarge"})

SOLVED, ROLLED_OUT, DEGRADED = "Solved", "RolledOut", "Degraded"
INTERACTIVE_SLO = "InteractiveSLO"

#: Tier-split failures that planning the same inputs again cannot fix.
PERMANENT_TIER_REASONS = frozenset({"InvalidTier"})


# ------------------------------------------------------------------------- observations


@dataclass(frozen=True)
class NodeView:
    """A GPUNode as observed.

    Attributes:
        name: GPUNode name (the Kubernetes node name).
        labels: GPUNode metadata labels (what gpuNodeSelector matches).
        spec: cordon and tier.
        status: inventory, health and heartbeat.
        deleting: has a deletionTimestamp.
    """

    name: str
    labels: Mapping[str, str]
    spec: GPUNodeSpec
    status: GPUNodeStatus
    deleting: bool = False


@dataclass(frozen=True)
class PlanView:
    """A PartitionPlan of the deployment as observed.

    Attributes:
        name: object name.
        uid: object uid.
        spec: the immutable plan.
        status: per-node rollout.
        deleting: has a deletionTimestamp.
    """

    name: str
    uid: str
    spec: PartitionPlanSpec
    status: PartitionPlanStatus
    deleting: bool = False


@dataclass(frozen=True)
class ConfigMapView:
    """The deployment's ConfigMap as observed.

    Attributes:
        name: object name.
        plan: PartitionPlan name in its ``mixfleet.io/plan`` annotation.
        keys: data keys it holds.
    """

    name: str
    plan: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class DeploymentView:
    """A ModelDeployment as observed.

    Attributes:
        name, namespace, uid: identity.
        generation: metadata.generation (bumped by spec changes only).
        finalizers: metadata.finalizers.
        deleting: has a deletionTimestamp.
        spec: the parsed spec, or None when it does not parse (see ``spec_error``).
        spec_error: why the spec did not parse.
        status: the status as last written.
    """

    name: str
    namespace: str
    uid: str
    generation: int
    finalizers: tuple[str, ...]
    deleting: bool
    spec: ModelDeploymentSpec | None
    status: ModelDeploymentStatus
    spec_error: str = ""


@dataclass(frozen=True)
class SolveOutcome:
    """The result of running a :class:`SolveAction`.

    Attributes:
        inputs_digest: digest of the inputs solved.
        plan: the plan, or None when the solve failed.
        reason: ``Solved`` or the failure's condition reason.
        message: failure message (with "To fix:"), empty on success.
        duration_s: wall time of the solve, seconds.
    """

    inputs_digest: str
    plan: Plan | None
    reason: str
    message: str = ""
    duration_s: float = 0.0


@dataclass(frozen=True)
class TierOutcome:
    """The result of running a :class:`TierAction`.

    Attributes:
        inputs_digest: digest of the inputs planned.
        plan: the split, or None when planning failed.
        reason: ``Planned`` or the failure's condition reason (``InvalidTier``,
            ``TierPlanningFailed``).
        message: failure message (with "To fix:"), empty on success.
        duration_s: wall time of the planning, seconds.
    """

    inputs_digest: str
    plan: TierPlan | None
    reason: str
    message: str = ""
    duration_s: float = 0.0


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile of one deployment looks at.

    Attributes:
        deployment: the ModelDeployment.
        nodes: every GPUNode.
        plans: the deployment's PartitionPlans (label ``mixfleet.io/deployment``).
        config_map: its ConfigMap, if any.
        policy: the PlacementPolicy spec that applies (referenced, default, or built-in).
        policy_name: its name ("" for built-in defaults).
        policy_missing: name of a referenced policy that does not exist ("" if none).
        now: the time of the observation (UTC).
        solve: outcome of the solve this tick ran, if any.
        version_floor: highest plan version ever used for this deployment name (also by
            deleted incarnations); new versions are above it.
        tiers: outcome of the tier split this tick ran, if any.
    """

    deployment: DeploymentView
    nodes: tuple[NodeView, ...]
    plans: tuple[PlanView, ...]
    config_map: ConfigMapView | None
    policy: PlacementPolicySpec
    now: datetime
    policy_name: str = ""
    policy_missing: str = ""
    solve: SolveOutcome | None = None
    version_floor: int = 0
    tiers: TierOutcome | None = None


@dataclass(frozen=True)
class ReconcileSettings:
    """Knobs of the decision.

    Attributes:
        node_stale_after_s: a GPUNode whose last heartbeat is older is left out, seconds.
        plan_history: PartitionPlans kept per deployment (newest first, current included).
        solver_error_retry_s: wait before re-solving after a solver failure that may be
            transient, seconds.
        field_manager: server-side apply field manager (recorded nowhere in the decision,
            kept here so all knobs travel together).
    """

    node_stale_after_s: float = 90.0
    plan_history: int = 3
    solver_error_retry_s: float = 60.0
    field_manager: str = "mixfleet-operator"


# ------------------------------------------------------------------------------ actions


@dataclass(frozen=True)
class SetFinalizer:
    """Add (``present``) or remove this operator's finalizer on the deployment."""

    present: bool


@dataclass(frozen=True)
class SolveAction:
    """Solve ``request``; feed the outcome back into :func:`reconcile`.

    Attributes:
        request: the placement request.
        inputs_digest: digest of the inputs, recorded in the PartitionPlan.
        version: version the new plan gets.
    """

    request: PlacementRequest
    inputs_digest: str
    version: int


@dataclass(frozen=True)
class TierAction:
    """Split the eligible nodes between the interactive and the batch tier
    (:func:`policies.tiers.plan_tiers`); feed the outcome back into :func:`reconcile`.

    Attributes:
        request: the tier request (the whole eligible fleet).
        inputs_digest: digest of the inputs, recorded in ``status.tiers``.
    """

    request: TierRequest
    inputs_digest: str


@dataclass(frozen=True)
class ApplyPlan:
    """Create a PartitionPlan (server-side apply of metadata and immutable spec)."""

    body: Json = field(repr=False)
    name: str = ""


@dataclass(frozen=True)
class DeletePlan:
    """Delete an old or orphaned PartitionPlan."""

    name: str
    uid: str


@dataclass(frozen=True)
class ApplyConfigMap:
    """Publish the engine export of the current plan."""

    body: Json = field(repr=False)
    name: str = ""


@dataclass(frozen=True)
class DeleteConfigMap:
    """Remove the deployment's ConfigMap."""

    name: str


@dataclass(frozen=True)
class ApplyStatus:
    """Server-side apply of the deployment's status subresource."""

    status: Json


@dataclass(frozen=True)
class Requeue:
    """Reconcile this deployment again after ``after_s`` seconds."""

    after_s: float


Action = (
    SetFinalizer
    | TierAction
    | SolveAction
    | ApplyPlan
    | DeletePlan
    | ApplyConfigMap
    | DeleteConfigMap
    | ApplyStatus
    | Requeue
)


# ------------------------------------------------------------------------- small helpers


def digest(doc: Any) -> str:
    """16 hex digits of the SHA-256 of a JSON document (sorted keys)."""
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def selector_matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether ``labels`` carry every ``key: value`` of a node selector (empty: all)."""
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------- fleet from nodes


@dataclass(frozen=True)
class FleetView:
    """The GPUNodes a deployment may use.

    Attributes:
        fleet: eligible nodes as the planning core's fleet (sorted by name).
        measured: calibrated figures by GPU id, from the agents' inventories.
        excluded: node name -> why it is left out (not listed: not selected).
        next_stale_s: seconds until the first eligible node's heartbeat goes stale.
    """

    fleet: Fleet
    measured: Mapping[str, MeasuredFigures]
    excluded: Mapping[str, str]
    next_stale_s: float | None


def eligible_fleet(
    nodes: Sequence[NodeView],
    selector: Mapping[str, str],
    policy: PlacementPolicySpec,
    now: datetime,
    stale_after_s: float,
) -> FleetView:
    """Select and convert the GPUNodes a deployment may place on.

    A node is left out when it is being deleted, cordoned, not matched by the selector, of
    a tier the policy does not allow, has reported no inventory, its heartbeat is older
    than ``stale_after_s``, its health is ``Unhealthy``, or none of its GPUs is healthy.
    """
    out: list[Node] = []
    measured: dict[str, MeasuredFigures] = {}
    excluded: dict[str, str] = {}
    next_stale: float | None = None
    for n in sorted(nodes, key=lambda x: x.name):
        if not selector_matches(selector, n.labels):
            continue
        if n.deleting:
            excluded[n.name] = "being deleted"
            continue
        if n.spec.cordon:
            excluded[n.name] = "cordoned"
            continue
        if policy.tiers and n.spec.tier not in policy.tiers:
            excluded[n.name] = f"tier {n.spec.tier or '(none)'!r} not in policy tiers"
            continue
        inv = n.status.inventory
        if inv is None:
            excluded[n.name] = "no inventory reported yet"
            continue
        beat = parse_time(n.status.last_heartbeat_time)
        age = (now - beat).total_seconds() if beat else None
        if age is None or age > stale_after_s:
            excluded[n.name] = "no heartbeat" if age is None else f"last heartbeat {age:.0f} s ago"
            continue
        if n.status.health is not None and n.status.health.state == "Unhealthy":
            excluded[n.name] = f"unhealthy: {n.status.health.message or 'agent reports it'}"
            continue
        try:
            node = _to_node(n.name, inv, n.labels)
        except InputError as exc:
            excluded[n.name] = f"inventory not usable: {exc}"
            continue
        if not node.gpus:
            excluded[n.name] = "no healthy GPU"
            continue
        remaining = stale_after_s - age
        next_stale = remaining if next_stale is None else min(next_stale, remaining)
        for g in inv.gpus:
            if g.measured:
                # A bad calibration falls back to the catalog figures.
                with contextlib.suppress(InputError):
                    measured[f"{n.name}/gpu{g.index}"] = measured_from_dict(g.measured)
        out.append(node)
    return FleetView(Fleet("gpunodes", tuple(out)), measured, excluded, next_stale)


def _to_node(name: str, inv: NodeInventory, labels: Mapping[str, str]) -> Node:
    merged = {**inv.labels, **labels}
    return dataclasses.replace(inv, node=name, labels=merged).to_node(healthy_only=True)


# ------------------------------------------------------------------------- solve inputs


@dataclass(frozen=True)
class SolveInputs:
    """What a solve of this deployment would read, and its digest.

    Attributes:
        request: the placement request (its fleet leaves out ``reserved`` nodes).
        digest: digest of the inputs.
        fleet_view: the eligible GPUNodes (reserved ones included in ``fleet``).
        redundant_note: why redundantExperts was raised, if it was.
        effective: solver settings after overrides.
        load: the expert load the workload was built from (None: uniform), and its source.
        prices: price table of the cost report (USD per GPU-hour).
        reserved: node -> why it is left out of this plan (the interactive tier).
    """

    request: PlacementRequest
    digest: str
    fleet_view: FleetView
    redundant_note: str = ""
    effective: Effective | None = None
    load: tuple[tuple[tuple[float, ...], ...] | None, str] = (None, "uniform")
    prices: PriceTable = field(default_factory=PriceTable)
    reserved: Mapping[str, str] = field(default_factory=dict)


def model_of(spec: ModelDeploymentSpec, name: str) -> ModelSpec:
    """The model a deployment names (an inline config is named after the deployment).

    Raises:
        PermanentError: ``UnknownModel`` or ``InvalidModelConfig``.
    """
    if spec.model is not None:
        try:
            return preset(spec.model)
        except InputError as exc:
            raise PermanentError("UnknownModel", f"spec.model: {exc}") from exc
    try:
        return from_hf_config(spec.model_config or {}, name)
    except InputError as exc:
        raise PermanentError("InvalidModelConfig", f"spec.modelConfig: {exc}") from exc


@dataclass(frozen=True)
class Effective:
    """Solver settings after overrides: deployment spec > PlacementPolicy > built-in.

    Attributes:
        policy: placement algorithm.
        time_limit_s: solve limit, seconds.
        redundant_experts: requested extra slots (before rounding for engine form).
        migration_weight_us: cost of one expert move, us (0 = solver default).
    """

    policy: str
    time_limit_s: float
    redundant_experts: int
    migration_weight_us: float


def effective_settings(spec: ModelDeploymentSpec, policy: PlacementPolicySpec) -> Effective:
    """Resolve a deployment's solver settings against its policy."""
    rebalance = spec.rebalance or policy.rebalance
    redundant = spec.redundant_experts
    if redundant is None:
        redundant = policy.redundant_experts or 0
    return Effective(
        policy=spec.policy or policy.policy,
        time_limit_s=spec.solver_time_limit_s or policy.solver_time_limit_s,
        redundant_experts=redundant,
        migration_weight_us=rebalance.migration_weight_us,
    )


def effective_prices(observed: Observed) -> PriceTable:
    """Prices of the cost report: the deployment's ``gpuHourPrices`` over the policy's over
    the built-in assumed prices, USD per GPU-hour.

    Raises:
        PermanentError: ``InvalidPrices`` - a name that is not a catalog GPU model (the
            closest are named) or a negative or non-finite price.
    """
    spec = observed.deployment.spec
    where = f"PlacementPolicy {observed.policy_name}" if observed.policy_name else "policy"
    try:
        policy = catalog_price_table(
            observed.policy.gpu_hour_prices,
            field_path=f"{where} spec.gpuHourPrices",
            source=f"{where} gpuHourPrices",
        )
        if spec is None or not spec.gpu_hour_prices:
            return policy
        return catalog_price_table(
            spec.gpu_hour_prices,
            base=policy.usd_per_gpu_hour,
            field_path="spec.gpuHourPrices",
            source="spec.gpuHourPrices",
        )
    except InputError as exc:
        raise PermanentError("InvalidPrices", str(exc)) from exc


def allow_cross_vendor(spec: ModelDeploymentSpec, policy: PlacementPolicySpec) -> bool:
    """Whether one expert-parallel group may span GPU vendors: the deployment's
    ``allowCrossVendor`` when set, else the policy's."""
    if spec.allow_cross_vendor is not None:
        return spec.allow_cross_vendor
    return policy.allow_cross_vendor


def solve_inputs(
    observed: Observed,
    settings: ReconcileSettings,
    *,
    reserved: Mapping[str, str] | None = None,
) -> SolveInputs:
    """Build the placement request of a deployment from its spec, policy and GPUNodes.

    Args:
        observed: the observation.
        settings: decision knobs.
        reserved: eligible nodes to leave out of the plan, with why (the interactive tier).

    Raises:
        PermanentError: the spec cannot be solved as it stands (reason says why).
    """
    d = observed.deployment
    if d.spec is None:
        raise PermanentError("InvalidSpec", d.spec_error or "spec does not parse")
    spec = d.spec
    if observed.policy_missing:
        raise PermanentError(
            "PolicyNotFound",
            f"PlacementPolicy {observed.policy_missing!r} does not exist. To fix: create it "
            "(kubectl apply -f placementpolicy.yaml) or remove spec.policyRef",
        )
    prices = effective_prices(observed)
    model = model_of(spec, d.name)
    if spec.engine_format != "none" and not model.is_moe:
        raise PermanentError(
            "NothingToExport",
            f"{model.name} is a dense model: there is no expert placement to publish as "
            f"{spec.engine_format}. To fix: set spec.engineFormat: none",
        )
    w = spec.workload
    try:
        load: tuple[tuple[float, ...], ...] | None = None
        source = "uniform"
        if w.load_matrix is not None:
            load, source = w.load_matrix, "spec"
        elif w.load.startswith("synthetic:"):
            rows = synthetic_zipf(model, w.load)
            load, source = tuple(tuple(float(x) for x in r) for r in rows), w.load
        if not model.is_moe:
            load = None
        workload = make_workload(
            model,
            phase=w.phase,
            tokens_per_gpu=w.tokens_per_gpu,
            context_len=w.context_len,
            load=load,
            kv_cache_dtype=w.kv_cache_dtype,
            load_source=source,
        )
    except InputError as exc:
        raise PermanentError("InvalidWorkload", f"spec.workload: {exc}") from exc
    policy = observed.policy
    eff = effective_settings(spec, policy)
    cross = allow_cross_vendor(spec, policy)
    view = eligible_fleet(
        observed.nodes, spec.node_selector, policy, observed.now, settings.node_stale_after_s
    )
    reserved = dict(reserved or {})
    fleet = view.fleet
    if reserved:
        fleet = Fleet(fleet.name, tuple(n for n in fleet.nodes if n.name not in reserved))
    gpus = len(fleet.gpus)
    if gpus == 0 and reserved and view.fleet.gpus:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(reserved.items())[:10])
        raise PermanentError(
            "NoEligibleNodes",
            f"every eligible GPUNode is reserved for the interactive tier ({why}); none is "
            "left for the batch tier, which is this deployment's plan. To fix: add GPUNodes, "
            "lower the policy's interactive.requestsPerS or relax its tpotMs / ttftMs",
        )
    if gpus == 0:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(view.excluded.items())[:10])
        raise PermanentError(
            "NoEligibleNodes",
            "no GPUNode is eligible"
            + (f" ({why})" if why else " (none matches spec.nodeSelector)")
            + ". To fix: uncordon nodes, check their agents' heartbeats, or widen "
            "spec.nodeSelector / the policy's tiers",
        )
    redundant = eff.redundant_experts
    note = ""
    if spec.form == "engine" and model.is_moe and (model.num_experts + redundant) % gpus:
        wanted = redundant
        redundant += (-(model.num_experts + redundant)) % gpus
        if wanted:
            note = (
                f"redundantExperts raised from {wanted} to {redundant} so that "
                f"{model.num_experts} + {redundant} slots divide by {gpus} GPUs"
            )
    previous = _previous_plan(observed, model)
    options = SolverOptions(
        time_limit_s=eff.time_limit_s,
        mip_gap=policy.mip_gap,
        solver=policy.milp_solver,
        workers=policy.workers,
    )
    if eff.migration_weight_us > 0:
        options = dataclasses.replace(options, migration_weight_us=eff.migration_weight_us)
    kept = {n.name for n in fleet.nodes}
    measured = {k: v for k, v in view.measured.items() if k.split("/", 1)[0] in kept}
    request = PlacementRequest(
        fleet=fleet,
        model=model,
        workload=workload,
        policy=eff.policy,
        form=spec.form,
        redundant_experts=redundant,
        options=options,
        previous=previous,
        settings=CostSettings(measured=measured),
        allow_cross_vendor=cross,
    )
    solve_doc: dict[str, Any] = {
        "model": spec.model or spec.model_config,
        "workload": to_wire(spec.workload),
        "form": spec.form,
        "effective": dataclasses.asdict(eff),
        "solver": [policy.milp_solver, policy.mip_gap, policy.workers],
        "redundant": redundant,
        "fleet": fleet_to_doc(fleet),
        "measured": {k: dataclasses.asdict(v) for k, v in sorted(measured.items())},
    }
    if cross:  # only when set, so digests of existing deployments stay as they were
        solve_doc["allowCrossVendor"] = True
    return SolveInputs(
        request,
        digest(solve_doc),
        view,
        note,
        effective=eff,
        load=(load, source),
        prices=prices,
        reserved=reserved,
    )


@dataclass(frozen=True)
class TierInputs:
    """What a tier split of this deployment would read, and its digest.

    Attributes:
        request: the tier request, or None when it cannot be built (see ``error``).
        digest: digest of the inputs.
        error: why the policy's interactive tier is invalid (``InvalidTier``), or None.
    """

    request: TierRequest | None
    digest: str
    error: PermanentError | None = None


def tier_inputs(observed: Observed, inputs: SolveInputs) -> TierInputs | None:
    """The tier split the deployment's policy asks for; None without an interactive tier.

    ``inputs`` are the deployment's solve inputs over every eligible node (nothing
    reserved): the split shares their model, load, solver settings, measured figures,
    vendor rule and prices. The batch tier is the deployment's own workload.
    """
    tier = observed.policy.interactive
    spec = observed.deployment.spec
    eff = inputs.effective
    if tier is None or spec is None or eff is None:
        return None
    req = inputs.request
    key = digest(
        {
            "interactive": to_wire(tier),
            "solve": inputs.digest,
            "prices": sorted(inputs.prices.usd_per_gpu_hour.items()),
        }
    )
    w = spec.workload
    load, source = inputs.load
    where = f"PlacementPolicy {observed.policy_name}" if observed.policy_name else "policy"
    if tier.tpot_ms is None and tier.ttft_ms is None:
        return TierInputs(
            None,
            key,
            PermanentError(
                "InvalidTier",
                f"{where} spec.interactive has no latency target. To fix: set tpotMs and/or "
                "ttftMs, or remove interactive",
            ),
        )
    try:
        interactive = InteractiveTier(
            tpot_ms=tier.tpot_ms,
            ttft_ms=tier.ttft_ms,
            requests_per_s=tier.requests_per_s,
            prompt_tokens=tier.prompt_tokens,
            output_tokens=tier.output_tokens,
            max_utilisation=tier.max_utilisation,
        )
        interactive.check()
        dep = Deployment(
            fleet=req.fleet,
            model=req.model,
            phase=w.phase,
            context_len=w.context_len,
            kv_cache_dtype=w.kv_cache_dtype,
            load=load,
            load_source=source,
            policy=eff.policy,
            form=req.form,
            redundant_experts=eff.redundant_experts,
            options=req.options,
            settings=req.settings,
            allow_cross_vendor=req.allow_cross_vendor,
        )
    except InputError as exc:
        return TierInputs(
            None, key, PermanentError("InvalidTier", f"{where} spec.interactive: {exc}")
        )
    request = TierRequest(
        deployment=dep,
        interactive=interactive,
        batch=BatchTier(phase=w.phase, tokens_per_gpu=w.tokens_per_gpu, context_len=w.context_len),
        preference=tier.preference,
        allow_cross_vendor=req.allow_cross_vendor,
        prices=inputs.prices,
    )
    return TierInputs(request, key)


def _tier_step(
    observed: Observed, settings: ReconcileSettings, t_in: TierInputs
) -> TierAction | tuple[TiersStatus, float]:
    """The split to use this tick and seconds until a failed one is retried (0: none), or
    the action that plans it. A split recorded for the same inputs is reused."""
    now = observed.now
    fresh = observed.tiers
    if fresh is not None and fresh.inputs_digest == t_in.digest:
        st = tiers_status(fresh, observed, now)
        transient = st.outcome == "Failed" and st.reason not in PERMANENT_TIER_REASONS
        return st, settings.solver_error_retry_s if transient else 0.0
    prev = observed.deployment.status.tiers
    if prev is not None and prev.inputs_digest == t_in.digest:
        if prev.outcome == "Succeeded" or prev.reason in PERMANENT_TIER_REASONS:
            return prev, 0.0
        t = parse_time(prev.time)
        elapsed = (now - t).total_seconds() if t else settings.solver_error_retry_s
        if elapsed < settings.solver_error_retry_s:
            return prev, settings.solver_error_retry_s - elapsed
    if t_in.error is not None:
        failed = TiersStatus(
            inputs_digest=t_in.digest,
            outcome="Failed",
            reason=t_in.error.reason,
            message=str(t_in.error)[:8192],
            time=rfc3339(now),
        )
        return failed, 0.0
    assert t_in.request is not None  # built whenever there is no error
    return TierAction(t_in.request, t_in.digest)


def _targets(observed: Observed) -> str:
    tier = observed.policy.interactive
    if tier is None:
        return "the SLO"
    parts = []
    if tier.tpot_ms is not None:
        parts.append(f"TPOT {tier.tpot_ms:g} ms")
    if tier.ttft_ms is not None:
        parts.append(f"TTFT {tier.ttft_ms:g} ms")
    return " / ".join(parts)


def tiers_status(outcome: TierOutcome, observed: Observed, now: datetime) -> TiersStatus:
    """``status.tiers`` of a split (or of a failed attempt)."""
    when = rfc3339(now)
    duration = round(outcome.duration_s, 3)
    tp = outcome.plan
    if tp is None:
        return TiersStatus(
            inputs_digest=outcome.inputs_digest,
            outcome="Failed",
            reason=outcome.reason,
            message=outcome.message[:8192],
            time=when,
            duration_s=duration,
        )
    inter = tp.interactive
    replicas = tuple(
        TierReplica(
            nodes=r.nodes,
            gpu_model=r.gpu_model,
            gpus=len(r.result.plan.gpus),
            decode_tokens_per_gpu=r.decode_tokens_per_gpu,
            prefill_tokens_per_gpu=r.prefill_tokens_per_gpu,
            tpot_ms=round(r.tpot_ms, 3),
            ttft_ms=round(r.ttft_ms, 3),
            requests_per_s=round(r.requests_per_s, 3),
        )
        for r in inter.replicas
    )
    additions = tuple(
        TierAddition(
            gpu_model=a.gpu_model,
            nodes=a.nodes,
            gpus_per_node=a.gpus_per_node,
            usd_per_hour=round(a.usd_per_hour, 2) if a.usd_per_hour is not None else None,
        )
        for a in inter.additions[:32]
    )
    targets = _targets(observed)
    demand = inter.demand_requests_per_s
    capacity = inter.capacity_requests_per_s
    batch = ", ".join(tp.batch.nodes) or "none"
    if inter.slo_met and not replicas:
        message = (
            f"interactive.requestsPerS is {demand:g}: no interactive replica; every "
            f"eligible node is in the batch tier ({batch})"
        )
    elif inter.slo_met:
        message = (
            f"{len(replicas)} interactive replica(s) ("
            + "; ".join(", ".join(r.nodes) for r in replicas)
            + f") serve {capacity:.2f} requests/s within {targets} ({demand:.2f} asked; "
            f"predicted TPOT {inter.tpot_ms or 0.0:.2f} ms, TTFT {inter.ttft_ms or 0.0:.2f} "
            f"ms); batch tier, this deployment's plan: {batch}"
        )
    else:
        fixes = "; ".join(
            f"{a.nodes} node(s) of {a.gpus_per_node}x {a.gpu_model}"
            + (f" ({a.usd_per_hour:.2f} USD/h)" if a.usd_per_hour is not None else "")
            for a in additions[:5]
        )
        adds = (
            f"To meet it, add any one of: {fixes}; or lower interactive.requestsPerS or "
            "relax its targets"
            if fixes
            else "No catalog GPU meets these targets. To fix: relax tpotMs / ttftMs or shorten "
            "promptTokens / outputTokens"
        )
        why = [x for x in inter.reasons if not x.startswith("the eligible units serve")]
        message = (
            f"the interactive tier cannot meet its SLO: the eligible NVLink domains serve "
            f"{capacity:.2f} requests/s within {targets}, {demand:.2f} asked. {adds}."
            + (f" Not eligible: {'; '.join(why)}." if why else "")
            + f" Meanwhile the interactive tier keeps {', '.join(inter.nodes) or 'no node'}; "
            f"batch tier: {batch}"
        )
    return TiersStatus(
        inputs_digest=outcome.inputs_digest,
        outcome="Succeeded",
        reason="SLOMet" if inter.slo_met else "SLONotMet",
        message=message[:8192],
        time=when,
        slo_met=inter.slo_met,
        demand_requests_per_s=round(demand, 3),
        capacity_requests_per_s=round(capacity, 3),
        interactive_nodes=inter.nodes,
        batch_nodes=tp.batch.nodes,
        replicas=replicas,
        additions=additions,
        duration_s=duration,
    )


def reserved_nodes(tiers: TiersStatus | None) -> dict[str, str]:
    """Nodes the interactive tier keeps out of the deployment's plan, with why."""
    if tiers is None or tiers.outcome != "Succeeded":
        return {}
    out = dict.fromkeys(tiers.interactive_nodes, "interactive tier")
    for i, r in enumerate(tiers.replicas):
        for n in r.nodes:
            out[n] = f"interactive replica {i + 1} ({r.gpu_model})"
    return out


def check_vendor_mix(request: PlacementRequest) -> None:
    """Refuse one expert-parallel group over several GPU vendors unless allowed.

    Raises:
        PermanentError: ``MixedVendors``, counting the GPUs per vendor.
    """
    if request.allow_cross_vendor or not request.model.is_moe:
        return
    counts: dict[str, int] = {}
    for g in request.fleet.gpus:
        counts[g.spec.vendor] = counts.get(g.spec.vendor, 0) + 1
    if len(counts) <= 1:
        return
    detail = ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
    raise PermanentError(
        "MixedVendors",
        f"one plan of {request.model.name} would put expert-parallel all-to-all traffic "
        f"across GPU vendors ({detail} GPUs); NCCL/DeepEP and RCCL cannot form one such "
        "group. To fix: give each vendor its own ModelDeployment (spec.nodeSelector on a "
        "label only that vendor's GPUNodes carry), or set allowCrossVendor: true on the "
        "PlacementPolicy or the deployment if your runtime bridges vendors",
    )


def _previous_plan(observed: Observed, model: ModelSpec) -> Plan | None:
    """The current plan, to keep a re-plan close to it (None for another model)."""
    current = current_plan(observed.plans)
    if current is None or current.spec.model != model.name:
        return None
    try:
        plan = decode_plan(current.spec)
    except InputError:
        return None
    if plan.num_experts != model.num_experts or len(plan.moe_layers) != model.num_moe_layers:
        return None
    return plan


def next_version(observed: Observed) -> int:
    """The version a new plan gets: above every existing plan and every recorded version."""
    return max([observed.version_floor, *(p.spec.version for p in observed.plans)]) + 1


def newest_plan(plans: Sequence[PlanView]) -> PlanView | None:
    """The newest PartitionPlan that is not being deleted (what the operator compares its
    inputs with: a plan it wrote and the controller has not committed yet still counts)."""
    live = [p for p in plans if not p.deleting]
    return max(live, key=lambda p: p.spec.version) if live else None


def current_plan(plans: Sequence[PlanView]) -> PlanView | None:
    """The plan the deployment serves: the committed PartitionPlan (the controller commits
    it when every agent has prepared it), else - before any commit, or with no controller
    rolling plans out - the newest one that is not being deleted. Status, ConfigMap and
    ``plans history`` all name this plan."""
    live = [p for p in plans if not p.deleting]
    committed = [p for p in live if p.status.state == "Committed"]
    pool = committed or live
    return max(pool, key=lambda p: p.spec.version) if pool else None


# -------------------------------------------------------------------------- the decision


def reconcile(observed: Observed, settings: ReconcileSettings) -> tuple[Action, ...]:
    """Decide what to do for one ModelDeployment.

    Returns the actions in the order they must run. When a solve is needed and
    ``observed.solve`` is None, the result is the finalizer action (if any) and one
    :class:`SolveAction`: run it and call again with the outcome in ``observed.solve``.
    """
    d = observed.deployment
    if d.deleting:
        return _finalize(observed)
    actions: list[Action] = []
    if FINALIZER not in d.finalizers:
        actions.append(SetFinalizer(True))

    inputs: SolveInputs | None = None
    input_error: PermanentError | None = None
    try:
        inputs = solve_inputs(observed, settings)
    except PermanentError as exc:
        input_error = exc
    requeue: list[float] = []

    # With an interactive tier, split first; the deployment's plan is then the batch tier.
    tiers: TiersStatus | None = None
    t_in = tier_inputs(observed, inputs) if inputs is not None else None
    if t_in is not None:
        step = _tier_step(observed, settings, t_in)
        if isinstance(step, TierAction):
            return (*actions, step)
        tiers, retry_tiers_in = step
        if retry_tiers_in > 0:
            requeue.append(retry_tiers_in)
        reserved = reserved_nodes(tiers)
        if reserved:
            try:
                inputs = solve_inputs(observed, settings, reserved=reserved)
            except PermanentError as exc:
                inputs, input_error = None, exc
    if inputs is not None:
        try:
            check_vendor_mix(inputs.request)
        except PermanentError as exc:
            inputs, input_error = None, exc

    plans = [p for p in observed.plans if not p.deleting]
    current = current_plan(plans)
    ours = newest_plan([p for p in plans if p.spec.made_by == "operator"])
    last = d.status.last_solve
    solve = observed.solve
    new_record: SolveRecord | None = last

    # The operator re-solves when the inputs of its own newest plan no longer match. It is
    # the only writer of PartitionPlans: the controller rolls them out and commits them.
    if inputs is not None and (ours is None or ours.spec.inputs_digest != inputs.digest):
        failed_before = (
            last is not None and last.outcome == "Failed" and last.inputs_digest == inputs.digest
        )
        retry_in = 0.0
        if failed_before and last is not None and last.reason not in PERMANENT_SOLVE_REASONS:
            t = parse_time(last.time)
            elapsed = (observed.now - t).total_seconds() if t else settings.solver_error_retry_s
            retry_in = max(0.0, settings.solver_error_retry_s - elapsed)
        if solve is None or solve.inputs_digest != inputs.digest:
            if not failed_before or (
                last is not None and last.reason not in PERMANENT_SOLVE_REASONS and retry_in <= 0
            ):
                return (
                    *actions,
                    SolveAction(inputs.request, inputs.digest, next_version(observed)),
                )
            if retry_in > 0:
                requeue.append(retry_in)
        else:
            new_record = SolveRecord(
                inputs_digest=solve.inputs_digest,
                outcome="Succeeded" if solve.plan is not None else "Failed",
                reason=solve.reason,
                time=rfc3339(observed.now),
                duration_s=round(solve.duration_s, 3),
            )
            if solve.plan is not None:
                try:
                    body, view = _plan_object(
                        observed, solve.plan, solve.inputs_digest, _why(observed, ours, inputs)
                    )
                except PermanentError as exc:
                    new_record = dataclasses.replace(
                        new_record, outcome="Failed", reason=exc.reason
                    )
                    solve = dataclasses.replace(
                        solve, plan=None, reason=exc.reason, message=str(exc)
                    )
                else:
                    actions.append(ApplyPlan(body, view.name))
                    plans.append(view)
                    current = view
            if solve.plan is None and solve.reason not in PERMANENT_SOLVE_REASONS:
                requeue.append(settings.solver_error_retry_s)

    # Engine export of the current plan.
    spec = d.spec
    cm_name = config_map_name(d.name)
    cm_wanted = current is not None and spec is not None and spec.engine_format != "none"
    if cm_wanted and current is not None and spec is not None:
        cm = observed.config_map
        wanted_keys = (ENGINE_FILES[spec.engine_format], SIDECAR_FILE)
        if (
            cm is None
            or cm.plan != current.name
            or tuple(sorted(cm.keys)) != tuple(sorted(wanted_keys))
        ):
            try:
                actions.append(
                    ApplyConfigMap(_config_map(observed, current, spec.engine_format), cm_name)
                )
            except InputError as exc:
                input_error = input_error or PermanentError("ExportFailed", str(exc))
    elif observed.config_map is not None:
        actions.append(DeleteConfigMap(observed.config_map.name))

    # Keep the newest plans; the current one always survives.
    keep = {
        p.name
        for p in sorted(plans, key=lambda p: -p.spec.version)[: max(1, settings.plan_history)]
    }
    for p in sorted(plans, key=lambda p: p.spec.version):
        if p.name not in keep and (current is None or p.name != current.name):
            actions.append(DeletePlan(p.name, p.uid))

    ours = newest_plan([p for p in plans if p.spec.made_by == "operator"])
    status = _status(
        observed, inputs, input_error, current, ours, new_record, solve, cm_wanted, tiers
    )
    # committedVersion and controller belong to the controller's field manager: compare
    # with them carried over, apply without them.
    seen = dataclasses.replace(
        status, committed_version=d.status.committed_version, controller=d.status.controller
    )
    if to_wire(seen) != to_wire(d.status):
        actions.append(ApplyStatus(to_wire(status)))
    if inputs is not None and inputs.fleet_view.next_stale_s is not None:
        requeue.append(max(1.0, inputs.fleet_view.next_stale_s + 1.0))
    if requeue:
        actions.append(Requeue(min(requeue)))
    return tuple(actions)


def _finalize(observed: Observed) -> tuple[Action, ...]:
    """Deletion: remove the ConfigMap and the PartitionPlans, then the finalizer."""
    d = observed.deployment
    if FINALIZER not in d.finalizers:
        return ()
    actions: list[Action] = []
    if observed.config_map is not None:
        actions.append(DeleteConfigMap(observed.config_map.name))
    actions += [DeletePlan(p.name, p.uid) for p in observed.plans if not p.deleting]
    if observed.config_map is None and not observed.plans:
        actions.append(SetFinalizer(False))
    else:
        actions.append(Requeue(1.0))
    return tuple(actions)


# ----------------------------------------------------------------------------- objects


def _owner(d: DeploymentView) -> Json:
    return {
        "apiVersion": API_VERSION,
        "kind": "ModelDeployment",
        "name": d.name,
        "uid": d.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _labels(d: DeploymentView) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: d.name, LABEL_MANAGED_BY: MANAGED_BY}


def _why(observed: Observed, ours: PlanView | None, inputs: SolveInputs) -> str:
    """Why a new plan is made, for the PartitionPlan's ``reason``."""
    d = observed.deployment
    if ours is None:
        return "first plan"
    if ours.spec.deployment_generation != d.generation:
        return f"spec changed (generation {d.generation})"
    now_nodes = {n.name for n in inputs.request.fleet.nodes}
    gone = sorted(set(ours.spec.nodes) - now_nodes)
    new = sorted(now_nodes - set(ours.spec.nodes))
    if gone or new:
        why = {**inputs.fleet_view.excluded, **inputs.reserved}
        parts = [f"-{n} ({why.get(n, 'not selected')})" for n in gone]
        parts += [f"+{n}" for n in new]
        return "fleet changed: " + ", ".join(parts)
    return "fleet or policy changed"


def _plan_object(
    observed: Observed, plan: Plan, inputs_digest: str, reason: str
) -> tuple[Json, PlanView]:
    d = observed.deployment
    version = next_version(observed)
    plan = dataclasses.replace(plan, version=version)
    spec = dataclasses.replace(
        plan_spec(
            plan,
            deployment=d.name,
            inputs_digest=inputs_digest,
            deployment_generation=d.generation,
        ),
        made_by="operator",
        reason=reason[:1024],
    )
    name = plan_name(d.name, version)
    body: Json = {
        "metadata": {
            "name": name,
            "namespace": d.namespace,
            "labels": _labels(d),
            "annotations": {ANNOTATION_PLAN_ID: plan.id},
            "ownerReferences": [_owner(d)],
        },
        "spec": to_wire(spec),
    }
    return body, PlanView(name, "", spec, PartitionPlanStatus())


def _config_map(observed: Observed, current: PlanView, engine_format: str) -> Json:
    """The ConfigMap of the current plan's engine export.

    Raises:
        InputError: the plan cannot be exported (native form, dense model).
    """
    d = observed.deployment
    plan = decode_plan(current.spec)
    doc = export_plan(plan, engine_format)
    data = {
        ENGINE_FILES[engine_format]: json.dumps(doc, separators=(",", ":")),
        SIDECAR_FILE: json.dumps(export_sidecar(plan), separators=(",", ":")),
    }
    return {
        "metadata": {
            "name": config_map_name(d.name),
            "namespace": d.namespace,
            "labels": _labels(d),
            "annotations": {
                ANNOTATION_PLAN: current.name,
                ANNOTATION_PLAN_VERSION: str(current.spec.version),
                ANNOTATION_PLAN_ID: current.spec.plan_id,
            },
            "ownerReferences": [_owner(d)],
        },
        "data": data,
    }


# ------------------------------------------------------------------------------ status


def _condition(
    previous: Sequence[Condition],
    type_: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
    now: datetime,
) -> Condition:
    """A condition; keeps the old lastTransitionTime when its status did not change."""
    old = next((c for c in previous if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == status else rfc3339(now)
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message[:32768],
        last_transition_time=since,
        observed_generation=generation,
    )


def _rollout(plan: PlanView) -> tuple[str, str, str]:
    """``(status, reason, message)`` of the RolledOut condition for a plan."""
    states = {n.node: n for n in plan.status.nodes}
    nodes = plan.spec.nodes
    failed = [states[n] for n in nodes if n in states and states[n].state in ("Failed", "Aborted")]
    if failed:
        detail = "; ".join(
            f"{f.node}: {f.reason or f.state} {f.message}".strip() for f in failed[:5]
        )
        return "False", "RolloutFailed", f"plan v{plan.spec.version} failed on {detail}"
    done = [n for n in nodes if n in states and states[n].state == "Committed"]
    if len(done) == len(nodes):
        return "True", "RolledOut", f"all {len(nodes)} nodes committed plan v{plan.spec.version}"
    waiting = [n for n in nodes if n not in done]
    return (
        "False",
        "RolloutPending",
        f"{len(done)}/{len(nodes)} nodes committed plan v{plan.spec.version}; waiting for "
        + ", ".join(waiting[:10]),
    )


def _status(
    observed: Observed,
    inputs: SolveInputs | None,
    input_error: PermanentError | None,
    current: PlanView | None,
    ours: PlanView | None,
    record: SolveRecord | None,
    solve: SolveOutcome | None,
    cm_wanted: bool,
    tiers: TiersStatus | None = None,
) -> ModelDeploymentStatus:
    d = observed.deployment
    gen, now, prev = d.generation, observed.now, d.status.conditions

    # Solved
    old_solved = next((c for c in prev if c.type == SOLVED), None)
    if input_error is not None:
        solved = ("False", input_error.reason, str(input_error))
    elif (
        solve is not None
        and inputs is not None
        and solve.inputs_digest == inputs.digest
        and solve.plan is None
    ):
        solved = ("False", solve.reason, solve.message)
    elif ours is not None and inputs is not None and ours.spec.inputs_digest == inputs.digest:
        s = ours.spec
        msg = (
            f"plan v{s.version} ({s.plan_id}) places {s.model} on {len(s.gpus)} GPUs of "
            f"{len(s.nodes)} nodes: step {s.step_time_us:.0f} us, {s.tokens_per_s:.0f} tokens/s "
            f"({s.policy})"
        )
        if inputs.redundant_note:
            msg += f"; {inputs.redundant_note}"
        solved = ("True", SOLVED, msg)
    elif (
        record is not None
        and inputs is not None
        and record.outcome == "Failed"
        and record.inputs_digest == inputs.digest
    ):
        keep = (
            old_solved.message
            if old_solved is not None and old_solved.reason == record.reason
            else ""
        )
        solved = ("False", record.reason, keep or f"the last solve failed: {record.reason}")
    else:
        solved = ("Unknown", "Solving", "a new plan is being solved")

    # RolledOut
    rolled = _rollout(current) if current is not None else ("False", "NoPlan", "no plan yet")

    # Degraded
    degraded = ("False", "AsExpected", "serving the plan for the current spec and fleet")
    if current is not None:
        eligible = {n.name for n in inputs.fleet_view.fleet.nodes} if inputs else set()
        lost = [n for n in current.spec.nodes if inputs is not None and n not in eligible]
        if lost:
            why = inputs.fleet_view.excluded if inputs else {}
            detail = ", ".join(f"{n} ({why.get(n, 'not selected')})" for n in lost[:10])
            degraded = (
                "True",
                "NodesUnavailable",
                f"plan v{current.spec.version} uses nodes that are no longer eligible: {detail}",
            )
        elif solved[0] == "False":
            degraded = (
                "True",
                "ServingOutdatedPlan",
                f"serving plan v{current.spec.version}, solved for earlier inputs: {solved[2]}",
            )
        elif rolled[1] == "RolloutFailed":
            degraded = ("True", "RolloutFailed", rolled[2])

    conditions: tuple[Condition, ...] = (
        _condition(prev, SOLVED, *solved, gen, now),
        _condition(prev, ROLLED_OUT, *rolled, gen, now),
        _condition(prev, DEGRADED, *degraded, gen, now),
    )
    slo = _interactive_slo(observed, tiers, input_error)
    if slo is not None:
        conditions += (_condition(prev, INTERACTIVE_SLO, *slo, gen, now),)
    if current is None:
        return ModelDeploymentStatus(
            observed_generation=gen, conditions=conditions, last_solve=record, tiers=tiers
        )
    s = current.spec
    prices = inputs.prices if inputs is not None else None
    if prices is None:
        with contextlib.suppress(PermanentError):
            prices = effective_prices(observed)
    per_hour, per_mtok = plan_spec_cost(s, prices) if prices is not None else (None, None)
    return ModelDeploymentStatus(
        observed_generation=gen,
        conditions=conditions,
        current_plan=PlanRef(current.name, s.plan_id, s.version),
        predicted_step_time_us=s.step_time_us,
        predicted_tokens_per_s=s.tokens_per_s,
        cost_per_hour_usd=per_hour,
        cost_per_million_tokens_usd=per_mtok,
        tiers=tiers,
        gpus=len(s.gpus),
        nodes=s.nodes,
        config_map=config_map_name(d.name) if cm_wanted else None,
        last_solve=record,
    )


def _interactive_slo(
    observed: Observed, tiers: TiersStatus | None, input_error: PermanentError | None
) -> tuple[str, str, str] | None:
    """``(status, reason, message)`` of the InteractiveSLO condition; None without an
    interactive tier."""
    if observed.policy.interactive is None:
        return None
    if tiers is None:
        why = f"{input_error.reason}: {input_error}" if input_error else "not planned yet"
        return "Unknown", "NotPlanned", f"the tier split waits for a solvable deployment ({why})"
    if tiers.outcome == "Failed":
        return "False", tiers.reason, tiers.message
    return ("True" if tiers.slo_met else "False"), tiers.reason, tiers.message


def plan_spec_cost(
    spec: PartitionPlanSpec, prices: PriceTable
) -> tuple[float | None, float | None]:
    """``(USD per hour, USD per million tokens)`` of a plan: its GPUs at ``prices`` over its
    predicted tokens/s. ``(None, None)`` when a GPU model has no price; the per-token cost
    is None when the plan produces nothing."""
    try:
        per_hour = sum(prices.price(g.model) for g in spec.gpus)
    except InputError:
        return None, None
    per_mtok = usd_per_million_tokens(per_hour, spec.tokens_per_s)
    return round(per_hour, 4), (round(per_mtok, 6) if math.isfinite(per_mtok) else None)
