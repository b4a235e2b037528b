"""From an observation to solve inputs: which GPUNodes are eligible (:func:`eligible_fleet`),
the deployment's settings after PlacementPolicy overrides and its prices (resolved in
:mod:`operators.effective`, re-exported here), and the one front door :func:`solve_inputs`
that builds the placement request and its digest; also the inputs of the interactive /
batch tier split (:func:`tier_inputs`). Pure: errors in the spec are raised as
:class:`apis.kube.errors.PermanentError` with a reason and a fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from apis.kube.errors import PermanentError
from apis.kube.names import (
    parse_time,
)
from apis.kube.plancodec import decode_plan
from apis.kube.schema import to_wire
from apis.kube.v1alpha1 import (
    ModelDeploymentSpec,
    PlacementPolicySpec,
    TiersStatus,
)
from operators.effective import Effective as Effective
from operators.effective import allow_cross_vendor as allow_cross_vendor
from operators.effective import deployment_engine as deployment_engine
from operators.effective import deployment_serving as deployment_serving
from operators.effective import effective_prices as effective_prices
from operators.effective import effective_settings as effective_settings
from operators.effective import effective_spec as effective_spec
from operators.effective import model_of as model_of
from operators.effective import workload_spec as workload_spec
from operators.observe import (
    NodeView,
    Observed,
    ReconcileSettings,
    current_plan,
)
from policies.advice.cost import PriceTable
from policies.advice.tiers import BatchTier, InteractiveTier, TierRequest
from policies.defaults import default_tokens_per_gpu
from policies.deployment import Deployment
from policies.errors import InputError
from policies.estimate.costmodel import MeasuredFigures, measured_from_dict
from policies.estimate.engines import EngineSpec, engine_to_doc
from policies.hardware.fleet import Fleet, Node, check_reachable, fleet_to_doc
from policies.hardware.inventory import NodeInventory
from policies.model.architecture import ModelSpec
from policies.plan import Plan
from policies.request import PlacementRequest
from policies.spec.build import (
    Measured,
    SolverPolicy,
    redundancy_note,
    to_request,
)


def digest(doc: Any) -> str:
    """16 hex digits of the SHA-256 of a JSON document (sorted keys)."""
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def selector_matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether ``labels`` carry every ``key: value`` of a node selector (empty: all)."""
    return all(labels.get(k) == v for k, v in selector.items())


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

    A node is left out when it is being deleted, cordoned or draining (its agent says so;
    the controller does not roll a plan out onto it), not matched by the selector, of
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
        if n.error:
            excluded[n.name] = n.error
            continue
        if n.spec.cordon or (n.status.agent is not None and n.status.agent.state == "draining"):
            excluded[n.name] = "cordoned" if n.spec.cordon else "its agent is draining"
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


def _check_solvable(observed: Observed) -> tuple[ModelDeploymentSpec, ModelSpec]:
    """The spec and its model, or the permanent reason why it cannot be solved."""
    d = observed.deployment
    if d.spec is None:
        raise PermanentError("InvalidSpec", d.spec_error or "spec does not parse")
    spec = d.spec
    if observed.policy_error:
        name = observed.policy_name
        raise PermanentError(
            "InvalidPolicy",
            f"PlacementPolicy {name!r} does not parse: {observed.policy_error}. To fix: "
            f"correct it (kubectl edit placementpolicy {name}); deployments using other "
            "policies are not affected",
        )
    if observed.policy_missing:
        raise PermanentError(
            "PolicyNotFound",
            f"PlacementPolicy {observed.policy_missing!r} does not exist. To fix: create it "
            "(kubectl apply -f placementpolicy.yaml) or remove spec.policyRef",
        )
    model = model_of(spec, d.name)
    if spec.engine_format != "none" and not model.is_moe:
        raise PermanentError(
            "NothingToExport",
            f"{model.name} is a dense model: there is no expert placement to publish as "
            f"{spec.engine_format}. To fix: set spec.engineFormat: none",
        )
    return spec, model


def _check_nodes(view: FleetView, fleet: Fleet, reserved: Mapping[str, str]) -> None:
    """Raises ``NoEligibleNodes`` when no GPU is left to plan on, saying why."""
    if fleet.gpus:
        return
    if reserved and view.fleet.gpus:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(reserved.items())[:10])
        raise PermanentError(
            "NoEligibleNodes",
            f"every eligible GPUNode is reserved for the interactive tier ({why}); none is "
            "left for the batch tier, which is this deployment's plan. To fix: add GPUNodes, "
            "lower the policy's interactive.requestsPerS or relax its tpotMs / ttftMs",
        )
    why = "; ".join(f"{k}: {v}" for k, v in sorted(view.excluded.items())[:10])
    raise PermanentError(
        "NoEligibleNodes",
        "no GPUNode is eligible"
        + (f" ({why})" if why else " (none matches spec.nodeSelector)")
        + ". To fix: uncordon nodes, check their agents' heartbeats, or widen "
        "spec.nodeSelector / the policy's tiers",
    )


def solve_inputs(
    observed: Observed,
    settings: ReconcileSettings,
    *,
    reserved: Mapping[str, str] | None = None,
) -> SolveInputs:
    """Build the placement request of a deployment from its spec, policy and GPUNodes,
    through :func:`effective_spec` and the one request builder
    :func:`policies.spec.build.to_request` (the controller's too).

    Args:
        observed: the observation.
        settings: decision knobs.
        reserved: eligible nodes to leave out of the plan, with why (the interactive tier).

    Raises:
        PermanentError: the spec cannot be solved as it stands (reason says why).
    """
    spec, model = _check_solvable(observed)
    prices = effective_prices(observed)
    policy = observed.policy
    eff = effective_settings(spec, policy)
    resolved = effective_spec(observed.deployment.name, spec, policy)
    view = eligible_fleet(
        observed.nodes, spec.node_selector, policy, observed.now, settings.node_stale_after_s
    )
    reserved = dict(reserved or {})
    try:
        request = to_request(
            resolved,
            SolverPolicy(policy.mip_gap, policy.milp_solver, policy.workers),
            view.fleet,
            measured=Measured(gpus=view.measured),
            reserved=reserved,
            previous=_previous_plan(observed, model),
        )
    except InputError as exc:
        raise PermanentError("InvalidWorkload", f"spec.workload: {exc}") from exc
    fleet = request.fleet
    _check_nodes(view, fleet, reserved)
    try:  # the one reachability check (policies.hardware.fleet), here on the GPUNodes' inventories
        check_reachable(fleet, field="")
    except InputError as exc:
        raise PermanentError(
            "NodesUnreachable",
            f"{exc}. A GPUNode's fabrics are its agent's (status.inventory.nics[].fabric: "
            "mixfleet-agent --nic-fabric DEVICE=NAME or --default-fabric NAME)",
        ) from exc
    w = request.workload
    load = w.expert_load if model.is_moe and w.load_source != "uniform" else None
    solve_doc: dict[str, Any] = {
        "model": spec.model or spec.model_config,
        "workload": to_wire(spec.workload),
        "form": spec.form,
        "effective": dataclasses.asdict(eff),
        "solver": [policy.milp_solver, policy.mip_gap, policy.workers],
        "redundant": request.redundant_experts,
        "fleet": fleet_to_doc(fleet),
        "measured": {
            k: dataclasses.asdict(v) for k, v in sorted(request.settings.measured.items())
        },
    }
    if resolved.allow_cross_vendor:  # only when set, so existing digests stay as they were
        solve_doc["allowCrossVendor"] = True
    if resolved.engine != EngineSpec():  # likewise
        solve_doc["engine"] = engine_to_doc(resolved.engine)
    return SolveInputs(
        request,
        digest(solve_doc),
        view,
        redundancy_note(resolved, model, len(fleet.gpus)),
        effective=eff,
        load=(load, w.load_source if load is not None else "uniform"),
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
        batch=BatchTier(
            phase=w.phase,
            tokens_per_gpu=w.tokens_per_gpu or default_tokens_per_gpu(w.phase),
            context_len=w.context_len,
        ),
        preference=tier.preference,
        allow_cross_vendor=req.allow_cross_vendor,
        prices=inputs.prices,
    )
    return TierInputs(request, key)


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
