"""``python -m bench.goodput``: its command line, the generated 1,000-GPU fleet, and the
Markdown report of the committed results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# bench/ is a directory of scripts, not an installed package: import it from the checkout.
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import goodput  # noqa: E402


def test_unknown_scenario_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert goodput.main(["--scenario", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "unknown scenario" in err and err.count("\n") == 1


def test_generated_fleet_and_deployments() -> None:
    f = goodput.generated_fleet()
    assert len(f.gpus) == 1000 and len(f.nodes) == 125
    assert len({g.spec.model for g in f.gpus}) == 5
    deps = goodput.twenty_deployments()
    assert len(deps) == 20 and len({d.name for d in deps}) == 20
    assert len({d.spec.model for d in deps}) == 6
    assert all(d.spec.traffic is not None and d.spec.slo is not None for d in deps)


def test_report_of_the_committed_results(capsys: pytest.CaptureFixture[str]) -> None:
    path = ROOT / "bench" / "results" / "goodput.json"
    doc = json.loads(path.read_text())
    assert set(doc["scenarios"]) == set(goodput.SCENARIOS)
    assert goodput.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("| dsv3-mixed-24-4096-512 |") == 2  # both tables
    assert "generated-1000-twenty" in out
