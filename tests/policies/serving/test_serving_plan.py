"""Serving plans: the document codec, prices and shares, strict parsing."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from serving_builders import flat_curve, linear_curve

from policies.errors import InputError
from policies.serving.plan import (
    InstanceGroup,
    KvPath,
    Pool,
    ServingPlan,
    plan_from_doc,
    plan_to_doc,
)

ROOT = Path(__file__).resolve().parents[3]


def _plan() -> ServingPlan:
    return ServingPlan(
        pools=(
            Pool("agg", 2.0, instances=InstanceGroup(3, linear_curve(), 32, 4096, 12.5, "h100")),
            Pool(
                "pd",
                1.0,
                prefill=InstanceGroup(1, flat_curve(), chunk_tokens=16384, usd_per_hour=20.0),
                decode=InstanceGroup(2, linear_curve(), batch_limit=128, usd_per_hour=30.0),
                kv_path=KvPath(gbytes_per_s=50.0, latency_us=15.0),
            ),
        )
    )


def test_the_document_round_trips_and_prices_add_up() -> None:
    plan = _plan()
    assert plan_from_doc(plan_to_doc(plan)) == plan
    assert plan.usd_per_hour() == 3 * 12.5 + 20.0 + 2 * 30.0
    assert plan.shares() == pytest.approx((2 / 3, 1 / 3))
    assert plan.pools[1].disaggregated and not plan.pools[0].disaggregated
    assert KvPath(50.0, 15.0).transfer_us(1e8) == pytest.approx(15.0 + 2000.0)


def _doc_with(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(plan_to_doc(_plan()))
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("pools",), [], "plan.pools"),
        (("pools", 0, "share"), 0, "plan.pools[0].share"),
        (("pools", 1, "name"), "agg", "plan.pools[1].name"),
        (("pools", 1, "kvPath"), None, "plan.pools[1].kvPath"),
        (("pools", 1, "kvPath", "gbytesPerS"), -1, "plan.pools[1].kvPath.gbytesPerS"),
        (("pools", 1, "kvPath", "bandwidth"), 5, "plan.pools[1].kvPath.bandwidth"),
        (
            ("pools", 0, "prefill"),
            plan_to_doc(_plan())["pools"][1]["prefill"],
            "plan.pools[0].instances",
        ),
        (("pools", 0, "instances", "count"), 0, "plan.pools[0].instances.count"),
        (("pools", 0, "instances", "batchLimit"), 5 * 10**6, "plan.pools[0].instances.batchLimit"),
        (("pools", 0, "instances", "chunk"), 5, "plan.pools[0].instances.chunk"),
        (
            ("pools", 0, "instances", "curve", "maxBatch"),
            0,
            "plan.pools[0].instances.curve.maxBatch",
        ),
        (("pool",), [], "plan.pool"),
    ],
)
def test_bad_plans_are_refused_naming_the_field(
    path: tuple[Any, ...], value: Any, field: str
) -> None:
    with pytest.raises(InputError) as err:
        plan_from_doc(_doc_with(path, value))
    assert err.value.field == field


@pytest.mark.parametrize("path", sorted((ROOT / "examples/serving").glob("*plan*.yaml")))
def test_the_example_plans_parse(path: Path) -> None:
    plan = plan_from_doc(yaml.safe_load(path.read_text()))
    assert plan.pools
