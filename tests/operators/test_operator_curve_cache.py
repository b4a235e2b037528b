"""The operator keeps the fleet planner's step curves on disk (``--curve-cache``, the chart's
``operator.curveCache``): a restarted operator plans a deployment with traffic and SLOs from
the curves its predecessor wrote, computing none - counted by the plan
(``curves_computed`` / ``curves_cached``), not timed - and without the cache it computes
them all again. End to end against the API server (the fake one; with
MIXFLEET_E2E_KUBECONFIG also a real cluster)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from k8s_builders import md_object
from k8s_cluster import RUN_LABEL, Cluster, wait_for
from test_operator_e2e import settings
from test_operator_instances_e2e import CHAT, PLANNER

from apis.curvecache import FileCurveCache
from apis.kube.client import MODEL_DEPLOYMENTS, Kube
from operators.cli import build_parser, settings_from
from operators.operator import Operator
from policies.fleetplan import FleetPlan, MemoryCurveCache

pytestmark = pytest.mark.slow


def test_the_flag_reaches_the_settings() -> None:
    args = build_parser().parse_args(["run", "--curve-cache", "/var/cache/curves"])
    assert settings_from(args).curve_cache_dir == "/var/cache/curves"
    assert settings_from(build_parser().parse_args(["run"])).curve_cache_dir == ""


def _plan_once(cluster: Cluster, curve_dir: str) -> tuple[FleetPlan, int, int]:
    """Start an operator with the curve cache ``curve_dir`` ("" = in memory), wait for its
    fleet plan of ``chat``, stop it (a restart is the next call). Returns the plan and, over
    the operator's life (it may plan more than once), the curves it computed (put into its
    cache) and the curves it read from disk."""
    kube = cluster.kube("mixfleet-operator", user_agent="mixfleet-operator/op-0")
    cfg = dataclasses.replace(settings(cluster), fleet_planner=PLANNER, curve_cache_dir=curve_dir)
    op = Operator(kube, cfg)
    op.start(wait_synced_s=10)
    try:
        plan: FleetPlan = wait_for(
            lambda: (p := op.fleet.fleet_plan) is not None and "chat" in p.deployments and p,
            what="the fleet plan of chat",
        )
    finally:
        op.stop()
    cache = op.fleet.curves
    if isinstance(cache, FileCurveCache):
        return plan, cache.writes, cache.hits
    assert isinstance(cache, MemoryCurveCache)
    return plan, cache.computed, 0


def _instances(plan: FleetPlan) -> list[tuple[str, str, int]]:
    return sorted(
        (pool.name, g.variant.key, g.count)
        for pool in plan.deployments["chat"].pools
        for g in pool.groups()
    )


def test_a_restarted_operator_reads_the_curves_its_predecessor_computed(
    cluster: Cluster, fleet3: Kube, tmp_path: Path
) -> None:
    k = fleet3
    spec = {**CHAT, "nodeSelector": {RUN_LABEL: cluster.run}}
    k.create(MODEL_DEPLOYMENTS, md_object("chat", cluster.namespace, **spec))
    curves = tmp_path / "curves"

    first, computed, _ = _plan_once(cluster, str(curves))
    assert computed > 0 and first.curves_computed + first.curves_cached == computed
    written = sorted(p.name for p in curves.rglob("*.json"))
    assert len(written) == computed

    again, recomputed, read = _plan_once(cluster, str(curves))
    assert (recomputed, again.curves_computed) == (0, 0)
    assert read >= computed and again.curves_cached == computed
    assert _instances(again) == _instances(first)
    assert sorted(p.name for p in curves.rglob("*.json")) == written

    # Without the cache a restart computes every curve again.
    _, in_memory, _ = _plan_once(cluster, "")
    assert in_memory == computed
