"""Tables and documents for the deployment-strategy reports (tiers, batch sizing, long
context, cost), shared by ``mixfleetctl`` (:mod:`controlplane.cli.advise`, :mod:`controlplane.cli.plan`) and the
strategy benchmark (:mod:`bench.strategies`).

Every ``*_document`` returns plain JSON-ready data (tuples become lists when dumped by
:func:`controlplane.cli.files.dump_document`); every ``*_table`` returns text for a terminal.
Units in keys: ``_ms``, ``_us``, ``_gib``, ``tokens_per_s``, ``usd_per_hour``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from controlplane.cli.output import clip, format_table
from controlplane.cli.problem import CompareRow, plan_problems
from policies.advice.advise import BatchAdvice, BatchPoint, ContextAdvice
from policies.advice.cost import MinCostResult, PlanCost, PriceTable, plan_cost
from policies.advice.tiers import TierPlan

# ------------------------------------------------------------------------ batch sizing


def _ms(us: float | None, fmt: str = ".2f") -> str:
    return "-" if us is None else format(us / 1e3, fmt)


def _point_state(p: BatchPoint, best: BatchPoint | None) -> str:
    if best is not None and p.tokens_per_gpu == best.tokens_per_gpu:
        return "LARGEST"
    if p.ok:
        return "ok"
    return "memory" if not p.fits_memory else "target"


def batch_table(advice: BatchAdvice) -> str:
    """The throughput curve, one row per batch solved, and a verdict line."""
    rows = [
        [
            str(p.tokens_per_gpu),
            f"{p.max_gpu_tokens:,.0f}",
            _ms(p.step_time_us),
            f"{p.tokens_per_s:,.0f}",
            _point_state(p, advice.best),
        ]
        for p in advice.points
    ]
    name = advice.target_name
    head = format_table(
        ["tokens/GPU", "max on a GPU", f"step ms ({name})", "tokens/s", "state"], rows
    )
    target = f"{name} <= {advice.target_ms:g} ms" if advice.target_ms is not None else "no target"
    lines = [
        f"batch sizing ({advice.phase}, {advice.policy}, {target}): start at "
        f"{advice.start_tokens_per_gpu} tokens/GPU (what {advice.start_gpu} fits at an "
        "equal split)",
        head,
    ]
    if advice.best is not None:
        lines.append(
            f"largest: {advice.largest_tokens_per_gpu} tokens/GPU, "
            f"{_ms(advice.best.step_time_us)} ms per step, {advice.best.tokens_per_s:,.0f} "
            f"tokens/s (next larger batch: {advice.limit})"
        )
    for r in advice.infeasible:
        lines.append(f"INFEASIBLE: {r}")
    return "\n".join(lines)


def _point_doc(p: BatchPoint) -> dict[str, Any]:
    return {
        "tokens_per_gpu": p.tokens_per_gpu,
        "max_gpu_tokens": round(p.max_gpu_tokens, 2),
        "step_time_ms": None if p.step_time_us is None else round(p.step_time_us / 1e3, 4),
        "tokens_per_s": round(p.tokens_per_s, 1),
        "fits_memory": p.fits_memory,
        "meets_target": p.meets_target,
        "reason": p.reason,
        "plan_id": p.plan_id,
    }


def batch_document(advice: BatchAdvice) -> dict[str, Any]:
    """JSON form of a batch-sizing answer."""
    return {
        "phase": advice.phase,
        "policy": advice.policy,
        "target": advice.target_name,
        "target_ms": advice.target_ms,
        "start_tokens_per_gpu": advice.start_tokens_per_gpu,
        "start_gpu": advice.start_gpu,
        "largest_tokens_per_gpu": advice.largest_tokens_per_gpu,
        "limit": advice.limit,
        "best": None if advice.best is None else _point_doc(advice.best),
        "points": [_point_doc(p) for p in advice.points],
        "infeasible": list(advice.infeasible),
    }


# ------------------------------------------------------------------------ long context


def context_table(advice: ContextAdvice) -> str:
    """Per policy and context: fits, step time, attention share and KV per GPU model."""
    rows = []
    for rep in advice.policies:
        for p in rep.points:
            shares = ", ".join(
                f"{s.gpu_model} {s.attention_share_each:.4f} ({s.kv_gib_each:.1f}/"
                f"{s.free_gib_each:.1f} GiB)"
                for s in p.shares
            )
            rows.append(
                [
                    rep.policy,
                    f"{p.context_len:,}",
                    "yes" if p.ok else "NO",
                    _ms(p.step_time_us),
                    "-" if p.max_context_at_shares is None else f"{p.max_context_at_shares:,}",
                    shares or clip(p.reason, 70),
                ]
            )
    lines = [
        f"long context at {advice.tokens_per_gpu} tokens/GPU (share per GPU, KV used/free per GPU)",
        format_table(
            ["policy", "context", "fits", "step ms", "holds at shares", "per GPU model"], rows
        ),
    ]
    for rep in advice.policies:
        longest = "-" if rep.longest_context is None else f"{rep.longest_context:,}"
        lines.append(
            f"{rep.policy}: longest context {longest} tokens (binding: {rep.binding_gpu or '-'})"
        )
    return "\n".join(lines)


def context_document(advice: ContextAdvice) -> dict[str, Any]:
    """JSON form of a long-context report."""
    return {
        "tokens_per_gpu": advice.tokens_per_gpu,
        "contexts": list(advice.contexts),
        "policies": [
            {
                "policy": rep.policy,
                "longest_context": rep.longest_context,
                "binding_gpu": rep.binding_gpu,
                "points": [
                    {
                        "context_len": p.context_len,
                        "fits": p.ok,
                        "reason": p.reason,
                        "step_time_ms": None
                        if p.step_time_us is None
                        else round(p.step_time_us / 1e3, 4),
                        "tokens_per_s": round(p.tokens_per_s, 1),
                        "max_context_at_shares": p.max_context_at_shares,
                        "binding_gpu": p.binding_gpu,
                        "by_gpu_model": [
                            {
                                "gpu_model": s.gpu_model,
                                "gpus": s.gpus,
                                "attention_share_each": round(s.attention_share_each, 6),
                                "kv_gib_each": round(s.kv_gib_each, 3),
                                "free_gib_each": round(s.free_gib_each, 3),
                                "max_context": s.max_context,
                            }
                            for s in p.shares
                        ],
                    }
                    for p in rep.points
                ],
            }
            for rep in advice.policies
        ],
    }


# ------------------------------------------------------------------------------- tiers


def tiers_table(tp: TierPlan) -> str:
    """Unit types, the interactive replicas, the batch tier and what would meet the SLO."""
    i, b = tp.interactive, tp.batch
    units = [
        [
            u.description,
            "-" if u.decode is None else str(u.decode.tokens_per_gpu),
            "-" if u.decode is None else _ms(u.decode.step_time_us),
            "-" if u.prefill is None else str(u.prefill.tokens_per_gpu),
            "-" if u.prefill is None else _ms(u.prefill.step_time_us),
            f"{u.requests_per_s:,.2f}",
            u.reason or "",
        ]
        for u in tp.unit_types
    ]
    lines = [
        "interactive replica per unit type (one NVLink domain each; fastest first):",
        format_table(
            ["unit", "decode tok/GPU", "TPOT ms", "prefill tok/GPU", "TTFT ms", "req/s", "note"],
            units,
        ),
        "",
        f"interactive ({tp.preference}): {len(i.replicas)} replica(s) on "
        f"{', '.join(i.nodes) or 'no nodes'}, "
        f"{sum(r.result.plan.summary.tokens_per_s for r in i.replicas):,.0f} decode tokens/s "
        f"at full batch; capacity {i.capacity_requests_per_s:,.2f} "
        f"req/s for {i.demand_requests_per_s:,.2f} asked, utilisation "
        f"{'-' if math.isinf(i.utilisation) else f'{i.utilisation:.2f}'}; TPOT "
        f"{'-' if i.tpot_ms is None else f'{i.tpot_ms:.2f}'} ms, TTFT "
        f"{'-' if i.ttft_ms is None else f'{i.ttft_ms:.2f}'} ms; SLO "
        f"{'met' if i.slo_met else 'NOT MET'}",
        f"batch: {', '.join(b.nodes) or 'no nodes'}: {b.tokens_per_s:,.0f} tokens/s, step "
        f"{'-' if b.step_time_ms is None else f'{b.step_time_ms:.2f}'} ms, "
        f"{len(b.results)} plan(s)"
        + ("" if b.meets_target is None else f", target {'met' if b.meets_target else 'NOT met'}")
        + (f" ({b.reason})" if b.reason else ""),
    ]
    if i.additions:
        lines.append("to meet the SLO, add one of:")
        for a in i.additions:
            price = "" if a.usd_per_hour is None else f", {a.usd_per_hour:,.2f} USD/h"
            lines.append(
                f"  {a.nodes} node(s) of {a.gpus_per_node}x {a.gpu_model} ({a.gpus} GPUs, "
                f"{a.requests_per_s_per_node:,.2f} req/s each{price})"
            )
    lines += [f"note: {r}" for r in i.reasons]
    lines += [f"note: {n}" for n in tp.notes]
    return "\n".join(lines)


def tiers_document(tp: TierPlan) -> dict[str, Any]:
    """JSON form of a tier split (plans by id and headline figures)."""
    i, b = tp.interactive, tp.batch
    return {
        "preference": tp.preference,
        "assignments_screened": tp.assignments_screened,
        "unit_types": [
            {
                "nodes": list(u.nodes),
                "description": u.description,
                "gpus": u.gpus,
                "decode": None if u.decode is None else _point_doc(u.decode),
                "prefill": None if u.prefill is None else _point_doc(u.prefill),
                "requests_per_s": round(u.requests_per_s, 3),
                "reason": u.reason,
            }
            for u in tp.unit_types
        ],
        "interactive": {
            "nodes": list(i.nodes),
            "slo_met": i.slo_met,
            "capacity_requests_per_s": round(i.capacity_requests_per_s, 3),
            "demand_requests_per_s": i.demand_requests_per_s,
            "utilisation": None if math.isinf(i.utilisation) else round(i.utilisation, 4),
            "tpot_ms": i.tpot_ms,
            "ttft_ms": i.ttft_ms,
            "replicas": [
                {
                    "nodes": list(r.nodes),
                    "gpu_model": r.gpu_model,
                    "plan_id": r.result.plan.id,
                    "policy": r.result.plan.summary.policy,
                    "tpot_ms": round(r.tpot_ms, 4),
                    "ttft_ms": round(r.ttft_ms, 4),
                    "decode_tokens_per_gpu": r.decode_tokens_per_gpu,
                    "prefill_tokens_per_gpu": r.prefill_tokens_per_gpu,
                    "requests_per_s": round(r.requests_per_s, 3),
                    "decode_tokens_per_s": round(r.result.plan.summary.tokens_per_s, 1),
                }
                for r in i.replicas
            ],
            "additions": [
                {
                    "gpu_model": a.gpu_model,
                    "nodes": a.nodes,
                    "gpus": a.gpus,
                    "requests_per_s_per_node": round(a.requests_per_s_per_node, 3),
                    "usd_per_hour": a.usd_per_hour,
                }
                for a in i.additions
            ],
            "reasons": list(i.reasons),
        },
        "batch": {
            "nodes": list(b.nodes),
            "tokens_per_s": round(b.tokens_per_s, 1),
            "step_time_ms": None if b.step_time_ms is None else round(b.step_time_ms, 4),
            "meets_target": b.meets_target,
            "plans": [
                {
                    "plan_id": r.plan.id,
                    "policy": r.plan.summary.policy,
                    "gpus": len(r.plan.gpus),
                    "tokens_per_s": round(r.plan.summary.tokens_per_s, 1),
                }
                for r in b.results
            ],
            "reason": b.reason,
        },
        "notes": list(tp.notes),
    }


# -------------------------------------------------------------------------------- cost


def _usd(x: float) -> str:
    return "-" if math.isinf(x) or math.isnan(x) else f"{x:,.3f}"


def cost_rows(rows: Sequence[CompareRow], prices: PriceTable) -> list[tuple[str, PlanCost | None]]:
    """Each compared policy with its plan's cost (None when it has no usable plan)."""
    out: list[tuple[str, PlanCost | None]] = []
    for r in rows:
        if r.result is None:
            out.append((r.policy, None))
        else:
            out.append((r.policy, plan_cost(r.result.plan, prices)))
    return out


def cost_table(rows: Sequence[CompareRow], prices: PriceTable) -> str:
    """``plan compare`` with cost per hour and per million tokens beside throughput."""
    base = next(
        (
            r.result.plan.summary.tokens_per_s
            for r in rows
            if r.policy == "uniform" and r.result is not None
        ),
        None,
    )
    table = []
    for (policy, cost), r in zip(cost_rows(rows, prices), rows, strict=True):
        if r.result is None or cost is None:
            table.append([policy, "-", "-", "-", "-", "-", clip("no: " + r.error, 54)])
            continue
        s = r.result.plan.summary
        table.append(
            [
                policy,
                f"{s.step_time_us / 1e3:.2f}",
                f"{s.tokens_per_s:,.0f}",
                f"{s.tokens_per_s / base:.3f}x" if base else "-",
                _usd(cost.usd_per_hour),
                _usd(cost.usd_per_million_tokens),
                "NO" if plan_problems(r.result.plan) else "yes",
            ]
        )
    cur = prices.currency
    return "\n".join(
        [
            format_table(
                [
                    "policy",
                    "step ms",
                    "tokens/s",
                    "vs uniform",
                    f"{cur}/h",
                    f"{cur}/Mtok",
                    "feasible",
                ],
                table,
            ),
            f"prices: {prices.source}",
        ]
    )


def cost_document(rows: Sequence[CompareRow], prices: PriceTable) -> dict[str, Any]:
    """JSON form of a cost comparison."""
    out = []
    for policy, cost in cost_rows(rows, prices):
        if cost is None:
            out.append({"policy": policy, "feasible": False})
            continue
        out.append(
            {
                "policy": policy,
                "tokens_per_s": round(cost.tokens_per_s, 1),
                "usd_per_hour": round(cost.usd_per_hour, 4),
                "usd_per_million_tokens": cost.usd_per_million_tokens,
                "gpus_by_model": dict(cost.gpus_by_model),
            }
        )
    return {"currency": prices.currency, "prices_source": prices.source, "policies": out}


def min_cost_table(res: MinCostResult) -> str:
    """The chosen subset, then every subset screened in order of price."""
    cur = res.cost.currency
    rows = []
    final = {c.counts: c for c in res.finalists}
    for c in res.screened:
        f = final.get(c.counts)
        rows.append(
            [
                ", ".join(c.nodes),
                str(c.gpus),
                _usd(c.usd_per_hour),
                c.layout,
                f"{c.screened_tokens_per_s:,.0f}",
                "-"
                if f is None or f.final_tokens_per_s is None
                else f"{f.final_tokens_per_s:,.0f}",
                "CHOSEN" if c.counts == res.best.counts else clip(c.reason, 40),
            ]
        )
    lines = [
        f"cheapest subset for {res.target_tokens_per_s:,.0f} tokens/s: {res.description} "
        f"({res.best.layout} layout, {len(res.results)} plan(s)): {res.cost.tokens_per_s:,.0f} "
        f"tokens/s, {_usd(res.cost.usd_per_hour)} {cur}/h, "
        f"{_usd(res.cost.usd_per_million_tokens)} {cur}/Mtok",
        format_table(
            ["nodes", "GPUs", f"{cur}/h", "layout", "screened tok/s", "final tok/s", ""], rows
        ),
    ]
    lines += [f"note: {n}" for n in res.notes]
    return "\n".join(lines)


def min_cost_document(res: MinCostResult) -> dict[str, Any]:
    """JSON form of a minimum-cost answer."""

    def cand(c: Any) -> dict[str, Any]:
        return {
            "nodes": list(c.nodes),
            "gpus": c.gpus,
            "usd_per_hour": round(c.usd_per_hour, 4),
            "layout": c.layout,
            "screened_tokens_per_s": round(c.screened_tokens_per_s, 1),
            "final_tokens_per_s": None
            if c.final_tokens_per_s is None
            else round(c.final_tokens_per_s, 1),
            "reason": c.reason,
        }

    return {
        "target_tokens_per_s": res.target_tokens_per_s,
        "chosen": cand(res.best),
        "description": res.description,
        "plans": [
            {"plan_id": r.plan.id, "policy": r.plan.summary.policy, "gpus": len(r.plan.gpus)}
            for r in res.results
        ],
        "tokens_per_s": round(res.cost.tokens_per_s, 1),
        "usd_per_hour": round(res.cost.usd_per_hour, 4),
        "usd_per_million_tokens": res.cost.usd_per_million_tokens,
        "currency": res.cost.currency,
        "screened": [cand(c) for c in res.screened],
        "finalists": [cand(c) for c in res.finalists],
        "notes": list(res.notes),
    }
