"""The cost model against the one-GPU sweep of :mod:`bench.gpu_sweep`: calibration from a
few of the sweep's points, prediction of all of them, the tables and the figure. Pure
(no torch); reruns on a results file: ``python -m bench.gpu_sweep --analyse FILE``.

Per model, expert dtype and round: the figures come from :func:`agents.calibrate.fit.
sweep_figures` over the :data:`CALIBRATION` points of that round (kernel rates from their
kernel splits, then the fixed costs as intercept and slope over their sizes); every point
of the round is then predicted by the cost model (:func:`agents.calibrate.fit.
layer_phase_times`) and compared with its phases as measured inside the step's CUDA graph.
A point's error is the worst of the three rounds.

Units: microseconds (``_us``), fractions for errors.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agents.calibrate.fit import PhasePoint, layer_phase_times, sweep_figures
from agents.calibrate.options import DEFAULT_SWEEP_POINTS
from bench.gpu_model import layer_model

CALIBRATION = DEFAULT_SWEEP_POINTS
"""(phase, tokens, context) of the points each round calibrates from: the calibration's own
sweep (:data:`agents.calibrate.options.DEFAULT_SWEEP_POINTS`), five decode sizes and three
prefill sizes, none of them the issue's table points (decode 128 x 4096, prefill 8192 x
2048)."""

TOLERANCE = 0.10
"""The target: each phase within 10% of the measurement."""

TABLE_POINTS = (("decode", 128, 4096), ("prefill", 8192, 2048))
"""The issue's per-phase table: decode 128 sequences x 4096, prefill 8192 tokens of 2048."""


def _key(p: Mapping[str, Any]) -> tuple[str, int, int]:
    return (str(p["phase"]), int(p["tokens"]), int(p["context"]))


def _measured(p: Mapping[str, Any]) -> tuple[float, float, float] | None:
    """(attention, expert phase, step) inside the step graph, us; None if not measured."""
    il = p.get("in_layer_us")
    if not il:
        return None
    return (
        float(il["attention"]),
        float(il["dispatch"] + il["experts"] + il["combine"]),
        float(il["layer"]),
    )


def _point(p: Mapping[str, Any], kernels: Mapping[str, Any] | None) -> PhasePoint | None:
    m = _measured(p)
    if m is None:
        return None
    return PhasePoint(
        layer_model(str(p["model"]), str(p["expert_dtype"])),
        p["phase"] == "decode",
        int(p["tokens"]),
        int(p["context"]),
        m[0],
        m[1],
        kernels,
    )


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def analyse(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Calibrate per (model, dtype, round), predict every point, collect errors; returns
    ``figures`` per case and round, ``points`` (measured medians, predicted, worst error
    per phase), ``summary`` and the markdown ``table``."""
    groups: dict[tuple[str, str], dict[int, list[Mapping[str, Any]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for p in doc["points"]:
        if "error" not in p:
            groups[(p["model"], p["expert_dtype"])][int(p["round"])].append(p)
    figures: dict[str, list[dict[str, float]]] = {}
    rows: list[dict[str, Any]] = []
    for (model, dt), rounds in groups.items():
        case = f"{model}/{dt}"
        kernels0 = {_key(p): p.get("kernels") for p in rounds.get(0, [])}
        per_point: dict[tuple[str, int, int], list[tuple[tuple[float, ...], dict[str, float]]]]
        per_point = defaultdict(list)
        figures[case] = []
        for _r, pts in sorted(rounds.items()):
            cal = []
            for p in pts:
                if _key(p) in CALIBRATION:
                    pt = _point(p, p.get("kernels") or kernels0.get(_key(p)))
                    if pt is not None:
                        cal.append(pt)
            if not cal:
                continue
            figs, _ = sweep_figures(cal)
            figures[case].append(figs)
            m = layer_model(model, dt)
            for p in pts:
                meas = _measured(p)
                if meas is None:
                    continue
                ph, t, c = _key(p)
                pred = layer_phase_times(
                    m, decode=ph == "decode", tokens=t, context=c, figures=figs
                )
                per_point[(ph, t, c)].append((meas, pred))
        for (ph, t, c), vals in sorted(per_point.items()):
            meas_med = [statistics.median(v[0][i] for v in vals) for i in range(3)]
            errs = {
                name: max(
                    (_err(pred[key], meas[i]) for meas, pred in vals),
                    key=abs,
                )
                for i, (name, key) in enumerate(
                    (("attention", "attention_us"), ("experts", "expert_us"), ("layer", "layer_us"))
                )
            }
            pred_med = {
                k: statistics.median(v[1][k] for v in vals)
                for k in ("attention_us", "expert_us", "layer_us")
            }
            rows.append(
                {
                    "case": case,
                    "phase": ph,
                    "tokens": t,
                    "context": c,
                    "calibration": (ph, t, c) in CALIBRATION,
                    "measured_us": dict(
                        zip(("attention", "experts", "layer"), meas_med, strict=True)
                    ),
                    "predicted_us": pred_med,
                    "worst_error": errs,
                    "rounds": len(vals),
                }
            )
    summary = _summary(rows)
    roof = roofline_rows(rows, doc.get("ceilings", {}))
    return {
        "figures": figures,
        "figure_spread": _spread(figures),
        "points": rows,
        "summary": summary,
        "rooflines": roof,
        "table": [*_table(rows, summary), "", *_issue_table(rows), "", *_roof_table(roof)],
    }


def _issue_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The issue's per-phase table: each case at its decode and prefill point."""
    out = [
        "| model | experts | phase | attention us (pred, worst err of 3) "
        "| expert phase us | layer us |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if (r["phase"], r["tokens"], r["context"]) not in TABLE_POINTS:
            continue
        m, p, e = r["measured_us"], r["predicted_us"], r["worst_error"]
        model, dt = r["case"].split("/")
        out.append(
            f"| {model} | {dt} | {r['phase']} "
            f"| {m['attention']:.0f} ({p['attention_us']:.0f}, {e['attention']:+.1%}) "
            f"| {m['experts']:.0f} ({p['expert_us']:.0f}, {e['experts']:+.1%}) "
            f"| {m['layer']:.0f} ({p['layer_us']:.0f}, {e['layer']:+.1%}) |"
        )
    return out


def roofline_rows(
    rows: Sequence[Mapping[str, Any]], ceilings: Mapping[str, float]
) -> list[dict[str, Any]]:
    """Measured phases over their rooflines (:mod:`agents.runtime.roofline` at the run's
    copy bandwidth and GEMM peaks; expert weights counted for the experts that get pairs):
    per case at decode 16-256 sequences x 4096 and prefill 4096-16384 tokens of 2048."""
    if not ceilings:
        return []
    from agents.runtime.roofline import layer_work, rooflines_us
    from policies.estimate.costmodel import active_fraction

    tflops = {"bf16": ceilings["bf16_tflops"], "fp8": ceilings["fp8_tflops"]}
    out = []
    for r in rows:
        decode = r["phase"] == "decode"
        if (decode and (r["context"] != 4096 or r["tokens"] < 16)) or (
            not decode and (r["context"] != 2048 or r["tokens"] < 4096)
        ):
            continue
        model, dt = r["case"].split("/")
        m = layer_model(model, dt)
        p = r["tokens"] * m.top_k / m.num_experts
        work = layer_work(
            hidden=m.hidden,
            num_experts=m.num_experts,
            slots=max(1, round(m.num_experts * active_fraction(p))),
            top_k=m.top_k,
            expert_ffn=m.expert_ffn,
            num_shared_experts=m.num_shared_experts,
            num_q_heads=m.num_q_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            tokens=r["tokens"],
            decode=decode,
            context=r["context"],
            seq_len=r["context"],
            expert_dtype=dt,
        )
        roof = rooflines_us(work, ceilings["copy_gbytes_per_s"], tflops)
        meas = r["measured_us"]
        exp_roof = roof["experts"] + roof["combine"]
        out.append(
            {
                "case": r["case"],
                "phase": r["phase"],
                "tokens": r["tokens"],
                "context": r["context"],
                "attention": meas["attention"] / roof["attention"],
                "experts": meas["experts"] / exp_roof,
                "layer": meas["layer"] / roof["layer"],
                "roofline_us": roof,
            }
        )
    return out


def _roof_table(roof: Sequence[Mapping[str, Any]]) -> list[str]:
    out = [
        "| case | phase | tokens x context | attention / roof | expert phase / roof "
        "| layer / roof |",
        "|---|---|---|---|---|---|",
    ]
    for r in roof:
        out.append(
            f"| {r['case']} | {r['phase']} | {r['tokens']} x {r['context']} "
            f"| {r['attention']:.2f}x | {r['experts']:.2f}x | {r['layer']:.2f}x |"
        )
    return out


def _spread(figures: Mapping[str, Sequence[Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    """Per case and figure, max / min - 1 over the rounds' calibrations."""
    out: dict[str, dict[str, float]] = {}
    for case, runs in figures.items():
        keys = set().union(*(r.keys() for r in runs)) if runs else set()
        out[case] = {
            k: max(r[k] for r in runs) / min(r[k] for r in runs) - 1.0
            for k in sorted(keys)
            if all(k in r and r[k] > 0 for r in runs)
        }
    return out


def _summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per case and phase: points within :data:`TOLERANCE` in every round, of how many."""
    out: dict[str, Any] = {}
    for r in rows:
        for name, e in r["worst_error"].items():
            s = out.setdefault(
                f"{r['case']} {r['phase']} {name}", {"within": 0, "of": 0, "worst": 0.0}
            )
            s["of"] += 1
            s["within"] += abs(e) <= TOLERANCE
            if abs(e) > abs(s["worst"]):
                s["worst"] = e
    return out


def _table(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> list[str]:
    out = [
        "| case | phase | tokens x context | attention us (pred, worst err) "
        "| expert phase us (pred, worst err) | step us (pred, worst err) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, p, e = r["measured_us"], r["predicted_us"], r["worst_error"]
        mark = " (cal)" if r["calibration"] else ""
        out.append(
            f"| {r['case']} | {r['phase']} | {r['tokens']} x {r['context']}{mark} "
            f"| {m['attention']:.0f} ({p['attention_us']:.0f}, {e['attention']:+.1%}) "
            f"| {m['experts']:.0f} ({p['expert_us']:.0f}, {e['experts']:+.1%}) "
            f"| {m['layer']:.0f} ({p['layer_us']:.0f}, {e['layer']:+.1%}) |"
        )
    out += ["", "| case, phase, part | within 10% (all rounds) | worst |", "|---|---|---|"]
    for k, s in summary.items():
        out.append(f"| {k} | {s['within']} / {s['of']} | {s['worst']:+.1%} |")
    return out


def plot(report: Mapping[str, Any], path: str) -> None:
    """Measured (markers) and predicted (lines) step time: decode against sequences per
    GPU, one line per context, and prefill against tokens, one panel per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in report["points"]})
    fig, axes = plt.subplots(len(cases), 2, figsize=(11, 3.4 * len(cases)), squeeze=False)
    for row, case in enumerate(cases):
        pts = [r for r in report["points"] if r["case"] == case]
        ax = axes[row][0]
        _phase_lines(ax, pts, "decode", "o", lambda ctx: f"ctx {ctx // 1024}k")
        ax.set_xlabel("decode sequences per GPU")
        ax.set_ylabel("step ms (one layer)")
        ax.set_title(f"{case} decode: measured (o), model (x-)", fontsize=9)
        ax.legend(fontsize=7)
        ax = axes[row][1]
        _phase_lines(ax, pts, "prefill", "s", lambda seq: f"seq {seq}")
        ax.set_xlabel("prefill tokens per GPU")
        ax.set_title(f"{case} prefill: measured (s), model (x-)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _phase_lines(
    ax: Any, pts: list[Mapping[str, Any]], phase: str, marker: str, label: Callable[[int], str]
) -> None:
    """One panel of :func:`plot`: per context of ``phase``, the predicted step time (ms,
    ``-x`` line) and the measured one (``marker``) against tokens, log2 x axis."""
    for k, ctx in enumerate(sorted({r["context"] for r in pts if r["phase"] == phase})):
        sel = sorted(
            (r for r in pts if r["phase"] == phase and r["context"] == ctx),
            key=lambda r: r["tokens"],
        )
        xs = [r["tokens"] for r in sel]
        colour = f"C{k}"
        ax.plot(xs, [r["predicted_us"]["layer_us"] / 1e3 for r in sel], "-x", color=colour)
        ax.plot(
            xs,
            [r["measured_us"]["layer"] / 1e3 for r in sel],
            marker,
            color=colour,
            label=label(ctx),
        )
    ax.set_xscale("log", base=2)
