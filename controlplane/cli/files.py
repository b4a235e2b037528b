"""Reading and writing the user's files: fleets, model configs, expert loads and plans.

The planning core (:mod:`policies`) parses documents that are already loaded; this module
does the disk I/O around it. Every failure - a missing or unreadable file, a YAML or JSON
syntax error (with its line), a file over a limit of :mod:`policies.limits`, a document of
the wrong shape - becomes a :class:`policies.errors.InputError` whose message names the file
and says what to do.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.errors import InputError

if TYPE_CHECKING:  # the parsers are imported when a file is read (mixfleetctl --help is cheap)
    from policies.hardware.fleet import Fleet
    from policies.model.architecture import ModelSpec
    from policies.plan import Plan

YAML_SUFFIXES = (".yaml", ".yml")


def read_document(path: str | Path, what: str) -> Any:
    """Load a JSON (``.json``) or YAML (anything else; YAML also reads JSON) document within
    the limits of :mod:`policies.limits` (size of its kind, UTF-8, nesting, no YAML aliases,
    one document; see :mod:`apis.documents`).

    Args:
        path: file path.
        what: what the file is, a key of :data:`policies.limits.MAX_DOCUMENT_BYTES`
            (``fleet``, ``plan``...).

    Raises:
        InputError: unreadable file, over a limit, syntax error (with line and column) or
            empty file.
    """
    from apis.documents import load_document, read_limited  # yaml: imported when a file is read
    from policies.limits import decode_utf8

    p = Path(path)
    where = f"{what} file {str(p)!r}"
    text = decode_utf8(read_limited(p, what, what), where)
    if not text.strip():
        raise InputError(f"{where} is empty")
    doc = load_document(text, where, "json" if p.suffix.lower() == ".json" else "yaml")
    if doc is None:
        raise InputError(f"{where} holds no document (only comments or '---')")
    return doc


def _in_file(path: str | Path, what: str, exc: InputError) -> InputError:
    """The same error with the file named first (the field stays in the message once)."""
    wrapped = InputError(f"{what} file {str(path)!r}: {exc}")
    wrapped.field = exc.field
    return wrapped


def read_fleet(path: str | Path) -> Fleet:
    """Read and parse a Fleet file (YAML or JSON; see :func:`policies.hardware.fleet.parse_fleet`).

    Raises:
        InputError: naming the file, the field (``spec.nodes[1].gpus[0].model``) and the fix.
    """
    from policies.hardware.fleet import parse_fleet

    doc = read_document(path, "fleet")
    try:
        fleet = parse_fleet(doc)
    except InputError as exc:
        raise _in_file(path, "fleet", exc) from exc
    for w in fleet.warnings:  # deprecated keys: still read, named with their replacement
        print(f"warning: fleet file '{path}': {w}", file=sys.stderr)
    return fleet


def read_model_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json``; the model is named after its directory
    (``.../DeepSeek-V3/config.json`` -> ``DeepSeek-V3``) unless it names itself.

    Raises:
        InputError: unreadable, not JSON, or an unsupported or incomplete config.
    """
    from policies.model.architecture import from_hf_config

    p = Path(path)
    doc = read_document(p, "model config")
    name = None
    if isinstance(doc, dict) and not doc.get("_name_or_path"):
        name = p.resolve().parent.name if p.name == "config.json" else p.stem
    try:
        return from_hf_config(doc, name)
    except InputError as exc:
        raise _in_file(path, "model config", exc) from exc


def read_expert_load(path: str | Path, model: ModelSpec) -> tuple[tuple[float, ...], ...]:
    """Read an expert-load file for ``model``: an SGLang expert-distribution dump
    (``{"logical_count": [steps][layers][experts]}`` or ``[layers][experts]``) or a plain
    ``[layers][experts]`` JSON list, rows per MoE layer or per decoder layer.

    Returns:
        ``[moe_layer][expert]`` finite, non-negative token counts.

    Raises:
        InputError: unreadable, not JSON, NaN or infinite entries, or the wrong shape.
    """
    from policies.estimate.workload import load_from_json, make_workload

    doc = read_document(path, "load")
    try:
        rows = load_from_json(doc, model)
        # make_workload is the one validator of a load's shape and values.
        return make_workload(
            model, phase="decode", tokens_per_gpu=1, context_len=1, load=rows
        ).expert_load
    except InputError as exc:
        raise _in_file(path, "load", exc) from exc
    except TypeError as exc:  # a row that is not a list
        raise InputError(
            f"load file {str(path)!r} must hold a [layers][experts] list of numbers or an "
            f"SGLang dump with 'logical_count' ({exc})"
        ) from exc


def read_plan(path: str | Path) -> Plan:
    """Read a plan written by ``mixfleetctl plan solve --out`` (JSON or YAML).

    Raises:
        InputError: unreadable, syntax error, or not a plan of this schema version.
    """
    from policies.plan import plan_from_dict

    doc = read_document(path, "plan")
    try:
        return plan_from_dict(doc)
    except InputError as exc:
        raise _in_file(path, "plan", exc) from exc
    except (AttributeError, KeyError, IndexError) as exc:  # shapes plan_from_dict misses
        raise InputError(
            f"plan file {str(path)!r} is malformed ({type(exc).__name__}: {exc}). To fix: "
            "give a plan written by mixfleetctl plan solve -o json / --out"
        ) from exc


def plain(doc: Any) -> Any:
    """``doc`` with tuples turned into lists and float NaN/inf into None (JSON- and
    YAML-safe)."""
    if isinstance(doc, dict):
        return {k: plain(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [plain(v) for v in doc]
    if isinstance(doc, float) and not math.isfinite(doc):
        return None
    return doc


def dump_document(doc: Any, fmt: str) -> str:
    """Serialise ``doc`` as ``json`` (indented) or ``yaml`` text, ending in a newline."""
    clean = plain(doc)
    if fmt == "yaml":
        import yaml

        return str(yaml.safe_dump(clean, sort_keys=False, default_flow_style=None, width=100))
    return json.dumps(clean, indent=2) + "\n"


def write_text(path: str | Path, text: str, what: str) -> Path:
    """Write ``text`` to ``path``, creating parent directories.

    Raises:
        InputError: the directory cannot be created or the file cannot be written.
    """
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise InputError(
            f"cannot write {what} to {str(p)!r}: {exc.strerror or exc}. To fix: choose a "
            "writable path with --out"
        ) from exc
    return p


def write_document(path: str | Path, doc: Any, what: str) -> Path:
    """Write ``doc`` as YAML when ``path`` ends in .yaml/.yml, else JSON.

    Raises:
        InputError: the file cannot be written.
    """
    fmt = "yaml" if Path(path).suffix.lower() in YAML_SUFFIXES else "json"
    return write_text(path, dump_document(doc, fmt), what)
