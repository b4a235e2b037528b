"""Conversions between the controller's records and ``mixfleet.v1`` messages.

Used by the servicers (:mod:`controlplane.server.services`) and the remote CLI; no logic beyond
copying fields and mapping enums.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mixfleet.v1 import agent_pb2, engine_pb2, plan_pb2

from apis.wire.deployment import spec_to_proto
from apis.wire.inventory import inventory_to_proto
from controlplane.server.controller import AssignmentEvent, NodeView
from controlplane.store import AckState, PlanState, StoredDeployment, StoredPlan
from controlplane.wire.instances import demand_to_proto, instance_fields
from policies.assignment import PlanDiff, engine_document
from policies.errors import InputError
from policies.plan import Plan

PHASE_TO_PROTO = {
    "prepare": agent_pb2.ASSIGNMENT_PHASE_PREPARE,
    "commit": agent_pb2.ASSIGNMENT_PHASE_COMMIT,
    "abort": agent_pb2.ASSIGNMENT_PHASE_ABORT,
    "remove": agent_pb2.ASSIGNMENT_PHASE_REMOVE,
}
ACK_FROM_PROTO: dict[int, AckState] = {
    agent_pb2.ACK_STATE_PREPARED: "prepared",
    agent_pb2.ACK_STATE_COMMITTED: "committed",
    agent_pb2.ACK_STATE_FAILED: "failed",
}
NODE_STATE_FROM_PROTO = {
    agent_pb2.NODE_STATE_UNSPECIFIED: "ready",
    agent_pb2.NODE_STATE_READY: "ready",
    agent_pb2.NODE_STATE_DRAINING: "draining",
    agent_pb2.NODE_STATE_DEGRADED: "degraded",
}
PLAN_STATE_TO_PROTO: dict[PlanState, plan_pb2.PlanState.ValueType] = {
    "proposed": plan_pb2.PLAN_STATE_PROPOSED,
    "preparing": plan_pb2.PLAN_STATE_PREPARING,
    "committed": plan_pb2.PLAN_STATE_COMMITTED,
    "aborted": plan_pb2.PLAN_STATE_ABORTED,
    "superseded": plan_pb2.PLAN_STATE_SUPERSEDED,
}
PLAN_STATE_NAMES = {v: k for k, v in PLAN_STATE_TO_PROTO.items()}
DEPLOYMENT_PHASE_TO_PROTO = {
    "pending": plan_pb2.DEPLOYMENT_PHASE_PENDING,
    "planning": plan_pb2.DEPLOYMENT_PHASE_PLANNING,
    "rolling_out": plan_pb2.DEPLOYMENT_PHASE_ROLLING_OUT,
    "ready": plan_pb2.DEPLOYMENT_PHASE_READY,
    "degraded": plan_pb2.DEPLOYMENT_PHASE_DEGRADED,
    "failed": plan_pb2.DEPLOYMENT_PHASE_FAILED,
}
DEPLOYMENT_PHASE_NAMES = {v: k for k, v in DEPLOYMENT_PHASE_TO_PROTO.items()}
NODE_HEALTH_TO_PROTO = {
    "ready": plan_pb2.NODE_HEALTH_READY,
    "degraded": plan_pb2.NODE_HEALTH_DEGRADED,
    "draining": plan_pb2.NODE_HEALTH_DRAINING,
    "lost": plan_pb2.NODE_HEALTH_LOST,
}
NODE_HEALTH_NAMES = {v: k for k, v in NODE_HEALTH_TO_PROTO.items()}
FORMAT_FROM_PROTO = {
    engine_pb2.ROUTING_FORMAT_UNSPECIFIED: "sglang",
    engine_pb2.ROUTING_FORMAT_SGLANG: "sglang",
    engine_pb2.ROUTING_FORMAT_VLLM: "vllm",
    engine_pb2.ROUTING_FORMAT_TRTLLM: "trtllm",
    engine_pb2.ROUTING_FORMAT_NATIVE: "native",
}


def assignment_to_proto(e: AssignmentEvent) -> agent_pb2.Assignment:
    msg = agent_pb2.Assignment(
        deployment=e.deployment,
        plan_id=e.plan_id,
        version=e.version,
        phase=PHASE_TO_PROTO[e.phase],
        world_size=e.world_size,
        prepare_deadline_unix_s=e.prepare_deadline_s,
    )
    if e.part is not None:
        msg.gpus.extend(
            agent_pb2.GpuAssignment(
                gpu=g.gpu,
                index=g.index,
                uuid=g.uuid,
                rank=g.rank,
                attention_share=g.attention_share,
                dp_weight=g.dp_weight,
                expert_slots=g.expert_slots,
            )
            for g in e.part.gpus
        )
        msg.part_json = e.part.json
        msg.expert_location_zlib = e.part.expert_location_zlib
        if e.instance is not None:
            msg.role = e.instance.role
            msg.instance_of = e.instance.of
            msg.engine_port = e.instance.port
            msg.bootstrap_port = e.instance.bootstrap_port
    return msg


def summary_to_proto(s: Mapping[str, Any], num_gpus: int = 0) -> plan_pb2.PlanSummary:
    msg = plan_pb2.PlanSummary(
        policy=str(s.get("policy", "")),
        form=str(s.get("form", "")),
        step_time_us=float(s.get("step_time_us", 0.0)),
        tokens_per_s=float(s.get("tokens_per_s", 0.0)),
        solve_s=float(s.get("solve_s", 0.0)),
        feasible=bool(s.get("feasible", False)),
        imbalance=float(s.get("imbalance", 0.0)),
        solver=str(s.get("solver", "")),
        num_gpus=num_gpus,
    )
    if s.get("lower_bound_us") is not None:
        msg.lower_bound_us = float(s["lower_bound_us"])
    if s.get("gap") is not None:
        msg.gap = float(s["gap"])
    if s.get("expert_moves") is not None:
        msg.expert_moves = int(s["expert_moves"])
    return msg


def plan_to_proto(
    p: StoredPlan, *, acks: Mapping[str, str] | None = None, with_doc: bool = False
) -> plan_pb2.PlanRecord:
    num_gpus = len(p.plan.gpus) if p.plan is not None else 0
    msg = plan_pb2.PlanRecord(
        deployment=p.deployment,
        version=p.version,
        plan_id=p.plan_id,
        state=PLAN_STATE_TO_PROTO[p.state],
        reason=p.reason,
        summary=summary_to_proto(p.summary, num_gpus),
        nodes=list(p.nodes),
        created_unix_s=p.created_at_s,
        state_changed_unix_s=p.state_changed_at_s,
        acks=dict(acks or {}),
    )
    if with_doc and p.plan is not None:
        msg.plan_json = json.dumps(p.plan.to_dict()).encode()
    return msg


def unstored_plan_to_proto(plan: Plan, *, with_doc: bool) -> plan_pb2.PlanRecord:
    """A dry-run plan (not stored: version 0, state unspecified)."""
    doc = plan.to_dict()
    msg = plan_pb2.PlanRecord(
        plan_id=plan.id,
        summary=summary_to_proto(doc["summary"], len(plan.gpus)),
        nodes=list(dict.fromkeys(g.node for g in plan.gpus)),
    )
    if with_doc:
        msg.plan_json = json.dumps(doc).encode()
    return msg


def deployment_to_proto(d: StoredDeployment, *, latest_version: int = 0) -> plan_pb2.Deployment:
    st = d.status
    status = plan_pb2.DeploymentStatus(
        phase=DEPLOYMENT_PHASE_TO_PROTO.get(
            str(st.get("phase", "pending")), plan_pb2.DEPLOYMENT_PHASE_UNSPECIFIED
        ),
        message=str(st.get("message", "")),
        committed_version=d.committed_version or 0,
        committed_plan_id=str(st.get("committed_plan_id", "")),
        latest_version=latest_version,
        nodes=[str(n) for n in st.get("nodes", [])] if d.committed_version else [],
        step_time_us=float(st.get("step_time_us", 0.0)) if d.committed_version else 0.0,
        imbalance=float(st.get("imbalance", 0.0)) if d.committed_version else 0.0,
        observed_imbalance=float(st.get("observed_imbalance", 0.0)),
        cost_per_million_tokens_usd=float(st.get("cost_per_million_tokens_usd") or 0.0)
        if d.committed_version
        else 0.0,
        conditions=[str(c) for c in st.get("conditions", ()) or ()],
        assigned_nodes=[str(n) for n in st.get("assigned_nodes", ()) or ()],
        assigned_gpus=int(st.get("assigned_gpus", 0) or 0),
    )
    sched = st.get("scheduling")
    if isinstance(sched, dict):
        status.scheduling.CopyFrom(scheduling_to_proto(sched))
    status.instance_of, status.instance_count = instance_fields(st)
    demand = demand_to_proto(d.spec, st)
    if demand is not None:
        status.demand.CopyFrom(demand)
    return plan_pb2.Deployment(
        spec=spec_to_proto(d.spec),
        status=status,
        generation=d.generation,
        created_unix_s=d.created_at_s,
        updated_unix_s=d.updated_at_s,
    )


def scheduling_to_proto(s: dict[str, object]) -> plan_pb2.SchedulingStatus:
    """The fleet scheduler's ``status["scheduling"]`` record (FleetScheduler._record)."""

    def num(key: str) -> float:
        v = s.get(key, 0.0)
        return float(v) if isinstance(v, int | float) else 0.0

    return plan_pb2.SchedulingStatus(
        placed=bool(s.get("placed", False)),
        reason=str(s.get("reason", "")),
        resource=str(s.get("resource", "")),
        missing=num("missing"),
        missing_unit=str(s.get("missing_unit", "")),
        predicted_tokens_per_s=num("predicted_tokens_per_s"),
        decision=str(s.get("decision", "")),
        solver=str(s.get("solver", "")),
    )


def node_to_proto(v: NodeView) -> plan_pb2.NodeRecord:
    n = v.stored
    return plan_pb2.NodeRecord(
        inventory=inventory_to_proto(n.inventory),
        health=NODE_HEALTH_TO_PROTO[v.health],
        registered_unix_s=n.registered_at_s,
        last_heartbeat_unix_s=v.last_seen_s,
        healthy_gpus=len(n.inventory.healthy_gpus()),
        applied=dict(n.applied),
        message=n.message,
        unknown_deployments=list(v.unknown_deployments),
    )


def diff_to_proto(deployment: str, a: int, b: int, d: PlanDiff) -> plan_pb2.PlanDiff:
    return plan_pb2.PlanDiff(
        deployment=deployment,
        from_version=a,
        to_version=b,
        expert_moves=d.expert_moves,
        total_slots=d.total_slots,
        step_time_us_before=d.step_time_us_before,
        step_time_us_after=d.step_time_us_after,
        gpus_added=list(d.gpus_added),
        gpus_removed=list(d.gpus_removed),
        gpus=[
            plan_pb2.GpuDiff(
                gpu=g.gpu,
                attention_share_before=g.attention_share_before,
                attention_share_after=g.attention_share_after,
                experts_added=g.experts_added,
                experts_removed=g.experts_removed,
            )
            for g in d.gpus
        ],
    )


def routing_to_proto(
    p: StoredPlan, fmt_value: engine_pb2.RoutingFormat.ValueType
) -> engine_pb2.Routing:
    """Routing of a committed plan in the requested format.

    Raises:
        InputError: an engine format for a native-form or dense plan.
    """
    if p.plan is None:
        raise InputError("plan document missing", field="deployment")
    plan = p.plan
    fmt = FORMAT_FROM_PROTO.get(fmt_value)
    if fmt is None:
        raise InputError(f"unknown routing format {fmt_value}", field="format")
    doc = engine_document(plan, fmt)
    return engine_pb2.Routing(
        deployment=p.deployment,
        plan_id=p.plan_id,
        version=p.version,
        format=fmt_value or engine_pb2.ROUTING_FORMAT_SGLANG,
        world_size=len(plan.gpus),
        slots_per_rank=plan.slots_per_gpu or 0,
        num_logical_experts=plan.num_experts,
        moe_layers=list(plan.moe_layers),
        layers=[engine_pb2.LayerMap(physical_to_logical=row) for row in plan.physical_to_logical()],
        dp_weights=[g.dp_weight for g in plan.gpus],
        rank_gpus=[g.gpu for g in plan.gpus],
        engine_json=json.dumps(doc).encode(),
        engine=plan.engine.name,
        dp_ranks=dp_ranks(plan),
        dp_balance=plan.engine.dp_balance,
    )


def dp_ranks(plan: Plan) -> list[int]:
    """Engine DP attention rank of each GPU (rank order): GPUs of one ``dp_group`` share a
    rank, numbered in order of first appearance; a GPU outside any group is its own rank."""
    seen: dict[int, int] = {}
    out: list[int] = []
    for i, g in enumerate(plan.gpus):
        key = g.dp_group if g.dp_group is not None else -1 - i
        out.append(seen.setdefault(key, len(seen)))
    return out
