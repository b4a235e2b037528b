"""The placement and strategy benchmark runners' command lines (``python -m bench.*``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# bench/ is a directory of scripts, not an installed package: import it from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import placement, strategies


def test_bench_placement_parses_the_same_flags() -> None:
    args = placement.parse_args(["--scenario", "mixed-24-decode", "--json", "--out", "r.json"])
    assert (args.scenario, args.json, args.out, args.docs) == (
        "mixed-24-decode",
        True,
        "r.json",
        None,
    )


def test_bench_placement_unknown_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert placement.main(["--scenario", "nope"]) == 2
    assert "unknown scenario" in capsys.readouterr().err


def test_bench_strategies_unknown_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    code = strategies.main(["--scenario", "nope"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown scenario" in err
