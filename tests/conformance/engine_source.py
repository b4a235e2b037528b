"""The pinned engines' own modules, imported on the CPU for the conformance suite.

``tests/conformance/prepare.py`` (``make conformance``) unpacks the SGLang and vLLM wheels into
``.conformance/src`` and the light packages their modules import into ``.conformance/deps``.
Both folders are *appended* to ``sys.path``, so a package the project's environment already has
is taken from there. The modules under test are the engines' real files; where importing one
would drag in the whole server (CUDA kernels, triton, the HTTP frontend), the suite puts a
minimal stand-in in ``sys.modules`` for a module the code under test does not use, or whose
one function it uses is replayed here and checked against the real source by a test:

* ``sglang`` (the top package): a bare package object, so ``sglang/__init__.py`` (the frontend
  language API and Hugging Face patches) does not run; ``sglang.srt.*`` are the real files.
* ``sglang.srt.elastic_ep.elastic_ep``: only ``elastic_expanded_world_enabled`` (read by
  ``_prefer_same_node_experts``), answering False as the real one does when no elastic-EP
  state manager exists, i.e. at every launch without elastic EP
  (``test_elastic_stand_in_matches_the_real_function`` reads the real function).
* ``sglang.srt.model_loader``: only ``get_model_architecture``, resolving the architecture
  name through the models' own ``EntryClass`` declarations the way SGLang's ``ModelRegistry``
  does, to a class that carries the real ``get_model_config_for_expert_location`` compiled
  from the model's source file (or none, as Mixtral's class has none).

For the launch recipes (``test_conformance_launch_*.py``) SGLang's own argument parser
(``ServerArgs.add_cli_args`` / ``from_cli_args`` of ``sglang/srt/server_args.py``) is imported
with one more stand-in, only while it is imported: ``triton`` (its ``utils/common.py`` imports
triton at the top for kernels; no argument definition reads it). vLLM's
(``make_arg_parser`` of ``vllm/entrypoints/common/cli_args.py``, ``EngineArgs``) is imported
with ``VLLM_TARGET_DEVICE=cpu``, vLLM's own switch for its CPU platform (its
``DeviceConfig`` default needs a platform).

The runtime configuration SGLang's EPLB code reads (``get_exec().moe``, ``get_parallel()``,
``get_device()``) lives in ``sglang.srt.runtime_context``; ``publish()`` would need a full
``ServerArgs`` (whose module imports the whole server), so :func:`sglang_runtime` fills the
same containers, the wheel's own ``_ConfigBag`` and ``ParallelContext``, with the values the
flags give.
"""

from __future__ import annotations

import ast
import functools
import importlib
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from policies.estimate.engines import PINNED_VERSIONS

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".conformance"


def source_dir(engine: str) -> Path:
    """Where ``prepare.py`` unpacked the engine's wheel."""
    return CACHE / "src" / f"{engine}-{PINNED_VERSIONS[engine]}"


def missing_reason(engine: str) -> str | None:
    """Why the engine's source cannot be imported here, or None when it can."""
    src = source_dir(engine)
    if not (src / ".unpacked").exists() or not (CACHE / "deps").is_dir():
        return (
            f"{engine} {PINNED_VERSIONS[engine]} source not downloaded ({src.relative_to(ROOT)} "
            "missing): run `make conformance`"
        )
    return None


def require(engine: str) -> None:
    """Skip the calling test module (at import) when the engine's source is absent."""
    reason = missing_reason(engine)
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)


def _add_paths(engine: str) -> None:
    for p in (str(CACHE / "deps"), str(source_dir(engine))):
        if p not in sys.path:
            sys.path.append(p)


# --------------------------------------------------------------------------- SGLang

SGLANG_ARCHS = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "llama4": "Llama4ForCausalLM",
}
"""mixfleet family -> the Hugging Face architecture SGLang resolves."""


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in _tree(path).body if isinstance(n, ast.ClassDef)}


@functools.cache
def _entry_index(models_dir: Path) -> dict[str, Path]:
    """Architecture name -> the model file whose ``EntryClass`` declares it (as SGLang's
    ``ModelRegistry`` collects them). Read without importing: a file declaring ``EntryClass``
    holds the word, so only those are parsed."""
    index: dict[str, Path] = {}
    for path in sorted(models_dir.glob("*.py")):
        if "EntryClass" not in path.read_text(encoding="utf-8"):
            continue
        for node in _tree(path).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets
            ):
                value = node.value
                items = value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
                for i in items:
                    if isinstance(i, ast.Name):
                        index.setdefault(i.id, path)
    return index


def find_method(models_dir: Path, arch: str, method: str) -> tuple[Path, ast.FunctionDef] | None:
    """The model file declaring ``arch`` in its ``EntryClass`` and ``method`` as defined on the
    class or a base class of the same file; None when the class chain has no such method."""
    path = _entry_index(models_dir).get(arch)
    if path is None:
        raise LookupError(f"no model file of {models_dir} declares {arch} in EntryClass")
    classes = _classes(path)
    todo, seen = [arch], set()
    while todo:
        name = todo.pop(0)
        if name in seen or name not in classes:
            continue
        seen.add(name)
        for item in classes[name].body:
            if isinstance(item, ast.FunctionDef) and item.name == method:
                return path, item
        todo += [b.id for b in classes[name].bases if isinstance(b, ast.Name)]
    return None


def _model_class(models_dir: Path, arch: str, namespace: dict[str, Any]) -> type:
    """A class named ``arch`` holding the model file's real
    ``get_model_config_for_expert_location`` (compiled from its source), or none."""
    attrs: dict[str, Any] = {}
    found = find_method(models_dir, arch, "get_model_config_for_expert_location")
    if found is not None:
        path, fn = found
        module = ast.Module(body=[fn], type_ignores=[])
        scope: dict[str, Any] = dict(namespace)
        exec(compile(module, str(path), "exec"), scope)  # the wheel's own code
        attrs["get_model_config_for_expert_location"] = scope[fn.name]
    return type(arch, (), attrs)


@dataclass(frozen=True)
class SGLang:
    """The SGLang modules under test."""

    expert_location: Any
    dispatch: Any
    runtime_context: Any
    models_dir: Path


def sglang() -> SGLang:
    """Import SGLang 0.5.23's EPLB modules from the unpacked wheel (see the module docstring
    for the three stand-ins)."""
    _add_paths("sglang")
    src = source_dir("sglang") / "sglang"
    if "sglang" not in sys.modules:
        pkg = types.ModuleType("sglang")
        pkg.__path__ = [str(src)]
        sys.modules["sglang"] = pkg
        elastic = types.ModuleType("sglang.srt.elastic_ep.elastic_ep")
        elastic.elastic_expanded_world_enabled = lambda: False  # type: ignore[attr-defined]
        sys.modules[elastic.__name__] = elastic
    el = importlib.import_module("sglang.srt.eplb.expert_location")
    models_dir = src / "srt" / "models"
    if "sglang.srt.model_loader" not in sys.modules:
        loader = types.ModuleType("sglang.srt.model_loader")
        namespace = {"ModelConfigForExpertLocation": el.ModelConfigForExpertLocation}

        def get_model_architecture(model_config: Any) -> tuple[type, str]:
            arch = model_config.hf_config.architectures[0]
            return _model_class(models_dir, arch, namespace), arch

        loader.get_model_architecture = get_model_architecture  # type: ignore[attr-defined]
        sys.modules[loader.__name__] = loader
    return SGLang(
        expert_location=el,
        dispatch=importlib.import_module("sglang.srt.eplb.expert_location_dispatch"),
        runtime_context=importlib.import_module("sglang.srt.runtime_context"),
        models_dir=models_dir,
    )


@dataclass(frozen=True)
class SglangModelConfig:
    """What SGLang's EPLB code reads of its ``ModelConfig``: ``hf_config`` (for the model
    class's ``get_model_config_for_expert_location`` and ``get_model_architecture``)."""

    hf_config: types.SimpleNamespace


def sglang_model_config(
    family: str, num_layers: int, num_experts: int, n_group: int = 1
) -> SglangModelConfig:
    """The ``hf_config`` fields the real model classes read, named as in their config.json."""
    fields: dict[str, Any] = {"architectures": [SGLANG_ARCHS[family]]}
    fields["num_hidden_layers"] = num_layers
    if family == "deepseek_v3":
        fields |= {"n_routed_experts": num_experts, "n_group": n_group}
    elif family == "qwen3_moe":
        fields["num_experts"] = num_experts
    else:
        fields["num_local_experts"] = num_experts
    return SglangModelConfig(types.SimpleNamespace(**fields))


@contextmanager
def sglang_runtime(
    sg: SGLang,
    *,
    ep_size: int,
    nnodes: int,
    num_redundant: int,
    a2a_backend: str = "deepep",
    dispatch: str | None = "static",
) -> Iterator[None]:
    """SGLang's runtime context as ``--ep-size``, ``--nnodes``, ``--ep-num-redundant-experts``,
    ``--moe-a2a-backend`` and ``--ep-dispatch-algorithm`` set it, on the CPU; reset after."""
    rc = sg.runtime_context
    moe = rc._ConfigBag("exec.moe")
    for name, value in {
        "ep_num_redundant_experts": num_redundant,
        "ep_dispatch_algorithm": dispatch,
        "moe_a2a_backend": a2a_backend,
        "ep_join_mode": None,
        "init_expert_location": "trivial",
        "eplb_algorithm": "auto",
    }.items():
        moe._set(name, value)
    exec_bag = rc._ConfigBag("exec")
    exec_bag._set_sub("moe", moe)
    device = rc._ConfigBag("device")
    device._set("device", "cpu")
    context = rc.get_context()
    context._config_bags = {"exec": exec_bag, "device": device}
    rc.get_parallel()._stamp.update(
        ep_size=ep_size, tp_size=ep_size, nnodes=nnodes, elastic_ep_initial_size=None
    )
    try:
        yield
    finally:
        rc.reset_context()


@contextmanager
def _triton_stand_in() -> Iterator[None]:
    """A bare ``triton`` module while SGLang's server arguments are imported (see the module
    docstring); the previous entry (none on a CPU machine) is put back after."""
    saved = {k: sys.modules[k] for k in ("triton", "triton.language") if k in sys.modules}
    if "triton" in saved:  # a real triton: nothing to stand in for
        yield
        return
    tr = types.ModuleType("triton")
    tr.__path__ = []
    lang = types.ModuleType("triton.language")
    tr.language = lang  # type: ignore[attr-defined]
    tr.runtime = types.SimpleNamespace(jit=types.SimpleNamespace(JITFunction=type))  # type: ignore[attr-defined]
    tr.jit = lambda *a, **_: a[0] if a and callable(a[0]) else (lambda f: f)  # type: ignore[attr-defined]
    sys.modules["triton"], sys.modules["triton.language"] = tr, lang
    try:
        yield
    finally:
        for k in ("triton", "triton.language"):
            sys.modules.pop(k, None)


@dataclass(frozen=True)
class SGLangArgs:
    """SGLang's server arguments: the class, and a parser with its flags."""

    server_args: Any
    parser: Any
    runtime_context: Any


def sglang_args() -> SGLangArgs:
    """SGLang 0.5.23's ``ServerArgs`` and its ``argparse`` parser (``add_cli_args``)."""
    import argparse

    sglang()
    with _triton_stand_in():
        module = importlib.import_module("sglang.srt.server_args")
    parser = argparse.ArgumentParser()
    module.ServerArgs.add_cli_args(parser)
    return SGLangArgs(
        module.ServerArgs, parser, importlib.import_module("sglang.srt.runtime_context")
    )


# ----------------------------------------------------------------------------- vLLM


@dataclass(frozen=True)
class VLLM:
    """The vLLM modules under test."""

    eplb_state: Any
    rebalance_execute: Any
    parallel_config: Any
    root: Path


def vllm() -> VLLM:
    """Import vLLM 0.33.0's EPLB state, weight rearrangement and parallel config from the
    unpacked wheel (no stand-ins: the light packages in ``.conformance/deps`` suffice)."""
    _add_paths("vllm")
    return VLLM(
        eplb_state=importlib.import_module("vllm.distributed.eplb.eplb_state"),
        rebalance_execute=importlib.import_module("vllm.distributed.eplb.rebalance_execute"),
        parallel_config=importlib.import_module("vllm.config.parallel"),
        root=source_dir("vllm") / "vllm",
    )


@dataclass(frozen=True)
class VLLMArgs:
    """vLLM's ``vllm serve`` parser and the engine arguments built from it."""

    parser: Any
    engine_args: Any
    kv_transfer: Any
    envs: Any


def vllm_args() -> VLLMArgs:
    """vLLM 0.33.0's ``vllm serve`` parser (``make_arg_parser`` on its
    ``FlexibleArgumentParser``), ``EngineArgs`` and ``KVTransferConfig``, on its CPU platform."""
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    vllm()
    cli = importlib.import_module("vllm.entrypoints.common.cli_args")
    flexible = importlib.import_module("vllm.utils.argparse_utils").FlexibleArgumentParser
    return VLLMArgs(
        parser=cli.make_arg_parser(flexible()),
        engine_args=importlib.import_module("vllm.engine.arg_utils").EngineArgs,
        kv_transfer=importlib.import_module("vllm.config.kv_transfer"),
        envs=importlib.import_module("vllm.envs"),
    )


def function_source(path: Path, name: str) -> ast.FunctionDef:
    """A top-level (or nested under ``if``) function definition of a source file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"{path.name} defines no function {name}")
