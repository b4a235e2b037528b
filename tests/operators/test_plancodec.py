"""Plans inside PartitionPlan objects: size of a DeepSeek-V3 plan, round trip, integrity."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from support.structural import admit

from apis.kube.plancodec import decode_plan, encode_plan, plan_spec
from apis.kube.schema import from_wire, to_wire
from apis.kube.v1alpha1 import MAX_PLAN_DATA_CHARS, PARTITION_PLAN, PartitionPlanSpec
from policies.errors import InputError
from policies.estimate.workload import make_workload, synthetic_zipf
from policies.hardware.fleet import parse_fleet
from policies.model.architecture import preset
from policies.plan import Plan
from policies.request import PlacementRequest
from policies.solve import solve

ROOT = Path(__file__).resolve().parents[2]
OBJECT_LIMIT_BYTES = 1_500_000  # etcd's default request limit, which caps one object


@pytest.fixture(scope="module")
def dsv3_plan() -> Plan:
    """DeepSeek-V3 on the mixed 24-GPU fleet (58 MoE layers x 24 GPUs x 12 slots), skewed
    load so the placement is irregular and compresses like a real one."""
    fleet = parse_fleet(yaml.safe_load((ROOT / "examples/fleets/mixed-24.yaml").read_text()))
    model = preset("deepseek-v3")
    load = synthetic_zipf(model, "synthetic:zipf:1.2:seed=3")
    w = make_workload(model, phase="decode", tokens_per_gpu=64, context_len=4096, load=load)
    return solve(PlacementRequest(fleet, model, w, policy="greedy", redundant_experts=32)).plan


def test_deepseek_v3_plan_fits_a_partition_plan_with_room_to_spare(dsv3_plan: Plan) -> None:
    assert len(dsv3_plan.moe_layers) == 58 and len(dsv3_plan.gpus) == 24
    assert dsv3_plan.slots_per_gpu == 12
    spec = plan_spec(dsv3_plan, deployment="dsv3", inputs_digest="0" * 16, deployment_generation=1)
    obj = {
        "apiVersion": "mixfleet.io/v1alpha1",
        "kind": "PartitionPlan",
        "metadata": {"name": "dsv3-v1", "namespace": "inference"},
        "spec": to_wire(spec),
    }
    size = len(json.dumps(obj).encode())
    print(f"plan JSON {spec.uncompressed_bytes} B, PartitionPlan object {size} B")
    assert spec.uncompressed_bytes > 150_000  # the raw plan is big...
    assert size < 100_000  # ...the object is under 7% of the 1.5 MB limit
    assert size < OBJECT_LIMIT_BYTES / 10
    _, _, causes = admit(obj, PARTITION_PLAN.schema())
    assert causes == []


def test_round_trip_is_exact_and_encoding_is_deterministic(dsv3_plan: Plan) -> None:
    a = plan_spec(dsv3_plan, deployment="dsv3", inputs_digest="0" * 16, deployment_generation=1)
    b = plan_spec(dsv3_plan, deployment="dsv3", inputs_digest="0" * 16, deployment_generation=1)
    assert a == b  # same plan, same bytes: re-applying is a no-op
    back = decode_plan(from_wire(PartitionPlanSpec, to_wire(a), "spec"))
    assert back.to_dict() == dsv3_plan.to_dict()


def test_tampered_data_is_rejected(dsv3_plan: Plan) -> None:
    spec = plan_spec(dsv3_plan, deployment="dsv3", inputs_digest="0" * 16, deployment_generation=1)
    other = encode_plan(dataclasses.replace(dsv3_plan, version=9))
    with pytest.raises(InputError, match="does not match"):
        decode_plan(dataclasses.replace(spec, data=other.data))
    with pytest.raises(InputError, match="cannot decode"):
        decode_plan(dataclasses.replace(spec, data="not base64!"))


def test_limit_constant_matches_the_schema() -> None:
    data = PARTITION_PLAN.schema()["properties"]["spec"]["properties"]["data"]
    assert data["maxLength"] == MAX_PLAN_DATA_CHARS < OBJECT_LIMIT_BYTES
