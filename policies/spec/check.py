"""Checking a :class:`~policies.spec.types.DeploymentSpec`, and resolving what the check
and the request builder both need from it: its model, its workload and its prices.

Re-exported by :mod:`policies.spec.build`, the deployment spec's front door; import from there.

Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from policies.advice.cost import PriceTable, catalog_price_table
from policies.errors import InputError
from policies.estimate.engines import EngineSpec, check_engine
from policies.estimate.workload import KV_DTYPES, PHASES, Workload, make_workload, synthetic_zipf
from policies.limits import (
    MAX_ABS_INTEGER,
    MAX_CONTEXT_TOKENS,
    MAX_DURATION_S,
    MAX_EXPERTS,
    MAX_TOKENS_PER_GPU,
    MAX_WIRE_INT32,
    bounded_int,
)
from policies.model.architecture import ModelSpec, from_hf_config, preset
from policies.plan import FORMS
from policies.request import POLICIES
from policies.scheduling.fields import check_fields
from policies.serving.traffic import check_slo, check_traffic
from policies.spec.types import DISAGGREGATION, Budget, DeploymentSpec

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
    if isinstance(spec.disaggregation, bool):
        word = "on" if spec.disaggregation else "off"
        raise InputError(
            f"got {str(spec.disaggregation).lower()}: YAML reads a bare {word} as a boolean. "
            f'To fix: quote it, disaggregation: "{word}"',
            field=f"{path}.disaggregation",
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
