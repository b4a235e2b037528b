"""The SQLite store (:class:`SqliteStore`, in :mod:`.store`): one file, WAL mode, versioned
schema (:mod:`.schema`); :mod:`.rows` turns its rows into records."""

from controlplane.store.sqlite.schema import MIGRATIONS, SCHEMA_VERSION
from controlplane.store.sqlite.store import SqliteStore

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "SqliteStore"]
