"""The SQLite store: one file, WAL mode, versioned schema.

* WAL journal with ``synchronous=FULL``: a returned write survives a kill -9 and a power loss.
* ``schema_migrations`` records each applied migration; opening a file applies the missing
  ones in order, each in its own transaction, and refuses a file with a newer schema.
* Foreign keys are on: plans belong to deployments, acks to plans, the committed pointer to
  a plan.
* Every write is one ``BEGIN IMMEDIATE`` transaction; a trigger makes inserting a version
  that is not above every version of the deployment fail, so versions only grow even if
  two controllers shared the file by mistake.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from controlplane.errors import AlreadyExistsError, NotFoundError, PreconditionError, StoreError
from controlplane.store.base import (
    AckState,
    LoadWindow,
    NodeState,
    PlanAuthor,
    PlanState,
    StoredAck,
    StoredDeployment,
    StoredNode,
    StoredPlan,
)
from controlplane.store.sqlite.rows import (
    PLAN_COLUMNS,
    deployment_from_row,
    inventory_json,
    node_from_row,
    plan_from_row,
    plan_nodes,
)
from controlplane.store.sqlite.schema import MIGRATIONS, SCHEMA_VERSION, split_sql
from policies.inventory import NodeInventory
from policies.plan import Plan
from policies.spec import DeploymentSpec, spec_to_doc

_ALLOWED_MOVES: dict[str, set[str]] = {
    "proposed": {"preparing", "aborted"},
    "preparing": {"preparing", "aborted"},
}


class SqliteStore:
    """:class:`controlplane.store.base.Store` on one SQLite file.

    Args:
        path: database file (created with its directory when missing).
        busy_timeout_s: how long a write waits for another writer's lock, s.
        synchronous: SQLite ``synchronous`` mode: ``FULL`` (default; a returned write
            survives a power loss) or ``NORMAL`` (survives a process crash or kill -9, may
            lose the last writes on power loss; about 8x faster writes).
    """

    plan_author: PlanAuthor = "controller"

    def __init__(
        self, path: str | Path, *, busy_timeout_s: float = 10.0, synchronous: str = "FULL"
    ) -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise StoreError(f"synchronous must be FULL or NORMAL, got {synchronous!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(
                str(self.path),
                isolation_level=None,
                check_same_thread=False,
                timeout=busy_timeout_s,
            )
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.execute("PRAGMA foreign_keys=ON")
        except sqlite3.Error as exc:
            raise StoreError(
                f"cannot open {self.path}: {exc}. To fix: check the path and its permissions",
                field="store",
            ) from exc
        self._closed = False
        self._migrate()

    # ----------------------------------------------------------------- plumbing
    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE ... COMMIT, ROLLBACK on error)."""
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed", field="store")
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"cannot start a transaction: {exc}", field="store") from exc
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._db.execute("ROLLBACK")
                raise StoreError(f"commit failed: {exc}", field="store") from exc

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed", field="store")
            try:
                return list(self._db.execute(sql, tuple(args)))
            except sqlite3.Error as exc:
                raise StoreError(f"query failed: {exc}", field="store") from exc

    def _migrate(self) -> None:
        with self._lock:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY,"
                " description TEXT NOT NULL, applied_at REAL NOT NULL)"
            )
        applied = {r["version"] for r in self._query("SELECT version FROM schema_migrations")}
        newest = max(applied, default=0)
        if newest > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} has schema version {newest}, this controller knows up to "
                f"{SCHEMA_VERSION}. To fix: run a newer mixfleet controller on this store",
                field="store",
            )
        for version, description, sql in MIGRATIONS:
            if version in applied:
                continue
            with self._tx() as db:
                for statement in split_sql(sql):
                    db.execute(statement)
                db.execute(
                    "INSERT INTO schema_migrations VALUES (?, ?, ?)",
                    (version, description, time.time()),
                )
        with self._tx() as db:
            if not db.execute("SELECT 1 FROM meta WHERE key = 'controller_id'").fetchone():
                db.execute("INSERT INTO meta VALUES ('controller_id', ?)", (uuid.uuid4().hex,))

    def schema_version(self) -> int:
        rows = self._query("SELECT MAX(version) AS v FROM schema_migrations")
        return int(rows[0]["v"] or 0)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    def controller_id(self) -> str:
        return str(self._query("SELECT value FROM meta WHERE key = 'controller_id'")[0]["value"])

    # ----------------------------------------------------------------- nodes
    def upsert_node(self, node: StoredNode) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO nodes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    node.name,
                    inventory_json(node.inventory),
                    node.session_id,
                    node.registered_at_s,
                    node.last_heartbeat_s,
                    node.state,
                    node.message,
                    json.dumps(dict(node.applied)),
                ),
            )

    def update_node_status(
        self,
        name: str,
        *,
        inventory: NodeInventory | None = None,
        last_heartbeat_s: float | None = None,
        state: NodeState | None = None,
        message: str | None = None,
        applied: Mapping[str, int] | None = None,
    ) -> None:
        sets: list[str] = []
        args: list[Any] = []
        if inventory is not None:
            sets.append("inventory_json = ?")
            args.append(inventory_json(inventory))
        if last_heartbeat_s is not None:
            sets.append("last_heartbeat = ?")
            args.append(last_heartbeat_s)
        if state is not None:
            sets.append("state = ?")
            args.append(state)
        if message is not None:
            sets.append("message = ?")
            args.append(message)
        if applied is not None:
            sets.append("applied_json = ?")
            args.append(json.dumps(dict(applied)))
        if not sets:
            return
        with self._tx() as db:
            db.execute(f"UPDATE nodes SET {', '.join(sets)} WHERE name = ?", (*args, name))

    def get_node(self, name: str) -> StoredNode | None:
        rows = self._query("SELECT * FROM nodes WHERE name = ?", (name,))
        return node_from_row(rows[0]) if rows else None

    def list_nodes(self) -> list[StoredNode]:
        return [node_from_row(r) for r in self._query("SELECT * FROM nodes ORDER BY name")]

    def delete_node(self, name: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM nodes WHERE name = ?", (name,)).rowcount > 0

    # ----------------------------------------------------------------- deployments
    def put_deployment(
        self,
        spec: DeploymentSpec,
        *,
        now_s: float,
        create_only: bool = False,
        update_only: bool = False,
    ) -> StoredDeployment:
        doc = json.dumps(spec_to_doc(spec), sort_keys=True)
        with self._tx() as db:
            row = db.execute("SELECT * FROM deployments WHERE name = ?", (spec.name,)).fetchone()
            live = row is not None and row["deleted_at"] is None
            if create_only and live:
                raise AlreadyExistsError(
                    f"deployment {spec.name!r} exists. To fix: use UpdateDeployment or "
                    "ApplyDeployment, or delete it first",
                    field="spec.name",
                )
            if update_only and not live:
                raise NotFoundError(f"no deployment {spec.name!r}", field="spec.name")
            if row is None:
                db.execute(
                    "INSERT INTO deployments (name, spec_json, generation, created_at, updated_at)"
                    " VALUES (?, ?, 1, ?, ?)",
                    (spec.name, doc, now_s, now_s),
                )
            elif not live:  # revive: history and version counter are kept
                db.execute(
                    "UPDATE deployments SET spec_json = ?, generation = generation + 1,"
                    " created_at = ?, updated_at = ?, deleted_at = NULL, status_json = '{}'"
                    " WHERE name = ?",
                    (doc, now_s, now_s, spec.name),
                )
            elif row["spec_json"] != doc:
                db.execute(
                    "UPDATE deployments SET spec_json = ?, generation = generation + 1,"
                    " updated_at = ? WHERE name = ?",
                    (doc, now_s, spec.name),
                )
            out = db.execute("SELECT * FROM deployments WHERE name = ?", (spec.name,)).fetchone()
        return deployment_from_row(out)

    def get_deployment(
        self, name: str, *, include_deleted: bool = False
    ) -> StoredDeployment | None:
        rows = self._query("SELECT * FROM deployments WHERE name = ?", (name,))
        if not rows or (rows[0]["deleted_at"] is not None and not include_deleted):
            return None
        return deployment_from_row(rows[0])

    def list_deployments(self, *, include_deleted: bool = False) -> list[StoredDeployment]:
        where = "" if include_deleted else " WHERE deleted_at IS NULL"
        return [
            deployment_from_row(r)
            for r in self._query(f"SELECT * FROM deployments{where} ORDER BY name")
        ]

    def delete_deployment(self, name: str, *, now_s: float) -> bool:
        with self._tx() as db:
            row = db.execute(
                "SELECT committed_version FROM deployments WHERE name = ? AND deleted_at IS NULL",
                (name,),
            ).fetchone()
            if row is None:
                return False
            db.execute(
                "UPDATE plans SET state = 'superseded', state_changed_at = ?"
                " WHERE deployment = ? AND state = 'committed'",
                (now_s, name),
            )
            db.execute(
                "UPDATE plans SET state = 'aborted', reason = 'deployment deleted',"
                " state_changed_at = ? WHERE deployment = ? AND state IN ('proposed', 'preparing')",
                (now_s, name),
            )
            db.execute(
                "UPDATE deployments SET deleted_at = ?, committed_version = NULL, updated_at = ?"
                " WHERE name = ?",
                (now_s, now_s, name),
            )
        return True

    def set_deployment_status(self, name: str, status: Mapping[str, Any]) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE deployments SET status_json = ? WHERE name = ?",
                (json.dumps(dict(status), sort_keys=True), name),
            )

    # ----------------------------------------------------------------- plans
    def add_plan(
        self,
        deployment: str,
        plan: Plan,
        *,
        reason: str,
        inputs_key: str,
        now_s: float,
        document: Mapping[str, Any] | None = None,
    ) -> StoredPlan:
        with self._tx() as db:
            row = db.execute(
                "SELECT next_version FROM deployments WHERE name = ? AND deleted_at IS NULL",
                (deployment,),
            ).fetchone()
            if row is None:
                raise NotFoundError(f"no deployment {deployment!r}", field="deployment")
            version = int(row["next_version"])
            plan = replace(plan, version=version)
            doc = {**document, "version": version} if document is not None else plan.to_dict()
            nodes = plan_nodes(plan)
            try:
                db.execute(
                    "INSERT INTO plans VALUES (?, ?, ?, 'proposed', ?, ?, ?, ?, ?, NULL, ?, ?)",
                    (
                        deployment,
                        version,
                        plan.id,
                        reason,
                        inputs_key,
                        json.dumps(nodes),
                        json.dumps(doc["summary"]),
                        json.dumps(doc),
                        now_s,
                        now_s,
                    ),
                )
            except sqlite3.IntegrityError as exc:
                raise StoreError(f"cannot store version {version}: {exc}", field="version") from exc
            db.execute(
                "UPDATE deployments SET next_version = ? WHERE name = ?", (version + 1, deployment)
            )
        return StoredPlan(
            deployment,
            version,
            plan.id,
            "proposed",
            reason,
            inputs_key,
            tuple(nodes),
            doc["summary"],
            now_s,
            now_s,
            None,
            plan,
        )

    def set_plan_state(
        self,
        deployment: str,
        version: int,
        state: PlanState,
        *,
        reason: str | None = None,
        now_s: float,
        prepare_deadline_s: float | None = None,
    ) -> None:
        with self._tx() as db:
            row = db.execute(
                "SELECT state FROM plans WHERE deployment = ? AND version = ?",
                (deployment, version),
            ).fetchone()
            if row is None:
                raise NotFoundError(
                    f"deployment {deployment!r} has no version {version}", field="version"
                )
            if state not in _ALLOWED_MOVES.get(row["state"], set()):
                raise PreconditionError(
                    f"version {version} of {deployment!r} is {row['state']}; it cannot become "
                    f"{state}",
                    field="version",
                )
            db.execute(
                "UPDATE plans SET state = ?, reason = COALESCE(?, reason), state_changed_at = ?,"
                " prepare_deadline = COALESCE(?, prepare_deadline)"
                " WHERE deployment = ? AND version = ?",
                (state, reason, now_s, prepare_deadline_s, deployment, version),
            )

    def commit_plan(self, deployment: str, version: int, *, now_s: float) -> None:
        with self._tx() as db:
            row = db.execute(
                "SELECT state FROM plans WHERE deployment = ? AND version = ?",
                (deployment, version),
            ).fetchone()
            if row is None:
                raise NotFoundError(
                    f"deployment {deployment!r} has no version {version}", field="version"
                )
            if row["state"] == "committed":
                return
            if row["state"] not in ("proposed", "preparing"):
                raise PreconditionError(
                    f"version {version} of {deployment!r} is {row['state']}; it cannot be "
                    "committed",
                    field="version",
                )
            db.execute(
                "UPDATE plans SET state = 'superseded', state_changed_at = ?"
                " WHERE deployment = ? AND state = 'committed'",
                (now_s, deployment),
            )
            db.execute(
                "UPDATE plans SET state = 'committed', state_changed_at = ?"
                " WHERE deployment = ? AND version = ?",
                (now_s, deployment, version),
            )
            db.execute(
                "UPDATE deployments SET committed_version = ? WHERE name = ?", (version, deployment)
            )

    def get_plan(
        self, deployment: str, version: int, *, with_plan: bool = True
    ) -> StoredPlan | None:
        cols = "*" if with_plan else PLAN_COLUMNS
        rows = self._query(
            f"SELECT {cols} FROM plans WHERE deployment = ? AND version = ?", (deployment, version)
        )
        return plan_from_row(rows[0], with_plan=with_plan) if rows else None

    def committed_plan(self, deployment: str) -> StoredPlan | None:
        rows = self._query(
            "SELECT p.* FROM plans p JOIN deployments d ON d.name = p.deployment"
            " AND d.committed_version = p.version WHERE d.name = ? AND d.deleted_at IS NULL",
            (deployment,),
        )
        return plan_from_row(rows[0], with_plan=True) if rows else None

    def list_plans(
        self,
        deployment: str | None = None,
        *,
        states: Sequence[PlanState] | None = None,
        limit: int = 50,
    ) -> list[StoredPlan]:
        cols = PLAN_COLUMNS
        where: list[str] = []
        args: list[Any] = []
        if deployment is not None:
            where.append("deployment = ?")
            args.append(deployment)
        if states:
            where.append(f"state IN ({', '.join('?' for _ in states)})")
            args.extend(states)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        rows = self._query(
            f"SELECT {cols} FROM plans{clause} ORDER BY deployment, version DESC LIMIT ?",
            (*args, limit),
        )
        return [plan_from_row(r, with_plan=False) for r in rows]

    # ----------------------------------------------------------------- acks
    def record_ack(
        self,
        deployment: str,
        version: int,
        node: str,
        state: AckState,
        *,
        reason: str = "",
        now_s: float,
    ) -> bool:
        with self._tx() as db:
            if not db.execute(
                "SELECT 1 FROM plans WHERE deployment = ? AND version = ?", (deployment, version)
            ).fetchone():
                raise NotFoundError(
                    f"deployment {deployment!r} has no plan version {version}", field="version"
                )
            cur = db.execute(
                "INSERT OR IGNORE INTO acks VALUES (?, ?, ?, ?, ?, ?)",
                (deployment, version, node, state, reason, now_s),
            )
            return cur.rowcount > 0

    def record_acks(self, acks: Sequence[StoredAck]) -> int:
        stored = 0
        with self._tx() as db:
            known: dict[tuple[str, int], bool] = {}
            for a in acks:
                key = (a.deployment, a.version)
                if key not in known:
                    known[key] = bool(
                        db.execute(
                            "SELECT 1 FROM plans WHERE deployment = ? AND version = ?", key
                        ).fetchone()
                    )
                if known[key]:
                    cur = db.execute(
                        "INSERT OR IGNORE INTO acks VALUES (?, ?, ?, ?, ?, ?)",
                        (a.deployment, a.version, a.node, a.state, a.reason, a.at_s),
                    )
                    stored += cur.rowcount
        return stored

    def acks(self, deployment: str, version: int) -> list[StoredAck]:
        rows = self._query(
            "SELECT * FROM acks WHERE deployment = ? AND version = ? ORDER BY at, node",
            (deployment, version),
        )
        return [
            StoredAck(
                r["deployment"],
                r["version"],
                r["node"],
                cast(AckState, r["state"]),
                r["reason"],
                r["at"],
            )
            for r in rows
        ]

    # ----------------------------------------------------------------- load
    def add_load_window(self, window: LoadWindow, *, now_s: float) -> None:
        with self._tx() as db:
            if not db.execute(
                "SELECT 1 FROM deployments WHERE name = ? AND deleted_at IS NULL",
                (window.deployment,),
            ).fetchone():
                raise NotFoundError(f"no deployment {window.deployment!r}", field="deployment")
            db.execute(
                "INSERT INTO load_windows (deployment, engine_id, start_s, end_s, plan_version,"
                " counts_json, received_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    window.deployment,
                    window.engine_id,
                    window.start_s,
                    window.end_s,
                    window.plan_version,
                    json.dumps([list(r) for r in window.counts]),
                    now_s,
                ),
            )

    def load_windows(self, deployment: str, *, since_s: float = 0.0) -> list[LoadWindow]:
        rows = self._query(
            "SELECT * FROM load_windows WHERE deployment = ? AND end_s > ? ORDER BY end_s, id",
            (deployment, since_s),
        )
        return [
            LoadWindow(
                r["deployment"],
                r["engine_id"],
                r["start_s"],
                r["end_s"],
                r["plan_version"],
                tuple(tuple(float(x) for x in row) for row in json.loads(r["counts_json"])),
            )
            for r in rows
        ]

    def prune_load_windows(self, *, before_s: float) -> int:
        with self._tx() as db:
            return db.execute("DELETE FROM load_windows WHERE end_s < ?", (before_s,)).rowcount
