"""The controller on its Kubernetes store rolls out only what it should: no rollout onto a
GPUNode an administrator cordoned, none while the operator (the one decision maker) reports
that it cannot plan the deployment (``Solved=False``: PolicyNotFound, NoEligibleNodes...),
and the user's ``policyRef`` is left as it is."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from k8s_builders import inventory, md_object, propose_plan
from k8s_cluster import Cluster, wait_for

from apis.kube.client import GPUNODES, MODEL_DEPLOYMENTS
from apis.kube.v1alpha1 import API_VERSION
from controlplane.server import reconcile as rc
from controlplane.server.inprocess import FAST, start_controller
from controlplane.store.kubernetes import KubernetesStore
from policies.estimate.workload import make_workload
from policies.hardware.fleet import parse_fleet
from policies.model.architecture import preset
from policies.plan import Plan
from policies.request import PlacementRequest
from policies.solve import solve

SETTINGS = dataclasses.replace(FAST, node_lost_after_s=600.0)
BASES = {"h100-0": "H100-SXM5-80GB", "a100-0": "A100-SXM4-80GB"}


def _plan(cluster: Cluster) -> Plan:
    nodes = [
        {
            "name": cluster.name(b),
            "gpus": [{"model": m, "count": 2}],
            "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib0"}],
        }
        for b, m in BASES.items()
    ]
    model = preset("mixtral-8x7b")
    w = make_workload(model, phase="decode", tokens_per_gpu=16, context_len=2048)
    fleet = parse_fleet({"metadata": {"name": "f"}, "spec": {"nodes": nodes}})
    return solve(PlacementRequest(fleet, model, w, policy="greedy", redundant_experts=0)).plan


def _starts(actions: list[rc.Action]) -> list[tuple[str, int]]:
    return [(a.deployment, a.version) for a in actions if isinstance(a, rc.StartRollout)]


def _status(actions: list[rc.Action]) -> str:
    return next(a.message for a in actions if isinstance(a, rc.SetStatus))


def _solved(cluster: Cluster, status: str, reason: str, message: str) -> None:
    """What the operator writes: the Solved condition of mx."""
    cluster.kube("mixfleet-operator").apply(
        MODEL_DEPLOYMENTS,
        {
            "metadata": {"name": "mx", "namespace": cluster.namespace},
            "status": {
                "observedGeneration": 1,
                "conditions": [
                    {
                        "type": "Solved",
                        "status": status,
                        "reason": reason,
                        "message": message,
                        "lastTransitionTime": "2026-03-01T12:00:00Z",
                    }
                ],
            },
        },
        subresource="status",
        force=True,
    )


def _run(cluster: Cluster, tmp_path: Path, steps: Any) -> None:
    """Start the controller (its loop stopped: the test ticks it), register both nodes,
    create mx with a policyRef and propose one plan on both nodes; then ``steps(ctl)``."""
    store = KubernetesStore(
        cluster.kube("mixfleet-controller"), cluster.namespace, cordon_refresh_s=0.0
    )
    user = cluster.kube("kubectl")

    async def go() -> None:
        async with start_controller(
            tmp_path, store=store, run_loop=False, settings=SETTINGS
        ) as ctl:
            for base in BASES:
                ctl.controller.register(inventory(cluster.name(base), base))
            user.create(
                MODEL_DEPLOYMENTS,
                md_object("mx", cluster.namespace, policyRef={"name": cluster.name("fast")}),
            )
            assert propose_plan(user, cluster.namespace, "mx", _plan(cluster)) == 1
            steps(ctl.controller)

    asyncio.run(go())


def _cordon(cluster: Cluster, base: str, cordon: bool) -> None:
    cluster.kube("admin").apply(
        GPUNODES,
        {
            "apiVersion": API_VERSION,
            "kind": "GPUNode",
            "metadata": {"name": cluster.name(base)},
            "spec": {"cordon": cordon},
        },
    )


def test_no_rollout_onto_a_cordoned_gpunode(cluster: Cluster, tmp_path: Path) -> None:
    h100 = cluster.name("h100-0")

    def steps(controller: Any) -> None:
        _cordon(cluster, "h100-0", True)
        actions = controller.tick()
        assert _starts(actions) == []
        assert f"v1 targets nodes that are not usable ({h100})" in _status(actions)
        _cordon(cluster, "h100-0", False)
        assert _starts(controller.tick()) == [("mx", 1)]

    _run(cluster, tmp_path, steps)
    md = cluster.kube().get(MODEL_DEPLOYMENTS, "mx", cluster.namespace)
    assert md is not None and md["spec"]["policyRef"] == {"name": cluster.name("fast")}


@pytest.mark.parametrize(
    "reason",
    ["PolicyNotFound", "NoEligibleNodes"],
)
def test_no_rollout_while_the_operator_reports_it_cannot_plan(
    cluster: Cluster, tmp_path: Path, reason: str
) -> None:
    def steps(controller: Any) -> None:
        _solved(cluster, "False", reason, "what the operator says. To fix: ...")
        actions = controller.tick()
        assert _starts(actions) == []
        assert f"v1 held: the operator reports {reason}: what the operator says" in _status(actions)
        _solved(cluster, "True", "Solved", "plan v1 places mixtral-8x7b")
        assert _starts(controller.tick()) == [("mx", 1)]

    _run(cluster, tmp_path, steps)
    md = cluster.kube().get(MODEL_DEPLOYMENTS, "mx", cluster.namespace)
    assert md is not None and md["spec"]["policyRef"] == {"name": cluster.name("fast")}


def test_a_node_reporting_a_deployment_deleted_while_its_stream_was_down_gets_remove(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A node whose stored record lags (heartbeats are persisted at intervals) opens its
    stream without the deleted deployment in that record, then reports it in a heartbeat:
    the Kubernetes store keeps no tombstone, so the version counter says it was this store's,
    and the node gets REMOVE (it was left running before)."""
    h100 = cluster.name("h100-0")

    def steps(controller: Any) -> None:
        user = cluster.kube("kubectl")
        user.delete(MODEL_DEPLOYMENTS, "mx", cluster.namespace)
        assert wait_for(lambda: user.get(MODEL_DEPLOYMENTS, "mx", cluster.namespace) is None)
        session = controller.register(inventory(h100, "h100-0")).session_id
        sent: list[tuple[str, str, str, int]] = []
        controller.watchers.send = lambda node, e: sent.append(
            (node, e.deployment, e.phase, e.version)
        )
        assert controller.heartbeat(h100, session, applied={"mx": 1})
        assert sent == [(h100, "mx", "remove", 1)]
        assert controller.nodes.node_views(h100)[0].unknown_deployments == ()
        # a version this store never allocated is another store's: reported, never removed
        sent.clear()
        assert controller.heartbeat(h100, session, applied={"mx": 7})
        assert sent == []
        assert controller.nodes.node_views(h100)[0].unknown_deployments == ("mx",)

    _run(cluster, tmp_path, steps)
