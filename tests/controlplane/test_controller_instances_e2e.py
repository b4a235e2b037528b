"""A deployment with traffic and SLOs runs as several engine instances, end to end: a real
in-process controller (SQLite store, gRPC on loopback) and fake agents
(tests/controlplane/agent_fakes.py) on three 4-GPU H100 nodes.

Qwen3-30B-A3B (SGLang) at 50 requests/s is planned as a prefill/decode pool (one prefill,
two decode instances, one node each): each instance has its own committed plan and the agents
hold its parts; the deployment is Ready. Applying an instance's name is refused. A restart
keeps names and ports and rolls nothing out. At 5 requests/s one aggregated instance serves
it on a node a decode instance held (the fleet is full): that decode instance drains first,
alone, and is removed after the drain grace; the other two retire - WatchInstances keeps
listing them ready - until the new one is committed, then drain and are removed after the
grace. Planned for 50 requests/s again (the traffic hook) instances are added; deleting the
deployment removes every part from the agents."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from agent_fakes import FakeAgent, wait_until
from mixfleet.v1 import engine_pb2, engine_pb2_grpc, plan_pb2, plan_pb2_grpc

from apis.wire.deployment import spec_to_proto
from controlplane.server.controller.instance_records import (
    BOOTSTRAP_BASE_PORT,
    ENGINE_BASE_PORT,
    INSTANCES_KEY,
    InstanceRecord,
)
from controlplane.server.inprocess import FAST, start_controller
from controlplane.store import Store
from policies.estimate.engines import EngineSpec
from policies.hardware.fleet import parse_fleet
from policies.hardware.inventory import NodeInventory, inventory_from_node
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec.build import DeploymentSpec, WorkloadSpec

SPEC = DeploymentSpec(
    "q",
    model="qwen3-30b-a3b",
    policy="greedy",
    workload=WorkloadSpec(kv_cache_dtype="fp8"),
    engine=EngineSpec("sglang"),
    traffic=Traffic(50.0, LengthDist(4096, 5120), LengthDist(512, 640)),
    slo=Slo(ttft_ms=2000, tpot_ms=50, percentile=90),
    disaggregation="auto",
    prepare_timeout_s=10.0,
)


#: Drain grace of the test's controller, s: long enough for the test to see the drains.
GRACE_S = 1.0
SETTINGS = replace(FAST, drain_grace_s=GRACE_S)


def _inventories() -> list[NodeInventory]:
    """Three nodes of four H100 with one 400 Gb/s InfiniBand NIC each."""
    nodes = [
        {
            "name": f"h{i}",
            "gpus": [{"model": "H100-SXM5-80GB", "count": 4}],
            "nvlink": {"per_gpu_bidir_gbytes_per_s": 900},
            "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib"}],
        }
        for i in range(3)
    ]
    fleet = parse_fleet({"metadata": {"name": "f"}, "spec": {"nodes": nodes}})
    return [inventory_from_node(n) for n in fleet.nodes]


def _at(rps: float) -> DeploymentSpec:
    assert SPEC.traffic is not None
    return replace(SPEC, traffic=replace(SPEC.traffic, requests_per_s=rps))


def _records(store: Store) -> dict[str, InstanceRecord]:
    """Every live instance's record, by name."""
    out = {}
    for d in store.list_deployments():
        r = InstanceRecord.from_status(d.status)
        if r is not None:
            out[d.name] = r
    return out


def _committed(store: Store, name: str) -> bool:
    d = store.get_deployment(name)
    return d is not None and d.committed_version is not None and d.status.get("phase") == "ready"


def _ready(store: Store, roles: dict[str, int]) -> bool:
    """q is Ready with exactly ``roles`` (role -> count) of live instances, each committed."""
    q = store.get_deployment("q")
    if q is None or q.status.get("phase") != "ready":
        return False
    live = {n: r for n, r in _records(store).items() if not r.draining}
    got: dict[str, int] = {}
    for r in live.values():
        got[r.role] = got.get(r.role, 0) + 1
    return got == roles and all(_committed(store, n) for n in live)


def _held(agents: dict[str, FakeAgent]) -> dict[str, list[str]]:
    return {node: sorted(a.applied) for node, a in agents.items()}


async def _apply(address: str, spec: DeploymentSpec) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        plans = plan_pb2_grpc.PlanServiceStub(ch)
        await plans.ApplyDeployment(
            plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(spec)), wait_for_ready=True
        )


async def _first_plan(address: str, store: Store, agents: dict[str, FakeAgent]) -> None:
    """50 requests/s: one prefill and two decode instances, each on its own node, committed
    and held by its node's agent; ports from the bases; an instance name is refused."""
    await _apply(address, SPEC)
    await wait_until(
        lambda: _ready(store, {"prefill": 1, "decode": 2}), timeout_s=120, what="q Ready"
    )
    recs = _records(store)
    assert sorted(recs) == ["q-decode-0", "q-decode-1", "q-prefill-0"]
    assert sorted(r.port for r in recs.values()) == [ENGINE_BASE_PORT + i for i in range(3)]
    assert recs["q-prefill-0"].bootstrap_port == BOOTSTRAP_BASE_PORT
    assert recs["q-decode-0"].bootstrap_port == 0
    assert sorted(n for r in recs.values() for n in r.nodes) == ["h0", "h1", "h2"]
    for name, r in recs.items():
        assert r.of == "q" and r.requests_per_s > 0 and r.batch_limit > 0
        inst = store.get_deployment(name)
        assert inst is not None and inst.spec.traffic is None  # planned as one engine
        assert inst.status["assigned_nodes"] == list(r.nodes)
        plan = store.committed_plan(name)
        assert plan is not None and set(plan.nodes) <= set(r.nodes)
    await wait_until(
        lambda: all(_held(agents)[r.nodes[0]] == [n] for n, r in recs.items()),
        what="each agent holds its instance's part",
    )
    q = store.get_deployment("q")
    assert q is not None and q.committed_version is None  # never solved as one engine
    assert q.status[INSTANCES_KEY] == sorted(recs)
    summary = q.status["fleet_plan"]
    assert summary["served_requests_per_s"] == pytest.approx(50.0, rel=1e-3)
    assert summary["shortfalls"] == [] and summary["gpus"] == 12
    async with grpc.aio.insecure_channel(address) as ch:
        plans = plan_pb2_grpc.PlanServiceStub(ch)
        own = replace(SPEC, name="q-decode-0", traffic=None, slo=None)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await plans.ApplyDeployment(plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(own)))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "an instance of q, written by the controller: change q" in str(err.value.details())


def _snapshot(store: Store) -> dict[str, Any]:
    """Names, ports and plan versions of every instance."""
    return {
        n: (r.port, r.bootstrap_port, r.nodes, [p.version for p in store.list_plans(n)])
        for n, r in _records(store).items()
    }


def _check_routers_saw(
    messages: list[engine_pb2.Instances],
    name: str,
    others: list[str],
    blocker: str,
    before: set[str],
) -> None:
    """What routers saw while ``before`` shrank to the new instance ``name``: until it was
    ready, the ``others`` were ready and not draining in every message, and only the
    ``blocker`` ever drained; in the end every instance of ``before`` drained."""
    agg_ready = False
    seen_draining: set[str] = set()
    for msg in messages:
        listed = {i.name: i for i in msg.instances}
        agg_ready = agg_ready or (name in listed and listed[name].ready)
        seen_draining |= {n for n, i in listed.items() if i.draining}
        if not agg_ready:
            assert all(listed[n].ready and not listed[n].draining for n in others), msg
            if name in listed:  # planned: the ones it replaces are marked retiring
                assert all(listed[n].retiring for n in others), msg
            assert seen_draining <= {blocker}, msg
    assert seen_draining == before


async def _shrink(store: Store, address: str, agents: dict[str, FakeAgent]) -> None:
    """5 requests/s: one aggregated instance on the node of a decode instance (the fleet is
    full). The decode instance it needs drains first, alone; the other two keep serving -
    WatchInstances lists them ready, not draining - until the new one is committed, then
    drain; each is removed once the grace has passed since it began draining."""
    before = _records(store)
    messages: list[engine_pb2.Instances] = []

    async def watch() -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            engines = engine_pb2_grpc.EngineServiceStub(ch)
            req = engine_pb2.GetInstancesRequest(deployment="q")
            async for msg in engines.WatchInstances(req, wait_for_ready=True):
                messages.append(msg)

    watcher = asyncio.create_task(watch())
    await wait_until(lambda: bool(messages), what="the first WatchInstances message")
    await _apply(address, _at(5.0))
    states: dict[str, list[str]] = {n: [] for n in before}

    def progress() -> bool:
        recs = _records(store)
        for n, seen in states.items():
            r = recs.get(n)
            now = "removed" if r is None else "draining" if r.draining else "retiring"
            if r is not None and not r.dropped:
                now = "live"
            if not seen or seen[-1] != now:
                seen.append(now)
        new = [n for n, r in recs.items() if r.role == "aggregated"]
        agg = store.get_deployment(new[0]) if new else None
        if agg is not None and agg.committed_version is None:
            # Invariant: before the new instance commits, at most one old instance drains
            # (or is gone), and it is the one whose node the new instance needs.
            blocker = {n for n in before if set(before[n].nodes) & set(recs[new[0]].nodes)}
            gone = {n for n in before if n not in recs or recs[n].draining}
            assert gone <= blocker and len(blocker) == 1, (gone, blocker)
        return _ready(store, {"aggregated": 1}) and len(recs) == 1

    try:
        await wait_until(progress, timeout_s=120, what="q Ready on one aggregated instance")
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    recs = _records(store)
    ((name, agg),) = recs.items()
    assert name == "q-aggregated-0"
    assert agg.port not in [r.port for n, r in before.items() if set(r.nodes) != set(agg.nodes)]
    (blocker,) = [n for n in before if set(before[n].nodes) & set(agg.nodes)]
    others = sorted(set(before) - {blocker})
    for n in others:  # retired while the new one came up, then drained
        assert [x for x in states[n] if x != "live"] == ["retiring", "draining", "removed"], (
            n,
            states[n],
        )
    assert states[blocker][-2:] == ["draining", "removed"], states[blocker]

    _check_routers_saw(messages, name, others, blocker, set(before))

    want = {n: (["q-aggregated-0"] if n in agg.nodes else []) for n in agents}
    try:
        await wait_until(lambda: _held(agents) == want, what="only the aggregated instance held")
    except AssertionError as exc:
        ev = {n: a.events for n, a in agents.items()}
        raise AssertionError(f"{exc}; held: {_held(agents)}; events: {ev}") from None
    for gone in before:  # removed by the controller's clock once the grace had passed
        d = store.get_deployment(gone, include_deleted=True)
        assert d is not None and d.deleted
        r = InstanceRecord.from_status(d.status)
        assert r is not None and r.draining and r.draining_since_s > 0
        assert d.updated_at_s - r.draining_since_s >= GRACE_S


async def _grow_and_delete(store: Store, ctl: Any, agents: dict[str, FakeAgent]) -> None:
    """Planned for 50 requests/s again - by the traffic hook that demand measurement
    replaces, the spec still says 5: instances are added (the aggregated one keeps its node
    and name); deleting q removes every instance and part."""
    assert SPEC.traffic is not None
    measured = SPEC.traffic
    ctl.controller.scheduler.instances.traffic_for = lambda d: measured
    await wait_until(
        lambda: _ready(store, {"aggregated": 1, "prefill": 1, "decode": 1}),
        timeout_s=120,
        what="q Ready on three instances",
    )
    assert "q-aggregated-0" in _records(store)
    q = store.get_deployment("q")
    assert q is not None and q.spec.traffic is not None and q.spec.traffic.requests_per_s == 5.0
    assert q.status["fleet_plan"]["demand_requests_per_s"] == pytest.approx(50.0)
    assert ctl.controller.delete_deployment("q")
    await wait_until(lambda: all(not a.applied for a in agents.values()), what="every part removed")
    assert _records(store) == {}
    assert [d.name for d in store.list_deployments()] == []


def test_a_planned_deployment_runs_as_instances_that_drain_restart_and_delete(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        cm = start_controller(tmp_path, settings=SETTINGS)
        ctl = await cm.__aenter__()
        port, address = ctl.port, ctl.address
        agents = {a.node: a for a in (FakeAgent(address, inv) for inv in _inventories())}
        for a in agents.values():
            await a.start()
        try:
            store = ctl.controller.store
            await _first_plan(address, store, agents)
            before = _snapshot(store)
            events = {n: len(a.events) for n, a in agents.items()}
            await cm.__aexit__(None, None, None)

            async with start_controller(tmp_path, port=port, settings=SETTINGS) as again:
                s2 = again.controller.store
                await wait_until(
                    lambda: (
                        again.controller.scheduler.instances.plan is not None
                        and _ready(s2, {"prefill": 1, "decode": 2})
                    ),
                    timeout_s=60,
                    what="q Ready again after the restart",
                )
                assert _snapshot(s2) == before  # same names, ports, nodes and versions
                assert all(
                    e[0] != "prepare" for n, a in agents.items() for e in a.events[events[n] :]
                )
                await _shrink(s2, address, agents)
                await _grow_and_delete(s2, again, agents)
        finally:
            for a in agents.values():
                await a.stop()

    asyncio.run(main())
