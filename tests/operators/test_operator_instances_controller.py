"""A ModelDeployment planned from its traffic and SLOs with the whole Kubernetes mode: the
real operator makes its engine instances, the real controller on the Kubernetes store rolls
each instance's plan out to simulated agents, and the deployment is Ready once every
instance is committed on its nodes; the controller reads each instance's record as its own
(``StoredDeployment.status["instance"]``) and lists them as ``WatchInstances`` does in the
standalone mode. Deleting the deployment takes every instance's
plan off the agents.

Runs against the fake API server always and against a real cluster when
``MIXFLEET_E2E_KUBECONFIG`` is set (the ``cluster`` fixture)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from k8s_builders import md_object, policy_object
from k8s_cluster import RUN_LABEL, Cluster, wait_for
from test_operator_e2e import condition, status
from test_operator_instances_e2e import CHAT, instances, start

from agents.agent import AgentSettings
from agents.backoff import BackoffSettings
from agents.simulate import SimulatedFleet
from apis.kube.client import MODEL_DEPLOYMENTS, PLACEMENT_POLICIES
from controlplane.server.controller.endpoints import instance_set
from controlplane.server.controller.instance_records import InstanceRecord
from controlplane.server.inprocess import start_controller
from controlplane.store.kubernetes import KubernetesStore

pytestmark = pytest.mark.slow


def _in_thread(fn: Any) -> Any:
    return asyncio.to_thread(fn)


def test_the_controller_rolls_out_every_instance_and_the_deployment_is_ready(
    cluster: Cluster, tmp_path: Path
) -> None:
    k = cluster.kube("mixfleet-test")
    k.create(PLACEMENT_POLICIES, policy_object(cluster.name("default"), policy="greedy"))
    fleet = cluster.fleet("e2e", tuple((f"h100-{i}", "H100-SXM5-80GB") for i in range(3)))
    store = KubernetesStore(cluster.kube("mixfleet-controller"), cluster.namespace)

    async def go() -> None:
        async with start_controller(tmp_path / "ctl", store=store) as ctl:
            agents = AgentSettings(
                controller=ctl.address,
                insecure=True,
                backoff=BackoffSettings(initial_s=0.05, max_s=0.3, jitter=0.5),
                rpc_timeout_s=5.0,
            )
            sim = SimulatedFleet(fleet, agents)
            sim.start()
            operator = start(cluster)
            try:
                await _in_thread(
                    lambda: wait_for(lambda: cluster.registered(fleet), what="GPUNodes reported")
                )
                spec = {**CHAT, "nodeSelector": {RUN_LABEL: cluster.run}}
                k.create(MODEL_DEPLOYMENTS, md_object("chat", cluster.namespace, **spec))
                await _in_thread(
                    lambda: wait_for(
                        lambda: condition(k, cluster, "chat", "Ready").get("status") == "True",
                        what="every instance committed",
                    )
                )
                names = [o["metadata"]["name"] for o in instances(k, cluster, "chat")]
                assert names == ["chat-decode-0", "chat-prefill-0"]
                for name in names:
                    st = status(k, cluster, name)
                    assert st["committedVersion"] == 1
                    for node in st["nodes"]:
                        assert sim.appliers[node].applied().get(name) == 1
                    stored = store.get_deployment(name)
                    assert stored is not None
                    rec = InstanceRecord.from_status(stored.status)
                    assert rec is not None and rec.of == "chat" and rec.nodes == tuple(st["nodes"])
                    assert rec.role == name.split("-")[1]
                assert status(k, cluster, "chat")["instancesReady"] == "2/2"
                # What WatchInstances lists: the same instances as in the standalone mode.
                listed = instance_set(store, lambda node: node, "chat")
                assert [(i.name, i.role, i.ready) for i in listed.instances] == [
                    ("chat-decode-0", "decode", True),
                    ("chat-prefill-0", "prefill", True),
                ]
                assert listed.instances[1].bootstrap_port == 8998

                # Deleting the deployment takes every instance's plan off the agents.
                k.delete(MODEL_DEPLOYMENTS, "chat", cluster.namespace)

                def gone() -> bool:
                    return not instances(k, cluster, "chat") and all(
                        not sim.appliers[n.name].applied() for n in fleet.nodes
                    )

                await _in_thread(lambda: wait_for(gone, what="instances gone from the agents"))
            finally:
                operator.stop()
                await sim.stop()

    asyncio.run(go())
