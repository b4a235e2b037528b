"""``mixfleetctl schedule show|explain``: which nodes of a fleet serve which deployment.

Without ``--fleet`` both read the running controller's assignment (connection options as
for ``deploy``; :mod:`controlplane.cli.schedule_live`). With ``--fleet FILE -f DEPLOYMENTS``
they read a Fleet file and the deployments' ModelDeployment documents and run the fleet
scheduler (:mod:`policies.scheduling`) offline, the same one the controller runs:

* ``schedule show``: every deployment's nodes, GPUs, predicted tokens/s and cost per
  million tokens; the free nodes; each pending deployment and why (resource, nodes, how
  much is missing).
* ``schedule explain DEPLOYMENT``: why these nodes, its other candidate instances, and what
  the next-best assignment would give it and the fleet.

``-o json|yaml`` writes the same as a document.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from apis.cliargs import positive_int
from controlplane.cli import files
from controlplane.cli.connection import add_connection_args
from controlplane.cli.output import Groups, add_group, add_leaf, add_output_arg, emit, emit_document
from policies.errors import InputError

if TYPE_CHECKING:
    from policies.fleetplan import FleetPlan
    from policies.hardware.fleet import Fleet
    from policies.scheduling.types import Schedule, ScheduleRequest
    from policies.spec.build import DeploymentSpec


def _usd(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v:.3f}"


def _quotas(items: list[str] | None) -> dict[str, int]:
    from policies.scheduling.fields import parse_quotas

    return parse_quotas(items or [], "--quota")


def _read_specs(args: argparse.Namespace) -> tuple[Fleet, list[DeploymentSpec]]:
    """The Fleet file and the deployments of ``-f``."""
    if not args.file:
        raise InputError(
            "--fleet needs the deployments. To fix: pass -f DEPLOYMENTS.yaml", field="-f"
        )
    from controlplane.cli.deploy import _read_docs
    from policies.spec.build import parse_deployment

    fleet = files.read_fleet(args.fleet)
    specs = [parse_deployment(doc) for path in args.file for doc in _read_docs(path)]
    if not specs:
        raise InputError("no deployment given. To fix: pass -f DEPLOYMENTS.yaml", field="-f")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise InputError(f"deployment names repeat: {sorted(names)}", field="-f")
    return fleet, specs


def _plan_and_schedule(
    args: argparse.Namespace,
) -> tuple[FleetPlan | None, tuple[ScheduleRequest, Schedule] | None]:
    """Deployments with traffic and SLOs through the fleet planner; the others through the
    fleet scheduler on the nodes the plan leaves free (either part None when empty):
    :func:`policies.fleetplan.combined.plan_and_schedule`, as the controller decides."""
    from apis.curvecache import FileCurveCache
    from controlplane.cli.schedule_plan import curve_cache_dir
    from policies.fleetplan.combined import PlanOptions, ScheduleOptions, plan_and_schedule
    from policies.scheduling.table import TableSettings
    from policies.spec.build import selects

    fleet, specs = _read_specs(args)
    pairs = [(s, [n.name for n in fleet.nodes if selects(s, n.labels)]) for s in specs]
    planning = PlanOptions(cache=FileCurveCache(curve_cache_dir(args)))
    scheduling = ScheduleOptions(
        quotas_gpus=_quotas(args.quota),
        settings=TableSettings(
            estimate_policy=args.estimate_policy, max_instances=args.replica_groups
        ),
    )
    if args.workers == 1:  # --workers is at least 1 (positive_int)
        d = plan_and_schedule(fleet, pairs, planning=planning, scheduling=scheduling)
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.workers) as pool:
            d = plan_and_schedule(fleet, pairs, planning=planning, scheduling=scheduling, pool=pool)
    if d.request is None or d.schedule is None:
        return d.plan, None
    return d.plan, (d.request, d.schedule)


def schedule_document(req: ScheduleRequest, s: Schedule) -> dict[str, Any]:
    """The schedule as a plain document (``-o json|yaml``)."""
    by_name = {d.name: d for d in req.demands}
    return {
        "kind": "FleetSchedule",
        "solver": s.solver,
        "solveS": round(s.solve_s, 4),
        "tokensPerS": round(s.tokens_per_s, 1),
        "usdPerHour": round(s.usd_per_hour, 3),
        "placements": [
            {
                "deployment": p.deployment,
                "priority": by_name[p.deployment].priority,
                "objective": by_name[p.deployment].objective,
                "nodes": list(p.nodes),
                "instances": [list(i) for i in p.instances],
                "gpus": p.gpus,
                "tokensPerS": round(p.tokens_per_s, 1),
                "usdPerMillionTokens": None
                if not math.isfinite(p.usd_per_million_tokens)
                else round(p.usd_per_million_tokens, 4),
            }
            for p in s.placements.values()
        ],
        "pending": [
            {
                "deployment": p.deployment,
                "resource": p.resource,
                "nodes": list(p.nodes),
                "missing": p.missing,
                "unit": p.unit,
                "reason": p.message,
            }
            for p in s.pending.values()
        ],
        "freeNodes": list(s.free_nodes),
        "decisions": [
            {"deployment": d.deployment, "kind": d.kind, "reason": d.reason} for d in s.decisions
        ],
    }


def cmd_schedule_show(args: argparse.Namespace) -> int:
    """``schedule show``: the fleet's assignment."""
    from controlplane.cli.output import format_table

    if args.fleet is None:
        from controlplane.cli.schedule_live import cmd_live_show

        return cmd_live_show(args)
    plan, both = _plan_and_schedule(args)
    if plan is not None:
        from controlplane.cli.schedule_plan import plan_document, print_plan

        if args.output != "table":
            doc = plan_document(plan)
            if both is not None:
                doc["schedule"] = schedule_document(*both)
            names = [f"schedule/{n}" for n in plan.deployments]
            names += [f"schedule/{n}" for n in (both[1].placements if both else {})]
            emit_document(doc, args.output, names)
            return 0
        print_plan(plan)
        if both is None:
            return 0
        emit("deployments without traffic and SLOs (fleet scheduler, on the nodes left free):")
        if not plan.free_nodes:
            emit("note: the fleet planner's deployments hold every node")
    assert both is not None
    req, s = both
    if args.output != "table":
        emit_document(
            schedule_document(req, s), args.output, [f"schedule/{n}" for n in s.placements]
        )
        return 0
    by_name = {d.name: d for d in req.demands}
    rows = []
    for d in sorted(req.demands, key=lambda d: (-d.priority, d.name)):
        p = s.placements.get(d.name)
        rows.append(
            [
                d.name,
                str(d.priority),
                d.objective,
                ",".join(p.nodes) if p else "-",
                str(p.gpus) if p else "0",
                f"{p.tokens_per_s:,.0f}" if p else "-",
                _usd(p.usd_per_million_tokens) if p else "-",
                "placed" if p else "Pending",
            ]
        )
    headers = [
        "deployment",
        "priority",
        "objective",
        "nodes",
        "GPUs",
        "tokens/s",
        "USD/Mtok",
        "state",
    ]
    emit(format_table(headers, rows))
    gpus = {n: g.gpus_per_node for g in req.groups for n in g.nodes}
    free = s.free_nodes
    emit(
        f"free: {len(free)} nodes, {sum(gpus[n] for n in free)} GPUs ({', '.join(free) or 'none'})"
    )
    for why in s.pending.values():
        emit(f"pending {why.deployment} ({by_name[why.deployment].priority}): {why.message}")
    emit(
        f"total {s.tokens_per_s:,.0f} tokens/s, {s.usd_per_hour:,.2f} USD/h of held GPUs; "
        f"{s.solver}, {s.solve_s:.2f} s"
    )
    return 0


def cmd_schedule_explain(args: argparse.Namespace) -> int:
    """``schedule explain DEPLOYMENT``: why these nodes, and the next best."""
    from controlplane.cli.output import format_table
    from policies.scheduling.explain import explain

    if args.fleet is None:
        from controlplane.cli.schedule_live import cmd_live_explain

        return cmd_live_explain(args)
    plan, both = _plan_and_schedule(args)
    if plan is not None and args.deployment in plan.deployments:
        from controlplane.cli.schedule_plan import explain_document, print_explanation

        doc = explain_document(plan, args.deployment)
        if args.output != "table":
            emit_document(doc, args.output, [f"schedule/{args.deployment}"])
        else:
            print_explanation(doc)
        return 0
    known_names = sorted(
        [*(plan.deployments if plan else ()), *(d.name for d in both[0].demands)]
        if both
        else list(plan.deployments if plan else ())
    )
    if both is None or args.deployment not in {d.name for d in both[0].demands}:
        raise InputError(
            f"no deployment {args.deployment!r} (known: {', '.join(known_names)})",
            field="DEPLOYMENT",
        )
    req, s = both
    e = explain(req, s, args.deployment)
    if args.output != "table":
        doc = {
            "kind": "ScheduleExplanation",
            "deployment": e.deployment,
            "nodes": list(e.nodes),
            "reason": e.reason,
            "tokensPerS": round(e.tokens_per_s, 1),
            "alternatives": [
                {
                    "nodes": a[0],
                    "gpus": a[1],
                    "tokensPerS": round(a[2], 1),
                    "usdPerMillionTokens": None if not math.isfinite(a[3]) else round(a[3], 4),
                }
                for a in e.alternatives
            ],
            "nextBest": {
                "nodes": list(e.next_best_nodes),
                "tokensPerS": round(e.next_best_tokens_per_s, 1),
                "fleetTokensPerS": round(e.next_best_total_tokens_per_s, 1),
            },
            "fleetTokensPerS": round(e.total_tokens_per_s, 1),
        }
        emit_document(doc, args.output, [f"schedule/{e.deployment}"])
        return 0
    emit(f"{e.deployment}: {', '.join(e.nodes) or 'Pending'}")
    emit(f"why: {e.reason}")
    rows = [[a[0], str(a[1]), f"{a[2]:,.0f}", _usd(a[3])] for a in e.alternatives]
    emit("candidate instances (best value first):")
    emit(format_table(["nodes", "GPUs", "tokens/s", "USD/Mtok"], rows))
    delta = e.next_best_total_tokens_per_s - e.total_tokens_per_s
    emit(
        f"next best: {e.deployment} on {', '.join(e.next_best_nodes) or 'nothing (Pending)'}: "
        f"{e.next_best_tokens_per_s:,.0f} tokens/s (now {e.tokens_per_s:,.0f}); fleet "
        f"{e.next_best_total_tokens_per_s:,.0f} tokens/s ({delta:+,.0f})"
    )
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fleet",
        metavar="FILE",
        help="schedule offline: this Fleet file (YAML or JSON) with -f; "
        "without it the controller's assignment is read",
    )
    p.add_argument(
        "-f",
        "--file",
        action="append",
        metavar="FILE",
        help="with --fleet: ModelDeployment documents (YAML, several per file; repeatable)",
    )
    p.add_argument(
        "--quota",
        action="append",
        metavar="NAMESPACE=GPUS",
        help="most GPUs a namespace's deployments may hold (repeatable)",
    )
    p.add_argument(
        "--estimate-policy",
        choices=("greedy", "ilp"),
        default="greedy",
        help="policy of the per-candidate estimates (default: %(default)s)",
    )
    p.add_argument(
        "--replica-groups",
        type=positive_int,
        default=1,
        metavar="N",
        help="engine instances a deployment may be split into (default: %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="with --fleet: processes for the estimate solves and the fleet planner's step "
        "curves (default: %(default)s)",
    )
    p.add_argument(
        "--curve-cache",
        metavar="DIR",
        help="where the fleet planner keeps step curves across runs (default: "
        "$MIXFLEET_CURVE_CACHE, else $XDG_CACHE_HOME/mixfleet/curves, "
        "~/.cache/mixfleet/curves)",
    )
    add_connection_args(p, suppress=True)
    add_output_arg(p)


def register(groups: Groups) -> None:
    """Add the ``schedule`` group."""
    g = add_group(groups, "schedule", "assign a fleet's nodes to deployments (exclusive GPUs)")
    p = add_leaf(
        g, "show", cmd_schedule_show, "which nodes serve which deployment; pending and why"
    )
    _common(p)
    p = add_leaf(
        g, "explain", cmd_schedule_explain, "why a deployment has its nodes; the next best"
    )
    p.add_argument("deployment", metavar="DEPLOYMENT")
    _common(p)
