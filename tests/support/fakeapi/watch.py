"""Watches of the fake API server: the events after a resourceVersion (or a synthetic
``ADDED`` of everything first), label selection with objects entering and leaving it,
``timeoutSeconds``, bookmarks and ``410 Gone`` after compaction."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from support.fakeapi.errors import Json, status_event
from support.fakeapi.resources import ResourceType
from support.fakeapi.selectors import parse_selector

if TYPE_CHECKING:
    from support.fakeapi.server import FakeApiServer


def watch_events(
    api: FakeApiServer,
    rt: ResourceType,
    ns: str,
    query: Mapping[str, str],
    alive: Callable[[], bool],
) -> Iterator[Json]:
    """Watch events as dictionaries (``{"type", "object"}``), until timeout or stop."""
    sel = parse_selector(query.get("labelSelector", ""))
    timeout_s = float(query.get("timeoutSeconds") or 1800)
    bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
    rv_param = query.get("resourceVersion", "")
    deadline = time.monotonic() + timeout_s
    tk = api._type_key(rt)

    matches = _matcher(ns, sel)

    with api._lock:
        if rv_param in ("", "0"):
            last = api._rv
            initial = [
                api._render(st)
                for (t, _, _), st in sorted(api._objects.items())
                if t == tk and matches(st.obj)
            ]
        else:
            try:
                last = int(rv_param)
            except ValueError:
                yield status_event(400, "BadRequest", f"invalid resourceVersion {rv_param!r}")
                return
            initial = []
            if last < api._compacted_rv:
                yield status_event(
                    410, "Expired", f"too old resource version: {last} ({api._compacted_rv})"
                )
                return
    for obj in initial:
        yield {"type": "ADDED", "object": obj}
    while alive():
        with api._lock:
            pending = [e for e in api._events if e.rv > last]
            if not pending:
                left = deadline - time.monotonic()
                if left <= 0 or api._closing:
                    break
                api._lock.wait(min(left, 0.5))
                continue
            if last < api._compacted_rv:
                yield status_event(410, "Expired", "too old resource version")
                return
        for e in pending:
            last = e.rv
            if e.rt is not rt and api._type_key(e.rt) != tk:
                continue
            new_ok = e.type != "DELETED" and matches(e.obj)
            old_ok = (
                matches(e.old) if e.type == "MODIFIED" else (e.type == "DELETED" and matches(e.obj))
            )
            if e.type == "DELETED":
                if old_ok:
                    yield {"type": "DELETED", "object": e.obj}
            elif new_ok and (e.type == "ADDED" or old_ok):
                yield {"type": e.type, "object": e.obj}
            elif new_ok:
                yield {"type": "ADDED", "object": e.obj}
            elif old_ok:
                yield {"type": "DELETED", "object": e.obj}
    if bookmarks:
        yield {
            "type": "BOOKMARK",
            "object": {
                "apiVersion": rt.api_version,
                "kind": rt.kind,
                "metadata": {"resourceVersion": str(last)},
            },
        }


def _matcher(ns: str, sel: Callable[[Mapping[str, str]], bool]) -> Callable[[Json | None], bool]:
    """Whether an object is in the watch's namespace (all when "") and label selection."""

    def matches(o: Json | None) -> bool:
        if o is None:
            return False
        return (not ns or o["metadata"].get("namespace", "") == ns) and sel(
            o["metadata"].get("labels") or {}
        )

    return matches
