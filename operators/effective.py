"""A ModelDeployment resolved against its PlacementPolicy (deployment > policy > built-in):
its model (:func:`model_of`), solver settings (:func:`effective_settings`), prices
(:func:`effective_prices`), and the one :class:`policies.spec.build.DeploymentSpec` every path
solves (:func:`effective_spec`). Pure: errors in the spec are raised as
:class:`apis.kube.errors.PermanentError` with a reason and a fix.

Re-exported by :mod:`operators.inputs`, which builds the solve inputs from them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from dataclasses import fields as _fields
from typing import Any, TypeVar

from apis.kube.errors import PermanentError
from apis.kube.schema import to_wire
from apis.kube.v1alpha1 import ModelDeploymentSpec, PlacementPolicySpec, WorkloadSpec
from operators.observe import Observed
from policies.advice.cost import PriceTable, catalog_price_table
from policies.defaults import default_tokens_per_gpu
from policies.errors import InputError
from policies.estimate.engines import EngineSpec, parse_engine
from policies.model.architecture import ModelSpec, from_hf_config, preset
from policies.spec.build import DeploymentSpec, serving_from_doc
from policies.spec.build import RebalanceSpec as SpecRebalance
from policies.spec.build import WorkloadSpec as SpecWorkload

_T = TypeVar("_T")


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


def effective_spec(
    name: str, spec: ModelDeploymentSpec, policy: PlacementPolicySpec
) -> DeploymentSpec:
    """The ModelDeployment's spec resolved against its PlacementPolicy (deployment > policy
    > built-in): the one :class:`policies.spec.build.DeploymentSpec` that every path solves."""
    eff = effective_settings(spec, policy)
    rb = spec.rebalance or policy.rebalance
    defaults = DeploymentSpec(name=name)
    return DeploymentSpec(
        name=name,
        model=spec.model or "",
        model_config=spec.model_config if spec.model is None else None,
        workload=workload_spec(spec.workload),
        policy=eff.policy,
        form=spec.form,
        redundant_experts=eff.redundant_experts,
        node_selector=dict(spec.node_selector),
        solver_time_limit_s=eff.time_limit_s,
        prepare_timeout_s=spec.prepare_timeout_s or defaults.prepare_timeout_s,
        rebalance=_same_fields(SpecRebalance, rb),
        allow_cross_vendor=allow_cross_vendor(spec, policy),
        gpu_hour_prices={**policy.gpu_hour_prices, **spec.gpu_hour_prices},
        engine=deployment_engine(spec),
        priority=spec.priority,
        min_gpus=spec.min_gpus,
        max_gpus=spec.max_gpus,
        objective=spec.objective,
        slo_step_time_ms=spec.slo_step_time_ms,
        memory_fraction=spec.memory_fraction,
        namespace=spec.namespace,
        **deployment_serving(spec),
    )


def deployment_serving(spec: ModelDeploymentSpec) -> dict[str, Any]:
    """The deployment's demand fields (traffic, slo, disaggregation, budget) through the
    document's one parser (:func:`policies.spec.build.serving_from_doc`).

    Raises:
        PermanentError: ``InvalidSpec`` naming the field (``spec.traffic.inputTokens.p90``).
    """
    doc = {
        k: v
        for k, v in to_wire(spec).items()
        if k in ("traffic", "slo", "disaggregation", "budget")
    }
    try:
        return serving_from_doc(doc)
    except InputError as exc:
        raise PermanentError("InvalidSpec", str(exc)) from exc


def deployment_engine(spec: ModelDeploymentSpec) -> EngineSpec:
    """The deployment's target engine through the one engine parser
    (:func:`policies.estimate.engines.parse_engine`); unset is ``native``.

    Raises:
        PermanentError: ``InvalidSpec`` naming the field (an option the engine lacks).
    """
    try:
        return parse_engine({} if spec.engine is None else to_wire(spec.engine), "spec.engine")
    except InputError as exc:
        raise PermanentError("InvalidSpec", str(exc)) from exc


def workload_spec(w: WorkloadSpec) -> SpecWorkload:
    """The CR's workload as the one spec type, an unset ``tokensPerGpu`` resolved to the
    phase's default (:func:`policies.defaults.default_tokens_per_gpu`)."""
    shared = {f.name for f in _fields(w)}
    same = SpecWorkload(**{n: getattr(w, n) for n in shared if n != "tokens_per_gpu"})
    tokens = w.tokens_per_gpu or default_tokens_per_gpu(w.phase)
    return replace(same, tokens_per_gpu=tokens, tokens_per_gpu_set=w.tokens_per_gpu is not None)


def _same_fields(cls: type[_T], source: object) -> _T:
    """A ``cls`` from the equally named fields of the CRD type ``source`` (the two are kept
    field-for-field equal by tests/policies/test_spec.py)."""
    return cls(**{f.name: getattr(source, f.name) for f in _fields(cls)})  # type: ignore[arg-type]
