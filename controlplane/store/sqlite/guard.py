"""What keeps one SQLite store safe to open: one writer at a time, and the right file.

* **One writer.** A controller holds an exclusive ``fcntl.flock`` on the database file
  itself (its resolved path: a symlink, a hard link or a symlinked directory names the same
  file, and there is no separate lock file to delete) for as long as its store is open; a
  second controller on the same file is refused at start with the holder's pid, host and
  start time. The kernel drops the lock when the holder dies (also on kill -9), so a crashed
  controller never blocks its successor. Two stores of one process on one file are refused
  the same way (a per-process table of held files: opening and closing a second descriptor
  of the file would drop SQLite's own locks). The descriptor is not inherited by child
  processes.
* **Fencing.** Where a lock does not hold (a network file system without lock support), the
  holder record in the database (``meta.writer``: pid, host, start time and a random token)
  catches a second writer: every write transaction checks that the record is still its own;
  a writer that finds another's stops writing and records the split (``meta.split``), which
  ``mixfleetctl store check`` reports.
* **The right file.** Every store has an identity (``meta.controller_id``, made when the
  store is created); the holder record in ``PATH.lock`` beside the database remembers the
  identity the last writer used. A missing or empty (0-byte) file, a file that is not a
  mixfleet store, or a file whose identity differs from the one last used here (replaced,
  restored from another store) is refused unless the caller says the store is new
  (``mixfleetctl controller run --store-new``): starting a fresh store silently would make
  every running deployment look deleted.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sqlite3
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from controlplane.errors import StoreError

try:  # POSIX only; the store refuses to open for writing without it
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

#: Mode of files the store creates (the database, its lock file): owner read/write only.
FILE_MODE = 0o600


@dataclass(frozen=True)
class Holder:
    """The writer of a store, as its lock file records it.

    Attributes:
        pid: process id.
        host: host name.
        started_at_s: when it took the lock, Unix s.
        store_id: the identity of the store it opened ("" before it read it).
        token: random, one per opening (``meta.writer``; "" in the ``PATH.lock`` record).
    """

    pid: int
    host: str
    started_at_s: float
    store_id: str = ""
    token: str = ""

    def describe(self) -> str:
        """``pid 1234 on host-a since 2026-12-01T10:00:00Z``."""
        when = datetime.datetime.fromtimestamp(self.started_at_s, datetime.UTC)
        return f"pid {self.pid} on {self.host} since {when.strftime('%Y-%m-%dT%H:%M:%SZ')}"


def lock_path(db_path: Path) -> Path:
    """The lock file of a database: ``PATH.lock`` beside it."""
    return db_path.with_name(db_path.name + ".lock")


def read_holder(path: Path) -> Holder | None:
    """The holder record in a lock file (None when absent or unreadable)."""
    try:
        return holder_from_json(path.read_text(encoding="utf-8"))
    except OSError:
        return None


def holder_from_json(text: str) -> Holder | None:
    """A holder record from its JSON (None when it is not one)."""
    try:
        doc = json.loads(text or "null")
        return Holder(
            int(doc["pid"]),
            str(doc["host"]),
            float(doc["started_at_s"]),
            str(doc.get("store_id", "")),
            str(doc.get("token", "")),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def holder_json(h: Holder) -> str:
    """The JSON of a holder record (``PATH.lock``, ``meta.writer``)."""
    return json.dumps(
        {
            "pid": h.pid,
            "host": h.host,
            "started_at_s": h.started_at_s,
            "store_id": h.store_id,
            "token": h.token,
        },
        sort_keys=True,
    )


def read_writer(db_path: Path) -> Holder | None:
    """The holder record in the database (``meta.writer``), read without a lock (None when
    absent or unreadable)."""
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=1.0)
        try:
            row = db.execute("SELECT value FROM meta WHERE key = 'writer'").fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return None
    return holder_from_json(str(row[0])) if row else None


def this_writer() -> Holder:
    """A new holder record of this process (a fresh token)."""
    return Holder(os.getpid(), socket.gethostname(), time.time(), token=uuid.uuid4().hex)


#: The database files (device, inode) this process holds for writing, with their holders.
_HELD: dict[tuple[int, int], Holder] = {}


class WriterLock:
    """The exclusive lock one writer holds on a store (see the module docstring).

    Args:
        db_path: the database file (resolved: no symlink in it); it must exist.
    """

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        self.path = lock_path(db_path)
        #: This writer's holder record (``meta.writer`` once the store is open).
        self.holder = this_writer()
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None
        #: The record the previous writer left in ``PATH.lock`` (None for the first writer).
        self.previous: Holder | None = None

    def acquire(self) -> None:
        """Take the lock, or refuse.

        Raises:
            StoreError: another process (or another store of this one) holds it - the
            message names the holder - or the file cannot be opened.
        """
        if fcntl is None:  # pragma: no cover - not POSIX
            raise StoreError("the SQLite store needs a POSIX system (fcntl)", field="store")
        try:
            st = os.stat(self.db_path)
            key = (st.st_dev, st.st_ino)
            if key in _HELD:  # never open a second descriptor: closing it drops SQLite's locks
                self._refuse(_HELD[key], None)
            fd = os.open(self.db_path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise StoreError(
                f"cannot open the store file {self.db_path}: {exc.strerror or exc}. To fix: "
                "check the file's and its directory's permissions",
                field="store",
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            # Through another hard link SQLite reads another write-ahead log: a stale record.
            holder = read_writer(self.db_path) if st.st_nlink == 1 else None
            self._refuse(holder or read_holder(self.path), exc)
        if st.st_nlink > 1:
            os.close(fd)
            raise StoreError(
                f"the store file {self.db_path} has {st.st_nlink} hard links: SQLite names its "
                "write-ahead log after the path, so writers through two names corrupt the "
                "store. To fix: remove the other links and use one name",
                field="store",
            )
        self._fd, self._key = fd, key
        _HELD[key] = self.holder
        self.previous = read_holder(self.path)
        self.record("")

    def _refuse(self, holder: Holder | None, cause: OSError | None) -> None:
        who = holder.describe() if holder is not None else "another process"
        raise StoreError(
            f"the store {self.db_path} is in use by the controller {who}. "
            "Only one controller may write a store. To fix: stop that controller first, "
            "or give this one another --store",
            field="store",
        ) from cause

    def record(self, store_id: str) -> None:
        """Write this process's holder record (with the store identity it opened) to
        ``PATH.lock``, where the next writer reads the identity last used here."""
        if self._fd is None:
            return
        doc = replace(self.holder, store_id=store_id, token="")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(holder_json(doc) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise StoreError(
                f"cannot write the holder record {self.path}: {exc.strerror or exc}. To fix: "
                "check the directory's permissions",
                field="store",
            ) from exc

    def release(self) -> None:
        """Drop the lock (idempotent; after the database is closed); the holder record in
        ``PATH.lock`` stays for the next writer."""
        fd, self._fd = self._fd, None
        if self._key is not None and _HELD.get(self._key) is self.holder:
            del _HELD[self._key]
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def check_file(path: Path, *, new: bool | None) -> bool:
    """Check that ``path`` may be opened as a store; returns True when it must be created.

    Args:
        new: True = the caller says the store is new (create it when missing or empty);
            False = it must already hold a store; None = create when missing or empty
            (tests, the in-process harness).

    Raises:
        StoreError: missing or empty and not ``new``.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        size = -1
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror or exc}", field="store") from exc
    if size > 0:
        return False
    if new is False:
        what = "does not exist" if size < 0 else "is empty (0 bytes)"
        raise StoreError(
            f"the store file {path} {what}. Starting a new store would make every running "
            "deployment look deleted. To fix: check --store (a typo?) or restore the file from "
            "a backup; pass --store-new only when this really is a new store",
            field="store",
        )
    return True


def check_identity(path: Path, store_id: str, previous: Holder | None, *, new: bool | None) -> None:
    """Refuse a store whose identity differs from the one last used at ``path``.

    Raises:
        StoreError: the file was replaced by another store and the caller did not say so.
    """
    if new or previous is None or not previous.store_id or previous.store_id == store_id:
        return
    raise StoreError(
        f"the store file {path} holds store {store_id}, but the controller {previous.describe()} "
        f"used store {previous.store_id} here: the file was replaced. To fix: put the right file "
        "back (or restore it from a backup); pass --store-new to adopt this store as it is",
        field="store",
    )


def create_private(path: Path) -> None:
    """Create an empty database file readable by its owner only (0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    os.close(fd)
