"""Step time across batch sizes and contexts on one GPU: the fast runtime measured against
the cost model.

``python -m bench.gpu_sweep --out DIR`` on a host with one NVIDIA GPU (H200 here) writes
``DIR/gpu-h200-sweep.json`` (every measured point, three rounds each) in about four minutes:

* DeepSeek-V3 (GQA form, BF16 and FP8 experts) and Qwen3-235B-A22B (BF16) layers, all
  experts on the one GPU, uniform load, SGLang static replica choice;
* decode at 1, 4, 16, 64, 128 and 256 sequences with 1k, 4k, 16k and 32k cached tokens
  each; prefill of 1k-16k tokens in sequences of 2k (and 4k, 8k, 16k single sequences);
* per point, each phase replayed from its own CUDA graph and the whole step from one
  (:meth:`agents.runtime.fast.FastLayer.time_graphs`), three rounds over the whole sweep
  (each round rebuilds the layer and recaptures every point), each phase's time inside the
  step's graph (:meth:`agents.runtime.fast.FastLayer.time_layer_phases`, what the cost
  model is compared with) and the kernel-time split of each phase (``torch.profiler``);
* the expert kernel each point runs is the fastest of Triton, ``torch._grouped_mm`` /
  ``torch._scaled_grouped_mm`` and the capacity batch GEMM on that point
  (:meth:`agents.runtime.fast.FastLayer.tune_experts`), and the decode attention backend
  the fastest of cuDNN and flash.

The comparison with the cost model is pure and reruns on the file:
``python -m bench.gpu_sweep --analyse FILE [--png PNG]`` (:mod:`bench.gpu_fit`: calibration
as slope and intercept over the calibration points of the sweep, prediction of every point,
the table and the PNG).

Units: microseconds (``_us``), tokens, bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Sequence
from functools import partial
from typing import Any

from bench.gpu_model import layer_model

DECODE_BATCH = (1, 4, 16, 64, 128, 256)
"""Decode sequences per GPU."""
DECODE_CONTEXT = (1024, 4096, 16384, 32768)
"""Cached tokens per sequence in decode."""
PREFILL = (
    (1024, 1024),
    (2048, 2048),
    (4096, 2048),
    (8192, 2048),
    (16384, 2048),
    (4096, 4096),
    (8192, 8192),
    (16384, 16384),
)
"""Prefill points: (tokens per GPU, sequence length)."""
MODELS = (("deepseek-v3", "bf16"), ("deepseek-v3", "fp8"), ("qwen3-235b-a22b", "bf16"))
"""(model preset, expert dtype) of the sweep."""


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def points(phase: str = "all") -> list[dict[str, Any]]:
    """Every (phase, tokens, context, seq_len) of the sweep, decode first (``phase``:
    ``all``, or only ``decode`` or ``prefill`` points)."""
    out = [
        {"phase": "decode", "tokens": b, "context": c, "seq_len": c}
        for c in DECODE_CONTEXT
        for b in DECODE_BATCH
    ]
    out += [{"phase": "prefill", "tokens": t, "context": s, "seq_len": s} for t, s in PREFILL]
    return [p for p in out if phase in ("all", p["phase"])]


def _base_layer(model: str, expert_dtype: str, seed: int) -> Any:
    import torch

    from agents.runtime.fast import build_fast_layer
    from agents.runtime.layer import LayerShape
    from agents.runtime.routing import RankPlacement

    m = layer_model(model, expert_dtype)
    shape = LayerShape.from_model(m)
    dev = torch.device("cuda", 0)
    placement = RankPlacement((1,), (tuple((e, 1.0) for e in range(m.num_experts)),))
    return build_fast_layer(
        shape,
        placement,
        rank=0,
        decode=True,
        seq_len=1,
        context=16,
        device=dev,
        dtype=torch.bfloat16,
        expert_dtype=expert_dtype,
        rule="static",
        seeded_experts=False,
        sample_logits=torch.zeros(m.num_experts, device=dev),
        seed=seed,
    )


def measure_point(
    base: Any, p: dict[str, Any], iters: int, split: bool, seed: int
) -> dict[str, Any]:
    """One point: phase and step graph replay medians, and (``split``) kernel splits."""
    import torch

    from agents.calibrate.runtime_figures import kernel_split

    layer = base.resized(
        p["tokens"],
        decode=p["phase"] == "decode",
        seq_len=p["seq_len"],
        context=p["context"],
        seed=seed,
    )
    out: dict[str, Any] = {"plan": layer.plan.kernel, "kernel_us": layer.kernel_us}
    if split:
        layer.step()
        out["kernels"] = {name: kernel_split(fn) for name, fn in layer.phase_fns().items()}
    layer.capture()
    out["graph_us"] = layer.time_graphs(iters)
    out["in_layer_us"] = layer.time_layer_phases(iters)
    out["attn_backend"] = layer.attn_backend
    layer.graphs.clear()
    layer._keep.clear()
    del layer
    torch.cuda.empty_cache()
    return out


def attention_probe() -> list[dict[str, Any]]:
    """Decode attention kernel alone (packed query heads over the cache), cuDNN and flash
    SDPA backends at a few batch x context shapes (DeepSeek-V3 GQA form), microseconds."""
    import torch

    from agents.calibrate.runtime_figures import graph_time_us
    from agents.runtime.fast import _sdpa

    rows = []
    for b, ctx in ((1, 32768), (4, 32768), (16, 16384), (1, 1024), (256, 1024), (128, 4096)):
        q = torch.randn(b, 8, 16, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, 8, ctx, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv_bytes = 2.0 * k.numel() * 2
        for backend in ("cudnn", "flash"):
            try:
                us = graph_time_us(partial(_sdpa, q, k, v, backend, False), 20)
                rows.append(
                    {
                        "batch": b,
                        "context": ctx,
                        "backend": backend,
                        "us": us,
                        "gbytes_per_s": kv_bytes / us / 1e3,
                    }
                )
            except Exception as exc:  # a backend that refuses the shape is a result too
                rows.append(
                    {"batch": b, "context": ctx, "backend": backend, "error": str(exc)[:200]}
                )
        del q, k, v
    torch.cuda.empty_cache()
    return rows


def run_sweep(
    rounds: int,
    iters: int,
    phase: str = "all",
    cases: Sequence[str] = (),
    tokens: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """Every model x point of ``phase`` (:func:`points`), ``rounds`` times (rounds
    outermost); only the ``model/dtype`` ``cases`` and the points of ``tokens`` when given."""
    import torch

    results: list[dict[str, Any]] = []
    for r in range(rounds):
        for model, dt in MODELS:
            if cases and f"{model}/{dt}" not in cases:
                continue
            base = _base_layer(model, dt, seed=r)
            for k, p in enumerate(points(phase)):
                if tokens and p["tokens"] not in tokens:
                    continue
                label = {"model": model, "expert_dtype": dt, "round": r, **p}
                try:
                    res = measure_point(base, p, iters, split=True, seed=1000 * r + k)
                except Exception as exc:  # one failed point must not lose the others
                    traceback.print_exc()
                    res = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    torch.cuda.empty_cache()
                results.append({**label, **res})
                g = res.get("graph_us", {})
                _log(
                    f"r{r} {model}/{dt} {p['phase']} {p['tokens']}x{p['context']}: "
                    f"attn {g.get('attention', 0):.0f} exp {g.get('experts', 0):.0f} "
                    f"layer {g.get('layer', 0):.0f} {res.get('error', '')}"
                )
            del base
            torch.cuda.empty_cache()
    return results


def _bad_filters(only: str, tokens: str) -> str | None:
    """What is wrong with ``--only`` / ``--tokens`` (None when both are good)."""
    known = [f"{m}/{d}" for m, d in MODELS]
    bad = [c for c in only.split(",") if c and c not in known]
    if bad:
        return f"--only {bad[0]!r}: choose from {', '.join(known)}"
    if not all(t.isdigit() for t in tokens.split(",") if t):
        return f"--tokens {tokens!r}: give whole numbers, e.g. 8192,16384"
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", help="folder for gpu-h200-sweep.json (runs the sweep on the GPU)")
    p.add_argument("--analyse", help="a sweep results file to compare with the cost model")
    p.add_argument("--png", help="with --analyse: write the measured-vs-predicted figure here")
    p.add_argument(
        "--phase",
        choices=("all", "decode", "prefill"),
        default="all",
        help="with --out: only these points (the cost-model fit needs all)",
    )
    p.add_argument(
        "--only",
        default="",
        metavar="MODEL/DTYPE,...",
        help="with --out: only these cases, e.g. deepseek-v3/bf16 (default: all)",
    )
    p.add_argument(
        "--tokens",
        default="",
        metavar="N,...",
        help="with --out: only the points of these tokens per GPU (default: all)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds over the whole sweep")
    p.add_argument("--iters", type=int, default=10, help="graph replays per point and round")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if bool(args.out) == bool(args.analyse):
        print("error: give exactly one of --out (measure) or --analyse FILE", file=sys.stderr)
        return 2
    problem = _bad_filters(args.only, args.tokens)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from bench import gpu_fit

    if args.analyse:
        try:
            with open(args.analyse, encoding="utf-8") as fh:
                saved = json.load(fh)
        except (OSError, ValueError) as exc:
            print(f"error: cannot read {args.analyse}: {exc}", file=sys.stderr)
            return 2
        rep = gpu_fit.analyse(saved)
        print("\n".join(rep["table"]))
        if args.png:
            gpu_fit.plot(rep, args.png)
            print(f"wrote {args.png}")
        return 0
    from agents.calibrate.measure import import_torch

    try:
        torch = import_torch()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from agents.calibrate.runtime_figures import warm_clocks
    from bench.gpu import ceilings, save_record, start_record

    t0 = time.perf_counter()
    doc = start_record(
        "mixfleet.gpu-sweep/v1", "bench.gpu_sweep", argv, args.out, torch.cuda.get_device_name(0)
    )
    try:
        import triton

        doc["environment"]["software"]["triton"] = str(triton.__version__)
    except ImportError:
        doc["environment"]["software"]["triton"] = "not installed"
    warm_clocks()
    doc["ceilings"] = ceilings()
    _log(f"ceilings {doc['ceilings']}")
    doc["attention_probe"] = attention_probe()
    _log(f"attention probe {doc['attention_probe']}")
    cases = tuple(c for c in args.only.split(",") if c)
    tokens = tuple(int(t) for t in args.tokens.split(",") if t)
    doc["points"] = run_sweep(args.rounds, args.iters, args.phase, cases, tokens)
    doc["duration_s"] = time.perf_counter() - t0
    path = save_record(doc, args.out, "gpu-h200-sweep.json")
    _log(f"wrote {path} in {doc['duration_s']:.0f} s")
    try:
        report = gpu_fit.analyse(doc)
        print("\n".join(report["table"]))
    except Exception:  # the measurements are saved; the analysis reruns on the file
        traceback.print_exc()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
