"""What ``mixfleetctl`` prints reads as users write it: enum values and versions in
``-o json|yaml`` (``committed``, ``version: 1``), ``nodes show`` as YAML, table cells cut at a
word with an ellipsis, and ``plans history`` of a deployment without a plan saying where its
planning stands - against a real in-process controller with fake agents."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from agent_fakes import controller_in_thread, small_inventories
from cli_builders import RunCli, cli_runner
from mixfleet.v1 import plan_pb2

from controlplane.cli.connection import enum_word, to_json
from controlplane.cli.output import clip
from controlplane.server.inprocess import RunningController

#: A deployment no node can take (no node carries the label): it stays pending.
UNPLACEABLE = """\
apiVersion: mixfleet.io/v1alpha1
kind: ModelDeployment
metadata: {name: waiting}
spec:
  model: mixtral-8x7b
  workload: {phase: decode, tokensPerGpu: 32, contextLen: 2048}
  policy: greedy
  nodeSelector: {rack: nowhere}
"""


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    return cli_runner(capsys)


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningController]:
    yield from controller_in_thread(tmp_path_factory.mktemp("ctl"), small_inventories(2))


def test_enum_values_lose_their_prefix_and_case() -> None:
    state = plan_pb2.PlanState.DESCRIPTOR
    assert enum_word(state, plan_pb2.PLAN_STATE_COMMITTED) == "committed"
    phase = plan_pb2.DeploymentPhase.DESCRIPTOR
    assert enum_word(phase, plan_pb2.DEPLOYMENT_PHASE_ROLLING_OUT) == "rolling_out"


def test_documents_carry_numbers_and_words() -> None:
    record = plan_pb2.PlanRecord(deployment="d", version=3, state=plan_pb2.PLAN_STATE_SUPERSEDED)
    assert to_json(record) == {"deployment": "d", "version": 3, "state": "superseded"}
    status = plan_pb2.DeploymentStatus(committed_version=1, phase=plan_pb2.DEPLOYMENT_PHASE_READY)
    assert to_json(status, proto_names=False) == {"phase": "ready", "committedVersion": 1}


@pytest.mark.parametrize(
    ("text", "width", "want"),
    [
        ("waiting for nodes to drain: h200-0", 60, "waiting for nodes to drain: h200-0"),
        (
            "waiting for nodes to drain: h200-0 still serves mixtral",
            30,
            "waiting for nodes to drain...",
        ),
        ("waiting for nodes to drain: h200-0 still serves mixtral", 26, "waiting for nodes to..."),
        ("an  extra\nspace", 60, "an extra space"),
        ("x" * 40, 10, "xxxxxxx..."),
    ],
)
def test_a_cell_is_cut_at_a_word(text: str, width: int, want: str) -> None:
    assert clip(text, width) == want
    assert len(clip(text, width)) <= width


def test_plans_history_right_after_apply_says_planning_is_under_way(
    controller: RunningController, run_cli: RunCli, tmp_path: Path
) -> None:
    addr = ["--controller", controller.address]
    spec = tmp_path / "waiting.yaml"
    spec.write_text(UNPLACEABLE)
    assert run_cli(*addr, "deploy", "apply", "-f", spec)[0] == 0
    code, out, err = run_cli(*addr, "plans", "history", "waiting")
    assert code == 0, err
    assert out.startswith("waiting: no plan version yet (pending")
    assert "planning is under way" in out and "DEPLOYMENT" not in out  # no empty table

    code, out, err = run_cli(*addr, "deploy", "get")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("waiting "))
    status = json.loads(run_cli(*addr, "deploy", "get", "waiting", "-o", "json")[1])["status"]
    message = status["message"]
    assert message and status["phase"] == "pending"
    shown = row.split("  ")[-1].strip()  # the MESSAGE column
    assert shown == message or (shown.endswith("...") and message.startswith(shown[:-3]))
    if shown != message:  # cut between words, never inside one
        assert message[len(shown) - 3 : len(shown) - 2] in (" ", ",", ";", ":", "(")

    code, _, err = run_cli(*addr, "plans", "history", "absent")
    assert code != 0 and err.startswith("error: ") and "absent" in err


def test_nodes_show_prints_yaml_then_tables(controller: RunningController, run_cli: RunCli) -> None:
    code, out, err = run_cli("--controller", controller.address, "nodes", "show", "n0")
    assert code == 0, err
    head, _, tables = out.partition("\nGPU ")
    doc = yaml.safe_load(head)
    assert doc["node"] == "n0" and doc["health"] == "ready"
    assert doc["labels"] == {"rack": "r0"} and isinstance(doc["assignedTo"], list)
    assert "{'" not in out  # no Python dict anywhere
    assert "MODEL" in tables
