"""``mixfleetctl schedule show|explain`` on a Fleet file and deployment documents: exclusive
nodes, pending reasons, the next-best answer, and one clear error per bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_builders import RunCli, cli_runner, write_fleet

DEPLOYMENTS = """\
apiVersion: mixfleet.io/v1alpha1
kind: ModelDeployment
metadata: {name: big}
spec: {model: mixtral-8x7b, policy: greedy, priority: 5, workload: {tokensPerGpu: 32, contextLen: 2048}}
---
apiVersion: mixfleet.io/v1alpha1
kind: ModelDeployment
metadata: {name: small}
spec: {model: mixtral-8x7b, policy: greedy, priority: 1, maxGpus: 2,
       workload: {tokensPerGpu: 32, contextLen: 2048}}
---
apiVersion: mixfleet.io/v1alpha1
kind: ModelDeployment
metadata: {name: nowhere}
spec: {model: mixtral-8x7b, policy: greedy, nodeSelector: {rack: r9}}
"""


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    return cli_runner(capsys)


@pytest.fixture
def inputs(tmp_path: Path) -> list[str]:
    deps = tmp_path / "deps.yaml"
    deps.write_text(DEPLOYMENTS)
    return ["--fleet", str(write_fleet(tmp_path)), "-f", str(deps)]


def test_show_gives_each_node_to_one_deployment_and_says_why_one_is_pending(
    run_cli: RunCli, inputs: list[str]
) -> None:
    code, out, err = run_cli("schedule", "show", *inputs, "-o", "json")
    assert code == 0, err
    doc = json.loads(out)
    nodes = [n for p in doc["placements"] for n in p["nodes"]]
    assert len(nodes) == len(set(nodes)) and set(nodes) <= {"a100-0", "h100-0"}
    placed = {p["deployment"] for p in doc["placements"]}
    assert "big" in placed  # the higher priority
    (nowhere,) = [p for p in doc["pending"] if p["deployment"] == "nowhere"]
    assert nowhere["resource"] == "nodes" and "nodeSelector" in nowhere["reason"]
    code, table, _ = run_cli("schedule", "show", *inputs)
    assert code == 0 and "Pending" in table and "pending nowhere" in table
    code, text, _ = run_cli("schedule", "show", *inputs, "-o", "yaml")
    assert code == 0 and yaml.safe_load(text)["kind"] == "FleetSchedule"


def test_explain_names_the_nodes_and_the_next_best(run_cli: RunCli, inputs: list[str]) -> None:
    code, out, err = run_cli("schedule", "explain", "big", *inputs)
    assert code == 0, err
    assert out.startswith("big: ") and "why: " in out and "next best: big on " in out
    code, out, _ = run_cli("schedule", "explain", "big", *inputs, "-o", "json")
    doc = json.loads(out)
    assert doc["nodes"] and doc["alternatives"] and doc["nextBest"]["nodes"] != doc["nodes"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--quota", "team"], "--quota"),
        (["--quota", "team=x"], "NAMESPACE=GPUS"),
        (["--quota", "team=\u00b2"], "NAMESPACE=GPUS"),  # a digit to str.isdigit, not to int
        (["--quota", "Team_A=4"], "--quota: 'Team_A' (in 'Team_A=4') is not a valid namespace"),
        (["--quota", "a=1", "--quota", "a=2"], "--quota: namespace 'a' is given twice"),
        (["--workers", "0"], "argument --workers: must be >= 1, got 0"),
    ],
)
def test_bad_flags_are_one_error_line(
    run_cli: RunCli, inputs: list[str], extra: list[str], needle: str
) -> None:
    code, _, err = run_cli("schedule", "show", *inputs, *extra)
    assert code == 2 and "Traceback" not in err and needle in err


def test_an_unknown_deployment_or_a_bad_field_is_named(
    run_cli: RunCli, inputs: list[str], tmp_path: Path
) -> None:
    code, _, err = run_cli("schedule", "explain", "nope", *inputs)
    assert code == 2 and "no deployment 'nope'" in err and "big" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text(DEPLOYMENTS.replace("priority: 5", "priority: 5, memoryFraction: 2"))
    code, _, err = run_cli("schedule", "show", "--fleet", inputs[1], "-f", str(bad))
    assert code == 2 and "spec.memoryFraction" in err and "Traceback" not in err


def test_workers_give_the_same_schedule(run_cli: RunCli, inputs: list[str]) -> None:
    code, one, _ = run_cli("schedule", "show", *inputs, "-o", "json")
    code2, two, err = run_cli("schedule", "show", *inputs, "-o", "json", "--workers", "2")
    assert code == code2 == 0, err
    a, b = json.loads(one), json.loads(two)
    a.pop("solveS")
    b.pop("solveS")
    assert a == b
