"""Rows of the SQLite store into records, and the column lists and documents the store
writes."""

from __future__ import annotations

import json
import sqlite3
from typing import cast

from apis.wire.inventory import inventory_from_proto_json, inventory_to_proto_json
from controlplane.store.base import (
    NodeState,
    PlanState,
    StoredDeployment,
    StoredNode,
    StoredPlan,
)
from policies.inventory import NodeInventory
from policies.plan import Plan, plan_from_dict
from policies.spec import parse_deployment

#: Every ``plans`` column but the plan document (listings read no documents).
PLAN_COLUMNS = (
    "deployment, version, plan_id, state, reason, inputs_key, nodes_json, summary_json,"
    " prepare_deadline, created_at, state_changed_at"
)


def inventory_json(inv: NodeInventory) -> str:
    """The inventory as the ``inventory_json`` column stores it (protobuf JSON)."""
    return inventory_to_proto_json(inv)


def node_from_row(r: sqlite3.Row) -> StoredNode:
    """A ``nodes`` row as a record."""
    return StoredNode(
        name=r["name"],
        inventory=inventory_from_proto_json(r["inventory_json"]),
        session_id=r["session_id"],
        registered_at_s=r["registered_at"],
        last_heartbeat_s=r["last_heartbeat"],
        state=cast(NodeState, r["state"]),
        message=r["message"],
        applied={k: int(v) for k, v in json.loads(r["applied_json"]).items()},
    )


def deployment_from_row(r: sqlite3.Row) -> StoredDeployment:
    """A ``deployments`` row as a record."""
    return StoredDeployment(
        spec=parse_deployment(json.loads(r["spec_json"])),
        generation=r["generation"],
        created_at_s=r["created_at"],
        updated_at_s=r["updated_at"],
        deleted=r["deleted_at"] is not None,
        committed_version=r["committed_version"],
        status=json.loads(r["status_json"]),
    )


def plan_from_row(r: sqlite3.Row, *, with_plan: bool) -> StoredPlan:
    """A ``plans`` row as a record; ``with_plan``: the row has ``plan_json`` to decode."""
    return StoredPlan(
        deployment=r["deployment"],
        version=r["version"],
        plan_id=r["plan_id"],
        state=cast(PlanState, r["state"]),
        reason=r["reason"],
        inputs_key=r["inputs_key"],
        nodes=tuple(json.loads(r["nodes_json"])),
        summary=json.loads(r["summary_json"]),
        created_at_s=r["created_at"],
        state_changed_at_s=r["state_changed_at"],
        prepare_deadline_s=r["prepare_deadline"],
        plan=plan_from_dict(json.loads(r["plan_json"])) if with_plan else None,
    )


def plan_nodes(plan: Plan) -> list[str]:
    """The plan's nodes, each once, in the order of their first GPU."""
    seen: dict[str, None] = {}
    for g in plan.gpus:
        seen.setdefault(g.node, None)
    return list(seen)
