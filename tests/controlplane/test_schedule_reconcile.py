"""The pure decision with the fleet scheduler's assignment: a deployment solves only on its
own nodes, and one without nodes reports the scheduler's Pending reason."""

from __future__ import annotations

from controlplane.server.reconcile import (
    DeploymentObs,
    NodeObs,
    Observed,
    ReconcileSettings,
    SetStatus,
    Solve,
    inputs_key,
    reconcile,
)
from policies.spec.build import DeploymentSpec

NOW = 1000.0
S = ReconcileSettings()


def _node(name: str) -> NodeObs:
    return NodeObs(name, {}, NOW, healthy_gpus=(f"{name}/gpu0", f"{name}/gpu1"))


NODES = (_node("a"), _node("b"), _node("c"))
A = DeploymentObs(DeploymentSpec(name="x", model="mixtral-8x7b"), 1)
B = DeploymentObs(DeploymentSpec(name="y", model="mixtral-8x7b"), 1)


def test_each_deployment_solves_on_its_assigned_nodes_only() -> None:
    assigned = {"x": ("a", "c"), "y": ("b",)}
    actions = reconcile(Observed(NOW, NODES, (A, B), assigned), S)
    solves = {a.deployment: a for a in actions if isinstance(a, Solve)}
    assert solves["x"].nodes == ("a", "c")
    assert solves["x"].inputs_key == inputs_key(1, ("a/gpu0", "a/gpu1", "c/gpu0", "c/gpu1"))
    assert solves["y"].nodes == ("b",)


def test_without_nodes_the_schedulers_reason_is_the_pending_message() -> None:
    why = "its closest runnable instance needs 2 GPUs; held by x (priority 10)"
    actions = reconcile(Observed(NOW, NODES, (A, B), {"x": ("a", "b", "c")}, {"y": why}), S)
    (status,) = [a for a in actions if isinstance(a, SetStatus) and a.deployment == "y"]
    assert status.phase == "pending" and status.message == why
    assert not [a for a in actions if isinstance(a, Solve) and a.deployment == "y"]


def test_no_assignment_means_every_usable_node() -> None:
    actions = reconcile(Observed(NOW, NODES, (A,)), S)
    (solve,) = [a for a in actions if isinstance(a, Solve)]
    assert solve.nodes == ("a", "b", "c")
