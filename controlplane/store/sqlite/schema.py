"""The SQLite store's schema: its migrations, applied in order on open (:func:`migrate`),
and how a migration script splits into statements."""

from __future__ import annotations

import sqlite3
import time
import uuid
from pathlib import Path

from controlplane.errors import StoreError

#: (version, description, SQL). Append only; never edit an applied migration.
MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (
        1,
        "nodes, deployments, plans, acks, load windows",
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE nodes (
            name TEXT PRIMARY KEY,
            inventory_json TEXT NOT NULL,
            session_id TEXT NOT NULL,
            registered_at REAL NOT NULL,
            last_heartbeat REAL NOT NULL,
            state TEXT NOT NULL DEFAULT 'ready'
                CHECK (state IN ('ready', 'draining', 'degraded')),
            message TEXT NOT NULL DEFAULT '',
            applied_json TEXT NOT NULL DEFAULT '{}'
        );
        CREATE TABLE deployments (
            name TEXT PRIMARY KEY,
            spec_json TEXT NOT NULL,
            generation INTEGER NOT NULL CHECK (generation > 0),
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            deleted_at REAL,
            next_version INTEGER NOT NULL DEFAULT 1 CHECK (next_version > 0),
            committed_version INTEGER,
            status_json TEXT NOT NULL DEFAULT '{}',
            FOREIGN KEY (name, committed_version) REFERENCES plans (deployment, version)
                DEFERRABLE INITIALLY DEFERRED
        );
        CREATE TABLE plans (
            deployment TEXT NOT NULL REFERENCES deployments (name),
            version INTEGER NOT NULL CHECK (version > 0),
            plan_id TEXT NOT NULL,
            state TEXT NOT NULL
                CHECK (state IN ('proposed', 'preparing', 'committed', 'aborted', 'superseded')),
            reason TEXT NOT NULL DEFAULT '',
            inputs_key TEXT NOT NULL DEFAULT '',
            nodes_json TEXT NOT NULL,
            summary_json TEXT NOT NULL,
            plan_json TEXT NOT NULL,
            prepare_deadline REAL,
            created_at REAL NOT NULL,
            state_changed_at REAL NOT NULL,
            PRIMARY KEY (deployment, version)
        );
        CREATE TRIGGER plans_versions_only_grow BEFORE INSERT ON plans
        WHEN NEW.version <= (SELECT COALESCE(MAX(version), 0) FROM plans
                             WHERE deployment = NEW.deployment)
        BEGIN SELECT RAISE(ABORT, 'plan versions only grow'); END;
        CREATE TABLE acks (
            deployment TEXT NOT NULL,
            version INTEGER NOT NULL,
            node TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('prepared', 'committed', 'failed')),
            reason TEXT NOT NULL DEFAULT '',
            at REAL NOT NULL,
            PRIMARY KEY (deployment, version, node, state),
            FOREIGN KEY (deployment, version) REFERENCES plans (deployment, version)
        );
        CREATE TABLE load_windows (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            deployment TEXT NOT NULL REFERENCES deployments (name),
            engine_id TEXT NOT NULL,
            start_s REAL NOT NULL,
            end_s REAL NOT NULL,
            plan_version INTEGER NOT NULL,
            counts_json TEXT NOT NULL,
            received_at REAL NOT NULL
        );
        CREATE INDEX load_windows_by_end ON load_windows (deployment, end_s);
        """,
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1][0]


def split_sql(script: str) -> list[str]:
    """Statements of a migration script (triggers keep their inner semicolons)."""
    out: list[str] = []
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            if buf.strip():
                out.append(buf.strip())
            buf = ""
    if buf.strip():
        out.append(buf.strip())
    return out


def migrate(db: sqlite3.Connection, path: Path, *, fresh: bool) -> None:
    """Apply the missing migrations in order, each in its own transaction; a ``fresh`` (new,
    empty) file also gets its identity (``meta.controller_id``).

    Raises:
        StoreError: the file is a SQLite database but not a mixfleet store, has a schema newer
            than this controller, has no identity, or a migration fails.
    """
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not fresh and "schema_migrations" not in tables:
            raise StoreError(
                f"{path} is a SQLite database but not a mixfleet store (no schema_migrations "
                "table). To fix: check --store; a new store needs a new file",
                field="store",
            )
        db.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY,"
            " description TEXT NOT NULL, applied_at REAL NOT NULL)"
        )
        applied = {r[0] for r in db.execute("SELECT version FROM schema_migrations")}
        newest = max(applied, default=0)
        if newest > SCHEMA_VERSION:
            raise StoreError(
                f"{path} has schema version {newest}, this controller knows up to "
                f"{SCHEMA_VERSION}. To fix: run a newer mixfleet controller on this store",
                field="store",
            )
        for version, description, sql in MIGRATIONS:
            if version in applied:
                continue
            db.execute("BEGIN IMMEDIATE")
            try:
                for statement in split_sql(sql):
                    db.execute(statement)
                db.execute(
                    "INSERT INTO schema_migrations VALUES (?, ?, ?)",
                    (version, description, time.time()),
                )
                if version == 1 and fresh:
                    db.execute("INSERT INTO meta VALUES ('controller_id', ?)", (uuid.uuid4().hex,))
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
    except sqlite3.Error as exc:
        raise StoreError(f"cannot migrate {path}: {exc}", field="store") from exc
