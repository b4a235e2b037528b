"""What the example deployments' headers say is what the fleet scheduler does: each header's
``# On FLEET the fleet scheduler gives it NODES (N GPUs)`` line - or, for a deployment stated
by its demand and SLOs, ``# On FLEET the fleet planner serves it with ROLE on NODES; ...``
(a prefill/decode pool as ``prefill on NODES + decode on NODES``) - is checked with
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
#: The header line of a deployment the fleet planner serves with engine instances.
PLANNED = re.compile(r"^# On (\S+) the fleet planner serves it with ([\w,;+ -]+)\.?$", re.M)


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    return cli_runner(capsys)


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_header_says_what_the_scheduler_does(example: Path, run_cli: RunCli) -> None:
    planned = PLANNED.search(example.read_text())
    if planned is not None:
        _check_planned(example, planned, run_cli)
        return
    claim = CLAIM.search(example.read_text())
    assert claim is not None, f"{example.name}: no '# On FLEET the fleet scheduler gives it' line"
    fleet, nodes, gpus = claim.group(1), claim.group(2).split(", "), int(claim.group(3))
    argv = ["schedule", "show", "--fleet", str(REPO / fleet), "-f", str(example), "-o", "json"]
    code, out, err = run_cli(*argv)
    assert code == 0, err
    (placed,) = json.loads(out)["placements"]
    assert (sorted(placed["nodes"]), placed["gpus"]) == (sorted(nodes), gpus)


def _check_planned(example: Path, claim: re.Match[str], run_cli: RunCli) -> None:
    """The fleet plan's pools are the claimed ones: ``ROLE on NODES`` per aggregated pool,
    ``prefill on NODES + decode on NODES`` per prefill/decode pool, ``;`` between pools."""
    argv = ["schedule", "show", "--fleet", str(REPO / claim.group(1)), "-f", str(example)]
    code, out, err = run_cli(*argv, "-o", "json")
    assert code == 0, err
    (dep,) = json.loads(out)["deployments"]
    got = sorted(
        " + ".join(
            f"{g['role']} on {', '.join(n for inst in g['nodes'] for n in inst)}"
            for g in pool["instances"]
        )
        for pool in dep["pools"]
    )
    assert got == sorted(p.strip() for p in claim.group(2).split(";"))
