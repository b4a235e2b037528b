"""Informers: caches of one resource kept up to date by list + watch, and which GPUNode
changes matter to placement.

An :class:`Informer` lists its resource, then watches from the list's resourceVersion,
calling ``on_event(type, old, new)`` for every ADDED / MODIFIED / DELETED it sees. A watch
whose resourceVersion is too old (410 Gone) or that fails ends in a fresh list, whose
differences from the cache are reported as events too, so no change is lost.
:mod:`operators.operator` turns the events into deployment keys on its work queue.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

from apis.kube.client import Json, Kube, Resource
from apis.kube.errors import ApiError, CrdMissingError, GoneError, OperatorError

#: Retry period while the resource is not served (its CRD not installed), s: one error line
#: every few seconds, not every retry.
CRD_MISSING_RETRY_S = 10.0

Key = tuple[str, str]
"""An object key: (namespace, name); the namespace is empty for cluster-scoped objects."""


def key_of(obj: Json) -> Key:
    """The (namespace, name) key of an object."""
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class Informer:
    """Keeps a cache of one resource up to date with list + watch.

    Args:
        kube: API access.
        res: the resource.
        namespace: one namespace, or None for all (cluster-scoped: None).
        label_selector: only objects matching it.
        on_event: ``(type, old, new)`` for ADDED / MODIFIED / DELETED (old or new None).
        watch_timeout_s: server-side watch timeout, seconds.
        retry_delay_s: wait after an error before listing again, seconds.
    """

    def __init__(
        self,
        kube: Kube,
        res: Resource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        on_event: Callable[[str, Json | None, Json | None], None] = lambda t, o, n: None,
        watch_timeout_s: int = 300,
        retry_delay_s: float = 1.0,
    ) -> None:
        self.kube = kube
        self.res = res
        self.namespace = namespace
        self.label_selector = label_selector
        self.on_event = on_event
        self.watch_timeout_s = watch_timeout_s
        self.retry_delay_s = retry_delay_s
        self.synced = threading.Event()
        self._cache: dict[Key, Json] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.log = structlog.get_logger("mixfleet.operator").bind(resource=res.plural)
        #: lists done (1 + re-lists after errors or 410 Gone).
        self.lists = 0

    def items(self) -> list[Json]:
        """A snapshot of the cached objects."""
        with self._lock:
            return list(self._cache.values())

    def get(self, key: Key) -> Json | None:
        """The cached object with this key, or None."""
        with self._lock:
            return self._cache.get(key)

    def _relist(self) -> str:
        items, rv = self.kube.list(self.res, self.namespace, label_selector=self.label_selector)
        self.lists += 1
        fresh = {key_of(o): o for o in items}
        with self._lock:
            old = self._cache
            self._cache = fresh
        for k, obj in fresh.items():
            prev = old.get(k)
            if prev is None:
                self.on_event("ADDED", None, obj)
            elif prev.get("metadata", {}).get("resourceVersion") != obj["metadata"].get(
                "resourceVersion"
            ):
                self.on_event("MODIFIED", prev, obj)
        for k, prev in old.items():
            if k not in fresh:
                self.on_event("DELETED", prev, None)
        self.synced.set()
        return rv

    def run(self) -> None:
        """List, then watch from the list's resourceVersion; re-list on 410 or errors."""
        rv = ""
        while not self._stop.is_set():
            try:
                if not rv:
                    rv = self._relist()
                for ev in self.kube.watch(
                    self.res,
                    rv,
                    self.namespace,
                    label_selector=self.label_selector,
                    timeout_s=self.watch_timeout_s,
                    stop=self._stop,
                ):
                    if self._stop.is_set():
                        return
                    rv = ev.resource_version or rv
                    if ev.type == "BOOKMARK":
                        continue
                    k = key_of(ev.object)
                    with self._lock:
                        prev = self._cache.get(k)
                        if ev.type == "DELETED":
                            self._cache.pop(k, None)
                        else:
                            self._cache[k] = ev.object
                    if ev.type == "DELETED":
                        self.on_event("DELETED", prev, None)
                    else:
                        self.on_event(ev.type if prev is None else "MODIFIED", prev, ev.object)
            except GoneError:
                self.log.info("watch expired; listing again")
                rv = ""
            except CrdMissingError as exc:  # names the CRDs and how to install them
                self.log.error("resource not served; retrying", error=str(exc))
                rv = ""
                self._stop.wait(max(self.retry_delay_s, CRD_MISSING_RETRY_S))
            except (ApiError, OperatorError) as exc:
                self.log.warning("watch failed; listing again", error=str(exc))
                rv = ""
                self._stop.wait(self.retry_delay_s)
            except Exception as exc:  # loop boundary: keep the informer alive
                self.log.error("informer error", error=repr(exc))
                rv = ""
                self._stop.wait(self.retry_delay_s)

    def start(self) -> None:
        """Run :meth:`run` in a daemon thread."""
        self._thread = threading.Thread(
            target=self.run, name=f"informer-{self.res.plural}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end; the watch in progress is given the same stop event."""
        self._stop.set()

    def alive(self) -> bool:
        """The thread was started and is still running."""
        return self._thread is not None and self._thread.is_alive()


_PLACEMENT_IGNORED_STATUS = ("lastHeartbeatTime",)


def placement_relevant(obj: Json | None) -> Any:
    """The parts of a GPUNode that placement reads (heartbeat time excluded)."""
    if obj is None:
        return None
    meta = obj.get("metadata") or {}
    status = {
        k: v for k, v in (obj.get("status") or {}).items() if k not in _PLACEMENT_IGNORED_STATUS
    }
    return (
        meta.get("labels"),
        meta.get("deletionTimestamp"),
        obj.get("spec"),
        status,
    )
