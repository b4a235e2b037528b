"""EngineService.WatchInstances and ReportTraffic against a real controller on loopback gRPC
with real SQLite: instances follow records, commits and node addresses; reports are checked
field by field; a sustained demand shift changes what a planned deployment is planned for,
and that survives a restart."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from agent_fakes import FakeAgent, small_inventories, wait_until
from mixfleet.v1 import agent_pb2, agent_pb2_grpc, engine_pb2, engine_pb2_grpc

from apis.wire.inventory import inventory_to_proto
from controlplane.server.controller.demand import DEMAND_KEY, DemandStatus
from controlplane.server.controller.endpoints import engine_url
from controlplane.server.controller.instance_records import (
    ENGINE_BASE_PORT,
    INSTANCE_KEY,
    INSTANCES_KEY,
    InstanceRecord,
)
from controlplane.server.inprocess import start_controller
from controlplane.store import Store
from policies.errors import InputError
from policies.estimate.engines import EngineSpec
from policies.hardware.fleet import parse_fleet
from policies.hardware.inventory import NodeInventory, inventory_from_node
from policies.limits import check_host_address
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec.build import DeploymentSpec, WorkloadSpec

ENGINE_TOKEN = "engine-token-0123456789abcdef"
VIEWER_TOKEN = "viewer-token-0123456789abcdef"
ADDRESSES = {"n0": "fd00::10", "n1": "10.0.0.11", "n2": "gpu-2.example.net"}
AGGREGATED = DeploymentSpec(
    name="mx",
    model="mixtral-8x7b",
    policy="greedy",
    workload=WorkloadSpec(tokens_per_gpu=32, context_len=2048),
    engine=EngineSpec("vllm"),
    prepare_timeout_s=5.0,
)
TRAFFIC = Traffic(10.0, LengthDist(1000, 1500), LengthDist(200, 300))
PLANNED = DeploymentSpec(
    "p",
    model="mixtral-8x7b",
    engine=EngineSpec("sglang"),
    traffic=TRAFFIC,
    slo=Slo(ttft_ms=1000, tpot_ms=50),
)
T0 = 1_800_000_000.0


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


class Stream:
    """The messages of one WatchInstances call, read one at a time."""

    def __init__(self, engine: engine_pb2_grpc.EngineServiceStub, deployment: str) -> None:
        stub = cast("engine_pb2_grpc.EngineServiceAsyncStub", engine)
        self.call = stub.WatchInstances(engine_pb2.GetInstancesRequest(deployment=deployment))
        self._it: AsyncIterator[engine_pb2.Instances] = aiter(self.call)

    def close(self) -> None:
        self.call.cancel()

    async def next(self) -> engine_pb2.Instances:
        return await asyncio.wait_for(self._it.__anext__(), timeout=30.0)

    async def until(self, ok: Any, what: str) -> engine_pb2.Instances:
        """The first message (of those still to come) that ``ok`` accepts."""
        for _ in range(50):
            msg = await self.next()
            if ok(msg):
                return msg
        raise AssertionError(f"no message with {what}")


def _record(of: str, role: str, nodes: tuple[str, ...], port: int, **more: Any) -> InstanceRecord:
    return InstanceRecord(of, role, f"{of}-pool-0", f"1x (2x H100)/{role}", nodes, port, **more)


def test_an_aggregated_deployment_lists_itself_and_follows_commits_and_addresses(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with start_controller(tmp_path) as ctl, grpc.aio.insecure_channel(ctl.address) as ch:
            inventories = [replace(i, address=ADDRESSES[i.node]) for i in small_inventories()]
            agents = [FakeAgent(ctl.address, inv) for inv in inventories]
            for a in agents:
                await a.start()
            try:
                ctl.controller.apply_deployment(AGGREGATED)
                watch = Stream(engine_pb2_grpc.EngineServiceStub(ch), "mx")
                first = await watch.next()
                assert first.deployment == "mx" and first.engine == "vllm"
                assert (first.slo_ttft_ms, first.slo_percentile) == (0, 0)  # no spec.slo
                ready = first
                if not first.instances[0].ready:  # usually: nothing committed yet
                    (pending,) = first.instances
                    assert pending.role == "aggregated" and pending.version == 0
                    ready = await watch.until(lambda m: m.instances[0].ready, "a commit")
                    assert ready.generation > first.generation
                (inst,) = ready.instances
                assert inst.name == "mx" and inst.version >= 1 and not inst.draining
                node = inst.nodes[0]
                assert inst.url == engine_url(ADDRESSES[node], ENGINE_BASE_PORT)

                agent = next(a for a in agents if a.node == node)
                agent.inventory = replace(agent.inventory, address="192.0.2.7")
                await agent.register()
                moved = await watch.until(lambda m: "192.0.2.7" in m.instances[0].url, "address")
                assert moved.instances[0].url == f"http://192.0.2.7:{ENGINE_BASE_PORT}"
                assert moved.generation > ready.generation
                watch.close()
            finally:
                for a in agents:
                    await a.stop()

    run(main())


def test_a_planned_deployment_lists_its_instance_records(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            start_controller(tmp_path, run_loop=False) as ctl,
            grpc.aio.insecure_channel(ctl.address) as ch,
        ):
            c, store = ctl.controller, ctl.controller.store
            agent = agent_pb2_grpc.AgentServiceStub(ch)
            for inv in small_inventories():
                address = ADDRESSES[inv.node] if inv.node != "n2" else ""
                req = agent_pb2.RegisterRequest(
                    inventory=inventory_to_proto(replace(inv, address=address))
                )
                await agent.Register(req)
            store.put_deployment(PLANNED, now_s=c.clock())
            engine = engine_pb2_grpc.EngineServiceStub(ch)
            watch = Stream(engine, "p")
            empty = await watch.next()
            assert list(empty.instances) == []  # planned, nothing written yet
            assert (empty.slo_ttft_ms, empty.slo_tpot_ms, empty.slo_percentile) == (1000, 50, 90)

            records = {
                "p-prefill-0": _record("p", "prefill", ("n0",), 30000, bootstrap_port=8998),
                "p-decode-0": _record(
                    "p", "decode", ("n2", "n1"), 30001, requests_per_s=10.0, batch_limit=64
                ),
            }
            for name, r in records.items():
                store.put_deployment(replace(AGGREGATED, name=name), now_s=c.clock())
                store.set_deployment_status(name, {INSTANCE_KEY: r.to_status()})
            store.set_deployment_status("p", {INSTANCES_KEY: sorted(records)})
            c.changed("p")
            msg = await watch.until(lambda m: len(m.instances) == 2, "two instances")
            assert msg.engine == "sglang"
            decode, prefill = msg.instances  # by name
            assert prefill.url == "http://[fd00::10]:30000" and prefill.bootstrap_port == 8998
            assert decode.url == "http://n2:30001"  # n2 advertises no address: its name
            assert list(decode.nodes) == ["n2", "n1"] and decode.role == "decode"
            assert decode.requests_per_s == 10.0 and decode.batch_limit == 64
            assert decode.pool == "p-pool-0" and decode.variant == "1x (2x H100)/decode"
            assert not decode.ready and decode.version == 0  # nothing committed

            drained = replace(records["p-decode-0"], draining=True)
            store.set_deployment_status("p-decode-0", {INSTANCE_KEY: drained.to_status()})
            c.changed("p-decode-0")
            msg2 = await watch.until(lambda m: m.instances[0].draining, "a draining instance")
            assert msg2.generation > msg.generation and not msg2.instances[0].ready
            watch.close()

            unknown = Stream(engine, "nope")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await unknown.next()
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert "deployment" in (err.value.details() or "")

    run(main())


def test_watch_instances_and_report_traffic_need_the_engine_role(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ENGINE_TOKEN} engine eng\n{VIEWER_TOKEN} viewer dash\n")

    async def main() -> None:
        async with (
            start_controller(tmp_path, token_file=tokens, run_loop=False) as ctl,
            grpc.aio.insecure_channel(ctl.address) as ch,
        ):
            ctl.controller.store.put_deployment(AGGREGATED, now_s=ctl.controller.clock())
            engine = engine_pb2_grpc.EngineServiceStub(ch)
            req = engine_pb2.GetInstancesRequest(deployment="mx")
            denied = engine.WatchInstances(
                req, metadata=(("authorization", f"Bearer {VIEWER_TOKEN}"),)
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await denied.read()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            ok = engine.WatchInstances(req, metadata=(("authorization", f"Bearer {ENGINE_TOKEN}"),))
            msg = await ok.read()
            assert isinstance(msg, engine_pb2.Instances) and msg.instances[0].name == "mx"
            ok.cancel()
            report = engine_pb2.TrafficReport(
                deployment="mx", reporter="r", start_unix_s=1.0, end_unix_s=2.0
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await engine.ReportTraffic(
                    report, metadata=(("authorization", f"Bearer {VIEWER_TOKEN}"),)
                )
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

    run(main())


def _report(start_s: float, rps: float, reporter: str = "r0", **changes: Any) -> Any:
    fields: dict[str, Any] = {
        "deployment": "p",
        "reporter": reporter,
        "start_unix_s": start_s,
        "end_unix_s": start_s + 10.0,
        "requests": round(rps * 10),
        "input_tokens_mean": 2000.0,
        "input_tokens_p90": 3000.0,
        "output_tokens_mean": 400.0,
        "output_tokens_p90": 600.0,
        "ttft_ms_p50": 300.0,
        "ttft_ms_p99": 900.0,
        "tpot_ms_p50": 20.0,
        "tpot_ms_p99": 45.0,
        "slo_judged": 10,
        "slo_met": 9,
    }
    fields.update(changes)
    return engine_pb2.TrafficReport(**fields)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"reporter": ""}, "reporter"),
        ({"end_unix_s": T0}, "end_unix_s"),
        ({"end_unix_s": T0 + 3600.0}, "end_unix_s"),  # over the longest window
        ({"start_unix_s": math.nan}, "start_unix_s"),
        ({"input_tokens_mean": -1.0}, "input_tokens_mean"),
        ({"output_tokens_p90": math.inf}, "output_tokens_p90"),
        ({"ttft_ms_p99": 1.0}, "ttft_ms_p99"),
        ({"tpot_ms_p50": math.nan}, "tpot_ms_p50"),
        ({"requests": 2**63}, "requests"),
        ({"slo_judged": 2, "slo_met": 3}, "slo_met"),
    ],
)
def test_a_malformed_report_is_invalid_argument_naming_its_field(
    tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    async def main() -> None:
        async with (
            start_controller(tmp_path, run_loop=False, clock=lambda: T0 + 20.0) as ctl,
            grpc.aio.insecure_channel(ctl.address) as ch,
        ):
            ctl.controller.store.put_deployment(PLANNED, now_s=T0)
            engine = engine_pb2_grpc.EngineServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await engine.ReportTraffic(_report(T0, 1.0, **change))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith(f"{field}: ")

    run(main())


def test_report_traffic_unknown_deployment_and_old_windows(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            start_controller(tmp_path, run_loop=False, clock=lambda: T0 + 20.0) as ctl,
            grpc.aio.insecure_channel(ctl.address) as ch,
        ):
            ctl.controller.store.put_deployment(PLANNED, now_s=T0)
            engine = engine_pb2_grpc.EngineServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await engine.ReportTraffic(_report(T0, 1.0, deployment="nope"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert (await engine.ReportTraffic(_report(T0, 1.0))).accepted
            assert not (await engine.ReportTraffic(_report(T0 - 86_400.0, 1.0))).accepted

    run(main())


def test_a_sustained_shift_replans_once_and_survives_a_restart(tmp_path: Path) -> None:
    now = [T0]

    async def main() -> None:
        async with (
            start_controller(tmp_path, run_loop=False, clock=lambda: now[0]) as ctl,
            grpc.aio.insecure_channel(ctl.address) as ch,
        ):
            c, store = ctl.controller, ctl.controller.store
            store.put_deployment(PLANNED, now_s=T0)
            engine = engine_pb2_grpc.EngineServiceStub(ch)

            async def feed(start_s: float, seconds: float, rps: float) -> None:
                t = start_s
                while t < start_s + seconds:
                    now[0] = t + 11.0
                    for k in range(2):  # two routers, each half the traffic
                        r = await engine.ReportTraffic(_report(t, rps / 2, reporter=f"router-{k}"))
                        assert r.accepted
                    t += 10.0

            def planned_rps() -> float:
                d = store.get_deployment("p")
                assert d is not None
                return c.scheduler.instances.traffic_for(d).requests_per_s

            await feed(T0, 120.0, 10.0)
            assert planned_rps() == 10.0
            await feed(T0 + 120.0, 30.0, 30.0)  # a 30 s blip
            await feed(T0 + 150.0, 60.0, 10.0)
            assert planned_rps() == 10.0
            await feed(T0 + 210.0, 60.0, 30.0)  # sustained
            assert planned_rps() == pytest.approx(30.0)
            await feed(T0 + 270.0, 120.0, 90.0)  # again, within the min interval
            assert planned_rps() == pytest.approx(30.0)
            d = store.get_deployment("p")
            assert d is not None
            st = DemandStatus.from_status(d.status)
            assert st.replans == 1 and "above the planned 10 requests/s" in st.last_replan_reason
            assert st.measured is not None and st.measured.requests_per_s == pytest.approx(90.0)
            assert st.measured.reporters == 2 and st.measured.ttft_ms_p99 == 900.0
            assert st.measured.slo_attainment == pytest.approx(0.9)  # 9 of 10 per window

        async with start_controller(tmp_path, run_loop=False, clock=lambda: now[0]) as ctl2:
            d = ctl2.controller.store.get_deployment("p")
            assert d is not None and DEMAND_KEY in d.status
            assert ctl2.controller.scheduler.instances.traffic_for(d).requests_per_s == (
                pytest.approx(30.0)
            )
            st = DemandStatus.from_status(d.status)
            assert st.replans == 1 and st.last_replan_s is not None

    run(main())


def test_an_advertised_address_is_a_host_name_or_an_ip(tmp_path: Path) -> None:
    for good in ("10.1.2.3", "fd00::1", "gpu-0.rack-1.example.com", "n0"):
        check_host_address(good, "address")
    for bad in ("", "[fd00::1]", "10.0.0.1:8000", "-lead", "a..b", "x" * 254, "sp ace"):
        with pytest.raises(InputError):
            check_host_address(bad, "address")

    async def main() -> None:
        async with (
            start_controller(tmp_path, run_loop=False) as ctl,
            grpc.aio.insecure_channel(ctl.address) as ch,
        ):
            inv = replace(small_inventories()[0], address="http://n0")
            req = agent_pb2.RegisterRequest(inventory=inventory_to_proto(inv))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await agent_pb2_grpc.AgentServiceStub(ch).Register(req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith("inventory.address: ")

    run(main())


QWEN = DeploymentSpec(
    "q",
    model="qwen3-30b-a3b",
    policy="greedy",
    workload=WorkloadSpec(kv_cache_dtype="fp8"),
    engine=EngineSpec("sglang"),
    traffic=Traffic(50.0, LengthDist(4096, 5120), LengthDist(512, 640)),
    slo=Slo(ttft_ms=2000, tpot_ms=50, percentile=90),
    prepare_timeout_s=10.0,
)


def _h100_nodes() -> list[NodeInventory]:
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


def _ready(store: Store, roles: dict[str, int]) -> bool:
    """q is ready with exactly ``roles`` (role -> count) of live instances, each committed."""
    q = store.get_deployment("q")
    if q is None or q.status.get("phase") != "ready":
        return False
    got: dict[str, int] = {}
    for d in store.list_deployments():
        r = InstanceRecord.from_status(d.status)
        if r is None or r.draining:
            continue
        if d.committed_version is None or d.status.get("phase") != "ready":
            return False
        got[r.role] = got.get(r.role, 0) + 1
    return got == roles


def test_a_measured_demand_shift_adds_instances_end_to_end(tmp_path: Path) -> None:
    """Qwen3-30B-A3B stated at 5 requests/s runs as one aggregated instance on three 4-GPU
    H100 nodes; two routers then report 50 requests/s for a minute: the controller plans for
    the measured demand and adds a prefill/decode pool, WatchInstances lists the new
    instances, and the spec still says 5."""
    assert QWEN.traffic is not None
    spec = replace(QWEN, traffic=replace(QWEN.traffic, requests_per_s=5.0))

    async def main() -> None:
        async with start_controller(tmp_path) as ctl, grpc.aio.insecure_channel(ctl.address) as ch:
            agents = [FakeAgent(ctl.address, inv) for inv in _h100_nodes()]
            for a in agents:
                await a.start()
            try:
                store = ctl.controller.store
                ctl.controller.apply_deployment(spec)
                await wait_until(
                    lambda: _ready(store, {"aggregated": 1}), timeout_s=120, what="q on one"
                )
                engine = engine_pb2_grpc.EngineServiceStub(ch)
                end = math.floor(ctl.controller.clock() / 10.0) * 10.0
                for k in range(6):  # the last minute at 50 requests/s, from two routers
                    for router in ("router-0", "router-1"):
                        start = end - 60.0 + 10.0 * k
                        report = _report(
                            start,
                            25.0,
                            router,
                            deployment="q",
                            input_tokens_mean=4096.0,
                            input_tokens_p90=5120.0,
                            output_tokens_mean=512.0,
                            output_tokens_p90=640.0,
                        )
                        assert (await engine.ReportTraffic(report)).accepted
                await wait_until(
                    lambda: _ready(store, {"aggregated": 1, "prefill": 1, "decode": 1}),
                    timeout_s=120,
                    what="q on three instances",
                )
                q = store.get_deployment("q")
                assert q is not None and q.spec.traffic is not None
                assert q.spec.traffic.requests_per_s == 5.0
                demand = DemandStatus.from_status(q.status)
                assert demand.replans == 1 and demand.planned is not None
                assert demand.planned.requests_per_s == pytest.approx(50.0)
                watch = Stream(engine, "q")
                msg = await watch.until(lambda m: len(m.instances) == 3, "three instances")
                assert sorted(i.role for i in msg.instances) == ["aggregated", "decode", "prefill"]
                assert all(i.ready and i.url for i in msg.instances)
                watch.close()
            finally:
                for a in agents:
                    await a.stop()

    run(main())
