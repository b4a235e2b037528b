"""What the example deployments' headers say is what the fleet scheduler does: each header's
``# On FLEET the fleet scheduler gives it NODES (N GPUs)`` line is checked with
``mixfleetctl schedule show --fleet FLEET -f DEPLOYMENT`` offline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_builders import RunCli, cli_runner

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples" / "deployments").glob("*.yaml"))
#: The header line a deployment example carries (it may continue after the colon).
CLAIM = re.compile(r"^# On (\S+) the fleet scheduler gives it ([\w, -]+) \((\d+) GPUs\)", re.M)


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    return cli_runner(capsys)


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_header_says_what_the_scheduler_does(example: Path, run_cli: RunCli) -> None:
    claim = CLAIM.search(example.read_text())
    assert claim is not None, f"{example.name}: no '# On FLEET the fleet scheduler gives it' line"
    fleet, nodes, gpus = claim.group(1), claim.group(2).split(", "), int(claim.group(3))
    argv = ["schedule", "show", "--fleet", str(REPO / fleet), "-f", str(example), "-o", "json"]
    code, out, err = run_cli(*argv)
    assert code == 0, err
    (placed,) = json.loads(out)["placements"]
    assert (sorted(placed["nodes"]), placed["gpus"]) == (sorted(nodes), gpus)
