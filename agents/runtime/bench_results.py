"""The results file of :mod:`agents.runtime.bench`: the host it ran on
(:func:`environment`), its headline figures (:func:`report`: measured against predicted
layer time, ilp-vs-uniform speed-ups) and the table printed at the end (:func:`summary`).

Times are microseconds (``_us``); errors and gains are fractions.
"""

from __future__ import annotations

import importlib
import math
import os
import platform
import subprocess
from collections.abc import Mapping
from typing import Any

from agents.calibrate import (
    software_versions,
)


def environment() -> dict[str, Any]:
    """Hardware and software of this host, for the results file."""
    env: dict[str, Any] = {"software": software_versions(), "platform": platform.platform()}
    env["cpu_count"] = os.cpu_count()
    try:
        q = "name,memory.total,driver_version,clocks.max.sm,clocks.max.mem,power.limit"
        env["nvidia_smi"] = (
            subprocess.run(
                ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            .stdout.strip()
            .splitlines()
        )
        env["nvidia_smi_topo"] = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        env["nvidia_smi"] = f"unavailable: {exc}"
    try:
        env["software"]["cupy"] = str(importlib.import_module("cupy").__version__)
    except ImportError:
        env["software"]["cupy"] = "not installed"
    return env


def report(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Headline figures: per scenario, phase and policy the measured layer time against
    the calibrated and catalog predictions; ilp-vs-uniform speed-ups, measured and
    predicted, and the measured share of the predicted gain."""
    out: dict[str, Any] = {"fidelity": [], "heterogeneity": []}
    for key in ("equal", "slowed"):
        sc = doc.get(key)
        if not sc or "runs" not in sc:
            continue
        for phase, by_policy in sc["runs"].items():
            for policy, r in by_policy.items():
                meas = max(m["layer_us"] for m in r["measured"])
                pred = r["predicted"]["layer_us"]
                cat = r["predicted_catalog"]["layer_us"]
                out["fidelity"].append(
                    {
                        "scenario": key,
                        "phase": phase,
                        "policy": policy,
                        "tokens_per_gpu": [m["tokens"] for m in r["measured"]],
                        "experts_per_gpu": [m["slots"] for m in r["measured"]],
                        "measured_layer_us": meas,
                        "measured_free_layer_us": max(m["free_layer_us"] for m in r["measured"]),
                        "predicted_layer_us": pred,
                        "error": (pred - meas) / meas,
                        "catalog_layer_us": cat,
                        "catalog_error": (cat - meas) / meas,
                        "measured_busy_us": [m["busy_us"] for m in r["measured"]],
                        "predicted_busy_us": r["predicted"]["busy_us"],
                        "busy_error": [
                            (p - m["busy_us"]) / m["busy_us"]
                            for p, m in zip(r["predicted"]["busy_us"], r["measured"], strict=True)
                        ],
                    }
                )
            uni, ilp = by_policy.get("uniform"), by_policy.get("ilp")
            if uni and ilp:
                mu = max(m["layer_us"] for m in uni["measured"])
                mi = max(m["layer_us"] for m in ilp["measured"])
                pu, pi = uni["predicted"]["layer_us"], ilp["predicted"]["layer_us"]
                gain_pred = pu / pi - 1.0
                out["heterogeneity"].append(
                    {
                        "scenario": key,
                        "phase": phase,
                        "measured_speedup": mu / mi,
                        "predicted_speedup": pu / pi,
                        "measured_gain_over_predicted": (mu / mi - 1.0) / gain_pred
                        if abs(gain_pred) > 1e-3
                        else None,
                    }
                )
    return out


def summary(doc: Mapping[str, Any]) -> str:
    """A short table: per scenario, phase and policy the predicted and measured layer time."""
    lines = [
        f"{'scenario':<9} {'phase':<8} {'policy':<8} {'pred_us':>9} {'meas_us':>9} {'free_us':>9} {'err%':>6}  per-GPU busy meas/pred"
    ]
    for key in ("equal", "slowed"):
        sc = doc.get(key)
        if not sc or "runs" not in sc:
            if sc:
                lines.append(f"{key}: {sc.get('error')}")
            continue
        for phase, by_policy in sc["runs"].items():
            for policy, r in by_policy.items():
                pred = r["predicted"]["layer_us"]
                meas = max(m["layer_us"] for m in r["measured"])
                free = max(m["free_layer_us"] for m in r["measured"])
                err = (pred - meas) / meas * 100 if meas else math.nan
                per = " ".join(
                    f"{m['busy_us']:.0f}/{b:.0f}"
                    for m, b in zip(r["measured"], r["predicted"]["busy_us"], strict=True)
                )
                lines.append(
                    f"{key:<9} {phase:<8} {policy:<8} {pred:9.0f} {meas:9.0f} {free:9.0f} {err:6.1f}  {per}"
                )
    return "\n".join(lines)
