"""The controller's instances of a planned deployment, without agents: a real controller on
SQLite (its loop not started, a fake clock) adopts fleet plans; commits are written to the
store as a rollout writes them (a plan solved for the instance's spec on its nodes). Each
instance is a stored deployment with its record; engine ports are the lowest free from the
controller's base and stay with a kept instance; a dropped instance that never served is
deleted at once, one that serves retires (listed ready), drains once its replacement is
committed and is deleted after the drain grace, across a restart; on a full fleet one instance drains at a time, the cheapest loss first; the plan
the instances run reads back from their records (the previous plan after a restart); a user
may not delete an instance."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from test_controller_instances_e2e import SPEC, _at, _inventories

from controlplane.errors import PreconditionError
from controlplane.server.controller import Controller, ControllerSettings
from controlplane.server.controller.instance_records import (
    BOOTSTRAP_BASE_PORT,
    ENGINE_BASE_PORT,
    INSTANCES_KEY,
    InstanceRecord,
)
from controlplane.server.inprocess import FAST
from controlplane.store import Store, StoredDeployment
from controlplane.store.sqlite import SqliteStore
from policies.fleetplan import FleetDeployment, FleetPlan, MemoryCurveCache, PlanRequest, plan_fleet
from policies.hardware.fleet import Fleet
from policies.hardware.inventory import inventory_from_node
from policies.solve import solve
from policies.spec.build import DeploymentSpec, build_request

CACHE = MemoryCurveCache()
FLEET = Fleet("f", tuple(inv.to_node(healthy_only=True) for inv in _inventories()))
#: A fourth node like the others, the spare one.
SPARE = replace(inventory_from_node(FLEET.nodes[0]), node="h3").to_node(healthy_only=True)
T0 = 1_800_000_000.0
GRACE_S = 30.0


def _plan(
    spec: DeploymentSpec, previous: FleetPlan | None = None, fleet: Fleet = FLEET
) -> FleetPlan:
    req = PlanRequest(fleet, (FleetDeployment(spec),), previous=previous)
    return plan_fleet(req, cache=CACHE)


class Clock:
    """The controller's Unix time, s, moved by the test."""

    def __init__(self) -> None:
        self.now_s = T0

    def __call__(self) -> float:
        return self.now_s


def _controller(
    store: SqliteStore,
    clock: Clock,
    engine_base_port: int = ENGINE_BASE_PORT,
    bootstrap_base_port: int = BOOTSTRAP_BASE_PORT,
) -> Controller:
    settings = replace(
        FAST,
        drain_grace_s=GRACE_S,
        engine_base_port=engine_base_port,
        bootstrap_base_port=bootstrap_base_port,
    )
    return Controller(store, settings=settings, clock=clock)


def _commit(c: Controller, name: str) -> None:
    """Commit a plan solved for instance ``name``'s current spec on its nodes, as its
    rollout would."""
    store, now = c.store, c.clock()
    d = _stored(store, name)
    nodes = set(c.scheduler.instances.records[name].nodes)
    fleet = Fleet("f", tuple(n for n in (*FLEET.nodes, SPARE) if n.name in nodes))
    plan = solve(build_request(d.spec, fleet)).plan
    p = store.add_plan(name, plan, reason="t", inputs_key=f"g{d.generation}:t", now_s=now)
    store.set_plan_state(name, p.version, "preparing", now_s=now)
    store.commit_plan(name, p.version, now_s=now)


def _listed(c: Controller) -> dict[str, str]:
    """q's instances as WatchInstances lists them: name -> ready | draining | pending."""
    return {i.name: i.state for i in c.endpoints.instances("q").instances}


def _groups(plan: FleetPlan) -> list[tuple[str, int, list[tuple[str, ...]]]]:
    """(variant, count, nodes) of every group of q's pools."""
    return sorted(
        (g.variant.key, g.count, sorted(g.nodes))
        for p in plan.deployments["q"].pools
        for g in p.groups()
    )


def _apply(c: Controller, spec: DeploymentSpec) -> StoredDeployment:
    return c.apply_deployment(spec)


def _stored(store: Store, name: str) -> StoredDeployment:
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

        # 5 requests/s: one aggregated instance; the three retire and keep their ports.
        small = _plan(_at(5.0), previous=again)
        inst.adopt(small, [_apply(c, _at(5.0))])
        assert sorted(inst.of("q")) == ["q-aggregated-0", *sorted(recs)]
        assert all(inst.records[n].retiring and not inst.draining(n) for n in recs)
        assert inst.records["q-aggregated-0"].port == ENGINE_BASE_PORT + 3
        assert inst.records["q-aggregated-0"].bootstrap_port == 0
        # None of them ever had a committed plan: nothing to drain, deleted at once.
        inst.tick(["q"], {})
        assert inst.removed == set(recs) and inst.of("q") == ["q-aggregated-0"]

        # A user may neither delete nor apply an instance.
        with pytest.raises(PreconditionError, match="an instance of q, written by the"):
            c.delete_deployment("q-aggregated-0")
        with pytest.raises(PreconditionError, match="change q"):
            c.apply_deployment(replace(SPEC, name="q-aggregated-0", traffic=None, slo=None))

        # Deleting q takes every instance with it.
        assert c.delete_deployment("q")
        assert inst.of("q") == [] and [d.name for d in store.list_deployments()] == []
    finally:
        asyncio.run(c.stop())
        store.close()


def test_the_controller_keeps_step_curves_next_to_its_sqlite_file(tmp_path: Path) -> None:
    from argparse import Namespace

    from apis.curvecache import FileCurveCache
    from controlplane.cli.controller import _curve_cache_dir

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


def test_a_dropped_instance_serves_until_its_replacement_commits_then_drains(
    tmp_path: Path,
) -> None:
    """45 requests/s on h0-h2, then 5 requests/s planned on the spare h3: the three old
    instances stay listed ready (retiring) until the new one commits, then drain, across two
    restarts, and are deleted when the grace has passed by the controller's clock."""
    store = SqliteStore(tmp_path / "state.db")
    clock = Clock()
    c = _controller(store, clock, engine_base_port=41000, bootstrap_base_port=42000)
    try:
        inst = c.scheduler.instances
        first = _plan(SPEC)
        inst.adopt(first, [_apply(c, SPEC)])
        old = inst.of("q")
        assert sorted(inst.records[n].port for n in old) == [41000, 41001, 41002]
        assert inst.records["q-prefill-0"].bootstrap_port == 42000
        for n in old:
            _commit(c, n)
        assert inst.tick(["q"], {}) == {"q": ("ready", "")}
        assert _listed(c) == dict.fromkeys(old, "ready")

        spare = Fleet("f", (SPARE,))
        inst.adopt(_plan(_at(5.0), previous=first, fleet=spare), [_apply(c, _at(5.0))])
        assert inst.records["q-aggregated-0"].nodes == ("h3",)
        assert inst.records["q-aggregated-0"].port == 41003
        assert inst.tick(["q"], {}) == {
            "q": ("rolling_out", "0 of 1 instances committed; 3 retiring")
        }
        want = dict.fromkeys(old, "ready") | {"q-aggregated-0": "pending"}
        assert _listed(c) == want  # the old ones keep serving
        listed = c.endpoints.instances("q").instances
        assert sorted(i.name for i in listed if i.retiring) == old
        assert {n: _stored(store, n).status["scheduling"]["decision"] for n in old} == (
            dict.fromkeys(old, "retiring")
        )
    finally:
        asyncio.run(c.stop())

    # A restart while they retire: still retiring, nothing drains before the commit.
    c = _controller(store, clock)
    try:
        inst = c.scheduler.instances
        assert all(inst.records[n].retiring for n in old)
        clock.now_s += 5.0
        inst.tick(["q"], {})
        assert _listed(c) == want
        _commit(c, "q-aggregated-0")
        clock.now_s += 1.0
        since = clock.now_s
        inst.on_commit("q-aggregated-0")  # the rollout's commit point: they drain at once
        assert _listed(c) == dict.fromkeys(old, "draining") | {"q-aggregated-0": "ready"}
        inst.tick(["q"], {})  # no fleet plan yet after the restart: the records decide
        assert _listed(c) == dict.fromkeys(old, "draining") | {"q-aggregated-0": "ready"}
        assert all(inst.records[n].draining_since_s == since for n in old)
    finally:
        asyncio.run(c.stop())

    # A restart while they drain keeps the time they began: deleted at since + grace.
    c = _controller(store, clock)
    try:
        inst = c.scheduler.instances
        assert all(inst.records[n].draining_since_s == since for n in old)
        clock.now_s = since + GRACE_S - 0.5
        inst.tick(["q"], {})
        assert inst.removed == set() and sorted(inst.of("q")) == sorted([*old, "q-aggregated-0"])
        clock.now_s = since + GRACE_S
        inst.tick(["q"], {})
        assert inst.removed == set(old) and inst.of("q") == ["q-aggregated-0"]
        assert _listed(c) == {"q-aggregated-0": "ready"}
        for n in old:
            d = store.get_deployment(n, include_deleted=True)
            assert d is not None and d.deleted
        assert _stored(store, "q").status[INSTANCES_KEY] == ["q-aggregated-0"]
    finally:
        asyncio.run(c.stop())
        store.close()


def test_on_a_full_fleet_one_instance_drains_at_a_time_the_cheapest_first(
    tmp_path: Path,
) -> None:
    """45 requests/s on h0-h2 (one prefill, two decode), then 5 requests/s on the same full
    fleet: the new aggregated instance waits for nodes the retiring ones hold (the
    scheduler's drain view, given here). While it could still come up nothing drains; once
    it waits only for retiring instances, one drains - a decode instance, as losing the
    pool's only prefill instance would stop the pool - and no other until that one is
    deleted after its grace; the others stay listed ready meanwhile."""
    store = SqliteStore(tmp_path / "state.db")
    clock = Clock()
    c = _controller(store, clock)
    try:
        inst = c.scheduler.instances
        first = _plan(SPEC)
        inst.adopt(first, [_apply(c, SPEC)])
        old = inst.of("q")
        for n in old:
            _commit(c, n)
        inst.tick(["q"], {})
        inst.adopt(_plan(_at(5.0), previous=first), [_apply(c, _at(5.0))])
        new = "q-aggregated-0"
        assert new in inst.records and all(inst.records[n].retiring for n in old)

        inst.tick(["q"], {})  # it waits for nothing: a surge, nothing drains
        inst.tick(["q"], {new: ["some-deployment"]})  # a holder that is not an instance
        assert not any(inst.draining(n) for n in old)

        waiting = {new: list(old)}
        inst.tick(["q"], waiting)
        assert [n for n in old if inst.draining(n)] == ["q-decode-0"]
        listed = _listed(c)
        assert listed == {
            "q-decode-0": "draining",
            "q-decode-1": "ready",
            "q-prefill-0": "ready",
            new: "pending",
        }
        since = clock.now_s
        for _ in range(3):  # one at a time
            clock.now_s += GRACE_S / 4
            inst.tick(["q"], waiting)
            assert _listed(c) == listed
        clock.now_s = since + GRACE_S
        inst.tick(["q"], waiting)
        assert inst.removed == {"q-decode-0"}
        waiting = {new: ["q-decode-1", "q-prefill-0"]}
        inst.tick(["q"], waiting)
        # With one decode instance left, either loss stops the pool: the first by name.
        assert [n for n in old if inst.draining(n)] == ["q-decode-1"]
        assert _listed(c)["q-prefill-0"] == "ready"
        assert inst.phases["q"] == (
            "rolling_out",
            "0 of 1 instances committed; 1 retiring; 1 draining",
        )
    finally:
        asyncio.run(c.stop())
        store.close()


def test_controller_run_takes_the_drain_grace_and_port_bases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from controlplane.cli import build_parser, main

    flags = ["--drain-grace", "5", "--engine-base-port", "41000", "--bootstrap-base-port", "42000"]
    args = build_parser().parse_args(["controller", "run", *flags])
    assert (args.drain_grace, args.engine_base_port, args.bootstrap_base_port) == (
        5.0,
        41000,
        42000,
    )
    defaults = build_parser().parse_args(["controller", "run"])
    settings = ControllerSettings()
    assert defaults.drain_grace == settings.drain_grace_s == 30.0
    assert defaults.engine_base_port == settings.engine_base_port == ENGINE_BASE_PORT
    assert defaults.bootstrap_base_port == settings.bootstrap_base_port == BOOTSTRAP_BASE_PORT

    store = f"sqlite:{tmp_path / 'state.db'}"
    argv = ["controller", "run", "--insecure", "--store", store, "--store-new"]
    assert main([*argv, "--engine-base-port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --engine-base-port: 70000 is not a TCP port (1-65535)"]
    assert main([*argv, "--drain-grace", "-1"]) == 2
    assert "--drain-grace" in capsys.readouterr().err
    assert not (tmp_path / "state.db").exists()  # refused before the store was opened
