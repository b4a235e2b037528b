"""Reference timings of GPUs this project cannot run, read from NVIDIA's aiconfigurator
per-operation data (PyPI ``aiconfigurator-core`` 0.12.0, ``systems/data/<gpu>/...``,
measured by NVIDIA on each GPU with SGLang's kernels and NCCL), written as the data file
``policies/data/reference_timings.json`` that :mod:`policies.estimate.reference` reads.

``python -m bench.gpu_reference`` in an environment with ``aiconfigurator-core==0.12.0``
and ``pyarrow`` installed (neither is a dependency of this project: only this extraction
needs them); ``--data DIR`` reads the tables from another ``aiconfigurator_core/systems/
data`` folder (an unpacked wheel) than the installed package's.

Per GPU it keeps: BF16 and FP8 GEMM times at ``m x 8192 x 8192`` (m = 16 and 8192: weight
streaming and compute rate), decode attention times (8 query heads, 1 KV head of 128, BF16
cache: one rank's slice of a GQA model) at 1-256 sequences x 4096 cached tokens, and NCCL
all-gather, reduce-scatter and all-to-all times over 8 GPUs of one node for messages of
1 MiB to 1 GiB.

Whole-layer step curves (``layer_curves`` in the file): aiconfigurator's own composition of
a step from those per-operation tables (``aiconfigurator_core.sdk``: the model's op graph
for SGLang, each op looked up in the GPU's measured tables and summed as its
``InferenceSession.run_static`` does), for the setups in :data:`SETUPS` at 1-256
sequences per GPU and 4096 tokens of context, 8 GPUs of one node, uniform expert load,
attention data-parallel (TP 1). Building them needs the ``aiconfigurator-core`` package
itself (its SDK; ``pip install aiconfigurator-core==0.12.0`` in a scratch environment);
the file keeps the per-phase sums, not the tables.

Units: microseconds, bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

GPUS = {
    "A100-SXM4-80GB": ("a100_sxm", "0.5.10", "flash_attention"),
    "H100-SXM5-80GB": ("h100_sxm", "0.5.14", "fa3"),
    "H200-SXM-141GB": ("h200_sxm", "0.5.14", "fa3"),
    "B200": ("b200_sxm", "0.5.14", "flashinfer"),
    "L40S": ("l40s", "0.5.14", "flashinfer"),
}
"""Catalog model -> (data folder, SGLang version of its tables, decode attention kernel)."""

NCCL = {
    "A100-SXM4-80GB": "2.27.3",
    "H100-SXM5-80GB": "2.27.3",
    "H200-SXM-141GB": "2.26.2",
    "B200": "2.27.3",
    "L40S": "2.27.3",
}
"""The NCCL version whose table is read for each GPU (one version per GPU)."""

OUT = Path(__file__).resolve().parent.parent / "policies" / "data" / "reference_timings.json"
BATCHES = (1, 16, 64, 256)
CONTEXT = 4096
MESSAGES = tuple(2**k for k in range(20, 31))  # 1 MiB .. 1 GiB


def _table(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return list(pq.read_table(path).to_pylist())


def _gemm(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for dt in ("bfloat16", "fp8"):
        for m in (16, 8192):
            hit = [
                r
                for r in rows
                if r["gemm_dtype"] == dt and (r["m"], r["n"], r["k"]) == (m, 8192, 8192)
            ]
            if hit:
                out.setdefault(dt, {})[f"m{m}_us"] = float(hit[0]["latency"]) * 1e3
    return out


def _attention(rows: list[dict[str, Any]], kernel: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in rows:
        if (
            (r["num_heads"], r["num_key_value_heads"], r["head_dim"]) == (8, 1, 128)
            and r["kv_cache_dtype"] == "bfloat16"
            and r["kernel_source"] == kernel
            and not r.get("window_size")
            and r["isl"] + r["step"] == CONTEXT
            and r["batch_size"] in BATCHES
        ):
            out[f"b{r['batch_size']}_us"] = float(r["latency"]) * 1e3
    return out


def _nccl(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["num_gpus"] == 8 and r["op_name"] in ("all_gather", "reduce_scatter", "alltoall"):
            size = int(
                r["message_size"]
            )  # bytes (nccl-tests size: 8 GPUs of H100 then gather at ~340 GB/s bus bandwidth)
            if size in MESSAGES:
                out.setdefault(r["op_name"], {})[str(size)] = float(r["latency"]) * 1e3
    return out


SETUPS: dict[str, dict[str, Any]] = {
    "deepseek-v3/decode/deepep": {
        "hf_model": "deepseek-ai/DeepSeek-V3",
        "preset": "deepseek-v3",
        "phase": "decode",
        "exchange": "alltoall",
        "deepep": True,
        "kv_cache_dtype": "fp8",
        "gpus": ("H100-SXM5-80GB", "H200-SXM-141GB", "B200"),
        "batches": (1, 8, 32, 64, 128, 256),
        "describe": "DeepSeek-V3 (FP8 block weights, FP8 KV cache), SGLang with DeepEP "
        "low-latency all-to-all, attention DP 8 x TP 1, EP 8, decode at 4096 tokens of context",
    },
    "deepseek-v3/prefill/deepep": {
        "hf_model": "deepseek-ai/DeepSeek-V3",
        "preset": "deepseek-v3",
        "phase": "prefill",
        "exchange": "alltoall",
        "deepep": True,
        "kv_cache_dtype": "fp8",
        "gpus": ("H100-SXM5-80GB", "H200-SXM-141GB", "B200"),
        "batches": (1, 2, 4),
        "describe": "DeepSeek-V3 (FP8 block weights), SGLang with DeepEP high-throughput "
        "all-to-all, attention DP 8 x TP 1, EP 8, prefill of sequences of 4096 tokens",
    },
    "deepseek-v3/decode/allgather": {
        "hf_model": "deepseek-ai/DeepSeek-V3",
        "preset": "deepseek-v3",
        "phase": "decode",
        "exchange": "allgather",
        "deepep": False,
        "kv_cache_dtype": "fp8",
        "gpus": ("H100-SXM5-80GB", "H200-SXM-141GB", "B200"),
        "batches": (1, 8, 32, 64, 128, 256),
        "describe": "DeepSeek-V3 (FP8 block weights, FP8 KV cache), SGLang's default MoE inside "
        "one node (fused MoE kernel, tokens all-gathered and reduce-scattered, overlapped with "
        "the shared expert), attention DP 8 x TP 1, EP 8, decode at 4096 tokens of context",
    },
    "deepseek-v3/prefill/allgather": {
        "hf_model": "deepseek-ai/DeepSeek-V3",
        "preset": "deepseek-v3",
        "phase": "prefill",
        "exchange": "allgather",
        "deepep": False,
        "kv_cache_dtype": "fp8",
        "fmha_quant_mode": "bfloat16",  # the tables hold no FP8 context MLA for this path
        "gpus": ("H100-SXM5-80GB", "H200-SXM-141GB", "B200"),
        "batches": (1, 2, 4),
        "describe": "DeepSeek-V3 (FP8 block weights, BF16 attention), SGLang's default MoE "
        "inside one node (fused MoE kernel, tokens all-gathered and reduce-scattered), "
        "attention DP 8 x TP 1, EP 8, prefill of sequences of 4096 tokens",
    },
    "qwen3-235b-a22b-bf16/decode/allgather": {
        "hf_model": "Qwen/Qwen3-235B-A22B",
        "preset": "qwen3-235b-a22b",
        "phase": "decode",
        "exchange": "allgather",
        "deepep": False,
        "kv_cache_dtype": "bf16",
        "gpus": ("A100-SXM4-80GB", "H100-SXM5-80GB", "H200-SXM-141GB", "B200"),
        "batches": (1, 8, 32, 64, 128, 256),
        "describe": "Qwen3-235B-A22B in BF16, SGLang's default MoE inside one node (fused "
        "MoE kernel, tokens all-gathered and reduce-scattered), attention DP 8 x TP 1, EP 8, "
        "decode at 4096 tokens of context",
    },
    "qwen3-30b-a3b-bf16/decode/allgather": {
        "hf_model": "Qwen/Qwen3-30B-A3B",
        "preset": "qwen3-30b-a3b",
        "phase": "decode",
        "exchange": "allgather",
        "deepep": False,
        "kv_cache_dtype": "bf16",
        "gpus": ("A100-SXM4-80GB", "H100-SXM5-80GB", "H200-SXM-141GB", "B200", "L40S"),
        "batches": (1, 8, 32, 64, 128, 256),
        "describe": "Qwen3-30B-A3B in BF16, SGLang's default MoE inside one node (fused MoE "
        "kernel, tokens all-gathered and reduce-scattered: over PCIe on L40S), attention DP 8 "
        "x TP 1, EP 8, decode at 4096 tokens of context",
    },
}
"""Whole-layer setups: aiconfigurator model, mixfleet preset, phase, how the EP group moves
tokens (``alltoall``: DeepEP; ``allgather``: SGLang's default EP inside a node), KV-cache
dtype, GPUs and batch sizes (sequences per GPU; prefill: sequences of :data:`CONTEXT`
tokens per GPU)."""

PHASE_OF_OP = {
    "attention_us": (
        "qkv_a_proj_gemm",
        "downscale_gemm",
        "add_norm_1",
        "add_norm_2",
        "attention",
        "mla_block",
        "qkv_gemm",
        "proj_gemm",
        "router_gemm",
        "gate_ffn1_gemm",
        "shared_gate_up_gemm",
        "shared_act_gate",
        "shared_ffn2_gemm",
        "act_gate",
        "ffn2_gemm",
    ),
    "exchange_us": ("moe_dispatch", "moe_combine", "moe_pre_dispatch", "moe_post_dispatch"),
    "expert_us": ("moe", "moe_overlap"),
    "outside_layers_us": ("embedding", "logits_gemm", "p2p", "embedding_ar"),
}
"""aiconfigurator op name (without its ``generation_``/``context_`` prefix) -> the mixfleet
phase it belongs to: attention phase (norms, attention projections, the attention kernel,
router and the shared expert), dispatch + combine, routed experts, and what runs outside
the layers (embedding, LM head). In SGLang's default DeepSeek decode graph one op,
``moe_overlap``, is the router, all-gather, routed experts and reduce-scatter overlapped
with the shared expert: it counts as routed experts."""


def _aic_step_ms(
    system: str, setup: dict[str, Any], batch: int
) -> tuple[str, dict[str, float], dict[str, str]]:
    """One step of ``setup`` on aiconfigurator's ``system`` at ``batch`` sequences per GPU:
    (SGLang table version, per-op milliseconds of the whole step, per-op data source)."""
    import logging

    from aiconfigurator.cli import api  # type: ignore[import-not-found]
    from aiconfigurator.sdk import perf_database  # type: ignore[import-not-found]
    from aiconfigurator.sdk.backends.factory import get_backend  # type: ignore[import-not-found]
    from aiconfigurator.sdk.config import RuntimeConfig  # type: ignore[import-not-found]
    from aiconfigurator.sdk.inference_session import (  # type: ignore[import-not-found]
        InferenceSession,
    )
    from aiconfigurator.sdk.models import get_model  # type: ignore[import-not-found]
    from aiconfigurator.sdk.moe_comm_resolver import (  # type: ignore[import-not-found]
        resolve_model_config_moe_comm,
    )

    logging.disable(logging.WARNING)
    version = perf_database.get_latest_database_version(system, "sglang")
    db = perf_database.get_database(system, "sglang", version)
    # tp, pp, attention dp, moe tp, moe ep; quant modes from the checkpoint
    mc = api._build_model_config(
        1, 1, 8, 1, 8, None, None, setup.get("fmha_quant_mode"), None, None
    )
    decode = setup["phase"] == "decode"
    # uniform expert load: DeepEP tables call it "uniform", the fused-MoE ones "balanced"
    mc.workload_distribution = "uniform" if setup["deepep"] else "balanced"
    phase = "generation" if decode else "context"
    if setup["deepep"]:  # the CLI keeps EP inside a node on the fused path; select DeepEP
        resolve_model_config_moe_comm(
            mc,
            model_path=setup["hf_model"],
            backend_name="sglang",
            database=db,
            required_phases=(phase,),
            coverage_snapshot={phase: {"deepep_ll" if decode else "deepep_ht": {8}}},
        )
    model = get_model(setup["hf_model"], mc, "sglang")
    session = InferenceSession(model, db, get_backend("sglang"))
    rc = RuntimeConfig(batch_size=batch, isl=CONTEXT, osl=2 if decode else 1)
    summary = session.run_static(
        runtime_config=rc, mode="static_gen" if decode else "static_ctx", stride=32
    )
    if decode:
        ops, src = summary.get_generation_latency_dict(), summary.get_generation_source_dict()
    else:
        ops, src = summary.get_context_latency_dict(), summary.get_context_source_dict()
    return str(version), {k: float(v) for k, v in ops.items()}, dict(src or {})


def _phases_us(ops_ms: dict[str, float]) -> dict[str, float]:
    """Per-op step milliseconds grouped into :data:`PHASE_OF_OP`'s phases, microseconds;
    ``step_us`` their sum (aiconfigurator's step time)."""
    out = dict.fromkeys(PHASE_OF_OP, 0.0)
    for name, ms in ops_ms.items():
        short = name.split("_", 1)[1]
        phase = next((p for p, names in PHASE_OF_OP.items() if short in names), None)
        if phase is None:
            raise KeyError(f"aiconfigurator op {name!r} has no phase in PHASE_OF_OP")
        out[phase] += ms * 1e3
    out["step_us"] = sum(ms for ms in ops_ms.values()) * 1e3
    return {k: round(v, 2) for k, v in out.items()}


def layer_curves() -> dict[str, Any]:
    """Every :data:`SETUPS` curve on every GPU with data (a GPU whose tables lack a needed
    op is kept with the reason instead of a curve)."""
    out: dict[str, Any] = {}
    for name, setup in SETUPS.items():
        per_gpu: dict[str, Any] = {}
        for model in setup["gpus"]:
            system = GPUS[model][0]
            try:
                curve: dict[str, dict[str, float]] = {}
                sources: set[str] = set()
                ops: list[str] = []
                version = ""
                for b in setup["batches"]:
                    version, ops_ms, src = _aic_step_ms(system, setup, b)
                    curve[str(b)] = _phases_us(ops_ms)
                    sources |= {f"{k.split('_', 1)[1]}={v}" for k, v in src.items()}
                    ops = [k.split("_", 1)[1] for k in ops_ms]
                per_gpu[model] = {
                    "sglang": version,
                    "ops": ops,
                    "op_sources": sorted(sources),
                    "by_batch": curve,
                }
            except (ValueError, RuntimeError) as exc:  # aiconfigurator: no data for an op
                reason = str(exc).split(" at /")[0].strip()
                per_gpu[model] = {"missing": f"{type(exc).__name__}: {reason}"}
        out[name] = {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in setup.items()
            if k not in ("gpus",)
        } | {"context": CONTEXT, "gpus_per_node": 8, "by_gpu": per_gpu}
    return out


def extract(data: Path) -> dict[str, Any]:
    """The reference document from the unpacked data folder."""
    gpus: dict[str, Any] = {}
    for model, (folder, ver, kernel) in GPUS.items():
        base = data / folder
        gpus[model] = {
            "folder": folder,
            "sglang": ver,
            "nccl": NCCL[model],
            "attention_kernel": kernel,
            "gemm_8192x8192_us": _gemm(
                _table(base / "gemm" / "sglang" / ver / "gemm_perf.parquet")
            ),
            "decode_attention_4096_us": _attention(
                _table(base / "attention" / "sglang" / ver / "generation_attention_perf.parquet"),
                kernel,
            ),
            "nccl_8gpu_us": _nccl(
                _table(base / "comm" / "nccl" / NCCL[model] / "nccl_perf.parquet")
            ),
        }
    return {
        "kind": "mixfleet.reference-timings/v1",
        "source": "NVIDIA aiconfigurator-core 0.12.0 (PyPI), aiconfigurator_core/systems/data "
        "(per-operation timings measured by NVIDIA with SGLang kernels and NCCL)",
        "command": "python -m bench.gpu_reference (aiconfigurator-core 0.12.0 and pyarrow "
        "installed; --data DATA to read the tables from an unpacked wheel instead)",
        "shapes": {
            "gemm": "m x 8192 x 8192 (m rows, 8192 x 8192 weight), m = 16 and 8192",
            "decode_attention": f"8 query heads, 1 KV head of 128, BF16 cache, {CONTEXT} cached "
            f"tokens, batch {', '.join(map(str, BATCHES))}",
            "nccl": "8 GPUs of one node, message bytes (per GPU input for all-gather, output "
            "for reduce-scatter, per GPU buffer for all-to-all)",
        },
        "units": "microseconds",
        "gpus": gpus,
        "layer_curves": layer_curves(),
    }


def _installed_data() -> Path:
    """The ``systems/data`` folder of the installed aiconfigurator-core."""
    import aiconfigurator_core  # type: ignore[import-not-found]

    return Path(aiconfigurator_core.__file__).resolve().parent / "systems" / "data"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--data",
        help="aiconfigurator_core/systems/data folder (default: the installed package's)",
    )
    p.add_argument("--out", default=str(OUT), help="where to write the JSON")
    args = p.parse_args(argv)
    try:
        doc = extract(Path(args.data) if args.data else _installed_data())
    except (OSError, ImportError, KeyError) as exc:
        fix = (
            ". To fix: pip install aiconfigurator-core==0.12.0 pyarrow (a scratch environment)"
            if isinstance(exc, ImportError)
            else ""
        )
        print(f"error: cannot read the reference data: {exc}{fix}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
