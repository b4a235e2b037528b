"""Deployment documents: parsing, validation naming the field, wire round trip."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from apis.wire.deployment import spec_from_proto, spec_to_proto
from policies.errors import InputError
from policies.hardware.fleet import parse_fleet
from policies.model.architecture import preset
from policies.spec.build import (
    DeploymentSpec,
    build_request,
    effective_redundant,
    parse_deployment,
    spec_to_doc,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "deployments"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_parse_and_round_trip(path: Path) -> None:
    spec = parse_deployment(yaml.safe_load(path.read_text()))
    assert parse_deployment(spec_to_doc(spec)) == spec
    assert spec_from_proto(spec_to_proto(spec)) == spec


def _doc(**spec: object) -> dict[str, object]:
    body: dict[str, object] = {"model": "mixtral-8x7b"}
    body.update(spec)
    return {
        "apiVersion": "mixfleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "mx"},
        "spec": body,
    }


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"model": "gpt-17"}, "spec.model"),
        ({"policy": "magic"}, "spec.policy"),
        ({"form": "weird"}, "spec.form"),
        ({"workload": {"phase": "train"}}, "spec.workload.phase"),
        ({"workload": {"tokensPerGpu": 0}}, "spec.workload.tokensPerGpu"),
        ({"workload": {"load": "synthetic:zipf:99"}}, "spec.workload.load"),
        ({"redundantExperts": -1}, "spec.redundantExperts"),
        ({"solverTimeLimitS": math.nan}, "spec.solverTimeLimitS"),
        ({"rebalance": {"imbalanceThreshold": -0.1}}, "spec.rebalance.imbalanceThreshold"),
        ({"surprise": 1}, "spec.surprise"),
    ],
)
def test_bad_specs_name_the_field(spec: dict[str, object], field: str) -> None:
    with pytest.raises(InputError) as err:
        parse_deployment(_doc(**spec))
    assert err.value.field == field, str(err.value)


def test_bad_name_and_kind() -> None:
    doc = _doc()
    doc["metadata"] = {"name": "Not_A_Name"}
    with pytest.raises(InputError, match=r"metadata\.name"):
        parse_deployment(doc)
    doc = _doc()
    doc["kind"] = "Fleet"
    with pytest.raises(InputError, match="kind"):
        parse_deployment(doc)


def test_redundant_experts_follow_the_gpu_count() -> None:
    model = preset("mixtral-8x7b")  # 8 experts
    spec = DeploymentSpec(name="mx", model="mixtral-8x7b")
    assert effective_redundant(spec, model, 6) == 4  # 12 slots on 6 GPUs
    assert effective_redundant(spec, model, 4) == 0
    assert (
        effective_redundant(DeploymentSpec(name="mx", model="x", redundant_experts=5), model, 4)
        == 8
    )
    native = DeploymentSpec(name="mx", model="mixtral-8x7b", form="native", redundant_experts=3)
    assert effective_redundant(native, model, 6) == 3


def test_build_request_drops_a_previous_plan_of_another_model() -> None:
    from agent_fakes import small_fleet_doc

    from policies.solve import solve

    fleet = parse_fleet(small_fleet_doc())
    spec = DeploymentSpec(name="mx", model="mixtral-8x7b", policy="greedy")
    plan = solve(build_request(spec, fleet)).plan
    other = DeploymentSpec(name="mx", model="qwen3-30b-a3b", policy="greedy")
    assert build_request(other, fleet, previous=plan).previous is None
    assert build_request(spec, fleet, previous=plan).previous is plan
