"""The one deployment spec: the document parser, the protobuf codec and the ModelDeployment
CRD are checked against :class:`policies.spec.build.DeploymentSpec`, so a field added to one and
not the others fails here; and :func:`policies.spec.build.to_request` is the one request builder."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from mixfleet.v1 import plan_pb2

from apis.kube import v1alpha1
from apis.wire.deployment import spec_from_proto, spec_to_proto
from policies.errors import InputError
from policies.estimate.costmodel import MeasuredFigures
from policies.estimate.engines import EngineOptions, EngineSpec
from policies.hardware.fleet import parse_fleet
from policies.model.architecture import preset
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec.build import (
    Budget,
    DeploymentSpec,
    Measured,
    RebalanceSpec,
    SolverPolicy,
    WorkloadSpec,
    effective_redundant,
    parse_deployment,
    redundancy_note,
    round_redundancy,
    spec_to_doc,
    to_request,
)

#: CRD fields that only the operator reads (it resolves them before building a spec).
OPERATOR_ONLY = {"policy_ref", "engine_format"}
#: DeploymentSpec field -> proto field where the wire carries it under another name.
PROTO_NAMES = {
    "model_config": "model_config_json",
    "load_matrix": "load_json",
    "tokens_per_gpu_set": "tokens_per_gpu",  # the wire's 0 means "not stated"
}
#: Spec fields the CRD carries as the presence of another field (tokensPerGpu unset).
PRESENCE_ONLY = {"tokens_per_gpu_set"}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def _names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _proto_names(msg: type) -> set[str]:
    return {f.name for f in msg.DESCRIPTOR.fields}  # type: ignore[attr-defined]


def test_the_crd_declares_exactly_the_spec_fields() -> None:
    assert _names(v1alpha1.ModelDeploymentSpec) - OPERATOR_ONLY == _names(DeploymentSpec) - {"name"}
    assert _names(v1alpha1.WorkloadSpec) == _names(WorkloadSpec) - PRESENCE_ONLY
    assert _names(v1alpha1.RebalanceSpec) == _names(RebalanceSpec)
    assert _names(v1alpha1.EngineSpec) == _names(EngineSpec)
    assert _names(v1alpha1.EngineOptions) == _names(EngineOptions)


def test_the_proto_carries_exactly_the_spec_fields() -> None:
    def wire(cls: type) -> set[str]:
        return {PROTO_NAMES.get(n, n) for n in _names(cls)}

    assert _proto_names(plan_pb2.DeploymentSpec) == wire(DeploymentSpec)
    assert _proto_names(plan_pb2.WorkloadSpec) == wire(WorkloadSpec)
    assert _proto_names(plan_pb2.RebalanceSpec) == wire(RebalanceSpec)
    assert _proto_names(plan_pb2.EngineSpec) == wire(EngineSpec)
    assert _proto_names(plan_pb2.EngineOptions) == wire(EngineOptions)


def _full_spec() -> DeploymentSpec:
    """A spec with every field away from its default."""
    spec = DeploymentSpec(
        name="full",
        model="mixtral-8x7b",
        workload=WorkloadSpec(
            phase="prefill",
            tokens_per_gpu=96,
            tokens_per_gpu_set=True,
            context_len=2048,
            kv_cache_dtype="fp8",
            load="synthetic:zipf:0.5:seed=3",
            load_matrix=tuple(tuple(float(i + j) for j in range(8)) for i in range(32)),
        ),
        policy="greedy",
        form="native",
        redundant_experts=4,
        node_selector={"rack": "r1"},
        solver_time_limit_s=12.0,
        prepare_timeout_s=7.0,
        rebalance=RebalanceSpec(True, 0.2, 30.0, 100.0, 3.0),
        allow_cross_vendor=True,
        gpu_hour_prices={"H100-SXM5-80GB": 2.5},
        engine=EngineSpec("sglang", "0.5.23", EngineOptions("none", "dynamic", "engine")),
        priority=7,
        min_gpus=8,
        max_gpus=64,
        objective="slo",
        slo_step_time_ms=50.0,
        memory_fraction=0.5,
        namespace="team-a",
        traffic=Traffic.of_output_tokens(
            10240.0, LengthDist(4096.0, 6000.0), LengthDist.of_histogram([(256, 1), (1024, 3)])
        ),
        slo=Slo(ttft_ms=2000.0, tpot_ms=50.0, percentile=99.0),
        disaggregation="on",
        budget=Budget(usd_per_hour=400.0, gpus=64),
    )
    default = DeploymentSpec(name="full")
    for f in dataclasses.fields(DeploymentSpec):
        if f.name not in ("name", "model_config"):  # model_config excludes model
            assert getattr(spec, f.name) != getattr(default, f.name), f.name
    for f in dataclasses.fields(WorkloadSpec):
        assert getattr(spec.workload, f.name) != getattr(WorkloadSpec(), f.name), f.name
    for f in dataclasses.fields(RebalanceSpec):
        assert getattr(spec.rebalance, f.name) != getattr(RebalanceSpec(), f.name), f.name
    for cls, value in ((EngineSpec, spec.engine), (EngineOptions, spec.engine.options)):
        for f in dataclasses.fields(cls):
            assert getattr(value, f.name) != getattr(cls(), f.name), f.name
    return spec


def test_document_and_proto_round_trip_every_field() -> None:
    spec = _full_spec()
    doc = spec_to_doc(spec)
    assert set(doc["spec"]) == {_camel(n) for n in _names(DeploymentSpec)} - {"name", "modelConfig"}
    assert parse_deployment(doc) == spec
    assert spec_from_proto(spec_to_proto(spec)) == spec
    inline = dataclasses.replace(spec, model="", model_config=dict(preset_config()))
    assert parse_deployment(spec_to_doc(inline)) == inline
    assert spec_from_proto(spec_to_proto(inline)) == inline


def preset_config() -> dict[str, object]:
    return {
        "model_type": "mixtral",
        "num_hidden_layers": 32,
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 2048,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
    }


def test_redundancy_is_rounded_in_one_place() -> None:
    assert round_redundancy(8, 6, 0, "engine") == 4
    assert round_redundancy(8, 4, 5, "engine") == 8
    assert round_redundancy(8, 6, 3, "native") == 3
    assert round_redundancy(0, 6, 0, "engine") == 0
    model = preset("mixtral-8x7b")
    spec = DeploymentSpec(name="mx", model="mixtral-8x7b", redundant_experts=2)
    assert effective_redundant(spec, model, 6) == 4
    assert redundancy_note(spec, model, 6) == (
        "redundantExperts raised from 2 to 4 so that 8 + 4 slots divide by 6 GPUs"
    )
    assert redundancy_note(spec, model, 5) == ""


def test_to_request_reads_the_policy_measurements_and_reserved_nodes() -> None:
    root = Path(__file__).resolve().parents[2]
    fleet = parse_fleet(yaml.safe_load((root / "examples/fleets/mixed-24.yaml").read_text()))
    names = [n.name for n in fleet.nodes]
    spec = DeploymentSpec(
        name="mx",
        model="mixtral-8x7b",
        policy="greedy",
        rebalance=RebalanceSpec(migration_weight_us=2.0),
    )
    figures = MeasuredFigures(gemm_bf16_tflops=500.0)
    gpus = {f"{names[0]}/gpu0": figures, f"{names[-1]}/gpu0": figures, "elsewhere/gpu0": figures}
    req = to_request(
        spec,
        SolverPolicy(mip_gap=0.02, milp_solver="cbc", workers=3),
        fleet,
        measured=Measured(gpus=gpus),
        reserved=[names[-1]],
    )
    assert [n.name for n in req.fleet.nodes] == names[:-1]
    assert (req.options.mip_gap, req.options.solver, req.options.workers) == (0.02, "cbc", 3)
    assert req.options.migration_weight_us == 2.0
    assert req.options.time_limit_s == spec.solver_time_limit_s
    assert (8 + req.redundant_experts) % len(req.fleet.gpus) == 0
    assert set(req.settings.measured) == {f"{names[0]}/gpu0"}
    assert req.policy == "greedy" and req.form == "engine"
    assert req.engine == EngineSpec()
    vllm = dataclasses.replace(spec, engine=EngineSpec("vllm", options=EngineOptions("naive")))
    assert to_request(vllm, SolverPolicy(), fleet).engine == vllm.engine


def test_field_names_of_the_document_are_camel_case() -> None:
    for key in spec_to_doc(_full_spec())["spec"]:
        assert re.fullmatch(r"[a-z][A-Za-z]*", key), key


def _with_engine(engine: object) -> dict[str, object]:
    return {"metadata": {"name": "mx"}, "spec": {"model": "mixtral-8x7b", "engine": engine}}


@pytest.mark.parametrize(
    ("engine", "field", "needle"),
    [
        ({"name": "tgi"}, "spec.engine.name", "choose one of native, sglang, vllm, trtllm"),
        ({"name": "vllm", "flavour": "x"}, "spec.engine.flavour", "unknown field 'flavour'"),
        ({"name": "vllm", "options": {"eplb": True}}, "spec.engine.options.eplb", "unknown field"),
        ({"name": "vllm", "options": {"dispatch": "static"}}, "spec.engine.options.dispatch", ""),
        (
            {"name": "sglang", "options": {"a2aBackend": "nccl"}},
            "spec.engine.options.a2aBackend",
            "",
        ),
        ({"name": "trtllm", "options": {"dpBalance": "even"}}, "spec.engine.options.dpBalance", ""),
        (["sglang"], "spec.engine", "must be a mapping or an engine name"),
    ],
)
def test_the_document_refuses_a_bad_engine_naming_the_field(
    engine: object, field: str, needle: str
) -> None:
    with pytest.raises(InputError) as e:
        parse_deployment(_with_engine(engine))
    assert e.value.field == field
    assert needle in str(e.value)


def test_an_engine_name_alone_and_an_absent_engine_parse() -> None:
    assert parse_deployment(_with_engine("trtllm")).engine == EngineSpec("trtllm")
    assert parse_deployment(_with_engine(None)).engine == EngineSpec()
    assert "engine" not in spec_to_doc(DeploymentSpec(name="mx", model="mixtral-8x7b"))["spec"]
