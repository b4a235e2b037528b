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

Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from policies.cost import PriceTable, catalog_price_table, plan_cost
from policies.costmodel import CostSettings, MeasuredFigures
from policies.defaults import (
    DEFAULT_FORM,
    DEFAULT_POLICY,
    DEFAULT_PREPARE_TIMEOUT_S,
    DEFAULT_SOLVER_TIME_LIMIT_S,
    default_tokens_per_gpu,
)
from policies.engines import EngineSpec, check_engine, engine_to_doc, parse_engine
from policies.errors import InputError
from policies.fleet import Fleet
from policies.keys import check_keys
from policies.limits import (
    MAX_ABS_INTEGER,
    MAX_CONTEXT_TOKENS,
    MAX_DURATION_S,
    MAX_EXPERTS,
    MAX_TOKENS_PER_GPU,
    MAX_WIRE_INT32,
    bounded_int,
)
from policies.models import ModelSpec, from_hf_config, preset
from policies.plan import FORMS, Plan
from policies.request import POLICIES, PlacementRequest, SolverOptions
from policies.scheduling.fields import KEYS as SCHEDULING_KEYS
from policies.scheduling.fields import check_fields, fields_from_doc, fields_to_doc
from policies.serving.traffic import (
    check_slo,
    check_traffic,
    slo_from_doc,
    slo_to_doc,
    traffic_from_doc,
    traffic_to_doc,
)
from policies.spec_types import DISAGGREGATION as DISAGGREGATION
from policies.spec_types import Budget as Budget
from policies.spec_types import DeploymentSpec as DeploymentSpec
from policies.spec_types import RebalanceSpec as RebalanceSpec
from policies.spec_types import WorkloadSpec as WorkloadSpec
from policies.workload import (
    KV_DTYPES,
    PHASES,
    Workload,
    make_workload,
    synthetic_zipf,
)

API_VERSION = "mixfleet.io/v1alpha1"
KIND = "ModelDeployment"
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


# ---------------------------------------------------------------------- validation


def _number(
    v: Any,
    path: str,
    *,
    positive: bool = True,
    allow_zero: bool = False,
    maximum: float = math.inf,
) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise InputError(f"must be a finite number, got {v!r}", field=path)
    if positive and (v < 0 or (v == 0 and not allow_zero)):
        raise InputError(f"must be {'>=' if allow_zero else '>'} 0, got {v!r}", field=path)
    if v > maximum:
        raise InputError(f"must be at most {maximum:g}, got {v!r}", field=path)
    return float(v)


def _int(v: Any, path: str, *, minimum: int = 1, maximum: int = MAX_ABS_INTEGER) -> int:
    return bounded_int(v, path, minimum=minimum, maximum=maximum)


def check_spec(spec: DeploymentSpec, *, path: str = "spec") -> ModelSpec:
    """Validate a spec; returns its model.

    Raises:
        InputError: naming the field (``spec.workload.phase`` ...).
    """
    if not _NAME_RE.match(spec.name or ""):
        raise InputError(
            f"{spec.name!r} is not a valid name. To fix: use lower-case letters, digits and "
            "'-', at most 63 characters, starting and ending with a letter or digit",
            field="metadata.name",
        )
    model = resolve_model(spec, path=path)
    w = spec.workload
    if w.phase not in PHASES:
        raise InputError(
            f"must be one of {PHASES}, got {w.phase!r}", field=f"{path}.workload.phase"
        )
    _int(w.tokens_per_gpu, f"{path}.workload.tokensPerGpu", maximum=MAX_TOKENS_PER_GPU)
    _int(w.context_len, f"{path}.workload.contextLen", maximum=MAX_CONTEXT_TOKENS)
    if w.kv_cache_dtype not in KV_DTYPES:
        raise InputError(
            f"must be one of {KV_DTYPES}, got {w.kv_cache_dtype!r}",
            field=f"{path}.workload.kvCacheDtype",
        )
    if w.load not in ("", "uniform", "measured") and not w.load.startswith("synthetic:"):
        raise InputError(
            f"unknown load {w.load!r}. To fix: use uniform, measured or synthetic:zipf:S:seed=N",
            field=f"{path}.workload.load",
        )
    try:
        workload_for(spec, model, measured=None)
    except InputError as exc:
        raise InputError(str(exc), field=f"{path}.workload.{exc.field or 'load'}") from exc
    if spec.policy not in POLICIES:
        raise InputError(f"must be one of {POLICIES}, got {spec.policy!r}", field=f"{path}.policy")
    if spec.form not in FORMS:
        raise InputError(f"must be one of {FORMS}, got {spec.form!r}", field=f"{path}.form")
    if spec.redundant_experts is not None:
        _int(spec.redundant_experts, f"{path}.redundantExperts", minimum=0, maximum=MAX_EXPERTS)
    for k, v in spec.node_selector.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k:
            raise InputError(
                f"labels must be non-empty strings, got {k!r}: {v!r}", field=f"{path}.nodeSelector"
            )
    _number(spec.solver_time_limit_s, f"{path}.solverTimeLimitS", maximum=MAX_DURATION_S)
    _number(spec.prepare_timeout_s, f"{path}.prepareTimeoutS", maximum=MAX_DURATION_S)
    r = spec.rebalance
    _number(r.imbalance_threshold, f"{path}.rebalance.imbalanceThreshold")
    _number(r.sustain_s, f"{path}.rebalance.sustainS", allow_zero=True, maximum=MAX_DURATION_S)
    _number(
        r.min_interval_s, f"{path}.rebalance.minIntervalS", allow_zero=True, maximum=MAX_DURATION_S
    )
    _number(r.migration_weight_us, f"{path}.rebalance.migrationWeightUs", allow_zero=True)
    if not isinstance(spec.allow_cross_vendor, bool):
        raise InputError(
            f"must be true or false, got {spec.allow_cross_vendor!r}",
            field=f"{path}.allowCrossVendor",
        )
    price_table(spec, path=path)
    if not isinstance(spec.engine, EngineSpec):
        raise InputError(f"must be an engine spec, got {spec.engine!r}", field=f"{path}.engine")
    check_engine(spec.engine, f"{path}.engine")
    check_fields(spec, path)
    check_serving(spec, path)
    return model


def check_serving(spec: DeploymentSpec, path: str = "spec") -> None:
    """Validate the demand fields (``traffic``, ``slo``, ``disaggregation``, ``budget``) and
    refuse the ones that contradict each other or an older field.

    Raises:
        InputError: naming the field and how to fix it.
    """
    if spec.traffic is not None:
        check_traffic(spec.traffic, f"{path}.traffic")
    if spec.slo is not None:
        check_slo(spec.slo, f"{path}.slo")
        tpot = spec.slo.tpot_ms
        if spec.slo_step_time_ms and tpot and spec.slo_step_time_ms != tpot:
            raise InputError(
                f"sloStepTimeMs {spec.slo_step_time_ms:g} contradicts slo.tpotMs {tpot:g} "
                "(both are the time per output token). To fix: drop sloStepTimeMs",
                field=f"{path}.sloStepTimeMs",
            )
    if spec.disaggregation not in DISAGGREGATION:
        raise InputError(
            f"must be one of {', '.join(DISAGGREGATION)}, got {spec.disaggregation!r}",
            field=f"{path}.disaggregation",
        )
    if spec.disaggregation == "on" and spec.traffic is None:
        raise InputError(
            "disaggregation on needs traffic (its prompt lengths size the prefill pool). "
            "To fix: give spec.traffic or set disaggregation: auto",
            field=f"{path}.disaggregation",
        )
    b = spec.budget
    if not isinstance(b, Budget):
        raise InputError(f"must be a budget, got {b!r}", field=f"{path}.budget")
    _number(b.usd_per_hour, f"{path}.budget.usdPerHour", allow_zero=True)
    gpus = _int(b.gpus, f"{path}.budget.gpus", minimum=0, maximum=MAX_WIRE_INT32)
    if gpus and spec.max_gpus and gpus != spec.max_gpus:
        raise InputError(
            f"budget.gpus {gpus} contradicts maxGpus {spec.max_gpus} (both cap its GPUs). "
            "To fix: keep one of the two",
            field=f"{path}.budget.gpus",
        )
    if gpus and spec.min_gpus > gpus:
        raise InputError(
            f"minGpus {spec.min_gpus} is above budget.gpus {gpus}. To fix: lower minGpus or "
            "raise the budget",
            field=f"{path}.budget.gpus",
        )


def price_table(spec: DeploymentSpec, *, path: str = "spec") -> PriceTable:
    """The prices a deployment's cost is reported with: the built-in assumed prices, with
    the spec's ``gpu_hour_prices`` replacing them (USD per GPU-hour).

    Raises:
        InputError: a name that is not a catalog GPU model (the closest are suggested) or a
            price that is not a finite number >= 0.
    """
    if not isinstance(spec.gpu_hour_prices, Mapping):
        raise InputError(
            "must map catalog GPU models to USD per GPU-hour", field=f"{path}.gpuHourPrices"
        )
    return catalog_price_table(
        spec.gpu_hour_prices,
        field_path=f"{path}.gpuHourPrices",
        source=f"deployment {spec.name} gpuHourPrices over the assumed defaults",
    )


def resolve_model(spec: DeploymentSpec, *, path: str = "spec") -> ModelSpec:
    """The spec's model (preset or inline config).

    Raises:
        InputError: unknown preset, bad config, or neither given.
    """
    if spec.model:
        try:
            return preset(spec.model)
        except InputError as exc:
            raise InputError(str(exc), field=f"{path}.model") from exc
    if spec.model_config is not None:
        try:
            return from_hf_config(dict(spec.model_config), spec.name)
        except InputError as exc:
            raise InputError(str(exc), field=f"{path}.modelConfig.{exc.field}") from exc
    raise InputError("give a model preset or a modelConfig", field=f"{path}.model")


def workload_for(
    spec: DeploymentSpec, model: ModelSpec, *, measured: Sequence[Sequence[float]] | None
) -> Workload:
    """The workload to solve for; ``measured`` is the aggregated load windows (or None).

    Raises:
        InputError: bad sizes or load shape.
    """
    w = spec.workload
    load: Sequence[Sequence[float]] | None = None
    source = w.load or "uniform"
    if w.load_matrix is not None:
        load, source = w.load_matrix, "spec"
    elif measured is not None and w.load == "measured":
        load = measured
    elif measured is not None:
        load, source = measured, "measured"
    elif w.load.startswith("synthetic:"):
        load = synthetic_zipf(model, w.load)
    if not model.is_moe:
        load = None
    return make_workload(
        model,
        phase=w.phase,
        tokens_per_gpu=w.tokens_per_gpu,
        context_len=w.context_len,
        load=load,
        kv_cache_dtype=w.kv_cache_dtype,
        load_source=source if load is not None else "uniform",
    )


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
            PlacementPolicy, :func:`operators.inputs.effective_spec`).
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


# ---------------------------------------------------------------------- documents


def _camel(name: str) -> str:
    """The document's key of a dataclass field (``tokens_per_gpu`` -> ``tokensPerGpu``)."""
    head, *rest = name.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


#: Keys a ModelDeployment's ``spec`` may have.
_SPEC_FIELDS = (
    frozenset({"model", "modelConfig", "workload", "nodeSelector", "gpuHourPrices"})
    | {"allowCrossVendor", "policy", "form", "redundantExperts", "solverTimeLimitS"}
    | {"prepareTimeoutS", "rebalance", "engine"}
    | {"traffic", "slo", "disaggregation", "budget"}  # demand (policies.serving)
    | set(SCHEDULING_KEYS)  # the fleet scheduler's (policies.scheduling.fields)
    | {"policyRef", "engineFormat"}  # Kubernetes operator fields: read there, ignored here
)
#: Keys of the document, its ``metadata``, ``spec.workload`` and ``spec.rebalance``
#: (``status`` is what the controller reports: accepted on apply and not read, as kubectl).
_DOCUMENT_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")
_METADATA_FIELDS = ("name", "namespace", "labels", "annotations")
_WORKLOAD_FIELDS = tuple(
    _camel(f.name) for f in fields(WorkloadSpec) if f.name != "tokens_per_gpu_set"
)
_BUDGET_FIELDS = ("usdPerHour", "gpus")
_REBALANCE_FIELDS = tuple(_camel(f.name) for f in fields(RebalanceSpec))


def parse_deployment(doc: Any) -> DeploymentSpec:
    """Read a ModelDeployment document (parsed YAML or JSON) and validate it.

    Raises:
        InputError: naming the field.
    """
    if not isinstance(doc, Mapping):
        raise InputError("a deployment must be a mapping", field="")
    check_keys(doc, _DOCUMENT_FIELDS, "")
    if doc.get("apiVersion", API_VERSION) != API_VERSION:
        raise InputError(
            f"unsupported apiVersion {doc.get('apiVersion')!r}; this mixfleet reads {API_VERSION}",
            field="apiVersion",
        )
    if doc.get("kind", KIND) != KIND:
        raise InputError(f"must be {KIND}, got {doc.get('kind')!r}", field="kind")
    meta = doc.get("metadata") or {}
    spec = doc.get("spec")
    if not isinstance(meta, Mapping):
        raise InputError("must be a mapping", field="metadata")
    if not isinstance(spec, Mapping):
        raise InputError("missing or not a mapping", field="spec")
    check_keys(meta, _METADATA_FIELDS, "metadata")
    check_keys(spec, _SPEC_FIELDS, "spec")
    w = _mapping(spec, "workload", "must be a mapping")
    check_keys(w, _WORKLOAD_FIELDS, "spec.workload")
    rb = _mapping(spec, "rebalance", "must be a mapping")
    check_keys(rb, _REBALANCE_FIELDS, "spec.rebalance")
    cfg = spec.get("modelConfig")
    if cfg is not None and not isinstance(cfg, Mapping):
        raise InputError("must be a mapping (a config.json)", field="spec.modelConfig")
    selector = _mapping(spec, "nodeSelector", "must be a mapping of label: value")
    prices = _mapping(
        spec,
        "gpuHourPrices",
        "must be a mapping of catalog GPU model: USD per GPU-hour. To fix: write e.g. "
        "gpuHourPrices: {H100-SXM5-80GB: 2.5}",
    )
    cross = spec.get("allowCrossVendor")
    dr = RebalanceSpec()
    out = DeploymentSpec(
        name=str(meta.get("name", "")),
        model=str(spec.get("model", "") or ""),
        model_config=dict(cfg) if cfg is not None else None,
        workload=_workload_spec(w),
        policy=spec.get("policy", DEFAULT_POLICY),
        form=spec.get("form", DEFAULT_FORM),
        redundant_experts=spec.get("redundantExperts"),
        node_selector={str(k): str(v) for k, v in selector.items()},
        solver_time_limit_s=spec.get("solverTimeLimitS", DEFAULT_SOLVER_TIME_LIMIT_S),
        prepare_timeout_s=spec.get("prepareTimeoutS", DEFAULT_PREPARE_TIMEOUT_S),
        rebalance=RebalanceSpec(
            enabled=bool(rb.get("enabled", dr.enabled)),
            imbalance_threshold=rb.get("imbalanceThreshold", dr.imbalance_threshold),
            sustain_s=rb.get("sustainS", dr.sustain_s),
            min_interval_s=rb.get("minIntervalS", dr.min_interval_s),
            migration_weight_us=rb.get("migrationWeightUs", dr.migration_weight_us),
        ),
        allow_cross_vendor=False if cross is None else cross,
        gpu_hour_prices={str(k): v for k, v in prices.items()},
        engine=parse_engine(_or_empty(spec.get("engine")), "spec.engine"),
        **fields_from_doc(spec),
        **serving_from_doc(spec),
    )
    check_spec(out)
    return out


def serving_from_doc(spec: Mapping[str, Any], path: str = "spec") -> dict[str, Any]:
    """The demand fields of a ``spec`` mapping as DeploymentSpec keyword arguments, each
    block read by its one parser (:mod:`policies.serving.traffic`); absent keys take the
    defaults.

    Raises:
        InputError: naming the field.
    """
    out: dict[str, Any] = {}
    if spec.get("traffic") is not None:
        out["traffic"] = traffic_from_doc(spec["traffic"], f"{path}.traffic")
    if spec.get("slo") is not None:
        out["slo"] = slo_from_doc(spec["slo"], f"{path}.slo")
    if spec.get("disaggregation") is not None:
        out["disaggregation"] = spec["disaggregation"]
    if spec.get("budget") is not None:
        out["budget"] = budget_from_doc(spec["budget"], f"{path}.budget")
    return out


def budget_from_doc(doc: Any, path: str) -> Budget:
    """A budget of ``{usdPerHour, gpus}`` (at least one of the two).

    Raises:
        InputError: naming the field.
    """
    if not isinstance(doc, Mapping):
        raise InputError("must be a mapping: {usdPerHour: USD, gpus: N}", field=path)
    check_keys(doc, _BUDGET_FIELDS, path)
    if not doc.get("usdPerHour") and not doc.get("gpus"):
        raise InputError(
            "gives no limit. To fix: set usdPerHour and/or gpus (> 0), or drop budget",
            field=path,
        )
    usd = _number(doc.get("usdPerHour", 0.0), f"{path}.usdPerHour", allow_zero=True)
    gpus = _int(doc.get("gpus", 0), f"{path}.gpus", minimum=0, maximum=MAX_WIRE_INT32)
    return Budget(usd_per_hour=usd, gpus=gpus)


def serving_to_doc(spec: DeploymentSpec) -> dict[str, Any]:
    """The demand fields of a spec away from their defaults, as document keys (inverse of
    :func:`serving_from_doc`)."""
    out: dict[str, Any] = {}
    if spec.traffic is not None:
        out["traffic"] = traffic_to_doc(spec.traffic)
    if spec.slo is not None:
        out["slo"] = slo_to_doc(spec.slo)
    if spec.disaggregation != "auto":
        out["disaggregation"] = spec.disaggregation
    b = spec.budget
    if b != Budget():
        out["budget"] = {k: v for k, v in (("usdPerHour", b.usd_per_hour), ("gpus", b.gpus)) if v}
    return out


def _or_empty(value: Any) -> Any:
    """``value``, or ``{}`` for an absent (null) block."""
    return {} if value is None else value


def _mapping(spec: Mapping[str, Any], key: str, message: str) -> Mapping[str, Any]:
    """``spec[key]`` as a mapping (absent or null: empty)."""
    value = spec.get(key) or {}
    if not isinstance(value, Mapping):
        raise InputError(message, field=f"spec.{key}")
    return value


def _workload_spec(w: Mapping[str, Any]) -> WorkloadSpec:
    """The ``spec.workload`` block (missing keys take the defaults; checked by check_spec)."""
    d = WorkloadSpec()
    matrix = w.get("loadMatrix")
    return WorkloadSpec(
        phase=w.get("phase", d.phase),
        tokens_per_gpu=w.get("tokensPerGpu", default_tokens_per_gpu(w.get("phase", d.phase))),
        tokens_per_gpu_set=w.get("tokensPerGpu") is not None,
        context_len=w.get("contextLen", d.context_len),
        kv_cache_dtype=w.get("kvCacheDtype", d.kv_cache_dtype),
        load=str(w.get("load", d.load)),
        load_matrix=None if matrix is None else load_matrix(matrix, "spec.workload.loadMatrix"),
    )


def load_matrix(v: Any, path: str) -> tuple[tuple[float, ...], ...]:
    if isinstance(v, Mapping):
        v = v.get("logical_count")
    if not isinstance(v, list) or not all(isinstance(r, list) for r in v):
        raise InputError("must be a [layers][experts] list of numbers", field=path)
    rows = []
    for i, row in enumerate(v):
        rows.append(tuple(_number(x, f"{path}[{i}]", allow_zero=True) for x in row))
    return tuple(rows)


def spec_to_doc(spec: DeploymentSpec) -> dict[str, Any]:
    """The ModelDeployment document of a spec (inverse of :func:`parse_deployment`)."""
    w = spec.workload
    workload: dict[str, Any] = {"phase": w.phase}
    if w.tokens_per_gpu_set:
        workload["tokensPerGpu"] = w.tokens_per_gpu
    workload |= {
        "contextLen": w.context_len,
        "kvCacheDtype": w.kv_cache_dtype,
        "load": w.load,
    }
    if w.load_matrix is not None:
        workload["loadMatrix"] = [list(r) for r in w.load_matrix]
    body: dict[str, Any] = {"workload": workload}
    if spec.model:
        body["model"] = spec.model
    if spec.model_config is not None:
        body["modelConfig"] = dict(spec.model_config)
    body.update(policy=spec.policy, form=spec.form)
    if spec.redundant_experts is not None:
        body["redundantExperts"] = spec.redundant_experts
    if spec.node_selector:
        body["nodeSelector"] = dict(spec.node_selector)
    r = spec.rebalance
    body.update(
        solverTimeLimitS=spec.solver_time_limit_s,
        prepareTimeoutS=spec.prepare_timeout_s,
        rebalance={
            "enabled": r.enabled,
            "imbalanceThreshold": r.imbalance_threshold,
            "sustainS": r.sustain_s,
            "minIntervalS": r.min_interval_s,
            "migrationWeightUs": r.migration_weight_us,
        },
    )
    if spec.allow_cross_vendor:
        body["allowCrossVendor"] = True
    if spec.gpu_hour_prices:
        body["gpuHourPrices"] = dict(spec.gpu_hour_prices)
    if spec.engine != EngineSpec():
        body["engine"] = engine_to_doc(spec.engine)
    body.update(fields_to_doc(spec))
    body.update(serving_to_doc(spec))
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": spec.name}, "spec": body}
