"""The real controller (Kubernetes store), the real operator and simulated agents on one
ModelDeployment: the operator alone decides the plan, the controller rolls it out on the
agents, and every object names the same committed plan.

Runs against the fake API server always and against a real cluster when
``MIXFLEET_E2E_KUBECONFIG`` is set (the ``cluster`` fixture)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from api_calls import component_calls, request_need
from k8s_builders import md_object, policy_object
from k8s_cluster import RUN_LABEL, Cluster, wait_for
from test_operator_e2e import start_operator

from agents.agent import AgentSettings
from agents.backoff import BackoffSettings
from agents.simulate import SimulatedFleet
from apis.kube.client import (
    CONFIGMAPS,
    MODEL_DEPLOYMENTS,
    PARTITION_PLANS,
    PLACEMENT_POLICIES,
)
from controlplane.server.inprocess import start_controller
from controlplane.store.kubernetes import KubernetesStore
from policies.hardware.fleet import Fleet


def _fleet(cluster: Cluster) -> Fleet:
    """Two 2-GPU nodes (H100, A100) with the run label, named for this run."""
    return cluster.fleet("e2e", (("h100-0", "H100-SXM5-80GB"), ("a100-0", "A100-SXM4-80GB")))


def _plans(cluster: Cluster, name: str = "mx") -> list[dict[str, Any]]:
    items, _ = cluster.kube().list(
        PARTITION_PLANS, cluster.namespace, label_selector=f"mixfleet.io/deployment={name}"
    )
    return sorted(items, key=lambda p: int(p["spec"]["version"]))


def _committed(cluster: Cluster, version: int, name: str = "mx") -> dict[str, Any] | None:
    """The deployment when ``version`` is committed everywhere and named by every object:
    the PartitionPlan's state, the ModelDeployment's pointer and status, the ConfigMap, and
    RolledOut True."""
    k = cluster.kube()
    md = k.get(MODEL_DEPLOYMENTS, name, cluster.namespace) or {}
    status = md.get("status") or {}
    plans = {int(p["spec"]["version"]): p for p in _plans(cluster, name)}
    plan = plans.get(version)
    if plan is None or (plan.get("status") or {}).get("state") != "Committed":
        return None
    if status.get("committedVersion") != version:
        return None
    if (status.get("currentPlan") or {}).get("version") != version:
        return None
    rolled = [c for c in status.get("conditions") or [] if c["type"] == "RolledOut"]
    if not rolled or rolled[0]["status"] != "True":
        return None
    cm = k.get(CONFIGMAPS, f"{name}-placement", cluster.namespace)
    if cm is None or cm["metadata"].get("annotations", {}).get("mixfleet.io/plan-version") != str(
        version
    ):
        return None
    return md


def _registered(cluster: Cluster) -> bool:
    """Every simulated node has registered: its GPUNode carries an inventory."""
    return cluster.registered(_fleet(cluster))


def _in_thread(fn: Callable[[], Any]) -> Any:
    return asyncio.to_thread(fn)


def test_one_plan_per_generation_made_by_the_operator_rolled_out_by_the_controller(
    cluster: Cluster, tmp_path: Path
) -> None:
    k = cluster.kube("mixfleet-test")
    k.create(
        PLACEMENT_POLICIES,
        policy_object(cluster.name("default"), policy="greedy", solverTimeLimitS=5, workers=1),
    )
    store = KubernetesStore(cluster.kube("mixfleet-controller"), cluster.namespace)
    stop = threading.Event()

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
            try:
                await _in_thread(
                    lambda: wait_for(lambda: _registered(cluster), what="both GPUNodes reported")
                )
                spec = {"policy": "greedy", "nodeSelector": {RUN_LABEL: cluster.run}}
                k.create(MODEL_DEPLOYMENTS, md_object("mx", cluster.namespace, **spec))
                await _in_thread(
                    lambda: wait_for(
                        lambda: _committed(cluster, 1),
                        what="v1 committed",
                        timeout_s=60.0,
                    )
                )
                plans = _plans(cluster)
                assert [(p["spec"]["version"], p["spec"]["madeBy"]) for p in plans] == [
                    (1, "operator")
                ]
                assert sorted(plans[0]["spec"]["nodes"]) == sorted(
                    n.name for n in _fleet(cluster).nodes
                )

                def applied_everywhere() -> bool:
                    return all(
                        sim.appliers[n].applied().get("mx") == 1 for n in plans[0]["spec"]["nodes"]
                    )

                await _in_thread(lambda: wait_for(applied_everywhere, what="v1 applied"))

                # ---- a spec change: exactly one new plan, which replaces v1
                k.merge_patch(
                    MODEL_DEPLOYMENTS,
                    "mx",
                    {"spec": {"workload": {"tokensPerGpu": 32}}},
                    cluster.namespace,
                )
                await _in_thread(
                    lambda: wait_for(lambda: _committed(cluster, 2), what="v2 committed")
                )
                plans = _plans(cluster)
                assert [
                    (p["spec"]["version"], p["spec"]["madeBy"], p["status"]["state"]) for p in plans
                ] == [(1, "operator", "Superseded"), (2, "operator", "Committed")]
                assert [p["spec"]["deploymentGeneration"] for p in plans] == [1, 2]
            finally:
                stop.set()
                operator.stop()
                await sim.stop()

    asyncio.run(go())
    _check_requests_were_declared(cluster)


def _check_requests_were_declared(cluster: Cluster) -> None:
    """Every request each component made is one its source declares (test_rbac.py checks
    that the chart grants exactly those)."""
    if cluster.fake is None:
        return
    for component, agent in (
        ("controller", "mixfleet-controller"),
        ("operator", "mixfleet-operator"),
    ):
        declared = set(component_calls(component).needs)
        made = {
            request_need(r.method, r.path, dict(r.query))
            for r in cluster.fake.requests
            if r.user_agent.startswith(agent)
        }
        assert made and made - {None} <= declared, (component, made - declared)
