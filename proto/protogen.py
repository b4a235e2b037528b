"""Regenerate the gRPC stubs of ``proto/mixfleet/v1/*.proto`` (or check they are current).

Usage::

    python -m protogen          # write the stubs next to the .proto files
    python -m protogen --check  # exit 1 when the stubs on disk are stale

The stubs are importable as ``mixfleet.v1`` (pyproject maps the ``proto`` directory, so
``proto/mixfleet`` is the package ``mixfleet``; there is no package named ``proto``). protoc
is run with ``-I proto``, so generated imports already read ``from mixfleet.v1 import
inventory_pb2``; :func:`fix_imports` rewrites any bare ``import inventory_pb2`` a different
include root would produce, so the output never depends on how protoc was invoked.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = PROTO_ROOT / "mixfleet" / "v1"
PACKAGE = "mixfleet.v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")

_BARE_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)
_FROM_BARE = re.compile(r"^from (\w+_pb2) import", re.MULTILINE)


def proto_files() -> list[Path]:
    """The .proto sources, sorted."""
    return sorted(PACKAGE_DIR.glob("*.proto"))


def fix_imports(text: str) -> str:
    """Make imports between generated modules absolute (``from mixfleet.v1 import x_pb2``)."""
    text = _BARE_IMPORT.sub(rf"from {PACKAGE} import \1 as \2", text)
    return _FROM_BARE.sub(rf"from {PACKAGE}.\1 import", text)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (grpcio-tools + mypy-protobuf) into ``out_dir``/mixfleet/v1.

    Returns:
        the generated files, sorted.

    Raises:
        RuntimeError: protoc failed (its exit code is in the message).
    """
    import grpc_tools  # type: ignore[import-untyped]
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    plugins = []
    for name in ("protoc-gen-mypy", "protoc-gen-mypy_grpc"):
        exe = shutil.which(name) or str(Path(sys.executable).parent / name)
        if not Path(exe).exists():
            raise RuntimeError(f"{name} not found. To fix: pip install mypy-protobuf")
        plugins.append(f"--plugin={name}={exe}")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        *plugins,
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc exited with {rc}. To fix: read its messages above")
    generated = sorted(
        p for p in (out_dir / "mixfleet" / "v1").iterdir() if p.name.endswith(SUFFIXES)
    )
    for path in generated:
        path.write_text(fix_imports(path.read_text()))
    return generated


def stale_files() -> list[str]:
    """Names of stubs that differ from a fresh generation (missing, changed or extra)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_text() for p in generate(Path(tmp))}
    current = {p.name: p.read_text() for p in PACKAGE_DIR.iterdir() if p.name.endswith(SUFFIXES)}
    return sorted(
        name for name in fresh.keys() | current.keys() if fresh.get(name) != current.get(name)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m protogen", description=__doc__, allow_abbrev=False
    )
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(
                f"stale gRPC stubs: {', '.join(stale)}. To fix: python -m protogen",
                file=sys.stderr,
            )
            return 1
        print("gRPC stubs are current")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        for old in PACKAGE_DIR.iterdir():
            if old.name.endswith(SUFFIXES):
                old.unlink()
        for path in fresh:
            (PACKAGE_DIR / path.name).write_text(path.read_text())
            print(f"wrote {(PACKAGE_DIR / path.name).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
