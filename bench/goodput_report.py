"""The goodput benchmark's results (the JSON :mod:`bench.goodput` writes) as the Markdown
tables of docs/goodput.md (``python -m bench.goodput --report PATH``)."""

from __future__ import annotations

from typing import Any


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def report(doc: dict[str, Any]) -> str:
    """The results as the Markdown tables of docs/goodput.md."""
    lines = [
        "| scenario | mixfleet goodput req/s (tok/s) | vs (a) one instance | vs (b) hand split "
        "| vs (c) hand split P/D | predicted vs simulated at the planned load | USD/Mtok at "
        "(b)'s goodput: mixfleet / (b) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in doc["scenarios"].items():
        m = r["mixfleet"]
        chk = m["prediction_check"]
        eq = r.get("equal_goodput") or {}
        ratio = r["ratios"]
        usd = (
            f"{_fmt(eq.get('mixfleet_usd_per_mtok'), 3)} / {_fmt(eq.get('b_usd_per_mtok'), 3)}"
            if eq
            else "-"
        )
        if eq and eq.get("mixfleet_usd_per_mtok") and eq.get("b_usd_per_mtok"):
            usd += f" ({eq['mixfleet_usd_per_mtok'] / eq['b_usd_per_mtok']:.2f}x)"
        err = chk.get("error")
        lines.append(
            f"| {name} | {_fmt(m['sim']['goodput_rps'])} ({m['sim']['goodput_tokens_per_s']:,.0f}) "
            f"| {_fmt(ratio['a_one_instance'])}x | {_fmt(ratio['b_hand_split'])}x "
            f"| {_fmt(ratio['c_hand_split_pd'])}x "
            f"| {_fmt(chk.get('predicted_rps'))} / {_fmt(chk.get('simulated_goodput_rps'))} "
            f"({'-' if err is None else f'{err * 100:+.1f}%'}) | {usd} |"
        )
    lines.append("")
    lines.append("| scenario | mixfleet pools | (b) hand split | (c) hand split P/D | (a) |")
    lines.append("|---|---|---|---|---|")
    for name, r in doc["scenarios"].items():
        pools = "; ".join(
            " + ".join(
                f"{g['count']}x {g['role']} on {'+'.join(n for inst in g['nodes'][:1] for n in inst)}"
                for g in p["instances"]
            )
            for p in r["mixfleet"]["pools"]
        )
        lines.append(
            f"| {name} | {pools or 'none'} ({r['mixfleet']['gpus']} GPUs, "
            f"{r['mixfleet']['usd_per_hour']:.1f} USD/h) "
            f"| {_fmt(r['b_hand_split']['sim']['goodput_rps'])} req/s "
            f"| {_fmt(r['c_hand_split_pd']['sim']['goodput_rps'])} req/s "
            f"({'; '.join(r['c_hand_split_pd']['notes'])[:80]}) "
            f"| {_fmt(r['a_one_instance']['sim']['goodput_rps'])} req/s |"
        )
    lines += _edges(doc)
    for name, t in doc.get("timing", {}).items():
        lines.append("")
        hog = t.get("beside_two_cpu_hogs", {})
        lines.append(
            f"{name}: {t['gpus']} GPUs, {t['deployments']} deployments; same plan with 1 and "
            f"2 workers: {t['same_plan_1_and_2_workers']}; beside two CPU hogs: "
            f"{hog.get('same_plan')} ({hog.get('cold_s')} s cold)"
        )
        for w in ("workers_2", "workers_1"):
            x = t[w]
            lines.append(
                f"- {w.replace('_', ' ')}: cold {x['cold_s']} s ({x['curves_computed']} curves, "
                f"program {x['program_s']} s, {x['solver']}); after a change {x['warm_after_change_s']} s "
                f"({x['warm_curves_computed']} curves, program {x['warm_program_s']} s)"
            )
    return "\n".join(lines)


def _edges(doc: dict[str, Any]) -> list[str]:
    """Per scenario and plan: the largest rate within the SLO (the edge), the requests/s
    within the SLOs there, and the goodput (the peak at or up to 5% below the edge); the
    ratio to (b) by the edge's figure (the yardstick before the peak was searched)."""
    plans = (("mixfleet", "mixfleet"), ("(b)", "b_hand_split"), ("(c)", "c_hand_split_pd"))
    lines = [
        "",
        "| scenario | "
        + " | ".join(f"{label} edge rate / within SLO there / goodput" for label, _ in plans)
        + " | vs (b) at the edge |",
        "|---|" + "---|" * (len(plans) + 1),
    ]
    for name, r in doc["scenarios"].items():
        cells = []
        for _, key in plans:
            sim = r[key]["sim"]
            cells.append(
                f"{_fmt(sim.get('rate_rps'))} / {_fmt(sim.get('edge_goodput_rps'))} / "
                f"{_fmt(sim.get('goodput_rps'))}"
            )
        m_edge = r["mixfleet"]["sim"].get("edge_goodput_rps")
        b_edge = r["b_hand_split"]["sim"].get("edge_goodput_rps")
        ratio = _fmt(m_edge / b_edge) + "x" if m_edge is not None and b_edge else "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
    return lines
