"""Declared dependency floors hold what the code needs, and torch stays opt-in.

The generated gRPC stubs refuse to import below the grpcio-tools version that wrote them
(``GRPC_GENERATED_VERSION``) and the ``_pb2`` modules below their protobuf gencode version
(``ValidateProtobufRuntimeVersion``); pyproject's floors must not be lower. CI installs exactly
the floors in a second venv (``.ci/min_versions.sh``); these checks catch a floor left behind
when the stubs are regenerated, without that venv.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "proto" / "mixfleet" / "v1"


def _floors() -> dict[str, tuple[int, ...]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])
    out = {}
    for req in reqs:
        m = re.match(r"^([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9.]*)", req)
        if m:
            out[m.group(1).lower()] = tuple(int(x) for x in m.group(2).split("."))
    return out


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_grpc_floors_cover_the_generated_stubs() -> None:
    floors = _floors()
    versions = {
        _version(m)
        for path in STUBS.glob("*_pb2_grpc.py")
        for m in re.findall(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", path.read_text())
    }
    assert versions, "no generated gRPC stubs found"
    needed = max(versions)
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection", "grpcio-tools"):
        assert floors[name] >= needed, f"{name} floor {floors[name]} < stubs' {needed}"


def test_protobuf_floor_covers_the_generated_messages() -> None:
    pattern = re.compile(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),")
    versions = {
        tuple(int(x) for x in m)
        for path in STUBS.glob("*_pb2.py")
        for m in pattern.findall(path.read_text())
    }
    assert versions, "no generated protobuf modules found"
    assert _floors()["protobuf"] >= max(versions)


def test_every_runtime_dependency_declares_a_floor() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    without = [r for r in project["dependencies"] if ">=" not in r]
    assert not without, f"dependencies without a >= floor (CI tests the floors): {without}"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_demo_does_not_install_torch_and_test_does(tmp_path: Path) -> None:
    def plan(target: str) -> str:
        run = subprocess.run(
            ["make", "-n", "-B", target, f"VENV={tmp_path / 'venv'}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return run.stdout

    assert "torch" not in plan("demo")
    assert "torch" not in plan("install")
    assert "torch==" in plan("test")
    assert "torch==" in plan("install-torch")


def test_ci_runs_the_readme_test_command_with_torch_and_the_floors() -> None:
    steps = [
        line.split("#")[0].strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert "make test" in steps
    assert steps.index("make install-torch") < steps.index("make test")
    assert "bash .ci/min_versions.sh" in steps
    assert "make test" in (ROOT / "README.md").read_text()
