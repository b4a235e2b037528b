"""From measured curves to planning inputs, pure (no torch, no I/O).

Owns :func:`figures_from_curves` (curves -> :class:`policies.costmodel.MeasuredFigures`
fields), the runtime-profile roofline fit of fixed overheads (:func:`overhead_figures`),
putting figures into an inventory (:func:`apply_calibration`), pooling same-model figures
that agree within noise (:func:`pool_within_noise`) and the fleet and cost settings a solve
needs (:func:`planning_inputs`).

Units: microseconds (``_us``), TFLOPS, GB/s (1e9 B/s), bytes.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

from agents.calibrate.options import CalibrationOptions, profile_model
from policies.costmodel import CostSettings, Efficiency, MeasuredFigures, measured_from_dict
from policies.fleet import Fleet, Gpu
from policies.inventory import NodeInventory, gpu_spec


def figures_from_curves(
    gpu: Mapping[str, Any],
    nccl: Mapping[str, Any] | None,
    profile: Mapping[str, Any] | None = None,
    *,
    options: CalibrationOptions | None = None,
    gpu_name: str = "",
    world: int = 1,
) -> dict[str, float]:
    """:class:`MeasuredFigures` fields from the raw curves.

    * ``gemm_bf16_tflops`` / ``gemm_fp8_tflops``: expert-FFN GEMM rate at the largest m;
    * ``gemm_launch_us``: median over m >= 64 of what one GEMM takes beyond its roofline
      ``max(FLOPs / peak, weight bytes / HBM)`` (half the FFN pair's excess);
    * ``hbm_gbytes_per_s``: copy bandwidth; ``attn_prefill_tflops``, ``attn_decode_gbytes_per_s``: SDPA;
    * ``nvlink_per_direction_gbytes_per_s``: remote bytes per rank over (time - latency) at the largest all-to-all;
    * ``expert_gemm_tflops``: grouped expert GEMM at >= 256 rows per expert (best point);
      ``expert_read_gbytes_per_s``: its weight-streaming rate at <= 16 rows per expert (median);
    * with a runtime ``profile``: what the runtime's phases take beyond the cost model's
      roofline terms (computed with the figures above), split into fixed costs and
      per-token / per-pair costs - see :func:`overhead_figures`.
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
    grouped = gpu.get("grouped_experts", {}).get("points", [])
    big_rows = [p["tflops"] for p in grouped if p["rows_per_expert"] >= 256]
    small_rows = [p["weight_gbytes_per_s"] for p in grouped if p["rows_per_expert"] <= 16]
    if big_rows:
        out["expert_gemm_tflops"] = float(max(big_rows))
    if small_rows:
        out["expert_read_gbytes_per_s"] = float(statistics.median(small_rows))
    if profile and options is not None:
        out.update(overhead_figures(out, profile, options, gpu_name=gpu_name, world=world))
    return out


_NEGLIGIBLE = 1e-9  # a measured figure that makes the cost model add (almost) nothing


def _profile_roofline(
    figures: Mapping[str, float],
    point: Mapping[str, Any],
    o: CalibrationOptions,
    gpu_name: str,
    world: int,
) -> tuple[float, float, float]:
    """The cost model's attention, comm and expert times (us) for one profile point of GPU 0
    with fixed costs and extras set to (almost) zero."""
    from policies.catalog import lookup
    from policies.costmodel import build_cost_table
    from policies.errors import InputError
    from policies.evaluation import LayerPlacement, evaluate
    from policies.fleet import GpuId, Node, NvLinkDomain
    from policies.workload import make_workload

    try:
        spec = lookup(gpu_name)
    except InputError:
        spec = lookup("H100-SXM5-80GB")
    node = Node(
        "profile",
        tuple(Gpu(GpuId(f"profile/gpu{i}"), "profile", i, spec) for i in range(world)),
        NvLinkDomain("profile", spec.nvlink_bidir_gbytes_per_s or 900.0) if world > 1 else None,
        (),
    )
    base = {k: v for k, v in figures.items() if k in MeasuredFigures.__dataclass_fields__}
    base.update(attn_overhead_us=_NEGLIGIBLE, expert_overhead_us=_NEGLIGIBLE)
    base.update(a2a_latency_us=_NEGLIGIBLE)
    m = measured_from_dict(base)
    settings = CostSettings(measured={g.id: m for g in node.gpus}, fp8_dispatch=o.fp8_dispatch)
    model = profile_model(o, experts=int(point["experts"]), top_k=int(point["top_k"]))
    wl = make_workload(
        model,
        phase="decode" if point["decode"] else "prefill",
        tokens_per_gpu=int(point["tokens_per_gpu"]),
        context_len=int(point["context"]),
    )
    table = build_cost_table(Fleet("profile", (node,)), model, wl, settings)
    e = model.num_experts
    layer = LayerPlacement(
        tuple(tuple((x, 1.0) for x in range(e) if x * world // e == r) for r in range(world))
    )
    t = evaluate(table, [1.0 / world] * world, [layer]).moe_layers[0]
    return t.attention_us[0], t.comm_us[0], t.expert_us[0]


def overhead_figures(
    figures: Mapping[str, float],
    profile: Mapping[str, Any],
    o: CalibrationOptions,
    *,
    gpu_name: str = "",
    world: int = 1,
) -> dict[str, float]:
    """Fixed and per-token / per-pair costs of the runtime beyond the roofline.

    With ``r = measured - roofline`` per phase group - attention; comm (dispatch +
    combine); experts (experts + output) - at the decode point (``T_d`` tokens, ``P_d =
    T_d * top_k`` pairs per GPU) and the large point (``T_l``, ``P_l``), a straight line
    through both::

        attn_extra_us_per_token  = (r_attn(l) - r_attn(d)) / (T_l - T_d)
        attn_overhead_us         = r_attn(d) - attn_extra_us_per_token * T_d
        expert_extra_us_per_pair = (r_ce(l) - r_ce(d)) / (P_l - P_d),  r_ce = r_comm + r_exp
        a2a_latency_us           = r_comm(d) / 2                 (one dispatch, one combine)
        expert_overhead_us       = r_ce(d) - expert_extra_us_per_pair * P_d - 2 a2a_latency_us

    Every figure is kept above a small positive floor (a negative residual means the
    roofline alone is already slower than the runtime).
    """
    floor = 1e-3
    dec, large = profile["decode"], profile["large"]
    res = {}
    for name, point in (("d", dec), ("l", large)):
        ph = point["phases_us"]
        a, c, e = _profile_roofline(figures, point, o, gpu_name, world)
        res[name] = (
            ph["attention"] - a,
            ph["dispatch"] + ph["combine"] - c,
            ph["experts"] + ph["output"] - e,
        )
    t_d, t_l = dec["tokens_per_gpu"], large["tokens_per_gpu"]
    p_d, p_l = t_d * dec["top_k"], t_l * large["top_k"]
    (ra_d, rc_d, re_d), (ra_l, rc_l, re_l) = res["d"], res["l"]
    attn_extra = max(floor, (ra_l - ra_d) / max(t_l - t_d, 1))
    pair_extra = max(floor, (rc_l + re_l - rc_d - re_d) / max(p_l - p_d, 1))
    a2a = max(floor, rc_d / 2.0)
    return {
        "attn_overhead_us": max(floor, ra_d - attn_extra * t_d),
        "attn_extra_us_per_token": attn_extra,
        "a2a_latency_us": a2a,
        "expert_overhead_us": max(floor, rc_d + re_d - pair_extra * p_d - 2 * a2a),
        "expert_extra_us_per_pair": pair_extra,
    }


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
