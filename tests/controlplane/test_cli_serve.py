"""``mixfleetctl serve simulate``: a serving plan or a fleet plan's deployment, traffic from a
file, a ModelDeployment or flags; the table, the documents, the plot; one error line per bad
input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_fakes import controller_in_thread, small_inventories
from cli_builders import RunCli, cli_runner

from controlplane.server.inprocess import RunningController
from policies.serving.curves import StepCurve
from policies.serving.plan import InstanceGroup, KvPath, Pool, ServingPlan, plan_to_doc
from policies.serving.simulate import SimOptions, report_to_doc, simulate
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec.build import parse_deployment

REPO = Path(__file__).resolve().parents[2]


def _curve() -> StepCurve:
    return StepCurve(
        batch_grid=(1, 64),
        context_grid=(1, 8192),
        decode_step_us=((10_000.0, 10_050.0), (13_000.0, 16_000.0)),
        prefill_grid=(1, 8192),
        prefill_us=(2000.0, 60_000.0),
        max_batch=64,
        kv_bytes_per_token=70_000.0,
    )


def _plan() -> ServingPlan:
    return ServingPlan(
        pools=(
            Pool("agg", 1.0, instances=InstanceGroup(1, _curve(), usd_per_hour=20.0)),
            Pool(
                "pd",
                1.0,
                prefill=InstanceGroup(1, _curve(), usd_per_hour=20.0),
                decode=InstanceGroup(1, _curve(), usd_per_hour=20.0),
                kv_path=KvPath(50.0, 10.0),
            ),
        )
    )


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    return cli_runner(capsys)


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan_to_doc(_plan())))
    return path


FLAGS = ["--rps", "4", "--isl", "2048", "--isl-p90", "3000", "--osl", "256", "--osl-p90", "400"]
SLO_FLAGS = ["--ttft-ms", "1000", "--tpot-ms", "40"]


def test_the_json_is_the_simulator_s_report(run_cli: RunCli, plan_file: Path) -> None:
    code, out, err = run_cli(
        "serve",
        "simulate",
        plan_file,
        *FLAGS,
        *SLO_FLAGS,
        "--requests",
        "800",
        "--seed",
        "3",
        "-o",
        "json",
    )
    assert code == 0, err
    doc = json.loads(out)
    traffic = Traffic(4.0, LengthDist(2048.0, 3000.0), LengthDist(256.0, 400.0))
    # The default warm-up: the arrivals of one request lifetime at the SLO, 4 requests/s x
    # (1 s + 400 tokens x 40 ms) = 68 requests.
    assert doc["options"]["warmupRequests"] == 68
    opts = SimOptions(requests=800, seed=3, warmup_requests=68)
    want = simulate(_plan(), traffic, Slo(1000.0, 40.0), opts)
    assert doc["simulated"] == json.loads(json.dumps(report_to_doc(want)))
    assert doc["kind"] == "ServingSimulation"
    assert doc["slo"] == {"ttftMs": 1000, "tpotMs": 40, "percentile": 90}
    # Without an SLO 10% of the requests warm up; --warmup sets it.
    for extra, measured in (([], 45), (["--warmup", "0"], 50)):
        code, text, _ = run_cli(
            "serve", "simulate", plan_file, *FLAGS, "--requests", "50", *extra, "-o", "yaml"
        )
        assert code == 0 and yaml.safe_load(text)["simulated"]["requests"] == measured


def test_the_table_shows_percentiles_goodput_cost_and_pools(
    run_cli: RunCli, plan_file: Path
) -> None:
    code, out, err = run_cli(
        "serve", "simulate", plan_file, *FLAGS, *SLO_FLAGS, "--requests", "400"
    )
    assert code == 0, err
    for needle in ("TTFT ms", "TPOT ms", "goodput", "USD per", "TTFT <= 1000 ms", "agg", "pd"):
        assert needle in out, needle
    assert [line.split()[0] for line in out.splitlines() if line.startswith(("agg", "pd"))] == [
        "agg",
        "pd",
    ]


def test_traffic_and_slo_come_from_a_file_or_a_deployment(
    run_cli: RunCli, plan_file: Path, tmp_path: Path
) -> None:
    traffic = {
        "requestsPerS": 4,
        "inputTokens": {"mean": 2048, "p90": 3000},
        "outputTokens": {"mean": 256, "p90": 400},
    }
    slo = {"ttftMs": 1000, "tpotMs": 40}
    plain = tmp_path / "traffic.yaml"
    plain.write_text(yaml.safe_dump({"traffic": traffic, "slo": slo}))
    deployment = tmp_path / "dep.yaml"
    deployment.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "mixfleet.io/v1alpha1",
                "kind": "ModelDeployment",
                "metadata": {"name": "m"},
                "spec": {"model": "mixtral-8x7b", "traffic": traffic, "slo": slo},
            }
        )
    )
    runs = [
        run_cli("serve", "simulate", plan_file, *args, "--requests", "300", "-o", "json")
        for args in (["--traffic", plain], ["--traffic", deployment], [*FLAGS, *SLO_FLAGS])
    ]
    assert all(code == 0 for code, _, _ in runs), [err for _, _, err in runs]
    docs = [json.loads(out)["simulated"] for _, out, _ in runs]
    assert docs[0] == docs[1] == docs[2]
    code, out, _ = run_cli(
        "serve",
        "simulate",
        plan_file,
        "--traffic",
        plain,
        "--percentile",
        "99",
        "--requests",
        "100",
        "-o",
        "json",
    )
    assert code == 0 and json.loads(out)["slo"]["percentile"] == 99


def _deployment_a(input_tokens: dict[str, Any]) -> dict[str, Any]:
    """Deployment ``a`` of a fleet plan: the test plan at 3 requests/s of 128-token answers."""
    return {
        "name": "a",
        "servingPlan": plan_to_doc(_plan()),
        "traffic": {
            "requestsPerS": 3,
            "inputTokens": input_tokens,
            "outputTokens": {"mean": 128, "p90": 200},
        },
    }


def _fleet_plan_file(tmp_path: Path, *deployments: dict[str, Any]) -> Path:
    path = tmp_path / "fleet-plan.json"
    path.write_text(json.dumps({"kind": "FleetPlan", "deployments": list(deployments)}))
    return path


def test_a_fleet_plan_s_deployment_is_simulated_with_its_traffic(
    run_cli: RunCli, tmp_path: Path
) -> None:
    traffic = Traffic(3.0, LengthDist(1024.0, 1500.0), LengthDist(128.0, 200.0))
    a = _deployment_a({"mean": 1024, "p90": 1500})
    a["slo"] = {"ttftMs": 800, "tpotMs": 30}
    a["predicted"] = {"ttftMs": 120.0, "tpotMs": 14.0}
    path = _fleet_plan_file(tmp_path, a, {"name": "b", "pools": []})
    code, out, err = run_cli("serve", "simulate", path, "--requests", "300", "-o", "json")
    assert code == 0, err
    doc = json.loads(out)
    # Warm-up: 3 requests/s x (0.8 s + 200 tokens x 30 ms) = 20.4 -> 21 requests.
    want = simulate(
        _plan(), traffic, Slo(800.0, 30.0), SimOptions(requests=300, warmup_requests=21)
    )
    assert doc["deployment"] == "a" and doc["predicted"] == {"ttftMs": 120.0, "tpotMs": 14.0}
    assert doc["simulated"] == json.loads(json.dumps(report_to_doc(want)))
    # Flags replace fields of the plan's traffic and keep the rest.
    code, out, err = run_cli(
        "serve",
        "simulate",
        path,
        "--rps",
        "5",
        "--osl-p90",
        "250",
        "--requests",
        "100",
        "-o",
        "json",
    )
    assert code == 0, err
    assert json.loads(out)["traffic"] == {
        "requestsPerS": 5,
        "inputTokens": {"mean": 1024, "p90": 1500},
        "outputTokens": {"mean": 128, "p90": 250},
        "arrival": "poisson",
    }
    # A burst CV alone makes the plan's arrivals bursty.
    code, out, err = run_cli(
        "serve", "simulate", path, "--burst-cv", "3", "--requests", "100", "-o", "json"
    )
    assert code == 0, err
    assert json.loads(out)["traffic"]["arrival"] == "bursty"
    assert json.loads(out)["traffic"]["burstCv"] == 3
    code, out, _ = run_cli("serve", "simulate", path, "--requests", "100")
    assert code == 0 and "planner    predicted TTFT 120.0 ms" in out
    code, _, err = run_cli("serve", "simulate", path, "--deployment", "b")
    assert code == 2 and "has no instances" in err
    code, _, err = run_cli("serve", "simulate", path, "--deployment", "c")
    assert code == 2 and "no deployment 'c'" in err and "a, b" in err


def test_a_p90_flag_over_a_histogram_is_refused(run_cli: RunCli, tmp_path: Path) -> None:
    path = _fleet_plan_file(tmp_path, _deployment_a({"histogram": [[512, 1], [2048, 1]]}))
    code, _, err = run_cli("serve", "simulate", path, "--isl-p90", "3000")
    assert code == 2 and err.startswith("error: --isl-p90:") and "histogram" in err
    assert err.count("\n") == 1
    code, _, err = run_cli("serve", "simulate", path, "--isl", "1024", "--requests", "50")
    assert code == 0, err


def test_plot_writes_a_picture(run_cli: RunCli, plan_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "lat.png"
    code, _, err = run_cli(
        "serve", "simulate", plan_file, *FLAGS, *SLO_FLAGS, "--requests", "200", "--plot", out
    )
    assert code == 0, err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_example_plan_and_traffic_run(run_cli: RunCli) -> None:
    code, out, err = run_cli(
        "serve",
        "simulate",
        REPO / "examples/serving/plan-dsv3-hopper-blackwell.yaml",
        "--traffic",
        REPO / "examples/serving/traffic-dsv3.yaml",
        "--requests",
        "300",
        "-o",
        "json",
    )
    assert code == 0, err
    doc = json.loads(out)
    # 12 requests/s for one lifetime (2 s + 800 tokens x 50 ms) is past half the requests.
    assert doc["options"]["warmupRequests"] == 150
    assert doc["simulated"]["completed"] == 150


def _plan_doc_with(**change: Any) -> dict[str, Any]:
    doc = plan_to_doc(_plan())
    doc["pools"][0] = {**doc["pools"][0], **change}
    return doc


@pytest.mark.parametrize(
    ("plan", "args", "needle"),
    [
        (plan_to_doc(_plan()), ["--rps", "2", "--isl", "100"], "--osl"),
        (plan_to_doc(_plan()), [], "no traffic"),
        (plan_to_doc(_plan()), [*FLAGS, "--traffic", "x.yaml"], "--traffic and --rps"),
        (plan_to_doc(_plan()), [*FLAGS, "--output-tokens-per-s", "9"], "both requestsPerS"),
        (plan_to_doc(_plan()), [*FLAGS, "--arrival", "bursty", "--burst-cv", "0.5"], "--burst-cv"),
        (plan_to_doc(_plan()), [*FLAGS, "--arrival", "poisson", "--burst-cv", "3"], "--burst-cv"),
        (
            plan_to_doc(_plan()),
            ["--rps", "1", "--isl", "100", "--isl-p90", "50", "--osl", "9"],
            "--isl-p90",
        ),
        (plan_to_doc(_plan()), [*FLAGS, "--percentile", "90"], "--percentile needs a target"),
        (plan_to_doc(_plan()), [*FLAGS, "--ttft-ms", "5", "--percentile", "100"], "--percentile"),
        (plan_to_doc(_plan()), [*FLAGS, "--requests", "10", "--warmup", "10"], "--warmup"),
        (plan_to_doc(_plan()), [*FLAGS, "--deployment", "x"], "--deployment"),
        (_plan_doc_with(shares=2), FLAGS, "did you mean 'share'"),
        (_plan_doc_with(share=-1), FLAGS, "plan.pools[0].share"),
        ([1, 2], FLAGS, "serving plan"),
    ],
)
def test_bad_input_is_one_error_line(
    run_cli: RunCli, tmp_path: Path, plan: Any, args: list[str], needle: str
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    code, out, err = run_cli("serve", "simulate", path, *args)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0], lines[0]
    assert "Traceback" not in err and out == ""


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[RunningController]:
    """A controller with three fake agents on its own event loop in a thread."""
    yield from controller_in_thread(tmp_path, small_inventories())


def test_deploy_apply_carries_demand_and_slo_to_the_controller_and_back(
    controller: RunningController, run_cli: RunCli, tmp_path: Path
) -> None:
    doc: dict[str, Any] = {
        "apiVersion": "mixfleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "demand"},
        "spec": {
            "model": "mixtral-8x7b",
            "policy": "greedy",
            "traffic": {
                "outputTokensPerS": 2048,
                "inputTokens": {"histogram": [[512, 1], [2048, 3]]},
                "outputTokens": {"mean": 256, "p90": 400},
                "arrival": "bursty",
                "burstCv": 2.5,
            },
            "slo": {"ttftMs": 1500, "tpotMs": 60, "percentile": 95},
            "disaggregation": "off",
            "budget": {"usdPerHour": 90},
        },
    }
    path = tmp_path / "demand.yaml"
    path.write_text(yaml.safe_dump(doc))
    addr = ["--controller", controller.address]
    code, out, err = run_cli(*addr, "deploy", "apply", "-f", path)
    assert code == 0, err
    code, out, err = run_cli(*addr, "deploy", "get", "demand", "-o", "json")
    assert code == 0, err
    got = json.loads(out)["spec"]
    assert parse_deployment({**doc, "spec": got}) == parse_deployment(doc)
    assert {k: got[k] for k in ("traffic", "slo", "disaggregation", "budget")} == {
        k: doc["spec"][k] for k in ("traffic", "slo", "disaggregation", "budget")
    }
    assert "tokensPerGpu" not in got["workload"]  # not stated: the planner's to choose
