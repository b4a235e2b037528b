"""``make demo`` smoke test: the mixed-24-decode scenario end to end (about 20-35 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
from demo import main

from controlplane.cli.files import read_plan


@pytest.mark.slow
def test_demo_solves_compares_and_renders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--compare", "--out", str(tmp_path), "-q"]) == 0
    out = capsys.readouterr().out
    policies = ("uniform", "eplb", "greedy", "ilp")
    table = [
        line.split()
        for line in out.splitlines()
        if line.split()[:1] and line.split()[0] in policies and "tokens/s:" not in line
    ]
    assert [row[0] for row in table] == ["uniform", "eplb", "greedy", "ilp"]
    assert all(row[-1] == "yes" for row in table)
    png = tmp_path / "mixed-24-decode-ilp.png"
    assert f"picture of the ilp plan: {png}" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    tps = {
        p: read_plan(tmp_path / f"{p}.json").summary.tokens_per_s
        for p in ("uniform", "eplb", "ilp")
    }
    assert tps["ilp"] > tps["eplb"] > tps["uniform"]
