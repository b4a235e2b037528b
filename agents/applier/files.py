"""Crash-safe file primitives: every write is fsynced before it counts, and a file or a
symlink is replaced with one atomic ``rename(2)``, so a crash leaves the old or the new
content, never a torn one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (renames, creations) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Create ``path`` (which must not exist) with ``data``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` so readers see the old or the new content, never a
    part: write a temporary file in the same directory, fsync it, rename it over ``path``,
    fsync the directory. The temporary file is removed if any step fails."""
    tmp = path.parent / f".tmp-{path.name}-{secrets.token_hex(4)}"
    try:
        write_file(tmp, data, fsync=fsync)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_symlink(link: Path, target: str, *, fsync: bool = True) -> None:
    """Point ``link`` at ``target`` with one rename (a new symlink renamed over the old)."""
    tmp = link.parent / f".tmp-{link.name}-{secrets.token_hex(4)}"
    try:
        os.symlink(target, tmp)
        os.replace(tmp, link)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if fsync:
        fsync_dir(link.parent)
