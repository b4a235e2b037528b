"""Round trips of the proto codec (apis.wire.inventory, binary and its JSON mapping) and
the CRD codec (apis.kube.gpunode) of NodeInventory, with builders that set every field; and
of a deployment's engine through the proto, document and CRD forms."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from mixfleet.v1 import inventory_pb2, plan_pb2
from support.codec_builders import assert_every_field_set, node_inventory

from apis.kube import v1alpha1
from apis.kube.gpunode import inventory_from_crd, inventory_to_crd
from apis.kube.schema import from_wire
from apis.wire.deployment import spec_from_proto, spec_to_proto
from apis.wire.inventory import (
    inventory_from_proto,
    inventory_from_proto_json,
    inventory_to_proto,
    inventory_to_proto_json,
)
from operators.inputs import deployment_engine
from policies.estimate.engines import (
    A2A_BACKENDS,
    DISPATCH_OPTIONS,
    DP_BALANCE_OPTIONS,
    ENGINES,
    NO_HTTP_RANK_FIELD,
    EngineOptions,
    EngineSpec,
    engine_to_doc,
)
from policies.hardware.inventory import NodeInventory
from policies.spec.build import DeploymentSpec, parse_deployment, spec_to_doc


@settings(max_examples=50, deadline=None)
@given(node_inventory)
def test_proto_round_trip_keeps_every_field(inv: NodeInventory) -> None:
    assert_every_field_set(inv)
    wire = inventory_to_proto(inv).SerializeToString()
    assert inventory_from_proto(inventory_pb2.Inventory.FromString(wire)) == inv


@settings(max_examples=30, deadline=None)
@given(node_inventory)
def test_proto_json_round_trip_keeps_every_field(inv: NodeInventory) -> None:
    assert inventory_from_proto_json(inventory_to_proto_json(inv)) == inv


@settings(max_examples=50, deadline=None)
@given(node_inventory)
def test_crd_round_trip_keeps_every_field(inv: NodeInventory) -> None:
    assert_every_field_set(inv)
    doc = json.loads(json.dumps(inventory_to_crd(inv)))
    assert inventory_from_crd(doc) == inv


@settings(max_examples=10, deadline=None)
@given(node_inventory)
def test_proto_json_reads_pre_rename_field_names(inv: NodeInventory) -> None:
    doc = json.loads(inventory_to_proto_json(inv))
    for g in doc["gpus"]:
        g["hbmBandwidthGbps"] = g.pop("hbmBandwidthGbytesPerS")
    for n in doc["nics"]:
        n["rateGbps"] = n.pop("ratePerDirectionGbitsPerS")
    assert inventory_from_proto_json(json.dumps(doc)) == inv


def _every_engine() -> list[EngineSpec]:
    """Every engine and option combination the engine model accepts."""
    out = []
    for name in ENGINES:
        dispatches = DISPATCH_OPTIONS if name == "sglang" else ("auto",)
        for backend in ("auto", *A2A_BACKENDS[name]):
            for dispatch in dispatches:
                for balance in DP_BALANCE_OPTIONS:
                    if balance == "router" and name in NO_HTTP_RANK_FIELD:
                        continue  # refused: tests/policies/test_engines.py
                    options = EngineOptions(backend, dispatch, balance)
                    out.append(EngineSpec(name, "1.2.3" if balance == "engine" else "", options))
    return out


@pytest.mark.parametrize("engine", _every_engine(), ids=lambda e: engine_label(e))
def test_engine_round_trips_through_proto_document_and_crd(engine: EngineSpec) -> None:
    spec = DeploymentSpec(name="mx", model="mixtral-8x7b", engine=engine)
    wire = spec_to_proto(spec).SerializeToString()
    assert spec_from_proto(plan_pb2.DeploymentSpec.FromString(wire)).engine == engine
    assert parse_deployment(spec_to_doc(spec)).engine == engine
    crd = from_wire(v1alpha1.ModelDeploymentSpec, {"model": "mixtral-8x7b", **_engine_doc(engine)})
    assert deployment_engine(crd) == engine


def _engine_doc(engine: EngineSpec) -> dict[str, object]:
    return {"engine": json.loads(json.dumps(engine_to_doc(engine)))}


def engine_label(e: EngineSpec) -> str:
    o = e.options
    return f"{e.name}-{o.a2a_backend}-{o.dispatch}-{o.dp_balance}"


def test_an_empty_proto_engine_is_native() -> None:
    spec = spec_from_proto(plan_pb2.DeploymentSpec(name="mx", model="mixtral-8x7b"))
    assert spec.engine == EngineSpec()
