"""The fleet scheduler in Kubernetes mode: the operator's pure decision plans only on the
GPUNodes the scheduler assigns, reports Unschedulable with the reason, and the status carries
the assigned GPUs; :class:`operators.fleet_schedule.FleetAssignments` gives two deployments
disjoint GPUNodes; a deployment left without GPUNodes withdraws its PartitionPlans; a node
moves only once drained; namespace quotas hold per Kubernetes namespace."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest
from k8s_builders import (
    FAST_POLICY,
    T0,
    deployment,
    md_object,
    node_view,
    observed,
    plan_view_from,
    run_solve,
)

from apis.kube.v1alpha1 import PlacementPolicySpec
from operators.decide import ApplyPlan, ApplyStatus, DeletePlan, SolveAction, reconcile
from operators.fleet_schedule import FleetAssignments, drained
from operators.observe import ReconcileSettings
from policies.errors import InputError

SETTINGS = ReconcileSettings(node_stale_after_s=90.0, plan_history=2, solver_error_retry_s=60.0)


def test_the_solve_uses_only_the_assigned_gpunodes_and_the_status_counts_them() -> None:
    obs = observed(deployment(), assigned_nodes=("h100-0",))
    actions = reconcile(obs, SETTINGS)
    (solve,) = [a for a in actions if isinstance(a, SolveAction)]
    assert {g.node for g in solve.request.fleet.gpus} == {"h100-0"}
    after = reconcile(dataclasses.replace(obs, solve=run_solve(solve)), SETTINGS)
    (status,) = [a for a in after if isinstance(a, ApplyStatus)]
    assert status.status["assignedGpus"] == 2 and status.status["gpus"] == 2


def test_no_assigned_node_is_unschedulable_with_the_reason() -> None:
    why = "its closest runnable instance needs 2 GPUs, 2 more than are free; held by big"
    obs = observed(deployment(), assigned_nodes=(), unschedulable=why)
    actions = reconcile(obs, SETTINGS)
    assert not [a for a in actions if isinstance(a, SolveAction)]
    (status,) = [a for a in actions if isinstance(a, ApplyStatus)]
    solved = next(c for c in status.status["conditions"] if c["type"] == "Solved")
    assert solved["status"] == "False" and solved["reason"] == "Unschedulable"
    assert why in solved["message"]
    assert status.status["assignedGpus"] == 0


def test_two_deployments_get_disjoint_gpunodes() -> None:
    nodes = [node_view("h100-0"), node_view("h100-1"), node_view("a100-0")]
    objs = [md_object("big", "team-a", priority=5), md_object("small", "team-b", maxGpus=2)]
    for o in objs:
        o["metadata"]["generation"] = 1
    fa = FleetAssignments()

    def policy(_: str) -> PlacementPolicySpec:
        return FAST_POLICY

    now = T0 + timedelta(seconds=5)
    big, why_big, changed = fa.of(("team-a", "big"), objs, nodes, policy, now, 90.0)
    small, why_small, again = fa.of(("team-b", "small"), objs, nodes, policy, now, 90.0)
    assert changed and not again  # one solve serves both
    assert big and small and not set(big) & set(small), (big, small, why_big, why_small)
    assert len(small) == 1  # maxGpus 2: one 2-GPU node


def test_a_deployment_left_without_gpunodes_withdraws_its_plans() -> None:
    obs = observed(deployment(), assigned_nodes=("h100-0",))
    (solve,) = [a for a in reconcile(obs, SETTINGS) if isinstance(a, SolveAction)]
    (apply,) = [
        a
        for a in reconcile(dataclasses.replace(obs, solve=run_solve(solve)), SETTINGS)
        if isinstance(a, ApplyPlan)
    ]
    view = plan_view_from(apply.body)
    why = "held by high (priority 10): 2 GPUs missing"
    preempted = observed(deployment(), plans=(view,), assigned_nodes=(), unschedulable=why)
    actions = reconcile(preempted, SETTINGS)
    assert [a.name for a in actions if isinstance(a, DeletePlan)] == [view.name]
    assert not [a for a in actions if isinstance(a, SolveAction | ApplyPlan)]
    (status,) = [a for a in actions if isinstance(a, ApplyStatus)]
    assert status.status.get("currentPlan") is None and not status.status.get("nodes")
    solved = next(c for c in status.status["conditions"] if c["type"] == "Solved")
    assert solved["reason"] == "Unschedulable"
    assert why in solved["message"]
    # still placed: the plan stays
    kept = reconcile(observed(deployment(), plans=(view,), assigned_nodes=("h100-0",)), SETTINGS)
    assert not [a for a in kept if isinstance(a, DeletePlan)]


def test_a_node_moves_only_after_its_old_holder_drained_it() -> None:
    a, b = ("ns", "a"), ("ns", "b")
    assigned = {a: ("n1", "n2"), b: ("n3",)}
    # b still has n2 in its current plan: a keeps what it holds, and says why
    mine, why = drained(a, assigned, {a: ("n1",), b: ("n2", "n3")})
    assert mine == ("n1",) and why == "waiting for GPUNodes to drain (n2 by ns/b)"
    # a new deployment holding nothing waits for all of it
    assert drained(a, assigned, {b: ("n2", "n3")})[0] == ()
    # b's new plan is committed without n2: a grows
    assert drained(a, assigned, {a: ("n1",), b: ("n3",)}) == (("n1", "n2"), "")
    # a Pending holder (not assigned) does not block: its plans are withdrawn at once
    assert drained(a, {a: ("n1", "n2")}, {b: ("n2",)}) == (("n1", "n2"), "")


def test_namespace_quotas_are_the_deployments_own_namespace() -> None:
    nodes = [node_view("h100-0"), node_view("h100-1"), node_view("a100-0")]
    objs = [
        md_object("big", "team-a", priority=5),
        md_object("small", "team-b", priority=1, maxGpus=2),
    ]
    for o in objs:
        o["metadata"]["generation"] = 1

    def policy(_: str) -> PlacementPolicySpec:
        return FAST_POLICY

    def of(
        fa: FleetAssignments, key: tuple[str, str], objs: list[dict[str, Any]]
    ) -> tuple[tuple[str, ...], str]:
        assigned, why, _ = fa.of(key, objs, nodes, policy, T0 + timedelta(seconds=5), 90.0)
        assert assigned is not None
        return assigned, why

    free = FleetAssignments()
    big, _ = of(free, ("team-a", "big"), objs)
    assert len(big) == 2  # no quota: two 2-GPU nodes
    fa = FleetAssignments({"team-a": 2, "team-b": 0})
    big, _ = of(fa, ("team-a", "big"), objs)
    assert len(big) == 1  # team-a may hold 2 GPUs: one node, one left idle
    assert of(fa, ("team-b", "small"), objs) == (
        (),
        "namespace team-b quota is 0 GPUs, 0 in use; the smallest instance needs 2. "
        "To fix: raise the quota or free GPUs in the namespace",
    )
    # the same name in a namespace without a quota is placed
    three = [*objs, md_object("small", "team-c", priority=1, maxGpus=2)]
    three[-1]["metadata"]["generation"] = 1
    c, _ = of(fa, ("team-c", "small"), three)
    assert len(c) == 1 and not set(c) & set(big)


def test_namespace_quota_flags() -> None:
    from operators.cli import namespace_quotas

    assert namespace_quotas(["team-a=16", "team-b=0"]) == {"team-a": 16, "team-b": 0}
    with pytest.raises(InputError, match=r"--namespace-quota team-a=16"):
        namespace_quotas(["team-a"])


def test_the_chart_passes_namespace_quotas_to_the_operator() -> None:
    from test_chart import parsed_commands, render

    from operators.cli import settings_from

    docs = render({"operator": {"namespaceQuotasGpus": {"team-a": 16, "team-b": 0}}})
    op = parsed_commands(docs)["Deployment/mixfleet-controller/operator"]
    assert settings_from(op).namespace_quotas_gpus == {"team-a": 16, "team-b": 0}
    op = parsed_commands(render({}))["Deployment/mixfleet-controller/operator"]
    assert settings_from(op).namespace_quotas_gpus == {}
