"""``mixfleetctl schedule show|explain``, ``deploy get`` and ``nodes show`` against a real
in-process controller (SQLite, gRPC, fake agents): the fleet scheduler's assignment as the
gRPC Deployment status carries it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from agent_fakes import controller_in_thread, small_inventories, wait_until
from cli_builders import RunCli, cli_runner
from test_schedule_e2e import SPECS

from controlplane.server.inprocess import RunningController

#: A fourth deployment, lowest priority: three 2-GPU nodes, three placed, it stays Pending.
EXTRA = replace(SPECS["low"], name="extra", priority=0)


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    return cli_runner(capsys)


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[RunningController]:
    """A controller with three fake agents and four deployments, on a thread's loop."""

    async def setup(ctl: RunningController) -> None:
        for spec in (*SPECS.values(), EXTRA):
            ctl.controller.apply_deployment(spec)
        store = ctl.controller.store

        def settled() -> bool:
            deps = [store.get_deployment(n) for n in (*SPECS, "extra")]
            return all(
                d is not None and "scheduling" in d.status and d.status.get("phase") == want
                for d, want in zip(deps, ("ready", "ready", "ready", "pending"), strict=True)
            )

        await wait_until(settled, timeout_s=30, what="three ready, extra pending")

    yield from controller_in_thread(tmp_path, small_inventories(3), setup, ready_timeout_s=60)


def test_show_reads_the_controllers_assignment(
    controller: RunningController, run_cli: RunCli
) -> None:
    addr = ["--controller", controller.address]
    code, out, err = run_cli("schedule", "show", *addr, "-o", "json")
    assert code == 0, err
    doc = json.loads(out)
    placed = {p["deployment"]: p for p in doc["placements"]}
    assert list(placed) == ["high", "mid", "low"]  # by priority
    nodes = [n for p in placed.values() for n in p["nodes"]]
    assert sorted(nodes) == ["n0", "n1", "n2"]  # disjoint, all used
    assert all(p["gpus"] == 2 and p["tokensPerS"] > 0 for p in placed.values())
    store = controller.controller.store
    for name, p in placed.items():  # the same as the store's record
        d = store.get_deployment(name)
        assert d is not None and p["nodes"] == d.status["assigned_nodes"]
    assert doc["freeNodes"] == [] and doc["freeGpus"] == 0 and doc["scheduled"] is True
    (pend,) = doc["pending"]
    assert pend["deployment"] == "extra" and pend["resource"] == "gpus"
    assert pend["missing"] == 2 and pend["unit"] == "GPUs"
    assert "held by" in pend["reason"]

    code, out, _ = run_cli("schedule", "show", *addr, "-o", "yaml")
    assert code == 0 and yaml.safe_load(out) == doc
    code, out, _ = run_cli("schedule", "show", *addr)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "deployment",
        "priority",
        "objective",
        "nodes",
        "GPUs",
        "tokens/s",
        "state",
    ]
    assert any(line.startswith("extra") and "Pending" in line for line in lines)
    assert "free: 0 nodes, 0 GPUs (none)" in out
    assert f"pending extra (0): {pend['reason']}" in out


def test_explain_deploy_get_and_nodes_show(controller: RunningController, run_cli: RunCli) -> None:
    addr = ["--controller", controller.address]
    store = controller.controller.store
    high = store.get_deployment("high")
    assert high is not None
    mine = high.status["assigned_nodes"]
    code, out, err = run_cli("schedule", "explain", "high", *addr, "-o", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["nodes"] == mine and doc["gpus"] == 2 and doc["placed"]
    assert doc["reason"] == high.status["scheduling"]["reason"]
    assert doc["resolvedHere"]["sameAsController"]
    # next best: high forbidden from its own node takes another one
    nb = doc["resolvedHere"]["nextBest"]
    assert nb["nodes"] and nb["nodes"] != mine
    code, out, _ = run_cli("schedule", "explain", "high", *addr)
    assert code == 0 and out.startswith(f"high: {mine[0]} (2 GPUs)")
    assert "next best: high on" in out

    code, _, err = run_cli("schedule", "explain", "nope", *addr)
    assert code != 0 and "no deployment 'nope'" in err and "extra, high, low, mid" in err

    code, out, _ = run_cli("deploy", "get", *addr)
    assert code == 0 and "ASSIGNED" in out.splitlines()[0]
    row = next(line for line in out.splitlines() if line.startswith("high "))
    assert f"2 GPUs on {mine[0]}" in row
    code, out, _ = run_cli("deploy", "get", "high", *addr, "-o", "json")
    st = json.loads(out)["status"]
    assert st["assignedNodes"] == mine and st["scheduling"]["placed"] is True

    code, out, _ = run_cli("nodes", "show", mine[0], *addr)
    assert code == 0 and "assignedTo: [high]" in out


def test_offline_flags_are_checked(run_cli: RunCli, tmp_path: Path) -> None:
    code, _, err = run_cli("schedule", "show", "--fleet", str(tmp_path / "f.yaml"))
    assert code != 0 and "-f DEPLOYMENTS.yaml" in err


def test_without_a_recorded_schedule_the_show_says_so() -> None:
    """A controller whose scheduler is off (or in Kubernetes mode) records no schedule."""
    from mixfleet.v1 import plan_pb2

    from controlplane.cli.schedule_live import live_document

    d = plan_pb2.Deployment(
        spec=plan_pb2.DeploymentSpec(name="mx", priority=3),
        status=plan_pb2.DeploymentStatus(
            phase=plan_pb2.DEPLOYMENT_PHASE_READY, message="", nodes=["n0"]
        ),
    )
    n = plan_pb2.NodeRecord(health=plan_pb2.NODE_HEALTH_READY, healthy_gpus=2)
    n.inventory.node = "n0"
    doc = live_document([d], [n])
    assert doc["scheduled"] is False and doc["placements"] == []
    (p,) = doc["pending"]
    assert p["deployment"] == "mx" and p["reason"] == "not scheduled yet"
    assert doc["freeNodes"] == ["n0"] and doc["freeGpus"] == 2
