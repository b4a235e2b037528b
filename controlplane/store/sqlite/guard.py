"""What keeps one SQLite store safe to open: one writer at a time, and the right file.

* **One writer.** A controller holds an exclusive ``fcntl.flock`` on ``PATH.lock`` (beside
  the database) for as long as its store is open; a second controller on the same file is
  refused at start with the holder's pid, host and start time, read from the holder record
  the lock file carries. The kernel drops the lock when the holder dies (also on kill -9),
  so a crashed controller never blocks its successor. The lock file is created 0600 and its
  descriptor is not inherited by child processes.
* **The right file.** Every store has an identity (``meta.controller_id``, made when the
  store is created); the holder record remembers the identity the last writer used. A
  missing or empty (0-byte) file, a file that is not a mixfleet store, or a file whose
  identity differs from the one last used here (replaced, restored from another store) is
  refused unless the caller says the store is new (``mixfleetctl controller run
  --store-new``): starting a fresh store silently would make every running deployment look
  deleted.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

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
    """

    pid: int
    host: str
    started_at_s: float
    store_id: str = ""

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
        doc = json.loads(path.read_text(encoding="utf-8") or "null")
        return Holder(
            int(doc["pid"]), str(doc["host"]), float(doc["started_at_s"]), str(doc["store_id"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


class WriterLock:
    """The exclusive lock one writer holds on a store (see the module docstring).

    Args:
        db_path: the database file.
    """

    def __init__(self, db_path: Path) -> None:
        self.path = lock_path(db_path)
        self._file: IO[str] | None = None
        #: The record the previous writer left (None for the first writer).
        self.previous: Holder | None = None

    def acquire(self) -> None:
        """Take the lock, or refuse.

        Raises:
            StoreError: another process holds it (the message names the holder), or the
            lock file cannot be made.
        """
        if fcntl is None:  # pragma: no cover - not POSIX
            raise StoreError("the SQLite store needs a POSIX system (fcntl)", field="store")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            raise StoreError(
                f"cannot create the lock file {self.path}: {exc.strerror or exc}. To fix: "
                "check the directory's permissions",
                field="store",
            ) from exc
        f = os.fdopen(fd, "r+", encoding="utf-8")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            f.close()
            holder = read_holder(self.path)
            who = holder.describe() if holder is not None else "another process"
            raise StoreError(
                f"the store {self.path.with_suffix('')} is in use by the controller {who}. "
                "Only one controller may write a store. To fix: stop that controller first, "
                "or give this one another --store",
                field="store",
            ) from exc
        self.previous = read_holder(self.path)
        self._file = f
        self.record("")

    def record(self, store_id: str) -> None:
        """Write this process's holder record (with the store identity it opened)."""
        f = self._file
        if f is None:
            return
        doc = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at_s": time.time(),
            "store_id": store_id,
        }
        f.seek(0)
        f.truncate()
        f.write(json.dumps(doc, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())

    def release(self) -> None:
        """Drop the lock (idempotent); the holder record stays for the next writer."""
        f, self._file = self._file, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()


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
