"""Round trips of the proto codec (apis.wire.inventory, binary and its JSON mapping) and
the CRD codec (apis.kube.gpunode) of NodeInventory, with builders that set every field."""

from __future__ import annotations

import json

from hypothesis import given, settings
from mixfleet.v1 import inventory_pb2
from support.codec_builders import assert_every_field_set, node_inventory

from apis.kube.gpunode import inventory_from_crd, inventory_to_crd
from apis.wire.inventory import (
    inventory_from_proto,
    inventory_from_proto_json,
    inventory_to_proto,
    inventory_to_proto_json,
)
from policies.inventory import NodeInventory


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
