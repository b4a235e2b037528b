"""The SQLite store: one file, WAL mode, versioned schema.

* WAL journal with ``synchronous=FULL``: a returned write survives a kill -9 and a power loss.
* ``schema_migrations`` records each applied migration; opening a file applies the missing
  ones in order, each in its own transaction, and refuses a file with a newer schema.
* Foreign keys are on: plans belong to deployments, acks to plans, the committed pointer to
  a plan.
* Every write is one ``BEGIN IMMEDIATE`` transaction; a trigger makes inserting a version
  that is not above every version of the deployment fail, so versions only grow. A stored
  next version at or below an existing one (a damaged or hand-edited row) is repaired when
  the next plan is added (logged ``next plan version repaired``).
* One writer: opening for writing locks the database file itself (:mod:`.guard`); a second
  controller is refused with the holder's pid, host and start time, and every write checks
  the holder record in the file (a writer that finds another's stops writing). A missing,
  empty or replaced file is refused unless the caller says the store is new.
* A row that does not decode is quarantined (:class:`.rows.Quarantine`): logged, skipped,
  listed by :meth:`SqliteStore.quarantined`; the rest loads.
* Files are created 0600 (owner only).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from controlplane.errors import AlreadyExistsError, NotFoundError, PreconditionError, StoreError
from controlplane.store.base import (
    NodeState,
    PlanAuthor,
    PlanState,
    QuarantinedRow,
    StoredDeployment,
    StoredNode,
    StoredPlan,
)
from controlplane.store.sqlite.connection import AckAndLoadRows, connect
from controlplane.store.sqlite.guard import (
    Holder,
    WriterLock,
    check_file,
    check_identity,
    create_private,
    holder_json,
)
from controlplane.store.sqlite.rows import (
    PLAN_COLUMNS,
    Quarantine,
    deployment_from_row,
    inventory_json,
    node_from_row,
    plan_from_row,
    plan_nodes,
)
from controlplane.store.sqlite.schema import migrate
from policies.hardware.inventory import NodeInventory
from policies.plan import Plan
from policies.spec.build import DeploymentSpec, spec_to_doc

_log = structlog.get_logger("mixfleet.store")

_ALLOWED_MOVES: dict[str, set[str]] = {
    "proposed": {"preparing", "aborted"},
    "preparing": {"preparing", "aborted"},
}


class SqliteStore(AckAndLoadRows):
    """:class:`controlplane.store.base.Store` on one SQLite file.

    Opening for writing takes the store's writer lock (:mod:`.guard`): a second writer is
    refused with the holder's pid, host and start time. A missing, empty, foreign or
    replaced file is refused unless ``new`` says the store is new.

    Args:
        path: database file.
        busy_timeout_s: how long a write waits for another writer's lock, s.
        synchronous: SQLite ``synchronous`` mode: ``FULL`` (default; a returned write
            survives a power loss) or ``NORMAL`` (survives a process crash or kill -9, may
            lose the last writes on power loss; about 8x faster writes).
        new: True = the store is new here: create the file (0600, with its directory) when
            missing or empty, and accept a store other than the one last used at this path;
            False = the file must hold the store last used here; None = create when missing
            or empty (tests and the in-process harness).
        read_only: read without the writer lock (``mixfleetctl store check`` beside a
            running controller); writes fail.

    Raises:
        StoreError: the file is refused (the message says why and what to do), or another
            controller holds the store.
    """

    plan_author: PlanAuthor = "controller"

    def __init__(
        self,
        path: str | Path,
        *,
        busy_timeout_s: float = 10.0,
        synchronous: str = "FULL",
        new: bool | None = None,
        read_only: bool = False,
    ) -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise StoreError(f"synchronous must be FULL or NORMAL, got {synchronous!r}")
        self.path = Path(path).resolve()  # one file, however it is named
        self._lock = threading.RLock()
        self._closed = True
        self._writer: WriterLock | None = None
        self._holder: Holder | None = None
        self._fenced = ""
        self._quarantine = Quarantine(str(self.path))
        create = check_file(self.path, new=False if read_only else new)
        if not read_only:
            self._writer = WriterLock(self.path)
            if create:
                create_private(self.path)
            self._writer.acquire()
        try:
            self._db = connect(self.path, busy_timeout_s, synchronous, read_only=read_only)
            self._closed = False
            if not read_only:
                migrate(self._db, self.path, fresh=create)
            store_id = self.controller_id()
            if self._writer is not None:
                check_identity(self.path, store_id, self._writer.previous, new=new)
                self._writer.record(store_id)
                self._claim(self._writer.holder, adopt=bool(new))
        except BaseException:
            self.close()
            raise

    def _claim(self, holder: Holder, *, adopt: bool) -> None:
        """Write this writer's holder record into the store (``meta.writer``); every later
        write checks it (:meth:`_tx`). ``adopt`` (a store said to be new here) also clears a
        recorded split."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES ('writer', ?)", (holder_json(holder),))
            if adopt:
                db.execute("DELETE FROM meta WHERE key = 'split'")
        self._holder = holder

    def schema_version(self) -> int:
        rows = self._query("SELECT MAX(version) AS v FROM schema_migrations")
        return int(rows[0]["v"] or 0)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()
            if self._writer is not None:
                self._writer.release()

    def controller_id(self) -> str:
        rows = self._query("SELECT value FROM meta WHERE key = 'controller_id'")
        if not rows:
            raise StoreError(f"{self.path} has no store identity", field="store")
        return str(rows[0]["value"])

    def quarantined(self) -> list[QuarantinedRow]:
        """Rows found damaged since the store was opened (:class:`.rows.Quarantine`)."""
        return self._quarantine.rows()

    def record_alive(self, now_s: float) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES ('alive_at', ?)", (repr(now_s),))

    def last_alive_s(self) -> float | None:
        rows = self._query("SELECT value FROM meta WHERE key = 'alive_at'")
        try:
            return float(rows[0]["value"]) if rows else None
        except ValueError:
            return None

    # ----------------------------------------------------------------- nodes
    def upsert_node(self, node: StoredNode) -> None:
        self._quarantine.discard("nodes", node.name)
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
        return self._quarantine.decode("nodes", name, node_from_row, rows[0]) if rows else None

    def list_nodes(self) -> list[StoredNode]:
        out = []
        for r in self._query("SELECT * FROM nodes ORDER BY name"):
            n = self._quarantine.decode("nodes", str(r["name"]), node_from_row, r)
            if n is not None:
                out.append(n)
        return out

    def cordoned_nodes(self) -> frozenset[str]:
        return frozenset()  # standalone: no administrator cordon (agents report draining)

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
        self._quarantine.discard("deployments", spec.name)
        return deployment_from_row(out, self._quarantine)

    def get_deployment(
        self, name: str, *, include_deleted: bool = False
    ) -> StoredDeployment | None:
        rows = self._query("SELECT * FROM deployments WHERE name = ?", (name,))
        if not rows or (rows[0]["deleted_at"] is not None and not include_deleted):
            return None
        return self._deployment(rows[0])

    def list_deployments(self, *, include_deleted: bool = False) -> list[StoredDeployment]:
        where = "" if include_deleted else " WHERE deleted_at IS NULL"
        out = []
        for r in self._query(f"SELECT * FROM deployments{where} ORDER BY name"):
            d = self._deployment(r)
            if d is not None:
                out.append(d)
        return out

    def _deployment(self, r: sqlite3.Row) -> StoredDeployment | None:
        q = self._quarantine
        return q.decode("deployments", str(r["name"]), deployment_from_row, r, q)

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

    def withdraw_plan(self, deployment: str, *, reason: str, now_s: float) -> bool:
        with self._tx() as db:
            row = db.execute(
                "SELECT committed_version FROM deployments WHERE name = ? AND deleted_at IS NULL",
                (deployment,),
            ).fetchone()
            if row is None or row["committed_version"] is None:
                return False
            db.execute(
                "UPDATE plans SET state = 'superseded', reason = ?, state_changed_at = ?"
                " WHERE deployment = ? AND state = 'committed'",
                (reason, now_s, deployment),
            )
            db.execute(
                "UPDATE deployments SET committed_version = NULL, updated_at = ? WHERE name = ?",
                (now_s, deployment),
            )
        return True

    def set_deployment_status(self, name: str, status: Mapping[str, Any]) -> None:
        self._quarantine.discard("deployments.status_json", name)
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
            top = db.execute(
                "SELECT MAX(version) FROM plans WHERE deployment = ?", (deployment,)
            ).fetchone()[0]
            if top is not None and version <= int(top):  # a damaged or restored counter
                _log.warning(
                    "next plan version repaired",
                    deployment=deployment,
                    stored_next_version=version,
                    highest_version=int(top),
                    next_version=int(top) + 1,
                )
                version = int(top) + 1
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
        return self._plan(rows[0], with_plan=with_plan) if rows else None

    def _plan(self, r: sqlite3.Row, *, with_plan: bool) -> StoredPlan | None:
        key = f"{r['deployment']}/{r['version']}"
        return self._quarantine.decode("plans", key, plan_from_row, r, with_plan=with_plan)

    def committed_plan(self, deployment: str) -> StoredPlan | None:
        rows = self._query(
            "SELECT p.* FROM plans p JOIN deployments d ON d.name = p.deployment"
            " AND d.committed_version = p.version WHERE d.name = ? AND d.deleted_at IS NULL",
            (deployment,),
        )
        return self._plan(rows[0], with_plan=True) if rows else None

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
        plans = [self._plan(r, with_plan=False) for r in rows]
        return [p for p in plans if p is not None]
