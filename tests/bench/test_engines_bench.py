"""The engine benchmark's targets and report (``python -m bench.engines``), on a recorded
result shape: no solve runs here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import engines


def _row(step: float, feasible: bool = True) -> dict[str, Any]:
    return {
        "step_ms": step,
        "feasible": feasible,
        "a2a_backend": "deepep",
        "dispatch": "static",
    }


def _results() -> dict[str, Any]:
    router = {
        p: _row(s)
        for p, s in zip(("uniform", "eplb", "greedy", "ilp"), (130, 115, 104, 100), strict=True)
    }
    router["idealised_executed"] = _row(120)
    balanced = {
        p: _row(s)
        for p, s in zip(("uniform", "eplb", "greedy", "ilp"), (130, 110, 105, 104), strict=True)
    }
    balanced["idealised_executed"] = _row(150, feasible=False)
    return {
        "mixed": {
            "description": "d",
            "idealised": {"step_ms": 90.0},
            "engines": {
                "sglang + router weights": router,
                "sglang + engine's own DP balancing": balanced,
                "vllm + router weights": {"refused": "no backend"},
            },
        }
    }


def test_targets_are_met_or_missed_by_their_figure() -> None:
    checks = {(c["engine"], c["target"]): c for c in engines.check_targets(_results())}
    up = checks[("sglang + router weights", "ilp >= 1.30x uniform")]
    assert up["value"] == pytest.approx(1.30) and up["met"]
    eplb = checks[("sglang + router weights", "ilp >= 1.15x eplb")]
    assert eplb["value"] == pytest.approx(1.15) and eplb["met"]
    own = checks[("sglang + engine's own DP balancing", "ilp >= 1.10x eplb")]
    assert own["value"] == pytest.approx(110 / 104) and not own["met"]
    assert not any(c["engine"].startswith("vllm") for c in checks.values())


def test_report_shows_the_executed_idealised_plan_and_refusals() -> None:
    doc = {
        "command": "python -m bench.engines --scenario all",
        "machine": {"cpu_count": 2, "python": "3.11"},
        "results": _results(),
        "targets": engines.check_targets(_results()),
    }
    text = engines._markdown(doc)
    assert "| sglang + router weights | deepep / static | 120.0 (+33%) |" in text
    assert "150.0 (infeasible) (+67%)" in text
    assert "refused: no backend" in text
    assert "| NO |" in text


def test_unknown_scenario_is_an_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert engines.main(["--scenario", "nope"]) == 2
    assert "unknown scenario" in capsys.readouterr().err
