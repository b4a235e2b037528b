"""Tiers: the interactive tier meets its SLO inside NVLink domains, batch gets the rest."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from builders import fleet, fleet_doc, tiny_model

from policies.advice.tier_planner import batch_tier, interactive_units, plan_tiers
from policies.advice.tiers import BatchTier, InteractiveTier, TierRequest
from policies.deployment import Deployment
from policies.errors import InputError
from policies.hardware.fleet import Fleet, parse_fleet
from policies.request import SolverOptions

NODES: list[tuple[str, str, int, float | None]] = [
    ("h200-0", "H200-SXM-141GB", 2, 900.0),
    ("h100-0", "H100-SXM5-80GB", 2, 900.0),
    ("h100-1", "H100-SXM5-80GB", 2, 900.0),
    ("a100-0", "A100-SXM4-80GB", 2, 600.0),
    ("v100-0", "V100-SXM2-32GB", 2, 300.0),
]
OPTIONS = SolverOptions(time_limit_s=5.0, workers=1)
SLO = InteractiveTier(tpot_ms=1.0, ttft_ms=20.0, prompt_tokens=1024, output_tokens=128)


def request(
    f: Fleet, rate: float, *, preference: str = "fastest", policy: str = "greedy", **kw: object
) -> TierRequest:
    dep = Deployment(f, tiny_model(), policy=policy, options=OPTIONS)
    req = TierRequest(
        dep,
        replace(SLO, requests_per_s=rate),
        BatchTier(tokens_per_gpu=64),
        preference=preference,
        additions=("H200-SXM-141GB", "B200"),
    )
    return replace(req, **kw)  # type: ignore[arg-type]


def test_tiers_partition_the_fleet_and_replicas_stay_in_one_node() -> None:
    f = fleet(NODES)
    tp = plan_tiers(request(f, 20_000, policy="ilp"))
    inter, batch = tp.interactive, tp.batch
    assert inter.slo_met and inter.capacity_requests_per_s >= 20_000
    assert set(inter.nodes).isdisjoint(batch.nodes)
    assert sorted((*inter.nodes, *batch.nodes)) == sorted(n.name for n in f.nodes)
    assert "v100-0" not in inter.nodes  # no FlashAttention-class kernels on Volta
    for r in inter.replicas:
        assert len({g.node for g in r.result.plan.gpus}) == 1  # no cross-node expert traffic
        assert r.tpot_ms <= 1.0 and r.ttft_ms <= 20.0
        assert r.result.plan.workload["phase"] == "decode"
        assert r.result.plan.workload["context_len"] == 1024 + 128
    assert inter.utilisation <= SLO.max_utilisation + 1e-9
    assert batch.results and batch.tokens_per_s > 0


def test_fastest_preference_fills_the_interactive_tier_fastest_units_first() -> None:
    f = fleet(NODES)
    tp = plan_tiers(request(f, 20_000))
    per_gpu = [u.per_gpu for u in tp.unit_types]
    assert per_gpu == sorted(per_gpu, reverse=True)
    assert [u.gpu_model for u in tp.unit_types][:2] == ["H200-SXM-141GB", "H100-SXM5-80GB"]
    assert tp.interactive.nodes == ("h200-0", "h100-0")  # one H200 unit is not enough
    one = tp.unit_types[0].requests_per_s
    assert one < 20_000 <= one + tp.unit_types[1].requests_per_s


def _minimal_assignments(tp_units: dict[str, float], demand: float) -> list[tuple[str, ...]]:
    names = list(tp_units)
    out = []
    for r in range(len(names) + 1):
        for subset in itertools.combinations(names, r):
            have = sum(tp_units[n] for n in subset)
            if have >= demand and all(have - tp_units[n] < demand for n in subset):
                out.append(subset)
    return out


def test_max_batch_is_the_best_minimal_assignment_by_brute_force() -> None:
    f = fleet(NODES)
    demand = 5_000.0
    req = request(f, demand, preference="max-batch", finalists=99, max_assignments=99)
    tp = plan_tiers(req)
    cap = {u.nodes[0]: u.requests_per_s for u in tp.unit_types if u.requests_per_s > 0}
    cap["h100-1"] = cap["h100-0"]  # same unit type
    best = 0.0
    for chosen in _minimal_assignments(cap, demand):
        rest = [n.name for n in f.nodes if n.name not in chosen]
        rep = batch_tier(req.deployment, req.batch, f, rest, "greedy", allow_cross_vendor=False)
        best = max(best, rep.tokens_per_s)
    assert tp.batch.tokens_per_s == pytest.approx(best)
    fastest = plan_tiers(replace(req, preference="fastest"))
    assert tp.batch.tokens_per_s >= fastest.batch.tokens_per_s - 1e-6
    assert tp.interactive.slo_met and tp.assignments_screened >= 2


def test_unmet_slo_suggests_nodes_that_would_meet_it() -> None:
    nodes = NODES[:4]
    f = fleet(nodes)
    tp = plan_tiers(request(f, 100_000))
    inter = tp.interactive
    assert not inter.slo_met
    assert "To fix" in inter.reasons[-1]
    assert set(inter.nodes) == {n.name for n in f.nodes}  # every eligible unit serves
    assert inter.additions
    add = inter.additions[0]
    assert add.requests_per_s_per_node * add.nodes >= 100_000 - inter.capacity_requests_per_s
    assert add.requests_per_s_per_node * (add.nodes - 1) < 100_000 - inter.capacity_requests_per_s
    # adding what it says to the fleet meets the SLO
    more = [(f"add-{k}", add.gpu_model, add.gpus_per_node, 1800.0) for k in range(add.nodes)]
    again = plan_tiers(request(fleet([*nodes, *more]), 100_000))
    assert again.interactive.slo_met


def test_target_no_gpu_meets_reports_why_and_no_additions() -> None:
    tp = plan_tiers(
        replace(request(fleet(NODES[:2]), 10.0), interactive=replace(SLO, tpot_ms=1e-4))
    )
    inter = tp.interactive
    assert not inter.slo_met and not inter.additions and not inter.replicas
    assert any("TPOT" in r and "To fix" in r for r in inter.reasons)
    assert set(tp.batch.nodes) == {"h200-0", "h100-0"}


def test_zero_rate_leaves_everything_to_batch() -> None:
    tp = plan_tiers(request(fleet(NODES[:3]), 0.0))
    assert tp.interactive.slo_met and tp.interactive.nodes == ()
    assert len(tp.batch.nodes) == 3


def test_units_are_nvlink_domains_and_pcie_nodes() -> None:
    doc = fleet_doc(
        [
            ("gb-0", "B200", 2, 1800.0),
            ("gb-1", "B200", 2, 1800.0),
            ("l40s-0", "L40S", 2, None),
            ("h100-0", "H100-SXM5-80GB", 2, 900.0),
        ]
    )
    for i in (0, 1):  # one multi-node NVLink domain (NVL72-style)
        doc["spec"]["nodes"][i]["nvlink"]["domain"] = "nvl72-a"
    f = parse_fleet(doc)
    assert interactive_units(f) == [("gb-0", "gb-1"), ("l40s-0",), ("h100-0",)]
    tp = plan_tiers(request(f, 10.0))
    assert tp.interactive.nodes[:2] == ("gb-0", "gb-1")  # the fastest unit, whole
    replica = tp.interactive.replicas[0]
    assert {g.node for g in replica.result.plan.gpus} == {"gb-0", "gb-1"}


def test_batch_tier_is_split_per_vendor_for_a_moe_model() -> None:
    f = fleet(
        [
            ("mi300x-0", "MI300X", 2, 896.0),
            ("mi300x-1", "MI300X", 2, 896.0),
            ("h100-0", "H100-SXM5-80GB", 2, 900.0),
        ]
    )
    tp = plan_tiers(request(f, 10.0))
    assert tp.interactive.nodes == ("mi300x-0",)  # 5.3 TB/s HBM: the fastest here
    models = [{g.model for g in r.plan.gpus} for r in tp.batch.results]
    assert sorted(map(sorted, models)) == [["H100-SXM5-80GB"], ["MI300X"]]
    mixed = plan_tiers(request(f, 10.0, allow_cross_vendor=True))
    assert len(mixed.batch.results) == 1


@pytest.mark.parametrize(
    ("tier", "needle"),
    [
        (InteractiveTier(), "needs a latency target"),
        (InteractiveTier(tpot_ms=-1.0), "> 0 ms"),
        (InteractiveTier(tpot_ms=1.0, max_utilisation=0.0), r"\(0, 1\]"),
        (InteractiveTier(tpot_ms=1.0, requests_per_s=float("nan")), "requests/s"),
    ],
)
def test_bad_interactive_tiers(tier: InteractiveTier, needle: str) -> None:
    with pytest.raises(InputError, match=needle):
        plan_tiers(replace(request(fleet(NODES[:1]), 1.0), interactive=tier))


def test_bad_preference() -> None:
    with pytest.raises(InputError, match="fastest"):
        plan_tiers(request(fleet(NODES[:1]), 1.0, preference="cheapest"))
