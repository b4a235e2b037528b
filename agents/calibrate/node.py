"""Calibrating a whole node, and the ``mixfleet-agent calibrate`` sub-command.

Owns the per-rank entry point (:func:`measure_rank`: every measurement of one GPU and its
figures), one process per GPU (:func:`calibrate_node`), the software versions recorded with
a calibration, and the sub-command's flags (:func:`add_arguments`) and :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import asdict, replace
from typing import Any

from agents.calibrate.fit import apply_calibration, figures_from_curves, stable_figures
from agents.calibrate.measure import calibrate_gpu, import_torch, nccl_figures
from agents.calibrate.options import CalibrationOptions


def _calibrate_rank(rank: int, world: int, o: CalibrationOptions) -> dict[str, Any]:
    """One GPU's calibration (runs in that GPU's process)."""
    import torch

    return measure_rank(rank, world, o, torch.device("cuda", rank))


def measure_rank(rank: int, world: int, o: CalibrationOptions, dev: Any) -> dict[str, Any]:
    """Every measurement of one rank's GPU (all ranks call it together), ``o.repeats``
    times, and the figures the repeats agree on (the others dropped, with the reason)."""
    import torch

    from agents.calibrate.runtime_figures import runtime_figures

    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for _ in range(max(1, o.repeats)):
        curves = calibrate_gpu(dev, o)
        nccl = nccl_figures(o) if o.nccl and world > 1 else None
        runtime = runtime_figures(dev, o) if o.runtime_figures else None
        runs.append(
            {
                "measured": figures_from_curves(curves, nccl, runtime),
                "curves": curves,
                "nccl": nccl,
                "runtime": runtime,
            }
        )
    measured, dropped = stable_figures([r["measured"] for r in runs])
    props = torch.cuda.get_device_properties(rank)
    return {
        "index": rank,
        "name": torch.cuda.get_device_name(rank),
        "uuid": _uuid(props),
        "sm_count": int(props.multi_processor_count),
        "measured": measured,
        "dropped": dropped,
        "runs": runs,
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
    torch = import_torch()
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
    parser.add_argument(
        "--repeats",
        type=int,
        default=d.repeats,
        help="calibrations per GPU; figures they disagree on by more than 5%% are dropped",
    )
    parser.add_argument(
        "--expert-dtype", default=d.expert_dtype, choices=("bf16", "fp8"), help="expert weights"
    )


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
        repeats=args.repeats,
        expert_dtype=args.expert_dtype,
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
        for k, why in sorted(g.get("dropped", {}).items()):
            print(f"gpu{g['index']} dropped {k}: {why}")
    print(f"calibration took {doc['duration_s']:.1f} s; wrote {args.out}")
    if args.inventory:
        from policies.hardware.inventory import inventory_from_dict, inventory_to_dict

        with open(args.inventory, encoding="utf-8") as fh:
            inv = inventory_from_dict(json.load(fh))
        updated = apply_calibration(inv, doc)
        path = os.path.splitext(args.out)[0] + ".inventory.json"
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(inventory_to_dict(updated), fh, indent=1)
        print(f"wrote {path}")
    return 0
