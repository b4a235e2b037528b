"""Contingency plans: a plan per single-node loss of each committed plan, solved in the
background, so a node loss commits a plan at once (the decision's rules, then end to end)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from agent_fakes import wait_until
from test_reconcile import ALL_GPUS, COMMITTED, NODES, NOW, SPEC, main_action
from test_rollout import SPEC as ROLLOUT_SPEC
from test_rollout import run, world

from controlplane.server.inprocess import FAST
from controlplane.server.reconcile import (
    Contingency,
    DeploymentObs,
    Observed,
    PlanContingencies,
    ReconcileSettings,
    Solve,
    inputs_key,
    reconcile,
)
from policies.solve import solve
from policies.spec.build import build_request

S = ReconcileSettings(node_lost_after_s=10.0, contingency_max_nodes=8)


def decided(observed: Observed, settings: ReconcileSettings) -> list[object]:
    return list(reconcile(observed, settings))


def test_a_ready_deployment_plans_one_contingency_per_node() -> None:
    d = DeploymentObs(SPEC, 1, committed=COMMITTED)
    action = main_action(decided(Observed(NOW, NODES, (d,)), S))
    assert isinstance(action, PlanContingencies) and action.version == 1
    assert action.cases[0] == Contingency(
        "a", inputs_key(1, [g for g in ALL_GPUS if not g.startswith("a/")]), ("b", "c")
    )
    assert [c.lost_node for c in action.cases] == ["a", "b", "c"]
    planned = replace(d, contingencies_for=1)  # planned once per committed version
    assert main_action(decided(Observed(NOW, NODES, (planned,)), S)) is None
    off = ReconcileSettings(node_lost_after_s=10.0)  # contingency_max_nodes=0
    assert main_action(decided(Observed(NOW, NODES, (d,)), off)) is None


def test_a_loss_with_a_ready_contingency_proposes_it() -> None:
    lost = inputs_key(1, [g for g in ALL_GPUS if not g.startswith("c/")])
    d = DeploymentObs(SPEC, 1, committed=COMMITTED, contingency_keys=frozenset({lost}))
    nodes = (NODES[0], NODES[1], replace(NODES[2], last_seen_s=NOW - 60))
    action = main_action(decided(Observed(NOW, nodes, (d,)), S))
    assert action == Solve(
        "mx", "node c lost (plan solved in advance)", lost, ("a", "b"), 1, contingency=True
    )
    other = replace(d, contingency_keys=frozenset({"g1:other"}))  # not this loss: solve
    action = main_action(decided(Observed(NOW, nodes, (other,)), S))
    assert isinstance(action, Solve) and not action.contingency


def test_node_loss_commits_the_plan_solved_in_advance(tmp_path: Path) -> None:
    settings = replace(FAST, contingency_max_nodes=8, contingency_processes=0)

    async def main() -> None:
        async with world(tmp_path, nodes=3, settings=settings) as w:
            c = w.ctl.controller
            await w.apply()
            await wait_until(lambda: w.committed() == 1, what="v1")
            await wait_until(lambda: len(c.contingencies.keys("mx")) == 3, what="contingencies")
            v1 = c.store.get_plan("mx", 1)
            assert v1 is not None and v1.plan is not None
            # What a re-solve after losing n2 computes (before n2 is gone).
            fleet = c.fleet_for("mx", ["n0", "n1"])
            expected = solve(build_request(ROLLOUT_SPEC, fleet, previous=v1.plan)).plan
            await w.agents[2].stop()
            await wait_until(lambda: "n2" in c.nodes.lost, what="n2 lost")
            await wait_until(lambda: w.committed() == 2, what="v2 committed")
            v2 = c.store.get_plan("mx", 2)
            # a rollout, not a solve: the plan solved in advance, proposed as it was
            assert v2 is not None and v2.reason == "node n2 lost (plan solved in advance)"
            assert v2.plan_id == expected.id and sorted(v2.nodes) == ["n0", "n1"]
            # The new committed version gets its own contingencies; the old ones are gone.
            await wait_until(lambda: len(c.contingencies.keys("mx")) == 2, what="for v2")
            assert c.contingencies.planned_for("mx") == 2

    run(main())
