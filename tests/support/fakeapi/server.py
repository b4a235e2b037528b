"""The fake API server's state and verbs: stored objects with their field managers, the
watch history, and get / list / create / update / patch / apply / delete / watch as
kube-apiserver answers them. HTTP is in :mod:`support.fakeapi.handler`."""

from __future__ import annotations

import copy
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import ThreadingHTTPServer
from typing import Any

from support.fakeapi.admission import admit_object
from support.fakeapi.errors import ApiStatusError, Json
from support.fakeapi.fields import Path, fields_v1, object_fields
from support.fakeapi.handler import ApiHandler
from support.fakeapi.ownership import (
    applied_configuration,
    check_apply_request,
    claim_fields,
    drop_unapplied,
    merge_configuration,
    update_managers,
)
from support.fakeapi.patches import json_merge_patch, json_patch
from support.fakeapi.records import Fault, RequestRecord
from support.fakeapi.resources import BUILTINS, CRD_TYPE, ResourceType, resource_from_crd
from support.fakeapi.routing import route
from support.fakeapi.selectors import field_match, parse_selector
from support.fakeapi.watch import watch_events
from support.structural import Cause


@dataclass
class _Event:
    """One entry of the watch history: the object after the write (and before it, for
    MODIFIED), at resourceVersion ``rv``."""

    rv: int
    rt: ResourceType
    type: str
    obj: Json
    old: Json | None


@dataclass
class _Stored:
    """A stored object, the fields each of its managers owns and when each last wrote."""

    obj: Json
    managers: dict[tuple[str, str, str], set[Path]] = field(default_factory=dict)
    times: dict[tuple[str, str, str], str] = field(default_factory=dict)


class FakeApiServer:
    """In-process API server; see :mod:`support.fakeapi` for what it implements.

    Args:
        crds: CustomResourceDefinition manifests to serve.
        history_limit: watch events kept; older resourceVersions get 410 Gone.
        clock: wall clock for timestamps.
    """

    def __init__(
        self,
        crds: Sequence[Mapping[str, Any]],
        *,
        history_limit: int = 10_000,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        for rt in (*BUILTINS, CRD_TYPE, *(resource_from_crd(c) for c in crds)):
            self.types[(rt.group, rt.version, rt.plural)] = rt
        self.history_limit = history_limit
        self.clock = clock
        self._lock = threading.Condition(threading.RLock())
        self._objects: dict[tuple[str, str, str], _Stored] = {}
        self._pending_crds: set[str] = set()
        self._rv = 1
        self._events: list[_Event] = []
        self._compacted_rv = 0
        self.requests: list[RequestRecord] = []
        self.faults: list[Fault] = []
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._closing = False

    # ---------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        assert self._httpd is not None
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve in a background thread; returns the base URL."""
        server = self

        class Handler(ApiHandler):
            api = server

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="fakeapi", daemon=True
        )
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop serving; open watches end."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    # ----------------------------------------------------------------- helpers for tests

    def inject(self, fault: Fault) -> None:
        """Fail requests matching ``fault``."""
        with self._lock:
            self.faults.append(fault)

    def compact(self) -> int:
        """Drop the watch history, as etcd compaction after other writes would: the version
        moves on, and a watch that resumes from any version before it gets 410 Gone (a
        fresh list returns the new version, from which watching works again). Returns the
        compacted version."""
        with self._lock:
            self._rv += 1
            self._events.clear()
            self._compacted_rv = self._rv
            return self._rv

    @property
    def resource_version(self) -> int:
        return self._rv

    def writes(self, *, user_agent: str | None = None) -> list[RequestRecord]:
        """Successful writes (POST, PUT, PATCH, DELETE), optionally of one user agent."""
        return [
            r
            for r in list(self.requests)
            if r.method != "GET"
            and 200 <= r.status < 300
            and (user_agent is None or r.user_agent.startswith(user_agent))
        ]

    def get_object(self, plural: str, name: str, namespace: str = "") -> Json | None:
        """Direct read of the stored object (a copy), bypassing HTTP."""
        with self._lock:
            for (ptype, ns, n), st in self._objects.items():
                if ptype.endswith("/" + plural) and n == name and ns == namespace:
                    return self._render(st)
        return None

    def put_raw(self, plural: str, obj: Json) -> None:
        """Store ``obj`` as it is, without admission: what an older version of a CRD let
        in, for tests of readers that meet an object that no longer parses."""
        rt = next(t for t in self.types.values() if t.plural == plural)
        meta = obj["metadata"]
        with self._lock:
            key = self._okey(rt, str(meta.get("namespace") or ""), str(meta["name"]))
            new = copy.deepcopy(obj)
            new["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=self._now())
            self._commit(rt, key, new, None)

    # -------------------------------------------------------------------- internals

    def _type_key(self, rt: ResourceType) -> str:
        return f"{rt.group}/{rt.version}/{rt.plural}"

    def _okey(self, rt: ResourceType, ns: str, name: str) -> tuple[str, str, str]:
        return (self._type_key(rt), ns if rt.namespaced else "", name)

    def _now(self) -> str:
        return self.clock().astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def _render(self, st: _Stored) -> Json:
        obj = copy.deepcopy(st.obj)
        entries = []
        for (manager, operation, sub), paths in sorted(st.managers.items()):
            if not paths:
                continue
            e: Json = {
                "manager": manager,
                "operation": operation,
                "apiVersion": obj.get("apiVersion", ""),
                "time": st.times.get((manager, operation, sub))
                or obj["metadata"].get("creationTimestamp"),
                "fieldsType": "FieldsV1",
                "fieldsV1": fields_v1(paths),
            }
            if sub:
                e["subresource"] = sub
            entries.append(e)
        if entries:
            obj["metadata"]["managedFields"] = entries
        return obj

    def _emit(self, rt: ResourceType, type_: str, obj: Json, old: Json | None) -> None:
        self._events.append(_Event(self._rv, rt, type_, obj, old))
        if len(self._events) > self.history_limit:
            drop = len(self._events) - self.history_limit
            self._compacted_rv = self._events[drop - 1].rv
            del self._events[:drop]
        self._lock.notify_all()

    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _commit(
        self, rt: ResourceType, key: tuple[str, str, str], new: Json, old: Json | None
    ) -> Json:
        """Store a new version of an object (generation, resourceVersion, events)."""
        meta = new["metadata"]
        if rt.custom:
            if old is None:
                meta["generation"] = 1
            else:
                skip = ("apiVersion", "kind", "metadata", "status")
                before = {k: v for k, v in old.items() if k not in skip}
                after = {k: v for k, v in new.items() if k not in skip}
                meta["generation"] = int(old["metadata"].get("generation", 1)) + (before != after)
        new["apiVersion"] = rt.api_version
        new["kind"] = rt.kind
        if old is not None and new == old:
            return new  # no-op write: same resourceVersion, no event
        meta["resourceVersion"] = self._bump()
        st = self._objects.get(key)
        if st is None:
            st = _Stored(new)
            self._objects[key] = st
        else:
            st.obj = new
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self._remove(rt, key)
        if rt is CRD_TYPE and old is None:
            self._serve_crd(new)
        self._emit(rt, "ADDED" if old is None else "MODIFIED", self._render(st), old)
        return new

    def _serve_crd(self, crd: Json) -> None:
        """A new CRD: its resource is served from now on, and its status is what
        kube-apiserver stores first - ``conditions: null``, no accepted names yet - until a
        read has seen it (:meth:`_establish`; the real establishing controller takes a
        moment after the create returns)."""
        crd["status"] = {
            "conditions": None,
            "acceptedNames": {"kind": "", "plural": ""},
            "storedVersions": [v["name"] for v in crd["spec"]["versions"] if v.get("storage")],
        }
        self._pending_crds.add(str(crd["metadata"]["name"]))
        rt = resource_from_crd(crd)
        self.types[(rt.group, rt.version, rt.plural)] = rt

    def _establish(self, name: str) -> None:
        """Mark a CRD read once since its creation NamesAccepted and Established."""
        if name not in self._pending_crds:
            return
        self._pending_crds.discard(name)
        key = self._okey(CRD_TYPE, "", name)
        st = self._objects.get(key)
        if st is None:
            return
        old = copy.deepcopy(st.obj)
        new = copy.deepcopy(st.obj)
        now = self._now()
        names = new["spec"]["names"]
        new["status"]["acceptedNames"] = {"kind": names["kind"], "plural": names["plural"]}
        new["status"]["conditions"] = [
            {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": now}
            for t, r, m in (
                ("NamesAccepted", "NoConflicts", "no conflicts found"),
                ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
            )
        ]
        self._commit(CRD_TYPE, key, new, old)

    def _remove(self, rt: ResourceType, key: tuple[str, str, str]) -> Json:
        st = self._objects.pop(key)
        obj = st.obj
        obj["metadata"]["resourceVersion"] = self._bump()
        self._emit(rt, "DELETED", self._render(st), None)
        uid = obj["metadata"].get("uid")
        for okey, other in list(self._objects.items()):
            refs = other.obj["metadata"].get("ownerReferences") or []
            if any(r.get("uid") == uid for r in refs):
                ort = next(t for t in self.types.values() if self._type_key(t) == okey[0])
                self._delete_locked(ort, okey, None)
        return obj

    def _delete_locked(
        self, rt: ResourceType, key: tuple[str, str, str], options: Json | None
    ) -> Json:
        st = self._objects.get(key)
        if st is None:
            raise ApiStatusError(404, "NotFound", f'{rt.resource_name} "{key[2]}" not found')
        pre = (options or {}).get("preconditions") or {}
        meta = st.obj["metadata"]
        if pre.get("uid") and pre["uid"] != meta.get("uid"):
            raise ApiStatusError(
                409,
                "Conflict",
                f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {meta.get('uid')}",
            )
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta.get("resourceVersion"):
            raise ApiStatusError(409, "Conflict", "Precondition failed: resourceVersion")
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                old = copy.deepcopy(st.obj)
                new = copy.deepcopy(st.obj)
                new["metadata"]["deletionTimestamp"] = self._now()
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                return self._commit(rt, key, new, old)
            return copy.deepcopy(st.obj)
        return self._remove(rt, key)

    # -------------------------------------------------------------------- verbs

    def list_objects(self, rt: ResourceType, ns: str, query: Mapping[str, str]) -> Json:
        sel = parse_selector(query.get("labelSelector", ""))
        fsel = query.get("fieldSelector", "")
        with self._lock:
            items = [
                self._render(st)
                for (tk, ons, name), st in sorted(self._objects.items())
                if tk == self._type_key(rt)
                and (not ns or ons == ns)
                and sel(st.obj["metadata"].get("labels") or {})
                and field_match(st.obj, fsel)
            ]
            return {
                "apiVersion": rt.api_version,
                "kind": f"{rt.kind}List",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }

    def get(self, rt: ResourceType, ns: str, name: str) -> Json:
        with self._lock:
            st = self._objects.get(self._okey(rt, ns, name))
            if st is None:
                raise ApiStatusError(404, "NotFound", f'{rt.resource_name} "{name}" not found')
            out = self._render(st)
            if rt is CRD_TYPE:
                self._establish(name)
            return out

    def create(self, rt: ResourceType, ns: str, body: Json, manager: str) -> tuple[Json, list[str]]:
        with self._lock:
            meta = body.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
            if rt.namespaced:
                if meta.get("namespace") and meta["namespace"] != ns:
                    raise ApiStatusError(
                        400,
                        "BadRequest",
                        "the namespace of the object does not match the namespace on the request",
                    )
                meta["namespace"] = ns
            key = self._okey(rt, ns, str(meta.get("name") or ""))
            if key in self._objects:
                raise ApiStatusError(
                    409, "AlreadyExists", f'{rt.resource_name} "{meta.get("name")}" already exists'
                )
            new, warnings = admit_object(rt, body, None, "main")
            new["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=self._now())
            managers = update_managers(rt, {}, None, new, manager, "main")
            out = self._commit(rt, key, new, None)
            self._objects[key].managers = managers
            self._objects[key].times[(manager, "Update", "")] = self._now()
            return self._render(self._objects[key]) if key in self._objects else out, warnings

    def update(
        self, rt: ResourceType, ns: str, name: str, body: Json, manager: str, scope: str
    ) -> tuple[Json, list[str]]:
        with self._lock:
            key = self._okey(rt, ns, name)
            st = self._objects.get(key)
            if st is None:
                raise ApiStatusError(404, "NotFound", f'{rt.resource_name} "{name}" not found')
            meta = body.get("metadata") or {}
            if meta.get("name") not in (None, name):
                raise ApiStatusError(
                    400, "BadRequest", "the name of the object does not match the name on the URL"
                )
            rv = meta.get("resourceVersion")
            if not rv and rt.custom:
                raise ApiStatusError(
                    422,
                    "Invalid",
                    f'{rt.kind}.{rt.group} "{name}" is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update',
                    [
                        Cause(
                            "metadata.resourceVersion",
                            "must be specified for an update",
                            "FieldValueInvalid",
                        )
                    ],
                )
            return self._write(rt, key, st, body, manager, scope, rv)

    def _write(
        self,
        rt: ResourceType,
        key: tuple[str, str, str],
        st: _Stored,
        body: Json,
        manager: str,
        scope: str,
        rv: str | None,
    ) -> tuple[Json, list[str]]:
        old = st.obj
        if rv and rv != old["metadata"].get("resourceVersion"):
            raise ApiStatusError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {rt.resource_name} "{key[2]}": the object has been modified; please apply your changes to the latest version and try again',
            )
        uid = (body.get("metadata") or {}).get("uid")
        if uid and uid != old["metadata"].get("uid"):
            raise ApiStatusError(
                409, "Conflict", f"Precondition failed: UID in precondition: {uid}"
            )
        new, warnings = admit_object(rt, body, copy.deepcopy(old), scope)
        managers = update_managers(rt, st.managers, old, new, manager, scope)
        st.managers = managers
        sub = "status" if scope == "status" and rt.status_subresource else ""
        st.times[(manager, "Update", sub)] = self._now()
        out = self._commit(rt, key, new, copy.deepcopy(old))
        return (self._render(st) if key in self._objects else out), warnings

    def merge_patch(
        self,
        rt: ResourceType,
        ns: str,
        name: str,
        patch: Any,
        manager: str,
        scope: str,
        json_ops: bool,
    ) -> tuple[Json, list[str]]:
        with self._lock:
            key = self._okey(rt, ns, name)
            st = self._objects.get(key)
            if st is None:
                raise ApiStatusError(404, "NotFound", f'{rt.resource_name} "{name}" not found')
            current = self._render(st)
            current["metadata"].pop("managedFields", None)
            if json_ops:
                patched = json_patch(current, patch)
                rv = None
            else:
                if not isinstance(patch, dict):
                    raise ApiStatusError(400, "BadRequest", "merge patch must be a JSON object")
                rv = (patch.get("metadata") or {}).get("resourceVersion")
                patched = json_merge_patch(current, patch)
            return self._write(rt, key, st, patched, manager, scope, rv)

    def apply(
        self,
        rt: ResourceType,
        ns: str,
        name: str,
        body: Json,
        manager: str,
        force: bool,
        scope: str,
    ) -> tuple[Json, list[str]]:
        """Server-side apply (steps in :mod:`support.fakeapi.ownership`); creates the object
        when it does not exist (not through ``/status``)."""
        check_apply_request(rt, name, body, manager)
        sub = "status" if scope == "status" and rt.status_subresource else ""
        with self._lock:
            key = self._okey(rt, ns, name)
            st = self._objects.get(key)
            if st is None and sub:
                raise ApiStatusError(404, "NotFound", f'{rt.resource_name} "{name}" not found')
            applied = applied_configuration(rt, body, sub)
            applied_fields = object_fields(applied, rt, scope)
            mine = (manager, "Apply", sub)
            live = copy.deepcopy(st.obj) if st is not None else {"metadata": {"name": name}}
            if rt.namespaced:
                live["metadata"]["namespace"] = ns
            managers = {k: set(v) for k, v in (st.managers.items() if st else [])}
            claim_fields(rt, applied, applied_fields, live, managers, mine, force)
            merged = merge_configuration(rt, live, applied)
            drop_unapplied(merged, managers, mine, applied_fields)
            managers[mine] = applied_fields
            owned = {k: v for k, v in managers.items() if v}
            rv = (body.get("metadata") or {}).get("resourceVersion")
            if st is None:
                new, warnings = admit_object(rt, merged, None, "main")
                new["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=self._now())
                self._commit(rt, key, new, None)
                self._objects[key].managers = owned
                self._objects[key].times[mine] = self._now()
                return self._render(self._objects[key]), warnings
            if rv and rv != st.obj["metadata"].get("resourceVersion"):
                raise ApiStatusError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {rt.resource_name} "{name}": the object has been modified',
                )
            old = copy.deepcopy(st.obj)
            new, warnings = admit_object(rt, merged, old, scope)
            st.managers = owned
            st.times[mine] = self._now()
            out = self._commit(rt, key, new, old)
            return (self._render(st) if key in self._objects else out), warnings

    def delete(self, rt: ResourceType, ns: str, name: str, options: Json | None) -> Json:
        with self._lock:
            return copy.deepcopy(self._delete_locked(rt, self._okey(rt, ns, name), options))

    def watch_events(
        self, rt: ResourceType, ns: str, query: Mapping[str, str], alive: Callable[[], bool]
    ) -> Iterator[Json]:
        """Watch events as dictionaries (``{"type", "object"}``), until timeout or stop
        (:func:`support.fakeapi.watch.watch_events`)."""
        return watch_events(self, rt, ns, query, alive)

    # --------------------------------------------------------------- routing

    def route(self, path: str) -> tuple[ResourceType, str, str | None, str | None]:
        """``(type, namespace, name, subresource)`` of a URL path
        (:func:`support.fakeapi.routing.route`)."""
        return route(self.types, path)

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.remaining != 0 and f.method in ("*", method) and re.search(f.path_regex, path):
                    if f.remaining > 0:
                        f.remaining -= 1
                    return f
        return None
