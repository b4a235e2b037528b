"""Priority orders both kinds of deployment in the standalone controller
(policies.fleetplan.combined.plan_and_schedule), end to end: a real in-process controller
(SQLite store, gRPC on loopback) and fake agents on three 4-GPU H100 nodes.

Qwen3-30B-A3B at 1,000 requests/s (priority 0, planned from its traffic and SLOs) wants every
node; a deployment without traffic of priority 100 that may take one node keeps it: the
planned instances run on the other two, the deployment's fleet plan reports the shortfall
naming it, and each agent holds the part of the one deployment its node serves."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from agent_fakes import FakeAgent, wait_until
from test_controller_instances_e2e import SETTINGS, SPEC, _apply, _inventories, _records

from controlplane.server.inprocess import start_controller
from controlplane.store import Store
from policies.spec.build import DeploymentSpec, WorkloadSpec

assert SPEC.traffic is not None
HUNGRY = replace(SPEC, traffic=replace(SPEC.traffic, requests_per_s=1000.0))
BATCH = DeploymentSpec(
    "batch",
    model="qwen3-30b-a3b",
    policy="greedy",
    workload=WorkloadSpec(phase="decode", tokens_per_gpu=64, context_len=4096),
    priority=100,
    max_gpus=4,
    prepare_timeout_s=10.0,
)


def _settled(store: Store) -> bool:
    """batch holds one node and q's instances the other two."""
    b = store.get_deployment("batch")
    q = store.get_deployment("q")
    if b is None or q is None or "fleet_plan" not in q.status:
        return False
    batch_nodes = set(b.status.get("assigned_nodes") or ())
    planned = {n for r in _records(store).values() for n in r.nodes}
    return len(batch_nodes) == 1 and planned == {"h0", "h1", "h2"} - batch_nodes


def test_a_higher_priority_deployment_without_traffic_keeps_its_node(tmp_path: Path) -> None:
    async def main() -> None:
        async with start_controller(tmp_path, settings=SETTINGS) as ctl:
            agents = [FakeAgent(ctl.address, inv) for inv in _inventories()]
            for a in agents:
                await a.start()
            try:
                store = ctl.controller.store
                await _apply(ctl.address, BATCH)
                await _apply(ctl.address, HUNGRY)
                await wait_until(lambda: _settled(store), timeout_s=120, what="the decision")
                q = store.get_deployment("q")
                assert q is not None
                (short,) = q.status["fleet_plan"]["shortfalls"]
                assert "held by batch" in str(short), short
                b = store.get_deployment("batch")
                assert b is not None and b.status["scheduling"]["placed"]
                (node,) = b.status["assigned_nodes"]
                await wait_until(
                    lambda: [a.node for a in agents if "batch" in a.applied] == [node],
                    timeout_s=120,
                    what="batch's part on its node, and only there",
                )
            finally:
                for a in agents:
                    await a.stop()

    asyncio.run(main())
