"""Reference timings of GPUs this project cannot run, read from NVIDIA's aiconfigurator
per-operation data (PyPI ``aiconfigurator-core`` 0.12.0, ``systems/data/<gpu>/...``,
measured by NVIDIA on each GPU with SGLang's kernels and NCCL), written as the data file
``policies/data/reference_timings.json`` that :mod:`policies.reference` reads.

``python -m bench.gpu_reference --data DIR`` with ``DIR`` the ``aiconfigurator_core/systems/
data`` folder of the unpacked wheel (``pip download --no-deps aiconfigurator-core==0.12.0``
then unzip); needs ``pyarrow`` to read the parquet tables (not a dependency of this
project: only this extraction needs it).

Per GPU it keeps: BF16 and FP8 GEMM times at ``m x 8192 x 8192`` (m = 16 and 8192: weight
streaming and compute rate), decode attention times (8 query heads, 1 KV head of 128, BF16
cache: one rank's slice of a GQA model) at 1-256 sequences x 4096 cached tokens, and NCCL
all-gather, reduce-scatter and all-to-all times over 8 GPUs of one node for messages of
1 MiB to 1 GiB.

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
        "command": "python -m bench.gpu_reference --data DATA",
        "shapes": {
            "gemm": "m x 8192 x 8192 (m rows, 8192 x 8192 weight), m = 16 and 8192",
            "decode_attention": f"8 query heads, 1 KV head of 128, BF16 cache, {CONTEXT} cached "
            f"tokens, batch {', '.join(map(str, BATCHES))}",
            "nccl": "8 GPUs of one node, message bytes (per GPU input for all-gather, output "
            "for reduce-scatter, per GPU buffer for all-to-all)",
        },
        "units": "microseconds",
        "gpus": gpus,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--data", required=True, help="aiconfigurator_core/systems/data folder")
    p.add_argument("--out", default=str(OUT), help="where to write the JSON")
    args = p.parse_args(argv)
    try:
        doc = extract(Path(args.data))
    except (OSError, ImportError, KeyError) as exc:
        print(f"error: cannot read the reference data: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
