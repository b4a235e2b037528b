"""Deployment-strategy benchmark (issue 6): tiers, batch sizing, long context, cost, vendors.

Run ``python -m bench.strategies --scenario all --out bench/results/strategies.json
--docs docs/strategies.md`` (``make bench-strategies``). Every figure is the cost model's
prediction through :func:`policies.solve.solve` on the fleets of ``examples/fleets/``
(scenarios in :mod:`bench.strategies_scenarios`); solve times are wall-clock on the machine
that runs it (``cpu_count`` is recorded). Each scenario records the ``mixfleetctl`` command
that reproduces it, its headline figures and a check of the property it demonstrates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import add_arguments, command_line, log, package_versions, run_main
from bench.strategies_scenarios import LOAD, OPTIONS, SCENARIOS
from controlplane.cli.files import plain
from policies.advice.cost import DEFAULT_USD_PER_GPU_HOUR
from policies.errors import InputError

# ------------------------------------------------------------------------------ report


def _machine() -> dict[str, Any]:
    """CPUs, Python, platform and solver package versions of this machine."""
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "packages": package_versions(("pulp", "highspy", "numpy")),
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def _md_tiers(sc: dict[str, Any]) -> list[str]:
    lines = [
        "| rate req/s | preference | interactive nodes | capacity req/s | SLO | TPOT ms | "
        "TTFT ms | batch nodes | batch tokens/s | additions if unmet |",
        "|---:|---|---|---:|---|---:|---:|---|---:|---|",
    ]
    for r in sc["runs"]:
        i, b = r["interactive"], r["batch"]
        adds = "; ".join(
            f"{a['nodes']}x (8x {a['gpu_model']}) {_fmt(a['usd_per_hour'])} USD/h"
            for a in i["additions"]
        )
        lines.append(
            f"| {_fmt(r['rate_requests_per_s'])} | {r['preference']} | "
            f"{', '.join(i['nodes']) or '-'} | {_fmt(i['capacity_requests_per_s'])} | "
            f"{'met' if i['slo_met'] else '**not met**'} | {_fmt(i['tpot_ms'])} | "
            f"{_fmt(i['ttft_ms'])} | {', '.join(b['nodes']) or '-'} | "
            f"{_fmt(b['tokens_per_s'])} | {adds or '-'} |"
        )
    units = sc["runs"][0]["unit_types"]
    lines += [
        "",
        "One interactive replica per unit type (the largest batches meeting the targets):",
        "",
        "| unit | decode tokens/GPU | TPOT ms | prefill tokens/GPU | TTFT ms | req/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for u in units:
        d, p = u["decode"] or {}, u["prefill"] or {}
        lines.append(
            f"| {u['description']} | {_fmt(d.get('tokens_per_gpu'))} | "
            f"{_fmt(d.get('step_time_ms'))} | {_fmt(p.get('tokens_per_gpu'))} | "
            f"{_fmt(p.get('step_time_ms'))} | {_fmt(u['requests_per_s'])} |"
        )
    return lines


def _md_batch(sc: dict[str, Any]) -> list[str]:
    lines = [
        "| policy | start tokens/GPU | largest tokens/GPU | step ms | tokens/s | limit | "
        "points | wall s |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for policy, r in sc["runs"].items():
        best = r["best"] or {}
        lines.append(
            f"| {policy} | {r['start_tokens_per_gpu']} ({r['start_gpu']}) | "
            f"{_fmt(r['largest_tokens_per_gpu'])} | {_fmt(best.get('step_time_ms'))} | "
            f"{_fmt(best.get('tokens_per_s'))} | {r['limit']} | {len(r['points'])} | "
            f"{r['wall_s']} |"
        )
    curve = sc["runs"]["greedy"]["points"]
    lines += [
        "",
        "Greedy curve (tokens/GPU: step ms, tokens/s): "
        + "; ".join(
            f"{p['tokens_per_gpu']}: {_fmt(p['step_time_ms'])}, {_fmt(p['tokens_per_s'])}"
            for p in curve
        ),
        "",
        f"![batch curve]({Path(sc['png']).name})",
    ]
    return lines


def _md_context(sc: dict[str, Any]) -> list[str]:
    doc = sc["runs"]
    lines = [
        "| policy | context | fits | step ms | attention share per GPU (A100 / H100 / H200) | "
        "KV GiB per GPU (A100 / H100 / H200) |",
        "|---|---:|---|---:|---|---|",
    ]
    for rep in doc["policies"]:
        for p in rep["points"]:
            if p["context_len"] % 32_768 and p["context_len"] != rep["longest_context"]:
                continue
            shares = " / ".join(f"{s['attention_share_each']:.4f}" for s in p["by_gpu_model"])
            kv = " / ".join(f"{s['kv_gib_each']:.1f}" for s in p["by_gpu_model"])
            lines.append(
                f"| {rep['policy']} | {p['context_len']:,} | {'yes' if p['fits'] else 'no'} | "
                f"{_fmt(p['step_time_ms'])} | {shares or '-'} | {kv or '-'} |"
            )
    lines += [""]
    for rep in doc["policies"]:
        lines.append(
            f"- {rep['policy']}: longest context {_fmt(rep['longest_context'])} tokens "
            f"(binding GPU {rep['binding_gpu'] or '-'})"
        )
    return lines


def _md_cost(sc: dict[str, Any]) -> list[str]:
    lines = ["| policy | tokens/s | USD/h | USD per million tokens |", "|---|---:|---:|---:|"]
    for r in sc["runs"]["per_policy"]:
        lines.append(
            f"| {r['policy']} | {_fmt(r.get('tokens_per_s'))} | {_fmt(r.get('usd_per_hour'))} | "
            f"{r.get('usd_per_million_tokens', '-')} |"
        )
    lines += [
        "",
        "| target tokens/s | layout asked | chosen subset | layout | tokens/s | USD/h | "
        "USD/Mtok | subsets screened | finalists (final policy) | wall s |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in sc["runs"]["min_cost"]:
        lines.append(
            f"| {_fmt(m['target_tokens_per_s'])} | {m['layout_asked']} | {m['description']} | "
            f"{m['chosen']['layout']} | {_fmt(m['tokens_per_s'])} | {_fmt(m['usd_per_hour'])} | "
            f"{m['usd_per_million_tokens']:.4f} | {len(m['screened'])} | {len(m['finalists'])} | "
            f"{m['wall_s']} |"
        )
    return lines


def _md_vendors(sc: dict[str, Any]) -> list[str]:
    r = sc["runs"]
    lines = [
        "| deployment | GPUs | tokens/s |",
        "|---|---:|---:|",
        *(f"| {p['fleet']} | {p['gpus']} | {_fmt(p['tokens_per_s'])} |" for p in r["per_vendor"]),
        f"| per-vendor total | 32 | {_fmt(r['per_vendor_total_tokens_per_s'])} |",
        f"| one cross-vendor group (only with allow_cross_vendor) | 32 | "
        f"{_fmt(r['cross_vendor_group_tokens_per_s'])} |",
        "",
        f"Refusal: `{r['refused']}`",
    ]
    return lines


_RENDER: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "tiers": _md_tiers,
    "batch-sizing": _md_batch,
    "long-context": _md_context,
    "cost": _md_cost,
    "vendors": _md_vendors,
}


def render_markdown(report: dict[str, Any]) -> str:
    """The docs page of a strategy report."""
    m = report["machine"]
    lines = [
        "# Deployment strategies",
        "",
        "Tiers, batch sizing, long context, cost and mixed vendors (issue 6), predicted by the",
        "cost model through `policies.solve.solve` (docs/planning.md). Regenerate with:",
        "",
        "```",
        report["command"],
        "```",
        "",
        f"Machine: {m['cpu_count']} CPUs, Python {m['python']}, "
        + ", ".join(f"{k} {v}" for k, v in m["packages"].items())
        + f". Run on {report['generated_at'][:10]}. Load `{LOAD}`, ILP time limit "
        f"{OPTIONS.time_limit_s:g} s per solve.",
        "",
        "Assumptions behind the figures:",
        "",
        "- Every throughput and latency is the cost model's prediction, not a measurement.",
        "- Interactive tier (`policies/advice/tier_planner.py`): one replica per NVLink domain (no",
        "  cross-node expert traffic); a replica runs the largest decode batch meeting TPOT and",
        "  the largest prefill batch meeting TTFT; prefill and decode share its time, so it",
        "  serves `max_utilisation / (output/D + prompt/P)` requests/s (D, P its decode and",
        "  prefill tokens/s). The decode context is prompt + output tokens. `fastest` fills the",
        "  tier fastest units first; `max-batch` picks the minimal split that leaves the batch",
        "  tier the most throughput. Volta has no FlashAttention-class kernels: never",
        "  interactive.",
        "- Prices (`policies/advice/cost.py`) are ASSUMED list prices per GPU-hour, not quotes:",
        "  "
        + ", ".join(f"{k} {v:.2f}" for k, v in DEFAULT_USD_PER_GPU_HOUR.items())
        + " USD. Override them with `--prices FILE` (`{currency: USD, prices: {MODEL: X}}`).",
        "- Min-cost subsets: whole nodes, in order of price; a subset is one expert-parallel",
        "  group (`group`) or one model copy per node (`replicas`), whichever is faster",
        "  (`best`); greedy screens, ilp solves the finalists.",
        "- MI300X figures are the catalog's datasheet figures; the amdsmi discovery fixture is",
        "  modelled on AMD's published specs (no AMD host was available).",
        "",
        "A running controller answers the same questions on its live fleet (registered, healthy",
        "nodes matching a node selector) through PlanService `AdviseTiers`, `AdviseBatch`,",
        "`AdviseContext`, `EstimateCost` and `MinCost` (docs/api.md), with the same planners.",
        "",
        "Deployed, the same rules apply. A deployment document carries `allowCrossVendor` and",
        "`gpuHourPrices` (catalog GPU model -> USD per GPU-hour over the assumed prices;",
        "`mixfleetctl plan solve|compare --allow-cross-vendor` locally); the controller reports",
        "the committed plan's `cost_per_million_tokens_usd`. On Kubernetes the operator takes",
        "both from the PlacementPolicy (a ModelDeployment's own fields win) and, when the policy",
        "defines an `interactive` tier, splits the eligible GPUNodes with `plan_tiers`: the split",
        "and the `InteractiveSLO` condition (with the nodes to add when it is not met) are in the",
        "ModelDeployment's status, and its own plan is the batch tier on the nodes left",
        "(docs/kubernetes.md).",
        "",
    ]
    for sc in report["scenarios"]:
        lines += [f"## {sc['scenario']}", "", sc["description"] + ".", "", "```"]
        lines += sc["commands"]
        lines += ["```", ""]
        lines += _RENDER[sc["scenario"]](sc)
        lines += ["", "| check | value | met |", "|---|---|---|"]
        for c in sc["checks"]:
            value = json.dumps(c["value"]) if not isinstance(c["value"], str) else c["value"]
            lines.append(f"| {c['check']} | {value[:160]} | {'yes' if c['met'] else '**no**'} |")
        lines.append("")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the chosen scenarios; write the JSON results and the docs page.

    Raises:
        InputError: unknown scenario.
    """
    name = str(getattr(args, "scenario", "all") or "all")
    if name != "all" and name not in SCENARIOS:
        raise InputError(
            f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)} or all",
            field="scenario",
        )
    chosen = list(SCENARIOS.values()) if name == "all" else [SCENARIOS[name]]

    scenarios = []
    for s in chosen:
        log(f"{s.name}:")
        t0 = time.perf_counter()
        result = s.run(log)
        result["wall_s"] = round(time.perf_counter() - t0, 2)
        scenarios.append(result)
    report: dict[str, Any] = {
        "benchmark": "strategies",
        "command": command_line("bench.strategies", args, with_json=False),
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": _machine(),
        "scenarios": scenarios,
    }
    _write(report, args, name)
    for sc in report["scenarios"]:
        for c in sc["checks"]:
            if not c["met"]:
                log(f"check failed: {sc['scenario']}: {c['check']}: {c['value']}")
    return 0


def _write(report: dict[str, Any], args: argparse.Namespace, name: str) -> None:
    """``--out`` (one scenario merged into an existing report), ``--docs`` and ``--json``."""
    scenarios = list(report["scenarios"])
    if getattr(args, "out", None):
        out = Path(args.out)
        if out.exists() and name != "all":  # merge one scenario into an existing report
            try:
                old = json.loads(out.read_text())
                keep = [x for x in old.get("scenarios", []) if x["scenario"] != name]
                order = list(SCENARIOS)
                report["scenarios"] = sorted(
                    [*keep, *scenarios], key=lambda x: order.index(x["scenario"])
                )
            except (json.JSONDecodeError, KeyError, ValueError):
                pass
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(plain(report), indent=1) + "\n")
        log(f"wrote {out}")
    if getattr(args, "docs", None):
        docs = Path(args.docs)
        docs.parent.mkdir(parents=True, exist_ok=True)
        docs.write_text(render_markdown(report))
        log(f"wrote {docs}")
    if getattr(args, "json", False):
        print(json.dumps(plain(report), indent=1))


def parser() -> argparse.ArgumentParser:
    """Options of ``python -m bench.strategies``."""
    p = argparse.ArgumentParser(
        prog="python -m bench.strategies",
        description="deployment-strategy scenarios",
        allow_abbrev=False,
    )
    add_arguments(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the options of ``python -m bench.strategies``."""
    return parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.strategies``: exit 0, or 2 on a bad scenario name."""
    return run_main(parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
