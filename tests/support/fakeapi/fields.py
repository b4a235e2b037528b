"""Field paths of server-side apply: which fields a value sets (FieldsV1 elements
``f:name``, ``k:{...}``, ``v:...``), reading and removing the value at a path, merging an
applied configuration into the live object, and rendering owned paths as FieldsV1.

Maps are granular unless ``x-kubernetes-map-type: atomic``; lists are granular when their
``x-kubernetes-list-type`` is ``map`` (elements keyed by ``x-kubernetes-list-map-keys``) or
``set``; everything else is one leaf.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from support.fakeapi.errors import Json
from support.fakeapi.resources import ResourceType

Path = tuple[str, ...]

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
META_TRACKED = ("labels", "annotations", "finalizers", "ownerReferences")


def child_schema(schema: Mapping[str, Any] | None, key: str) -> Json | None:
    """The schema of field ``key`` of an object (its property, else additionalProperties)."""
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
            out |= fieldset(v, child_schema(schema, k), p)
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
        for k in META_TRACKED:
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
        out |= fieldset(v, child_schema(rt.schema, k), p)
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


MISSING = object()


def value_at(obj: Any, path: Path) -> Any:
    """The value at a field path, or a sentinel when absent."""
    cur = obj
    try:
        for elem in path:
            cur = _step(cur, elem)
    except KeyError:
        return MISSING
    return cur


def remove_at(obj: Any, path: Path) -> None:
    """Remove the field at ``path`` (no-op when absent)."""
    parent = value_at(obj, path[:-1])
    last = path[-1]
    if parent is MISSING:
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
                merge_applied(live.get(k, MISSING), v, child_schema(schema, k))
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


def dotted(p: Path) -> str:
    """A field path as kube-apiserver writes it in a conflict (structured-merge-diff's path
    string): ``.status.nodes[node="a"].state``, ``.spec.list[=value]``, ``.spec.items[0]``."""
    out = ""
    for e in p:
        kind, rest = e[:2], e[2:]
        if kind == "f:":
            out += f".{rest}"
        elif kind == "k:":
            keys = json.loads(rest)
            out += "[" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(keys.items())) + "]"
        elif kind == "v:":
            out += f"[={rest}]"
        else:
            out += f"[{rest}]"
    return out
