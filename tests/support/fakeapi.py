"""A fake Kubernetes API server for mixfleet's resources, over real HTTP.

It serves what the operator and the controller's Kubernetes store use, with the semantics
of kube-apiserver that code most often gets wrong:

* the mixfleet.io CRDs (loaded from their generated manifests, so the schema, list types and
  CEL rules under test are the shipped ones), core/v1 ConfigMaps and coordination.k8s.io/v1
  Leases;
* get, list (label and field selectors), create, update (PUT), JSON merge patch, JSON patch,
  server-side apply (``application/apply-patch+yaml``: field managers, ownership, conflicts
  with ``force``, removal of fields a manager stops applying, granular ``map`` and ``set``
  lists), delete (with uid / resourceVersion preconditions);
* ``resourceVersion`` on every write; 409 Conflict on a stale update or precondition; PUT of
  a custom resource without resourceVersion is rejected like kube-apiserver does;
* the status subresource: writes to the main resource ignore ``status``, writes to
  ``/status`` ignore everything else; ``metadata.generation`` grows on spec changes only;
* admission of custom resources: defaults, pruning of unknown fields (with a ``Warning``
  header), structural-schema validation and the CRD's CEL rules including transition rules
  (``self == oldSelf``) -> 422 Invalid with causes;
* finalizers: DELETE sets ``deletionTimestamp``; the object goes when its last finalizer is
  removed; no new finalizers while deleting; owner references are garbage-collected
  (background propagation);
* watch with ``resourceVersion`` (events after it), ``""``/``"0"`` (synthetic ADDED first),
  label selectors (ADDED/DELETED as objects enter or leave the selection),
  ``timeoutSeconds``, bookmarks, and ``410 Gone`` once the history before a version is
  compacted.

Tests can inject faults (status codes for matching requests), compact the history, and read
the request log (method, path, user agent, field manager) to check who wrote what.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import yaml

from support.structural import Cause, admit

Json = dict[str, Any]
Path = tuple[str, ...]

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

#: How server-side apply sees ObjectMeta: the fields a manager can own.
META_SCHEMA: Json = {
    "type": "object",
    "properties": {
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "finalizers": {
            "type": "array",
            "items": {"type": "string"},
            "x-kubernetes-list-type": "set",
        },
        "ownerReferences": {
            "type": "array",
            "items": {"type": "object", "properties": {"uid": {"type": "string"}}},
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["uid"],
        },
    },
}
_META_TRACKED = ("labels", "annotations", "finalizers", "ownerReferences")


class ApiStatusError(Exception):
    """An error answer: HTTP code, Status reason, message and causes."""

    def __init__(self, code: int, reason: str, message: str, causes: Sequence[Cause] = ()) -> None:
        self.code = code
        self.reason = reason
        self.message = message
        self.causes = tuple(causes)
        super().__init__(f"{code} {reason}: {message}")


@dataclass
class ResourceType:
    """A resource the server serves.

    Attributes:
        group, version, plural, kind: identity.
        namespaced: objects live in namespaces.
        schema: structural schema (custom resources) or a loose one (built-ins).
        status_subresource: ``/status`` is a separate endpoint.
        custom: a custom resource (validation, pruning, generation, PUT needs
            resourceVersion).
    """

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    schema: Json
    status_subresource: bool = False
    custom: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def resource_name(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


BUILTINS = (
    ResourceType(
        "",
        "v1",
        "configmaps",
        "ConfigMap",
        True,
        {
            "type": "object",
            "properties": {
                "data": {"type": "object", "additionalProperties": {"type": "string"}},
                "binaryData": {"type": "object", "additionalProperties": {"type": "string"}},
                "immutable": {"type": "boolean"},
            },
        },
    ),
    ResourceType(
        "coordination.k8s.io",
        "v1",
        "leases",
        "Lease",
        True,
        {
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "properties": {
                        "holderIdentity": {"type": "string"},
                        "leaseDurationSeconds": {"type": "integer"},
                        "acquireTime": {"type": "string", "format": "date-time"},
                        "renewTime": {"type": "string", "format": "date-time"},
                        "leaseTransitions": {"type": "integer"},
                    },
                }
            },
        },
    ),
)


def resource_from_crd(crd: Mapping[str, Any]) -> ResourceType:
    """A served resource from a CustomResourceDefinition manifest (its storage version)."""
    spec = crd["spec"]
    version = next(v for v in spec["versions"] if v.get("storage"))
    return ResourceType(
        group=spec["group"],
        version=version["name"],
        plural=spec["names"]["plural"],
        kind=spec["names"]["kind"],
        namespaced=spec["scope"] == "Namespaced",
        schema=version["schema"]["openAPIV3Schema"],
        status_subresource="status" in (version.get("subresources") or {}),
        custom=True,
    )


# ------------------------------------------------------------------- label selectors


def _requirement(text: str) -> Callable[[Mapping[str, str]], bool]:
    t = text.strip()
    m = re.match(r"^([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)$", t)
    if m:
        key, op = m.group(1), m.group(2)
        values = {v.strip() for v in m.group(3).split(",") if v.strip()}

        def set_based(labels: Mapping[str, str]) -> bool:
            return (labels.get(key) in values) == (op == "in")

        return set_based
    m = re.match(r"^([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)$", t)
    if m:
        key, op, value = m.groups()

        def equality(labels: Mapping[str, str]) -> bool:
            return (labels.get(key) == value) == (op != "!=")

        return equality
    m = re.match(r"^(!?)([\w./-]+)$", t)
    if m:
        neg, key = m.groups()

        def existence(labels: Mapping[str, str]) -> bool:
            return (key in labels) != bool(neg)

        return existence
    raise ApiStatusError(400, "BadRequest", f"unable to parse requirement: {t!r}")


def parse_selector(text: str) -> Callable[[Mapping[str, str]], bool]:
    """A label selector (``a=b,c!=d,e in (x,y),f notin (z),g,!h``) as a predicate.

    Raises:
        ApiStatusError: 400 for a malformed selector.
    """
    parts = re.split(r",(?![^()]*\))", text.strip()) if text.strip() else []
    terms = [_requirement(t) for t in parts]

    def selector(labels: Mapping[str, str]) -> bool:
        return all(term(labels) for term in terms)

    return selector


# ------------------------------------------------------------- server-side apply fields


def _child_schema(schema: Mapping[str, Any] | None, key: str) -> Json | None:
    if not schema:
        return None
    props = schema.get("properties") or {}
    if key in props:
        return dict(props[key])
    add = schema.get("additionalProperties")
    return dict(add) if isinstance(add, Mapping) else None


def _list_kind(schema: Mapping[str, Any] | None) -> tuple[str, list[str]]:
    if not schema:
        return "atomic", []
    return (
        str(schema.get("x-kubernetes-list-type") or "atomic"),
        list(schema.get("x-kubernetes-list-map-keys") or []),
    )


def _elem_key(item: Any, keys: Sequence[str]) -> str:
    if not isinstance(item, Mapping):
        return "k:" + json.dumps(item)
    return "k:" + json.dumps({k: item.get(k) for k in sorted(keys)}, separators=(",", ":"))


def _granular(value: Any, schema: Mapping[str, Any] | None) -> bool:
    if isinstance(value, dict):
        return not (schema and schema.get("x-kubernetes-map-type") == "atomic")
    if isinstance(value, list):
        return _list_kind(schema)[0] in ("map", "set")
    return False


def fieldset(value: Any, schema: Mapping[str, Any] | None, prefix: Path = ()) -> set[Path]:
    """Paths (FieldsV1 elements ``f:name``, ``k:{...}``, ``v:...``) of every field set in
    ``value``; granular maps and ``map``/``set`` lists are descended, the rest are leaves."""
    out: set[Path] = set()
    if isinstance(value, dict) and _granular(value, schema):
        for k, v in value.items():
            p = (*prefix, f"f:{k}")
            out.add(p)
            out |= fieldset(v, _child_schema(schema, k), p)
    elif isinstance(value, list) and _granular(value, schema):
        kind, keys = _list_kind(schema)
        items = (schema or {}).get("items") if schema else None
        for item in value:
            if kind == "set":
                out.add((*prefix, "v:" + json.dumps(item)))
            else:
                p = (*prefix, _elem_key(item, keys))
                out.add(p)
                out |= fieldset(item, items, p)
    return out


def object_fields(obj: Mapping[str, Any], rt: ResourceType, scope: str) -> set[Path]:
    """Owned-able fields of an object: ``scope`` ``main`` (all but status when the status is
    a subresource) or ``status``."""
    out: set[Path] = set()
    meta = obj.get("metadata") or {}
    if scope == "main":
        for k in _META_TRACKED:
            if k in meta:
                p: Path = ("f:metadata", f"f:{k}")
                out.add(p)
                out |= fieldset(meta[k], META_SCHEMA["properties"][k], p)
    for k, v in obj.items():
        if k in ("apiVersion", "kind", "metadata"):
            continue
        is_status = k == "status" and rt.status_subresource
        if (scope == "status") != is_status:
            continue
        p = (f"f:{k}",)
        out.add(p)
        out |= fieldset(v, _child_schema(rt.schema, k), p)
    return out


def _step(container: Any, elem: str) -> Any:
    if elem.startswith("f:"):
        if isinstance(container, dict) and elem[2:] in container:
            return container[elem[2:]]
        raise KeyError(elem)
    if elem.startswith("v:"):
        value = json.loads(elem[2:])
        if isinstance(container, list) and value in container:
            return value
        raise KeyError(elem)
    wanted = json.loads(elem[2:])
    if isinstance(container, list):
        for item in container:
            if isinstance(item, Mapping) and all(item.get(k) == v for k, v in wanted.items()):
                return item
    raise KeyError(elem)


_MISSING = object()


def value_at(obj: Any, path: Path) -> Any:
    """The value at a field path, or a sentinel when absent."""
    cur = obj
    try:
        for elem in path:
            cur = _step(cur, elem)
    except KeyError:
        return _MISSING
    return cur


def remove_at(obj: Any, path: Path) -> None:
    """Remove the field at ``path`` (no-op when absent)."""
    parent = value_at(obj, path[:-1])
    last = path[-1]
    if parent is _MISSING:
        return
    if last.startswith("f:") and isinstance(parent, dict):
        parent.pop(last[2:], None)
    elif isinstance(parent, list):
        try:
            target = _step(parent, last)
        except KeyError:
            return
        parent.remove(target)


def merge_applied(live: Any, applied: Any, schema: Mapping[str, Any] | None) -> Any:
    """Merge an applied configuration into the live value (server-side apply)."""
    if isinstance(live, dict) and isinstance(applied, dict) and _granular(applied, schema):
        out = dict(live)
        for k, v in applied.items():
            out[k] = (
                merge_applied(live.get(k, _MISSING), v, _child_schema(schema, k))
                if k in live
                else copy.deepcopy(v)
            )
        return out
    if isinstance(live, list) and isinstance(applied, list) and _granular(applied, schema):
        kind, keys = _list_kind(schema)
        out_list = list(live)
        if kind == "set":
            for item in applied:
                if item not in out_list:
                    out_list.append(copy.deepcopy(item))
            return out_list
        items_schema = (schema or {}).get("items")
        for item in applied:
            k = _elem_key(item, keys)
            idx = next((i for i, x in enumerate(out_list) if _elem_key(x, keys) == k), None)
            if idx is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[idx] = merge_applied(out_list[idx], item, items_schema)
        return out_list
    return copy.deepcopy(applied)


def leaves(paths: set[Path]) -> set[Path]:
    """The paths of a field set that have no descendants in it."""
    parents = {p[:i] for p in paths for i in range(1, len(p))}
    return paths - parents


def fields_v1(paths: set[Path]) -> Json:
    """Render owned paths as a FieldsV1 document."""
    root: Json = {}
    for p in sorted(paths, key=len):
        node = root
        for elem in p:
            node = node.setdefault(elem, {})
        if p and (p[-1].startswith("k:")):
            node.setdefault(".", {})
    return root


def json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = json_merge_patch(out.get(k), v)
    return out


def _pointer(doc: Any, ptr: str) -> tuple[Any, str]:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in ptr.split("/")[1:]]
    cur = doc
    for p in parts[:-1]:
        cur = cur[int(p)] if isinstance(cur, list) else cur[p]
    return cur, parts[-1]


def json_patch(doc: Any, ops: Sequence[Mapping[str, Any]]) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, test)."""
    out = copy.deepcopy(doc)
    for op in ops:
        try:
            parent, last = _pointer(out, str(op["path"]))
            kind = op["op"]
            if kind == "test":
                cur = parent[int(last)] if isinstance(parent, list) else parent.get(last, _MISSING)
                if cur != op.get("value"):
                    raise ApiStatusError(422, "Invalid", f"test operation failed at {op['path']}")
            elif kind == "remove":
                if isinstance(parent, list):
                    parent.pop(int(last))
                else:
                    del parent[last]
            elif kind in ("add", "replace"):
                if isinstance(parent, list):
                    if last == "-":
                        parent.append(op["value"])
                    elif kind == "add":
                        parent.insert(int(last), op["value"])
                    else:
                        parent[int(last)] = op["value"]
                else:
                    if kind == "replace" and last not in parent:
                        raise ApiStatusError(422, "Invalid", f"replace of missing {op['path']}")
                    parent[last] = op["value"]
            else:
                raise ApiStatusError(400, "BadRequest", f"unsupported JSON patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiStatusError(422, "Invalid", f"JSON patch {op}: {exc}") from exc
    return out


# ------------------------------------------------------------------------------ state


@dataclass
class _Event:
    rv: int
    rt: ResourceType
    type: str
    obj: Json
    old: Json | None


@dataclass
class RequestRecord:
    """One request the server answered.

    Attributes:
        method, path: HTTP method and path.
        query: query parameters (first value of each).
        user_agent: User-Agent header.
        status: HTTP status answered.
    """

    method: str
    path: str
    query: Mapping[str, str]
    user_agent: str
    status: int


@dataclass
class Fault:
    """Answer matching requests with an error instead of serving them.

    Attributes:
        method: HTTP method (``*`` for any).
        path_regex: searched in the request path.
        code: HTTP status to answer.
        reason: Status reason.
        remaining: how many more requests to fail (-1: forever).
    """

    method: str
    path_regex: str
    code: int
    reason: str = "InternalError"
    remaining: int = 1


@dataclass
class _Stored:
    obj: Json
    managers: dict[tuple[str, str, str], set[Path]] = field(default_factory=dict)


class FakeApiServer:
    """In-process API server; see the module docstring for what it implements.

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
        for rt in (*BUILTINS, *(resource_from_crd(c) for c in crds)):
            self.types[(rt.group, rt.version, rt.plural)] = rt
        self.history_limit = history_limit
        self.clock = clock
        self._lock = threading.Condition(threading.RLock())
        self._objects: dict[tuple[str, str, str], _Stored] = {}
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

        class Handler(_Handler):
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
                "time": obj["metadata"].get("creationTimestamp"),
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

    # ----------------------------------------------------------------- admission

    def _admit(
        self, rt: ResourceType, new: Json, old: Json | None, scope: str
    ) -> tuple[Json, list[str]]:
        """Apply subresource rules, metadata rules, defaults, pruning and validation."""
        new = copy.deepcopy(new)
        new.pop("apiVersion", None)
        new.pop("kind", None)
        meta = new.setdefault("metadata", {})
        meta.pop("managedFields", None)
        if old is not None:
            om = old["metadata"]
            if scope == "status" and rt.status_subresource:
                status = new.get("status")
                new = copy.deepcopy({k: v for k, v in old.items() if k != "status"})
                if status is not None:
                    new["status"] = status
                meta = new["metadata"]
            elif rt.status_subresource:
                new.pop("status", None)
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
            for k in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
                      "deletionGracePeriodSeconds", "generation", "resourceVersion"):  # fmt: skip
                if k in om:
                    meta[k] = om[k]
                else:
                    meta.pop(k, None)
            if om.get("deletionTimestamp"):
                added = set(meta.get("finalizers") or []) - set(om.get("finalizers") or [])
                if added:
                    raise ApiStatusError(
                        422,
                        "Invalid",
                        "metadata.finalizers: Forbidden: no new finalizers can be added if the "
                        "object is being deleted",
                        [
                            Cause(
                                "metadata.finalizers",
                                f"found new finalizers {sorted(added)}",
                                "FieldValueForbidden",
                            )
                        ],
                    )
        elif rt.status_subresource:
            new.pop("status", None)
        name = str(meta.get("name") or "")
        if not _DNS_SUBDOMAIN.match(name) or len(name) > 253:
            raise ApiStatusError(
                422,
                "Invalid",
                f"metadata.name: Invalid value: {name!r}: must be a DNS subdomain",
                [Cause("metadata.name", "must be a lowercase RFC 1123 subdomain")],
            )
        for k in ("labels", "annotations"):
            if meta.get(k) is not None and not all(isinstance(v, str) for v in meta[k].values()):
                raise ApiStatusError(422, "Invalid", f"metadata.{k} values must be strings")
        warnings: list[str] = []
        if rt.custom:
            body = {k: v for k, v in new.items() if k != "metadata"}
            name_schema = (
                ((rt.schema.get("properties") or {}).get("metadata") or {})
                .get("properties", {})
                .get("name")
            )
            causes: list[Cause] = []
            if name_schema and len(name) > int(name_schema.get("maxLength", 253)):
                causes.append(
                    Cause(
                        "metadata.name",
                        f"may not be longer than {name_schema['maxLength']}",
                        "FieldValueTooLong",
                    )
                )
            old_body = (
                {k: v for k, v in old.items() if k != "metadata"} if old is not None else None
            )
            admitted, dropped, more = admit(body, rt.schema, old=old_body)
            causes += more
            if causes:
                detail = "; ".join(str(c) for c in causes[:10])
                raise ApiStatusError(
                    422, "Invalid", f'{rt.kind}.{rt.group} "{name}" is invalid: {detail}', causes
                )
            warnings = [f'unknown field "{p}"' for p in dropped]
            new = {"metadata": meta, **admitted}
        else:
            body = {k: v for k, v in new.items() if k != "metadata"}
            admitted, dropped, causes = admit(body, rt.schema)
            if causes:
                raise ApiStatusError(422, "Invalid", "; ".join(str(c) for c in causes[:10]), causes)
            new = {"metadata": meta, **admitted}
        return new, warnings

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
        self._emit(rt, "ADDED" if old is None else "MODIFIED", self._render(st), old)
        return new

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

    # ---------------------------------------------------------------- ownership

    def _update_managers(
        self,
        rt: ResourceType,
        st: _Stored | None,
        old: Json | None,
        new: Json,
        manager: str,
        scope: str,
    ) -> dict[tuple[str, str, str], set[Path]]:
        managers = {k: set(v) for k, v in (st.managers.items() if st else [])}
        sub = "status" if scope == "status" and rt.status_subresource else ""
        old_fields = object_fields(old, rt, scope) if old else set()
        new_fields = object_fields(new, rt, scope)
        removed = old_fields - new_fields
        new_leaves = leaves(new_fields)
        changed = {
            p
            for p in new_fields
            if p not in old_fields or (p in new_leaves and value_at(old, p) != value_at(new, p))
        }
        mine = (manager, "Update", sub)
        for k in managers:
            managers[k] -= removed
            if k != mine:
                managers[k] -= changed & new_leaves
        managers.setdefault(mine, set()).update(changed)
        return {k: v for k, v in managers.items() if v}

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
                and _field_match(st.obj, fsel)
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
            return self._render(st)

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
            new, warnings = self._admit(rt, body, None, "main")
            new["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=self._now())
            managers = self._update_managers(rt, None, None, new, manager, "main")
            out = self._commit(rt, key, new, None)
            self._objects[key].managers = managers
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
        new, warnings = self._admit(rt, body, copy.deepcopy(old), scope)
        managers = self._update_managers(rt, st, old, new, manager, scope)
        st.managers = managers
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
        if not manager:
            raise ApiStatusError(
                422,
                "Invalid",
                'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is required for apply patch',
            )
        if body.get("apiVersion") != rt.api_version or body.get("kind") != rt.kind:
            raise ApiStatusError(
                400,
                "BadRequest",
                f"apply needs apiVersion {rt.api_version} and kind {rt.kind}, got {body.get('apiVersion')} {body.get('kind')}",
            )
        meta = body.get("metadata") or {}
        if meta.get("name") != name:
            raise ApiStatusError(400, "BadRequest", "metadata.name must match the name on the URL")
        if meta.get("managedFields"):
            raise ApiStatusError(400, "BadRequest", "metadata.managedFields must be nil")
        sub = "status" if scope == "status" and rt.status_subresource else ""
        with self._lock:
            key = self._okey(rt, ns, name)
            st = self._objects.get(key)
            if st is None and sub:
                raise ApiStatusError(404, "NotFound", f'{rt.resource_name} "{name}" not found')
            applied = {k: v for k, v in body.items() if k not in ("apiVersion", "kind")}
            applied_meta = {k: v for k, v in meta.items() if k in _META_TRACKED}
            applied["metadata"] = applied_meta
            if rt.status_subresource:
                if sub:
                    applied = {
                        "metadata": {},
                        **({"status": body["status"]} if "status" in body else {}),
                    }
                else:
                    applied.pop("status", None)
            applied_fields = object_fields(applied, rt, scope)
            mine = (manager, "Apply", sub)
            live = copy.deepcopy(st.obj) if st is not None else {"metadata": {"name": name}}
            if rt.namespaced:
                live["metadata"]["namespace"] = ns
            managers = {k: set(v) for k, v in (st.managers.items() if st else [])}
            conflicts: list[Cause] = []
            for p in sorted(leaves(applied_fields)):
                av = value_at(applied, p)
                lv = value_at(live, p)
                if lv is _MISSING or lv == av:
                    continue
                for k, paths in managers.items():
                    if k != mine and p in paths:
                        if force:
                            paths.discard(p)
                        else:
                            conflicts.append(
                                Cause(
                                    _dotted(p),
                                    f'conflict with "{k[0]}" using {rt.api_version}',
                                    "FieldManagerConflict",
                                )
                            )
            if conflicts:
                raise ApiStatusError(
                    409,
                    "Conflict",
                    f"Apply failed with {len(conflicts)} conflict(s): "
                    + "; ".join(f"{c.message}: {c.field}" for c in conflicts[:5]),
                    conflicts,
                )
            merged = copy.deepcopy(live)
            for field_name, v in applied.items():
                if field_name == "metadata":
                    for mk, mv in v.items():
                        merged["metadata"][mk] = (
                            merge_applied(
                                merged["metadata"].get(mk, _MISSING),
                                mv,
                                META_SCHEMA["properties"][mk],
                            )
                            if mk in merged["metadata"]
                            else copy.deepcopy(mv)
                        )
                else:
                    merged[field_name] = (
                        merge_applied(merged[field_name], v, _child_schema(rt.schema, field_name))
                        if field_name in merged
                        else copy.deepcopy(v)
                    )
            others: set[Path] = set()
            for mk2, owned in managers.items():
                if mk2 != mine:
                    others |= owned
            # Fields this manager applied before and no longer does go, unless another
            # manager owns them or something inside them; a removed map-list element or
            # object goes whole.
            removable = {
                p
                for p in managers.get(mine, set()) - applied_fields
                if not any(o[: len(p)] == p for o in others)
            }
            for p in sorted(removable, key=len):
                if not any(p[:i] in removable for i in range(1, len(p))):
                    remove_at(merged, p)
            managers[mine] = applied_fields
            rv = meta.get("resourceVersion")
            if st is None:
                new, warnings = self._admit(rt, merged, None, "main")
                new["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=self._now())
                self._commit(rt, key, new, None)
                self._objects[key].managers = {k: v for k, v in managers.items() if v}
                return self._render(self._objects[key]), warnings
            if rv and rv != st.obj["metadata"].get("resourceVersion"):
                raise ApiStatusError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {rt.resource_name} "{name}": the object has been modified',
                )
            old = copy.deepcopy(st.obj)
            new, warnings = self._admit(rt, merged, old, scope)
            st.managers = {k: v for k, v in managers.items() if v}
            out = self._commit(rt, key, new, old)
            return (self._render(st) if key in self._objects else out), warnings

    def delete(self, rt: ResourceType, ns: str, name: str, options: Json | None) -> Json:
        with self._lock:
            return copy.deepcopy(self._delete_locked(rt, self._okey(rt, ns, name), options))

    def watch_events(
        self, rt: ResourceType, ns: str, query: Mapping[str, str], alive: Callable[[], bool]
    ) -> Iterator[Json]:
        """Watch events as dictionaries (``{"type", "object"}``), until timeout or stop."""
        sel = parse_selector(query.get("labelSelector", ""))
        timeout_s = float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        rv_param = query.get("resourceVersion", "")
        deadline = time.monotonic() + timeout_s
        tk = self._type_key(rt)

        def matches(o: Json | None) -> bool:
            if o is None:
                return False
            return (not ns or o["metadata"].get("namespace", "") == ns) and sel(
                o["metadata"].get("labels") or {}
            )

        with self._lock:
            if rv_param in ("", "0"):
                last = self._rv
                initial = [
                    self._render(st)
                    for (t, _, _), st in sorted(self._objects.items())
                    if t == tk and matches(st.obj)
                ]
            else:
                try:
                    last = int(rv_param)
                except ValueError:
                    yield _status_event(400, "BadRequest", f"invalid resourceVersion {rv_param!r}")
                    return
                initial = []
                if last < self._compacted_rv:
                    yield _status_event(
                        410, "Expired", f"too old resource version: {last} ({self._compacted_rv})"
                    )
                    return
        for obj in initial:
            yield {"type": "ADDED", "object": obj}
        while alive():
            with self._lock:
                pending = [e for e in self._events if e.rv > last]
                if not pending:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closing:
                        break
                    self._lock.wait(min(left, 0.5))
                    continue
                if last < self._compacted_rv:
                    yield _status_event(410, "Expired", "too old resource version")
                    return
            for e in pending:
                last = e.rv
                if e.rt is not rt and self._type_key(e.rt) != tk:
                    continue
                new_ok = e.type != "DELETED" and matches(e.obj)
                old_ok = (
                    matches(e.old)
                    if e.type == "MODIFIED"
                    else (e.type == "DELETED" and matches(e.obj))
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

    # --------------------------------------------------------------- routing

    def route(self, path: str) -> tuple[ResourceType, str, str | None, str | None]:
        """``(type, namespace, name, subresource)`` of a URL path.

        Raises:
            ApiStatusError: 404 for an unknown path or resource.
        """
        parts = [unquote(p) for p in path.strip("/").split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiStatusError(
                404, "NotFound", f"the server could not find the requested resource {path}"
            )
        ns = ""
        if len(rest) >= 2 and rest[0] == "namespaces":
            ns, rest = rest[1], rest[2:]
        if not rest:
            raise ApiStatusError(
                404, "NotFound", f"the server could not find the requested resource {path}"
            )
        rt = self.types.get((group, version, rest[0]))
        if rt is None:
            raise ApiStatusError(
                404, "NotFound", f"the server could not find the requested resource {path}"
            )
        if ns and not rt.namespaced:
            raise ApiStatusError(404, "NotFound", f"{rt.plural} is not namespaced")
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub is not None and not (sub == "status" and rt.status_subresource):
            raise ApiStatusError(404, "NotFound", f"no subresource {sub!r} on {rt.plural}")
        if name is not None and rt.namespaced and not ns:
            raise ApiStatusError(404, "NotFound", f"{rt.plural} is namespaced: use /namespaces/NS/")
        return rt, ns, name, sub

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.remaining != 0 and f.method in ("*", method) and re.search(f.path_regex, path):
                    if f.remaining > 0:
                        f.remaining -= 1
                    return f
        return None


def _dotted(p: Path) -> str:
    out = ""
    for e in p:
        out += f".{e[2:]}" if e.startswith("f:") else f"[{e[2:]}]"
    return out


def _field_match(obj: Json, selector: str) -> bool:
    for term in [t for t in selector.split(",") if t]:
        key, _, value = term.partition("=")
        value = value.lstrip("=")
        neg = key.endswith("!")
        key = key.rstrip("!")
        actual = {
            "metadata.name": obj["metadata"].get("name"),
            "metadata.namespace": obj["metadata"].get("namespace", ""),
        }.get(key)
        if (actual == value) == neg:
            return False
    return True


def _status(code: int, reason: str, message: str, causes: Sequence[Cause] = ()) -> Json:
    out: Json = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if causes:
        out["details"] = {
            "causes": [{"field": c.field, "message": c.message, "reason": c.reason} for c in causes]
        }
    return out


def _status_event(code: int, reason: str, message: str) -> Json:
    return {"type": "ERROR", "object": _status(code, reason, message)}


class _Handler(BaseHTTPRequestHandler):
    api: FakeApiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, code: int, doc: Any, warnings: Sequence[str] = ()) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        for w in warnings:
            self.send_header("Warning", f'299 - "{w}"')
        self.end_headers()
        self.wfile.write(raw)

    def _record(self, status: int) -> None:
        u = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(u.query).items()}
        with self.api._lock:
            self.api.requests.append(
                RequestRecord(
                    self.command, u.path, query, self.headers.get("User-Agent", ""), status
                )
            )

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            try:
                return yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                raise ApiStatusError(400, "BadRequest", f"cannot decode body: {exc}") from exc

    def _handle(self) -> None:
        u = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(u.query).items()}
        code = 200
        try:
            body = self._body() if self.command in ("POST", "PUT", "PATCH", "DELETE") else None
            fault = self.api.take_fault(self.command, u.path)
            if fault is not None:
                raise ApiStatusError(
                    fault.code, fault.reason, f"injected fault for {self.command} {u.path}"
                )
            rt, ns, name, sub = self.api.route(u.path)
            manager = (
                query.get("fieldManager") or self.headers.get("User-Agent", "unknown").split("/")[0]
            )
            scope = "status" if sub == "status" else "main"
            warnings: list[str] = []
            if self.command == "GET" and name is None and query.get("watch") in ("true", "1"):
                self._record(200)
                self._stream(rt, ns, query)
                return
            if self.command == "GET":
                doc = (
                    self.api.list_objects(rt, ns, query)
                    if name is None
                    else self.api.get(rt, ns, name)
                )
            elif self.command == "POST" and name is None:
                if not isinstance(body, dict):
                    raise ApiStatusError(400, "BadRequest", "body must be an object")
                doc, warnings = self.api.create(rt, ns, body, manager)
                code = 201
            elif self.command == "PUT" and name is not None:
                if not isinstance(body, dict):
                    raise ApiStatusError(400, "BadRequest", "body must be an object")
                doc, warnings = self.api.update(rt, ns, name, body, manager, scope)
            elif self.command == "PATCH" and name is not None:
                ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
                if ctype == "application/apply-patch+yaml":
                    if not isinstance(body, dict):
                        raise ApiStatusError(400, "BadRequest", "apply body must be an object")
                    doc, warnings = self.api.apply(
                        rt,
                        ns,
                        name,
                        body,
                        query.get("fieldManager", ""),
                        query.get("force") == "true",
                        scope,
                    )
                elif ctype == "application/merge-patch+json":
                    doc, warnings = self.api.merge_patch(
                        rt, ns, name, body, manager, scope, json_ops=False
                    )
                elif ctype == "application/json-patch+json":
                    if not isinstance(body, list):
                        raise ApiStatusError(400, "BadRequest", "JSON patch must be a list")
                    doc, warnings = self.api.merge_patch(
                        rt, ns, name, body, manager, scope, json_ops=True
                    )
                else:
                    raise ApiStatusError(
                        415,
                        "UnsupportedMediaType",
                        f"the body of the request was in an unknown format: {ctype}",
                    )
            elif self.command == "DELETE" and name is not None:
                doc = self.api.delete(rt, ns, name, body if isinstance(body, dict) else None)
            else:
                raise ApiStatusError(
                    405, "MethodNotAllowed", f"{self.command} is not supported on {u.path}"
                )
        except ApiStatusError as exc:
            code = exc.code
            doc, warnings = _status(exc.code, exc.reason, exc.message, exc.causes), []
        self._record(code)
        self._send(code, doc, warnings)

    def _stream(self, rt: ResourceType, ns: str, query: Mapping[str, str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        ok = True

        def alive() -> bool:
            return ok and not self.api._closing

        try:
            for ev in self.api.watch_events(rt, ns, query, alive):
                line = json.dumps(ev).encode() + b"\n"
                self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            ok = False
        self.close_connection = True

    do_GET = _handle  # noqa: N815 - BaseHTTPRequestHandler's method names
    do_POST = _handle  # noqa: N815
    do_PUT = _handle  # noqa: N815
    do_PATCH = _handle  # noqa: N815
    do_DELETE = _handle  # noqa: N815


def crd_manifests(directory: str) -> list[Json]:
    """Load every CRD manifest in a directory (``charts/mixfleet/crds``)."""
    from pathlib import Path as FsPath

    docs = []
    for p in sorted(FsPath(directory).glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(p.read_text()) if d]
    return docs
