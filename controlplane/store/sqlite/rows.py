"""Rows of the SQLite store into records, the column lists and documents the store
writes, and the :class:`Quarantine` of rows that do not decode."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar, cast

import structlog
from google.protobuf import json_format

from apis.wire.inventory import inventory_from_proto_json, inventory_to_proto_json
from controlplane.store.base import (
    NodeState,
    PlanState,
    QuarantinedRow,
    StoredDeployment,
    StoredNode,
    StoredPlan,
)
from policies.errors import MixfleetError
from policies.hardware.inventory import NodeInventory
from policies.plan import Plan, plan_from_dict
from policies.spec.build import parse_deployment

T = TypeVar("T")

#: What decoding a damaged row raises (malformed JSON, a missing key, a NULL where a value
#: belongs, a document the planning core refuses, a protobuf JSON that does not parse).
DECODE_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    KeyError,
    TypeError,
    IndexError,
    AttributeError,
    RecursionError,
    MixfleetError,
    json_format.Error,
)


class Quarantine:
    """Rows that do not decode: each is logged once (``store row quarantined``), recorded,
    and skipped by the readers, so one damaged row never stops the rest of the store from
    loading. A row written again (a node re-registering) leaves the quarantine."""

    def __init__(self, path: str) -> None:
        self._rows: dict[tuple[str, str], QuarantinedRow] = {}
        self._log = structlog.get_logger("mixfleet.store").bind(store=path)

    def decode(
        self, table: str, key: str, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T | None:
        """``fn(*args, **kwargs)``, or None (the row quarantined) when it raises a decode
        error."""
        try:
            return fn(*args, **kwargs)
        except DECODE_ERRORS as exc:
            self.add(table, key, f"{type(exc).__name__}: {exc}"[:500])
            return None

    def add(self, table: str, key: str, error: str) -> None:
        """Record a damaged row (logged the first time)."""
        if (table, key) not in self._rows:
            self._rows[(table, key)] = QuarantinedRow(table, key, error)
            self._log.error(
                "store row quarantined",
                table=table,
                key=key,
                error=error,
                hint="the row is skipped; run `mixfleetctl store check` and restore it from a "
                "backup, or delete the record (a node re-registers by itself)",
            )

    def discard(self, table: str, key: str) -> None:
        """The row was written again: it decodes now."""
        self._rows.pop((table, key), None)

    def rows(self) -> list[QuarantinedRow]:
        """Every quarantined row, in the order found."""
        return list(self._rows.values())

    def has(self, table: str, key: str) -> bool:
        """Whether that row is quarantined."""
        return (table, key) in self._rows


#: Every ``plans`` column but the plan document (listings read no documents).
PLAN_COLUMNS = (
    "deployment, version, plan_id, state, reason, inputs_key, nodes_json, summary_json,"
    " prepare_deadline, created_at, state_changed_at"
)


def inventory_json(inv: NodeInventory) -> str:
    """The inventory as the ``inventory_json`` column stores it (protobuf JSON)."""
    return inventory_to_proto_json(inv)


def node_from_row(r: sqlite3.Row) -> StoredNode:
    """A ``nodes`` row as a record.

    Raises:
        One of :data:`DECODE_ERRORS` for a damaged row.
    """
    return StoredNode(
        name=r["name"],
        inventory=inventory_from_proto_json(r["inventory_json"]),
        session_id=r["session_id"],
        registered_at_s=float(r["registered_at"]),
        last_heartbeat_s=float(r["last_heartbeat"]),
        state=cast(NodeState, r["state"]),
        message=r["message"],
        applied={str(k): int(v) for k, v in json.loads(r["applied_json"]).items()},
    )


def deployment_from_row(r: sqlite3.Row, quarantine: Quarantine | None = None) -> StoredDeployment:
    """A ``deployments`` row as a record. A status that does not decode is replaced by one
    whose ``conditions`` say so (the deployment itself still loads).

    Raises:
        One of :data:`DECODE_ERRORS` when the spec or the row itself is damaged.
    """
    status = None
    if quarantine is not None:
        status = quarantine.decode("deployments.status_json", r["name"], _status, r)
        if status is None:
            status = {"conditions": ["StoreRowQuarantined: the stored status did not decode"]}
    return StoredDeployment(
        spec=parse_deployment(json.loads(r["spec_json"])),
        generation=int(r["generation"]),
        created_at_s=float(r["created_at"]),
        updated_at_s=float(r["updated_at"]),
        deleted=r["deleted_at"] is not None,
        committed_version=r["committed_version"],
        status=status if status is not None else _status(r),
    )


def _status(r: sqlite3.Row) -> dict[str, Any]:
    doc = json.loads(r["status_json"])
    if not isinstance(doc, dict):
        raise TypeError("the status must be a JSON object")
    return doc


def plan_from_row(r: sqlite3.Row, *, with_plan: bool) -> StoredPlan:
    """A ``plans`` row as a record; ``with_plan``: the row has ``plan_json`` to decode.

    Raises:
        One of :data:`DECODE_ERRORS` for a damaged row.
    """
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
