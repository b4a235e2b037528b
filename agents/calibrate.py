"""``mixfleet-agent calibrate``: measure what each GPU of this node really achieves.

Per GPU (one process per GPU, all GPUs at once, so each is measured as it runs in service):

* GEMM throughput at expert-FFN shapes (``[m, hidden] x [hidden, 2 ffn]`` then
  ``[m, ffn] x [ffn, hidden]``) for token counts m = 1..8192, in BF16 and in FP8
  (``torch._scaled_mm``, per-tensor scales; m padded to a multiple of 16);
* the grouped expert GEMM the reference runtime runs (``torch._grouped_mm`` over the
  experts of one GPU) for 1..512 rows per expert: small batches show the weight-streaming
  bandwidth, large ones the grouped compute rate;
* device-memory bandwidth (a device-to-device copy, bytes read plus written);
* attention through PyTorch SDPA's flash backend at a prefill shape (causal) and a decode
  shape (one query per sequence over a KV cache), and through ``flash_attn`` when installed;
* between the node's GPUs, NCCL ``all_to_all_single`` time for 1..16384 tokens per rank and
  the runtime's dispatch + combine round trip for one token (its fixed latency).

The result is a JSON document: per GPU the :class:`policies.costmodel.MeasuredFigures`
(``measured``), the raw curves, and how long calibration took. :func:`apply_calibration`
puts the figures into a :class:`NodeInventory`; :func:`planning_inputs` builds the fleet and
cost settings a solve needs from such an inventory.

torch is optional (``pip install 'mixfleet[gpu]'``): it is imported only when calibration
runs, and a clear error says how to install it when missing.

Units: microseconds (``_us``), TFLOPS, GB/s (1e9 B/s), bytes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from policies.costmodel import CostSettings, Efficiency, MeasuredFigures, measured_from_dict
from policies.fleet import Fleet, Gpu
from policies.inventory import NodeInventory, gpu_spec
from policies.models import ModelSpec

Tensor = Any  # torch.Tensor
DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_ROWS_PER_EXPERT = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_A2A_TOKENS = (1, 16, 128, 1024, 4096, 16384)
L2_FLUSH_BYTES = 256 * 2**20  # rotate inputs over at least this much (H200 L2: 60 MB)


@dataclass(frozen=True)
class CalibrationOptions:
    """Shapes and effort of a calibration.

    Attributes:
        hidden: model width (elements); DeepSeek-V3: 7168.
        expert_ffn: routed expert intermediate size; DeepSeek-V3: 2048.
        experts_per_gpu: experts in the grouped-GEMM measurement.
        num_q_heads, num_kv_heads, head_dim: attention shape.
        prefill_seq: prefill sequence length, tokens.
        prefill_tokens: tokens per prefill measurement (whole sequences).
        decode_batch: sequences in the decode measurement.
        decode_context: KV length per sequence in decode, tokens.
        token_counts: GEMM token counts m.
        rows_per_expert: grouped-GEMM rows per expert.
        a2a_tokens: tokens per rank in the all-to-all measurements.
        iters: timed repetitions per point (median reported).
        nccl: measure the all-to-all between the GPUs (needs every GPU's process).
        num_experts, top_k, num_shared_experts: MoE shape of the runtime profile.
        profile_decode_tokens, profile_decode_context: sequences per GPU and their KV
            length in the decode point of the runtime profile.
        profile_tokens: tokens per GPU of the large (prefill) point of the runtime profile.
        fp8_dispatch: the runtime profile dispatches in FP8 (else BF16).
    """

    hidden: int = 7168
    expert_ffn: int = 2048
    experts_per_gpu: int = 128
    num_q_heads: int = 128
    num_kv_heads: int = 8
    head_dim: int = 128
    prefill_seq: int = 2048
    prefill_tokens: int = 4096
    decode_batch: int = 128
    decode_context: int = 4096
    token_counts: tuple[int, ...] = DEFAULT_TOKEN_COUNTS
    rows_per_expert: tuple[int, ...] = DEFAULT_ROWS_PER_EXPERT
    a2a_tokens: tuple[int, ...] = DEFAULT_A2A_TOKENS
    iters: int = 10
    nccl: bool = True
    num_experts: int = 256
    top_k: int = 8
    num_shared_experts: int = 1
    profile_decode_tokens: int = 64
    profile_decode_context: int = 2048
    profile_tokens: int = 8192
    fp8_dispatch: bool = False


# ------------------------------------------------------------------------------ timing


def _torch() -> Any:
    """Import torch or explain how to get it.

    Raises:
        RuntimeError: torch is not installed or sees no CUDA GPU.
    """
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError(
            "calibration needs PyTorch. To fix: pip install 'mixfleet[gpu]' (torch >= 2.4 "
            "built for this host's CUDA driver)"
        ) from exc
    if not torch.cuda.is_available():
        raise RuntimeError(
            "calibration needs an NVIDIA GPU visible to PyTorch (torch.cuda.is_available() is "
            "False). To fix: run on a GPU node with the NVIDIA driver and a CUDA build of torch"
        )
    return torch


def time_us(fn: Callable[[int], Any], iters: int, warmup: int = 2) -> float:
    """Median time of ``fn(i)`` on the current CUDA stream, microseconds.

    Uses CUDA events and waits on the last one only (never a device-wide synchronize, so
    it works next to a kernel that occupies part of the GPU indefinitely).
    """
    import torch

    for i in range(warmup):
        fn(i)
    pairs = []
    for i in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn(warmup + i)
        b.record()
        pairs.append((a, b))
    pairs[-1][1].synchronize()
    return float(statistics.median(a.elapsed_time(b) * 1e3 for a, b in pairs))


def _copies(bytes_each: float) -> int:
    return max(1, math.ceil(L2_FLUSH_BYTES / max(bytes_each, 1.0)))


# ------------------------------------------------------------------------- measurements


def gemm_curves(device: Any, o: CalibrationOptions) -> dict[str, Any]:
    """Expert-FFN GEMM time and throughput per token count, BF16 and FP8.

    One point = ``[m, H] x [H, 2F]`` plus ``[m, F] x [F, H]``: ``6 m H F`` FLOPs.
    """
    torch = _torch()
    h, f = o.hidden, o.expert_ffn
    wbytes = 3 * h * f * 2
    n = _copies(wbytes)
    w13 = [torch.randn(2 * f, h, device=device, dtype=torch.bfloat16) for _ in range(n)]
    w2 = [torch.randn(h, f, device=device, dtype=torch.bfloat16) for _ in range(n)]
    fp8 = hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn")
    w13_8 = [w.to(torch.float8_e4m3fn) for w in w13] if fp8 else []
    w2_8 = [w.to(torch.float8_e4m3fn) for w in w2] if fp8 else []
    one = torch.ones((), device=device, dtype=torch.float32)
    out: dict[str, Any] = {"bf16": [], "fp8": [], "flops_per_token": 6.0 * h * f}
    for m in o.token_counts:
        x = torch.randn(m, h, device=device, dtype=torch.bfloat16)
        g = torch.randn(m, f, device=device, dtype=torch.bfloat16)

        def bf16(i: int, x: Tensor = x, g: Tensor = g) -> None:
            k = i % n
            x @ w13[k].t()
            g @ w2[k].t()

        t = time_us(bf16, o.iters)
        out["bf16"].append({"m": m, "us": t, "tflops": 6.0 * m * h * f / t / 1e6})
        if fp8:
            mp = max(16, -(-m // 16) * 16)
            x8 = torch.randn(mp, h, device=device).to(torch.float8_e4m3fn)
            g8 = torch.randn(mp, f, device=device).to(torch.float8_e4m3fn)

            def f8(i: int, x8: Tensor = x8, g8: Tensor = g8) -> None:
                k = i % n
                torch._scaled_mm(x8, w13_8[k].t(), one, one, out_dtype=torch.bfloat16)
                torch._scaled_mm(g8, w2_8[k].t(), one, one, out_dtype=torch.bfloat16)

            try:
                t8 = time_us(f8, o.iters)
                out["fp8"].append(
                    {"m": m, "m_padded": mp, "us": t8, "tflops": 6.0 * mp * h * f / t8 / 1e6}
                )
            except RuntimeError as exc:  # FP8 GEMM not supported on this GPU or build
                out["fp8_error"] = str(exc).splitlines()[0]
                fp8 = False
    a = torch.randn(16, 128, device=device, dtype=torch.bfloat16)
    b = torch.randn(128, 128, device=device, dtype=torch.bfloat16)
    out["tiny_gemm_us"] = time_us(lambda i: a @ b, max(o.iters, 20))
    return out


def grouped_expert_curve(device: Any, o: CalibrationOptions) -> dict[str, Any]:
    """The runtime's grouped expert FFN over ``experts_per_gpu`` experts, per rows/expert."""
    torch = _torch()
    from agents.runtime.layer import grouped_swiglu

    s, h, f = o.experts_per_gpu, o.hidden, o.expert_ffn
    w13 = torch.randn(s, 2 * f, h, device=device, dtype=torch.bfloat16) * h**-0.5
    w2 = torch.randn(s, h, f, device=device, dtype=torch.bfloat16) * f**-0.5
    weight_bytes = 3.0 * s * h * f * 2
    points = []
    for r in o.rows_per_expert:
        x = torch.randn(s * r, h, device=device, dtype=torch.bfloat16)
        counts = [r] * s

        def run(i: int, x: Tensor = x, counts: list[int] = counts) -> None:
            grouped_swiglu(x, counts, w13, w2)

        t = time_us(run, o.iters)
        points.append(
            {
                "rows_per_expert": r,
                "us": t,
                "tflops": 6.0 * s * r * h * f / t / 1e6,
                "weight_gbps": weight_bytes / t / 1e3,
            }
        )
    return {"experts": s, "weight_bytes": weight_bytes, "points": points}


def hbm_copy(device: Any, o: CalibrationOptions, gib: float = 2.0) -> dict[str, Any]:
    """Device-to-device copy bandwidth, GB/s counting bytes read plus bytes written."""
    torch = _torch()
    n = int(gib * 2**30 // 2)
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_us(lambda i: dst.copy_(src), o.iters)
    return {"bytes": 2 * n * 2, "us": t, "gbps": 2 * n * 2 / t / 1e3}


def attention_figures(device: Any, o: CalibrationOptions) -> dict[str, Any]:
    """SDPA flash prefill TFLOPS (causal) and decode KV-read GB/s; flash_attn if present."""
    torch = _torch()
    from agents.runtime.layer import _sdpa

    nq, nkv, d = o.num_q_heads, o.num_kv_heads, o.head_dim
    s = o.prefill_seq
    b = max(1, o.prefill_tokens // s)
    q = torch.randn(b, nq, s, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, nkv, s, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flops = 4.0 * b * nq * d * s * s / 2  # QK^T and PV over the causal half
    t = time_us(lambda i: _sdpa(q, k, v, causal=True), o.iters)
    out: dict[str, Any] = {
        "prefill": {
            "batch": b,
            "seq": s,
            "us": t,
            "tflops": flops / t / 1e6,
            "backend": "sdpa-flash",
        }
    }
    bd, ctx = o.decode_batch, o.decode_context
    qd = torch.randn(bd, nq, 1, d, device=device, dtype=torch.bfloat16)
    kd = torch.randn(bd, nkv, ctx, d, device=device, dtype=torch.bfloat16)
    vd = torch.randn_like(kd)
    kv_bytes = 2.0 * bd * nkv * ctx * d * 2
    td = time_us(lambda i: _sdpa(qd, kd, vd, causal=False), o.iters)
    out["decode"] = {
        "batch": bd,
        "context": ctx,
        "us": td,
        "gbps": kv_bytes / td / 1e3,
        "backend": "sdpa-flash",
    }
    try:
        flash_attn_func = importlib.import_module("flash_attn").flash_attn_func
    except ImportError:
        out["flash_attn"] = "not installed"
    else:
        qf, kf, vf = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        tf = time_us(lambda i: flash_attn_func(qf, kf, vf, causal=True), o.iters)
        out["flash_attn_prefill"] = {"us": tf, "tflops": flops / tf / 1e6}
    return out


def nccl_figures(o: CalibrationOptions, group: Any = None) -> dict[str, Any]:
    """All-to-all time per tokens-per-rank (hidden-wide BF16 rows, equal splits) and the
    runtime's dispatch + combine round trip for one token per rank. Every rank calls it."""
    torch = _torch()
    import torch.distributed as dist

    world = dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    h = o.hidden
    points = []
    for tokens in o.a2a_tokens:
        x = torch.randn(tokens * world, h, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)

        def a2a(i: int, x: Tensor = x, y: Tensor = y) -> None:
            dist.all_to_all_single(y, x, group=group)

        t = time_us(a2a, o.iters)
        remote = tokens * (world - 1) * h * 2.0
        points.append({"tokens_per_rank": tokens, "us": t, "remote_gbps": remote / t / 1e3})
    counts = torch.ones(world, device=dev, dtype=torch.int64)
    rows = torch.randn(world, h, device=dev, dtype=torch.bfloat16)

    def roundtrip(i: int) -> None:
        rc = torch.empty_like(counts)
        dist.all_to_all_single(rc, counts, group=group)
        splits = rc.tolist()
        recv = torch.empty(sum(splits), h, device=dev, dtype=torch.bfloat16)
        dist.all_to_all_single(recv, rows, splits, [1] * world, group=group)
        back = torch.empty_like(rows)
        dist.all_to_all_single(back, recv, [1] * world, splits, group=group)

    rt = time_us(roundtrip, o.iters)
    return {"world": world, "hidden": h, "points": points, "dispatch_combine_roundtrip_us": rt}


def profile_model(o: CalibrationOptions, *, experts: int, top_k: int) -> ModelSpec:
    """The one-MoE-layer model the runtime profile runs (GQA attention, BF16)."""
    return ModelSpec(
        name="runtime-profile",
        family="deepseek_v3",
        num_layers=1,
        moe_layers=(0,),
        hidden=o.hidden,
        vocab=1024,
        num_q_heads=o.num_q_heads,
        num_kv_heads=o.num_kv_heads,
        head_dim=o.head_dim,
        v_head_dim=o.head_dim,
        attention="gqa",
        q_lora_rank=0,
        kv_lora_rank=0,
        qk_rope_dim=0,
        num_experts=experts,
        num_shared_experts=o.num_shared_experts,
        top_k=top_k,
        expert_ffn=o.expert_ffn,
        dense_ffn=o.expert_ffn,
        n_group=1,
        topk_group=1,
        weight_dtype="bf16",
        expert_dtype="bf16",
    )


def _profile_points(o: CalibrationOptions) -> list[tuple[str, bool, int, int]]:
    """The runtime profile's two points: (name, decode, tokens per GPU, context)."""
    return [
        ("decode", True, o.profile_decode_tokens, o.profile_decode_context),
        ("large", False, o.profile_tokens, o.prefill_seq),
    ]


def runtime_profile(rank: int, world: int, o: CalibrationOptions, device: Any) -> dict[str, Any]:
    """Phase times of the reference runtime's MoE layer on all GPUs (uniform placement, the
    full MoE shape): a small decode step (``profile_decode_tokens`` sequences per GPU) and a
    large prefill step (``profile_tokens`` per GPU). Every rank calls it."""
    import torch

    from agents.runtime.layer import (
        LayerShape,
        MoeLayer,
        PhaseTimer,
        RankPlacement,
        build_tables,
        make_kv_cache,
        make_weights,
    )

    cpu = getattr(device, "type", str(device)) == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    out: dict[str, Any] = {}
    experts, top_k = o.num_experts, o.top_k
    for name, decode, tokens, context in _profile_points(o):
        shape = LayerShape.from_model(profile_model(o, experts=experts, top_k=top_k))
        slots = tuple(
            tuple((e, 1.0) for e in range(experts) if e * world // experts == r)
            for r in range(world)
        )
        placement = RankPlacement((tokens,) * world, slots)
        w = make_weights(
            shape, [e for e, _ in slots[rank]], device=device, dtype=dtype, seeded_experts=cpu
        )
        layer = MoeLayer(
            shape,
            placement,
            rank,
            world,
            w,
            build_tables(placement, experts, device),
            decode=decode,
            seq_len=o.prefill_seq,
            fp8_dispatch=o.fp8_dispatch,
            sync_phases=True,
            sample_logits=torch.zeros(experts, device=device),
        )
        x = torch.randn(tokens, o.hidden, device=device, dtype=dtype)
        cache = (
            make_kv_cache(shape, tokens, context, device=device, dtype=dtype, seed=rank)
            if decode
            else None
        )
        runs = []
        for i in range(3 + o.iters):
            timer = PhaseTimer(cuda=not cpu)
            layer.forward(x, cache, timer)
            if i >= 3:
                runs.append(timer.phases_us())
        out[name] = {
            "decode": decode,
            "tokens_per_gpu": tokens,
            "context": context,
            "experts": experts,
            "top_k": top_k,
            "phases_us": {k: statistics.median(r[k] for r in runs) for k in runs[0]},
        }
        del layer, w
    return out


def calibrate_gpu(device: Any, o: CalibrationOptions) -> dict[str, Any]:
    """Every single-GPU measurement for ``device``; raw curves plus timing."""
    t0 = time.perf_counter()
    curves: dict[str, Any] = {
        "gemm": gemm_curves(device, o),
        "grouped_experts": grouped_expert_curve(device, o),
        "hbm_copy": hbm_copy(device, o),
        "attention": attention_figures(device, o),
    }
    curves["duration_s"] = time.perf_counter() - t0
    return curves


# ---------------------------------------------------------------------- curves -> figures


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
    * ``hbm_gbps``: copy bandwidth; ``attn_prefill_tflops``, ``attn_decode_gbps``: SDPA;
    * ``nvlink_gbps``: remote bytes per rank over (time - latency) at the largest all-to-all;
    * ``expert_gemm_tflops``: grouped expert GEMM at >= 256 rows per expert (best point);
      ``expert_read_gbps``: its weight-streaming rate at <= 16 rows per expert (median);
    * with a runtime ``profile``: what the runtime's phases take beyond the cost model's
      roofline terms (computed with the figures above), split into fixed costs and
      per-token / per-pair costs - see :func:`overhead_figures`.
    """
    g = gpu["gemm"]
    bf16 = g["bf16"]
    peak = max(p["tflops"] for p in bf16[-3:])
    hbm = float(gpu["hbm_copy"]["gbps"])
    out: dict[str, float] = {
        "gemm_bf16_tflops": float(peak),
        "hbm_gbps": hbm,
        "attn_prefill_tflops": float(gpu["attention"]["prefill"]["tflops"]),
        "attn_decode_gbps": float(gpu["attention"]["decode"]["gbps"]),
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
        out["nvlink_gbps"] = remote / max(big["us"] - alpha, 1e-3) / 1e3
    grouped = gpu.get("grouped_experts", {}).get("points", [])
    big_rows = [p["tflops"] for p in grouped if p["rows_per_expert"] >= 256]
    small_rows = [p["weight_gbps"] for p in grouped if p["rows_per_expert"] <= 16]
    if big_rows:
        out["expert_gemm_tflops"] = float(max(big_rows))
    if small_rows:
        out["expert_read_gbps"] = float(statistics.median(small_rows))
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
    from policies.costmodel import LayerPlacement, build_cost_table, evaluate
    from policies.errors import InputError
    from policies.fleet import GpuId, Node, NvLinkDomain
    from policies.workload import make_workload

    try:
        spec = lookup(gpu_name)
    except InputError:
        spec = lookup("H100-SXM5-80GB")
    node = Node(
        "profile",
        tuple(Gpu(GpuId(f"profile/gpu{i}"), "profile", i, spec) for i in range(world)),
        NvLinkDomain("profile", spec.nvlink_per_gpu_gbps or 900.0) if world > 1 else None,
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
            if m.get("hbm_gbps"):
                over["hbm_bandwidth_gbps"] = m["hbm_gbps"] / eff.hbm
            spec = replace(spec.with_overrides(over), model=spec.model)
            gpus.append(Gpu(g.id, g.node, g.index, spec, g.uuid))
            if m:
                measured[g.id] = measured_from_dict(m)
        nodes.append(replace(node, gpus=tuple(gpus)))
    return Fleet(name, tuple(nodes)), CostSettings(measured=measured, fp8_dispatch=fp8_dispatch)


# --------------------------------------------------------------------------------- CLI


def _calibrate_rank(rank: int, world: int, o: CalibrationOptions) -> dict[str, Any]:
    """One GPU's calibration (runs in that GPU's process)."""
    import torch

    return measure_rank(rank, world, o, torch.device("cuda", rank))


def measure_rank(rank: int, world: int, o: CalibrationOptions, dev: Any) -> dict[str, Any]:
    """Every measurement of one rank's GPU (all ranks call it together) and its figures."""
    import torch

    t0 = time.perf_counter()
    curves = calibrate_gpu(dev, o)
    nccl = nccl_figures(o) if o.nccl and world > 1 else None
    profile = runtime_profile(rank, world, o, dev)
    props = torch.cuda.get_device_properties(rank)
    name = torch.cuda.get_device_name(rank)
    return {
        "index": rank,
        "name": name,
        "uuid": _uuid(props),
        "sm_count": int(props.multi_processor_count),
        "measured": figures_from_curves(
            curves, nccl, profile, options=o, gpu_name=name, world=world
        ),
        "curves": curves,
        "nccl": nccl,
        "runtime_profile": profile,
        "duration_s": time.perf_counter() - t0,
    }


def _uuid(props: Any) -> str:
    u = str(getattr(props, "uuid", ""))
    return u if not u or u.startswith("GPU-") else f"GPU-{u}"


def software_versions() -> dict[str, str]:
    """Versions of the pieces a measurement depends on."""
    out = {"python": sys.version.split()[0]}
    try:
        import torch

        out["torch"] = str(torch.__version__)
        out["cuda"] = str(torch.version.cuda)
        if torch.cuda.is_available():
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            out["cudnn"] = str(torch.backends.cudnn.version())
    except ImportError:
        out["torch"] = "not installed"
    try:
        import pynvml

        pynvml.nvmlInit()
        out["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        out["nvml"] = str(pynvml.nvmlSystemGetNVMLVersion())
        pynvml.nvmlShutdown()
    except Exception as exc:  # the versions are informative; a missing driver is no error here
        out["driver"] = f"unknown ({type(exc).__name__})"
    return out


def calibrate_node(o: CalibrationOptions, gpus: int = 0) -> dict[str, Any]:
    """Calibrate ``gpus`` GPUs of this node (0: all), one process each.

    Raises:
        RuntimeError: torch or a GPU is missing.
    """
    torch = _torch()
    from agents.runtime.launch import spawn

    n = gpus or torch.cuda.device_count()
    t0 = time.perf_counter()
    ranks = spawn(_calibrate_rank, n, o, backend="nccl")
    return {
        "kind": "mixfleet.calibration/v1",
        "host": socket.gethostname(),
        "software": software_versions(),
        "options": asdict(o),
        "duration_s": time.perf_counter() - t0,
        "gpus": ranks,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``mixfleet-agent calibrate``."""
    d = CalibrationOptions()
    parser.add_argument("--out", default="calibration.json", help="calibration JSON to write")
    parser.add_argument(
        "--inventory",
        default="",
        help="inventory JSON (from discovery) to update with the measured figures; written "
        "next to --out as <out>.inventory.json",
    )
    parser.add_argument("--gpus", type=int, default=0, help="GPUs to calibrate (0: all)")
    parser.add_argument("--hidden", type=int, default=d.hidden, help="model width")
    parser.add_argument("--expert-ffn", type=int, default=d.expert_ffn, help="expert FFN size")
    parser.add_argument("--experts-per-gpu", type=int, default=d.experts_per_gpu)
    parser.add_argument("--q-heads", type=int, default=d.num_q_heads)
    parser.add_argument("--kv-heads", type=int, default=d.num_kv_heads)
    parser.add_argument("--head-dim", type=int, default=d.head_dim)
    parser.add_argument("--iters", type=int, default=d.iters, help="timed repetitions per point")
    parser.add_argument("--no-nccl", action="store_true", help="skip the all-to-all measurement")


def options_from_args(args: argparse.Namespace) -> CalibrationOptions:
    return replace(
        CalibrationOptions(),
        hidden=args.hidden,
        expert_ffn=args.expert_ffn,
        experts_per_gpu=args.experts_per_gpu,
        num_q_heads=args.q_heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        iters=args.iters,
        nccl=not args.no_nccl,
    )


def main(args: argparse.Namespace) -> int:
    """Run calibration; write the JSON; print each GPU's figures. Returns the exit code."""
    try:
        doc = calibrate_node(options_from_args(args), args.gpus)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
    for g in doc["gpus"]:
        figs = ", ".join(f"{k}={v:.4g}" for k, v in sorted(g["measured"].items()))
        print(f"gpu{g['index']} {g['name']}: {figs}")
    print(f"calibration took {doc['duration_s']:.1f} s; wrote {args.out}")
    if args.inventory:
        from agents.discovery.nvml import inventory_from_dict, inventory_to_dict

        with open(args.inventory, encoding="utf-8") as fh:
            inv = inventory_from_dict(json.load(fh))
        updated = apply_calibration(inv, doc)
        path = os.path.splitext(args.out)[0] + ".inventory.json"
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(inventory_to_dict(updated), fh, indent=1)
        print(f"wrote {path}")
    return 0
