"""The fleet planner's part of ``mixfleetctl schedule show|explain``: deployments that state
their traffic and SLOs (``spec.traffic``, ``spec.slo``) are planned by
:func:`policies.fleetplan.plan_fleet` - instances (variant, role, nodes, batch), predicted
TTFT/TPOT, goodput against demand, cost and shortfalls; the others keep the fleet
scheduler's assignment of whole nodes on what the plan leaves free.

Step curves are kept on disk across runs (:class:`apis.curvecache.FileCurveCache`)
under ``--curve-cache DIR``, else ``$MIXFLEET_CURVE_CACHE``, else
``$XDG_CACHE_HOME/mixfleet/curves`` (``~/.cache/mixfleet/curves``).

Imported by :mod:`controlplane.cli.schedule` and :mod:`controlplane.cli.schedule_live`
inside their handlers.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.cli.output import emit, format_table
from policies.errors import InputError

if TYPE_CHECKING:
    from policies.fleetplan import FleetPlan
    from policies.hardware.fleet import Fleet
    from policies.spec.build import DeploymentSpec


def planned(spec: DeploymentSpec) -> bool:
    """Whether the fleet planner plans ``spec`` (it states both traffic and SLOs)."""
    from policies.fleetplan.instances import is_planned

    return is_planned(spec)


def curve_cache_dir(args: argparse.Namespace) -> Path:
    """The curve cache directory of this run."""
    from apis.curvecache import default_dir

    given = getattr(args, "curve_cache", None)
    return Path(given).expanduser() if given else default_dir()


def run_planner(
    args: argparse.Namespace,
    fleet: Fleet,
    specs: Sequence[DeploymentSpec],
    previous: FleetPlan | None = None,
) -> FleetPlan:
    """Plan ``specs`` (each with traffic and SLOs) on ``fleet`` with the on-disk curve cache
    (``--workers N`` processes for the curves not cached)."""
    from apis.curvecache import FileCurveCache
    from policies.fleetplan import FleetDeployment, PlanRequest, plan_fleet

    cache = FileCurveCache(curve_cache_dir(args))
    req = PlanRequest(fleet, tuple(FleetDeployment(s) for s in specs), previous=previous)
    workers = getattr(args, "workers", 1) or 1
    if workers < 1:
        raise InputError(f"--workers {workers}: at least 1", field="--workers")
    if workers == 1:
        return plan_fleet(req, cache=cache)
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers) as pool:
        return plan_fleet(req, cache=cache, pool=pool)


def plan_document(plan: FleetPlan) -> dict[str, Any]:
    """The ``FleetPlan`` document (:func:`policies.fleetplan.report.plan_doc`)."""
    from policies.fleetplan.report import plan_doc
    from policies.fleetplan.types import PlannerSettings

    return plan_doc(plan, PlannerSettings().chunk_tokens)


def _ms(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def print_plan(plan: FleetPlan) -> None:
    """The plan as tables: per deployment its instances, then goodput, cost, shortfalls."""
    rows = []
    for d in sorted(plan.deployments.values(), key=lambda d: (-d.priority, d.deployment)):
        if not d.pools:
            rows.append([d.deployment, str(d.priority), "-", "-", "0", "-", "-", "-", "-", "-"])
        for p in d.pools:
            for g in p.groups():
                rows.append(
                    [
                        d.deployment,
                        str(d.priority),
                        g.variant.make_up,
                        g.variant.role,
                        str(g.count),
                        " ".join(",".join(n) for n in g.nodes),
                        str(g.batch_limit),
                        _ms(p.ttft_ms),
                        _ms(p.tpot_ms),
                        f"{p.requests_per_s:.3g}",
                    ]
                )
    headers = [
        "deployment",
        "priority",
        "variant",
        "role",
        "count",
        "nodes",
        "batch",
        "TTFT ms",
        "TPOT ms",
        "req/s",
    ]
    emit(format_table(headers, rows))
    rows = []
    for d in sorted(plan.deployments.values(), key=lambda d: (-d.priority, d.deployment)):
        usd_mtok = d.usd_per_million_tokens
        rows.append(
            [
                d.deployment,
                f"{d.served_requests_per_s:.3g}/{d.demand_requests_per_s:.3g}",
                f"{d.goodput_output_tokens_per_s:,.0f}",
                f"p{d.slo.percentile:g} {d.slo.ttft_ms:g}/{d.slo.tpot_ms:g}",
                f"{_ms(d.ttft_ms)}/{_ms(d.tpot_ms)}" if d.pools else "-",
                str(d.gpus),
                f"{d.usd_per_hour:,.2f}",
                "-" if not math.isfinite(usd_mtok) else f"{usd_mtok:.3f}",
            ]
        )
    headers = [
        "deployment",
        "goodput/demand req/s",
        "goodput tok/s",
        "SLO TTFT/TPOT ms",
        "predicted",
        "GPUs",
        "USD/h",
        "USD/Mtok",
    ]
    emit(format_table(headers, rows))
    for s in plan.shortfalls.values():
        emit(f"short {s.deployment} ({s.resource}): {s.message}")
    emit(
        f"free: {', '.join(plan.free_nodes) or 'none'}; {plan.usd_per_hour:,.2f} USD/h; "
        f"{plan.solver}; curves {plan.curves_computed} computed, {plan.curves_cached} cached"
    )


def explain_document(plan: FleetPlan, name: str) -> dict[str, Any]:
    """Why ``name`` has its instances: the plan's part and every candidate variant."""
    from policies.fleetplan.report import deployment_doc
    from policies.fleetplan.types import PlannerSettings

    d = plan.deployments[name]
    short = plan.shortfalls.get(name)
    variants = [
        {
            "variant": v.key,
            "role": v.role,
            "makeUp": v.make_up,
            "gpus": v.gpus,
            "batchLimit": v.sizing.batch_limit,
            "requestsPerS": round(v.sizing.requests_per_s, 4),
            "ttftMs": round(v.sizing.ttft_ms, 1),
            "tpotMs": round(v.sizing.tpot_ms, 2),
            "usdPerHour": round(v.usd_per_hour, 3),
            "usdPerRequestPerS": round(v.usd_per_hour / v.sizing.requests_per_s, 4)
            if v.sizing.requests_per_s > 0
            else None,
        }
        for v in plan.variants.get(name, ())
    ]
    return {
        "kind": "FleetPlanExplanation",
        "deployment": name,
        "plan": deployment_doc(d, PlannerSettings().chunk_tokens),
        "shortfall": None
        if short is None
        else {"resource": short.resource, "fix": short.fix, "message": short.message},
        "variants": variants,
    }


def print_explanation(doc: dict[str, Any]) -> None:
    """``explain`` of a planned deployment as text."""
    p = doc["plan"]
    emit(
        f"{doc['deployment']}: goodput {p['served']['requestsPerS']:.3g} of "
        f"{p['demand']['requestsPerS']:.3g} requests/s within TTFT {p['slo']['ttftMs']} ms / "
        f"TPOT {p['slo']['tpotMs']} ms at p{p['slo']['percentile']}; {p['usdPerHour']:.2f} USD/h"
    )
    for pool in p["pools"]:
        parts = [
            f"{g['count']}x {g['role']} on {g['makeUp']} (batch {g['batchLimit']})"
            for g in pool["instances"]
        ]
        via = f" over {pool['kvPath']['path']}" if "kvPath" in pool else ""
        emit(
            f"  pool {pool['name']}: {' + '.join(parts)}{via}: {pool['requestsPerS']:.3g} "
            f"requests/s, TTFT {_ms(pool['predicted']['ttftMs'])} ms, TPOT "
            f"{_ms(pool['predicted']['tpotMs'])} ms"
        )
    if doc["shortfall"]:
        emit(f"short ({doc['shortfall']['resource']}): {doc['shortfall']['message']}")
    rows = [
        [
            v["variant"],
            v["role"],
            str(v["gpus"]),
            str(v["batchLimit"]),
            f"{v['requestsPerS']:.3g}",
            _ms(v["ttftMs"]),
            _ms(v["tpotMs"]),
            f"{v['usdPerHour']:.2f}",
            "-" if v["usdPerRequestPerS"] is None else f"{v['usdPerRequestPerS']:.3f}",
        ]
        for v in sorted(doc["variants"], key=lambda v: v["usdPerRequestPerS"] or math.inf)
    ]
    emit(
        "candidate variants (cheapest per request/s first; a prefill variant's figures are for its pair):"
    )
    emit(
        format_table(
            [
                "variant",
                "role",
                "GPUs",
                "batch",
                "req/s",
                "TTFT ms",
                "TPOT ms",
                "USD/h",
                "USD per req/s",
            ],
            rows,
        )
    )
