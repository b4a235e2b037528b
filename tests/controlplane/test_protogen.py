"""The generated stubs are current and importable as ``mixfleet.v1``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import protogen


def test_stubs_are_current() -> None:
    stale = protogen.stale_files()
    assert stale == [], f"stale stubs {stale}. To fix: python -m protogen"


def test_stubs_import_as_mixfleet_v1_and_there_is_no_proto_package() -> None:
    from mixfleet.v1 import agent_pb2, engine_pb2_grpc, plan_pb2_grpc

    assert agent_pb2.DESCRIPTOR.package == "mixfleet.v1"
    assert hasattr(plan_pb2_grpc, "PlanServiceStub")
    assert hasattr(engine_pb2_grpc, "EngineServiceStub")
    # The installed distribution ships no package named `proto` (proto-plus owns that
    # name): from the repository root `proto/` may show up as a bare namespace directory,
    # but it is never a regular package.
    spec = importlib.util.find_spec("proto")
    assert spec is None or (spec.origin in (None, "namespace") and spec.loader is None)
    assert not (Path(__file__).resolve().parents[2] / "proto" / "__init__.py").exists()
    from importlib import metadata

    top = (metadata.distribution("mixfleet").read_text("top_level.txt") or "").split()
    assert "proto" not in top


def test_fix_imports_makes_bare_imports_absolute() -> None:
    text = "import inventory_pb2 as inventory__pb2\nfrom agent_pb2 import X\n"
    fixed = protogen.fix_imports(text)
    assert "from mixfleet.v1 import inventory_pb2 as inventory__pb2" in fixed
    assert "from mixfleet.v1.agent_pb2 import X" in fixed
