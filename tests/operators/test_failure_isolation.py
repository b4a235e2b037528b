"""One bad object stops nothing else: a GPUNode, a PlacementPolicy or a PartitionPlan that no
longer parses (stored under an older CRD, say: the fake API server stores it without
admission) is reported with the reason in the status of the deployments it touches, and
every other deployment is planned, and rolled out, as before."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from k8s_builders import inventory, md_object, policy_object
from k8s_cluster import RUN_LABEL, Cluster, wait_for
from support.fakeapi import FakeApiServer
from test_operator_e2e import condition, start_operator

from apis.kube.client import MODEL_DEPLOYMENTS, PLACEMENT_POLICIES, Kube
from apis.kube.v1alpha1 import API_VERSION
from controlplane.errors import StoreError
from controlplane.store.base import StoredNode
from controlplane.store.kubernetes import KubernetesStore

pytestmark = pytest.mark.slow
NOW = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
def bad_world(cluster: Cluster, fake_only: FakeApiServer) -> Iterator[Kube]:
    """Two good GPUNodes and a good default policy, next to a GPUNode whose status does not
    parse (the only one labelled pool=broken), a PlacementPolicy whose spec does not parse
    and a PartitionPlan ``good-v7`` of deployment ``good`` whose spec does not parse."""
    k = cluster.kube("mixfleet-test")
    k.create(PLACEMENT_POLICIES, policy_object("default", policy="greedy", solverTimeLimitS=5))
    for n in ("h100-0", "a100-0"):
        cluster.put_gpunode(k, n, inventory(n), labels={"pool": "good"})
    fake_only.put_raw(
        "gpunodes",
        {
            "apiVersion": API_VERSION,
            "kind": "GPUNode",
            "metadata": {"name": "broken-0", "labels": {RUN_LABEL: cluster.run, "pool": "broken"}},
            "spec": {},
            "status": {
                "inventory": {"node": "broken-0", "gpus": "eight"},
                "lastHeartbeatTime": NOW,
            },
        },
    )
    fake_only.put_raw(
        "placementpolicies",
        {
            "apiVersion": API_VERSION,
            "kind": "PlacementPolicy",
            "metadata": {"name": "broken-policy"},
            "spec": {"solverTimeLimitS": "fast"},
        },
    )
    k.create(MODEL_DEPLOYMENTS, md_object("good", cluster.namespace, nodeSelector={"pool": "good"}))
    fake_only.put_raw(
        "partitionplans",
        {
            "apiVersion": API_VERSION,
            "kind": "PartitionPlan",
            "metadata": {
                "name": "good-v7",
                "namespace": cluster.namespace,
                "labels": {
                    "mixfleet.io/deployment": "good",
                    "app.kubernetes.io/managed-by": "mixfleet-operator",
                },
            },
            "spec": {"deployment": "good", "version": 7},
        },
    )
    yield k


def test_bad_objects_are_reported_and_the_rest_is_planned(
    cluster: Cluster, bad_world: Kube
) -> None:
    k = bad_world
    ns = cluster.namespace
    k.create(MODEL_DEPLOYMENTS, md_object("bad-policy", ns, policyRef={"name": "broken-policy"}))
    k.create(MODEL_DEPLOYMENTS, md_object("only-broken", ns, nodeSelector={"pool": "broken"}))
    op = start_operator(cluster)
    try:
        solved = wait_for(
            lambda: (
                condition(k, cluster, "good", "Solved").get("status") == "True"
                and condition(k, cluster, "good", "Solved")
            ),
            what="good solved",
        )
        assert "plan v8" in solved["message"]  # above the unreadable good-v7
        degraded = wait_for(
            lambda: (
                condition(k, cluster, "good", "Degraded").get("reason") == "UnreadablePlan"
                and condition(k, cluster, "good", "Degraded")
            ),
            what="good reports good-v7",
        )
        assert "good-v7" in degraded["message"] and "To fix: delete" in degraded["message"]
        bad = wait_for(
            lambda: (
                condition(k, cluster, "bad-policy", "Solved").get("reason") == "InvalidPolicy"
                and condition(k, cluster, "bad-policy", "Solved")
            ),
            what="InvalidPolicy",
        )
        assert "broken-policy" in bad["message"] and "solverTimeLimitS" in bad["message"]
        lonely = wait_for(
            lambda: (
                condition(k, cluster, "only-broken", "Solved").get("reason") == "NoEligibleNodes"
                and condition(k, cluster, "only-broken", "Solved")
            ),
            what="only-broken: no eligible node",
        )
        assert "broken-0: its status does not parse" in lonely["message"]
        assert op.healthy()
    finally:
        op.stop()
    # The controller's store: the plan that parses is listed, the other is named.
    store = KubernetesStore(cluster.kube("mixfleet-controller"), ns)
    assert [p.version for p in store.list_plans("good")] == [8]
    with pytest.raises(StoreError, match="PartitionPlan good-v7 does not parse"):
        store.get_plan("good", 7)
    assert [d.name for d in store.list_deployments()] == ["bad-policy", "good", "only-broken"]
    # An agent registers: its node is listed; broken-0 (no readable status) is not.
    store.upsert_node(StoredNode("l40s-0", inventory("l40s-0"), "s", 1.0, 2.0))
    assert [n.name for n in store.list_nodes()] == ["l40s-0"]
