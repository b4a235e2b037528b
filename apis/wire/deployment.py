"""The protobuf codec of :class:`policies.spec.build.DeploymentSpec` (``mixfleet.v1.DeploymentSpec``):
zero values on the wire mean the defaults; decoding validates like the document parser."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from mixfleet.v1 import plan_pb2

from apis.documents import load_json_field
from policies.defaults import default_tokens_per_gpu
from policies.errors import InputError
from policies.estimate.engines import EngineOptions, EngineSpec, parse_engine
from policies.estimate.workload import load_from_json
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec.build import (
    Budget,
    DeploymentSpec,
    RebalanceSpec,
    WorkloadSpec,
    check_spec,
    load_matrix,
    resolve_model,
    serving_from_doc,
)


def spec_to_proto(spec: DeploymentSpec) -> plan_pb2.DeploymentSpec:
    w = spec.workload
    r = spec.rebalance
    msg = plan_pb2.DeploymentSpec(
        name=spec.name,
        model=spec.model,
        model_config_json=json.dumps(dict(spec.model_config)).encode()
        if spec.model_config
        else b"",
        workload=plan_pb2.WorkloadSpec(
            phase=w.phase,
            tokens_per_gpu=w.tokens_per_gpu if w.tokens_per_gpu_set else 0,
            context_len=w.context_len,
            kv_cache_dtype=w.kv_cache_dtype,
            load=w.load,
            load_json=json.dumps([list(x) for x in w.load_matrix]).encode()
            if w.load_matrix is not None
            else b"",
        ),
        policy=spec.policy,
        form=spec.form,
        node_selector=dict(spec.node_selector),
        solver_time_limit_s=spec.solver_time_limit_s,
        prepare_timeout_s=spec.prepare_timeout_s,
        rebalance=plan_pb2.RebalanceSpec(
            enabled=r.enabled,
            imbalance_threshold=r.imbalance_threshold,
            sustain_s=r.sustain_s,
            min_interval_s=r.min_interval_s,
            migration_weight_us=r.migration_weight_us,
        ),
        allow_cross_vendor=spec.allow_cross_vendor,
        gpu_hour_prices=dict(spec.gpu_hour_prices),
        engine=engine_to_proto(spec.engine),
        priority=spec.priority,
        min_gpus=spec.min_gpus,
        max_gpus=spec.max_gpus,
        objective=spec.objective,
        slo_step_time_ms=spec.slo_step_time_ms,
        memory_fraction=spec.memory_fraction,
        namespace=spec.namespace,
        disaggregation=spec.disaggregation,
        budget=plan_pb2.BudgetSpec(usd_per_hour=spec.budget.usd_per_hour, gpus=spec.budget.gpus),
    )
    if spec.redundant_experts is not None:
        msg.redundant_experts = spec.redundant_experts
    if spec.traffic is not None:
        msg.traffic.CopyFrom(traffic_to_proto(spec.traffic))
    if spec.slo is not None:
        msg.slo.CopyFrom(plan_pb2.SloSpec(**_slo_fields(spec.slo)))
    return msg


def _slo_fields(slo: Slo) -> dict[str, float]:
    return {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "percentile": slo.percentile}


def _length_to_proto(dist: LengthDist) -> plan_pb2.LengthDistSpec:
    if dist.histogram:
        return plan_pb2.LengthDistSpec(
            histogram=[plan_pb2.LengthBin(tokens=n, weight=w) for n, w in dist.histogram]
        )
    return plan_pb2.LengthDistSpec(mean=dist.mean, p90=dist.p90)


def traffic_to_proto(traffic: Traffic) -> plan_pb2.TrafficSpec:
    """``mixfleet.v1.TrafficSpec`` of traffic (the rate as the user stated it)."""
    stated = traffic.stated_output_tokens_per_s
    return plan_pb2.TrafficSpec(
        requests_per_s=0.0 if stated else traffic.requests_per_s,
        output_tokens_per_s=stated,
        input_tokens=_length_to_proto(traffic.input_len),
        output_tokens=_length_to_proto(traffic.output_len),
        arrival=traffic.arrival,
        burst_cv=traffic.burst_cv,
    )


def _length_doc(msg: plan_pb2.LengthDistSpec) -> dict[str, Any]:
    if msg.histogram:
        return {"histogram": [[b.tokens, b.weight] for b in msg.histogram]}
    doc: dict[str, Any] = {"mean": msg.mean}
    if msg.p90:
        doc["p90"] = msg.p90
    return doc


def serving_from_proto(msg: plan_pb2.DeploymentSpec) -> dict[str, Any]:
    """The demand fields of a message as DeploymentSpec keyword arguments, read by the
    document's one parser (:func:`policies.spec.build.serving_from_doc`); zero values mean the
    defaults, an unset message none.

    Raises:
        InputError: naming the field (``spec.traffic.inputTokens.p90``...).
    """
    doc: dict[str, Any] = {}
    if msg.HasField("traffic"):
        t = msg.traffic
        traffic: dict[str, Any] = {
            "inputTokens": _length_doc(t.input_tokens),
            "outputTokens": _length_doc(t.output_tokens),
        }
        if t.requests_per_s:
            traffic["requestsPerS"] = t.requests_per_s
        if t.output_tokens_per_s:
            traffic["outputTokensPerS"] = t.output_tokens_per_s
        if t.arrival:
            traffic["arrival"] = t.arrival
        if t.burst_cv:
            traffic["burstCv"] = t.burst_cv
        doc["traffic"] = traffic
    if msg.HasField("slo"):
        slo = {"ttftMs": msg.slo.ttft_ms, "tpotMs": msg.slo.tpot_ms}
        doc["slo"] = {k: v for k, v in slo.items() if v}
        if msg.slo.percentile:
            doc["slo"]["percentile"] = msg.slo.percentile
    if msg.disaggregation:
        doc["disaggregation"] = msg.disaggregation
    out = serving_from_doc(doc)
    b = msg.budget
    if b.usd_per_hour or b.gpus:
        out["budget"] = Budget(usd_per_hour=b.usd_per_hour, gpus=b.gpus)
    return out


def engine_to_proto(engine: EngineSpec) -> plan_pb2.EngineSpec:
    """``mixfleet.v1.EngineSpec`` of an engine (every field written)."""
    o = engine.options
    return plan_pb2.EngineSpec(
        name=engine.name,
        version=engine.version,
        options=plan_pb2.EngineOptions(
            a2a_backend=o.a2a_backend, dispatch=o.dispatch, dp_balance=o.dp_balance
        ),
    )


def engine_from_proto(msg: plan_pb2.EngineSpec, path: str = "spec.engine") -> EngineSpec:
    """The engine of a message through the one engine parser
    (:func:`policies.estimate.engines.parse_engine`); empty strings mean the defaults.

    Raises:
        InputError: naming the field (``spec.engine.options.dispatch``...).
    """
    d, o = EngineSpec(), EngineOptions()
    return parse_engine(
        {
            "name": msg.name or d.name,
            "version": msg.version,
            "options": {
                "a2aBackend": msg.options.a2a_backend or o.a2a_backend,
                "dispatch": msg.options.dispatch or o.dispatch,
                "dpBalance": msg.options.dp_balance or o.dp_balance,
            },
        },
        path,
    )


def _json_field(raw: bytes, path: str, kind: str) -> Any:
    """A JSON document of a bytes field, within the limits of its ``kind``
    (:mod:`policies.limits`: size, UTF-8, nesting)."""
    return load_json_field(raw, kind, path)


def spec_from_proto(msg: plan_pb2.DeploymentSpec) -> DeploymentSpec:
    """A validated spec from the wire; zero values mean the defaults.

    Raises:
        InputError: naming the proto field (``spec.workload.phase``...).
    """
    d = DeploymentSpec(name=msg.name)
    dw = WorkloadSpec()
    dr = RebalanceSpec()
    w = msg.workload
    r = msg.rebalance
    cfg = (
        _json_field(msg.model_config_json, "spec.model_config_json", "model config")
        if msg.model_config_json
        else None
    )
    if cfg is not None and not isinstance(cfg, dict):
        raise InputError("must be a JSON object", field="spec.model_config_json")
    matrix = None
    if w.load_json:
        loaded = _json_field(w.load_json, "spec.workload.load_json", "load")
        model_hint = resolve_model(replace(d, model=msg.model, model_config=cfg))
        try:
            matrix = load_matrix(load_from_json(loaded, model_hint), "spec.workload.load_json")
        except InputError as exc:
            raise InputError(str(exc), field="spec.workload.load_json") from exc
    spec = DeploymentSpec(
        name=msg.name,
        model=msg.model,
        model_config=cfg,
        workload=WorkloadSpec(
            phase=w.phase or dw.phase,
            tokens_per_gpu=w.tokens_per_gpu or default_tokens_per_gpu(w.phase or dw.phase),
            tokens_per_gpu_set=w.tokens_per_gpu != 0,
            context_len=w.context_len or dw.context_len,
            kv_cache_dtype=w.kv_cache_dtype or dw.kv_cache_dtype,
            load=w.load or dw.load,
            load_matrix=matrix,
        ),
        policy=msg.policy or d.policy,
        form=msg.form or d.form,
        redundant_experts=msg.redundant_experts if msg.HasField("redundant_experts") else None,
        node_selector=dict(msg.node_selector),
        solver_time_limit_s=msg.solver_time_limit_s or d.solver_time_limit_s,
        prepare_timeout_s=msg.prepare_timeout_s or d.prepare_timeout_s,
        rebalance=RebalanceSpec(
            enabled=r.enabled,
            imbalance_threshold=r.imbalance_threshold or dr.imbalance_threshold,
            sustain_s=r.sustain_s or dr.sustain_s,
            min_interval_s=r.min_interval_s or dr.min_interval_s,
            migration_weight_us=r.migration_weight_us,
        ),
        allow_cross_vendor=msg.allow_cross_vendor,
        gpu_hour_prices=dict(msg.gpu_hour_prices),
        engine=engine_from_proto(msg.engine),
        priority=msg.priority,
        min_gpus=msg.min_gpus,
        max_gpus=msg.max_gpus,
        objective=msg.objective or d.objective,
        slo_step_time_ms=msg.slo_step_time_ms,
        memory_fraction=msg.memory_fraction or d.memory_fraction,
        namespace=msg.namespace or d.namespace,
        **serving_from_proto(msg),
    )
    check_spec(spec, path="spec")
    return spec
