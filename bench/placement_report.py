"""The placement benchmark's verdicts and its docs page (docs/benchmarks.md).

:func:`check_targets` holds the targets of issue 2 as data (:data:`TARGETS`) and measures
them on a scenario's result rows; :func:`render_markdown` turns a report (the JSON that
:mod:`bench.placement` writes) into the Markdown page. Both are pure functions of their
arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Rows = Sequence[dict[str, Any]]
Measure = Callable[[Rows], float | None]


def _get(rows: Sequence[dict[str, Any]], policy: str, form: str) -> dict[str, Any] | None:
    for r in rows:
        if (
            r["policy"] == policy
            and r["form"] == form
            and r.get("feasible")
            and "tokens_per_s" in r
        ):
            return r
    return None


def _field(row: dict[str, Any] | None, key: str) -> float | None:
    """A numeric field of a result row, None when the row or the value is missing."""
    if row is None or row.get(key) is None:
        return None
    return float(row[key])


def _ratio(rows: Sequence[dict[str, Any]], a: str, b: str, form: str) -> float | None:
    ra, rb = _get(rows, a, form), _get(rows, b, form)
    if ra is None or rb is None:
        return None
    return float(ra["tokens_per_s"]) / float(rb["tokens_per_s"])


def _ratio_of(a: str, b: str, form: str) -> Measure:
    """Measure: tokens/s of policy ``a`` over policy ``b`` in ``form``."""
    return lambda rows: _ratio(rows, a, b, form)


def _ilp_field(form: str, key: str) -> Measure:
    """Measure: field ``key`` of the ``ilp`` row in ``form``."""
    return lambda rows: _field(_get(rows, "ilp", form), key)


def _at_least(limit: float) -> Callable[[float], bool]:
    return lambda v: v >= limit


def _at_most(limit: float) -> Callable[[float], bool]:
    return lambda v: v <= limit


#: Issue-2 targets per scenario: (what, how it is measured, goal as written, met test).
TARGETS: dict[str, tuple[tuple[str, Measure, str, Callable[[float], bool]], ...]] = {
    "mixed-24-decode": (
        (
            "ilp / uniform tokens/s (engine)",
            _ratio_of("ilp", "uniform", "engine"),
            ">= 1.30",
            _at_least(1.30),
        ),
        (
            "ilp / eplb tokens/s (engine)",
            _ratio_of("ilp", "eplb", "engine"),
            ">= 1.15",
            _at_least(1.15),
        ),
        (
            "ilp / greedy tokens/s (engine)",
            _ratio_of("ilp", "greedy", "engine"),
            ">= 1.00",
            _at_least(1.0),
        ),
        # The gap is to the valid global bound (policies/solvers/ilp_bound.py); the earlier
        # 2% / 5% targets were met against a "bound" that was not one (it exceeded achieved
        # step times). The engine-faithful issue asks for <= 3% to a valid bound.
        ("gap to valid bound (native)", _ilp_field("native", "gap"), "<= 3%", _at_most(0.03)),
        ("gap to valid bound (engine)", _ilp_field("engine", "gap"), "<= 3%", _at_most(0.03)),
        (
            "solve time, all 58 MoE layers (engine)",
            _ilp_field("engine", "wall_s"),
            "<= 30 s",
            _at_most(30),
        ),
        (
            "solve time, all 58 MoE layers (native)",
            _ilp_field("native", "wall_s"),
            "<= 30 s",
            _at_most(30),
        ),
    ),
    "homog-32-decode": (
        (
            "ilp / eplb tokens/s (engine)",
            _ratio_of("ilp", "eplb", "engine"),
            ">= 1.00",
            _at_least(1.0),
        ),
    ),
    "large-256-decode": (
        ("solve time (engine)", _ilp_field("engine", "wall_s"), "<= 120 s", _at_most(120)),
    ),
    "layer-256x64-decode": (
        ("solve time, one layer (engine)", _ilp_field("engine", "wall_s"), "<= 1 s", _at_most(1.0)),
    ),
}


def check_targets(name: str, rows: Rows) -> list[dict[str, Any]]:
    """Issue-2 targets for a scenario: each with the measured value and pass/fail."""
    out: list[dict[str, Any]] = []
    for what, measure, goal, ok in TARGETS.get(name, ()):
        value = measure(rows)
        out.append(
            {
                "target": what,
                "goal": goal,
                "value": None if value is None else round(value, 4),
                "met": value is not None and ok(value),
            }
        )
    return out


def _md_groupings(sc: dict[str, Any]) -> list[str]:
    """The section of a grouping scenario: one row per policy and grouping."""
    inp = sc["inputs"]
    lines: list[str] = []
    lines += [
        f"## {sc['scenario']}",
        "",
        f"{sc['description']}. {inp['gpus']} GPUs, {inp['model']}, {inp['phase']}, {inp['tokens_per_gpu']} tokens/GPU, context {inp['context_len']}.",
        "",
        "| policy | grouping | tokens/s | groups (tokens/s, busiest link us per layer) |",
        "|---|---|---:|---|",
    ]
    for r in sc["groupings"]:
        parts = "; ".join(
            f"{'+'.join(g['nodes'])}: {g['tokens_per_s']:,.0f}, link {g['max_link_us']}"
            + (f" ({g['error']})" if g["error"] else "")
            for g in r["groups"]
        )
        lines.append(f"| {r['policy']} | {r['grouping']} | {r['tokens_per_s']:,.0f} | {parts} |")
    lines.append("")
    return lines


def _md_results(sc: dict[str, Any]) -> list[str]:
    """The section of a placement scenario: one row per form and policy, then its targets."""
    inp = sc["inputs"]
    lines: list[str] = []
    lines += [
        f"## {sc['scenario']}",
        "",
        f"{sc['description']}. {inp['gpus']} GPUs, {inp['model']} ({inp['moe_layers']} MoE layers), "
        f"{inp['phase']}, {inp['tokens_per_gpu']} tokens/GPU, context {inp['context_len']}, "
        f"KV {inp['kv_cache_dtype']}, load `{inp['load']}`, {inp['redundant_experts']} redundant "
        "experts.",
        "",
        "| form | policy | tokens/s | vs uniform | step ms | bound ms | gap | solve s | feasible |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sc["results"]:
        if "tokens_per_s" not in r:
            lines.append(
                f"| {r['form']} | {r['policy']} | - | - | - | - | - | - | no: {r.get('error', '')[:80]} |"
            )
            continue
        base = _get(sc["results"], "uniform", r["form"])
        vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        bound = f"{r['lower_bound_us'] / 1e3:.2f}" if r["lower_bound_us"] is not None else "-"
        gap = f"{r['gap'] * 100:.2f}%" if r["gap"] is not None else "-"
        feas = "yes" if r["feasible"] else "no: " + "; ".join(r["violations"][:1])[:80]
        lines.append(
            f"| {r['form']} | {r['policy']} | {r['tokens_per_s']:,.0f} | {vs} | "
            f"{r['step_time_us'] / 1e3:.2f} | {bound} | {gap} | {r['solve_s']:.2f} | {feas} |"
        )
    if sc["targets"]:
        lines += ["", "| target | goal | measured | met |", "|---|---|---:|---|"]
        for t in sc["targets"]:
            lines.append(
                f"| {t['target']} | {t['goal']} | {t['value']} | {'yes' if t['met'] else '**no**'} |"
            )
    lines.append("")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """The docs page for a benchmark report."""
    lines = [
        "# Placement benchmark",
        "",
        "Predicted by the cost model (docs/planning.md); every policy gets the same fleet, model,",
        "workload, slot budget and cost model. Regenerate with:",
        "",
        "```",
        report["command"],
        "```",
        "",
        f"Machine: {report['machine']['cpu_count']} CPUs, Python {report['machine']['python']}, "
        + ", ".join(f"{k} {v}" for k, v in report["machine"]["packages"].items())
        + f". Run on {report['generated_at'][:10]}.",
        "",
    ]
    for sc in report["scenarios"]:
        lines += _md_groupings(sc) if "groupings" in sc else _md_results(sc)
    lines += [
        "## Reading these results",
        "",
        "- The gains come from three places: attention shares that follow each GPU's speed and",
        "  memory, fewer and lighter experts on slow GPUs, and replicas of hot experts where",
        "  they cut the busiest GPU's dispatch/combine traffic. `greedy` already gets most of",
        "  the first; the ILP's margin over `greedy` is a few percent, over `eplb` (which assumes",
        "  identical GPUs) 20-30% on mixed fleets.",
        "- On identical GPUs (homog-32) there is little to gain: the ILP matches EPLB within a",
        "  few percent, never below it.",
        "- Where uniform and EPLB show INFEASIBLE, their equal attention split puts more KV cache",
        "  on the smallest GPU (L40S) than it holds; their step time is reported but the plan",
        "  cannot run.",
        "- large-256: the engine-form MILP does not close its gap within the time limit; the",
        "  plan is still the best of the four, but the gap column says how far the proof is.",
        "- The one-layer solve-time scenario runs with `--time-limit 0.9` (the whole solve,",
        "  model building included, fits in the 1 s target); its gap says what that costs.",
        "- All figures are cost-model predictions; docs/validation.md measures the model",
        "  against real H200s (within 15%).",
        "",
    ]
    return "\n".join(lines)
