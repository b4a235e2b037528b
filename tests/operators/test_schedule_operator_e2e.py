"""The fleet scheduler in Kubernetes mode end to end, against the API server (the fake one;
with MIXFLEET_E2E_KUBECONFIG also a real cluster): a higher-priority ModelDeployment
preempts the lowest, whose PartitionPlans are withdrawn; a namespace quota (the operator's
``namespace_quotas_gpus``) leaves a deployment Unschedulable with the quota as the reason.

Two GPUNodes of two GPUs each (``world``); every deployment takes one node.
"""

from __future__ import annotations

import dataclasses

import pytest
from k8s_cluster import Cluster, wait_for
from test_operator_e2e import condition, deploy, plans, settings, status, world

from apis.kube.client import Kube
from operators.operator import Operator

pytestmark = pytest.mark.slow
__all__ = ["world"]  # the fixture

ONE_NODE = {"minGpus": 2, "maxGpus": 2}


def start(cluster: Cluster, **changes: object) -> Operator:
    kube = cluster.kube("mixfleet-operator", user_agent="mixfleet-operator/op-0")
    op = Operator(kube, dataclasses.replace(settings(cluster), **changes))  # type: ignore[arg-type]
    op.start(wait_synced_s=10)
    return op


def solved(k: Kube, cluster: Cluster, name: str) -> bool:
    return condition(k, cluster, name, "Solved").get("status") == "True"


def test_higher_priority_preempts_the_lowest_and_its_plans_are_withdrawn(
    cluster: Cluster, world: Kube
) -> None:
    k = world
    op = start(cluster)
    try:
        deploy(cluster, k, "low", priority=1, **ONE_NODE)
        deploy(cluster, k, "mid", priority=5, **ONE_NODE)
        wait_for(lambda: solved(k, cluster, "low") and solved(k, cluster, "mid"), what="both")
        low_nodes = status(k, cluster, "low")["nodes"]
        mid_nodes = status(k, cluster, "mid")["nodes"]
        assert len(low_nodes) == 1 and not set(low_nodes) & set(mid_nodes)
        assert status(k, cluster, "low")["assignedGpus"] == 2
        assert plans(k, cluster, "low")

        deploy(cluster, k, "high", priority=10, **ONE_NODE)
        wait_for(lambda: solved(k, cluster, "high"), what="high solved")
        why = wait_for(
            lambda: (
                condition(k, cluster, "low", "Solved").get("reason") == "Unschedulable"
                and condition(k, cluster, "low", "Solved")["message"]
            ),
            what="low Unschedulable",
        )
        assert f"held by {cluster.namespace}/" in why, why
        wait_for(lambda: not plans(k, cluster, "low"), what="low's PartitionPlans withdrawn")
        wait_for(lambda: not status(k, cluster, "low").get("nodes"), what="low's status cleared")
        st = status(k, cluster, "low")
        assert st.get("assignedGpus") == 0 and not st.get("currentPlan")
        # Not "serving the plan": no plan serves it, and the condition says why.
        degraded = wait_for(
            lambda: (
                (got := condition(k, cluster, "low", "Degraded")).get("reason") == "NotServing"
                and got
            ),
            what="low Degraded NotServing",
        )
        assert degraded["status"] == "True"
        assert degraded["message"].startswith("no plan serves it: Unschedulable: "), degraded
        # high takes the node low held; mid is not moved
        assert status(k, cluster, "high")["nodes"] == low_nodes
        assert status(k, cluster, "mid")["nodes"] == mid_nodes
    finally:
        op.stop()


def test_a_namespace_quota_leaves_a_deployment_unschedulable(cluster: Cluster, world: Kube) -> None:
    k = world
    op = start(cluster, namespace_quotas_gpus={cluster.namespace: 2})
    try:
        deploy(cluster, k, "first", priority=5, **ONE_NODE)
        deploy(cluster, k, "second", priority=1, **ONE_NODE)
        wait_for(lambda: solved(k, cluster, "first"), what="first solved")
        c = wait_for(
            lambda: (
                (got := condition(k, cluster, "second", "Solved")).get("reason") == "Unschedulable"
                and got
            ),
            what="second Unschedulable",
        )
        assert f"namespace {cluster.namespace} quota is 2 GPUs, 2 in use" in c["message"]
        assert status(k, cluster, "first")["assignedGpus"] == 2
        assert not plans(k, cluster, "second")
    finally:
        op.stop()


def test_newcomers_of_equal_priority_do_not_preempt_a_running_deployment(
    cluster: Cluster, world: Kube
) -> None:
    """Only a strictly higher priority preempts: ``run`` (Mixtral, priority 0) keeps its
    node when two priority-0 newcomers that the objective values more (Qwen3-30B-A3B, more
    tokens/s per node) arrive for the two nodes; one of them gets the free node, the other
    stays Unschedulable (and says it serves nothing)."""
    k = world
    op = start(cluster)
    try:
        deploy(cluster, k, "run", **ONE_NODE)
        wait_for(lambda: solved(k, cluster, "run"), what="run solved")
        run_nodes = status(k, cluster, "run")["nodes"]
        run_plans = [p["metadata"]["name"] for p in plans(k, cluster, "run")]
        for name in ("a-new", "b-new"):
            deploy(cluster, k, name, model="qwen3-30b-a3b", **ONE_NODE)

        def settled() -> tuple[str, str] | None:
            reasons = {
                n: condition(k, cluster, n, "Solved").get("reason") for n in ("a-new", "b-new")
            }
            done = sorted(reasons, key=lambda n: reasons[n] != "Solved")
            if [reasons[n] for n in done] == ["Solved", "Unschedulable"]:
                return done[0], done[1]
            return None

        placed, waiting = wait_for(settled, what="one newcomer placed, the other waiting")
        assert solved(k, cluster, "run")
        assert status(k, cluster, "run")["nodes"] == run_nodes
        assert [p["metadata"]["name"] for p in plans(k, cluster, "run")] == run_plans
        assert not set(status(k, cluster, placed)["nodes"]) & set(run_nodes)
        why = condition(k, cluster, waiting, "Solved")["message"]
        assert f"held by {cluster.namespace}/" in why, why
        degraded = condition(k, cluster, waiting, "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "NotServing"), degraded
        assert not plans(k, cluster, waiting)
    finally:
        op.stop()
