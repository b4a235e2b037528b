"""Cost per token and the minimum-cost subset, checked against brute force."""

from __future__ import annotations

import itertools
import math

import pytest
from builders import fleet, tiny_model

from policies.advice.cost import (
    DEFAULT_USD_PER_GPU_HOUR,
    PriceTable,
    fleet_usd_per_hour,
    min_cost,
    plan_cost,
    plans_cost,
    price_table_from_dict,
    usd_per_million_tokens,
)
from policies.deployment import Deployment, node_groups, sub_fleet, try_solve
from policies.errors import InfeasibleError, InputError
from policies.hardware.catalog import catalog_names
from policies.request import SolverOptions

NODES = [
    ("a100-0", "A100-SXM4-80GB", 2, 600.0),
    ("a100-1", "A100-SXM4-80GB", 2, 600.0),
    ("h100-0", "H100-SXM5-80GB", 2, 900.0),
    ("h200-0", "H200-SXM-141GB", 2, 900.0),
]
OPTIONS = SolverOptions(time_limit_s=5.0, workers=1)


def test_every_catalog_gpu_has_a_default_price() -> None:
    assert set(DEFAULT_USD_PER_GPU_HOUR) == set(catalog_names())
    assert all(v > 0 for v in DEFAULT_USD_PER_GPU_HOUR.values())


def test_price_file_overrides_defaults_and_resolves_aliases() -> None:
    table = price_table_from_dict(
        {"currency": "EUR", "prices": {"H100-SXM": 2.0, "NVIDIA H200": 3.0, "MyGPU": 0.5}},
        source="f",
    )
    assert table.price("H100-SXM5-80GB") == 2.0
    assert table.price("H200-SXM-141GB") == 3.0
    assert table.price("MyGPU") == 0.5
    assert table.price("A100-SXM4-80GB") == DEFAULT_USD_PER_GPU_HOUR["A100-SXM4-80GB"]
    assert table.currency == "EUR"
    flat = price_table_from_dict({"L4": 0.1})
    assert flat.price("L4") == 0.1


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "cheap", True])
def test_bad_prices_are_input_errors(bad: object) -> None:
    with pytest.raises(InputError) as err:
        price_table_from_dict({"prices": {"L4": bad}})
    assert err.value.field == "prices.L4"


def test_missing_price_says_how_to_fix_it() -> None:
    with pytest.raises(InputError, match="To fix: add 'Nope: <USD per GPU-hour>'"):
        PriceTable({}).price("Nope")


def test_cost_per_million_tokens_is_price_over_throughput() -> None:
    m = tiny_model()
    f = fleet(NODES[2:])
    dep = Deployment(f, m, options=OPTIONS)
    out = try_solve(dep.request(64))
    assert out.ok and out.result is not None
    plan = out.result.plan
    prices = PriceTable()
    cost = plan_cost(plan, prices)
    assert cost.usd_per_hour == pytest.approx(2 * 2.99 + 2 * 3.80)
    assert cost.usd_per_hour == pytest.approx(fleet_usd_per_hour(f, prices))
    assert cost.usd_per_million_tokens == pytest.approx(
        cost.usd_per_hour / (plan.summary.tokens_per_s * 3600) * 1e6
    )
    assert cost.gpus_by_model == {"H100-SXM5-80GB": 2, "H200-SXM-141GB": 2}
    both = plans_cost([plan, plan], prices)
    assert both.usd_per_million_tokens == pytest.approx(cost.usd_per_million_tokens)
    assert usd_per_million_tokens(10.0, 0.0) == math.inf


def _brute_force(dep: Deployment, target: float, prices: PriceTable) -> float:
    """Cheapest price of any node subset whose one-group greedy plan reaches the target."""
    best = math.inf
    names = [n.name for n in dep.fleet.nodes]
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(names, r):
            part = sub_fleet(dep.fleet, subset)
            price = fleet_usd_per_hour(part, prices)
            if price >= best:
                continue
            out = try_solve(dep.request(64, fleet=part, policy="greedy"))
            if out.ok and out.result is not None and out.result.plan.summary.tokens_per_s >= target:
                best = price
    return best


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.9])
def test_min_cost_matches_brute_force(fraction: float) -> None:
    dep = Deployment(fleet(NODES), tiny_model(), options=OPTIONS)
    prices = PriceTable()
    whole = try_solve(dep.request(64, policy="greedy"))
    assert whole.result is not None
    target = fraction * whole.result.plan.summary.tokens_per_s
    got = min_cost(
        dep,
        target,
        prices,
        tokens_per_gpu=64,
        final_policy="greedy",
        layout="group",
        finalists=50,
        slack=0.0,
    )
    assert got.best.usd_per_hour == pytest.approx(_brute_force(dep, target, prices))
    assert got.cost.tokens_per_s >= target
    assert len(got.results) == 1 and got.best.layout == "group"
    # screened subsets come in order of price
    prices_seen = [c.usd_per_hour for c in got.screened]
    assert prices_seen == sorted(prices_seen)


def test_replicas_layout_runs_one_copy_per_node() -> None:
    dep = Deployment(fleet(NODES), tiny_model(), options=OPTIONS)
    got = min_cost(dep, 1.0, PriceTable(), tokens_per_gpu=64, layout="replicas")
    assert got.best.layout == "replicas"
    assert [len({g.node for g in r.plan.gpus}) for r in got.results] == [1] * len(got.results)
    assert {n for r in got.results for n in {g.node for g in r.plan.gpus}} == set(got.best.nodes)


def test_ilp_finalist_is_no_worse_than_its_screen() -> None:
    dep = Deployment(fleet(NODES), tiny_model(), options=OPTIONS)
    whole = try_solve(dep.request(64, policy="greedy"))
    assert whole.result is not None
    got = min_cost(
        dep, 0.8 * whole.result.plan.summary.tokens_per_s, PriceTable(), tokens_per_gpu=64
    )
    for c in got.finalists:
        assert c.final_tokens_per_s is not None
        assert c.final_tokens_per_s >= c.screened_tokens_per_s * (1 - 1e-9)


def test_subsets_never_mix_vendors_for_a_moe_model() -> None:
    nodes = [("mi300x-0", "MI300X", 2, 896.0), ("h100-0", "H100-SXM5-80GB", 2, 900.0)]
    dep = Deployment(fleet(nodes), tiny_model(), options=OPTIONS)
    groups = node_groups(dep.fleet)
    assert len(groups) == 2
    huge = 1e12
    with pytest.raises(InfeasibleError) as err:
        min_cost(dep, huge, PriceTable(), tokens_per_gpu=64, layout="group")
    assert "spanning GPU vendors skipped" in str(err.value)
    assert "To fix" in str(err.value)


def test_bad_min_cost_inputs() -> None:
    dep = Deployment(fleet(NODES[:1]), tiny_model(), options=OPTIONS)
    with pytest.raises(InputError):
        min_cost(dep, 0.0, PriceTable(), tokens_per_gpu=8)
    with pytest.raises(InputError):
        min_cost(dep, 1.0, PriceTable(), tokens_per_gpu=8, layout="mesh")
    with pytest.raises(InputError, match="no price"):
        min_cost(dep, 1.0, PriceTable({}), tokens_per_gpu=8)
