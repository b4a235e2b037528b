"""The measurements of one GPU (run in that GPU's process), with torch imported lazily.

Owns the timing loop (:func:`time_us`), the GEMM, grouped-expert, HBM-copy and attention
curves (:func:`calibrate_gpu`), the NCCL all-to-all figures (:func:`nccl_figures`) and the
reference runtime's per-phase profile (:func:`runtime_profile`). Results are raw curves:
:mod:`agents.calibrate.fit` turns them into cost-model figures.

Units: microseconds (``_us``), TFLOPS, GB/s (1e9 B/s), bytes.
"""

from __future__ import annotations

import importlib
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from agents.calibrate.options import CalibrationOptions, profile_model

Tensor = Any  # torch.Tensor


L2_FLUSH_BYTES = 256 * 2**20  # rotate inputs over at least this much (H200 L2: 60 MB)


def import_torch() -> Any:
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
    torch = import_torch()
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
    torch = import_torch()
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
                "weight_gbytes_per_s": weight_bytes / t / 1e3,
            }
        )
    return {"experts": s, "weight_bytes": weight_bytes, "points": points}


def hbm_copy(device: Any, o: CalibrationOptions, gib: float = 2.0) -> dict[str, Any]:
    """Device-to-device copy bandwidth, GB/s counting bytes read plus bytes written."""
    torch = import_torch()
    n = int(gib * 2**30 // 2)
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_us(lambda i: dst.copy_(src), o.iters)
    return {"bytes": 2 * n * 2, "us": t, "gbytes_per_s": 2 * n * 2 / t / 1e3}


def attention_figures(device: Any, o: CalibrationOptions) -> dict[str, Any]:
    """SDPA flash prefill TFLOPS (causal) and decode KV-read GB/s; flash_attn if present."""
    torch = import_torch()
    from agents.runtime.layer import sdpa

    nq, nkv, d = o.num_q_heads, o.num_kv_heads, o.head_dim
    s = o.prefill_seq
    b = max(1, o.prefill_tokens // s)
    q = torch.randn(b, nq, s, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, nkv, s, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flops = 4.0 * b * nq * d * s * s / 2  # QK^T and PV over the causal half
    t = time_us(lambda i: sdpa(q, k, v, causal=True), o.iters)
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
    td = time_us(lambda i: sdpa(qd, kd, vd, causal=False), o.iters)
    out["decode"] = {
        "batch": bd,
        "context": ctx,
        "us": td,
        "gbytes_per_s": kv_bytes / td / 1e3,
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
    torch = import_torch()
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
        points.append({"tokens_per_rank": tokens, "us": t, "remote_gbytes_per_s": remote / t / 1e3})
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
        make_kv_cache,
        make_weights,
    )
    from agents.runtime.routing import RankPlacement, build_tables

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
