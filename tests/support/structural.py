"""Structural OpenAPI v3 schemas: the checks, defaulting, pruning and validation an API
server applies to custom resources, in Python.

Used by the CRD tests (every generated schema must be structural), by the example checks
(``examples/k8s/*.yaml`` must validate against the CRDs) and by the fake API server, which
validates every write the way kube-apiserver does: defaults first, then unknown fields
pruned, then the schema (types, enums, bounds, patterns, required, list types) and the
``x-kubernetes-validations`` CEL rules (:mod:`support.cel`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from apis.kube.schema import apply_defaults
from support.cel import CelError, compile_rule, evaluate, uses_old_self

Json = dict[str, Any]

_TYPES = ("object", "array", "string", "integer", "number", "boolean")
_JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
_FORBIDDEN = (
    "$ref",
    "uniqueItems",
    "additionalItems",
    "patternProperties",
    "dependencies",
    "definitions",
    "id",
    "$schema",
)


@dataclass(frozen=True)
class Cause:
    """One validation failure, in the shape of a ``metav1.StatusCause``.

    Attributes:
        field: dotted path (``spec.workload.tokensPerGPU``, ``spec.nodes[2]``).
        message: what is wrong.
        reason: ``FieldValueRequired`` | ``FieldValueInvalid`` | ``FieldValueNotSupported``
            | ``FieldValueTypeInvalid`` | ``FieldValueTooLong`` | ``FieldValueTooMany`` |
            ``FieldValueDuplicate`` | ``FieldValueForbidden``.
    """

    field: str
    message: str
    reason: str = "FieldValueInvalid"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# -------------------------------------------------------------------- structural check


def check_structural(schema: Mapping[str, Any], path: str = "") -> list[str]:
    """Problems that make a CRD schema non-structural (empty when it is structural).

    Checks the rules of the Kubernetes "structural schema" definition: every node has a
    type (unless it preserves unknown fields or is int-or-string), no logical junctors or
    forbidden keywords, ``properties`` and ``additionalProperties`` not both, ``metadata``
    restricted to ``name``/``generateName``, list-type annotations consistent, defaults
    valid against their own schema and its CEL rules.
    """
    problems: list[str] = []
    where = path or "<root>"
    for key in _JUNCTORS + _FORBIDDEN:
        if key in schema:
            problems.append(f"{where}: {key} is not allowed in mixfleet CRDs")
    t = schema.get("type")
    preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
    int_or_string = schema.get("x-kubernetes-int-or-string") is True
    if t is None and not (preserve or int_or_string):
        problems.append(f"{where}: missing type")
    if t is not None and t not in _TYPES:
        problems.append(f"{where}: unknown type {t!r}")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{where}: properties and additionalProperties are exclusive")
    if schema.get("nullable") and "default" in schema and schema["default"] is None:
        problems.append(f"{where}: default null")
    for name, sub in (schema.get("properties") or {}).items():
        sub_path = _join(path, name)
        if path == "" and name == "metadata":
            extra = set(sub.get("properties") or {}) - {"name", "generateName"}
            if extra:
                problems.append(
                    f"metadata: only name and generateName may be restricted, not {sorted(extra)}"
                )
            if set(sub) - {"type", "properties", "description"}:
                problems.append("metadata: only type, properties and description are allowed")
        problems += check_structural(sub, sub_path)
    add = schema.get("additionalProperties")
    if isinstance(add, Mapping):
        problems += check_structural(add, f"{path}[*]")
    elif add is not None and add is not False:
        problems.append(f"{where}: additionalProperties must be a schema")
    if t == "array":
        items = schema.get("items")
        if not isinstance(items, Mapping):
            problems.append(f"{where}: an array needs one items schema")
        else:
            problems += check_structural(items, f"{path}[*]")
            lt = schema.get("x-kubernetes-list-type")
            if lt == "map":
                keys = schema.get("x-kubernetes-list-map-keys") or []
                props = items.get("properties") or {}
                req = set(items.get("required") or [])
                if items.get("type") != "object" or not keys:
                    problems.append(f"{where}: a map list needs object items and map keys")
                for k in keys:
                    if k not in props:
                        problems.append(f"{where}: map key {k!r} is not a property of the items")
                    elif k not in req and "default" not in props[k]:
                        problems.append(f"{where}: map key {k!r} must be required or defaulted")
            elif lt == "set" and items.get("type") in ("object", "array"):
                problems.append(f"{where}: a set list needs scalar items")
            elif lt not in (None, "atomic", "set", "map"):
                problems.append(f"{where}: unknown x-kubernetes-list-type {lt!r}")
    for rule in schema.get("x-kubernetes-validations") or []:
        try:
            compile_rule(rule["rule"])
        except CelError as exc:
            problems.append(f"{where}: CEL rule {rule['rule']!r}: {exc}")
    if "default" in schema:
        sub = dict(schema)
        sub.pop("default")
        value = apply_defaults(copy.deepcopy(schema["default"]), sub)
        # CEL rules included: kube-apiserver refuses a CRD whose default fails them
        # ("...default: Invalid value: <the rule's message>").
        causes = validate(value, sub, path=path)
        problems += [f"{where}: default {schema['default']!r} is invalid: {c}" for c in causes]
    return problems


# --------------------------------------------------------------------------- defaulting


# ------------------------------------------------------------------------------ pruning


def prune(value: Any, schema: Mapping[str, Any], path: str = "") -> list[str]:
    """Drop fields the schema does not declare (in place); returns their paths."""
    dropped: list[str] = []
    if schema.get("x-kubernetes-preserve-unknown-fields") is True:
        return dropped
    if isinstance(value, dict):
        props = schema.get("properties")
        add = schema.get("additionalProperties")
        for k in list(value):
            sub_path = _join(path, k)
            if path == "" and k == "metadata":
                continue  # ObjectMeta is the API server's, never pruned by a CRD schema
            if props is not None and k in props:
                dropped += prune(value[k], props[k], sub_path)
            elif isinstance(add, Mapping):
                dropped += prune(value[k], add, sub_path)
            elif path == "" and k in ("apiVersion", "kind"):
                continue
            else:
                del value[k]
                dropped.append(sub_path)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            dropped += prune(item, schema["items"], f"{path}[{i}]")
    return dropped


# ----------------------------------------------------------------------------- validate


def _type_ok(value: Any, t: str) -> bool:
    if t == "object":
        return isinstance(value, dict)
    if t == "array":
        return isinstance(value, list)
    if t == "string":
        return isinstance(value, str)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return False


def _date_time_ok(s: str) -> bool:
    try:
        datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        return False
    return "T" in s


def validate(
    value: Any,
    schema: Mapping[str, Any],
    *,
    path: str = "",
    old: Any = None,
    rules: bool = True,
) -> list[Cause]:
    """Validate ``value`` against a structural schema; returns every failure.

    Args:
        value: the (defaulted, pruned) value.
        schema: its schema node.
        path: dotted path of ``value`` for messages.
        old: the previous value on update (for transition rules), None on create.
        rules: also evaluate ``x-kubernetes-validations`` CEL rules (only where the value
            passed the schema's other checks).
    """
    where = path or "<root>"
    if value is None:
        if schema.get("nullable"):
            return []
        return [Cause(where, "must not be null", "FieldValueTypeInvalid")]
    t = schema.get("type")
    if t is not None and not _type_ok(value, t):
        return [
            Cause(
                where, f"must be of type {t}, got {type(value).__name__}", "FieldValueTypeInvalid"
            )
        ]
    causes = _scalar_causes(value, schema, where)
    if isinstance(value, dict):
        causes += _object_causes(value, schema, path, old, rules)
    if isinstance(value, list):
        causes += _list_causes(value, schema, path, old, rules)
    if rules and not causes:
        causes += _rule_causes(value, schema, where, old)
    return causes


def _scalar_causes(value: Any, schema: Mapping[str, Any], where: str) -> list[Cause]:
    """``enum``, the bounds of a number, and the length, pattern and format of a string."""
    causes: list[Cause] = []
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(repr(v) for v in schema["enum"])
        causes.append(
            Cause(
                where, f"unsupported value {value!r}: allowed {allowed}", "FieldValueNotSupported"
            )
        )
    if isinstance(value, int | float) and not isinstance(value, bool):
        lo = schema.get("minimum")
        if lo is not None:
            if schema.get("exclusiveMinimum") and value <= lo:
                causes.append(Cause(where, f"must be greater than {lo}"))
            elif value < lo:
                causes.append(Cause(where, f"must be greater than or equal to {lo}"))
        hi = schema.get("maximum")
        if hi is not None and value > hi:
            causes.append(Cause(where, f"must be less than or equal to {hi}"))
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            causes.append(
                Cause(where, f"may not be longer than {schema['maxLength']}", "FieldValueTooLong")
            )
        if "minLength" in schema and len(value) < schema["minLength"]:
            causes.append(Cause(where, f"must be at least {schema['minLength']} characters"))
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            causes.append(Cause(where, f"{value!r} does not match {schema['pattern']!r}"))
        if schema.get("format") == "date-time" and not _date_time_ok(value):
            causes.append(Cause(where, f"{value!r} is not an RFC 3339 date-time"))
    return causes


def _object_causes(
    value: dict[str, Any], schema: Mapping[str, Any], path: str, old: Any, rules: bool
) -> list[Cause]:
    """Required properties, ``maxProperties``, and every property against its schema."""
    causes: list[Cause] = []
    props = schema.get("properties") or {}
    for name in schema.get("required") or []:
        if name not in value:
            causes.append(Cause(_join(path, name), "Required value", "FieldValueRequired"))
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        causes.append(
            Cause(
                path or "<root>",
                f"must have at most {schema['maxProperties']} entries",
                "FieldValueTooMany",
            )
        )
    old_map = old if isinstance(old, dict) else {}
    for k, v in value.items():
        if k in props:
            causes += validate(v, props[k], path=_join(path, k), old=old_map.get(k), rules=rules)
        elif isinstance(schema.get("additionalProperties"), Mapping):
            causes += validate(
                v,
                schema["additionalProperties"],
                path=_join(path, k),
                old=old_map.get(k),
                rules=rules,
            )
    return causes


def _list_causes(
    value: list[Any], schema: Mapping[str, Any], path: str, old: Any, rules: bool
) -> list[Cause]:
    """Item counts, duplicates of a ``set`` or ``map`` list, and every item against the
    item schema (a ``map`` list's items against the old item of the same key)."""
    causes: list[Cause] = []
    where = path or "<root>"
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        causes.append(
            Cause(where, f"must have at most {schema['maxItems']} items", "FieldValueTooMany")
        )
    if "minItems" in schema and len(value) < schema["minItems"]:
        causes.append(Cause(where, f"must have at least {schema['minItems']} items"))
    items = schema.get("items")
    lt = schema.get("x-kubernetes-list-type")
    keys = schema.get("x-kubernetes-list-map-keys") or []
    old_by_key: dict[tuple[Any, ...], Any] = {}
    if lt == "map" and isinstance(old, list):
        old_by_key = {tuple(o.get(k) for k in keys): o for o in old if isinstance(o, dict)}
    seen: set[Any] = set()
    for i, item in enumerate(value):
        ipath = f"{path}[{i}]"
        if lt == "set":
            marker = repr(item)
            if marker in seen:
                causes.append(Cause(ipath, f"duplicate value {item!r}", "FieldValueDuplicate"))
            seen.add(marker)
        old_item = None
        if lt == "map" and isinstance(item, dict):
            key = tuple(item.get(k) for k in keys)
            if key in seen:
                causes.append(
                    Cause(
                        ipath,
                        f"duplicate entry with key {dict(zip(keys, key, strict=True))}",
                        "FieldValueDuplicate",
                    )
                )
            seen.add(key)
            old_item = old_by_key.get(key)
        if isinstance(items, Mapping):
            causes += validate(item, items, path=ipath, old=old_item, rules=rules)
    return causes


def _rule_causes(value: Any, schema: Mapping[str, Any], where: str, old: Any) -> list[Cause]:
    """The node's ``x-kubernetes-validations`` CEL rules; transition rules (``oldSelf``)
    only on update."""
    causes: list[Cause] = []
    for r in schema.get("x-kubernetes-validations") or []:
        transition = uses_old_self(r["rule"])
        if transition and old is None:
            continue
        try:
            ok = evaluate(r["rule"], value, old if transition else None)
        except CelError as exc:
            causes.append(Cause(where, f"rule {r['rule']!r} failed to evaluate: {exc}"))
            continue
        if not ok:
            causes.append(Cause(where, r.get("message") or f"failed rule: {r['rule']}"))
    return causes


def drop_nulls(value: Any, schema: Mapping[str, Any] | None) -> Any:
    """Remove ``null`` values of fields that are not ``nullable`` (in place), as the API
    server does before defaulting."""
    if isinstance(value, dict):
        props = (schema or {}).get("properties") or {}
        add = (schema or {}).get("additionalProperties")
        for k in list(value):
            sub = props.get(k) if k in props else add if isinstance(add, Mapping) else None
            if value[k] is None and not (sub or {}).get("nullable"):
                del value[k]
            else:
                drop_nulls(value[k], sub)
    elif isinstance(value, list):
        items = (schema or {}).get("items")
        for item in value:
            drop_nulls(item, items if isinstance(items, Mapping) else None)
    return value


def admit(
    obj: Json, schema: Mapping[str, Any], *, old: Json | None = None
) -> tuple[Json, list[str], list[Cause]]:
    """What the API server does to a custom resource on a write: drop nulls, default,
    prune, validate.

    Returns:
        ``(object, dropped_field_paths, causes)``; the object is a defaulted, pruned copy.
    """
    out = copy.deepcopy(obj)
    drop_nulls(out, schema)
    apply_defaults(out, schema)
    dropped = prune(out, schema)
    causes = validate(out, schema, old=old)
    return out, dropped, causes
