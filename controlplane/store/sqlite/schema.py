"""The SQLite store's schema: its migrations, applied in order on open (see
:meth:`controlplane.store.sqlite.SqliteStore._migrate`), and how a migration script splits into
statements."""

from __future__ import annotations

import sqlite3

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
