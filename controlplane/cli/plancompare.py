"""``mixfleetctl plan compare`` and ``plan diff``: plans side by side, and what changed.

* :func:`plans_table` / :func:`compare_table` / :func:`compare_document` - plans side by
  side: step time, throughput, speed-up over ``uniform`` and USD per million tokens (at the
  built-in assumed prices or a ``--prices`` file); used for the policies ``plan compare``
  solves and for saved plans (:func:`compare_saved`);
* ``plan diff A B`` - two saved plans: summary changes, expert replicas added and removed
  per GPU, attention-share changes, GPUs only in one plan.

Offline: only files, no controller.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from controlplane.cli import files
from controlplane.cli.output import (
    Groups,
    add_leaf,
    add_output_arg,
    clip,
    emit,
    emit_document,
    fmt_opt,
    format_table,
    notes,
)
from controlplane.cli.problem import (
    CompareRow,
    check_same_question,
    plan_context,
    plan_problems,
    read_prices,
)
from policies.errors import InputError

if TYPE_CHECKING:
    from controlplane.cli.problem import Problem
    from policies.plan import Plan


def summary_line(plan: Plan) -> str:
    """One line: policy, step time, throughput, feasibility."""
    s = plan.summary
    return (
        f"plan {plan.id} ({s.policy}, {s.form} form, {len(plan.gpus)} GPUs of {plan.fleet}): "
        f"step {s.step_time_us / 1e3:.2f} ms, {s.tokens_per_s:,.0f} tokens/s, "
        f"{plan.num_redundant} redundant slots, feasible {'yes' if s.feasible else 'NO'}"
    )


def usd_per_million_tokens(plan: Plan, prices: Any) -> float | None:
    """The plan's cost per million tokens at ``prices`` (a :class:`policies.advice.cost.PriceTable`),
    or None when a GPU has no price or the plan serves no tokens."""
    import math

    from policies.advice.cost import plan_cost

    try:
        usd = plan_cost(plan, prices).usd_per_million_tokens
    except InputError:  # a custom GPU without a price
        return None
    return usd if math.isfinite(usd) else None


#: One row of a comparison: label, plan (None when there is none) and why there is none.
PlanRow = tuple[str, "Plan | None", str]


def _rows(rows: Sequence[CompareRow]) -> list[PlanRow]:
    return [(r.policy, r.result.plan if r.result else None, r.error) for r in rows]


def _baseline(rows: Sequence[PlanRow]) -> float | None:
    for _label, plan, _ in rows:
        if plan is not None and plan.summary.policy == "uniform":
            return plan.summary.tokens_per_s
    return None


def plans_table(rows: Sequence[PlanRow], prices: Any = None, label: str = "policy") -> str:
    """Side-by-side table of plans: step time, throughput and, with ``prices``, USD per
    million tokens."""
    base = _baseline(rows)
    table = []
    for name, plan, error in rows:
        if plan is None:
            cells = [name, "-", "-", "-", "-", "-", "-", clip("no: " + error, 64)]
            table.append(cells if prices is not None else cells[:4] + cells[5:])
            continue
        s = plan.summary
        usd = usd_per_million_tokens(plan, prices) if prices is not None else None
        cells = [
            name,
            f"{s.step_time_us / 1e3:.2f}",
            f"{s.tokens_per_s:,.0f}",
            f"{s.tokens_per_s / base:.3f}x" if base else "-",
            fmt_opt(usd, ".3f"),
            "-" if s.gap is None else f"{s.gap * 100:.2f}%",
            f"{s.solve_s:.1f}",
            "NO" if plan_problems(plan) else "yes",
        ]
        table.append(cells if prices is not None else cells[:4] + cells[5:])
    headers = [label, "step ms", "tokens/s", "vs uniform", "USD/Mtok", "gap", "solve s"]
    headers.append("feasible")
    if prices is None:
        headers.remove("USD/Mtok")
    return format_table(headers, table)


def compare_table(rows: Sequence[CompareRow], prices: Any = None) -> str:
    """Side-by-side table of a comparison (with USD per million tokens when ``prices``)."""
    return plans_table(_rows(rows), prices)


def plan_row_document(plan: Plan, base: float | None, prices: Any) -> dict[str, Any]:
    """One plan of a comparison document: its summary, id, problems, speed-up, cost."""
    d = asdict(plan.summary)
    d["plan_id"] = plan.id
    d["problems"] = list(plan_problems(plan)[:12])
    d["speedup_vs_uniform"] = d["tokens_per_s"] / base if base else None
    if prices is not None:
        d["usd_per_million_tokens"] = usd_per_million_tokens(plan, prices)
    return d


def compare_document(
    problem: Problem, rows: Sequence[CompareRow], prices: Any = None
) -> dict[str, Any]:
    """JSON/YAML form of a comparison."""
    base = _baseline(_rows(rows))
    wl = problem.workload
    out_rows: list[dict[str, Any]] = []
    for r in rows:
        if r.result is None:
            out_rows.append({"policy": r.policy, "feasible": False, "error": r.error})
            continue
        out_rows.append(plan_row_document(r.result.plan, base, prices))
    return {
        "fleet": problem.fleet.name,
        "model": problem.model.name,
        "workload": {
            "phase": wl.phase,
            "tokens_per_gpu": wl.tokens_per_gpu,
            "context_len": wl.context_len,
            "kv_cache_dtype": wl.kv_cache_dtype,
            "load_source": wl.load_source,
        },
        "form": problem.form,
        "redundant_experts": problem.redundant_experts,
        "policies": out_rows,
    }


def compare_saved(args: argparse.Namespace) -> int:
    """``plan compare A.json B.json``: saved plans side by side, with USD per million
    tokens."""
    prices = read_prices(args.prices)
    plans = [(str(f), files.read_plan(f)) for f in args.plans]
    rows: list[PlanRow] = [(name, plan, "") for name, plan in plans]
    if args.output == "table":
        emit(plans_table(rows, prices, label="plan"))
        return 0
    base = _baseline(rows)
    doc = {
        "plans": [{"file": name, **plan_row_document(plan, base, prices)} for name, plan in plans]
    }
    emit_document(doc, args.output, [f"plan/{plan.id}" for _, plan in plans])
    return 0


# ------------------------------------------------------------------------ plan diff


def _held(plan: Plan) -> dict[str, list[set[int]]]:
    """GPU id -> per MoE layer the experts it holds."""
    return {g.gpu: [{s.expert for s in layer} for layer in g.experts] for g in plan.gpus}


def diff_document(a: Plan, b: Plan) -> dict[str, Any]:
    """What changed from plan ``a`` to plan ``b``: summary figures, per GPU the expert
    replicas added and removed (summed over MoE layers) and the attention share, and the
    GPUs only one plan has. ``expert_moves`` counts replicas ``b`` places on a GPU that did
    not hold that expert in ``a`` (what a rollout from ``a`` to ``b`` copies)."""
    sa, sb = a.summary, b.summary
    held_a, held_b = _held(a), _held(b)
    share_a = {g.gpu: g.attention_share for g in a.gpus}
    gpus: list[dict[str, Any]] = []
    moves = 0
    for g in b.gpus:
        if g.gpu not in held_a:
            continue
        before, after = held_a[g.gpu], held_b[g.gpu]
        added = sum(len(y - x) for x, y in zip(before, after, strict=False))
        removed = sum(len(x - y) for x, y in zip(before, after, strict=False))
        moves += added
        share_before = share_a[g.gpu]
        if added or removed or abs(share_before - g.attention_share) > 1e-9:
            gpus.append(
                {
                    "gpu": g.gpu,
                    "attention_share_before": share_before,
                    "attention_share_after": g.attention_share,
                    "experts_added": added,
                    "experts_removed": removed,
                }
            )
    figures = ("policy", "form", "step_time_us", "tokens_per_s", "imbalance", "feasible")
    return {
        "from": {"id": a.id, "fleet": a.fleet, "model": a.model},
        "to": {"id": b.id, "fleet": b.fleet, "model": b.model},
        "summary": {
            k: {"from": getattr(sa, k), "to": getattr(sb, k)}
            for k in figures
            if getattr(sa, k) != getattr(sb, k)
        },
        "redundant_slots": {"from": a.num_redundant, "to": b.num_redundant},
        "expert_moves": moves,
        "gpus": gpus,
        "gpus_only_in_from": sorted(set(held_a) - set(held_b)),
        "gpus_only_in_to": sorted(set(held_b) - set(held_a)),
    }


def diff_text(d: dict[str, Any]) -> str:
    """The diff for a terminal."""
    lines = [f"plan {d['from']['id']} -> {d['to']['id']}"]
    if d["from"]["model"] != d["to"]["model"]:
        lines.append(f"model: {d['from']['model']} -> {d['to']['model']}")
    for k, v in d["summary"].items():
        if k == "step_time_us":
            lines.append(f"step: {v['from'] / 1e3:.2f} -> {v['to'] / 1e3:.2f} ms")
        elif k == "tokens_per_s":
            lines.append(f"throughput: {v['from']:,.0f} -> {v['to']:,.0f} tokens/s")
        elif isinstance(v["from"], float):
            lines.append(f"{k}: {v['from']:.3f} -> {v['to']:.3f}")
        else:
            lines.append(f"{k}: {v['from']} -> {v['to']}")
    r = d["redundant_slots"]
    if r["from"] != r["to"]:
        lines.append(f"redundant slots: {r['from']} -> {r['to']}")
    lines.append(f"expert moves: {d['expert_moves']} (replicas copied to a GPU)")
    for key, what in (("gpus_only_in_from", "removed"), ("gpus_only_in_to", "added")):
        if d[key]:
            lines.append(f"GPUs {what}: {', '.join(d[key])}")
    rows = [
        [
            g["gpu"],
            f"{g['attention_share_before']:.4f} -> {g['attention_share_after']:.4f}",
            f"+{g['experts_added']}",
            f"-{g['experts_removed']}",
        ]
        for g in d["gpus"]
    ]
    if rows:
        lines.append(format_table(["GPU", "attn share", "experts in", "experts out"], rows))
    elif not d["summary"] and not d["gpus_only_in_from"] and not d["gpus_only_in_to"]:
        lines.append("no differences")
    return "\n".join(lines)


def cmd_plan_diff(args: argparse.Namespace) -> int:
    """``plan diff A B``: what changed between two saved plans (exit 1 when they differ,
    as ``diff`` does)."""
    a, b = files.read_plan(args.a), files.read_plan(args.b)
    check_same_question(plan_context(a), plan_context(b), "plans A and B", "B", notes(args))
    d = diff_document(a, b)
    if args.output == "table":
        emit(diff_text(d))
    else:
        emit_document(d, args.output, [f"plan/{a.id}", f"plan/{b.id}"])
    same = not d["summary"] and not d["gpus"] and a.gpus == b.gpus
    return 0 if same or not args.exit_code else 1


def register(plan: Groups) -> None:
    """Add ``plan diff`` to the ``plan`` group."""
    p = add_leaf(plan, "diff", cmd_plan_diff, "what changed between two saved plans")
    p.add_argument("a", metavar="A", help="the older plan (JSON or YAML)")
    p.add_argument("b", metavar="B", help="the newer plan")
    p.add_argument(
        "--exit-code", action="store_true", help="exit 1 when the plans differ (as git diff)"
    )
    add_output_arg(p)
