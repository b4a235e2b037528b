"""The controller's instances of a planned deployment, without agents: a real controller on
SQLite (its loop not started) adopts fleet plans. Each instance is a stored deployment with
its record; engine ports are the lowest free and stay with a kept instance; a dropped
instance drains; the plan the instances run reads back from their records (the previous
plan after a restart); a user may not delete an instance."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from test_controller_instances_e2e import SPEC, _at, _inventories

from controlplane.errors import PreconditionError
from controlplane.server.controller import Controller
from controlplane.server.controller.instance_records import (
    BOOTSTRAP_BASE_PORT,
    ENGINE_BASE_PORT,
    INSTANCES_KEY,
    InstanceRecord,
)
from controlplane.server.inprocess import FAST
from controlplane.store import StoredDeployment
from controlplane.store.sqlite import SqliteStore
from policies.fleet import Fleet
from policies.fleetplan import FleetDeployment, FleetPlan, MemoryCurveCache, PlanRequest, plan_fleet
from policies.spec import DeploymentSpec

CACHE = MemoryCurveCache()
FLEET = Fleet("f", tuple(inv.to_node(healthy_only=True) for inv in _inventories()))


def _plan(spec: DeploymentSpec, previous: FleetPlan | None = None) -> FleetPlan:
    req = PlanRequest(FLEET, (FleetDeployment(spec),), previous=previous)
    return plan_fleet(req, cache=CACHE)


def _groups(plan: FleetPlan) -> list[tuple[str, int, list[tuple[str, ...]]]]:
    """(variant, count, nodes) of every group of q's pools."""
    return sorted(
        (g.variant.key, g.count, sorted(g.nodes))
        for p in plan.deployments["q"].pools
        for g in p.groups()
    )


def _apply(c: Controller, spec: DeploymentSpec) -> StoredDeployment:
    return c.apply_deployment(spec)


def _stored(store: SqliteStore, name: str) -> StoredDeployment:
    d = store.get_deployment(name)
    assert d is not None, name
    return d


def test_instances_ports_drain_and_the_running_plan(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    c = Controller(store, settings=FAST)
    inst = c.scheduler.instances
    try:
        first = _plan(SPEC)
        inst.adopt(first, [_apply(c, SPEC)])
        recs = {n: InstanceRecord.from_status(_stored(store, n).status) for n in inst.of("q")}
        assert sorted(recs) == ["q-decode-0", "q-decode-1", "q-prefill-0"]
        ports = {n: r.port for n, r in recs.items() if r is not None}
        assert sorted(ports.values()) == [ENGINE_BASE_PORT + i for i in range(3)]
        prefill = recs["q-prefill-0"]
        assert prefill is not None and prefill.bootstrap_port == BOOTSTRAP_BASE_PORT
        assert _stored(store, "q").status[INSTANCES_KEY] == sorted(recs)
        generations = {n: _stored(store, n).generation for n in recs}
        assert inst.tick(["q"], {}) == {"q": ("rolling_out", "0 of 3 instances committed")}
        d0 = _stored(store, "q-decode-0")
        store.set_deployment_status("q-decode-0", {**d0.status, "phase": "failed", "message": "x"})
        assert inst.tick(["q"], {})["q"] == ("failed", "0 of 3 instances committed; q-decode-0: x")
        store.set_deployment_status("q-decode-0", d0.status)

        # What runs reads back as the plan: planning against it changes nothing.
        running = inst.running_plan(first)
        assert running is not None and _groups(running) == _groups(first)
        again = _plan(SPEC, previous=running)
        inst.adopt(again, [_stored(store, "q")])
        assert {n: inst.records[n].port for n in recs} == ports
        assert {n: _stored(store, n).generation for n in recs} == generations

        # 5 requests/s: one aggregated instance; the three drain and keep their ports.
        small = _plan(_at(5.0), previous=again)
        inst.adopt(small, [_apply(c, _at(5.0))])
        assert sorted(inst.of("q")) == ["q-aggregated-0", *sorted(recs)]
        assert all(inst.draining(n) for n in recs)
        assert inst.records["q-aggregated-0"].port == ENGINE_BASE_PORT + 3
        assert inst.records["q-aggregated-0"].bootstrap_port == 0

        # A user may neither delete nor apply an instance.
        with pytest.raises(PreconditionError, match="an instance of q, written by the"):
            c.delete_deployment("q-aggregated-0")
        with pytest.raises(PreconditionError, match="change q"):
            c.apply_deployment(replace(SPEC, name="q-decode-1", traffic=None, slo=None))

        # Deleting q takes every instance with it.
        assert c.delete_deployment("q")
        assert inst.of("q") == [] and [d.name for d in store.list_deployments()] == []
    finally:
        asyncio.run(c.stop())
        store.close()


def test_the_controller_keeps_step_curves_next_to_its_sqlite_file(tmp_path: Path) -> None:
    from argparse import Namespace

    from controlplane.cli.controller import _curve_cache_dir
    from controlplane.curvecache import FileCurveCache

    store = SqliteStore(tmp_path / "state.db")
    try:
        where = _curve_cache_dir(Namespace(curve_cache=None), store)
        assert where == str(tmp_path.resolve() / "state.db.curves")
        assert _curve_cache_dir(Namespace(curve_cache=str(tmp_path / "c")), store) == str(
            tmp_path / "c"
        )
        c = Controller(store, settings=replace(FAST, curve_cache_dir=where))
        try:
            curves = c.scheduler.curves
            assert isinstance(curves, FileCurveCache)
            plan_fleet(PlanRequest(FLEET, (FleetDeployment(SPEC),)), cache=curves)
            assert curves.writes > 0 and any(Path(where).rglob("*.json"))
        finally:
            asyncio.run(c.stop())
    finally:
        store.close()
