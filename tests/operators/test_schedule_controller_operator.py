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
from test_walkthrough import _agent_settings, _files_of, _owned_by

from agents.simulate import SimulatedFleet
from apis.kube.client import MODEL_DEPLOYMENTS, PLACEMENT_POLICIES, Kube
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
            sim = SimulatedFleet(_fleet(cluster), _agent_settings(ctl.address))
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


def _on(sim: SimulatedFleet, nodes: list[str], name: str) -> list[str]:
    """The nodes of ``nodes`` whose agent has deployment ``name`` applied."""
    return [n for n in nodes if name in sim.appliers[n].applied()]


async def _delete_one_while_the_controller_runs(
    cluster: Cluster, k: Kube, sim: SimulatedFleet, nodes: list[str], plan_dir: Path
) -> None:
    """Create ``first`` and ``second`` (one agent each), delete ``first``: it leaves its agent,
    its plan files and owned objects go, ``second`` keeps serving."""
    sel = {"nodeSelector": {RUN_LABEL: cluster.run}, "policy": "greedy"}
    await _in_thread(lambda: wait_for(lambda: _registered(cluster), what="nodes"))
    for name in ("first", "second"):
        md = md_object(name, cluster.namespace, minGpus=2, maxGpus=2, **sel)
        k.create(MODEL_DEPLOYMENTS, md)
    await _in_thread(
        lambda: wait_for(
            lambda: len(_on(sim, nodes, "first")) == 1 and len(_on(sim, nodes, "second")) == 1,
            what="each on one agent",
        )
    )
    assert _files_of(plan_dir, "first") and _files_of(plan_dir, "second")
    assert _owned_by(k, cluster, "first")

    k.delete(MODEL_DEPLOYMENTS, "first", cluster.namespace)
    await _in_thread(
        lambda: wait_for(
            lambda: not _on(sim, nodes, "first") and not _files_of(plan_dir, "first"),
            what="first off its agent, its plan files removed",
        )
    )
    await _in_thread(
        lambda: wait_for(lambda: not _owned_by(k, cluster, "first"), what="first's objects")
    )
    # second stays (it may move to the node first freed, for the objective)
    await _in_thread(
        lambda: wait_for(lambda: len(_on(sim, nodes, "second")) == 1, what="second serving")
    )
    assert _files_of(plan_dir, "second")


async def _delete_the_other_across_a_restart(
    cluster: Cluster,
    k: Kube,
    sim: SimulatedFleet,
    nodes: list[str],
    plan_dir: Path,
    ctl_dir: Path,
    port: int,
) -> None:
    """With the controller down, delete ``second``; restart the controller on ``port`` (store
    state under ``ctl_dir``): ``second`` leaves its agent, and no agent reports a deployment
    the controller has no record of."""
    k.delete(MODEL_DEPLOYMENTS, "second", cluster.namespace)
    await _in_thread(
        lambda: wait_for(
            lambda: k.get(MODEL_DEPLOYMENTS, "second", cluster.namespace) is None,
            what="second gone (no tombstone left)",
        )
    )
    store = KubernetesStore(cluster.kube("mixfleet-controller"), cluster.namespace)
    async with start_controller(ctl_dir, store=store, port=port) as ctl:
        await _in_thread(
            lambda: wait_for(
                lambda: not _on(sim, nodes, "second") and not _files_of(plan_dir, "second"),
                what="second off its agent after the restart",
            )
        )
        views = ctl.controller.nodes.node_views()
        assert sorted(v.stored.name for v in views) == sorted(nodes)
        assert [v.unknown_deployments for v in views] == [(), ()], views


def test_a_deleted_deployment_leaves_its_agents_also_across_a_controller_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    """``kubectl delete modeldeployment`` takes the deployment's parts off its agents: its
    plan files go, its PartitionPlans and ConfigMaps are garbage-collected, and the other
    deployment is left alone. Deleted while the controller is down, it goes when the agents
    reconnect to the restarted controller, which reports no deployment it has no record of
    (the plan version is this store's: not a replaced or restored store)."""
    k = cluster.kube("mixfleet-test")
    k.create(
        PLACEMENT_POLICIES,
        policy_object(cluster.name("default"), policy="greedy", solverTimeLimitS=5, workers=1),
    )
    nodes = [n.name for n in _fleet(cluster).nodes]
    plan_dir = tmp_path / "plans"

    async def go() -> None:
        operator = start_operator(cluster)
        sim: SimulatedFleet | None = None
        try:
            store = KubernetesStore(cluster.kube("mixfleet-controller"), cluster.namespace)
            async with start_controller(tmp_path / "ctl", store=store) as ctl:
                sim = SimulatedFleet(
                    _fleet(cluster), _agent_settings(ctl.address), plan_dir=plan_dir
                )
                sim.start()
                port = ctl.port
                await _delete_one_while_the_controller_runs(cluster, k, sim, nodes, plan_dir)
            # The controller is down: delete the other one, then start it again.
            await _delete_the_other_across_a_restart(
                cluster, k, sim, nodes, plan_dir, tmp_path / "ctl2", port
            )
        finally:
            operator.stop()
            if sim is not None:
                await sim.stop()

    asyncio.run(go())
    _check_requests_were_declared(cluster)
