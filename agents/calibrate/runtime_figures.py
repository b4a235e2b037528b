"""Figures of the fast runtime's own kernels on one GPU, each measured directly (no fit):
the exact kernels :mod:`agents.runtime.fast` runs, replayed from CUDA graphs or timed
kernel by kernel with ``torch.profiler``, at the calibration shapes of
:class:`CalibrationOptions` (after a second of GEMMs, so clocks are at working speed).

* ``launch_us`` (recorded, not a figure): one kernel's cost inside a CUDA graph, a graph of
  1024 one-element kernels replayed, time / 1024; ``kernels``: kernels per phase;
* ``attn_gap_us``, ``expert_gap_us``: idle time between the kernels of a decode step of
  ``decode_batch`` x ``decode_context`` (each phase's CUDA-graph replay time minus its
  kernels' profiled durations), attention phase and dispatch + experts + combine; None
  when not positive;
* ``dense_read_gbytes_per_s``: attention-phase weights (fused QKV, output, router, shared
  expert) over that phase's GEMM kernel time in the decode step: the rate the runtime
  streams dense weights at decode batch sizes;
* ``dense_gemm_tflops``: the same phase's GEMM FLOPs over its GEMM kernel time in a
  prefill step of ``prefill_tokens`` in sequences of ``prefill_seq``;
* ``attn_decode_gbytes_per_s``: KV bytes over the decode attention kernel's time (packed
  query heads over the cache) in the decode step;
* ``attn_prefill_tflops``: causal attention FLOPs over the attention kernel's time in the
  prefill step;
* ``expert_read_gbytes_per_s``: the expert GEMM kernels over ``experts_per_gpu`` slots at
  4 and 16 rows per slot on average (uniformly drawn slots; median of the two): weight
  bytes / GEMM kernel time;
* ``expert_gemm_tflops``: the same at 256 rows per slot (a prefill load): ``6 rows H F`` /
  GEMM kernel time;
* ``attn_extra_us_per_token``, ``expert_extra_us_per_pair``: the time of every other kernel
  (elementwise, reductions, sorts, gathers) of a prefill step of ``prefill_tokens``, per
  token of the attention phase and per pair of the dispatch, expert and combine phases;
* ``sweep_figures``: with ``sweep_points``, the steps of several sizes timed inside their
  CUDA graph and :func:`agents.calibrate.fit.sweep_figures` over them - kernel rates, and
  the fixed costs as intercept and slope over the sizes - which replace the figures above
  (:func:`agents.calibrate.fit.runtime_overheads`).

Units: microseconds, GB/s (1e9 B/s), TFLOPS.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from agents.calibrate.options import CalibrationOptions

Tensor = Any


def graph_time_us(fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    """Median replay time of ``fn`` captured in a CUDA graph, microseconds."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warmup):
        g.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    del g
    return float(statistics.median(times))


def warm_clocks(seconds: float = 1.0) -> None:
    """Run BF16 GEMMs for ``seconds`` so the GPU is at its working clocks before timing."""
    import time

    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def launch_latency_us(iters: int, kernels: int = 1024) -> float:
    """Fixed cost of one kernel in a CUDA graph: ``kernels`` one-element adds, per kernel."""
    import torch

    x = torch.zeros(1, device="cuda")

    def many() -> None:
        for _ in range(kernels):
            x.add_(1.0)

    return graph_time_us(many, iters) / kernels


GEMM_MARKERS = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "gemv")
"""Kernel names of matrix products (cuBLAS, CUTLASS grouped GEMMs)."""
ATTENTION_MARKERS = ("flash", "fmha", "cudnn", "sdpa", "attention", "attn")
"""Kernel names of the attention core (flash, cuDNN, memory-efficient SDPA)."""


def kernel_split(fn: Callable[[], Any], repeats: int = 3) -> dict[str, Any] | None:
    """GPU time of one call of ``fn`` by kind of kernel, from ``torch.profiler`` (kernel
    durations, averaged over ``repeats`` calls), microseconds: ``gemm_us``,
    ``attention_us``, ``other_us`` (elementwise, reductions, sorts, gathers), ``kernels``
    per call and the largest kernels. None when the profiler cannot see the GPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                fn()
            torch.cuda.synchronize()
    except RuntimeError:
        return None
    split = {"gemm_us": 0.0, "attention_us": 0.0, "other_us": 0.0}
    by_name: dict[str, float] = {}
    n = 0
    for e in prof.events():
        if not str(e.device_type).endswith("CUDA"):
            continue
        n += 1
        us = float(e.time_range.elapsed_us()) / repeats
        low = e.name.lower()
        if any(m in low for m in ATTENTION_MARKERS):  # first: they name CUTLASS types too
            split["attention_us"] += us
        elif any(m in low for m in GEMM_MARKERS):
            split["gemm_us"] += us
        else:
            split["other_us"] += us
        by_name[e.name[:90]] = by_name.get(e.name[:90], 0.0) + us
    if not n:
        return None
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {**split, "kernels": n // repeats, "top": [[k, v] for k, v in top]}


def _layer(o: CalibrationOptions, device: Any, decode: bool, tokens: int, context: int) -> Any:
    import torch

    from agents.calibrate.options import profile_model
    from agents.runtime.fast import build_fast_layer
    from agents.runtime.layer import LayerShape
    from agents.runtime.routing import RankPlacement

    e = o.experts_per_gpu
    shape = LayerShape.from_model(profile_model(o, experts=e, top_k=o.top_k))
    placement = RankPlacement((tokens,), (tuple((x, 1.0) for x in range(e)),))
    return build_fast_layer(
        shape,
        placement,
        rank=0,
        decode=decode,
        seq_len=o.prefill_seq,
        context=context,
        device=device,
        dtype=torch.bfloat16,
        expert_dtype=o.expert_dtype,
        seeded_experts=False,
        sample_logits=torch.zeros(e, device=device),
    )


def _expert_point(layer: Any, rows_per_slot: int, iters: int) -> dict[str, Any]:
    """The layer's expert phase kernel with ``rows_per_slot`` rows per slot on average,
    each row's slot drawn uniformly (as routing spreads pairs): the whole call in a CUDA
    graph and its GEMM kernels alone (profiled), microseconds."""
    import torch

    from agents.runtime.experts import expert_forward, expert_plan

    s = layer.experts.slots
    n = s * rows_per_slot
    g = torch.Generator(device=layer.x.device).manual_seed(rows_per_slot)
    src = torch.randn(n, layer.shape.hidden, device=layer.x.device, dtype=layer.x.dtype)
    slot = torch.randint(0, s, (n,), device=src.device, generator=g)
    scale = torch.rand(n, device=src.device, generator=g)
    plan = expert_plan("auto", n, s, layer.experts.dtype, cuda=True)

    def run() -> Any:
        return expert_forward(src, None, slot, layer.experts, plan, scale)

    split = kernel_split(run) or {}
    return {
        "rows_per_slot": rows_per_slot,
        "us": graph_time_us(run, iters),
        "gemm_us": split.get("gemm_us"),
        "other_us": split.get("other_us"),
    }


def _phase_splits(layer: Any, iters: int) -> dict[str, Any]:
    """Per phase of one step of ``layer``: its kernel-time split (profiled) and its CUDA
    graph replay time, whose excess over the kernels' durations is the idle time between
    them (``gap_us``)."""
    out: dict[str, Any] = {}
    for name, fn in layer.phase_fns().items():
        layer.step()  # every phase's inputs in place
        out[name] = kernel_split(fn)
    layer.capture()
    graph = layer.time_graphs(iters)
    for name, split in out.items():
        if split:
            kernels = split["gemm_us"] + split["attention_us"] + split["other_us"]
            split["graph_us"] = graph[name]
            split["gap_us"] = graph[name] - kernels
    return out


def _dense(layer: Any) -> tuple[float, float]:
    """Attention-phase dense weights of ``layer``: (bytes, parameters)."""
    w = layer.weights
    mats = [layer.wqkv, w.wo, layer.w_router, w.shared_w13, w.shared_w2]
    mats = [m for m in mats if m is not None]
    return (
        sum(float(m.numel() * m.element_size()) for m in mats),
        sum(float(m.numel()) for m in mats),
    )


def _gaps(splits: dict[str, Any], phases: tuple[str, ...]) -> float | None:
    """Idle time between the kernels of ``phases`` (None when not measured or not > 0)."""
    parts = [splits.get(p) for p in phases]
    if not all(p and "gap_us" in p for p in parts):
        return None
    total = sum(p["gap_us"] for p in parts if p)
    return total if total > 0 else None


def runtime_figures(device: Any, o: CalibrationOptions) -> dict[str, Any]:
    """The figures of the module docstring, with the raw points they come from."""
    import torch

    warm_clocks()
    out: dict[str, Any] = {"launch_us": launch_latency_us(max(o.iters, 30))}
    dec = _layer(o, device, True, o.decode_batch, o.decode_context)
    splits = _phase_splits(dec, o.iters)
    out["decode_phases"] = splits
    out["kernels"] = {k: (v or {}).get("kernels") for k, v in splits.items()}
    attn = splits.get("attention")
    if attn and attn["gemm_us"] > 0 and attn["attention_us"] > 0:
        out["dense_read_gbytes_per_s"] = _dense(dec)[0] / attn["gemm_us"] / 1e3
        kc = dec.kv[0]
        kv_bytes = 2.0 * kc.numel() * kc.element_size()
        out["attn_decode_gbytes_per_s"] = kv_bytes / attn["attention_us"] / 1e3
    out["attn_gap_us"] = _gaps(splits, ("attention",))
    out["expert_gap_us"] = _gaps(splits, ("dispatch", "experts", "combine"))
    wbytes = dec.experts.bytes
    reads = [_expert_point(dec, r, o.iters) for r in (4, 16)]
    out["expert_read_points"] = reads
    if all(p["gemm_us"] for p in reads):
        out["expert_read_gbytes_per_s"] = float(
            statistics.median(wbytes / p["gemm_us"] / 1e3 for p in reads)
        )
    big = _expert_point(dec, 256, o.iters)
    s, h, f = dec.experts.slots, o.hidden, o.expert_ffn
    out["expert_gemm_point"] = big
    if big["gemm_us"]:
        out["expert_gemm_tflops"] = 6.0 * 256 * s * h * f / big["gemm_us"] / 1e6
    del dec
    torch.cuda.empty_cache()
    tokens = max(o.prefill_seq, o.prefill_tokens // o.prefill_seq * o.prefill_seq)
    pre = _layer(o, device, False, tokens, o.prefill_seq)
    psplit = _phase_splits(pre, max(3, o.iters // 3))
    out["prefill_phases"] = psplit
    pattn = psplit.get("attention")
    if pattn:
        out["attn_extra_us_per_token"] = pattn["other_us"] / tokens
        if pattn["gemm_us"] > 0:
            out["dense_gemm_tflops"] = 2.0 * tokens * _dense(pre)[1] / pattn["gemm_us"] / 1e6
        if pattn["attention_us"] > 0:
            nq, d, sl = o.num_q_heads, o.head_dim, o.prefill_seq
            flops = 4.0 * tokens * nq * d * (sl + 1) / 2.0
            out["attn_prefill_tflops"] = flops / pattn["attention_us"] / 1e6
    expert_phase = [psplit.get(k) for k in ("dispatch", "experts", "combine")]
    if all(expert_phase):
        other = sum(p["other_us"] for p in expert_phase if p)
        out["expert_extra_us_per_pair"] = other / (tokens * o.top_k)
    del pre
    torch.cuda.empty_cache()
    if o.sweep_points:
        from agents.calibrate.fit import sweep_figures

        points = sweep_points(device, o)
        out["sweep"] = [
            {"decode": p.decode, "tokens": p.tokens, "context": p.context,
             "attention_us": p.attention_us, "expert_us": p.expert_us}
            for p in points
        ]  # fmt: skip
        if points:
            out["sweep_figures"] = sweep_figures(points)[0]
    return out


def sweep_points(device: Any, o: CalibrationOptions) -> list[Any]:
    """The steps of ``o.sweep_points`` on the runtime profile's layer, each timed inside
    its step graph (:meth:`agents.runtime.fast.FastLayer.time_layer_phases`) with its
    kernel split: :class:`agents.calibrate.fit.PhasePoint` each (a step the profiler cannot
    cut is left out)."""
    import torch

    from agents.calibrate.fit import PhasePoint
    from agents.calibrate.options import profile_model

    model = replace(
        profile_model(o, experts=o.experts_per_gpu, top_k=o.top_k), expert_dtype=o.expert_dtype
    )
    base = _layer(o, device, True, 1, 16)
    points = []
    for k, (phase, tokens, context) in enumerate(o.sweep_points):
        decode = phase == "decode"
        layer = base.resized(tokens, decode=decode, seq_len=context, context=context, seed=k + 1)
        layer.step()
        kernels = {name: kernel_split(fn) for name, fn in layer.phase_fns().items()}
        layer.capture()
        t = layer.time_layer_phases(o.iters)
        if t is not None:
            expert = t["dispatch"] + t["experts"] + t["combine"]
            points.append(
                PhasePoint(model, decode, tokens, context, t["attention"], expert, kernels)
            )
        del layer
        torch.cuda.empty_cache()
    return points
