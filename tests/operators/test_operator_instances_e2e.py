"""A ModelDeployment planned from its traffic and SLOs runs as engine instances, end to end
against the API server (the fake one; with MIXFLEET_E2E_KUBECONFIG also a real cluster, whose
kube-controller-manager runs the garbage collector): the operator plans it with the fleet
planner and creates one ModelDeployment per instance (owned by the deployment, labelled
``mixfleet.io/instance-of``), each with one PartitionPlan on its planned GPUNodes and one
ConfigMap that launches it as its role; the deployment's status lists the instances and is
Ready once every instance's plan is committed; a user's edit of an instance is put back;
deleting the deployment removes its instances and what they own.

Three GPUNodes of two H100s each; Qwen3-30B-A3B with prefill/decode disaggregation on, which
the planner serves as one prefill and one decode instance of one node each.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from functools import partial

import pytest
from k8s_builders import md_object
from k8s_cluster import RUN_LABEL, Cluster, wait_for
from support.planner_settings import COARSE
from test_operator_e2e import ack, condition, plans, settings, status

from apis.kube.client import CONFIGMAPS, MODEL_DEPLOYMENTS, Json, Kube
from apis.kube.names import LABEL_INSTANCE_OF
from operators.operator import Operator

pytestmark = pytest.mark.slow

#: A coarse curve grid: the plan takes well under a second.
PLANNER = COARSE

CHAT = {
    "model": "qwen3-30b-a3b",
    "engine": {"name": "sglang"},
    "engineFormat": "sglang",
    "workload": {"phase": "decode", "contextLen": 2048, "kvCacheDtype": "fp8"},
    "traffic": {
        "requestsPerS": 20,
        "inputTokens": {"mean": 1024, "p90": 1280},
        "outputTokens": {"mean": 256, "p90": 320},
    },
    "slo": {"ttftMs": 2000, "tpotMs": 50, "percentile": 90},
    "disaggregation": "on",
}


class Clock:
    """The operator's clock: the wall clock, UTC, plus what the test moves it on by."""

    def __init__(self) -> None:
        self.ahead = timedelta(0)

    def __call__(self) -> datetime:
        return datetime.now(UTC) + self.ahead


def start(cluster: Cluster, clock: Clock | None = None) -> Operator:
    kube = cluster.kube("mixfleet-operator", user_agent="mixfleet-operator/op-0")
    op = Operator(
        kube,
        dataclasses.replace(settings(cluster), fleet_planner=PLANNER),
        clock=clock or Clock(),
    )
    op.start(wait_synced_s=10)
    return op


def instances(k: Kube, cluster: Cluster, parent: str) -> list[Json]:
    items, _ = k.list(
        MODEL_DEPLOYMENTS, cluster.namespace, label_selector=f"{LABEL_INSTANCE_OF}={parent}"
    )
    return sorted(items, key=lambda o: o["metadata"]["name"])


def plan_count(k: Kube, cluster: Cluster, name: str, count: int) -> bool:
    return len(plans(k, cluster, name)) == count


def record(k: Kube, cluster: Cluster, name: str) -> Json | None:
    rec: Json | None = status(k, cluster, name).get("instance")
    return rec


def no_config_map(k: Kube, cluster: Cluster, name: str) -> bool:
    return k.get(CONFIGMAPS, f"{name}-placement", cluster.namespace) is None


def launch_doc(k: Kube, cluster: Cluster, name: str) -> Json | None:
    cm = k.get(CONFIGMAPS, f"{name}-placement", cluster.namespace)
    if cm is None or "launch.json" not in (cm.get("data") or {}):
        return None
    doc: Json = json.loads(cm["data"]["launch.json"])
    return doc


def check_owned(kids: list[Json], uid: str) -> None:
    """The instances of ``chat`` (uid ``uid``): owned by it, specs without its demand."""
    names = [o["metadata"]["name"] for o in kids]
    assert names == ["chat-decode-0", "chat-prefill-0"], names
    for o in kids:
        (ref,) = o["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "ModelDeployment",
            "chat",
            uid,
            True,
        )
        assert "traffic" not in o["spec"] and "slo" not in o["spec"]
        assert o["spec"]["engineFormat"] == "sglang"


def check_plan_and_launch(k: Kube, cluster: Cluster, name: str, role: str) -> None:
    """One PartitionPlan and one ConfigMap for instance ``name``, launched as ``role``, and
    its record in its status."""
    wait_for(partial(plan_count, k, cluster, name, 1), what=f"{name}'s plan")
    doc = wait_for(partial(launch_doc, k, cluster, name), what=f"{name}'s ConfigMap")
    assert doc["role"] == role
    argv = doc["nodes"][0]["argv"]
    i = argv.index("--disaggregation-mode")
    assert argv[i + 1] == role, argv
    rec = wait_for(partial(record, k, cluster, name), what=f"{name}'s record")
    assert (rec["of"], rec["role"]) == ("chat", role)
    assert rec["nodes"] == status(k, cluster, name)["nodes"]


def test_a_planned_deployment_runs_as_owned_instances_with_their_own_plans_and_launches(
    cluster: Cluster, fleet3: Kube
) -> None:
    k = fleet3
    op = start(cluster)
    try:
        spec = {**CHAT, "nodeSelector": {RUN_LABEL: cluster.run}}
        parent = k.create(MODEL_DEPLOYMENTS, md_object("chat", cluster.namespace, **spec))
        uid = parent["metadata"]["uid"]
        wait_for(lambda: len(instances(k, cluster, "chat")) == 2, what="two instances")
        check_owned(instances(k, cluster, "chat"), uid)
        roles = {"chat-prefill-0": "prefill", "chat-decode-0": "decode"}
        for name, role in roles.items():
            check_plan_and_launch(k, cluster, name, role)
        prefill_nodes = status(k, cluster, "chat-prefill-0")["nodes"]
        decode_nodes = status(k, cluster, "chat-decode-0")["nodes"]
        assert len(prefill_nodes) == len(decode_nodes) == 1
        assert prefill_nodes != decode_nodes  # whole GPUNodes of their own
        assert status(k, cluster, "chat-prefill-0")["instance"]["bootstrapPort"] > 0
        assert not plans(k, cluster, "chat")  # the parent has none of its own

        st = wait_for(
            lambda: (s := status(k, cluster, "chat")).get("instancesReady") == "0/2" and s,
            what="the parent's status",
        )
        assert [i["name"] for i in st["instances"]] == ["chat-prefill-0", "chat-decode-0"]
        assert st["instances"][0]["nodes"] == prefill_nodes
        assert st["plannedRequestsPerSecond"] == pytest.approx(20.0)
        assert st["plannedAttainment"] == pytest.approx(1.0)
        assert st["instances"][0]["tpotMs"] > 0 and st["instances"][1]["ttftMs"] > 0
        assert condition(k, cluster, "chat", "Solved")["status"] == "True"
        assert condition(k, cluster, "chat", "DemandServed")["status"] == "True"
        assert condition(k, cluster, "chat", "Ready")["status"] == "False"

        # Every node commits each instance's plan: the deployment is Ready.
        for name in roles:
            (p,) = plans(k, cluster, name)
            for node in p["spec"]["nodes"]:
                ack(cluster, p["metadata"]["name"], node, "Committed")
        wait_for(
            lambda: condition(k, cluster, "chat", "Ready").get("status") == "True",
            what="Ready",
        )
        assert status(k, cluster, "chat")["instancesReady"] == "2/2"
        assert all(
            i["version"] == 1 and i["ready"] for i in status(k, cluster, "chat")["instances"]
        )

        # A user's edit of an instance is put back: the operator is its one writer.
        k.merge_patch(
            MODEL_DEPLOYMENTS,
            "chat-decode-0",
            {"spec": {"workload": {"contextLen": 999}, "priority": 7}},
            cluster.namespace,
        )

        def put_back() -> bool:
            s = (k.get(MODEL_DEPLOYMENTS, "chat-decode-0", cluster.namespace) or {})["spec"]
            return bool(s["workload"]["contextLen"] != 999 and s.get("priority", 0) == 0)

        wait_for(put_back, what="the edit put back")

        # Deleting the deployment removes its instances and what they own.
        k.delete(MODEL_DEPLOYMENTS, "chat", cluster.namespace)
        wait_for(lambda: not instances(k, cluster, "chat"), what="instances collected")
        for name in roles:
            wait_for(partial(plan_count, k, cluster, name, 0), what=f"{name}'s plans gone")
            wait_for(partial(no_config_map, k, cluster, name), what=f"{name}'s ConfigMap gone")
    finally:
        op.stop()


def commit_all(k: Kube, cluster: Cluster, name: str) -> bool:
    """Every node commits the newest plan of ``name`` (as the agents would); False while it
    has none."""
    mine = plans(k, cluster, name)
    if not mine:
        return False
    p = mine[-1]
    for node in p["spec"]["nodes"]:
        ack(cluster, p["metadata"]["name"], node, "Committed")
    return True


def test_a_replan_surges_the_new_instances_then_drains_the_dropped_one(
    cluster: Cluster, fleet3: Kube
) -> None:
    """Aggregated first; then disaggregation on: the prefill/decode instances come up beside
    the aggregated one, which keeps serving (retiring) until they are ready - or, when one
    of them needs its node, until every other one is - then drains (its record says since
    when) and is deleted once the drain grace (30 s, the default) has passed on the
    operator's clock; one that needs its node then takes it."""
    k = fleet3
    clock = Clock()
    op = start(cluster, clock)
    assert op.settings.drain_grace_s == 30.0
    old = "chat-aggregated-0"
    try:
        spec = {**CHAT, "disaggregation": "off", "nodeSelector": {RUN_LABEL: cluster.run}}
        k.create(MODEL_DEPLOYMENTS, md_object("chat", cluster.namespace, **spec))
        wait_for(partial(commit_all, k, cluster, old), what="aggregated plan")
        wait_for(
            lambda: condition(k, cluster, "chat", "Ready").get("status") == "True",
            what="aggregated Ready",
        )
        old_nodes = status(k, cluster, old)["nodes"]

        k.merge_patch(
            MODEL_DEPLOYMENTS, "chat", {"spec": {"disaggregation": "on"}}, cluster.namespace
        )
        new = ("chat-decode-0", "chat-prefill-0")
        wait_for(
            lambda: [o["metadata"]["name"] for o in instances(k, cluster, "chat")] == [old, *new],
            what="the new instances beside the old one",
        )
        st = wait_for(
            lambda: (s := status(k, cluster, "chat")).get("instancesReady") == "0/2" and s,
            what="the parent lists the new instances",
        )
        (listed,) = [i for i in st["instances"] if i["name"] == old]
        assert (listed["retiring"], listed["draining"]) == (True, False)
        assert condition(k, cluster, "chat", "Ready")["status"] == "False"
        rec = wait_for(
            lambda: (r := record(k, cluster, old)) and r.get("retiring") and r,
            what="the dropped instance retiring",
        )
        assert not rec["draining"] and rec["drainingSinceS"] == 0  # routers still use it
        # The new instances roll out beside it (those not waiting for its node).
        waiting = []
        for name in new:
            if wait_for(partial(plan_or_waiting, k, cluster, name), what=f"{name}") == "plan":
                assert not set(status(k, cluster, name).get("nodes") or ()) & set(old_nodes)
                commit_all(k, cluster, name)
            else:
                waiting.append(name)
        # Replaced (or, with one waiting for its node, drained early): draining from now.
        rec = wait_for(
            lambda: (r := record(k, cluster, old)) and r.get("draining") and r,
            what="the dropped instance draining",
        )
        assert not rec["retiring"]
        assert 0 < rec["drainingSinceS"] <= clock().timestamp()
        assert k.get(MODEL_DEPLOYMENTS, old, cluster.namespace) is not None  # the grace runs
        for name in waiting:
            assert not plans(k, cluster, name)  # its node is still the old one's
        clock.ahead = timedelta(seconds=31)  # the grace has passed
        op.queue.add((cluster.namespace, "chat"))
        wait_for(
            lambda: [o["metadata"]["name"] for o in instances(k, cluster, "chat")] == list(new),
            what="the dropped instance deleted",
        )
        for name in new:  # one that waited for the old node now has it
            wait_for(partial(commit_all, k, cluster, name), what=f"{name}'s plan")
        wait_for(
            lambda: condition(k, cluster, "chat", "Ready").get("status") == "True",
            what="Ready on the new instances",
        )
        assert status(k, cluster, "chat")["instancesReady"] == "2/2"
    finally:
        op.stop()


def plan_or_waiting(k: Kube, cluster: Cluster, name: str) -> str:
    """``plan`` when the instance has its PartitionPlan, ``waiting`` while it waits for a
    node to drain, "" before either."""
    if plans(k, cluster, name):
        return "plan"
    c = condition(k, cluster, name, "Solved")
    return "waiting" if "waiting for GPUNodes to drain" in c.get("message", "") else ""
