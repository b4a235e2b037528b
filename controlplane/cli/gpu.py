"""``mixfleetctl gpu list`` / ``gpu show NAME``: the GPU catalog, every figure with its source.

A Fleet file names its GPUs by these catalog names (or the NVML names shown as aliases); a
short name that fits several products (``H100``: SXM5, PCIe or NVL) is refused, so this is
where a user finds the exact name and checks the figures a plan will be priced with.
"""

from __future__ import annotations

import argparse
from typing import Any

from controlplane.cli.output import (
    Groups,
    add_group,
    add_leaf,
    add_output_arg,
    emit,
    emit_document,
    format_table,
)
from policies.estimate.reference import (
    comparison,
    layer_comparison,
    layer_source,
    reference_models,
    reference_source,
)
from policies.hardware.catalog import (
    CATALOG,
    DATASHEETS,
    LAYER_REFERENCE_NOTES,
    REFERENCE_NOTES,
    GpuSpec,
    aliases_of,
    ambiguous_names,
    figure_sources,
    lookup,
)

#: Table columns: (header, GpuSpec field); every header carries its unit.
_COLUMNS = (
    ("model", "model"),
    ("vendor", "vendor"),
    ("arch", "architecture"),
    ("cc", "compute_capability"),
    ("sms", "sms"),
    ("bf16_tflops", "bf16_tflops"),
    ("fp8_tflops", "fp8_tflops"),
    ("fp4_tflops", "fp4_tflops"),
    ("hbm_gbytes_per_s", "hbm_bandwidth_gbytes_per_s"),
    ("memory_gib", "memory_gib"),
    ("nvlink_bidir_gbytes_per_s", "nvlink_bidir_gbytes_per_s"),
    ("links", "nvlink_links"),
    ("pcie_gbytes_per_s", "pcie_per_direction_gbytes_per_s"),
    ("power_w", "power_w"),
)


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _layer_rows(model: str) -> list[dict[str, Any]]:
    """Whole-layer step times of ``model`` against the cost model, per setup and batch
    (policies.estimate.reference.layer_comparison), each with its source and the catalog's note."""
    rows: list[dict[str, Any]] = []
    for c in layer_comparison(model):
        setup, at = c.figure.split(" step_us @")
        batches, why = LAYER_REFERENCE_NOTES.get((model, setup), ((), ""))
        rows.append(
            {
                "setup": setup,
                "sequences_per_gpu": int(at),
                "measured_step_us": c.measured,
                "model_step_us": c.default,
                "measured_vs_h200": c.measured_ratio,
                "model_vs_h200": c.default_ratio,
                "source": layer_source(setup, model),
                "note": why if int(at) in batches else "",
            }
        )
    return rows


def gpu_document(spec: GpuSpec, *, layers: bool = False) -> dict[str, Any]:
    """One catalog entry as ``-o json|yaml`` writes it: identity, figures (field names carry
    the units), the other names that resolve to it and the source of every figure; with
    ``layers``, also the whole-layer step times measured against the cost model's."""
    doc: dict[str, Any] = dict(vars(spec))
    doc["aliases"] = aliases_of(spec.model)
    doc["datasheet"] = DATASHEETS[spec.model]
    doc["sources"] = figure_sources(spec.model)
    if spec.model in reference_models():
        doc["reference"] = {
            "source": reference_source(spec.model),
            "figures": [
                {
                    "figure": c.figure,
                    "measured": c.measured,
                    "model_default": c.default,
                    "measured_vs_h200": c.measured_ratio,
                    "model_vs_h200": c.default_ratio,
                    "note": REFERENCE_NOTES.get((spec.model, c.figure), ""),
                }
                for c in comparison(spec.model)
            ],
        }
        if layers:
            doc["reference"]["layers"] = _layer_rows(spec.model)
    return doc


def cmd_gpu_list(args: argparse.Namespace) -> int:
    """``gpu list``: every catalog entry."""
    specs = list(CATALOG.values())
    if args.output != "table":
        emit_document([gpu_document(s) for s in specs], args.output, [s.model for s in specs])
        return 0
    headers = [h for h, _ in _COLUMNS] + ["source"]
    rows = [[_number(getattr(s, f)) for _, f in _COLUMNS] + [DATASHEETS[s.model]] for s in specs]
    emit(format_table(headers, rows))
    refused = "; ".join(f"{n} ({', '.join(c)})" for n, c in ambiguous_names().items())
    emit(
        f"Short names refused as ambiguous: {refused}.\n"
        "How each figure is read from its datasheet: mixfleetctl gpu show NAME."
    )
    return 0


def cmd_gpu_show(args: argparse.Namespace) -> int:
    """``gpu show NAME``: one entry (catalog, alias or NVML name), each figure with its source."""
    spec = lookup(args.name, field_path="NAME")
    doc = gpu_document(spec, layers=True)
    if args.output != "table":
        emit_document(doc, args.output, [spec.model])
        return 0
    lines = [
        f"{spec.model} ({spec.vendor} {spec.architecture}, {spec.compute_capability}); "
        f"figures from: {doc['datasheet']}"
    ]
    if doc["aliases"]:
        lines.append(f"also named: {', '.join(doc['aliases'])}")
    sources = doc["sources"]
    rows = [[name, _number(doc[name]), sources[name]] for name in sources]
    emit("\n".join(lines))
    emit(format_table(["figure", "value", "source"], rows))
    ref = doc.get("reference")
    if ref:
        emit(f"Measured reference ({ref['source']}) against the cost model's default:")
        emit(
            format_table(
                ["figure", "measured", "model", "measured/h200", "model/h200", "note"],
                [
                    [
                        r["figure"],
                        f"{r['measured']:.4g}",
                        f"{r['model_default']:.4g}",
                        f"{r['measured_vs_h200']:.3g}",
                        f"{r['model_vs_h200']:.3g}",
                        r["note"] or "within 15% (10% on the ratio)",
                    ]
                    for r in ref["figures"]
                ],
            )
        )
        _emit_layers(ref.get("layers", []))
    else:
        emit("No measured reference for this GPU: its figures are the datasheet's above.")
    return 0


_LAYER_HEADERS = [
    "seq/gpu",
    "measured_ms",
    "model_ms",
    "error",
    "measured/h200",
    "model/h200",
    "note",
]


def _emit_layers(rows: list[dict[str, Any]]) -> None:
    """The whole-layer step table of ``gpu show``, one block per setup with its source."""
    for setup in dict.fromkeys(r["setup"] for r in rows):
        block = [r for r in rows if r["setup"] == setup]
        emit(f"Step time, {setup} ({block[0]['source']}) against the cost model's default:")
        emit(
            format_table(
                _LAYER_HEADERS,
                [
                    [
                        str(r["sequences_per_gpu"]),
                        f"{r['measured_step_us'] / 1e3:.2f}",
                        f"{r['model_step_us'] / 1e3:.2f}",
                        f"{r['model_step_us'] / r['measured_step_us'] - 1:+.0%}",
                        f"{r['measured_vs_h200']:.3g}",
                        f"{r['model_vs_h200']:.3g}",
                        "see below" if r["note"] else "within 15% (10% on the ratio)",
                    ]
                    for r in block
                ],
            )
        )
        notes = dict.fromkeys(r["note"] for r in block if r["note"])
        for note in notes:
            emit(f"  note: {note}")


def register(groups: Groups) -> None:
    """Add the ``gpu`` group."""
    gpu = add_group(groups, "gpu", "the GPU catalog")
    p = add_leaf(gpu, "list", cmd_gpu_list, "list the catalog GPUs with their figures and sources")
    add_output_arg(p)
    p = add_leaf(gpu, "show", cmd_gpu_show, "one catalog GPU, every figure with its source")
    p.add_argument("name", metavar="NAME", help="catalog name, alias or NVML name")
    add_output_arg(p)
