"""``mixfleetctl deploy get``: a deployment's engine instances and its demand planned vs
measured, in the table and in ``-o json``; the list names the deployment an instance serves
and counts a deployment's instances. A real controller on loopback gRPC with real SQLite."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from agent_fakes import controller_in_thread, small_inventories

from controlplane.cli import build_parser as parser
from controlplane.server.controller.instance_records import (
    INSTANCE_KEY,
    INSTANCES_KEY,
    InstanceRecord,
)
from controlplane.server.controller.measured import TrafficWindow
from controlplane.server.inprocess import RunningController
from policies.estimate.engines import EngineSpec
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec.build import DeploymentSpec

PLANNED = DeploymentSpec(
    "p",
    model="mixtral-8x7b",
    engine=EngineSpec("vllm"),
    traffic=Traffic(10.0, LengthDist(1000, 1500), LengthDist(200, 300)),
    slo=Slo(ttft_ms=1000, tpot_ms=50),
)
RECORDS = {
    "p-prefill-0": InstanceRecord(
        "p",
        "prefill",
        "pool-0",
        "v/prefill",
        ("n0",),
        30000,
        8998,
        10.0,
        8192,
        12.0,
        380.0,
        retiring=True,  # a newer plan dropped it
    ),
    "p-decode-0": InstanceRecord(
        "p", "decode", "pool-0", "v/decode", ("n1", "n2"), 30001, 0, 10.0, 64, 12.0, 0.0, 31.0
    ),
}


async def _setup(ctl: RunningController) -> None:
    c, store = ctl.controller, ctl.controller.store
    now = c.clock()
    store.put_deployment(PLANNED, now_s=now)
    for name, r in RECORDS.items():
        store.put_deployment(DeploymentSpec(name, model="mixtral-8x7b"), now_s=now)
        store.set_deployment_status(name, {INSTANCE_KEY: r.to_status()})
    fleet_plan = {"ttft_ms": 380.0, "tpot_ms": 31.0}
    store.set_deployment_status("p", {INSTANCES_KEY: sorted(RECORDS), "fleet_plan": fleet_plan})
    end = math.floor(now / 10.0) * 10.0
    for k in range(6):  # 60 s at twice the plan, from two routers
        for router, met in (("r0", 45), ("r1", 35)):  # SLO met by 80 of 100 judged
            start = end - 60.0 + 10.0 * k
            figures = (2000, 3000, 400, 600, 300, 900, 20, 45)
            window = TrafficWindow("p", router, start, start + 10.0, 100, *figures, 50, met)
            c.demands.report(window)


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[RunningController]:
    """A controller (no reconcile loop: the records are the test's) and three fake agents,
    node n0 advertising 10.0.0.5."""
    inventories = small_inventories()
    inventories[0] = replace(inventories[0], address="10.0.0.5")
    yield from controller_in_thread(tmp_path, inventories, setup=_setup, run_loop=False)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    args = parser().parse_args(list(argv))
    assert args.handler(args) == 0
    return capsys.readouterr().out


def test_deploy_get_shows_instances_and_demand(
    controller: RunningController, capsys: pytest.CaptureFixture[str]
) -> None:
    addr = ["--controller", controller.address]
    out = cli(capsys, *addr, "deploy", "get", "p")
    lines = out.splitlines()
    header = next(x for x in lines if x.startswith("INSTANCE"))
    assert header.split() == [
        "INSTANCE",
        "ROLE",
        "POOL",
        "NODES",
        "URL",
        "VERSION",
        "STATE",
        "REQ_PER_S",
        "BATCH",
        "TTFT_MS",
        "TPOT_MS",
    ]
    decode = next(x for x in lines if x.startswith("p-decode-0")).split()
    assert decode == [
        "p-decode-0",
        "decode",
        "pool-0",
        "n1,n2",
        "http://n1:30001",
        "-",
        "pending",
        "10",
        "64",
        "-",
        "31.0",
    ]
    prefill = next(x for x in lines if x.startswith("p-prefill-0")).split()
    assert prefill[4] == "http://10.0.0.5:30000" and prefill[9] == "380.0"
    assert prefill[6] == "retiring"
    planned = next(x for x in lines if x.startswith("planned")).split()
    # re-planned for the measured 20 requests/s; the prediction is the fleet plan's
    # ... beside the SLO's target percentile, and the attainment the routers measured
    assert planned[2:] == ["20", "2000", "3000", "400", "600", "380.0", "31.0", "90%"]
    measured = next(x for x in lines if x.startswith("measured")).split()
    assert measured[-8:] == ["20", "2000", "3000", "400", "600", "900.0", "45.0", "80.0%"]
    assert "2 routers" in out and "re-planned for measured demand 1 time(s)" in out

    got = json.loads(cli(capsys, *addr, "deploy", "get", "p", "-o", "json"))["status"]
    assert [i["name"] for i in got["instances"]] == ["p-decode-0", "p-prefill-0"]
    assert got["instances"][1]["url"] == "http://10.0.0.5:30000"
    assert got["instanceCount"] == 2
    assert got["demand"]["measured"]["requestsPerS"] == pytest.approx(20.0)
    assert got["demand"]["planned"]["requestsPerS"] == pytest.approx(20.0)
    assert got["demand"]["plannedFromMeasurement"] is True
    assert got["demand"]["predictedTtftMs"] == 380.0
    assert got["demand"]["measured"]["sloAttainment"] == pytest.approx(0.8)
    assert got["demand"]["sloPercentile"] == 90

    listing = cli(capsys, *addr, "deploy", "get").splitlines()
    cols = listing[0].split()
    serves, count = cols.index("SERVES"), cols.index("INSTANCES")
    rows = {x.split()[0]: x.split() for x in listing[1:] if x.strip()}
    assert rows["p-decode-0"][serves] == "p" and rows["p"][count] == "2"
    assert rows["p"][serves] == "-" and rows["p-prefill-0"][count] == "-"

    own = cli(capsys, *addr, "deploy", "get", "p-decode-0").splitlines()
    row = next(x for x in own if x.startswith("p-decode-0") and "http:" in x).split()
    assert row[1] == "decode" and row[4] == "http://n1:30001"  # its record, not port 30000


def test_deploy_get_of_a_plain_deployment_lists_it_as_one_engine(
    controller: RunningController, capsys: pytest.CaptureFixture[str]
) -> None:
    addr = ["--controller", controller.address]
    controller.controller.store.put_deployment(
        DeploymentSpec("solo", model="mixtral-8x7b"), now_s=time.time()
    )
    out = cli(capsys, *addr, "deploy", "get", "solo")
    row = next(x for x in out.splitlines() if x.startswith("solo") and "aggregated" in x)
    assert row.split()[1:3] == ["aggregated", "-"] and "pending" in row
    assert "DEMAND" not in out  # no traffic stated, none measured
