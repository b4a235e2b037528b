"""Round trips of the pure JSON codecs: NodeInventory (policies.hardware.inventory) and Plan /
GpuPlan (policies.plan), with builders that set every field (support.codec_builders)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from support.codec_builders import assert_every_field_set, gpu_plan, node_inventory, plan

from policies.errors import InputError
from policies.hardware.fleet import parse_fleet
from policies.hardware.inventory import (
    NicInventory,
    NodeInventory,
    inventory_from_dict,
    inventory_to_dict,
)
from policies.plan import GpuPlan, Plan, gpu_plan_from_dict, gpu_plan_to_dict, plan_from_dict


@settings(max_examples=50, deadline=None)
@given(node_inventory)
def test_inventory_json_round_trip_keeps_every_field(inv: NodeInventory) -> None:
    assert_every_field_set(inv)
    doc = json.loads(json.dumps(inventory_to_dict(inv)))
    assert inventory_from_dict(doc) == inv


def test_builder_check_catches_a_field_left_at_its_default() -> None:
    inv = NodeInventory("n", (), (NicInventory("mlx5_0", 1, 400.0, "ACTIVE", "infiniband"),))
    with pytest.raises(AssertionError, match="gpus is empty"):
        assert_every_field_set(inv)


def test_inventory_json_keeps_nics() -> None:
    """The JSON codec once dropped ``nics``: an inventory with one NIC came back with none."""
    inv = NodeInventory("n", (), (NicInventory("mlx5_0", 1, 400.0, "4: ACTIVE", "infiniband"),))
    assert inventory_from_dict(inventory_to_dict(inv)).nics == inv.nics


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(bogus=1), "inventory.bogus"),
        (lambda d: d.pop("node"), "inventory.node"),
        (lambda d: d["nics"][0].update(port="one"), "inventory.nics[0].port"),
        (
            lambda d: d["gpus"][0]["nvlinks"][0].update(extra=1),
            "inventory.gpus[0].nvlinks[0].extra",
        ),
        (
            lambda d: d["gpus"][0]["health"].update(xid_errors=["x"]),
            "inventory.gpus[0].health.xid_errors[0]",
        ),
        (lambda d: d["gpus"][0]["measured"].update(hbm=True), "inventory.gpus[0].measured.hbm"),
        (lambda d: d.update(simulated="yes"), "inventory.simulated"),
    ],
)
def test_inventory_json_errors_name_the_field(edit: Any, field: str) -> None:
    doc = inventory_to_dict(_one_of_each())
    edit(doc)
    with pytest.raises(InputError) as err:
        inventory_from_dict(doc)
    assert err.value.field == field


def test_inventory_json_reads_pre_rename_keys() -> None:
    doc = inventory_to_dict(_one_of_each())
    doc["gpus"][0]["hbm_bandwidth_gbps"] = doc["gpus"][0].pop("hbm_bandwidth_gbytes_per_s")
    doc["nics"][0]["rate_gbps"] = doc["nics"][0].pop("rate_per_direction_gbits_per_s")
    assert inventory_from_dict(doc) == _one_of_each()


def _one_of_each() -> NodeInventory:
    from policies.hardware.inventory import GpuHealth, GpuInventory, NvLinkInfo

    g = GpuInventory(
        0,
        "GPU-0",
        "NVIDIA H200",
        "H200-SXM-141GB",
        "hopper",
        "9.0",
        132,
        2**37,
        4800.0,
        nvlinks=(NvLinkInfo(0, True, 4, "FFFFFFFF:FF:FF.0"),),
        measured={"hbm_gbytes_per_s": 4200.0},
        health=GpuHealth(xid_errors=(13,)),
    )
    return NodeInventory("n", (g,), (NicInventory("mlx5_0", 1, 400.0, "4: ACTIVE", "infiniband"),))


@settings(max_examples=50, deadline=None)
@given(gpu_plan)
def test_gpu_plan_round_trip_keeps_every_field(g: GpuPlan) -> None:
    assert_every_field_set(g)
    assert gpu_plan_from_dict(json.loads(json.dumps(gpu_plan_to_dict(g))), "gpu") == g


@settings(max_examples=30, deadline=None)
@given(plan)
def test_plan_round_trip_keeps_every_field(p: Plan) -> None:
    assert_every_field_set(p)
    assert plan_from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_gpu_plan_decoder_names_the_field() -> None:
    doc: dict[str, Any] = {"gpu": "n/gpu0", "hints": {"ep_backend": "nccl"}}
    with pytest.raises(InputError) as err:
        gpu_plan_from_dict(doc, "part.gpus[0]")
    assert err.value.field == "part.gpus[0].hints"


# --------------------------------------------------------------------------- fleet keys

_OLD_KEYS_FLEET = {
    "apiVersion": "mixfleet.io/v1alpha1",
    "kind": "Fleet",
    "spec": {
        "nodes": [
            {
                "name": "h100-0",
                "gpus": [{"model": "H100-SXM5-80GB", "count": 2, "hbm_bandwidth_gbps": 3000}],
                "nvlink": {"domain": "h100-0", "per_gpu_gbps": 900},
                "nics": [{"count": 2, "gbps": 400, "fabric": "ib0"}],
            },
            {
                "name": "h100-1",
                "gpus": [{"model": "H100-SXM5-80GB", "count": 2}],
                "nics": [{"count": 2, "per_direction_gbits_per_s": 400, "fabric": "ib1"}],
            },
        ],
        "fabric_links": [{"between": ["ib0", "ib1"], "gbps": 800}],
    },
}


def test_fleet_old_unit_keys_parse_with_a_deprecation_message_each() -> None:
    fleet = parse_fleet(_OLD_KEYS_FLEET)
    node = fleet.nodes[0]
    assert node.gpus[0].spec.hbm_bandwidth_gbytes_per_s == 3000
    assert node.nvlink is not None and node.nvlink.per_gpu_bidir_gbytes_per_s == 900
    assert node.nics[0].per_direction_gbits_per_s == 400
    assert fleet.fabric_links[0].per_direction_gbits_per_s == 800
    assert len(fleet.warnings) == 4
    assert any(
        w.startswith("spec.nodes[0].nvlink.per_gpu_gbps: deprecated")
        and "'per_gpu_bidir_gbytes_per_s'" in w
        for w in fleet.warnings
    )
    assert any(
        w.startswith("spec.fabric_links[0].gbps:") and "gigabits per second" in w
        for w in fleet.warnings
    )
    new = json.loads(
        json.dumps(_OLD_KEYS_FLEET)
        .replace('"hbm_bandwidth_gbps"', '"hbm_bandwidth_gbytes_per_s"')
        .replace('"per_gpu_gbps"', '"per_gpu_bidir_gbytes_per_s"')
        .replace('"gbps"', '"per_direction_gbits_per_s"')
    )
    renamed = parse_fleet(new)
    assert renamed == fleet and renamed.warnings == ()
    assert replace(fleet, warnings=()) == fleet  # warnings are not part of the identity


def test_fleet_old_and_new_key_together_is_an_error() -> None:
    doc = json.loads(json.dumps(_OLD_KEYS_FLEET))
    doc["spec"]["nodes"][0]["nics"][0]["per_direction_gbits_per_s"] = 400
    with pytest.raises(InputError) as err:
        parse_fleet(doc)
    assert err.value.field == "spec.nodes[0].nics[0].gbps"
