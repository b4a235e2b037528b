"""The SQLite store's plumbing (:class:`SqliteBase`: connection, transactions, queries)
and its ack and load-window rows (:class:`AckAndLoadRows`), split off
:class:`controlplane.store.sqlite.SqliteStore`."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from controlplane.errors import NotFoundError, StoreError
from controlplane.store.base import AckState, LoadWindow, StoredAck
from controlplane.store.sqlite.guard import Holder, holder_from_json, holder_json
from controlplane.store.sqlite.rows import Quarantine


class SqliteBase:
    """One SQLite connection behind a lock: write transactions and queries."""

    _db: sqlite3.Connection
    _lock: threading.RLock
    _closed: bool
    _quarantine: Quarantine
    path: Path
    #: This writer's holder record, once written to ``meta.writer`` (None: read-only).
    _holder: Holder | None
    #: Why this writer writes no more ("" while it may).
    _fenced: str

    # ----------------------------------------------------------------- plumbing
    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE ... COMMIT, ROLLBACK on error), after
        checking that this writer still holds the store (:meth:`_check_writer`)."""
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed", field="store")
            if self._fenced:
                raise StoreError(self._fenced, field="store")
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"cannot start a transaction: {exc}", field="store") from exc
            self._check_writer()
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

    def _check_writer(self) -> None:
        """Inside a write transaction: refuse it when the holder record (``meta.writer``)
        is no longer this writer's - another controller opened the store without seeing
        its lock. The split is recorded (``meta.split``, for ``store check``) and this
        writer writes no more.

        Raises:
            StoreError: another writer took the store over.
        """
        holder = self._holder
        if holder is None:
            return
        try:
            row = self._db.execute("SELECT value FROM meta WHERE key = 'writer'").fetchone()
            other = holder_from_json(str(row[0])) if row is not None else None
            if other is not None and other.token == holder.token:
                return
            split = {
                "found_at_s": time.time(),
                "writers": [json.loads(holder_json(h)) for h in (holder, other) if h],
            }
            self._db.execute(
                "INSERT OR REPLACE INTO meta VALUES ('split', ?)", (json.dumps(split),)
            )
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._db.execute("ROLLBACK")
            raise StoreError(f"cannot check the store's writer: {exc}", field="store") from exc
        who = other.describe() if other is not None else "another process (its record is gone)"
        mine = holder.describe()
        self._fenced = (
            f"the store {self.path} was taken over by the controller {who} while this "
            f"controller ({mine}) held it: two controllers wrote one store, so this one "
            "writes no more. To fix: stop every controller of this store but one, then run "
            "`mixfleetctl store check`"
        )
        raise StoreError(self._fenced, field="store")

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed", field="store")
            try:
                return list(self._db.execute(sql, tuple(args)))
            except sqlite3.Error as exc:
                raise StoreError(f"query failed: {exc}", field="store") from exc


class AckAndLoadRows(SqliteBase):
    """The ``acks`` and ``load_windows`` tables (see :class:`controlplane.store.base.Store`)."""

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
        windows = (self._quarantine.decode("load_windows", str(r["id"]), _window, r) for r in rows)
        return [w for w in windows if w is not None]

    def prune_load_windows(self, *, before_s: float) -> int:
        with self._tx() as db:
            return db.execute("DELETE FROM load_windows WHERE end_s < ?", (before_s,)).rowcount


def _window(r: sqlite3.Row) -> LoadWindow:
    counts = json.loads(r["counts_json"])
    return LoadWindow(
        r["deployment"],
        r["engine_id"],
        float(r["start_s"]),
        float(r["end_s"]),
        int(r["plan_version"]),
        tuple(tuple(float(x) for x in row) for row in counts),
    )


def text_or_bytes(raw: bytes) -> str | bytes:
    """The ``text_factory`` of every store connection: a TEXT value as ``str``, or its raw
    bytes when it is not UTF-8. SQLite's default decoding raises inside the fetch, so one
    damaged row would fail the whole query before :class:`~.rows.Quarantine` sees it; raw
    bytes instead fail in the row's decoder (``json.loads`` and the protobuf JSON parser
    raise :class:`UnicodeDecodeError`, a :class:`ValueError`), which quarantines that row
    alone."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def connect(
    path: Path, busy_timeout_s: float, synchronous: str, *, read_only: bool
) -> sqlite3.Connection:
    """A connection in WAL mode (read-only: ``mode=ro``, no pragmas that write).

    Raises:
        StoreError: the file cannot be opened, or is not a SQLite database.
    """
    try:
        target = f"file:{path}?mode=ro" if read_only else str(path)
        db = sqlite3.connect(
            target,
            isolation_level=None,
            check_same_thread=False,
            timeout=busy_timeout_s,
            uri=read_only,
        )
        db.row_factory = sqlite3.Row
        db.text_factory = text_or_bytes
        if not read_only:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={synchronous}")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
    except sqlite3.Error as exc:
        raise StoreError(
            f"cannot open {path}: {exc}. To fix: check the path and its permissions, or "
            "restore the file from a backup",
            field="store",
        ) from exc
    return db
