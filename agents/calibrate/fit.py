"""From measured curves to planning inputs, pure (no torch, no I/O).

Owns :func:`figures_from_curves` (curves -> :class:`policies.estimate.costmodel.MeasuredFigures`
fields; the fast runtime's measured kernel rates and fixed costs, :func:`runtime_overheads`),
keeping only the figures that repeated calibrations agree on (:func:`stable_figures`), putting figures into an inventory (:func:`apply_calibration`), pooling same-model figures
that agree within noise (:func:`pool_within_noise`) and the fleet and cost settings a solve
needs (:func:`planning_inputs`).

Units: microseconds (``_us``), TFLOPS, GB/s (1e9 B/s), bytes.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from policies.estimate.costmodel import (
    CostSettings,
    Efficiency,
    MeasuredFigures,
    active_fraction,
    build_cost_table,
    measured_from_dict,
)
from policies.estimate.evaluation import LayerPlacement, evaluate
from policies.estimate.workload import make_workload
from policies.hardware.catalog import lookup
from policies.hardware.fleet import Fleet, Gpu, GpuId, Node
from policies.hardware.inventory import NodeInventory, gpu_spec
from policies.model.architecture import ModelSpec


def figures_from_curves(
    gpu: Mapping[str, Any],
    nccl: Mapping[str, Any] | None,
    runtime: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """:class:`MeasuredFigures` fields from the raw curves.

    * ``gemm_bf16_tflops`` / ``gemm_fp8_tflops``: expert-FFN GEMM rate at the largest m;
    * ``gemm_launch_us``: without ``runtime``, median over m >= 64 of what one GEMM takes
      beyond its roofline ``max(FLOPs / peak, weight bytes / HBM)`` (half the FFN pair's
      excess, at least 1 us);
    * ``hbm_gbytes_per_s``: copy bandwidth; ``attn_prefill_tflops``, ``attn_decode_gbytes_per_s``: SDPA;
    * ``nvlink_per_direction_gbytes_per_s``: remote bytes per rank over (time - latency) at the largest all-to-all;
    * ``expert_gemm_tflops``: grouped expert GEMM at >= 256 rows per expert (best point);
      ``expert_read_gbytes_per_s``: its weight-streaming rate at <= 16 rows per expert (median);
    * with ``runtime`` (:func:`agents.calibrate.runtime_figures.runtime_figures`, the fast
      runtime's own kernels): its attention and expert rates replace the curves' ones,
      ``gemm_launch_us`` is the measured per-kernel latency in a CUDA graph, and the fixed
      costs are counts times that latency: ``attn_overhead_us`` (kernels of the attention
      phase) and ``expert_overhead_us`` (kernels of dispatch, experts and combine). A phase
      whose kernels could not be counted gets no fixed cost (the model's default applies).
    """
    g = gpu["gemm"]
    bf16 = g["bf16"]
    peak = max(p["tflops"] for p in bf16[-3:])
    hbm = float(gpu["hbm_copy"]["gbytes_per_s"])
    out: dict[str, float] = {
        "gemm_bf16_tflops": float(peak),
        "hbm_gbytes_per_s": hbm,
        "attn_prefill_tflops": float(gpu["attention"]["prefill"]["tflops"]),
        "attn_decode_gbytes_per_s": float(gpu["attention"]["decode"]["gbytes_per_s"]),
    }
    if g.get("fp8"):
        out["gemm_fp8_tflops"] = float(max(p["tflops"] for p in g["fp8"][-3:]))
    flops_tok = float(g["flops_per_token"])  # 6 H F
    pair_bytes = flops_tok  # the pair's 3 H F BF16 weights: 6 H F bytes
    excess = []
    for p in bf16:
        if p["m"] >= 64:
            roof = max(flops_tok * p["m"] / (peak * 1e6), pair_bytes / (hbm * 1e3))
            excess.append((p["us"] - roof) / 2.0)
    if excess:
        out["gemm_launch_us"] = max(1.0, float(statistics.median(excess)))
    if nccl and nccl.get("points"):
        pts = nccl["points"]
        alpha = float(pts[0]["us"])
        big = pts[-1]
        remote = big["tokens_per_rank"] * (nccl["world"] - 1) * nccl["hidden"] * 2.0
        out["nvlink_per_direction_gbytes_per_s"] = remote / max(big["us"] - alpha, 1e-3) / 1e3
        out["a2a_latency_us"] = alpha  # one all-to-all of one token per rank
    grouped = gpu.get("grouped_experts", {}).get("points", [])
    big_rows = [p["tflops"] for p in grouped if p["rows_per_expert"] >= 256]
    small_rows = [p["weight_gbytes_per_s"] for p in grouped if p["rows_per_expert"] <= 16]
    if big_rows:
        out["expert_gemm_tflops"] = float(max(big_rows))
    if small_rows:
        out["expert_read_gbytes_per_s"] = float(statistics.median(small_rows))
    if runtime:
        out.update(runtime_overheads(runtime))
    return out


def runtime_overheads(runtime: Mapping[str, Any]) -> dict[str, float]:
    """The fast runtime's figures, each a measurement of its own kernels: attention and
    expert rates replace the curves' ones; the rate its attention phase streams dense
    weights at decode batch is ``hbm_gbytes_per_s`` and its dense GEMM rate in prefill
    ``gemm_bf16_tflops`` (the figures the cost model reads and computes dense weights
    with); the per-token and per-pair times of its other kernels are
    ``attn_extra_us_per_token`` and ``expert_extra_us_per_pair``; the fixed costs are the
    idle time between a decode step's kernels in a CUDA-graph replay (graph time minus the
    kernels' durations): ``attn_overhead_us`` (attention phase) and ``expert_overhead_us``
    (dispatch, experts and combine), present only when positive."""
    keys = (
        "attn_decode_gbytes_per_s",
        "attn_prefill_tflops",
        "expert_read_gbytes_per_s",
        "expert_gemm_tflops",
        "attn_extra_us_per_token",
        "expert_extra_us_per_pair",
    )
    out = {k: float(runtime[k]) for k in keys if runtime.get(k)}
    if runtime.get("dense_read_gbytes_per_s"):  # the cost model reads dense weights at hbm
        out["hbm_gbytes_per_s"] = float(runtime["dense_read_gbytes_per_s"])
    if runtime.get("dense_gemm_tflops"):  # ... and computes dense FLOPs at the BF16 rate
        out["gemm_bf16_tflops"] = float(runtime["dense_gemm_tflops"])
    if runtime.get("attn_gap_us"):
        out["attn_overhead_us"] = float(runtime["attn_gap_us"])
    if runtime.get("expert_gap_us"):
        out["expert_overhead_us"] = float(runtime["expert_gap_us"])
    # Fitted over several sizes (sweep_figures): these replace the single-shape figures.
    out.update({k: float(v) for k, v in (runtime.get("sweep_figures") or {}).items()})
    return out


#: Repeated calibrations of one GPU whose values of a figure spread by more than this
#: (max / min - 1) do not give that figure: it is dropped, with the spread as the reason.
STABILITY_TOLERANCE = 0.05


def stable_figures(
    runs: Sequence[Mapping[str, float]], tolerance: float = STABILITY_TOLERANCE
) -> tuple[dict[str, float], dict[str, str]]:
    """Figures of repeated calibrations of one GPU: each figure present in every run and
    positive, whose runs agree within ``tolerance``, as their mean; every other figure
    dropped, with the reason. Returns (figures, dropped: figure -> reason)."""
    keys = sorted(set().union(*(r.keys() for r in runs))) if runs else []
    kept: dict[str, float] = {}
    dropped: dict[str, str] = {}
    for k in keys:
        values = [r[k] for r in runs if k in r]
        if len(values) < len(runs):
            dropped[k] = f"measured in {len(values)} of {len(runs)} runs"
        elif min(values) <= 0:
            dropped[k] = f"not positive in every run ({min(values):.4g})"
        elif (spread := max(values) / min(values) - 1.0) > tolerance:
            dropped[k] = f"runs spread by {spread:.1%} (> {tolerance:.0%}): " + ", ".join(
                f"{v:.4g}" for v in values
            )
        else:
            kept[k] = sum(values) / len(values)
    return kept, dropped


# ------------------------------------------------------------------ inventory, planning


def apply_calibration(inv: NodeInventory, calibration: Mapping[str, Any]) -> NodeInventory:
    """The inventory with each GPU's measured figures (matched by UUID, else by index).

    Raises:
        InputError: a figure is not a :class:`MeasuredFigures` field or not > 0.
    """
    by_uuid = {str(g.get("uuid", "")): g for g in calibration.get("gpus", [])}
    by_index = {int(g["index"]): g for g in calibration.get("gpus", [])}
    gpus = []
    for g in inv.gpus:
        cal = by_uuid.get(g.uuid) or by_index.get(g.index)
        if cal is None:
            gpus.append(g)
            continue
        figures = measured_from_dict(cal.get("measured", {}))
        measured = {k: v for k, v in asdict(figures).items() if v is not None}
        gpus.append(replace(g, measured=measured))
    return replace(inv, gpus=tuple(gpus))


#: Figures of same-model GPUs of a node that agree within this fraction are measurement
#: noise around one true value: they are pooled (averaged) so identical GPUs plan as equals.
NOISE_TOLERANCE = 0.10


def pool_within_noise(
    inventories: Sequence[NodeInventory], tolerance: float = NOISE_TOLERANCE
) -> list[NodeInventory]:
    """Inventories where, per node and GPU model, every measured figure whose values agree
    within ``tolerance`` (max / min - 1) is replaced by its mean; a GPU measured genuinely
    slower (outside the tolerance) keeps its own figure."""
    out = []
    for inv in inventories:
        groups: dict[str, list[int]] = {}
        for k, g in enumerate(inv.gpus):
            groups.setdefault(g.catalog_model or g.name, []).append(k)
        measured = [dict(g.measured) for g in inv.gpus]
        for members in groups.values():
            keys = set().union(*(measured[k].keys() for k in members))
            for key in keys:
                values = [measured[k][key] for k in members if key in measured[k]]
                if len(values) != len(members) or min(values) <= 0:
                    continue
                if max(values) / min(values) - 1 <= tolerance:
                    mean = sum(values) / len(values)
                    for k in members:
                        measured[k][key] = mean
        gpus = tuple(replace(g, measured=m) for g, m in zip(inv.gpus, measured, strict=True))
        out.append(replace(inv, gpus=gpus))
    return out


def planning_inputs(
    inventories: Sequence[NodeInventory],
    name: str = "calibrated",
    efficiency: Efficiency | None = None,
    fp8_dispatch: bool | None = None,
    noise_tolerance: float = NOISE_TOLERANCE,
) -> tuple[Fleet, CostSettings]:
    """Fleet and cost settings for a solve from calibrated inventories.

    Each GPU's spec carries its measured figures (catalog peaks replaced by measured rate /
    default efficiency, so the cost model's defaults would give the measured figure), so
    GPUs that measured differently are different specs - solvers that group identical
    GPUs then keep them apart - and the settings carry the same figures per GPU id, which
    the cost model prefers. ``fp8_dispatch`` is the runtime's dispatch dtype (None: the
    cost model's default). Figures of same-model GPUs that agree within
    ``noise_tolerance`` are pooled first (:func:`pool_within_noise`).
    """
    eff = efficiency or Efficiency()
    inventories = pool_within_noise(inventories, noise_tolerance)
    nodes = []
    measured: dict[str, MeasuredFigures] = {}
    for inv in inventories:
        node = inv.to_node()
        gpus = []
        for g, ginv in zip(node.gpus, [x for x in inv.gpus if x.health.healthy], strict=True):
            m = ginv.measured
            spec = gpu_spec(ginv)
            over: dict[str, float] = {}
            if m.get("gemm_bf16_tflops"):
                over["bf16_tflops"] = m["gemm_bf16_tflops"] / eff.gemm_bf16
            if m.get("gemm_fp8_tflops") and spec.fp8_tflops > 0:
                over["fp8_tflops"] = m["gemm_fp8_tflops"] / eff.gemm_fp8
            if m.get("hbm_gbytes_per_s"):
                over["hbm_bandwidth_gbytes_per_s"] = m["hbm_gbytes_per_s"] / eff.hbm
            spec = replace(spec.with_overrides(over), model=spec.model)
            gpus.append(Gpu(g.id, g.node, g.index, spec, g.uuid))
            if m:
                measured[g.id] = measured_from_dict(m)
        nodes.append(replace(node, gpus=tuple(gpus)))
    return Fleet(name, tuple(nodes)), CostSettings(measured=measured, fp8_dispatch=fp8_dispatch)


# ------------------------------------------------------- phase sweep: rates, fixed costs


def layer_phase_times(
    model: ModelSpec,
    *,
    decode: bool,
    tokens: int,
    context: int,
    figures: Mapping[str, float],
    gpu_model: str = "H200-SXM-141GB",
) -> dict[str, float]:
    """The cost model's phase times for one MoE layer of ``model`` on one GPU of
    ``gpu_model`` holding every expert once, uniform load, serving ``tokens`` (decode:
    sequences with ``context`` cached tokens each; prefill: sequences of ``context``), with
    calibrated ``figures``, microseconds: ``attention_us``, ``expert_us``, ``comm_us`` (the
    model's all-to-all latency) and ``layer_us`` (attention + experts: one GPU exchanges
    nothing)."""
    spec = lookup(gpu_model)
    gpu = Gpu(GpuId("gpu/0"), "gpu", 0, spec)
    fleet = Fleet("one-gpu", (Node("gpu", (gpu,), None, ()),))
    settings = CostSettings(measured={gpu.id: measured_from_dict(figures)}, fp8_dispatch=False)
    wl = make_workload(
        model, phase="decode" if decode else "prefill", tokens_per_gpu=tokens, context_len=context
    )
    table = build_cost_table(fleet, model, wl, settings)
    layer = LayerPlacement((tuple((e, 1.0) for e in range(model.num_experts)),))
    t = evaluate(table, [1.0], [layer]).moe_layers[0]
    return {
        "attention_us": t.attention_us[0],
        "comm_us": t.comm_us[0],
        "expert_us": t.expert_us[0],
        "layer_us": t.attention_us[0] + t.expert_us[0],
    }


@dataclass(frozen=True)
class PhasePoint:
    """One measured step of the fast runtime's layer on one GPU (all experts local).

    Attributes:
        model: the layer's model (:func:`bench.gpu_model.layer_model` form).
        decode, tokens, context: the step (decode: sequences x cached tokens; prefill:
            tokens in sequences of ``context``).
        attention_us: the attention phase inside the step's graph, us.
        expert_us: dispatch + experts + combine inside the step's graph, us.
        kernels: per phase the kernel-time split (``gemm_us``, ``attention_us``,
            ``other_us``) of :func:`agents.calibrate.runtime_figures.kernel_split`, or None.
    """

    model: ModelSpec
    decode: bool
    tokens: int
    context: int
    attention_us: float
    expert_us: float
    kernels: Mapping[str, Any] | None = None

    @property
    def pairs(self) -> float:
        return float(self.tokens * self.model.top_k)

    @property
    def pairs_per_expert(self) -> float:
        return self.pairs / self.model.num_experts


def _dense_params(m: ModelSpec) -> float:
    """Attention-phase weights of one MoE layer: projections, shared expert, router."""
    return m.attn_params_per_layer + m.shared_expert_params + m.hidden * m.num_experts


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def kernel_rates(points: Sequence[PhasePoint]) -> dict[str, float]:
    """The runtime's kernel rates from the points' kernel splits (each the median over
    the points that exercise it): dense weights streamed by the attention phase's GEMMs
    at <= 64 sequences (``hbm_gbytes_per_s``) and their prefill rate
    (``gemm_bf16_tflops``); the decode attention kernel's KV bandwidth, the slope of its
    time against the KV bytes read (``attn_decode_gbytes_per_s``), and its prefill rate
    (``attn_prefill_tflops``); the expert GEMMs' weight streaming at <= 16 pairs per
    expert, the slope of their time against the bytes of the experts that get pairs
    (``expert_read_gbytes_per_s``), and their prefill rate against rows per expert (at
    >= 100 rows, past weight streaming), ``peak * rows / (rows + scale)`` fitted by least
    squares (``expert_gemm_tflops``,
    ``expert_gemm_rows_scale``)."""
    dense_read, dense_rate = [], []
    attn_pts: list[tuple[float, float, float]] = []
    kv_pts: list[tuple[float, float]] = []
    read_pts: list[tuple[float, float]] = []
    curve: list[tuple[float, float]] = []
    for p in points:
        k = p.kernels or {}
        a, e = k.get("attention") or {}, k.get("experts") or {}
        m = p.model
        if p.decode:
            if a.get("gemm_us") and p.tokens <= 64:
                dense_read.append(_dense_params(m) * 2.0 / a["gemm_us"] / 1e3)
            kv = p.tokens * m.kv_read_elements_per_token_per_layer(p.context) * 2.0
            if a.get("attention_us"):
                kv_pts.append((kv, a["attention_us"]))
            if e.get("gemm_us") and p.pairs_per_expert <= 16.0:
                read = m.num_experts * active_fraction(p.pairs_per_expert) * m.expert_bytes
                read_pts.append((read, e["gemm_us"]))
        else:
            if a.get("gemm_us"):
                dense_rate.append(2.0 * p.tokens * _dense_params(m) / a["gemm_us"] / 1e6)
            if a.get("attention_us"):
                flops = p.tokens * m.attn_core_flops_per_token(p.context / 2.0, decode=False)
                attn_pts.append((flops, p.tokens / p.context, a["attention_us"]))
            if e.get("gemm_us"):
                rate = 2.0 * m.expert_params * p.pairs / e["gemm_us"] / 1e6
                curve.append((p.pairs_per_expert, rate))
    out: dict[str, float] = {}
    out.update(_prefill_attention(attn_pts))
    for key, vals in (
        ("hbm_gbytes_per_s", dense_read),
        ("gemm_bf16_tflops", dense_rate),
    ):
        v = _median(vals)
        if v:
            out[key] = v
    # Streaming kernels: time = latency + bytes / bandwidth over the sizes; the bandwidth is
    # the slope (the latency joins the fixed costs fitted later).
    for key, pts in (("attn_decode_gbytes_per_s", kv_pts), ("expert_read_gbytes_per_s", read_pts)):
        if len({b for b, _ in pts}) >= 2:
            _, per_byte = _line([b for b, _ in pts], [t for _, t in pts], [1.0 / t for _, t in pts])
            if per_byte > 0:
                out[key] = 1.0 / per_byte / 1e3
    if curve:
        out.update(_fit_rate_curve(curve))
    return out


def _prefill_attention(pts: Sequence[tuple[float, float, float]]) -> dict[str, float]:
    """Prefill attention kernel time = FLOPs / rate + sequences x per-sequence time, by
    least squares in relative terms over (FLOPs, sequences, us) points of at least two
    sequence lengths; else the rate alone (median)."""
    if not pts:
        return {}
    ratios = {f / n for f, n, _ in pts}
    if len(ratios) >= 2:
        a = np.array([[f / t, n / t] for f, n, t in pts])
        inv_rate, per_seq = (float(v) for v in np.linalg.lstsq(a, np.ones(len(pts)), rcond=None)[0])
        if inv_rate > 0 and per_seq >= 0:
            out = {"attn_prefill_tflops": 1.0 / inv_rate / 1e6}
            if per_seq > 0:
                out["attn_prefill_us_per_sequence"] = per_seq
            return out
    return {"attn_prefill_tflops": float(statistics.median(f / t / 1e6 for f, _, t in pts))}


def _fit_rate_curve(curve: Sequence[tuple[float, float]]) -> dict[str, float]:
    """``peak * rows / (rows + scale)`` through (rows, TFLOPS) points: the time per row,
    ``1 / rate``, is linear in ``1 / rows`` (``(1 + scale / rows) / peak``), fitted by
    least squares in relative terms; one point gives the peak alone."""
    if len(curve) < 2:
        return {"expert_gemm_tflops": max(y for _, y in curve)}
    xs = [1.0 / r for r, _ in curve]
    ys = [1.0 / y for _, y in curve]
    inv_peak, slope = _line(xs, ys, [y for _, y in curve])
    if inv_peak <= 0:
        return {"expert_gemm_tflops": max(y for _, y in curve)}
    out = {"expert_gemm_tflops": 1.0 / inv_peak}
    if slope > 0:
        out["expert_gemm_rows_scale"] = slope / inv_peak
    return out


#: Figures that make the cost model's fixed costs vanish, for fitting them (a figure must
#: be > 0, so a negligible value stands for none).
NO_FIXED_COSTS = {
    "attn_overhead_us": 1e-9,
    "attn_extra_us_per_token": 1e-12,
    "attn_decode_extra_us_per_token": 1e-12,
    "expert_overhead_us": 1e-9,
    "expert_extra_us_per_pair": 1e-12,
    "expert_decode_extra_us_per_pair": 1e-12,
}


def _line(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> tuple[float, float]:
    """Intercept and slope, both >= 0, of ``y = c0 + c1 x`` by weighted least squares
    (weights ``ws`` on the residuals)."""
    a = np.array([[w, w * x] for x, w in zip(xs, ws, strict=True)])
    b = np.array([w * y for y, w in zip(ys, ws, strict=True)])
    c0, c1 = (float(v) for v in np.linalg.lstsq(a, b, rcond=None)[0])
    if c1 < 0:  # no growth with size: the intercept alone
        c1 = 0.0
        c0 = float(np.dot(a[:, 0], b) / np.dot(a[:, 0], a[:, 0]))
    if c0 < 0:  # no fixed part: the slope alone
        c0 = 0.0
        c1 = max(0.0, float(np.dot(a[:, 1], b) / np.dot(a[:, 1], a[:, 1])))
    return c0, c1


def _through_origin(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> float:
    """Slope >= 0 of ``y = c x`` by weighted least squares."""
    num = sum(w * w * x * y for x, y, w in zip(xs, ys, ws, strict=True))
    den = sum(w * w * x * x for x, w in zip(xs, ws, strict=True))
    return max(0.0, num / den) if den > 0 else 0.0


def fixed_costs(
    points: Sequence[PhasePoint], rates: Mapping[str, float]
) -> tuple[dict[str, float], dict[str, Any]]:
    """The fixed costs as intercept and slope over several sizes: per phase, what each
    point measured beyond the cost model's prediction with ``rates`` and no fixed costs.
    Over the decode points it is fitted as ``c0 + c1 x`` by least squares in relative
    terms (x: tokens for attention, token-expert pairs for experts): ``c0`` is the phase's
    fixed cost (``attn_overhead_us``, ``expert_overhead_us``), ``c1`` its decode time per
    token or pair (``attn_decode_extra_us_per_token``, ``expert_decode_extra_us_per_pair``);
    over the prefill points, what remains after ``c0`` is fitted as ``c x``
    (``attn_extra_us_per_token``, ``expert_extra_us_per_pair``). Returns (the figures that
    are > 0, the residuals the fit saw)."""
    base = {**rates, **NO_FIXED_COSTS}
    res: dict[bool, dict[str, list[float]]] = {
        d: {k: [] for k in ("ra", "re", "xa", "xe", "wa", "we")} for d in (True, False)
    }
    for p in points:
        pred = layer_phase_times(
            p.model, decode=p.decode, tokens=p.tokens, context=p.context, figures=base
        )
        r = res[p.decode]
        r["ra"].append(p.attention_us - pred["attention_us"])
        r["re"].append(p.expert_us - pred["expert_us"])
        r["xa"].append(float(p.tokens))
        r["xe"].append(p.pairs)
        r["wa"].append(1.0 / p.attention_us)
        r["we"].append(1.0 / p.expert_us)
    figures: dict[str, float] = {}
    dec, pre = res[True], res[False]
    a0 = e0 = 0.0
    if dec["ra"]:
        a0, a1 = _line(dec["xa"], dec["ra"], dec["wa"])
        e0, e1 = _line(dec["xe"], dec["re"], dec["we"])
        figures.update(
            attn_overhead_us=a0,
            attn_decode_extra_us_per_token=a1,
            expert_overhead_us=e0,
            expert_decode_extra_us_per_pair=e1,
        )
    if pre["ra"]:
        figures["attn_extra_us_per_token"] = _through_origin(
            pre["xa"], [y - a0 for y in pre["ra"]], pre["wa"]
        )
        figures["expert_extra_us_per_pair"] = _through_origin(
            pre["xe"], [y - e0 for y in pre["re"]], pre["we"]
        )
    detail = {
        "decode_attention_residual_us": dec["ra"],
        "decode_expert_residual_us": dec["re"],
        "prefill_attention_residual_us": pre["ra"],
        "prefill_expert_residual_us": pre["re"],
    }
    return {k: v for k, v in figures.items() if v > 0}, detail


def sweep_figures(points: Sequence[PhasePoint]) -> tuple[dict[str, float], dict[str, Any]]:
    """:class:`MeasuredFigures` fields from a sweep of measured steps: the kernel rates
    (:func:`kernel_rates`), then the fixed costs over the sizes (:func:`fixed_costs`)."""
    rates = kernel_rates(points)
    fixed, detail = fixed_costs(points, rates)
    return {**rates, **fixed}, detail
