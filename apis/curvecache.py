"""The on-disk store of the fleet planner's step curves
(:class:`policies.fleetplan.curves.CurveCache`), kept across runs and restarts: the
``mixfleetctl`` commands, the standalone controller (``--curve-cache``) and the Kubernetes
operator (``mixfleet-operator run --curve-cache``) all read and write it through
:func:`open_curve_cache`.

One JSON file per curve key (``<dir>/<key[:2]>/<key>.json``), written to a temporary file in
the same directory and renamed into place, so a reader never sees half a file and two
writers of one key leave one whole file. A file that does not parse, or holds a curve of
another :data:`~policies.fleetplan.curves.CURVE_VERSION`, is treated as absent (and
rewritten). The default directory is ``$MIXFLEET_CURVE_CACHE``, else
``$XDG_CACHE_HOME/mixfleet/curves``, else ``~/.cache/mixfleet/curves``.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from policies.errors import InputError
from policies.fleetplan.curves import CurveCache, CurveEntry, MemoryCurveCache

ENV_VAR = "MIXFLEET_CURVE_CACHE"
"""Environment variable naming the curve cache directory."""


def default_dir() -> Path:
    """The curve cache directory when none is given (see the module docstring)."""
    given = os.environ.get(ENV_VAR)
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mixfleet" / "curves"


@dataclass
class FileCurveCache:
    """Curves under ``directory`` (created on the first write).

    Attributes:
        directory: where the files are.
        hits: entries read from disk.
        writes: entries written.
    """

    directory: Path
    hits: int = 0
    writes: int = 0

    def _path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise InputError(f"not a curve key: {key!r}", field="key")
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> CurveEntry | None:
        """The entry of ``key``, or None when absent, unreadable or of another version."""
        path = self._path(key)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            entry = CurveEntry.from_doc(doc, str(path.name))
        except (OSError, ValueError, InputError):
            return None
        self.hits += 1
        return entry

    def put(self, key: str, entry: CurveEntry) -> None:
        """Write ``entry`` under ``key`` (atomically: temporary file, then rename)."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".curve-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(entry.to_doc(), f, separators=(",", ":"))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.writes += 1


def open_curve_cache(directory: str) -> CurveCache:
    """The step curves under ``directory`` (a :class:`FileCurveCache`), in memory when it
    is "" (a restart then recomputes every curve)."""
    if not directory:
        return MemoryCurveCache()
    return FileCurveCache(Path(directory).expanduser())


__all__ = ["ENV_VAR", "FileCurveCache", "default_dir", "open_curve_cache"]
