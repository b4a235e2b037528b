"""The cost table through the real cost model: every placed deployment's plan is feasible on
its own GPUs alone, nodes are never shared, and the engine group rules reject what the engine
cannot run."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from policies.deployment import sub_fleet, try_solve
from policies.estimate.engines import EngineOptions, EngineSpec
from policies.hardware.fleet import parse_fleet
from policies.scheduling import schedule
from policies.scheduling.baselines import first_fit
from policies.scheduling.check import violations
from policies.scheduling.explain import why_placed
from policies.scheduling.ilp import solve_schedule
from policies.scheduling.table import EstimateCache, TableSettings, build_table
from policies.spec.build import DeploymentSpec, SolverPolicy, WorkloadSpec, to_request


def _fleet(nodes: list[tuple[str, str, int]]) -> Any:
    return parse_fleet(
        {
            "apiVersion": "mixfleet.io/v1alpha1",
            "kind": "Fleet",
            "metadata": {"name": "t"},
            "spec": {
                "nodes": [
                    {
                        "name": name,
                        "gpus": [{"model": model, "count": count}],
                        "nvlink": {"domain": name, "per_gpu_bidir_gbytes_per_s": 900},
                        "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib0"}],
                    }
                    for name, model, count in nodes
                ]
            },
        }
    )


W = WorkloadSpec(tokens_per_gpu=32, context_len=2048)
FLEET = _fleet(
    [
        ("h100-0", "H100-SXM5-80GB", 2),
        ("h100-1", "H100-SXM5-80GB", 2),
        ("h200-0", "H200-SXM-141GB", 2),
        ("a100-0", "A100-SXM4-80GB", 2),
    ]
)


def test_each_placed_plan_is_feasible_on_its_own_gpus() -> None:
    names = [n.name for n in FLEET.nodes]
    specs = [
        DeploymentSpec("mx", model="mixtral-8x7b", policy="greedy", workload=W, priority=3),
        DeploymentSpec("qw", model="qwen3-30b-a3b", policy="greedy", workload=W, priority=2),
        DeploymentSpec("q2", model="qwen3-30b-a3b", policy="greedy", workload=W, objective="cost"),
    ]
    cache = EstimateCache()
    req, s = schedule(FLEET, [(sp, names) for sp in specs], cache=cache)
    assert violations(req, s) == []
    assert s.objective >= first_fit(req).objective - 1e-9
    assert len(s.placements) == 3  # small models: each fits somewhere
    held = [n for p in s.placements.values() for n in p.nodes]
    assert len(held) == len(set(held))
    for spec in specs:
        p = s.placements[spec.name]
        part = sub_fleet(FLEET, p.nodes)
        out = try_solve(to_request(spec, SolverPolicy(workers=1), part))
        assert out.ok, (spec.name, out.reason)
        assert out.result is not None
        assert out.result.plan.summary.tokens_per_s == p.tokens_per_s
    solves = cache.solves
    schedule(FLEET, [(sp, names) for sp in specs], cache=cache)
    assert cache.solves == solves  # estimates are kept between schedules


def test_sglang_groups_need_equal_gpus_per_node() -> None:
    uneven = _fleet([("a", "H100-SXM5-80GB", 2), ("b", "H100-SXM5-80GB", 4)])
    spec = DeploymentSpec(
        "sg", model="qwen3-30b-a3b", policy="greedy", workload=W, engine=EngineSpec("sglang")
    )
    req = build_table(uneven, [(spec, ["a", "b"])])
    by_counts = {c.counts: c for c in req.candidates["sg"]}
    both = by_counts[(1, 1)]
    assert not both.ok and "same number of GPUs" in both.reason
    assert by_counts[(0, 1)].ok


def test_a_memory_fraction_shares_a_node_and_is_estimated_on_its_share() -> None:
    one = _fleet([("h200-0", "H200-SXM-141GB", 2)])
    half = DeploymentSpec(
        "a", model="qwen3-30b-a3b", policy="greedy", workload=W, memory_fraction=0.5
    )
    other = DeploymentSpec(
        "b", model="qwen3-30b-a3b", policy="greedy", workload=W, memory_fraction=0.5
    )
    whole = DeploymentSpec("w", model="qwen3-30b-a3b", policy="greedy", workload=W)
    req, s = schedule(one, [(half, ["h200-0"]), (other, ["h200-0"])])
    assert set(s.placements) == {"a", "b"} and violations(req, s) == []
    full = build_table(one, [(whole, ["h200-0"])]).candidates["w"][0]
    assert s.placements["a"].tokens_per_s <= 0.5 * full.tokens_per_s + 1e-6


def test_replica_groups_split_a_deployment_into_instances() -> None:
    names = [n.name for n in FLEET.nodes]
    spec = DeploymentSpec("qw", model="qwen3-30b-a3b", policy="greedy", workload=W)
    req, s = schedule(FLEET, [(spec, names)], settings=TableSettings(max_instances=4))
    _, s1 = schedule(FLEET, [(spec, names)])
    assert violations(req, s) == []
    # Two instances (the A100 node alone, the rest together) beat one group of all four.
    assert len(s.placements["qw"].instances) > 1
    assert s.placements["qw"].tokens_per_s > s1.placements["qw"].tokens_per_s
    assert sorted(n for i in s.placements["qw"].instances for n in i) == sorted(names)


def test_a_pool_gives_the_same_table_and_each_make_up_is_solved_once() -> None:
    from concurrent.futures import ProcessPoolExecutor

    names = [n.name for n in FLEET.nodes]
    specs = [
        DeploymentSpec("mx", model="mixtral-8x7b", policy="greedy", workload=W, priority=3),
        DeploymentSpec("qw", model="qwen3-30b-a3b", policy="greedy", workload=W),
        DeploymentSpec("q2", model="qwen3-30b-a3b", policy="greedy", workload=W),  # same inputs
    ]
    here = EstimateCache()
    serial = build_table(FLEET, [(sp, names) for sp in specs], cache=here)
    pooled_cache = EstimateCache()
    with ProcessPoolExecutor(2) as pool:
        pooled = build_table(FLEET, [(sp, names) for sp in specs], cache=pooled_cache, pool=pool)
    assert pooled == serial
    # q2 has qw's planning inputs: its candidates come from qw's estimates
    assert serial.candidates["q2"] == serial.candidates["qw"]
    assert here.solves == pooled_cache.solves == len(here.entries)
    assert here.solves < sum(len(c) for c in serial.candidates.values())
    # h100-0 and h100-1 are one make-up: 1x of either is one estimate
    again = build_table(FLEET, [(specs[0], ["h100-1"])], cache=here)
    assert here.solves == pooled_cache.solves  # all from the cache
    assert again.candidates["mx"][0].tokens_per_s == next(
        c.tokens_per_s
        for c in serial.candidates["mx"]
        if c.counts == again.candidates["mx"][0].counts
    )


def test_sglang_estimates_are_a_screen_unless_engine_exact() -> None:
    """A candidate of an SGLang deployment (static replica choice) is estimated as a screen:
    the choice's expectation (the ``dynamic`` rule) and the policy's placement without the
    later stages (the locality search); ``engine_exact`` replays the choice and runs them.
    Either way the figure is that solve of the candidate's nodes."""
    names = ["h100-0", "h100-1", "h200-0"]
    spec = DeploymentSpec(
        "sg",
        model="qwen3-30b-a3b",
        policy="greedy",
        workload=W,
        engine=EngineSpec("sglang"),
        redundant_experts=8,
    )
    part = sub_fleet(FLEET, names)

    def solved(dispatch: str, later_stages: bool) -> float:
        """The candidate's solve under the ``dispatch`` rule, with or without the stages
        after the placement (the screen's options, spelled out)."""
        engine = EngineSpec("sglang", options=EngineOptions(dispatch=dispatch))
        req = to_request(replace(spec, engine=engine), SolverPolicy(workers=1), part)
        req = replace(req, options=replace(req.options, screen=not later_stages))
        out = try_solve(req)
        assert out.ok and out.result is not None, out.reason
        return out.result.plan.summary.tokens_per_s

    def estimated(settings: TableSettings) -> float:
        req = build_table(FLEET, [(spec, names)], settings=settings)
        (every,) = [c for c in req.candidates["sg"] if c.gpus == 6]
        return every.tokens_per_s

    screen, exact = solved("dynamic", False), solved("static", True)
    assert estimated(TableSettings()) == screen
    assert estimated(TableSettings(engine_exact=True)) == exact
    cache = EstimateCache()  # one cache for both: each kind keeps its own estimates
    for settings, want in ((TableSettings(), screen), (TableSettings(engine_exact=True), exact)):
        req = build_table(FLEET, [(spec, names)], settings=settings, cache=cache)
        assert [c.tokens_per_s for c in req.candidates["sg"] if c.gpus == 6] == [want]
    assert screen != exact  # the screen differs from the engine-exact solve here
    assert abs(screen / exact - 1) < 0.05


def test_no_candidate_above_max_gpus_is_estimated_and_the_schedule_is_the_same() -> None:
    """A candidate larger than ``maxGpus`` could never be given: it is not estimated (fewer
    solves), and the schedule is the one the full table gives."""
    names = [n.name for n in FLEET.nodes]
    capped = DeploymentSpec(
        "qw", model="qwen3-30b-a3b", policy="greedy", workload=W, max_gpus=4, priority=2
    )
    other = DeploymentSpec("mx", model="mixtral-8x7b", policy="greedy", workload=W, priority=1)
    specs = [(capped, names), (other, names)]
    req = build_table(FLEET, specs)
    assert req.candidates["qw"] and all(c.gpus <= 4 for c in req.candidates["qw"])
    uncapped = build_table(FLEET, [(replace(capped, max_gpus=0), names), (other, names)])
    assert len(req.candidates["qw"]) < len(uncapped.candidates["qw"])
    pruned = solve_schedule(req)
    full = solve_schedule(replace(uncapped, demands=req.demands))
    assert pruned.placements == full.placements


def test_max_gpus_below_every_node_says_so() -> None:
    """With ``maxGpus`` below the GPUs of every node it may use, no candidate is left; the
    pending reason names maxGpus and the fix."""
    names = [n.name for n in FLEET.nodes]
    spec = DeploymentSpec("qw", model="qwen3-30b-a3b", policy="greedy", workload=W, max_gpus=1)
    req, s = schedule(FLEET, [(spec, names)])
    assert req.candidates["qw"] == () and "qw" not in s.placements
    why = s.pending["qw"]
    assert why.resource == "gpus" and "maxGpus 1 is below one node's GPUs" in why.message
    assert "raise spec.maxGpus" in why.message


def test_why_placed_says_what_sizes_a_deployment_without_max_gpus() -> None:
    names = [n.name for n in FLEET.nodes]
    free = DeploymentSpec("free", model="qwen3-30b-a3b", policy="greedy", workload=W)
    capped = replace(free, name="capped", max_gpus=2)
    for spec, said in ((free, True), (capped, False)):
        req, s = schedule(FLEET, [(spec, names)])
        d = next(x for x in req.demands if x.name == spec.name)
        why = why_placed(req, s, d, s.placements[spec.name])
        assert ("no maxGpus" in why) is said, why
