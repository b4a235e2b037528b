"""Bring the pinned engines' own source into ``.conformance/`` for the conformance suite.

``make conformance`` runs this, then ``pytest -m conformance tests/conformance``. Steps, each
skipped when its result is already there (the folder is a cache, ignored by git):

1. ``pip download --no-deps`` the SGLang and vLLM wheels at the versions mixfleet models
   (:data:`policies.estimate.engines.PINNED_VERSIONS`) into ``.conformance/wheels``;
2. unpack each wheel into ``.conformance/src/<engine>-<version>`` (its pure-Python modules are
   what the suite imports; nothing is installed into the project's environment);
3. ``pip install --no-deps --target .conformance/deps`` the light packages those modules import
   on the way in (``tests/conformance/requirements.txt``).

TensorRT-LLM's wheel is not fetched: it is several GB and its Python imports its CUDA
bindings, so the suite re-implements the checks its config loader makes (see
``test_conformance_trtllm.py``).

Run from the repository root: ``python tests/conformance/prepare.py``.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from policies.estimate.engines import PINNED_VERSIONS

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".conformance"
ENGINES = ("sglang", "vllm")


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


def _wheel(engine: str, version: str) -> Path:
    """The engine's wheel, downloaded once."""
    folder = CACHE / "wheels"
    found = sorted(folder.glob(f"{engine}-{version}-*.whl"))
    if not found:
        _pip("download", "--no-deps", "--dest", str(folder), f"{engine}=={version}")
        found = sorted(folder.glob(f"{engine}-{version}-*.whl"))
    if not found:
        raise SystemExit(f"pip download left no {engine} {version} wheel in {folder}")
    return found[-1]


def _unpack(wheel: Path, engine: str, version: str) -> None:
    """Unpack the wheel's files (shared objects left out: the suite imports pure Python)."""
    target = CACHE / "src" / f"{engine}-{version}"
    stamp = target / ".unpacked"
    if stamp.exists():
        return
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if not n.endswith(".so")]
        whl.extractall(target, members=names)
    stamp.write_text(wheel.name)


def _deps() -> None:
    """The light packages, installed once per version of requirements.txt."""
    req = Path(__file__).with_name("requirements.txt")
    digest = hashlib.sha256(req.read_bytes()).hexdigest()[:16]
    target = CACHE / "deps"
    stamp = target / f".installed-{digest}"
    if stamp.exists():
        return
    _pip("install", "--no-deps", "--upgrade", "--target", str(target), "-r", str(req))
    stamp.write_text(digest)


def main() -> None:
    """Download, unpack and install what the suite needs; print where it is."""
    for engine in ENGINES:
        version = PINNED_VERSIONS[engine]
        _unpack(_wheel(engine, version), engine, version)
    _deps()
    print(f"conformance sources ready in {CACHE}")


if __name__ == "__main__":
    main()
