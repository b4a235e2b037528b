"""``mixfleetctl store check``: is a SQLite store whole?

:func:`check_store` opens the file read-only (safe beside a running controller) and runs,
in order:

1. SQLite's own ``PRAGMA integrity_check`` (pages, indexes) and ``PRAGMA
   foreign_key_check`` (acks of missing plans, plans of missing deployments);
2. mixfleet's row checks: the store identity is there, every row decodes (node inventories,
   deployment specs and statuses, plan documents, load windows), and the plan history is
   consistent - at most one committed version per deployment and it is the one the
   deployment's committed pointer names, no version at or above the deployment's next
   version, a plan document's own version equals its row's, a deleted deployment serves
   nothing and has no rollout open.

:func:`backup_store` writes a consistent copy with SQLite's online backup (the same as the
``sqlite3`` shell's ``.backup``), also beside a running controller.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

from controlplane.errors import StoreError
from controlplane.store.sqlite.connection import text_or_bytes
from controlplane.store.sqlite.guard import FILE_MODE, check_file, holder_from_json
from controlplane.store.sqlite.rows import (
    DECODE_ERRORS,
    deployment_from_row,
    node_from_row,
    plan_from_row,
)

T = TypeVar("T")


@dataclass
class CheckReport:
    """What :func:`check_store` found.

    Attributes:
        path: the database file.
        store_id: the store's identity ("" when missing).
        counts: rows per table.
        problems: one line per problem (empty: the store is whole).
    """

    path: str
    store_id: str = ""
    counts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_store(path: Path) -> CheckReport:
    """Check the store at ``path`` (see the module docstring).

    Raises:
        StoreError: the file is missing, empty or cannot be opened as SQLite at all.
    """
    check_file(path, new=False)
    report = CheckReport(str(path))
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open {path}: {exc}", field="store") from exc
    db.row_factory = sqlite3.Row
    db.text_factory = text_or_bytes  # a non-UTF-8 row is reported, not a failed query
    try:
        _sqlite_checks(db, report)
        if report.ok or all(p.startswith("foreign key") for p in report.problems):
            _row_checks(db, report)
    except sqlite3.Error as exc:
        report.problems.append(f"sqlite: {exc}")
    finally:
        db.close()
    return report


def _sqlite_checks(db: sqlite3.Connection, report: CheckReport) -> None:
    result = [r[0] for r in db.execute("PRAGMA integrity_check")]
    if result != ["ok"]:
        report.problems.extend(f"integrity: {line}" for line in result[:50])
        return
    for r in db.execute("PRAGMA foreign_key_check"):
        report.problems.append(
            f"foreign key: a row of {r[0]} (rowid {r[1]}) names a missing row of {r[2]}"
        )


def _row_checks(db: sqlite3.Connection, report: CheckReport) -> None:
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    missing = {"meta", "nodes", "deployments", "plans", "acks", "load_windows"} - tables
    if missing:
        report.problems.append(f"not a mixfleet store: no table {', '.join(sorted(missing))}")
        return
    ident = db.execute("SELECT value FROM meta WHERE key = 'controller_id'").fetchone()
    if ident is None:
        report.problems.append("meta: no store identity (controller_id)")
    else:
        report.store_id = str(ident[0])
    split = db.execute("SELECT value FROM meta WHERE key = 'split'").fetchone()
    if split is not None:
        report.problems.append(_split_problem(str(split[0])))
    for table in ("nodes", "deployments", "plans", "acks", "load_windows"):
        report.counts[table] = int(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
    for r in db.execute("SELECT * FROM nodes"):
        _decode(report, f"node {r['name']}", partial(node_from_row, r))
    deployments = list(db.execute("SELECT * FROM deployments"))
    for r in deployments:
        _decode(report, f"deployment {r['name']}", partial(deployment_from_row, r))
    _plan_checks(db, deployments, report)
    for r in db.execute("SELECT id, deployment, counts_json FROM load_windows"):
        _decode(report, f"load window {r['id']} of {r['deployment']}", partial(_counts, r))


def _plan_checks(
    db: sqlite3.Connection, deployments: list[sqlite3.Row], report: CheckReport
) -> None:
    by_name = {str(r["name"]): r for r in deployments}
    committed: dict[str, list[int]] = {}
    for r in db.execute("SELECT * FROM plans ORDER BY deployment, version"):
        name, version = str(r["deployment"]), int(r["version"])
        what = f"plan {name} v{version}"
        p = _decode(report, what, partial(plan_from_row, r, with_plan=True))
        if p is not None and p.plan is not None and p.plan.version != version:
            report.problems.append(f"{what}: its document says version {p.plan.version}")
        d = by_name.get(name)
        if d is None:
            continue
        if version >= int(d["next_version"]):
            report.problems.append(
                f"{what}: at or above the deployment's next version {d['next_version']}"
            )
        if r["state"] == "committed":
            committed.setdefault(name, []).append(version)
        if d["deleted_at"] is not None and r["state"] in ("committed", "preparing", "proposed"):
            report.problems.append(f"{what}: {r['state']} although the deployment is deleted")
    for name, d in by_name.items():
        versions = committed.get(name, [])
        pointer = d["committed_version"]
        if len(versions) > 1:
            report.problems.append(f"deployment {name}: {len(versions)} committed versions")
        if pointer is not None and versions != [pointer]:
            report.problems.append(
                f"deployment {name}: the committed pointer names v{pointer}, committed "
                f"versions are {versions or 'none'}"
            )
        if pointer is None and versions:
            report.problems.append(f"deployment {name}: v{versions[0]} committed, no pointer")


def _split_problem(text: str) -> str:
    """The ``meta.split`` record (two writers found, :mod:`.guard`) as a problem line."""
    try:
        doc = json.loads(text)
        writers = [holder_from_json(json.dumps(w)) for w in doc["writers"]]
        who = " and ".join(w.describe() for w in writers if w is not None)
    except (ValueError, KeyError, TypeError):
        who = "(the record does not decode)"
    return (
        f"two controllers wrote this store: {who}; the agents may hold plans of either. To "
        "fix: stop every controller of this store but one, check the plans it serves "
        "(`mixfleetctl plans history`), then restart it once with --store-new to clear this note"
    )


def _decode(report: CheckReport, what: str, fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except DECODE_ERRORS as exc:
        report.problems.append(f"{what}: does not decode ({type(exc).__name__}: {exc})"[:300])
        return None


def _counts(r: sqlite3.Row) -> int:
    rows = json.loads(r["counts_json"])
    return sum(len([float(x) for x in row]) for row in rows)


def backup_store(path: Path, target: Path) -> None:
    """Copy the store at ``path`` to ``target`` (a new file, 0600) with SQLite's online
    backup; consistent even while a controller writes.

    Raises:
        StoreError: the source is refused or the target exists or cannot be written.
    """
    check_file(path, new=False)
    if target.exists():
        raise StoreError(
            f"{target} exists. To fix: give a new file name for the backup", field="target"
        )
    try:
        src = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch(mode=FILE_MODE)
        dst = sqlite3.connect(str(target))
        try:
            src.backup(dst)
        finally:
            dst.close()
            src.close()
    except (sqlite3.Error, OSError) as exc:
        raise StoreError(f"cannot back up {path} to {target}: {exc}", field="target") from exc
