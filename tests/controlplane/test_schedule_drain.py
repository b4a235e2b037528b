"""The graceful drain end to end: a real in-process controller (SQLite store, gRPC) and fake
agents. A low-priority deployment holds every node; a higher-priority one is assigned one of
them and waits until the holder committed a plan without it - and then goes on by itself,
without any unrelated change waking it up."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import grpc
from agent_fakes import FakeAgent, small_fleet_doc, wait_until
from mixfleet.v1 import plan_pb2, plan_pb2_grpc
from test_schedule_e2e import BASE

from apis.wire.deployment import spec_to_proto
from controlplane.server.inprocess import start_controller
from controlplane.store import Store
from policies.hardware.fleet import parse_fleet
from policies.hardware.inventory import NodeInventory, inventory_from_node


def _h100_inventories(nodes: int) -> list[NodeInventory]:
    """``nodes`` nodes of two H100 each in one NVLink domain: a deployment gains throughput
    from every node, so the first one applied takes them all."""
    doc = small_fleet_doc(nodes)
    for n in doc["spec"]["nodes"]:
        n["gpus"][0]["model"] = "H100-SXM5-80GB"
        n["nvlink"]["domain"] = "d0"
    return [inventory_from_node(n) for n in parse_fleet(doc).nodes]


def _ready_nodes(store: Store, name: str) -> tuple[str, ...]:
    """The nodes of the deployment's committed plan once it is ready, else ()."""
    d = store.get_deployment(name)
    if d is None or d.status.get("phase") != "ready" or d.committed_version is None:
        return ()
    return tuple(d.status.get("nodes") or ())


def test_the_new_deployment_starts_once_the_holder_committed_without_its_node(
    tmp_path: Path,
) -> None:
    big = replace(BASE, name="big", priority=1, min_gpus=2, max_gpus=6)
    small = replace(BASE, name="small", priority=2, min_gpus=2, max_gpus=2)

    async def main() -> None:
        async with start_controller(tmp_path) as ctl:
            agents = [FakeAgent(ctl.address, inv) for inv in _h100_inventories(3)]
            for a in agents:
                await a.start()
            store = ctl.controller.store
            try:
                async with grpc.aio.insecure_channel(ctl.address) as ch:
                    plans = plan_pb2_grpc.PlanServiceStub(ch)
                    await plans.ApplyDeployment(
                        plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(big))
                    )
                    await wait_until(
                        lambda: len(_ready_nodes(store, "big")) == 3,
                        timeout_s=60,
                        what="big ready on all three nodes",
                    )
                    await plans.ApplyDeployment(
                        plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(small))
                    )
                    # The holder re-plans without the node it gives up and commits; then
                    # the waiting deployment is decided again, plans and becomes ready.
                    await wait_until(
                        lambda: len(_ready_nodes(store, "small")) == 1,
                        timeout_s=60,
                        what="small ready after big drained its node",
                    )
                    mine = set(_ready_nodes(store, "small"))
                    assert not mine & set(_ready_nodes(store, "big"))
                    assert len(_ready_nodes(store, "big")) == 2
            finally:
                for a in agents:
                    await a.stop()

    asyncio.run(main())
