"""A Fleet file with the old unit keys still works from the CLI, with one ``warning:`` line
per old key naming the new one on stderr."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from controlplane.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_old_unit_keys_warn_and_still_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load((ROOT / "examples/fleets/mixed-24.yaml").read_text())
    node = doc["spec"]["nodes"][0]
    node["nvlink"]["per_gpu_gbps"] = node["nvlink"].pop("per_gpu_bidir_gbytes_per_s")
    node["nics"][0]["gbps"] = node["nics"][0].pop("per_direction_gbits_per_s")
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(doc))
    assert main(["fleet", "show", str(old)]) == 0
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, err
    assert any("per_gpu_gbps" in w and "per_gpu_bidir_gbytes_per_s" in w for w in warnings)
    assert any(".gbps" in w and "per_direction_gbits_per_s" in w for w in warnings)
    assert main(["fleet", "show", str(ROOT / "examples/fleets/mixed-24.yaml")]) == 0
    assert "warning:" not in capsys.readouterr().err
    assert "a100-0" in out
