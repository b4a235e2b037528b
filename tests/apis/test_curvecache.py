"""The fleet planner's on-disk curve cache: what is written is read back, in another process
too; a damaged file, a curve of another version or a bad key is treated as absent or
refused, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apis.curvecache import ENV_VAR, FileCurveCache, default_dir
from policies.errors import InputError
from policies.fleetplan.curves import CurveEntry
from policies.serving.curves import StepCurve

KEY = "ab" + "0" * 62
CURVE = StepCurve(
    batch_grid=(8, 64),
    context_grid=(1024, 8192),
    decode_step_us=((20_000.0, 21_000.0), (30_000.0, 40_000.0)),
    prefill_grid=(512, 4096),
    prefill_us=(25_000.0, 60_000.0),
    max_batch=100,
    kv_bytes_per_token=35_136.0,
    kv_capacity_tokens=900_000,
)
ENTRY = CurveEntry(CURVE, 8, (1,) * 8)


def test_put_then_get_in_this_process_and_another(tmp_path: Path) -> None:
    cache = FileCurveCache(tmp_path / "curves")
    assert cache.get(KEY) is None
    cache.put(KEY, ENTRY)
    cache.put("cd" + "1" * 62, CurveEntry(None, 16, reason="does not fit"))
    assert cache.get(KEY) == ENTRY and cache.hits == 1 and cache.writes == 2
    assert cache.get("cd" + "1" * 62) == CurveEntry(None, 16, reason="does not fit")
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert [str(p) for p in files] == [f"curves/ab/{KEY}.json", f"curves/cd/{'cd' + '1' * 62}.json"]
    code = (
        "import sys; from pathlib import Path; from apis.curvecache import FileCurveCache;"
        f"e = FileCurveCache(Path(sys.argv[1])).get({KEY!r}); print(e.curve.max_batch, e.gpus)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "curves")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.split() == ["100", "8"]


def test_damaged_or_old_files_are_absent(tmp_path: Path) -> None:
    cache = FileCurveCache(tmp_path)
    cache.put(KEY, ENTRY)
    path = tmp_path / "ab" / f"{KEY}.json"
    path.write_text("{not json")
    assert cache.get(KEY) is None
    doc = ENTRY.to_doc() | {"version": "fleetplan-curve-0"}
    path.write_text(json.dumps(doc))
    assert cache.get(KEY) is None
    cache.put(KEY, ENTRY)  # rewritten whole
    assert cache.get(KEY) == ENTRY
    assert not list(tmp_path.rglob(".curve-*"))  # no temporary file left behind


def test_a_key_that_is_not_a_hash_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a curve key") as info:
        FileCurveCache(tmp_path).get("../../etc/passwd")
    assert info.value.field == "key"


def test_the_default_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "mine"))
    assert default_dir() == tmp_path / "mine"
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_dir() == tmp_path / "xdg" / "mixfleet" / "curves"
