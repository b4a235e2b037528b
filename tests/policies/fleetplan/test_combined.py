"""One fleet, both kinds of deployment (policies.fleetplan.combined): the deployment with
traffic and SLOs is planned as instances, the other gets whole nodes from the fleet
scheduler among the nodes the plan leaves free - and only those; priority orders both kinds
by the fleet scheduler's rules (a higher priority first and may take a lower one's nodes, an
equal one never takes a running deployment's nodes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_instances import SETTINGS, SPEC

from policies.errors import InputError
from policies.fleetplan import FleetPlan, MemoryCurveCache
from policies.fleetplan.combined import (
    FleetDecision,
    PlanOptions,
    ScheduleOptions,
    plan_and_schedule,
    steps,
)
from policies.hardware.fleet import parse_fleet
from policies.spec.build import DeploymentSpec, WorkloadSpec

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


CURVES = MemoryCurveCache()
#: More demand than the three nodes serve: the planner wants every node it may have.
HUNGRY = SPEC
#: One node is all it may take (4 GPUs).
ONE_NODE = replace(OTHER, max_gpus=4)


def _decide(
    *specs: DeploymentSpec, running: dict[str, frozenset[str]] | None = None
) -> FleetDecision:
    return plan_and_schedule(
        FLEET,
        [(s, ALL) for s in specs],
        planning=PlanOptions(settings=SETTINGS, cache=CURVES),
        scheduling=ScheduleOptions(previous=running or {}),
    )


def _planned_nodes(plan: FleetPlan | None) -> set[str]:
    assert plan is not None
    return {
        n
        for dp in plan.deployments.values()
        for p in dp.pools
        for g in p.groups()
        for i in g.nodes
        for n in i
    }


def test_a_higher_priority_unplanned_deployment_keeps_its_node_from_a_planned_one() -> None:
    alone = _decide(HUNGRY)
    assert _planned_nodes(alone.plan) == set(ALL)  # it would take every node
    running = {"batch": frozenset({"h0"})}
    d = _decide(HUNGRY, replace(ONE_NODE, priority=100), running=running)
    assert d.schedule is not None and d.plan is not None
    assert d.schedule.placements["batch"].nodes == ("h0",)
    assert _planned_nodes(d.plan) == {"h1", "h2"}
    assert d.plan.free_nodes == ("h0",)  # no instance uses it
    short = d.plan.shortfalls["q"]
    assert short.resource == "gpus" and "(h0) are held by batch" in short.message
    assert [(s.kind, s.priorities, s.nodes) for s in d.steps] == [
        ("schedule", (100,), ("h0",)),
        ("plan", (0,), ("h1", "h2")),
        ("schedule", (100,), ()),
    ]
    # A newcomer of the higher priority gets a node too; the plan keeps off it.
    new = _decide(HUNGRY, replace(ONE_NODE, priority=100))
    assert new.schedule is not None and len(new.schedule.placements["batch"].nodes) == 1
    assert not set(new.schedule.placements["batch"].nodes) & _planned_nodes(new.plan)


def test_a_higher_priority_planned_deployment_takes_a_lower_running_ones_nodes() -> None:
    alone = _decide(HUNGRY)
    running = {"batch": frozenset(ALL)}
    d = _decide(replace(HUNGRY, priority=100), OTHER, running=running)
    assert _planned_nodes(d.plan) == _planned_nodes(alone.plan) == set(ALL)
    assert d.plan is not None and alone.plan is not None
    assert d.plan.deployments["q"].served_requests_per_s == pytest.approx(
        alone.plan.deployments["q"].served_requests_per_s
    )
    assert d.schedule is not None and not d.schedule.placements
    pend = d.schedule.pending["batch"]
    assert (pend.resource, pend.nodes, pend.missing) == ("priority", ALL, 12.0)
    assert "instances of q" in pend.message
    assert [dec.kind for dec in d.schedule.decisions] == ["pending"]


def test_equal_priority_never_preempts_a_running_deployment() -> None:
    hungry, one = replace(HUNGRY, priority=5), replace(ONE_NODE, priority=5)
    # The unplanned deployment runs on h0: the planned newcomer of its priority leaves it.
    d = _decide(hungry, one, running={"batch": frozenset({"h0"})})
    assert d.schedule is not None and d.schedule.placements["batch"].nodes == ("h0",)
    assert _planned_nodes(d.plan) == {"h1", "h2"}
    assert d.plan is not None and "(h0) are held by batch" in d.plan.shortfalls["q"].message
    assert [s.kind for s in d.steps] == ["plan", "schedule"]
    # Both new: the planned one is served first, as before.
    both_new = _decide(hungry, one)
    assert _planned_nodes(both_new.plan) == set(ALL)
    assert both_new.schedule is not None and "batch" in both_new.schedule.pending
    # The planned one runs (its previous plan) and the unplanned one is new: it keeps them.
    assert both_new.plan is not None
    kept = plan_and_schedule(
        FLEET,
        [(hungry, ALL), (one, ALL)],
        planning=PlanOptions(previous=both_new.plan, settings=SETTINGS, cache=CURVES),
    )
    assert _planned_nodes(kept.plan) == set(ALL)
    assert kept.schedule is not None and "batch" in kept.schedule.pending


def test_the_walk_down_the_priority_levels() -> None:
    def walk(*specs: DeploymentSpec) -> list[tuple[str, list[str]]]:
        pairs = [(s, ALL) for s in specs]
        return [(kind, [pairs[i][0].name for i in idx]) for kind, idx in steps(pairs)]

    p = [replace(HUNGRY, name=f"p{i}", priority=i) for i in (9, 5, 0)]
    u = [replace(OTHER, name=f"u{i}", priority=i) for i in (9, 5, 0)]
    # Planned at or above every unplanned one: the planner once, then the scheduler once.
    assert walk(u[2], p[0], u[1], p[1]) == [("plan", ["p9", "p5"]), ("schedule", ["u5", "u0"])]
    assert walk(p[2], u[2]) == [("plan", ["p0"]), ("schedule", ["u0"])]
    # Interleaved levels: one step per run of one kind, high to low.
    assert walk(p[2], u[0], p[1], u[2]) == [
        ("schedule", ["u9"]),
        ("plan", ["p5", "p0"]),
        ("schedule", ["u0"]),
    ]
    assert walk(u[0], u[1], p[2]) == [("schedule", ["u9", "u5"]), ("plan", ["p0"])]
    assert walk() == []


def test_the_same_inputs_give_the_same_decision_and_names_are_unique() -> None:
    args = (HUNGRY, replace(ONE_NODE, priority=100))
    a, b = _decide(*args), _decide(*args)
    assert a.plan is not None and b.plan is not None and a.schedule and b.schedule
    assert _planned_nodes(a.plan) == _planned_nodes(b.plan)
    assert a.plan.shortfalls == b.plan.shortfalls and a.steps == b.steps
    assert a.schedule.placements == b.schedule.placements
    with pytest.raises(InputError, match="appears twice") as err:
        _decide(HUNGRY, replace(OTHER, name="q"))
    assert err.value.field == "deployments.q.name"


def test_a_lower_unplanned_level_gets_no_node_the_planned_level_above_it_was_denied() -> None:
    top = replace(OTHER, name="top", priority=100)  # takes every node it may
    low = replace(ONE_NODE, name="low")
    d = _decide(replace(HUNGRY, priority=50), top, low)
    assert d.plan is not None and d.schedule is not None
    assert d.schedule.placements["top"].nodes == ALL
    assert not _planned_nodes(d.plan) and d.plan.deployments["q"].served_requests_per_s == 0
    assert "are held by top" in d.plan.shortfalls["q"].message
    assert "low" in d.schedule.pending  # not on a node q, of a higher priority, was denied
    assert [s.kind for s in d.steps] == ["schedule", "plan", "schedule"]
