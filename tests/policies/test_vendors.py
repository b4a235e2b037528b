"""Mixed vendors: expert-parallel groups never span NVIDIA and AMD unless allowed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from builders import fleet, fleet_doc, request, tiny_model, workload

from policies.errors import InputError
from policies.hardware.fleet import parse_fleet
from policies.hardware.vendors import check_vendors, split_by_vendor, vendors_of
from policies.model.architecture import preset
from policies.request import PlacementRequest
from policies.solve import solve

MIXED_VENDORS = [
    ("h100-0", "H100-SXM5-80GB", 2, 900.0),
    ("mi300x-0", "MI300X", 2, 896.0),
    ("h100-1", "H100-SXM5-80GB", 2, 900.0),
]


def test_split_by_vendor_partitions_the_nodes_and_keeps_order() -> None:
    f = fleet(MIXED_VENDORS)
    parts = split_by_vendor(f)
    assert [p.name for p in parts] == ["t-amd", "t-nvidia"]
    assert [n.name for n in parts[0].nodes] == ["mi300x-0"]
    assert [n.name for n in parts[1].nodes] == ["h100-0", "h100-1"]
    assert sorted(g.id for p in parts for g in p.gpus) == sorted(g.id for g in f.gpus)
    for p in parts:
        assert len(vendors_of(p)) == 1


def test_single_vendor_fleet_comes_back_unchanged() -> None:
    f = fleet(MIXED_VENDORS[:1])
    assert split_by_vendor(f) == [f]


def test_fabric_links_follow_the_nodes_that_use_them() -> None:
    doc = fleet_doc(MIXED_VENDORS)
    doc["spec"]["nodes"][1]["nics"][0]["fabric"] = "roce1"
    doc["spec"]["fabric_links"] = [{"between": ["ib0", "roce1"], "per_direction_gbits_per_s": 100}]
    parts = split_by_vendor(parse_fleet(doc))
    assert all(p.fabric_links == () for p in parts)  # each part uses one fabric only


def test_moe_deployment_across_vendors_is_refused_with_a_fix() -> None:
    f = fleet(MIXED_VENDORS)
    with pytest.raises(InputError) as err:
        check_vendors(f, tiny_model())
    text = str(err.value)
    assert "2 amd, 4 nvidia" in text
    assert "To fix" in text and "t-amd" in text and "allow_cross_vendor" in text


def test_allowed_or_dense_or_single_vendor_passes() -> None:
    f = fleet(MIXED_VENDORS)
    check_vendors(f, tiny_model(), allow_cross_vendor=True)
    check_vendors(f, preset("llama-3.1-70b"))  # dense: no all-to-all
    check_vendors(fleet(MIXED_VENDORS[:1]), tiny_model())


def test_node_with_two_vendors_is_an_input_error() -> None:
    doc = fleet_doc(MIXED_VENDORS[:1])
    doc["spec"]["nodes"][0]["gpus"].append({"model": "MI300X", "count": 1})
    with pytest.raises(InputError, match="several vendors"):
        vendors_of(parse_fleet(doc))


WIRED = "allow_cross_vendor" in PlacementRequest.__dataclass_fields__


@pytest.mark.skipif(not WIRED, reason="policies.solve does not call check_vendors yet")
def test_solve_refuses_a_cross_vendor_group_unless_allowed() -> None:
    f = fleet(MIXED_VENDORS)
    m = tiny_model()
    req = request(f, m, workload(m), policy="greedy", redundant=4)
    with pytest.raises(InputError, match="To fix: deploy one copy per vendor"):
        solve(req)
    allow: dict[str, Any] = {"allow_cross_vendor": True}  # a field once request.py has it
    allowed = replace(req, **allow)
    assert solve(allowed).plan.summary.feasible
    for part in split_by_vendor(f):
        solve(request(part, m, workload(m), policy="greedy", redundant=0))
