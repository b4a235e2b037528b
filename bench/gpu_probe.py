"""First look at a GPU host for the fast runtime: software, which kernels exist, the
current reference runtime's per-phase times (the "before" figures of docs/validation.md)
and candidate kernels for the decode layer.

``python -m bench.gpu_probe --out DIR`` writes ``DIR/gpu-probe.json``; about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any


def _t(fn: Any, iters: int = 10, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    ev = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        ev.append((a, b))
    torch.cuda.synchronize()
    return float(statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev))


def _try(out: dict[str, Any], key: str, fn: Any) -> None:
    try:
        out[key] = fn()
    except Exception as exc:
        out[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        traceback.print_exc()
    print(key, json.dumps(out[key])[:600], flush=True)


def before(experts: int, seqs: int, ctx: int) -> dict[str, Any]:
    """The reference runtime (MoeLayer.forward, world 1) at the issue's shapes."""
    import torch

    from agents.runtime.layer import (
        LayerShape,
        MoeLayer,
        PhaseTimer,
        make_kv_cache,
        make_weights,
    )
    from agents.runtime.routing import RankPlacement, build_tables

    dev = torch.device("cuda", 0)
    sh = LayerShape(7168, experts, 8, 2048, 1, 128, 8, 128)
    pl = RankPlacement((seqs,), (tuple((e, 1.0) for e in range(experts)),))
    w = make_weights(sh, range(experts), device=dev, dtype=torch.bfloat16, seeded_experts=False)
    layer = MoeLayer(
        sh,
        pl,
        0,
        1,
        w,
        build_tables(pl, experts, dev),
        decode=True,
        seq_len=2048,
        sample_logits=torch.zeros(experts, device=dev),
    )
    x = torch.randn(seqs, 7168, device=dev, dtype=torch.bfloat16)
    cache = make_kv_cache(sh, seqs, ctx, device=dev, dtype=torch.bfloat16, seed=0)
    runs = []
    for i in range(11):
        tm = PhaseTimer(cuda=True)
        layer.forward(x, cache, tm)
        if i >= 3:
            runs.append(tm.phases_us())
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    med["layer"] = statistics.median(sum(r.values()) for r in runs)
    del layer, w, cache
    torch.cuda.empty_cache()
    return med


def _ceilings(out: dict[str, Any]) -> None:
    """Copy bandwidth and a large BF16 GEMM."""
    import torch

    dev = "cuda"

    n = 1 << 30
    src = torch.empty(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = _t(lambda: dst.copy_(src))
    out["copy_gbytes_per_s"] = 4 * n / t / 1e3
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t = _t(lambda: a @ a)
    out["gemm_8192_tflops"] = 2 * 8192**3 / t / 1e6


def _decode_attention(out: dict[str, Any]) -> None:
    """Decode attention backends on the packed and GQA layouts."""
    import torch
    import torch.nn.functional as nnf

    dev = "cuda"
    # decode attention: 128 seqs x 4096 ctx, 128 q / 8 kv heads
    b, ctx, nq, nkv, d = 128, 4096, 128, 8, 128
    kc = torch.randn(b, nkv, ctx, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, nq, 1, d, device=dev, dtype=torch.bfloat16)
    kvb = 2 * kc.numel() * 2
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def gqa() -> Any:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return nnf.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)

    def packed() -> Any:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return nnf.scaled_dot_product_attention(q.view(b, nkv, nq // nkv, d), kc, vc)

    def packed_eff() -> Any:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return nnf.scaled_dot_product_attention(q.view(b, nkv, nq // nkv, d), kc, vc)

    def cudnn() -> Any:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return nnf.scaled_dot_product_attention(q.view(b, nkv, nq // nkv, d), kc, vc)

    ref = gqa().view(b, nq, d)
    for name, fn in (
        ("gqa", gqa),
        ("packed", packed),
        ("packed_eff", packed_eff),
        ("cudnn", cudnn),
    ):

        def one(fn: Any = fn) -> dict[str, Any]:
            o = fn().reshape(b, nq, d)
            t = _t(fn)
            return {"us": t, "gbytes_per_s": kvb / t / 1e3, "maxdiff": float((o - ref).abs().max())}

        _try(out, f"decode_attn_{name}", one)


def _experts_bf16(out: dict[str, Any]) -> None:
    """BF16 grouped GEMM against batched GEMM."""
    import torch
    import torch.nn.functional as nnf

    dev = "cuda"
    # grouped experts: 128 experts, decode 8 rows each and prefill 256 rows each
    e, h, f = 128, 7168, 2048
    w13 = torch.randn(e, 2 * f, h, device=dev, dtype=torch.bfloat16) * h**-0.5
    w2 = torch.randn(e, h, f, device=dev, dtype=torch.bfloat16) * f**-0.5
    wbytes = 3 * e * h * f * 2
    for rows in (8, 16, 64, 256):
        x = torch.randn(e * rows, h, device=dev, dtype=torch.bfloat16)
        offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * rows

        def gm(x: Any = x, offs: Any = offs) -> Any:
            hh = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
            g = nnf.silu(hh[:, :f]) * hh[:, f:]
            return torch._grouped_mm(g, w2.transpose(-2, -1), offs=offs)

        def bm(x: Any = x, rows: int = rows) -> Any:
            xb = x.view(e, rows, h)
            hh = torch.bmm(xb, w13.transpose(-2, -1))
            g = nnf.silu(hh[..., :f]) * hh[..., f:]
            return torch.bmm(g, w2.transpose(-2, -1))

        def gm1(x: Any = x, offs: Any = offs) -> Any:
            return torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)

        for name, fn in (("grouped", gm), ("bmm", bm), ("grouped_w13_only", gm1)):

            def one_e(fn: Any = fn, rows: int = rows) -> dict[str, Any]:
                t = _t(fn)
                return {
                    "us": t,
                    "weight_gbytes_per_s": wbytes / t / 1e3,
                    "tflops": 6 * e * rows * h * f / t / 1e6,
                }

            _try(out, f"experts_{name}_{rows}", one_e)


def _experts_fp8(out: dict[str, Any]) -> None:
    """FP8 grouped GEMM at the shapes of _experts_bf16."""
    import torch

    dev = "cuda"
    e, h, f = 128, 7168, 2048
    w13 = torch.randn(e, 2 * f, h, device=dev, dtype=torch.bfloat16) * h**-0.5
    w2 = torch.randn(e, h, f, device=dev, dtype=torch.bfloat16) * f**-0.5
    wbytes = 3 * e * h * f * 2
    # FP8 weights
    f8 = torch.float8_e4m3fn
    w13_8 = w13.to(f8)
    w2_8 = w2.to(f8)
    out["has_scaled_grouped_mm"] = hasattr(torch, "_scaled_grouped_mm")
    for rows in (8, 64, 256):
        x8 = torch.randn(e * rows, h, device=dev).to(f8)
        g8 = torch.randn(e * rows, f, device=dev).to(f8)
        offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * rows
        sa = torch.ones(e * rows, device=dev, dtype=torch.float32)
        sb13 = torch.ones(e, 2 * f, device=dev, dtype=torch.float32)
        sb2 = torch.ones(e, h, device=dev, dtype=torch.float32)

        def sgm(
            x8: Any = x8,
            g8: Any = g8,
            offs: Any = offs,
            sa: Any = sa,
            sb13: Any = sb13,
            sb2: Any = sb2,
        ) -> Any:
            torch._scaled_grouped_mm(
                x8, w13_8.transpose(-2, -1), sa, sb13, offs=offs, out_dtype=torch.bfloat16
            )
            return torch._scaled_grouped_mm(
                g8, w2_8.transpose(-2, -1), sa, sb2, offs=offs, out_dtype=torch.bfloat16
            )

        def one_s(fn: Any = sgm, rows: int = rows) -> dict[str, Any]:
            t = _t(fn)
            return {
                "us": t,
                "weight_gbytes_per_s": wbytes / 2 / t / 1e3,
                "tflops": 6 * e * rows * h * f / t / 1e6,
            }

        _try(out, f"experts_scaled_grouped_{rows}", one_s)
    one_ = torch.ones((), device=dev)
    xa = torch.randn(128, h, device=dev).to(f8)
    _try(
        out,
        "scaled_mm_tensorwise",
        lambda: {
            "us": _t(
                lambda: torch._scaled_mm(xa, w13_8[0].t(), one_, one_, out_dtype=torch.bfloat16)
            )
        },
    )


def _graph_latency(out: dict[str, Any]) -> None:
    """One-kernel CUDA graph replay against an eager launch."""
    import torch

    dev = "cuda"
    # CUDA graph launch latency: an empty-ish graph of one tiny kernel
    s = torch.zeros(1, device=dev)
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        s.add_(1)
        with torch.cuda.graph(g, stream=st):
            for _ in range(1):
                s.add_(1)
    torch.cuda.current_stream().wait_stream(st)
    out["graph_replay_one_kernel_us"] = _t(g.replay, 50)
    out["eager_one_kernel_us"] = _t(lambda: s.add_(1), 50)


def kernels() -> dict[str, Any]:
    """Every kernel candidate, each section on its own."""
    out: dict[str, Any] = {}
    for section in (_ceilings, _decode_attention, _experts_bf16, _experts_fp8, _graph_latency):
        section(out)
    return out


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import torch

    doc: dict[str, Any] = {"command": "python -m bench.gpu_probe --out OUT"}
    doc["software"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "has_grouped_mm": hasattr(torch, "_grouped_mm"),
        "has_scaled_grouped_mm": hasattr(torch, "_scaled_grouped_mm"),
        "has_scaled_mm": hasattr(torch, "_scaled_mm"),
    }
    print(doc["software"], flush=True)
    t0 = time.time()
    _try(doc, "kernels", kernels)
    for key, args in (
        ("before_128x128x4096", (128, 128, 4096)),
        ("before_256x128x4096", (256, 128, 4096)),
        ("before_128x64x2048", (128, 64, 2048)),
    ):
        _try(doc, key, lambda args=args: before(*args))
    doc["duration_s"] = time.time() - t0
    with open(os.path.join(a.out, "gpu-probe.json"), "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
