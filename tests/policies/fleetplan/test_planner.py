"""The fleet planner: lexicographic priorities, least cost (checked against brute force over
the same candidates), shortfalls, budgets, disaggregation, KV paths, stability against the
previous plan, one answer with or without a process pool, and agreement with the serving
simulator."""

from __future__ import annotations

import itertools
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from support.planner_settings import COARSE

from policies.errors import InputError
from policies.estimate.engines import EngineSpec
from policies.fleetplan import (
    FleetDeployment,
    FleetPlan,
    MemoryCurveCache,
    PlanRequest,
    kv_path,
    plan_fleet,
)
from policies.fleetplan.planner import candidates
from policies.fleetplan.report import plan_doc, serving_plan
from policies.hardware.fleet import Fleet, parse_fleet
from policies.serving.plan import plan_from_doc
from policies.serving.simulate import SimOptions, simulate
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec.build import Budget, DeploymentSpec, WorkloadSpec

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = COARSE
SLO = Slo(ttft_ms=2000, tpot_ms=50, percentile=90)


def fleet(name: str) -> Fleet:
    return parse_fleet(yaml.safe_load((ROOT / "examples" / "fleets" / f"{name}.yaml").read_text()))


def dep(
    name: str,
    model: str,
    rps: float,
    *,
    priority: int = 0,
    isl: int = 4096,
    osl: int = 512,
    slo: Slo = SLO,
    **kw: object,
) -> FleetDeployment:
    spec = DeploymentSpec(
        name,
        model=model,
        workload=WorkloadSpec(kv_cache_dtype="fp8"),
        engine=EngineSpec(name="sglang"),
        priority=priority,
        traffic=Traffic(rps, LengthDist(isl, isl * 1.25), LengthDist(osl, osl * 1.25)),
        slo=slo,
        **kw,  # type: ignore[arg-type]
    )
    return FleetDeployment(spec)


@pytest.fixture(scope="module")
def cache() -> MemoryCurveCache:
    return MemoryCurveCache()


def plan(f: Fleet, *deps: FleetDeployment, cache: MemoryCurveCache, **kw: object) -> FleetPlan:
    return plan_fleet(PlanRequest(f, deps, settings=SETTINGS, **kw), cache=cache)  # type: ignore[arg-type]


def test_higher_priority_demand_is_served_first(cache: MemoryCurveCache) -> None:
    f = fleet("mixed-24")
    big = dep("big", "deepseek-v3", 1000.0, priority=10)
    other = dep("other", "qwen3-235b-a22b", 1000.0, priority=1, isl=1024, osl=1024)
    alone = plan(f, big, cache=cache).deployments["big"].served_requests_per_s
    both = plan(f, big, other, cache=cache)
    assert alone > 0
    assert both.deployments["big"].served_requests_per_s == pytest.approx(alone, rel=1e-6)
    flipped = plan(
        f,
        replace(big, spec=replace(big.spec, priority=0)),
        replace(other, spec=replace(other.spec, priority=5)),
        cache=cache,
    )
    other_alone = plan(f, other, cache=cache).deployments["other"].served_requests_per_s
    assert flipped.deployments["other"].served_requests_per_s == pytest.approx(
        other_alone, rel=1e-6
    )
    # Short deployments are reported with what would serve them.
    for name in ("big", "other"):
        s = both.shortfalls[name]
        d = both.deployments[name]
        assert s.missing_requests_per_s == pytest.approx(1000.0 - d.served_requests_per_s)
        assert s.resource == "gpus" and "more node" in s.fix and "To fix" in s.message


def test_plan_matches_brute_force_over_the_same_candidates(cache: MemoryCurveCache) -> None:
    """Every integer assignment of the candidates on mixed-24 (one node per group): the
    planner's served shares are the lexicographic best and its cost within the cost gap of
    the cheapest assignment that serves them."""
    f = fleet("mixed-24")
    deps = (
        dep("hi", "deepseek-v3", 6.0, priority=3),
        dep("lo", "qwen3-235b-a22b", 6.0, priority=1, isl=1024, osl=1024),
    )
    req = PlanRequest(f, deps, settings=SETTINGS)
    c = candidates(req, cache, None)
    got = plan_fleet(req, cache=cache)
    items: list[tuple[str, tuple[int, ...], float, float]] = []  # deployment, nodes, rps, usd
    for d in deps:
        for v in c.aggregated[d.name]:
            items.append((d.name, v.counts, v.sizing.requests_per_s, v.usd_per_hour))
        for p in c.pairs[d.name]:
            vec = tuple(a + b for a, b in zip(p.prefill.counts, p.decode.counts, strict=True))
            rate = min(p.prefill.sizing.requests_per_s, p.decode.sizing.requests_per_s)
            items.append((d.name, vec, rate, p.prefill.usd_per_hour + p.decode.usd_per_hour))
    items = [it for it in items if max(it[1]) <= 1]  # the others never fit one node per group
    assert 3 <= len(items) <= 16
    best: tuple[tuple[float, ...], float] | None = None
    for pick in itertools.product((0, 1), repeat=len(items)):
        used = [sum(it[1][t] for it, k in zip(items, pick, strict=True) if k) for t in range(3)]
        if any(u > 1 for u in used):
            continue
        served = tuple(
            min(
                d.traffic.requests_per_s,
                sum(it[2] for it, k in zip(items, pick, strict=True) if k and it[0] == d.name),
            )
            / d.traffic.requests_per_s
            for d in deps
        )
        cost = sum(it[3] for it, k in zip(items, pick, strict=True) if k)
        if best is None or served > best[0] or (served == best[0] and cost < best[1]):
            best = (served, cost)
    assert best is not None
    mine = tuple(
        got.deployments[d.name].served_requests_per_s / d.traffic.requests_per_s for d in deps
    )
    assert mine == pytest.approx(best[0], abs=1e-6)
    assert got.usd_per_hour <= best[1] * (1 + SETTINGS.cost_gap) + 1e-6


def test_least_cost_for_a_small_demand(cache: MemoryCurveCache) -> None:
    f = fleet("hopper-blackwell-24")
    got = plan(f, dep("d", "qwen3-235b-a22b", 1.0, isl=1024, osl=1024), cache=cache)
    d = got.deployments["d"]
    assert d.served_requests_per_s == pytest.approx(1.0) and not got.shortfalls
    cheapest = min(
        v.usd_per_hour
        for v in got.variants["d"]
        if v.role == "aggregated" and v.sizing.requests_per_s >= 1.0
    )
    assert d.usd_per_hour <= cheapest + 1e-9
    assert len(got.free_nodes) >= 1


def test_an_slo_no_instance_meets_and_a_budget_are_reported(cache: MemoryCurveCache) -> None:
    f = fleet("mixed-24")
    fast = dep("fast", "qwen3-235b-a22b", 5.0, isl=1024, osl=1024, slo=Slo(2000, 1.0, 90))
    got = plan(f, fast, cache=cache)
    assert got.deployments["fast"].pools == ()
    s = got.shortfalls["fast"]
    assert s.resource == "slo" and "TPOT 1 ms" in s.message
    broke = dep(
        "broke", "qwen3-235b-a22b", 5.0, isl=1024, osl=1024, budget=Budget(usd_per_hour=1.0)
    )
    got = plan(f, broke, cache=cache)
    assert got.deployments["broke"].served_requests_per_s == 0
    assert got.shortfalls["broke"].resource == "budget"
    assert "1 USD/h" in got.shortfalls["broke"].message


def test_disaggregation_on_and_off(cache: MemoryCurveCache) -> None:
    f = fleet("homog-32")
    on = plan(f, dep("d", "qwen3-235b-a22b", 1000.0, disaggregation="on"), cache=cache)
    pools = on.deployments["d"].pools
    assert pools and all(p.instances is None and p.prefill and p.decode for p in pools)
    assert all(p.kv_path.startswith("RDMA") and p.kv_gbytes_per_s > 0 for p in pools)
    off = plan(f, dep("d", "qwen3-235b-a22b", 1000.0, disaggregation="off"), cache=cache)
    assert off.deployments["d"].pools
    assert all(p.instances is not None for p in off.deployments["d"].pools)
    # Instances take whole nodes, each node once.
    nodes = [n for p in on.deployments["d"].pools for g in p.groups() for i in g.nodes for n in i]
    assert len(nodes) == len(set(nodes)) <= 4


def test_kv_paths_follow_the_fleets_links() -> None:
    f = fleet("ada-hopper")
    rdma = kv_path(f.node("h100-0"), f.node("l40s-0"), f)
    assert rdma is not None and rdma[2] == "RDMA roce0"
    assert rdma[0] == pytest.approx(200 / 8 * 0.85)  # one 200 Gb/s port at RDMA efficiency
    two = fleet("two-segments")
    a, b = two.nodes[0], two.nodes[-1]
    path = kv_path(a, b, two)
    if set(a.fabrics) & set(b.fabrics):
        assert path is not None and path[2].startswith("RDMA")
    else:
        link = next(x for x in two.fabric_links)
        assert path is not None and path[0] <= link.per_direction_gbits_per_s / 8
    lonely = replace(f.node("l40s-0"), nics=())
    assert kv_path(f.node("h100-0"), lonely, f) is None


def test_a_changed_demand_keeps_the_running_instances(cache: MemoryCurveCache) -> None:
    f = fleet("mixed-64")
    d = dep("q", "qwen3-235b-a22b", 9.0, isl=1024, osl=1024)
    first = plan(f, d, cache=cache)
    less = replace(d, spec=replace(d.spec, traffic=replace(d.traffic, requests_per_s=8.0)))
    second = plan(f, less, cache=cache, previous=first)
    fresh = plan(f, less, cache=cache)

    def nodes(p: FleetPlan) -> set[str]:
        return {
            n for pl in p.deployments["q"].pools for g in pl.groups() for i in g.nodes for n in i
        }

    # From scratch the lower demand has a cheaper plan on other nodes; against the running
    # plan, the move penalty outweighs the saving and the instances stay.
    assert nodes(fresh) != nodes(first)
    assert nodes(first) <= nodes(second)
    assert second.curves_computed == 0 and second.curves_cached > 0


def test_the_same_plan_with_a_process_pool() -> None:
    f = fleet("mixed-24")
    deps = (
        dep("a", "qwen3-30b-a3b", 30.0, isl=1024, osl=512),
        dep("b", "gpt-oss-120b", 30.0, priority=2),
    )
    req = PlanRequest(f, deps, settings=SETTINGS)
    here = plan_fleet(req, cache=MemoryCurveCache())
    with ProcessPoolExecutor(2) as pool:
        there = plan_fleet(req, cache=MemoryCurveCache(), pool=pool)
    assert plan_doc(here, 8192) == plan_doc(there, 8192)


def test_the_prediction_agrees_with_the_simulator(cache: MemoryCurveCache) -> None:
    f = fleet("mixed-24")
    got = plan(f, dep("d", "deepseek-v3", 1000.0), cache=cache)
    d = got.deployments["d"]
    sp = serving_plan(d, SETTINGS.chunk_tokens)
    assert sp is not None
    assert (
        plan_from_doc(plan_doc(got, SETTINGS.chunk_tokens)["deployments"][0]["servingPlan"]) == sp
    )
    tr = replace(d.traffic, requests_per_s=d.served_requests_per_s)
    rep = simulate(sp, tr, d.slo, SimOptions(requests=3000, seed=1, warmup_requests=300))
    assert rep.goodput_rps == pytest.approx(d.served_requests_per_s, rel=0.10)


def test_a_deployment_without_traffic_or_slo_is_refused() -> None:
    f = fleet("mixed-24")
    spec = DeploymentSpec("x", model="qwen3-30b-a3b")
    with pytest.raises(InputError, match="traffic") as info:
        plan_fleet(PlanRequest(f, (FleetDeployment(spec),)))
    assert info.value.field == "deployments.x.traffic"
    d = dep("x", "qwen3-30b-a3b", 1.0)
    with pytest.raises(InputError, match="twice"):
        plan_fleet(PlanRequest(f, (d, d)))


def test_queueing_rates_few_slots_lower_than_many(cache: MemoryCurveCache) -> None:
    """With the queueing bound (the default) each aggregated variant's capacity is the
    flat one scaled by what its slots hold within the TTFT target: less for fewer slots."""
    f = fleet("mixed-24")
    d = dep("d", "qwen3-235b-a22b", 1000.0)
    flat = candidates(
        PlanRequest(f, (d,), settings=replace(SETTINGS, queueing=False)), cache, None
    ).aggregated["d"]
    queued = candidates(PlanRequest(f, (d,), settings=SETTINGS), cache, None).aggregated["d"]
    assert [v.key for v in flat] == [v.key for v in queued] and len(flat) >= 2
    shares = sorted(
        (q.sizing.batch_limit, q.sizing.requests_per_s / v.sizing.requests_per_s)
        for v, q in zip(flat, queued, strict=True)
    )
    assert [v.sizing.batch_limit for v in flat] == [q.sizing.batch_limit for q in queued]
    assert all(0.7 < s < 1.0 for _, s in shares)
    assert [s for _, s in shares] == sorted(s for _, s in shares)  # more slots, more held
    assert shares[0][1] < shares[-1][1] - 0.02


def test_pairs_fit_the_nodes_a_deployment_may_use(cache: MemoryCurveCache) -> None:
    """On mixed-24 (one node per generation) a prefill partner from the decode side's own
    node group would need a second node of it: such a pair is not a candidate, and a partner
    from other nodes takes its place (the H200 node decoding for A100 + H100 prefill)."""
    f = fleet("mixed-24")
    d = dep("d", "deepseek-v3", 1000.0)
    c = candidates(PlanRequest(f, (d,), settings=SETTINGS), cache, None)
    pairs = c.pairs["d"]
    assert pairs
    for p in pairs:
        need = [a + b for a, b in zip(p.prefill.counts, p.decode.counts, strict=True)]
        assert all(n <= cap for n, cap in zip(need, c.eligible["d"], strict=True)), p.key
    h200 = next(t for t, g in enumerate(c.groups) if "H200" in g.label)
    assert any(p.decode.counts[h200] == 1 and p.prefill.counts[h200] == 0 for p in pairs)


def test_a_stated_batch_caps_the_instances(cache: MemoryCurveCache) -> None:
    """``tokensPerGpu`` stated: an explicit override of the batch the SLO allows, on every
    aggregated and decode instance (and the export's tokensPerGpu says so)."""
    f = fleet("homog-32")
    free = plan(f, dep("d", "qwen3-235b-a22b", 1000.0, isl=1024, osl=1024), cache=cache)
    stated = DeploymentSpec(
        "d",
        model="qwen3-235b-a22b",
        workload=WorkloadSpec(kv_cache_dtype="fp8", tokens_per_gpu=16),
        engine=EngineSpec(name="sglang"),
        traffic=Traffic(1000.0, LengthDist(1024, 1280), LengthDist(1024, 1280)),
        slo=SLO,
    )
    assert stated.workload.tokens_per_gpu_set
    capped = plan(f, FleetDeployment(stated), cache=cache)

    def batches(p: FleetPlan) -> list[tuple[int, int]]:
        return [
            (g.batch_limit, g.variant.gpus)
            for pool in p.deployments["d"].pools
            for g in pool.groups()
            if g.variant.role != "prefill"
        ]

    assert any(b > 16 * gpus for b, gpus in batches(free))  # the SLO allows more
    assert batches(capped) and all(b <= 16 * gpus for b, gpus in batches(capped))
    assert (
        capped.deployments["d"].served_requests_per_s < free.deployments["d"].served_requests_per_s
    )
    # The fleet is short of 1,000 requests/s either way; the capped plan says its batch is why.
    assert "tokensPerGpu 16" in capped.shortfalls["d"].message
    assert "tokensPerGpu" not in free.shortfalls["d"].message
