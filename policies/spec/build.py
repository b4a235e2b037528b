"""The deployment spec: what a user asks mixfleet to serve, and the one way it becomes a solve.

Every path that plans a deployment - the standalone controller, the Kubernetes operator,
``mixfleetctl plan`` and the strategy services - reads a :class:`DeploymentSpec` and calls
:func:`to_request`. The YAML/JSON document (:func:`parse_deployment` / :func:`spec_to_doc`),
the protobuf codec (:mod:`apis.wire.deployment`) and the ModelDeployment CRD schema
(:mod:`apis.kube.v1alpha1`) are checked against this type by ``tests/policies/test_spec.py``.

A deployment document (YAML, ``examples/deployments/*.yaml``)::

    apiVersion: mixfleet.io/v1alpha1
    kind: ModelDeployment
    metadata: {name: dsv3}
    spec:
      model: deepseek-v3            # a preset; or modelConfig: {... Hugging Face config.json ...}
      workload: {phase: decode, tokensPerGpu: 64, contextLen: 4096, kvCacheDtype: bf16,
                 load: uniform}     # uniform | synthetic:zipf:S[:seed=N] | measured
      policy: ilp                   # ilp | greedy | eplb | uniform
      form: engine                  # engine | native
      redundantExperts: 32          # optional; default the smallest valid count
      nodeSelector: {rack: r1}      # optional; nodes whose labels contain all of these
      solverTimeLimitS: 60
      prepareTimeoutS: 30
      rebalance: {enabled: true, imbalanceThreshold: 0.15, sustainS: 60, minIntervalS: 300,
                  migrationWeightUs: 2}
      allowCrossVendor: false       # optional; let the all-to-all span NVIDIA and AMD GPUs
      gpuHourPrices: {H100-SXM5-80GB: 2.5}   # optional; USD per GPU-hour, catalog names
      engine: {name: sglang, version: "", # optional; native (default) | sglang | vllm | trtllm
               options: {a2aBackend: auto, dispatch: auto, dpBalance: auto}}
      traffic: {requestsPerS: 20,   # optional demand (policies.serving.traffic), or
                outputTokensPerS: 10240 instead of requestsPerS
                inputTokens: {mean: 4096, p90: 6000}, outputTokens: {mean: 512, p90: 800},
                arrival: poisson}   # poisson | bursty (with burstCv > 1)
      slo: {ttftMs: 2000, tpotMs: 50, percentile: 90}   # optional latency targets
      disaggregation: auto          # auto | off | on (prefill/decode pools)
      budget: {usdPerHour: 400, gpus: 64}   # optional; either or both

Without ``tokensPerGpu`` in ``workload`` the phase's default fills it and
``WorkloadSpec.tokens_per_gpu_set`` is False: with traffic and an SLO the fleet planner then
chooses the batch the SLO allows; a stated ``tokensPerGpu`` is an explicit override.

The same document (as JSON) is what the store keeps; :mod:`apis.wire.deployment` carries it
over PlanService.

The checks (and the model, workload and prices they resolve) live in
:mod:`policies.spec.check`, the document's reader and writer in :mod:`policies.spec.document`;
both are re-exported here, and this module builds the request.

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from policies.advice.cost import plan_cost
from policies.errors import InputError
from policies.estimate.costmodel import CostSettings, MeasuredFigures
from policies.hardware.fleet import Fleet
from policies.model.architecture import ModelSpec
from policies.plan import Plan
from policies.request import PlacementRequest, SolverOptions
from policies.spec.check import check_serving as check_serving
from policies.spec.check import check_spec as check_spec
from policies.spec.check import price_table as price_table
from policies.spec.check import resolve_model as resolve_model
from policies.spec.check import workload_for as workload_for
from policies.spec.document import API_VERSION as API_VERSION
from policies.spec.document import KIND as KIND
from policies.spec.document import budget_from_doc as budget_from_doc
from policies.spec.document import load_matrix as load_matrix
from policies.spec.document import parse_deployment as parse_deployment
from policies.spec.document import serving_from_doc as serving_from_doc
from policies.spec.document import serving_to_doc as serving_to_doc
from policies.spec.document import spec_to_doc as spec_to_doc
from policies.spec.types import DISAGGREGATION as DISAGGREGATION
from policies.spec.types import Budget as Budget
from policies.spec.types import DeploymentSpec as DeploymentSpec
from policies.spec.types import RebalanceSpec as RebalanceSpec
from policies.spec.types import WorkloadSpec as WorkloadSpec

# ---------------------------------------------------------------------- requests


def usd_per_million_tokens(spec: DeploymentSpec, plan: Plan) -> float | None:
    """Cost of a million tokens of ``plan``: its GPUs at the spec's prices (USD per GPU-hour,
    :func:`price_table`) over its predicted throughput. None when a GPU model has no price
    (a GPU outside the catalog) or the plan produces nothing.

    Raises:
        InputError: invalid ``gpu_hour_prices``.
    """
    prices = price_table(spec)
    try:
        cost = plan_cost(plan, prices).usd_per_million_tokens
    except InputError:  # a custom GPU without a price: cost unknown, not an error
        return None
    return cost if math.isfinite(cost) else None


def round_redundancy(num_experts: int, num_gpus: int, requested: int, form: str) -> int:
    """Redundant slots per MoE layer for ``num_gpus`` GPUs: ``requested``, raised in engine
    form to the next count with equal slots per GPU (``E + r`` divisible by ``num_gpus``).
    Native form and dense models (``num_experts == 0``) keep ``requested``. The one place
    this rounding is done (the strategies' :func:`policies.deployment.engine_redundancy`
    adds its upper bound on top)."""
    if form != "engine" or num_experts <= 0 or num_gpus <= 0:
        return requested
    return requested + (-(num_experts + requested)) % num_gpus


def effective_redundant(spec: DeploymentSpec, model: ModelSpec, num_gpus: int) -> int:
    """Redundant slots for ``num_gpus`` GPUs: the spec's count, rounded by
    :func:`round_redundancy`."""
    experts = model.num_experts if model.is_moe else 0
    return round_redundancy(experts, num_gpus, spec.redundant_experts or 0, spec.form)


def redundancy_note(spec: DeploymentSpec, model: ModelSpec, num_gpus: int) -> str:
    """Why the redundant slots differ from the spec's count ("" when they do not)."""
    wanted = spec.redundant_experts or 0
    got = effective_redundant(spec, model, num_gpus)
    if not wanted or got == wanted:
        return ""
    return (
        f"redundantExperts raised from {wanted} to {got} so that "
        f"{model.num_experts} + {got} slots divide by {num_gpus} GPUs"
    )


@dataclass(frozen=True)
class SolverPolicy:
    """How hard the MILP works: what a PlacementPolicy may set beyond the deployment spec
    (standalone, the built-in defaults of :class:`~policies.request.SolverOptions`).

    Attributes:
        mip_gap: relative MIP gap at which a layer's solve stops (0.01 = 1%).
        milp_solver: ``highs`` or ``cbc``.
        workers: processes solving layers in parallel; 0 = one per CPU.
    """

    mip_gap: float = SolverOptions.mip_gap
    milp_solver: str = SolverOptions.solver
    workers: int = SolverOptions.workers


@dataclass(frozen=True)
class Measured:
    """What was measured and feeds a solve.

    Attributes:
        load: aggregated expert load ``[moe_layers][experts]`` of the engines' recent
            windows (tokens), or None.
        gpus: calibrated figures by GPU id (``node/gpuN``); GPUs not on the fleet are
            ignored.
    """

    load: Sequence[Sequence[float]] | None = None
    gpus: Mapping[str, MeasuredFigures] = field(default_factory=dict)


def to_request(
    spec: DeploymentSpec,
    policy: SolverPolicy,
    fleet: Fleet,
    *,
    measured: Measured = Measured(),
    reserved: Collection[str] = (),
    previous: Plan | None = None,
) -> PlacementRequest:
    """The planning core's request for a deployment: the one builder every path uses (the
    controller, the operator, the CLI and the strategy services).

    Args:
        spec: the deployment (for the operator: its spec resolved against the
            PlacementPolicy, :func:`operators.effective.effective_spec`).
        policy: solver knobs from the PlacementPolicy, or the defaults.
        fleet: the usable nodes (healthy GPUs only).
        measured: the measured expert load and calibrated GPU figures.
        reserved: node names to leave out (the interactive tier's nodes).
        previous: the committed plan, to make the ILP migration-aware; dropped when it is
            for another model.

    Raises:
        InputError: invalid spec (the field is named).
    """
    model = resolve_model(spec)
    workload = workload_for(spec, model, measured=measured.load)
    if reserved:
        out = set(reserved)
        kept = tuple(n for n in fleet.nodes if n.name not in out)
        fleet = Fleet(fleet.name, kept, fleet.fabric_links)
    if previous is not None and (
        previous.model != model.name or len(previous.moe_layers) != model.num_moe_layers
    ):
        previous = None
    options = SolverOptions(
        time_limit_s=spec.solver_time_limit_s,
        mip_gap=policy.mip_gap,
        solver=policy.milp_solver,
        workers=policy.workers,
    )
    if spec.rebalance.migration_weight_us > 0:
        options = replace(options, migration_weight_us=spec.rebalance.migration_weight_us)
    on_fleet = {n.name for n in fleet.nodes}
    figures = {k: v for k, v in measured.gpus.items() if k.split("/", 1)[0] in on_fleet}
    return PlacementRequest(
        fleet=fleet,
        model=model,
        workload=workload,
        policy=spec.policy,
        form=spec.form,
        redundant_experts=effective_redundant(spec, model, len(fleet.gpus)),
        options=options,
        previous=previous,
        settings=CostSettings(measured=figures),
        allow_cross_vendor=spec.allow_cross_vendor,
        engine=spec.engine,
    )


def build_request(
    spec: DeploymentSpec,
    fleet: Fleet,
    *,
    previous: Plan | None = None,
    measured: Sequence[Sequence[float]] | None = None,
) -> PlacementRequest:
    """:func:`to_request` with the built-in solver policy and only a measured load (the
    standalone controller and the CLI)."""
    return to_request(
        spec, SolverPolicy(), fleet, measured=Measured(load=measured), previous=previous
    )


def selects(spec: DeploymentSpec, labels: Mapping[str, str]) -> bool:
    """Whether a node with ``labels`` matches the spec's node selector."""
    return spec.node_selector.items() <= labels.items()
