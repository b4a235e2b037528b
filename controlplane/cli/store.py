"""``mixfleetctl store check|backup``: the controller's SQLite store, read directly.

``check`` opens the file read-only (safe beside a running controller) and runs SQLite's
``PRAGMA integrity_check`` and ``foreign_key_check`` plus mixfleet's own row checks (every
row decodes, one committed version per deployment and the pointer names it, versions below
the next version); exit 0 when whole, 1 with one line per problem. ``backup FILE`` writes a
consistent copy with SQLite's online backup (what the ``sqlite3`` shell's ``.backup`` does),
also while a controller runs; restore by putting the copy in place with the controller
stopped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from controlplane.cli.output import Groups, add_group, add_leaf, add_output_arg, emit_document
from policies.errors import InputError


def _sqlite_path(url: str) -> Path:
    """The file of a ``sqlite:PATH`` store URL.

    Raises:
        InputError: another kind of store.
    """
    scheme, _, rest = url.partition(":")
    if scheme != "sqlite" or not rest:
        raise InputError(
            f"{url!r} is not a SQLite store. To fix: give --store sqlite:PATH", field="--store"
        )
    return Path(rest[2:] if rest.startswith("//") else rest)


def cmd_store_check(args: argparse.Namespace) -> int:
    from controlplane.store.sqlite.check import check_store

    report = check_store(_sqlite_path(args.store))
    if args.output != "table":
        doc = {
            "path": report.path,
            "store_id": report.store_id,
            "ok": report.ok,
            "rows": report.counts,
            "problems": report.problems,
        }
        emit_document(doc, args.output, [f"store/{report.store_id or report.path}"])
        return 0 if report.ok else 1
    rows = ", ".join(f"{n} {t}" for t, n in report.counts.items())
    print(f"store {report.store_id or '?'} at {report.path}: {rows or 'no rows read'}")
    for line in report.problems:
        print(f"problem: {line}")
    print("ok" if report.ok else f"{len(report.problems)} problem(s)")
    return 0 if report.ok else 1


def cmd_store_backup(args: argparse.Namespace) -> int:
    from controlplane.store.sqlite.check import backup_store

    backup_store(_sqlite_path(args.store), Path(args.file))
    if args.output == "table":
        print(f"backed up {args.store} to {args.file}")
    else:
        doc = {"store": args.store, "backup": args.file}
        emit_document(doc, args.output, [f"backup/{args.file}"])
    return 0


def register(groups: Groups) -> None:
    """Add the ``store`` group."""
    store = add_group(groups, "store", "check or back up the controller's SQLite store")
    for name, handler, help_text in (
        ("check", cmd_store_check, "integrity check: SQLite's and mixfleet's row checks"),
        ("backup", cmd_store_backup, "write a consistent copy (online backup)"),
    ):
        p = add_leaf(store, name, handler, help_text)
        p.add_argument(
            "--store",
            metavar="URL",
            default="sqlite:mixfleet-state.db",
            help="the store, sqlite:PATH (default %(default)s)",
        )
        if name == "backup":
            p.add_argument("file", metavar="FILE", help="the copy to write (must not exist)")
        add_output_arg(p)
