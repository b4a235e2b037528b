"""One-GPU measurements of the fast runtime, its calibration and the cost model's fidelity.

``python -m bench.gpu --out DIR`` on a host with one NVIDIA GPU (H200 here) writes
``DIR/gpu-h200-runtime.json`` in about five minutes:

1. ceilings: device-copy bandwidth (read + write), an 8192^3 BF16 GEMM, an 8192^3 FP8
   GEMM (``torch._scaled_mm``, row-wise scales);
2. before: the plan executor (``agents.runtime.layer.MoeLayer``, world size 1) at the
   shapes of docs/validation.md (DeepSeek-V3 layer width, GQA 128/8 heads, decode);
3. after: the fast runtime (``agents.runtime.fast``) at the same shapes, BF16 and FP8
   experts, SGLang static and even replica choice over a placement with 32 replicated
   experts; every phase replayed from its own CUDA graph and the whole step from one, each
   against its roofline (``agents.runtime.roofline``) at the measured ceilings;
4. calibration (``agents.calibrate.measure_rank``) three times per model shape and expert
   dtype; figures the three runs disagree on by more than 5% are dropped;
5. fidelity: DeepSeek-V3 (GQA form; BF16 and FP8 experts) and Qwen3-235B-A22B (BF16) layers,
   decode (128 sequences x 4096 KV) and prefill (8192 tokens in sequences of 2048), all
   experts on the one GPU: measured phases against the cost model with the stable figures.

Multi-GPU runs (``agents.runtime.bench``) are separate; they need two or more GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from typing import Any

from bench.gpu_model import fidelity_table, layer_model, predict, roofline_table

DECODE = {"decode": True, "tokens": 128, "context": 4096}
PREFILL = {"decode": False, "tokens": 8192, "context": 2048}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _guard(fn: Callable[[], dict[str, Any]], **label: Any) -> dict[str, Any]:
    try:
        return {**label, **fn()}
    except Exception as exc:  # one failed case must not lose the others
        traceback.print_exc()
        return {**label, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def ceilings() -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write) and BF16 / FP8 GEMM peaks (TFLOPS)."""
    import torch

    from agents.calibrate.measure import time_us

    n = 1 << 30
    src = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = time_us(lambda i: dst.copy_(src), 20)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    bf16 = time_us(lambda i: a @ a, 20)
    a8 = a.to(torch.float8_e4m3fn)
    sa = torch.ones(8192, 1, device="cuda")
    sb = torch.ones(1, 8192, device="cuda")
    fp8 = time_us(lambda i: torch._scaled_mm(a8, a8.t(), sa, sb, out_dtype=torch.bfloat16), 20)
    flops = 2.0 * 8192**3
    return {
        "copy_gbytes_per_s": 4.0 * n / copy / 1e3,
        "bf16_tflops": flops / bf16 / 1e6,
        "fp8_tflops": flops / fp8 / 1e6,
    }


def _placement(experts: int, tokens: int, redundant: int) -> Any:
    from agents.runtime.routing import RankPlacement

    slots = [(e, 1.0) for e in range(experts)] + [(e, 1.0) for e in range(redundant)]
    return RankPlacement((tokens,), (tuple(slots),))


def runtime_case(
    ceil: dict[str, float],
    model: str,
    experts: int,
    *,
    decode: bool,
    tokens: int,
    context: int,
    expert_dtype: str = "bf16",
    rule: str = "static",
    redundant: int = 0,
    iters: int = 20,
) -> dict[str, Any]:
    """One fast-runtime layer: phase graphs, the whole-step graph, eager, and rooflines."""
    import torch

    from agents.runtime.fast import build_fast_layer, phase_summary
    from agents.runtime.layer import LayerShape
    from agents.runtime.roofline import layer_work, rooflines_us

    base = layer_model(model, expert_dtype)
    shape = replace(LayerShape.from_model(base), num_experts=experts)
    dev = torch.device("cuda", 0)
    layer = build_fast_layer(
        shape,
        _placement(experts, tokens, redundant),
        rank=0,
        decode=decode,
        seq_len=context,
        context=context,
        device=dev,
        dtype=torch.bfloat16,
        expert_dtype=expert_dtype,
        rule=rule,
        seeded_experts=False,
        sample_logits=torch.zeros(experts, device=dev),
    )
    layer.capture()
    graph = phase_summary(layer.time_graphs(iters))
    eager = layer.time_eager(max(5, iters // 4))
    work = layer_work(
        hidden=shape.hidden,
        num_experts=experts,
        slots=experts + redundant,
        top_k=shape.top_k,
        expert_ffn=shape.expert_ffn,
        num_shared_experts=shape.num_shared_experts,
        num_q_heads=shape.num_q_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        tokens=tokens,
        decode=decode,
        context=context,
        seq_len=context,
        expert_dtype=expert_dtype,
    )
    tflops = {"bf16": ceil["bf16_tflops"], "fp8": ceil["fp8_tflops"]}
    roof = rooflines_us(work, ceil["copy_gbytes_per_s"], tflops)
    served = torch.zeros(experts + redundant, device=dev)
    for _ in range(8):  # pairs each physical slot received, over 8 fresh routings
        layer.phase_attention()
        served += torch.bincount(layer.st["phys"], minlength=experts + redundant)
    out = {
        "plan": asdict(layer.plan),
        "attn_backend": layer.attn_backend,
        "graph_us": graph,
        "eager_us": eager,
        "roofline_us": roof,
        "work": {k: asdict(w) for k, w in work.items()},
        "bytes_total": sum(w.bytes for w in work.values()),
        "ratio": graph["layer"] / roof["layer"],
        "served_pairs_replicated": served[:redundant].tolist() if redundant else [],
        "served_pairs_replicas": served[experts:].tolist() if redundant else [],
    }
    del layer
    torch.cuda.empty_cache()
    return out


def before_case(experts: int, seqs: int, ctx: int) -> dict[str, Any]:
    """The plan executor (MoeLayer, world size 1), per-phase medians, microseconds."""
    from bench.gpu_probe import before

    return {"phases_us": before(experts, seqs, ctx)}


def calibrations(model: str, expert_dtype: str, repeats: int) -> dict[str, Any]:
    """``repeats`` calibrations at the model's shapes; the stable figures and what was
    dropped. Calibration shapes differ from the fidelity shapes: decode attention 64
    sequences x 8192 KV; experts at 4, 16 and 512 rows per slot."""
    import torch

    from agents.calibrate import CalibrationOptions, measure_rank

    m = layer_model(model, expert_dtype)
    o = replace(
        CalibrationOptions(),
        hidden=m.hidden,
        expert_ffn=m.expert_ffn,
        experts_per_gpu=m.num_experts,
        num_q_heads=m.num_q_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        num_experts=m.num_experts,
        top_k=m.top_k,
        num_shared_experts=m.num_shared_experts,
        decode_batch=64,
        decode_context=8192,
        prefill_tokens=4096,
        prefill_seq=2048,
        token_counts=(256, 2048, 8192),
        rows_per_expert=(4, 16, 256),
        iters=10,
        nccl=False,
        expert_dtype=expert_dtype,
        repeats=repeats,
    )
    t0 = time.perf_counter()
    r = measure_rank(0, 1, o, torch.device("cuda", 0))
    per_run = [run["measured"] for run in r["runs"]]
    spread = {}
    for k in sorted(set().union(*per_run)):
        vals = [x[k] for x in per_run if k in x]
        if vals and min(vals) > 0:
            spread[k] = max(vals) / min(vals) - 1.0
    return {
        "options": asdict(o),
        "measured": r["measured"],
        "dropped": r["dropped"],
        "per_run": per_run,
        "spread": spread,
        "runtime_raw": [run["runtime"] for run in r["runs"]],
        "duration_s": time.perf_counter() - t0,
    }


def fidelity_case(
    model: str, expert_dtype: str, phase: dict[str, Any], figures: dict[str, float]
) -> dict[str, Any]:
    """Measured phases of the model's layer against the cost model's prediction."""
    import torch

    from agents.runtime.fast import build_fast_layer
    from agents.runtime.layer import LayerShape

    m = layer_model(model, expert_dtype)
    shape = LayerShape.from_model(m)
    dev = torch.device("cuda", 0)
    layer = build_fast_layer(
        shape,
        _placement(m.num_experts, phase["tokens"], 0),
        rank=0,
        decode=phase["decode"],
        seq_len=phase["context"],
        context=phase["context"],
        device=dev,
        dtype=torch.bfloat16,
        expert_dtype=expert_dtype,
        rule="static",
        seeded_experts=False,
        sample_logits=torch.zeros(m.num_experts, device=dev),
    )
    from agents.calibrate.runtime_figures import kernel_split

    layer.capture()
    rounds = [layer.time_graphs(10) for _ in range(3)]
    kernels = {}
    for name, fn in layer.phase_fns().items():
        layer.step()
        kernels[name] = kernel_split(fn)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    measured = {
        "attention": med["attention"],
        "expert_phase": med["dispatch"] + med["experts"] + med["combine"],
        "layer": med["layer"],
        "phases": med,
        "rounds": rounds,
        "kernels": kernels,
    }
    del layer
    torch.cuda.empty_cache()
    pred = predict(
        m, decode=phase["decode"], tokens=phase["tokens"], context=phase["context"], figures=figures
    )
    pred["layer_us"] = pred["attention_us"] + pred["expert_us"]  # world 1: no all-to-all
    return {"measured": measured, "predicted": pred, "figures": figures}


BEFORE_SHAPES = ((128, 128, 4096), (256, 128, 4096), (128, 64, 2048))
"""The issue's shapes: (experts, decode sequences, KV length)."""

RUNTIME_CASES: tuple[tuple[str, int, dict[str, Any], str, str, int], ...] = (
    ("128 experts x 128 seqs x 4096, bf16", 128, DECODE, "bf16", "static", 0),
    ("256 experts x 128 seqs x 4096, bf16", 256, DECODE, "bf16", "static", 0),
    (
        "128 experts x 64 seqs x 2048, bf16",
        128,
        {**DECODE, "tokens": 64, "context": 2048},
        "bf16",
        "static",
        0,
    ),
    ("128 experts x 128 seqs x 4096, fp8", 128, DECODE, "fp8", "static", 0),
    ("256 experts x 128 seqs x 4096, fp8", 256, DECODE, "fp8", "static", 0),
    ("128+32 replicas decode, static", 128, DECODE, "bf16", "static", 32),
    ("128+32 replicas decode, even", 128, DECODE, "bf16", "even", 32),
    ("256 experts prefill 8192 x 2048, bf16", 256, PREFILL, "bf16", "static", 0),
    ("256 experts prefill 8192 x 2048, fp8", 256, PREFILL, "fp8", "static", 0),
)
"""(label, experts, step, expert dtype, replica rule, replicated experts)."""

FIDELITY_MODELS = (("deepseek-v3", "bf16"), ("deepseek-v3", "fp8"), ("qwen3-235b-a22b", "bf16"))


def _before_cases() -> list[dict[str, Any]]:
    out = []
    for e, s, c in BEFORE_SHAPES:
        out.append(_guard(partial(before_case, e, s, c), label=f"{e} experts x {s} seqs x {c}"))
        _log(f"before {out[-1]}")
    return out


def _runtime_cases(ceil: dict[str, float]) -> list[dict[str, Any]]:
    out = []
    for label, e, ph, dt, rule, red in RUNTIME_CASES:
        fn = partial(
            runtime_case, ceil, "deepseek-v3", e, expert_dtype=dt, rule=rule, redundant=red, **ph
        )
        out.append(
            _guard(fn, label=label, experts=e, expert_dtype=dt, rule=rule, redundant=red, **ph)
        )
        r = out[-1]
        _log(f"{label}: {r.get('graph_us', r.get('error'))} roof {r.get('roofline_us')}")
    return out


def _fidelity_cases(repeats: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    cals: dict[str, Any] = {}
    cases: list[dict[str, Any]] = []
    for model, dt in FIDELITY_MODELS:
        key = f"{model}/{dt}"
        cal = cals[key] = _guard(partial(calibrations, model, dt, repeats))
        _log(
            f"calibration {key}: {cal.get('measured', cal.get('error'))} "
            f"dropped {cal.get('dropped')}"
        )
        if "measured" not in cal:
            continue
        for name, ph in (("decode", DECODE), ("prefill", PREFILL)):
            fn = partial(fidelity_case, model, dt, ph, cal["measured"])
            cases.append(_guard(fn, model=model, expert_dtype=dt, phase=name))
            f = cases[-1]
            _log(
                f"fidelity {key} {name}: {f.get('measured', {}).get('layer')} vs "
                f"{f.get('predicted')}"
            )
    return cals, cases


def start_record(
    kind: str, module: str, argv: list[str] | None, out: str, device: str
) -> dict[str, Any]:
    """The head of a GPU results document, creating the folder ``out``: its ``kind``, the
    command that reproduces it (``python -m MODULE ...``, the folder written ``OUT``) and the
    environment, on the GPU named ``device``."""
    from agents.runtime.bench_results import environment

    os.makedirs(out, exist_ok=True)
    doc: dict[str, Any] = {
        "kind": kind,
        "command": f"python -m {module} " + " ".join(argv or sys.argv[1:]).replace(out, "OUT"),
        "environment": environment(),
    }
    doc["environment"]["device"] = device
    return doc


def save_record(doc: dict[str, Any], out: str, name: str) -> str:
    """Write ``doc`` as ``out/name`` (JSON); returns the path."""
    path = os.path.join(out, name)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1, default=str)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", required=True, help="folder for gpu-h200-runtime.json")
    p.add_argument("--repeats", type=int, default=3, help="calibrations per model shape")
    p.add_argument("--skip-before", action="store_true", help="skip the plan executor runs")
    args = p.parse_args(argv)
    from agents.calibrate.measure import import_torch

    try:
        torch = import_torch()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    doc = start_record(
        "mixfleet.gpu-runtime/v1", "bench.gpu", argv, args.out, torch.cuda.get_device_name(0)
    )
    doc["torch_features"] = {
        k: hasattr(torch, k) for k in ("_grouped_mm", "_scaled_grouped_mm", "_scaled_mm")
    }
    doc["ceilings"] = ceil = ceilings()
    _log(f"ceilings {ceil}")
    doc["before"] = [] if args.skip_before else _before_cases()
    doc["runtime"] = _runtime_cases(ceil)
    doc["calibration"], doc["fidelity"] = _fidelity_cases(args.repeats)
    doc["tables"] = {
        "roofline": roofline_table(doc["runtime"]),
        "fidelity": fidelity_table(doc["fidelity"]),
    }
    doc["duration_s"] = time.perf_counter() - t0
    path = save_record(doc, args.out, "gpu-h200-runtime.json")
    print("\n".join(doc["tables"]["roofline"] + [""] + doc["tables"]["fidelity"]))
    _log(f"wrote {path} in {doc['duration_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
