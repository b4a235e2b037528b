"""Preemption in Kubernetes mode with the real controller (Kubernetes store), the real
operator and simulated agents: the operator withdraws the preempted deployment's
PartitionPlans, the controller (``FleetScheduler.sweep_withdrawn``) takes its parts off the
agents, and the new holder is rolled out on every node.

Runs against the fake API server always and against a real cluster when
``MIXFLEET_E2E_KUBECONFIG`` is set (the ``cluster`` fixture)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from k8s_builders import md_object, policy_object
from k8s_cluster import RUN_LABEL, Cluster, wait_for
from test_controller_and_operator import (
    _check_requests_were_declared,
    _fleet,
    _in_thread,
    _plans,
    _registered,
)
from test_operator_e2e import start_operator

from agents.agent import AgentSettings
from agents.backoff import BackoffSettings
from agents.simulate import SimulatedFleet
from apis.kube.client import MODEL_DEPLOYMENTS, PLACEMENT_POLICIES
from controlplane.server.inprocess import start_controller
from controlplane.store.kubernetes import KubernetesStore

pytestmark = pytest.mark.slow


def test_a_preempted_deployment_leaves_its_agents(cluster: Cluster, tmp_path: Path) -> None:
    k = cluster.kube("mixfleet-test")
    k.create(
        PLACEMENT_POLICIES,
        policy_object(cluster.name("default"), policy="greedy", solverTimeLimitS=5, workers=1),
    )
    store = KubernetesStore(cluster.kube("mixfleet-controller"), cluster.namespace)
    stop = threading.Event()
    nodes = [n.name for n in _fleet(cluster).nodes]

    async def go() -> None:
        async with start_controller(tmp_path / "ctl", store=store) as ctl:
            agents = AgentSettings(
                controller=ctl.address,
                insecure=True,
                backoff=BackoffSettings(initial_s=0.05, max_s=0.3, jitter=0.5),
                rpc_timeout_s=5.0,
            )
            sim = SimulatedFleet(_fleet(cluster), agents)
            sim.start()
            operator = start_operator(cluster)
            sel = {"nodeSelector": {RUN_LABEL: cluster.run}, "policy": "greedy"}

            def on(name: str) -> list[str]:
                return [n for n in nodes if name in sim.appliers[n].applied()]

            try:
                await _in_thread(lambda: wait_for(lambda: _registered(cluster), what="nodes"))
                low = md_object("low", cluster.namespace, priority=1, minGpus=2, maxGpus=2, **sel)
                k.create(MODEL_DEPLOYMENTS, low)
                await _in_thread(lambda: wait_for(lambda: len(on("low")) == 1, what="low on"))
                high = md_object("high", cluster.namespace, priority=10, minGpus=4, **sel)
                k.create(MODEL_DEPLOYMENTS, high)
                await _in_thread(
                    lambda: wait_for(lambda: not _plans(cluster, "low"), what="low withdrawn")
                )
                await _in_thread(
                    lambda: wait_for(
                        lambda: not on("low") and sorted(on("high")) == sorted(nodes),
                        what="low off its agent, high on both",
                        timeout_s=60.0,
                    )
                )
            finally:
                stop.set()
                operator.stop()
                await sim.stop()

    asyncio.run(go())
    _check_requests_were_declared(cluster)
