"""The operator end to end: informers, work queue, solves, server-side apply, finalizers
and leader election against an API server (the fake one; with MIXFLEET_E2E_KUBECONFIG also
a real cluster).

The fleet is two or three small simulated GPUNodes (two GPUs each) and the model
mixtral-8x7b, so every solve takes well under a second.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from k8s_builders import inventory, md_object, policy_object
from k8s_cluster import RUN_LABEL, Cluster, wait_for
from support.fakeapi import Fault

from apis.kube.client import (
    CONFIGMAPS,
    GPUNODES,
    MODEL_DEPLOYMENTS,
    PARTITION_PLANS,
    PLACEMENT_POLICIES,
    Json,
    Kube,
)
from apis.kube.leader import LeaderSettings
from apis.kube.names import FINALIZER
from apis.kube.plancodec import decode_plan
from apis.kube.schema import from_wire
from apis.kube.v1alpha1 import PartitionPlanSpec
from operators.observe import ReconcileSettings
from operators.operator import Operator, OperatorSettings

pytestmark = pytest.mark.slow


def settings(cluster: Cluster, *, identity: str = "", leader: bool = False) -> OperatorSettings:
    return OperatorSettings(
        namespaces=(cluster.namespace,),
        default_policy=cluster.name("default"),
        workers=2,
        resync_period_s=30.0,
        watch_timeout_s=5,
        retry_base_delay_s=0.05,
        retry_max_delay_s=1.0,
        reconcile=ReconcileSettings(node_stale_after_s=600.0, plan_history=3),
        leader=(
            LeaderSettings(
                lease_name=cluster.name("operator"),
                namespace=cluster.namespace,
                identity=identity,
                lease_duration_s=6.0,
                renew_deadline_s=4.0,
                retry_period_s=0.3,
            )
            if leader
            else None
        ),
    )


def start_operator(cluster: Cluster, *, identity: str = "op-0", leader: bool = False) -> Operator:
    kube = cluster.kube("mixfleet-operator", user_agent=f"mixfleet-operator/{identity}")
    op = Operator(kube, settings(cluster, identity=identity, leader=leader))
    op.start(wait_synced_s=10)
    return op


@pytest.fixture
def world(cluster: Cluster) -> Iterator[Kube]:
    """Two GPUNodes (h100-0, a100-0) and a fast default policy; yields the test's client."""
    k = cluster.kube("mixfleet-test")
    k.create(
        PLACEMENT_POLICIES,
        policy_object(cluster.name("default"), policy="ilp", solverTimeLimitS=5, workers=1),
    )
    for n in ("h100-0", "a100-0"):
        cluster.put_gpunode(k, n, inventory(n), labels={"rack": "r1"})
    yield k


def deploy(cluster: Cluster, k: Kube, name: str = "mx", **spec: object) -> Json:
    spec.setdefault("nodeSelector", {RUN_LABEL: cluster.run})
    return k.create(MODEL_DEPLOYMENTS, md_object(name, cluster.namespace, **spec))


def condition(k: Kube, cluster: Cluster, name: str, type_: str) -> Json:
    obj = k.get(MODEL_DEPLOYMENTS, name, cluster.namespace) or {}
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


def status(k: Kube, cluster: Cluster, name: str = "mx") -> Json:
    return dict((k.get(MODEL_DEPLOYMENTS, name, cluster.namespace) or {}).get("status") or {})


def plans(k: Kube, cluster: Cluster, name: str = "mx") -> list[Json]:
    items, _ = k.list(
        PARTITION_PLANS, cluster.namespace, label_selector=f"mixfleet.io/deployment={name}"
    )
    return sorted(items, key=lambda p: p["spec"]["version"])


def ack(cluster: Cluster, plan: str, node: str, state: str) -> None:
    """What the controller writes when an agent acks: its own entry of status.nodes."""
    agent = cluster.kube(f"mixfleet-agent-{node}")
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "metadata": {"name": plan, "namespace": cluster.namespace},
        "status": {"nodes": [{"node": node, "state": state, "lastTransitionTime": now}]},
    }
    agent.apply(PARTITION_PLANS, body, subresource="status")


def test_deployment_from_apply_to_rolled_out(cluster: Cluster, world: Kube) -> None:
    k = world
    op = start_operator(cluster)
    try:
        deploy(cluster, k)
        solved = wait_for(
            lambda: condition(k, cluster, "mx", "Solved").get("status") == "True",
            what="Solved=True",
        )
        assert solved
        md = k.get(MODEL_DEPLOYMENTS, "mx", cluster.namespace)
        assert md is not None and FINALIZER in md["metadata"]["finalizers"]
        st = status(k, cluster)
        assert st["observedGeneration"] == 1 and st["gpus"] == 4
        assert st["currentPlan"]["name"] == "mx-v1"
        (plan,) = plans(k, cluster)
        (owner,) = plan["metadata"]["ownerReferences"]
        assert owner["uid"] == md["metadata"]["uid"] and owner["controller"] is True
        decoded = decode_plan(from_wire(PartitionPlanSpec, plan["spec"], "spec"))
        assert len(decoded.gpus) == 4 and decoded.model == "mixtral-8x7b"
        assert sorted(plan["spec"]["nodes"]) == sorted(
            [cluster.name("a100-0"), cluster.name("h100-0")]
        )
        cm = k.get(CONFIGMAPS, "mx-placement", cluster.namespace)
        assert cm is not None
        table = json.loads(cm["data"]["eplb-state.json"])["physical_to_logical_map"]
        assert len(table) == 32 and {len(r) for r in table} == {8}
        assert condition(k, cluster, "mx", "RolledOut")["reason"] == "RolloutPending"

        # Agents ack through the controller: two field managers, one map-list entry each.
        for node in plan["spec"]["nodes"]:
            ack(cluster, "mx-v1", node, "Prepared")
        for node in plan["spec"]["nodes"]:
            ack(cluster, "mx-v1", node, "Committed")
        wait_for(
            lambda: condition(k, cluster, "mx", "RolledOut").get("status") == "True",
            what="RolledOut=True",
        )
        got = k.get(PARTITION_PLANS, "mx-v1", cluster.namespace)
        assert got is not None and {n["state"] for n in got["status"]["nodes"]} == {"Committed"}
        assert condition(k, cluster, "mx", "Degraded")["status"] == "False"
    finally:
        op.stop()


def test_spec_change_replans_and_generation_is_observed(cluster: Cluster, world: Kube) -> None:
    k = world
    op = start_operator(cluster)
    try:
        deploy(cluster, k)
        wait_for(lambda: status(k, cluster).get("currentPlan"), what="first plan")
        out = k.merge_patch(
            MODEL_DEPLOYMENTS, "mx", {"spec": {"workload": {"tokensPerGpu": 48}}}, cluster.namespace
        )
        assert out["metadata"]["generation"] == 2
        wait_for(
            lambda: (status(k, cluster).get("currentPlan") or {}).get("version") == 2,
            what="plan v2",
        )
        wait_for(
            lambda: status(k, cluster).get("observedGeneration") == 2, what="observedGeneration 2"
        )
        vs = plans(k, cluster)
        assert [p["spec"]["version"] for p in vs] == [1, 2]
        assert vs[1]["spec"]["reason"] == "spec changed (generation 2)"
        assert vs[1]["spec"]["deploymentGeneration"] == 2
        md = k.get(MODEL_DEPLOYMENTS, "mx", cluster.namespace)
        assert md is not None and md["metadata"]["generation"] == 2  # status writes did not bump it
        cm = k.get(CONFIGMAPS, "mx-placement", cluster.namespace)
        assert cm is not None and cm["metadata"]["annotations"]["mixfleet.io/plan"] == "mx-v2"
    finally:
        op.stop()


def test_cordoned_node_is_planned_around(cluster: Cluster, world: Kube) -> None:
    k = world
    op = start_operator(cluster)
    try:
        deploy(cluster, k)
        wait_for(lambda: status(k, cluster).get("currentPlan"), what="first plan")
        a100 = cluster.name("a100-0")
        k.merge_patch(GPUNODES, a100, {"spec": {"cordon": True}})
        wait_for(
            lambda: (status(k, cluster).get("currentPlan") or {}).get("version") == 2,
            what="re-plan",
        )
        latest = plans(k, cluster)[-1]
        assert latest["spec"]["nodes"] == [cluster.name("h100-0")]
        assert latest["spec"]["reason"] == f"fleet changed: -{a100} (cordoned)"
        assert status(k, cluster)["gpus"] == 2
    finally:
        op.stop()


def test_spec_errors_are_conditions_not_crash_loops(cluster: Cluster, world: Kube) -> None:
    k = world
    op = start_operator(cluster)
    try:
        deploy(cluster, k, "unknown", model="no-such-model")
        deploy(cluster, k, "huge", model="deepseek-v3")
        wait_for(
            lambda: condition(k, cluster, "unknown", "Solved").get("reason") == "UnknownModel",
            what="UnknownModel",
        )
        wait_for(
            lambda: condition(k, cluster, "huge", "Solved").get("reason") == "Infeasible",
            what="Infeasible",
        )
        assert "To fix" in condition(k, cluster, "huge", "Solved")["message"]
        assert op.solves == 1  # deepseek-v3 solved once; the unknown model never
        writes = sum(op.kube.writes.values())
        # Heartbeats, a resync and a label change later: nothing is solved or written again.
        for n in ("h100-0", "a100-0"):
            cluster.heartbeat(k, cluster.name(n), inventory(n))
        k.merge_patch(
            MODEL_DEPLOYMENTS, "huge", {"metadata": {"labels": {"seen": "yes"}}}, cluster.namespace
        )
        op.enqueue_all()
        time.sleep(1.5)
        assert op.solves == 1
        assert sum(op.kube.writes.values()) == writes
        assert not plans(k, cluster, "huge") and not plans(k, cluster, "unknown")
    finally:
        op.stop()


def test_delete_cleans_up_through_the_finalizer(cluster: Cluster, world: Kube) -> None:
    k = world
    op = start_operator(cluster)
    try:
        deploy(cluster, k)
        wait_for(lambda: k.get(CONFIGMAPS, "mx-placement", cluster.namespace), what="configmap")
        k.delete(MODEL_DEPLOYMENTS, "mx", cluster.namespace)
        wait_for(
            lambda: k.get(MODEL_DEPLOYMENTS, "mx", cluster.namespace) is None,
            what="deployment gone",
        )
        assert k.get(CONFIGMAPS, "mx-placement", cluster.namespace) is None
        assert plans(k, cluster) == []
        assert (
            op.kube.writes["delete configmaps"] == 1
            and op.kube.writes["delete partitionplans"] == 1
        )
    finally:
        op.stop()


def test_conflicts_and_server_errors_are_retried(cluster: Cluster, world: Kube) -> None:
    fake = cluster.fake
    if fake is None:
        pytest.skip("injects faults into the fake API server")
    k = world
    ns = cluster.namespace
    fake.inject(
        Fault("PATCH", rf"/namespaces/{ns}/modeldeployments/mx$", 409, "Conflict", remaining=2)
    )
    fake.inject(
        Fault("POST", rf"/namespaces/{ns}/partitionplans$", 503, "ServiceUnavailable", remaining=2)
    )
    op = start_operator(cluster)
    try:
        deploy(cluster, k)
        wait_for(
            lambda: condition(k, cluster, "mx", "Solved").get("status") == "True",
            what="Solved after retries",
        )
        md = k.get(MODEL_DEPLOYMENTS, "mx", ns)
        assert md is not None and FINALIZER in md["metadata"]["finalizers"]
        codes = [
            (r.method, r.status)
            for r in fake.requests
            if r.path.endswith(("/modeldeployments/mx", "/partitionplans"))
        ]
        assert codes.count(("PATCH", 409)) == 2 and ("PATCH", 200) in codes
        assert codes.count(("POST", 503)) == 2 and ("POST", 201) in codes
        assert len(plans(k, cluster)) == 1  # retries did not make extra versions
    finally:
        op.stop()


def test_expired_watches_relist_and_keep_reacting(cluster: Cluster, world: Kube) -> None:
    fake = cluster.fake
    if fake is None:
        pytest.skip("compacts the fake API server's watch history")
    k = world
    op = start_operator(cluster)
    try:
        deploy(cluster, k)
        wait_for(lambda: status(k, cluster).get("currentPlan"), what="first plan")
        lists = sum(inf.lists for inf in op.informers)
        fake.compact()
        # Watches restart from their last version (now compacted) within watch_timeout_s.
        wait_for(
            lambda: sum(inf.lists for inf in op.informers) > lists, timeout_s=60, what="re-list"
        )
        k.merge_patch(
            MODEL_DEPLOYMENTS, "mx", {"spec": {"workload": {"tokensPerGpu": 24}}}, cluster.namespace
        )
        wait_for(
            lambda: (status(k, cluster).get("currentPlan") or {}).get("version") == 2,
            what="plan v2",
        )
    finally:
        op.stop()


def test_two_replicas_only_the_leader_writes_and_the_standby_takes_over(
    cluster: Cluster, world: Kube
) -> None:
    k = world
    a = start_operator(cluster, identity="op-a", leader=True)
    b = start_operator(cluster, identity="op-b", leader=True)
    try:
        wait_for(lambda: a.is_leader() or b.is_leader(), what="a leader")
        leader, standby = (a, b) if a.is_leader() else (b, a)
        assert not standby.is_leader()
        deploy(cluster, k)
        wait_for(lambda: status(k, cluster).get("currentPlan"), what="first plan")
        assert sum(leader.kube.writes.values()) > 0
        assert sum(standby.kube.writes.values()) == 0
        if cluster.fake is not None:
            standby_ua = f"mixfleet-operator/{standby.settings.leader.identity}"  # type: ignore[union-attr]
            assert cluster.fake.writes(user_agent=standby_ua) == []

        leader.stop()  # releases the lease
        wait_for(standby.is_leader, timeout_s=60, what="standby takes over")
        k.merge_patch(
            MODEL_DEPLOYMENTS, "mx", {"spec": {"workload": {"tokensPerGpu": 40}}}, cluster.namespace
        )
        wait_for(
            lambda: (status(k, cluster).get("currentPlan") or {}).get("version") == 2,
            what="plan v2 by the new leader",
        )
        assert standby.kube.writes["create partitionplans"] == 1
    finally:
        a.stop()
        b.stop()
