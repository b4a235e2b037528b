"""The ModelDeployment document (parsed YAML or JSON) of a deployment spec:
:func:`parse_deployment` reads and checks one, :func:`spec_to_doc` writes one back.

Re-exported by :mod:`policies.spec.build`, the deployment spec's front door; import from there.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from policies.defaults import (
    DEFAULT_FORM,
    DEFAULT_POLICY,
    DEFAULT_PREPARE_TIMEOUT_S,
    DEFAULT_SOLVER_TIME_LIMIT_S,
    default_tokens_per_gpu,
)
from policies.errors import InputError
from policies.estimate.engines import EngineSpec, engine_to_doc, parse_engine
from policies.keys import check_keys
from policies.limits import MAX_WIRE_INT32
from policies.scheduling.fields import KEYS as SCHEDULING_KEYS
from policies.scheduling.fields import fields_from_doc, fields_to_doc
from policies.serving.traffic import slo_from_doc, slo_to_doc, traffic_from_doc, traffic_to_doc
from policies.spec.check import _int, _number, check_spec
from policies.spec.types import Budget, DeploymentSpec, RebalanceSpec, WorkloadSpec

API_VERSION = "mixfleet.io/v1alpha1"
KIND = "ModelDeployment"


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
