"""``mixfleetctl schedule show|explain`` for deployments that state traffic and SLOs: the
fleet planner's instances, goodput and cost offline (a Fleet file) and against a real
in-process controller; curves cached on disk across runs; one error line per bad input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from agent_fakes import controller_in_thread, small_inventories, wait_until
from cli_builders import RunCli, cli_runner
from test_schedule_e2e import BASE

from controlplane.server.inprocess import RunningController
from policies.serving.plan import plan_from_doc
from policies.serving.traffic import LengthDist, Slo, Traffic

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "examples" / "fleets" / "mixed-24.yaml"

DEPLOYMENTS = """\
apiVersion: mixfleet.io/v1alpha1
kind: ModelDeployment
metadata: {name: chat}
spec:
  model: qwen3-30b-a3b
  workload: {kvCacheDtype: fp8}
  priority: 5
  traffic: {requestsPerS: 40, inputTokens: {mean: 1024, p90: 1280},
            outputTokens: {mean: 256, p90: 320}}
  slo: {ttftMs: 1000, tpotMs: 40, percentile: 90}
---
apiVersion: mixfleet.io/v1alpha1
kind: ModelDeployment
metadata: {name: batch}
spec: {model: qwen3-30b-a3b, policy: greedy, priority: 1}
"""


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    return cli_runner(capsys)


@pytest.fixture
def args(tmp_path: Path) -> list[str]:
    deps = tmp_path / "deps.yaml"
    deps.write_text(DEPLOYMENTS)
    return ["--fleet", str(FLEET), "-f", str(deps), "--curve-cache", str(tmp_path / "curves")]


def test_show_plans_the_deployments_with_traffic(run_cli: RunCli, args: list[str]) -> None:
    code, out, err = run_cli("schedule", "show", *args, "-o", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["kind"] == "FleetPlan" and doc["curves"]["computed"] > 0
    (chat,) = doc["deployments"]
    assert chat["name"] == "chat" and chat["demand"]["requestsPerS"] == 40
    assert 0 < chat["served"]["requestsPerS"] <= 40
    assert chat["predicted"]["tpotMs"] <= 40 and chat["predicted"]["ttftMs"] <= 1000
    inst = chat["pools"][0]["instances"][0]
    assert inst["role"] in ("aggregated", "prefill", "decode") and inst["batchLimit"] > 0
    assert inst["nodes"] and inst["count"] == len(inst["nodes"])
    plan_from_doc(chat["servingPlan"])  # what `serve simulate` reads
    used = {n for p in chat["pools"] for g in p["instances"] for i in g["nodes"] for n in i}
    # The deployment without traffic keeps the fleet scheduler, on the nodes left free.
    placed = doc["schedule"]["placements"]
    assert [p["deployment"] for p in placed] == ["batch"]
    assert not used & set(placed[0]["nodes"]) and set(doc["freeNodes"]) >= set(placed[0]["nodes"])
    # A second run reads every curve from the disk cache.
    code, out, _ = run_cli("schedule", "show", *args, "-o", "json")
    again = json.loads(out)
    assert code == 0 and again["curves"]["computed"] == 0 and again["curves"]["cached"] > 0
    assert again["deployments"] == doc["deployments"]
    code, out, _ = run_cli("schedule", "show", *args)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["deployment", "priority", "variant", "role"]
    assert any(line.startswith("chat ") and "p90 1000/40" in line for line in lines)
    assert "fleet scheduler, on the nodes left free" in out


def test_explain_lists_the_candidate_variants(run_cli: RunCli, args: list[str]) -> None:
    code, out, err = run_cli("schedule", "explain", "chat", *args)
    assert code == 0, err
    assert out.startswith("chat: goodput")
    assert "candidate variants" in out and "aggregated" in out
    code, out, _ = run_cli("schedule", "explain", "chat", *args, "-o", "json")
    doc = json.loads(out)
    assert doc["kind"] == "FleetPlanExplanation" and doc["variants"]
    code, out, _ = run_cli("schedule", "explain", "batch", *args)
    assert code == 0 and "candidate instances" in out
    code, _, err = run_cli("schedule", "explain", "nope", *args)
    assert code != 0 and err.startswith("error:") and "chat" in err and "batch" in err


def test_a_deployment_with_no_instance_shows_no_prediction(run_cli: RunCli, tmp_path: Path) -> None:
    deps = tmp_path / "deps.yaml"
    deps.write_text(
        DEPLOYMENTS.split("---")[0].replace("priority: 5", "nodeSelector: {rack: none}")
    )
    code, out, err = run_cli("schedule", "show", "--fleet", str(FLEET), "-f", str(deps))
    assert code == 0, err
    (row,) = [line.split() for line in out.splitlines() if line.startswith("chat ")][1:]
    assert row[1] == "0/40" and row[5] == "-", row  # no TTFT/TPOT predicted for nothing
    assert "short chat" in out


def test_a_bad_slo_is_one_error_line(run_cli: RunCli, tmp_path: Path) -> None:
    deps = tmp_path / "bad.yaml"
    deps.write_text(DEPLOYMENTS.replace("ttftMs: 1000", "ttftMs: -5"))
    code, out, err = run_cli("schedule", "show", "--fleet", str(FLEET), "-f", str(deps))
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith("error:") and "slo.ttftMs" in err


LIVE = replace(
    BASE,
    name="live",
    priority=3,
    traffic=Traffic(5.0, LengthDist(512, 640), LengthDist(128, 160)),
    slo=Slo(ttft_ms=2000, tpot_ms=100),
)


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[RunningController]:
    async def setup(ctl: RunningController) -> None:
        ctl.controller.apply_deployment(LIVE)
        store = ctl.controller.store

        def ready() -> bool:
            d = store.get_deployment("live")
            return d is not None and "scheduling" in d.status and d.status.get("phase") == "ready"

        await wait_until(ready, timeout_s=60, what="live scheduled and ready")

    yield from controller_in_thread(tmp_path, small_inventories(3), setup, ready_timeout_s=60)


def test_show_against_a_controller_adds_the_fleet_plan(
    controller: RunningController, run_cli: RunCli, tmp_path: Path
) -> None:
    cache = ["--curve-cache", str(tmp_path / "curves")]
    code, out, err = run_cli(
        "schedule", "show", "--controller", controller.address, *cache, "-o", "json"
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["kind"] == "FleetSchedule" and doc["source"] == "controller"
    plan = doc["fleetPlan"]
    assert plan["source"] == "resolvedHere" and [d["name"] for d in plan["deployments"]] == ["live"]
    assert plan["deployments"][0]["demand"]["requestsPerS"] == 5
    code, out, err = run_cli(
        "schedule", "explain", "live", "--controller", controller.address, *cache
    )
    assert code == 0, err
    assert "solved here" in out and "candidate variants" in out
