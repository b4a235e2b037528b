"""``mixfleetctl plans list|show|diff|history``: plan versions held by the controller.

``list`` the newest versions (of one deployment with ``-d``); ``show`` one version (default:
the committed one) with its GPUs and node acknowledgements; ``diff`` the expert moves and
GPU changes between two versions; ``history`` every version of one deployment.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from apis.cliargs import positive_int
from controlplane.cli.connection import add_client, age, call, ms, to_json
from controlplane.cli.output import Groups, add_group, clip, emit, emit_document, table

if TYPE_CHECKING:
    from mixfleet.v1 import plan_pb2


def _plan_row(p: plan_pb2.PlanRecord, *, history: bool = False) -> list[Any]:
    from controlplane.wire.plans import PLAN_STATE_NAMES

    s = p.summary
    moves = s.expert_moves if s.HasField("expert_moves") else "-"
    row: list[Any] = [
        p.deployment,
        p.version,
        PLAN_STATE_NAMES.get(p.state, "?"),
        p.plan_id,
        ms(s.step_time_us),
        f"{s.imbalance:.3f}",
        moves,
        len(p.nodes),
    ]
    if history:
        row += [age(p.created_unix_s), age(p.state_changed_unix_s)]
    return [*row, clip(p.reason, 70)]


_PLAN_HEADERS = [
    "DEPLOYMENT",
    "VERSION",
    "STATE",
    "PLAN_ID",
    "STEP_MS",
    "IMBALANCE",
    "MOVES",
    "NODES",
]


def cmd_plans_list(args: argparse.Namespace) -> int:
    from mixfleet.v1 import plan_pb2

    reply = call(
        args,
        lambda s, md: s.ListPlans(
            plan_pb2.ListPlansRequest(deployment=args.deployment or "", limit=args.limit),
            metadata=md,
        ),
    )
    if args.output != "table":
        names = [f"plan/{p.deployment}/v{p.version}" for p in reply.plans]
        emit_document([to_json(p) for p in reply.plans], args.output, names)
        return 0
    print(table([*_PLAN_HEADERS, "REASON"], [_plan_row(p) for p in reply.plans]))
    return 0


def cmd_plans_history(args: argparse.Namespace) -> int:
    from mixfleet.v1 import plan_pb2

    reply = call(
        args,
        lambda s, md: s.ListPlans(
            plan_pb2.ListPlansRequest(deployment=args.deployment, limit=args.limit), metadata=md
        ),
    )
    if args.output != "table":
        names = [f"plan/{p.deployment}/v{p.version}" for p in reply.plans]
        emit_document([to_json(p) for p in reply.plans], args.output, names)
        return 0
    if not reply.plans:
        emit(_no_plan_yet(args))
        return 0
    rows = [_plan_row(p, history=True) for p in reply.plans]
    print(table([*_PLAN_HEADERS, "CREATED", "CHANGED", "REASON"], rows))
    return 0


def _no_plan_yet(args: argparse.Namespace) -> str:
    """What ``plans history`` says of a deployment without a plan version: its phase and
    message (right after ``deploy apply``: planning is under way)."""
    from mixfleet.v1 import plan_pb2

    from controlplane.wire.plans import DEPLOYMENT_PHASE_NAMES

    d = call(
        args,
        lambda s, md: s.GetDeployment(
            plan_pb2.GetDeploymentRequest(name=args.deployment), metadata=md
        ),
    )
    phase = DEPLOYMENT_PHASE_NAMES.get(d.status.phase, "pending")
    said = f"{phase}: {d.status.message}" if d.status.message else phase
    line = f"{args.deployment}: no plan version yet ({said})"
    if phase in ("pending", "planning"):
        line += (
            "; planning is under way. To follow it: mixfleetctl watch (prints each version "
            "as it is committed)"
        )
    return line


def cmd_plans_show(args: argparse.Namespace) -> int:
    from mixfleet.v1 import plan_pb2

    p = call(
        args,
        lambda s, md: s.GetPlan(
            plan_pb2.GetPlanRequest(deployment=args.deployment, version=args.version or 0),
            metadata=md,
        ),
    )
    doc = json.loads(p.plan_json) if p.plan_json else {}
    if args.output != "table":
        record = to_json(p)
        record.pop("plan_json", None)
        names = [f"plan/{p.deployment}/v{p.version}"]
        emit_document({"record": record, "plan": doc}, args.output, names)
        return 0
    from controlplane.wire.plans import PLAN_STATE_NAMES

    s = p.summary
    print(
        f"deployment: {p.deployment}  version {p.version}  plan {p.plan_id}  "
        f"{PLAN_STATE_NAMES.get(p.state, '?')}"
    )
    print(f"reason:     {p.reason or '-'}")
    moves = s.expert_moves if s.HasField("expert_moves") else "-"
    print(f"policy:     {s.policy} ({s.form})  solver {s.solver}  solve {s.solve_s:.2f} s")
    print(
        f"predicted:  step {ms(s.step_time_us)} ms  {s.tokens_per_s:,.0f} tokens/s  "
        f"imbalance {s.imbalance:.3f}  expert moves {moves}"
    )
    rows = []
    for g in doc.get("gpus", []):
        slots = [len(layer) for layer in g.get("experts", [])]
        rows.append(
            [
                g["gpu"],
                g["model"],
                f"{g['attention_share']:.4f}",
                f"{g['dp_weight']:.3f}",
                f"{min(slots)}-{max(slots)}" if slots else "-",
                p.acks.get(g["node"], "-"),
            ]
        )
    if rows:
        print(table(["GPU", "MODEL", "ATTN_SHARE", "DP_WEIGHT", "SLOTS", "ACK"], rows))
    return 0


def cmd_plans_diff(args: argparse.Namespace) -> int:
    from mixfleet.v1 import plan_pb2

    d = call(
        args,
        lambda s, md: s.DiffPlans(
            plan_pb2.DiffPlansRequest(
                deployment=args.deployment,
                from_version=args.from_version or 0,
                to_version=args.to_version or 0,
            ),
            metadata=md,
        ),
    )
    if args.output != "table":
        names = [f"plan/{d.deployment}/v{d.from_version}", f"plan/{d.deployment}/v{d.to_version}"]
        emit_document(to_json(d), args.output, names)
        return 0
    churn = d.expert_moves / d.total_slots if d.total_slots else 0.0
    print(f"{d.deployment}: v{d.from_version} -> v{d.to_version}")
    print(f"expert moves: {d.expert_moves} of {d.total_slots} slots ({churn:.1%})")
    print(f"step time:    {ms(d.step_time_us_before)} -> {ms(d.step_time_us_after)} ms")
    if d.gpus_added:
        print(f"GPUs added:   {', '.join(d.gpus_added)}")
    if d.gpus_removed:
        print(f"GPUs removed: {', '.join(d.gpus_removed)}")
    rows = [
        [
            g.gpu,
            f"{g.attention_share_before:.4f} -> {g.attention_share_after:.4f}",
            f"+{g.experts_added}",
            f"-{g.experts_removed}",
        ]
        for g in d.gpus
    ]
    if rows:
        print(table(["GPU", "ATTN_SHARE", "EXPERTS_IN", "EXPERTS_OUT"], rows))
    return 0


def register(groups: Groups) -> None:
    """Add the ``plans`` group."""
    plans = add_group(groups, "plans", "plan versions held by the controller", required=False)
    p = add_client(plans, "list", cmd_plans_list, "list plan versions, newest first")
    p.add_argument("-d", "--deployment", metavar="NAME")
    p.add_argument("--limit", type=positive_int, default=50)
    p = add_client(plans, "show", cmd_plans_show, "show one plan version (default: committed)")
    p.add_argument("deployment", metavar="DEPLOYMENT")
    p.add_argument("--version", type=positive_int, metavar="V", help="version (default: committed)")
    p = add_client(plans, "diff", cmd_plans_diff, "expert moves and GPU changes between versions")
    p.add_argument("deployment", metavar="DEPLOYMENT")
    p.add_argument(
        "--from",
        dest="from_version",
        type=positive_int,
        metavar="V",
        help="older version (default: the served one before --to)",
    )
    p.add_argument(
        "--to",
        dest="to_version",
        type=positive_int,
        metavar="V",
        help="newer version (default: committed)",
    )
    p = add_client(plans, "history", cmd_plans_history, "every version of one deployment")
    p.add_argument("deployment", metavar="DEPLOYMENT")
    p.add_argument("--limit", type=positive_int, default=100)
