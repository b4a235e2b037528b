"""Measured reference figures of GPUs this project cannot run, and how the catalog and the
cost model's defaults compare with them.

The figures come from ``policies/data/reference_timings.json`` (written by
``python -m bench.gpu_reference``): per-operation timings NVIDIA measured on each GPU with
SGLang's kernels and NCCL, shipped in aiconfigurator-core 0.12.0 (the file names the
versions). From them, per catalog model (:func:`reference_figures`):

* ``gemm_bf16_tflops``, ``gemm_fp8_tflops``: an 8192 x 8192 x 8192 GEMM;
* ``weight_read_gbytes_per_s``: the 8192 x 8192 BF16 weight read by a 16-row GEMM;
* ``attn_decode_gbytes_per_s``: KV bytes over time of decode attention, 256 sequences x
  4096 cached tokens (one KV head of 128, BF16);
* ``allgather_bus_gbytes_per_s``, ``reducescatter_bus_gbytes_per_s``,
  ``alltoall_bus_gbytes_per_s``: NCCL bus bandwidth over 8 GPUs of one node at 256 MiB
  (``bytes * (n - 1) / n / time``, nccl-tests' definition).

:func:`model_defaults` gives the cost model's figure for the same quantity when no GPU is
calibrated (catalog peak times :class:`policies.estimate.costmodel.Efficiency`; collectives at the
NVLink or PCIe per-direction rate times its efficiency), and :func:`comparison` both, with
the ratios to the H200 that the heterogeneity-aware planner relies on.

Whole-layer steps (``layer_curves`` in the file): the step time of each setup (model,
engine path, phase; 8 GPUs of one node, 4096 tokens of context, 1-256 sequences per GPU)
as aiconfigurator's SDK composes it from those tables, per GPU, split into the cost model's
phases. :func:`measured_layer_curve` reads one, :func:`model_layer_curve` computes the
cost model's step on the same setup (defaults, no calibration), and
:func:`layer_comparison` / :func:`layer_misses` set them side by side with the ratios to
the H200; :data:`policies.hardware.catalog.LAYER_REFERENCE_NOTES` says where and why they miss.

Units: TFLOPS, GB/s (1e9 B/s), microseconds in the data file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.errors import InputError
from policies.hardware.catalog import lookup

if TYPE_CHECKING:
    from policies.estimate.costmodel import Efficiency
    from policies.hardware.fleet import Fleet

DATA = Path(__file__).resolve().parents[1] / "data" / "reference_timings.json"
BASELINE = "H200-SXM-141GB"
"""The GPU the ratios are taken against (the one measured here too)."""

RATIO_TOLERANCE = 0.10
"""A default's ratio to the baseline within 10% of the measured ratio."""
ABSOLUTE_TOLERANCE = 0.15
"""A default within 15% of the measured figure."""

_GEMM_FLOPS = 2.0 * 8192**3
_WEIGHT_BYTES = 8192 * 8192 * 2.0
_KV_BYTES_256 = 256 * 4096 * 128 * 2 * 2.0
_COLLECTIVE_BYTES = 2**28
_COLLECTIVES = {
    "allgather_bus_gbytes_per_s": "all_gather",
    "reducescatter_bus_gbytes_per_s": "reduce_scatter",
    "alltoall_bus_gbytes_per_s": "alltoall",
}


@cache
def reference_document() -> dict[str, Any]:
    """The data file, parsed."""
    return dict(json.loads(DATA.read_text(encoding="utf-8")))


def reference_models() -> tuple[str, ...]:
    """Catalog models with reference data."""
    return tuple(sorted(reference_document()["gpus"]))


def reference_source(model: str) -> str:
    """Where ``model``'s reference figures come from (data set, engine and NCCL versions)."""
    g = reference_document()["gpus"][model]
    return (
        f"measured by NVIDIA: aiconfigurator-core 0.12.0 systems/data/{g['folder']} "
        f"(SGLang {g['sglang']} kernels, decode attention {g['attention_kernel']}, "
        f"NCCL {g['nccl']})"
    )


def reference_figures(model: str) -> dict[str, float]:
    """The measured figures of catalog ``model`` (module docstring); {} without data."""
    g = reference_document()["gpus"].get(model)
    if g is None:
        return {}
    out: dict[str, float] = {}
    gemm = g["gemm_8192x8192_us"]
    for dt, key in (("bfloat16", "gemm_bf16_tflops"), ("fp8", "gemm_fp8_tflops")):
        if dt in gemm:
            out[key] = _GEMM_FLOPS / gemm[dt]["m8192_us"] / 1e6
    if "bfloat16" in gemm:
        out["weight_read_gbytes_per_s"] = _WEIGHT_BYTES / gemm["bfloat16"]["m16_us"] / 1e3
    attn = g["decode_attention_4096_us"]
    if "b256_us" in attn:
        out["attn_decode_gbytes_per_s"] = _KV_BYTES_256 / attn["b256_us"] / 1e3
    for key, op in _COLLECTIVES.items():
        t = g["nccl_8gpu_us"].get(op, {}).get(str(_COLLECTIVE_BYTES))
        if t:
            out[key] = _COLLECTIVE_BYTES * 7 / 8 / t / 1e3
    return out


def model_defaults(model: str, eff: Efficiency | None = None) -> dict[str, float]:
    """The cost model's figures for catalog ``model`` without calibration: the catalog's
    peaks times the default efficiencies; collectives at the per-direction NVLink rate
    (PCIe where the GPU has none) times its efficiency."""
    from policies.estimate.costmodel import Efficiency

    e = eff or Efficiency()
    s = lookup(model)
    link = (
        s.nvlink_bidir_gbytes_per_s / 2.0 * e.nvlink
        if s.nvlink_bidir_gbytes_per_s > 0
        else s.pcie_per_direction_gbytes_per_s * e.pcie
    )
    out = {
        "gemm_bf16_tflops": s.bf16_tflops * e.gemm_bf16,
        "weight_read_gbytes_per_s": s.hbm_bandwidth_gbytes_per_s * e.hbm,
        "attn_decode_gbytes_per_s": s.hbm_bandwidth_gbytes_per_s * e.attn_decode,
        **dict.fromkeys(_COLLECTIVES, link),
    }
    if s.nvlink_bidir_gbytes_per_s <= 0:  # the cost model uses the measured PCIe rate
        measured = pcie_collective_gbytes_per_s(model)
        if measured is not None:
            out.update(dict.fromkeys(_COLLECTIVES, measured))
    if s.has_fp8:
        out["gemm_fp8_tflops"] = s.fp8_tflops * e.gemm_fp8
    return out


def pcie_collective_gbytes_per_s(model: str) -> float | None:
    """NCCL bus bandwidth over 8 GPUs of catalog ``model`` joined by PCIe only (no NVLink):
    the median of all-gather, reduce-scatter and all-to-all at 256 MiB, GB/s; None for an
    NVLink GPU or one without reference data. The rate peer traffic over PCIe really gets
    (on 8 L40S, ~1.4 GB/s: the collectives go through the host, not at the link's 32 GB/s)."""
    try:
        spec = lookup(model)
    except InputError:
        return None
    if spec.nvlink_bidir_gbytes_per_s > 0:
        return None
    ref = reference_figures(spec.model)
    values = sorted(ref[k] for k in _COLLECTIVES if k in ref)
    return values[len(values) // 2] if values else None


@dataclass(frozen=True)
class Comparison:
    """One figure of one GPU: measured, the model's default, and both as ratios to the
    baseline GPU.

    Attributes:
        model, figure: catalog model and figure name (units in the name).
        measured, default: the reference figure and the cost model's.
        measured_ratio, default_ratio: each over the baseline GPU's.
    """

    model: str
    figure: str
    measured: float
    default: float
    measured_ratio: float
    default_ratio: float

    @property
    def absolute_error(self) -> float:
        return self.default / self.measured - 1.0

    @property
    def ratio_error(self) -> float:
        return self.default_ratio / self.measured_ratio - 1.0

    @property
    def within(self) -> bool:
        return (
            abs(self.ratio_error) <= RATIO_TOLERANCE
            and abs(self.absolute_error) <= ABSOLUTE_TOLERANCE
        )


def comparison(model: str) -> list[Comparison]:
    """Every reference figure of ``model`` against the cost model's default."""
    ref, base = reference_figures(model), reference_figures(BASELINE)
    dflt, base_d = model_defaults(model), model_defaults(BASELINE)
    return [
        Comparison(model, k, ref[k], dflt[k], ref[k] / base[k], dflt[k] / base_d[k])
        for k in sorted(ref)
        if k in dflt and k in base and k in base_d
    ]


# ------------------------------------------------------------------ whole-layer step curves

LAYER_PHASES = ("attention_us", "exchange_us", "expert_us", "step_us")
"""The phases of a step compared (microseconds, every layer of the model): attention phase
(norms, projections, attention kernel, router, shared expert or dense FFN), dispatch +
combine, routed experts, and the whole step."""


def layer_setups() -> tuple[str, ...]:
    """Names of the whole-layer setups in the data file (``layer_curves``)."""
    return tuple(sorted(reference_document().get("layer_curves", {})))


def layer_setup(name: str) -> dict[str, Any]:
    """One whole-layer setup of the data file: its model, phase, exchange, batches and,
    per GPU, the measured curve or why there is none."""
    setups = reference_document().get("layer_curves", {})
    if name not in setups:
        raise InputError(
            f"unknown reference setup {name!r}. To fix: use one of {', '.join(sorted(setups))}",
            field="setup",
        )
    return dict(setups[name])


def layer_source(name: str, model: str) -> str:
    """Where the measured curve of ``model`` in setup ``name`` comes from."""
    s = layer_setup(name)
    version = s["by_gpu"][model].get("sglang", "?")
    folder = reference_document()["gpus"][model]["folder"]
    return (
        f"aiconfigurator-core 0.12.0 step composition (its SDK's op graph for SGLang summed "
        f"over NVIDIA's per-operation tables of systems/data/{folder}, SGLang {version} "
        f"tables): {s['describe']}"
    )


def measured_layer_curve(name: str, model: str) -> dict[int, dict[str, float]]:
    """The measured step of ``model`` in setup ``name`` per batch (sequences per GPU):
    :data:`LAYER_PHASES` in microseconds; {} where the reference has no data for it."""
    g = layer_setup(name)["by_gpu"].get(model, {})
    return {
        int(b): {k: float(v[k]) for k in LAYER_PHASES} for b, v in g.get("by_batch", {}).items()
    }


def _one_node(model: str, count: int = 8) -> Fleet:
    """A fleet of one node with ``count`` GPUs of catalog ``model`` (NVLink when it has)."""
    from policies.hardware.fleet import Fleet, Gpu, GpuId, Node, NvLinkDomain

    spec = lookup(model)
    gpus = tuple(Gpu(GpuId(f"n/gpu{i}"), "n", i, spec) for i in range(count))
    nvlink = (
        NvLinkDomain("n", spec.nvlink_bidir_gbytes_per_s)
        if spec.nvlink_bidir_gbytes_per_s > 0
        else None
    )
    return Fleet(model, (Node("n", gpus, nvlink, ()),))


def model_layer_curve(
    name: str, model: str, eff: Efficiency | None = None
) -> dict[int, dict[str, float]]:
    """The cost model's step of setup ``name`` on 8 GPUs of ``model`` in one node, per batch
    (no calibration: catalog peaks times ``eff``, default :class:`Efficiency`): the
    ``uniform`` policy's native placement (equal attention shares, expert e on GPU
    ``e * 8 // E``, no replicas; uniform load), the setup's exchange. :data:`LAYER_PHASES`
    in microseconds, each phase summed over the layers at its slowest GPU (what
    :func:`policies.estimate.evaluation.evaluate` sums)."""
    from policies.estimate.costmodel import CostSettings, build_cost_table
    from policies.estimate.evaluation import evaluate
    from policies.estimate.workload import make_workload
    from policies.model.architecture import preset
    from policies.request import PlacementRequest
    from policies.solvers import uniform

    s = layer_setup(name)
    spec = preset(s["preset"])
    fleet = _one_node(model)
    settings = CostSettings() if eff is None else CostSettings(efficiency=eff)
    out: dict[int, dict[str, float]] = {}
    for b in s["batches"]:
        decode = s["phase"] == "decode"
        wl = make_workload(
            spec,
            phase=s["phase"],
            tokens_per_gpu=b if decode else b * int(s["context"]),
            context_len=int(s["context"]),
            kv_cache_dtype=s["kv_cache_dtype"],
        )
        table = build_cost_table(fleet, spec, wl, settings)
        req = PlacementRequest(fleet, spec, wl, "uniform", "native", 0, settings=settings)
        placed = uniform.place(req, table)
        ev = evaluate(table, placed.attention_share, placed.layers, s["exchange"])
        dense = ev.dense_layer
        attn = max(dense.attention_us) * ev.num_dense_layers if dense else 0.0
        attn += sum(max(t.attention_us) for t in ev.moe_layers)
        out[b] = {
            "attention_us": attn,
            "exchange_us": sum(max(max(t.comm_us), t.link_us) for t in ev.moe_layers),
            "expert_us": sum(max(t.expert_us) for t in ev.moe_layers),
            "step_us": ev.step_time_us,
        }
    return out


def layer_comparison(model: str, eff: Efficiency | None = None) -> list[Comparison]:
    """Every whole-layer step of ``model`` with reference data against the cost model, per
    setup and batch: figure ``"<setup> step_us @<batch>"``, ratios to the baseline GPU's
    step time in the same setup (a time ratio: above 1 is slower than the H200)."""
    out: list[Comparison] = []
    for name in layer_setups():
        ref, base = measured_layer_curve(name, model), measured_layer_curve(name, BASELINE)
        if not ref or not base:
            continue
        dflt, base_d = model_layer_curve(name, model, eff), model_layer_curve(name, BASELINE, eff)
        for b in sorted(ref):
            m, d = ref[b]["step_us"], dflt[b]["step_us"]
            out.append(
                Comparison(
                    model,
                    f"{name} step_us @{b}",
                    m,
                    d,
                    m / base[b]["step_us"],
                    d / base_d[b]["step_us"],
                )
            )
    return out


def layer_misses(model: str, eff: Efficiency | None = None) -> dict[str, tuple[int, ...]]:
    """Per setup, the batch sizes at which the cost model's step of ``model`` misses the
    reference by more than :data:`ABSOLUTE_TOLERANCE` or its ratio to the baseline by
    more than :data:`RATIO_TOLERANCE`."""
    out: dict[str, list[int]] = {}
    for c in layer_comparison(model, eff):
        if not c.within:
            setup, at = c.figure.split(" step_us @")
            out.setdefault(setup, []).append(int(at))
    return {k: tuple(v) for k, v in out.items()}
