"""``mixfleetctl schedule show|explain`` against a running controller.

The controller's fleet scheduler records its assignment in every deployment's status
(``DeploymentStatus.assigned_nodes``, ``assigned_gpus``, ``scheduling``); ``show`` reads it
with ``ListDeployments`` and ``ListNodes``: which nodes serve which deployment, the free
nodes and GPUs (ready nodes nobody is assigned), and each pending deployment with the
scheduler's reason. ``explain`` prints the controller's record of one deployment and the
next-best assignment, solved here (:func:`policies.scheduling.explain.explain`) on the
controller's ready nodes and deployment specs, starting from the controller's assignment
(namespace quotas only as given with ``--quota``: the controller's settings are not on the
wire).

Imported by :mod:`controlplane.cli.schedule` inside its handlers (grpc is heavy).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from controlplane.cli.connection import call
from controlplane.cli.output import emit, emit_document, format_table
from policies.errors import InputError


def _read(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """``(deployments, nodes)`` from the controller."""
    from mixfleet.v1 import plan_pb2

    deps = call(
        args, lambda s, md: s.ListDeployments(plan_pb2.ListDeploymentsRequest(), metadata=md)
    )
    nodes = call(args, lambda s, md: s.ListNodes(plan_pb2.ListNodesRequest(), metadata=md))
    return list(deps.deployments), list(nodes.nodes)


def live_document(deps: list[Any], nodes: list[Any]) -> dict[str, Any]:
    """The controller's assignment as a ``FleetSchedule`` document (``-o json|yaml``)."""
    from controlplane.wire.plans import DEPLOYMENT_PHASE_NAMES, NODE_HEALTH_NAMES

    placements, pending = [], []
    held: set[str] = set()
    for d in sorted(deps, key=lambda d: (-d.spec.priority, d.spec.name)):
        st, sc = d.status, d.status.scheduling
        base = {
            "deployment": d.spec.name,
            "priority": d.spec.priority,
            "objective": d.spec.objective or "throughput",
            "phase": DEPLOYMENT_PHASE_NAMES.get(st.phase, "?"),
        }
        if st.assigned_nodes:
            held.update(st.assigned_nodes)
            placements.append(
                base
                | {
                    "nodes": list(st.assigned_nodes),
                    "gpus": st.assigned_gpus,
                    "tokensPerS": round(sc.predicted_tokens_per_s, 1),
                    "decision": sc.decision,
                    "reason": sc.reason,
                }
            )
            continue
        scheduled = st.HasField("scheduling")
        pending.append(
            base
            | {
                "resource": sc.resource,
                "missing": sc.missing,
                "unit": sc.missing_unit,
                "reason": sc.reason if scheduled else (st.message or "not scheduled yet"),
            }
        )
    ready = [n for n in nodes if NODE_HEALTH_NAMES.get(n.health) == "ready"]
    free = [n for n in ready if n.inventory.node not in held]
    return {
        "kind": "FleetSchedule",
        "source": "controller",
        "tokensPerS": round(sum(p["tokensPerS"] for p in placements), 1),
        "placements": placements,
        "pending": pending,
        "freeNodes": [n.inventory.node for n in free],
        "freeGpus": sum(n.healthy_gpus for n in free),
        "readyNodes": len(ready),
        "scheduled": any(d.status.HasField("scheduling") for d in deps),
    }


def _local_fleet(nodes: list[Any]) -> Any:
    """The controller's ready nodes (healthy GPUs) as a Fleet."""
    from apis.wire.inventory import inventory_from_proto
    from controlplane.wire.plans import NODE_HEALTH_NAMES
    from policies.hardware.fleet import Fleet

    ready = [n for n in nodes if NODE_HEALTH_NAMES.get(n.health) == "ready"]
    fleet_nodes = [inventory_from_proto(n.inventory).to_node(healthy_only=True) for n in ready]
    return Fleet("controller", tuple(n for n in fleet_nodes if n.gpus))


def _local_plan(args: argparse.Namespace, deps: list[Any], nodes: list[Any]) -> Any:
    """The fleet planner's plan, solved here on the controller's ready nodes, of the
    deployments that state traffic and SLOs (None when none does)."""
    from apis.wire.deployment import spec_from_proto
    from controlplane.cli.schedule_plan import planned, run_planner

    specs = [s for s in (spec_from_proto(d.spec) for d in deps) if planned(s)]
    if not specs:
        return None
    return run_planner(args, _local_fleet(nodes), specs)


def cmd_live_show(args: argparse.Namespace) -> int:
    """``schedule show`` against the controller; deployments with traffic and SLOs also get
    the fleet planner's plan, solved here (the controller's own plan is in their status:
    ``instances``, ``fleet_plan``)."""
    from controlplane.cli.schedule_plan import plan_document, print_plan

    deps, nodes = _read(args)
    doc = live_document(deps, nodes)
    plan = _local_plan(args, deps, nodes)
    if plan is not None:
        doc["fleetPlan"] = plan_document(plan) | {"source": "resolvedHere"}
    if args.output != "table":
        emit_document(doc, args.output, [f"schedule/{p['deployment']}" for p in doc["placements"]])
        return 0
    rows = [
        [
            p["deployment"],
            str(p["priority"]),
            p["objective"],
            ",".join(p["nodes"]),
            str(p["gpus"]),
            f"{p['tokensPerS']:,.0f}",
            p["phase"],
        ]
        for p in doc["placements"]
    ] + [
        [p["deployment"], str(p["priority"]), p["objective"], "-", "0", "-", "Pending"]
        for p in doc["pending"]
    ]
    headers = ["deployment", "priority", "objective", "nodes", "GPUs", "tokens/s", "state"]
    emit(format_table(headers, rows))
    free = doc["freeNodes"]
    emit(f"free: {len(free)} nodes, {doc['freeGpus']} GPUs ({', '.join(free) or 'none'})")
    for p in doc["pending"]:
        emit(f"pending {p['deployment']} ({p['priority']}): {p['reason']}")
    emit(f"total {doc['tokensPerS']:,.0f} tokens/s predicted by the controller's scheduler")
    if doc["pending"] and not doc["placements"] and not doc["scheduled"]:
        emit(
            "note: the controller recorded no fleet schedule: its scheduler is off "
            "(ControllerSettings.fleet_scheduler), or in Kubernetes mode the operator "
            "schedules (kubectl get modeldeployments)"
        )
    if plan is not None:
        emit(
            "fleet plan of the deployments with traffic and SLOs, solved here on the "
            "controller's ready nodes (the controller's own plan runs them as engine "
            "instances):"
        )
        print_plan(plan)
    return 0


def _local_request(args: argparse.Namespace, deps: list[Any], nodes: list[Any]) -> Any:
    """The controller's inputs solved here: ``(request, schedule)``."""
    from apis.wire.deployment import spec_from_proto
    from controlplane.cli.schedule import _quotas
    from policies.scheduling import schedule
    from policies.spec.build import selects

    fleet = _local_fleet(nodes)
    specs = [spec_from_proto(d.spec) for d in deps]
    pairs = [(s, [n.name for n in fleet.nodes if selects(s, n.labels)]) for s in specs]
    previous = {
        d.spec.name: frozenset(d.status.assigned_nodes) for d in deps if d.status.assigned_nodes
    }
    return schedule(fleet, pairs, previous=previous, quotas_gpus=_quotas(args.quota))


def cmd_live_explain(args: argparse.Namespace) -> int:
    """``schedule explain DEPLOYMENT`` against the controller."""
    from policies.scheduling.explain import explain

    deps, nodes = _read(args)
    mine = next((d for d in deps if d.spec.name == args.deployment), None)
    if mine is None:
        known = ", ".join(sorted(d.spec.name for d in deps)) or "none"
        raise InputError(f"no deployment {args.deployment!r} (known: {known})", field="DEPLOYMENT")
    from apis.wire.deployment import spec_from_proto
    from controlplane.cli.schedule_plan import explain_document, planned, print_explanation

    if planned(spec_from_proto(mine.spec)):
        plan = _local_plan(args, deps, nodes)
        pdoc = explain_document(plan, args.deployment) | {"source": "resolvedHere"}
        if args.output != "table":
            emit_document(pdoc, args.output, [f"schedule/{args.deployment}"])
        else:
            emit("fleet plan solved here on the controller's ready nodes:")
            print_explanation(pdoc)
        return 0
    st, sc = mine.status, mine.status.scheduling
    req, s = _local_request(args, deps, nodes)
    e = explain(req, s, args.deployment)
    doc = {
        "kind": "ScheduleExplanation",
        "source": "controller",
        "deployment": args.deployment,
        "nodes": list(st.assigned_nodes),
        "gpus": st.assigned_gpus,
        "placed": sc.placed,
        "reason": sc.reason or st.message,
        "decision": sc.decision,
        "tokensPerS": round(sc.predicted_tokens_per_s, 1),
        "resolvedHere": {
            "nodes": list(e.nodes),
            "sameAsController": sorted(e.nodes) == sorted(st.assigned_nodes),
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
        },
    }
    if args.output != "table":
        emit_document(doc, args.output, [f"schedule/{args.deployment}"])
        return 0
    _print_explanation(doc)
    return 0


def _print_explanation(doc: dict[str, Any]) -> None:
    here = doc["resolvedHere"]
    emit(f"{doc['deployment']}: {', '.join(doc['nodes']) or 'Pending'} ({doc['gpus']} GPUs)")
    emit(f"why (controller): {doc['reason'] or '-'}")
    if doc["decision"]:
        emit(f"last decision: {doc['decision']}")
    if not here["sameAsController"]:
        emit(
            f"note: solved here on the controller's nodes it gets "
            f"{', '.join(here['nodes']) or 'nothing'} (the controller may be mid-change, or "
            "use quotas not given with --quota)"
        )
    rows = [
        [a["nodes"], str(a["gpus"]), f"{a['tokensPerS']:,.0f}", _usd(a["usdPerMillionTokens"])]
        for a in here["alternatives"]
    ]
    emit("candidate instances (best value first):")
    emit(format_table(["nodes", "GPUs", "tokens/s", "USD/Mtok"], rows))
    nb = here["nextBest"]
    delta = nb["fleetTokensPerS"] - here["fleetTokensPerS"]
    emit(
        f"next best: {doc['deployment']} on {', '.join(nb['nodes']) or 'nothing (Pending)'}: "
        f"{nb['tokensPerS']:,.0f} tokens/s; fleet {nb['fleetTokensPerS']:,.0f} tokens/s "
        f"({delta:+,.0f})"
    )


def _usd(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"
