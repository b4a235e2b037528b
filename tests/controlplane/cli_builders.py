"""Builders shared by the controlplane tests: small fleet files, an in-process
``mixfleetctl`` runner and solved plans."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from controlplane.cli import main

TINY_FLEET = """\
apiVersion: mixfleet.io/v1alpha1
kind: Fleet
metadata: {name: tiny}
spec:
  nodes:
  - name: a100-0
    labels: {rack: r1}
    gpus: [{model: A100-SXM4-80GB, count: 2}]
    nvlink: {domain: a100-0, per_gpu_bidir_gbytes_per_s: 600}
    nics: [{count: 1, per_direction_gbits_per_s: 400, fabric: ib0}]
  - name: h100-0
    gpus: [{model: H100-SXM5-80GB, count: 2}]
    nvlink: {domain: h100-0, per_gpu_bidir_gbytes_per_s: 900}
    nics: [{count: 1, per_direction_gbits_per_s: 400, fabric: ib0}]
"""

#: A quick solve on the tiny fleet: Mixtral (32 MoE layers x 8 experts), 12 slots.
MIXTRAL_ARGS = [
    "--model",
    "mixtral-8x7b",
    "--tokens",
    "64",
    "--context",
    "2048",
    "--load",
    "synthetic:zipf:1.0:seed=3",
    "--redundant-experts",
    "4",
    "--time-limit",
    "5",
    "--workers",
    "1",
    "-q",
]

Result = tuple[int, str, str]
RunCli = Callable[..., Result]


def write_fleet(directory: Path, text: str = TINY_FLEET) -> Path:
    """Write a fleet file into ``directory``; returns its path."""
    path = directory / "tiny.yaml"
    path.write_text(text)
    return path


def cli_runner(capsys: pytest.CaptureFixture[str]) -> RunCli:
    """Run ``mixfleetctl`` in-process: ``run("plan", "show", path)`` ->
    ``(exit status, stdout, stderr)``."""

    def run(*argv: str | Path) -> Result:
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def solve_plans(directory: Path) -> dict[str, Path]:
    """Solve the tiny-fleet Mixtral problem twice: ``engine`` (ilp, engine form) and
    ``native`` (greedy, native form); returns their paths and the ``fleet`` file's."""
    fleet = write_fleet(directory)
    engine, native = directory / "engine.json", directory / "native.json"
    base = ["plan", "solve", "--fleet", str(fleet), *MIXTRAL_ARGS, "-o", "json"]
    assert main([*base, "--policy", "ilp", "--out", str(engine)]) == 0
    assert main([*base, "--policy", "greedy", "--form", "native", "--out", str(native)]) == 0
    return {"engine": engine, "native": native, "fleet": fleet}
