"""One fleet, both kinds of deployment (policies.fleetplan.combined): the deployment with
traffic and SLOs is planned as instances first, the other gets whole nodes from the fleet
scheduler among the nodes the plan leaves free - and only those."""

from __future__ import annotations

from dataclasses import replace

from test_instances import SETTINGS, SPEC

from policies.fleet import parse_fleet
from policies.fleetplan import MemoryCurveCache
from policies.fleetplan.combined import PlanOptions, plan_and_schedule
from policies.spec import DeploymentSpec, WorkloadSpec

NODES = [
    {
        "name": f"h{i}",
        "gpus": [{"model": "H100-SXM5-80GB", "count": 4}],
        "nvlink": {"per_gpu_bidir_gbytes_per_s": 900},
        "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib"}],
    }
    for i in range(3)
]
FLEET = parse_fleet({"metadata": {"name": "f"}, "spec": {"nodes": NODES}})
ALL = ("h0", "h1", "h2")
OTHER = DeploymentSpec(
    "batch",
    model="qwen3-30b-a3b",
    policy="greedy",
    workload=WorkloadSpec(phase="decode", tokens_per_gpu=64, context_len=4096),
)


def test_the_planned_deployment_first_then_the_other_on_the_free_nodes() -> None:
    assert SPEC.traffic is not None
    planned = replace(SPEC, traffic=replace(SPEC.traffic, requests_per_s=20.0))
    planning = PlanOptions(settings=SETTINGS, cache=MemoryCurveCache())
    d = plan_and_schedule(FLEET, [(planned, ALL), (OTHER, ALL)], planning=planning)
    assert d.plan is not None and d.request is not None and d.schedule is not None
    used = {
        n for p in d.plan.deployments["q"].pools for g in p.groups() for i in g.nodes for n in i
    }
    assert used and set(d.plan.free_nodes) == set(ALL) - used
    placed = d.schedule.placements["batch"]
    assert set(placed.nodes) <= set(d.plan.free_nodes)
    assert {dem.name for dem in d.request.demands} == {"batch"}

    alone = plan_and_schedule(FLEET, [(planned, ALL)], planning=planning)
    assert alone.request is None and alone.schedule is None
    assert alone.plan is not None and set(alone.plan.free_nodes) == set(d.plan.free_nodes)
    only = plan_and_schedule(FLEET, [(OTHER, ALL)], planning=planning)
    assert only.plan is None and only.schedule is not None
