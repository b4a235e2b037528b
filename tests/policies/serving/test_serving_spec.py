"""Demand and SLOs in the deployment: every form survives the document, the protobuf
DeploymentSpec and the ModelDeployment CRD (admitted by its schema, read by the operator),
and every contradiction is refused naming the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from mixfleet.v1 import plan_pb2
from support.structural import admit

from apis.kube.errors import PermanentError
from apis.kube.schema import from_wire
from apis.kube.v1alpha1 import MODEL_DEPLOYMENT, ModelDeploymentSpec, PlacementPolicySpec
from apis.wire.deployment import spec_from_proto, spec_to_proto
from operators.inputs import effective_spec
from policies.errors import InputError
from policies.serving.traffic import LengthDist
from policies.spec.build import Budget, DeploymentSpec, parse_deployment, spec_to_doc

_LENGTHS = {"inputTokens": {"mean": 4096, "p90": 6000}, "outputTokens": {"mean": 512, "p90": 800}}

FORMS: dict[str, dict[str, Any]] = {
    "requests": {
        "traffic": {"requestsPerS": 20, **_LENGTHS},
        "slo": {"ttftMs": 2000, "tpotMs": 50},
    },
    "output-tokens-histogram": {
        "traffic": {
            "outputTokensPerS": 10240,
            "inputTokens": {"histogram": [[1024, 0.25], [8192, 0.75]]},
            "outputTokens": {"mean": 1024},
        },
        "slo": {"tpotMs": 40, "percentile": 99},
        "disaggregation": "on",
    },
    "bursty-budget": {
        "traffic": {"requestsPerS": 3.5, **_LENGTHS, "arrival": "bursty", "burstCv": 3},
        "slo": {"ttftMs": 500, "percentile": 50},
        "budget": {"usdPerHour": 250.5},
        "disaggregation": "off",
    },
    "budget-gpus-stated-batch": {
        "workload": {"tokensPerGpu": 32},
        "budget": {"gpus": 16, "usdPerHour": 100},
        "slo": {"ttftMs": 1000, "tpotMs": 30},
    },
    "none": {},
}


def _doc(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "mixfleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "dsv3", "namespace": "default"},
        "spec": {"model": "mixtral-8x7b", **copy.deepcopy(body)},
    }


def _serving(spec: DeploymentSpec) -> tuple[Any, ...]:
    return (
        spec.traffic,
        spec.slo,
        spec.disaggregation,
        spec.budget,
        spec.workload.tokens_per_gpu,
        spec.workload.tokens_per_gpu_set,
    )


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_form_round_trips_document_proto_and_crd(form: str) -> None:
    doc = _doc(FORMS[form])
    spec = parse_deployment(doc)
    assert parse_deployment(spec_to_doc(spec)) == spec
    assert spec_from_proto(spec_to_proto(spec)) == spec
    wire = plan_pb2.DeploymentSpec.FromString(spec_to_proto(spec).SerializeToString())
    assert spec_from_proto(wire) == spec
    admitted, dropped, causes = admit(doc, MODEL_DEPLOYMENT.schema())
    assert (dropped, causes) == ([], [])
    crd = from_wire(ModelDeploymentSpec, admitted["spec"], "spec", strict=True)
    assert _serving(effective_spec("dsv3", crd, PlacementPolicySpec())) == _serving(spec)


def test_the_parsed_values_are_what_the_document_says() -> None:
    spec = parse_deployment(_doc(FORMS["output-tokens-histogram"]))
    assert spec.traffic is not None and spec.slo is not None
    assert spec.traffic.requests_per_s == pytest.approx(10.0)
    assert spec.traffic.output_tokens_per_s() == pytest.approx(10240.0)
    assert spec.traffic.input_len == LengthDist.of_histogram([(1024, 0.25), (8192, 0.75)])
    assert spec.slo.ttft_ms == 0.0 and spec.slo.percentile == 99.0
    stated = parse_deployment(_doc(FORMS["budget-gpus-stated-batch"]))
    assert stated.budget == Budget(usd_per_hour=100.0, gpus=16)
    assert stated.workload.tokens_per_gpu_set and stated.workload.tokens_per_gpu == 32
    default = parse_deployment(_doc(FORMS["requests"]))
    assert not default.workload.tokens_per_gpu_set
    assert default.workload.tokens_per_gpu == DeploymentSpec(name="x").workload.tokens_per_gpu


@pytest.mark.parametrize(
    ("body", "field", "needle"),
    [
        (
            {"traffic": {"requestsPerS": 1, "outputTokensPerS": 5, **_LENGTHS}},
            "spec.traffic.outputTokensPerS",
            "both",
        ),
        (
            {"traffic": {"requestsPerS": 1, **_LENGTHS, "inputTokens": {"mean": 10, "p90": 5}}},
            "spec.traffic.inputTokens.p90",
            "below the mean",
        ),
        ({"slo": {"ttftMs": 10, "percentile": 100}}, "spec.slo.percentile", "(0, 100)"),
        ({"slo": {"tttfMs": 10}}, "spec.slo.tttfMs", "did you mean 'ttftMs'"),
        ({"trafic": {}}, "spec.trafic", "did you mean 'traffic'"),
        ({"disaggregation": "yes"}, "spec.disaggregation", "auto, off, on"),
        ({"disaggregation": True}, "spec.disaggregation", 'quote it, disaggregation: "on"'),
        ({"disaggregation": False}, "spec.disaggregation", 'quote it, disaggregation: "off"'),
        ({"disaggregation": "on"}, "spec.disaggregation", "needs traffic"),
        ({"budget": {}}, "spec.budget", "no limit"),
        ({"budget": {"gpus": -1}}, "spec.budget.gpus", ""),
        ({"budget": {"dollars": 5}}, "spec.budget.dollars", "unknown field"),
        ({"budget": {"gpus": 8}, "maxGpus": 16}, "spec.budget.gpus", "contradicts maxGpus"),
        ({"budget": {"gpus": 8}, "minGpus": 16}, "spec.budget.gpus", "minGpus 16"),
        (
            {"slo": {"tpotMs": 40}, "sloStepTimeMs": 50},
            "spec.sloStepTimeMs",
            "contradicts slo.tpotMs",
        ),
    ],
)
def test_contradictions_and_bad_values_are_refused_naming_the_field(
    body: dict[str, Any], field: str, needle: str
) -> None:
    with pytest.raises(InputError) as err:
        parse_deployment(_doc(body))
    assert err.value.field == field
    assert needle in str(err.value)


def test_the_wire_refuses_bad_demand_naming_the_field() -> None:
    msg = spec_to_proto(parse_deployment(_doc(FORMS["requests"])))
    msg.traffic.output_tokens_per_s = 100.0
    with pytest.raises(InputError) as err:
        spec_from_proto(msg)
    assert err.value.field == "spec.traffic.outputTokensPerS"
    msg = spec_to_proto(parse_deployment(_doc(FORMS["requests"])))
    msg.slo.percentile = 150.0
    with pytest.raises(InputError) as err:
        spec_from_proto(msg)
    assert err.value.field == "spec.slo.percentile"


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        (
            {"traffic": {"requestsPerS": 1, "outputTokensPerS": 5, **_LENGTHS}},
            "spec.traffic",
            "one of the two",
        ),
        ({"slo": {"ttftMs": 10, "percentile": 100}}, "spec.slo.percentile", "below 100"),
        ({"disaggregation": "yes"}, "spec.disaggregation", "unsupported value"),
        ({"disaggregation": True}, "spec.disaggregation", "must be of type string"),
        ({"budget": {"gpus": 0}}, "spec.budget.gpus", "greater than or equal to 1"),
    ],
)
def test_the_crd_schema_refuses_what_it_can_express(
    body: dict[str, Any], field: str, message: str
) -> None:
    _, _, causes = admit(_doc(body), MODEL_DEPLOYMENT.schema())
    assert any(c.field == field and message in c.message for c in causes), causes


def test_the_operator_refuses_what_only_the_parser_checks() -> None:
    body = {"traffic": {"requestsPerS": 1, **_LENGTHS, "inputTokens": {"mean": 10, "p90": 5}}}
    admitted, _, causes = admit(_doc(body), MODEL_DEPLOYMENT.schema())
    assert causes == []
    crd = from_wire(ModelDeploymentSpec, admitted["spec"], "spec", strict=True)
    with pytest.raises(PermanentError, match=r"spec\.traffic\.inputTokens\.p90"):
        effective_spec("dsv3", crd, PlacementPolicySpec())


def test_the_example_deployment_states_demand_and_slo() -> None:
    path = Path(__file__).resolve().parents[3] / "examples/serving/deployment-dsv3.yaml"
    doc = yaml.safe_load(path.read_text())
    spec = parse_deployment(doc)
    assert spec.traffic is not None and spec.slo is not None
    assert spec.traffic.output_tokens_per_s() == pytest.approx(20 * 512)
    assert not spec.workload.tokens_per_gpu_set
    doc["metadata"]["namespace"] = "default"
    assert admit(doc, MODEL_DEPLOYMENT.schema())[1:] == ([], [])
