"""Dataclasses as the one source of a CRD's schema and of its typed wire form.

A CRD's ``spec`` and ``status`` are declared once, as frozen dataclasses whose fields carry
their Kubernetes validation in ``dataclasses.field(metadata=k8s(...))`` (the Python
counterpart of kubebuilder's ``// +kubebuilder:validation`` markers). From that one
declaration this module derives:

* :func:`openapi_schema` - the structural OpenAPI v3 schema that goes into the CRD
  (types, descriptions, enums, minimums, patterns, defaults, list types, CEL rules);
* :func:`from_wire` - a typed, checked read of a wire dictionary into the dataclass;
* :func:`to_wire` - the dataclass back to a wire dictionary (camelCase keys, ``None`` left out).

Field names are snake_case in Python and camelCase on the wire (``tokens_per_gpu`` ->
``tokensPerGpu``) unless ``k8s(json_name=...)`` says otherwise. A field without a default
is required. ``X | None`` fields are optional and omitted from the wire when ``None``.

Supported field types: ``str``, ``int``, ``float``, ``bool``, nested dataclasses,
``tuple[T, ...]`` (arrays), ``Mapping[str, T]`` / ``dict[str, T]`` (string-keyed maps),
``dict[str, Any]`` (free-form objects, ``x-kubernetes-preserve-unknown-fields``) and
``T | None``. Dataclasses that do not use :func:`k8s` metadata (for instance the agent's
inventory types) are reflected too: descriptions then come from the ``Attributes:`` section
of the class docstring, and extra validation from the ``constraints`` argument.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.errors import InputError
from policies.keys import check_keys

Json = dict[str, Any]
T = typing.TypeVar("T")


@dataclass(frozen=True)
class Rule:
    """A CEL validation rule (``x-kubernetes-validations`` entry).

    Attributes:
        rule: the CEL expression; ``self`` is the value, ``oldSelf`` the previous value
            (a transition rule, checked on update only).
        message: what the API server answers when the rule fails.
    """

    rule: str
    message: str


@dataclass(frozen=True)
class Meta:
    """Kubernetes validation and naming of one dataclass field.

    Attributes:
        description: field documentation, with its unit.
        json_name: wire name; default is the camelCase of the Python name.
        enum: allowed values.
        minimum, maximum: numeric bounds (inclusive unless ``exclusive_minimum``).
        exclusive_minimum: the minimum itself is not allowed.
        pattern: regular expression a string must match (searched, anchor it).
        min_length, max_length: string length bounds, characters.
        min_items, max_items: array length bounds (bounding arrays keeps CEL costs low).
        max_properties: map size bound.
        format: OpenAPI format (``date-time``).
        list_type: ``atomic`` | ``set`` | ``map`` (server-side apply merges set and map
            lists element by element).
        list_map_keys: key fields of a ``map`` list.
        rules: CEL rules on this field.
        item_pattern, item_max_length: constraints on each string of a string array.
    """

    description: str = ""
    json_name: str | None = None
    enum: tuple[Any, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    pattern: str | None = None
    min_length: int | None = None
    max_length: int | None = None
    min_items: int | None = None
    max_items: int | None = None
    max_properties: int | None = None
    format: str | None = None
    list_type: str | None = None
    list_map_keys: tuple[str, ...] = ()
    rules: tuple[Rule, ...] = ()
    item_pattern: str | None = None
    item_max_length: int | None = None


_KEY = "k8s"


def k8s(description: str, **kwargs: Any) -> dict[str, Meta]:
    """Field metadata: ``field(default=..., metadata=k8s("what it is, unit", minimum=0))``."""
    return {_KEY: Meta(description, **kwargs)}


def camel(name: str) -> str:
    """``tokens_per_gpu`` -> ``tokensPerGpu``."""
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def wire_name(f: dataclasses.Field[Any]) -> str:
    """The wire (JSON) name of a dataclass field."""
    meta = f.metadata.get(_KEY)
    if isinstance(meta, Meta) and meta.json_name:
        return meta.json_name
    return camel(f.name)


# ------------------------------------------------------------------ docstring descriptions

_ATTR_LINE = re.compile(
    r"^(?P<names>[a-z_][a-z0-9_]*(\s*,\s*[a-z_][a-z0-9_]*)*)\s*:\s*(?P<text>.*)$"
)


def docstring_attributes(cls: type) -> dict[str, str]:
    """Descriptions from the ``Attributes:`` section of a Google-style class docstring.

    ``a, b: text`` lines document several fields; indented lines continue the previous one.
    """
    doc = cls.__doc__ or ""
    lines = doc.expandtabs().splitlines()
    out: dict[str, str] = {}
    in_section = False
    base_indent = -1
    current: list[str] = []
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stripped == "Attributes:":
            in_section = True
            base_indent = -1
            continue
        if not in_section:
            continue
        if not stripped:
            continue
        if base_indent < 0:
            base_indent = indent
        if indent < base_indent:
            break
        m = _ATTR_LINE.match(stripped)
        if indent == base_indent and m:
            current = [n.strip() for n in m.group("names").split(",")]
            for n in current:
                out[n] = m.group("text").strip()
        elif current:
            for n in current:
                out[n] = f"{out[n]} {stripped}"
    return {k: v.replace("``", "") for k, v in out.items()}


# ------------------------------------------------------------------------ type analysis


@dataclass(frozen=True)
class _Shape:
    """What a Python annotation means on the wire."""

    kind: str  # string | integer | number | boolean | object | array | map | free
    optional: bool = False
    item: _Shape | None = None  # array items, map values
    cls: type | None = None  # object: the dataclass


def _shape(tp: Any) -> _Shape:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"unsupported union {tp!r}: only X | None")
        return dataclasses.replace(_shape(rest[0]), optional=True)
    if tp is str:
        return _Shape("string")
    if tp is bool:
        return _Shape("boolean")
    if tp is int:
        return _Shape("integer")
    if tp is float:
        return _Shape("number")
    if tp is Any:
        return _Shape("free")
    if origin in (tuple, list, Sequence) or origin is typing.Sequence:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"unsupported tuple {tp!r}: use tuple[T, ...]")
        return _Shape("array", item=_shape(args[0]))
    if origin in (dict, Mapping) or origin is typing.Mapping:
        if args[0] is not str:
            raise TypeError(f"unsupported map key in {tp!r}: keys must be str")
        if args[1] is Any:
            return _Shape("free")
        return _Shape("map", item=_shape(args[1]))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _Shape("object", cls=tp)
    raise TypeError(f"unsupported field type {tp!r}")


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], _Shape]]:
    hints = typing.get_type_hints(cls)
    return [(f, _shape(hints[f.name])) for f in dataclasses.fields(cls)]


def _has_default(f: dataclasses.Field[Any]) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _default_value(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


# ------------------------------------------------------------------------ schema output

Constraints = Mapping[str, Meta]
"""Extra validation for fields of reflected classes, keyed ``ClassName.field``."""


def _meta_for(cls: type, f: dataclasses.Field[Any], constraints: Constraints) -> Meta:
    meta = f.metadata.get(_KEY)
    if isinstance(meta, Meta):
        return meta
    extra = constraints.get(f"{cls.__name__}.{f.name}")
    doc = docstring_attributes(cls).get(f.name, "")
    if extra is not None:
        return dataclasses.replace(extra, description=extra.description or doc)
    return Meta(doc)


def _apply_meta(schema: Json, meta: Meta, shape: _Shape) -> Json:
    if meta.description:
        schema["description"] = meta.description
    if meta.enum:
        schema["enum"] = list(meta.enum)
    if meta.minimum is not None:
        schema["minimum"] = meta.minimum
        if meta.exclusive_minimum:
            schema["exclusiveMinimum"] = True
    if meta.maximum is not None:
        schema["maximum"] = meta.maximum
    if meta.pattern is not None:
        schema["pattern"] = meta.pattern
    if meta.min_length is not None:
        schema["minLength"] = meta.min_length
    if meta.max_length is not None:
        schema["maxLength"] = meta.max_length
    if meta.min_items is not None:
        schema["minItems"] = meta.min_items
    if meta.max_items is not None:
        schema["maxItems"] = meta.max_items
    if meta.max_properties is not None:
        schema["maxProperties"] = meta.max_properties
    if meta.format is not None:
        schema["format"] = meta.format
    if meta.list_type is not None:
        if shape.kind != "array":
            raise TypeError("list_type on a non-array field")
        schema["x-kubernetes-list-type"] = meta.list_type
        if meta.list_type == "map":
            schema["x-kubernetes-list-map-keys"] = list(meta.list_map_keys)
    if meta.item_pattern is not None or meta.item_max_length is not None:
        items = schema.get("items")
        if shape.kind != "array" or not isinstance(items, dict) or items.get("type") != "string":
            raise TypeError("item_pattern / item_max_length need a string array")
        if meta.item_pattern is not None:
            items["pattern"] = meta.item_pattern
        if meta.item_max_length is not None:
            items["maxLength"] = meta.item_max_length
    if meta.rules:
        schema.setdefault("x-kubernetes-validations", []).extend(
            {"rule": r.rule, "message": r.message} for r in meta.rules
        )
    return schema


def _shape_schema(shape: _Shape, constraints: Constraints) -> Json:
    if shape.kind in ("string", "integer", "number", "boolean"):
        return {"type": shape.kind}
    if shape.kind == "free":
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    if shape.kind == "array":
        assert shape.item is not None
        return {"type": "array", "items": _shape_schema(shape.item, constraints)}
    if shape.kind == "map":
        assert shape.item is not None
        return {"type": "object", "additionalProperties": _shape_schema(shape.item, constraints)}
    assert shape.cls is not None
    return openapi_schema(shape.cls, constraints=constraints)


def openapi_schema(cls: type, *, constraints: Constraints | None = None) -> Json:
    """The structural OpenAPI v3 schema of a dataclass.

    Defaults of scalar and empty-collection fields become schema ``default`` values, so the
    API server and :func:`from_wire` fill in the same values. A class attribute
    ``K8S_RULES: ClassVar[tuple[Rule, ...]]`` adds object-level CEL rules;
    ``K8S_DEFAULT_EMPTY: ClassVar[bool] = False`` keeps a field of that class from the
    ``default: {}`` it would get (when the empty object fails those rules).
    """
    cons = constraints or {}
    props: dict[str, Json] = {}
    required: list[str] = []
    for f, shape in _fields(cls):
        meta = _meta_for(cls, f, cons)
        s = _apply_meta(_shape_schema(shape, cons), meta, shape)
        name = wire_name(f)
        if _has_default(f):
            default = _default_value(f)
            if dataclasses.is_dataclass(default):
                # The API server applies the nested defaults inside an empty object - unless
                # the class says the empty object fails its rules (``K8S_DEFAULT_EMPTY``):
                # the API server validates defaults against the CEL rules too.
                if getattr(type(default), "K8S_DEFAULT_EMPTY", True):
                    s["default"] = {}
            elif default is not None:
                wire = _to_wire_value(default)
                if wire != {} or shape.kind != "free":
                    s["default"] = wire
        elif not shape.optional:
            required.append(name)
        props[name] = s
    schema: Json = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    if doc and not doc.startswith(cls.__name__ + "("):
        schema["description"] = " ".join(doc.split())
    rules = getattr(cls, "K8S_RULES", ())
    if rules:
        schema["x-kubernetes-validations"] = [{"rule": r.rule, "message": r.message} for r in rules]
    return schema


# ---------------------------------------------------------------------------- wire I/O


def _to_wire_value(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return to_wire(v)
    if isinstance(v, Mapping):
        return {str(k): _to_wire_value(x) for k, x in v.items()}
    if isinstance(v, tuple | list):
        return [_to_wire_value(x) for x in v]
    return v


def to_wire(obj: Any) -> Json:
    """A dataclass instance as a wire dictionary (camelCase keys, ``None`` omitted)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_wire needs a dataclass instance, got {type(obj).__name__}")
    out: Json = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if v is None:
            continue
        out[wire_name(f)] = _to_wire_value(v)
    return out


def _read(shape: _Shape, value: Any, path: str, strict: bool = False) -> Any:
    if value is None:
        if shape.optional:
            return None
        raise InputError("must not be null", field=path)
    k = shape.kind
    if k == "string":
        if not isinstance(value, str):
            raise InputError(f"must be a string, got {value!r}", field=path)
        return value
    if k == "boolean":
        if not isinstance(value, bool):
            raise InputError(f"must be true or false, got {value!r}", field=path)
        return value
    if k == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise InputError(f"must be an integer, got {value!r}", field=path)
        return value
    if k == "number":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InputError(f"must be a number, got {value!r}", field=path)
        return float(value)
    if k == "free":
        if not isinstance(value, Mapping):
            raise InputError(f"must be an object, got {type(value).__name__}", field=path)
        return dict(value)
    if k == "array":
        if not isinstance(value, list | tuple):
            raise InputError(f"must be a list, got {type(value).__name__}", field=path)
        assert shape.item is not None
        return tuple(_read(shape.item, x, f"{path}[{i}]", strict) for i, x in enumerate(value))
    if k == "map":
        if not isinstance(value, Mapping):
            raise InputError(f"must be a map, got {type(value).__name__}", field=path)
        assert shape.item is not None
        return {str(key): _read(shape.item, x, f"{path}.{key}", strict) for key, x in value.items()}
    assert shape.cls is not None
    return from_wire(shape.cls, value, path, strict=strict)


def from_wire(cls: type[T], data: Any, path: str = "", *, strict: bool = False) -> T:
    """Read a wire dictionary into dataclass ``cls``; missing optional fields take their
    defaults.

    Args:
        cls: the dataclass.
        data: the wire dictionary.
        path: its field path, for messages.
        strict: refuse unknown keys at every level (what a user wrote: a custom resource's
            spec), naming the full path and the closest known key; otherwise they are
            ignored, as the API server prunes them (what mixfleet wrote itself: a status,
            which a newer version may extend).

    Raises:
        InputError: a required field is missing, a value has the wrong type, or (strict)
            a key is unknown; ``field`` is the wire path (``spec.workload.tokensPerGpu``).
    """
    if not isinstance(data, Mapping):
        raise InputError(f"must be an object, got {type(data).__name__}", field=path or "object")
    fields = _fields(cls)
    if strict:
        check_keys(data, {wire_name(f) for f, _ in fields}, path)
    kwargs: dict[str, Any] = {}
    for f, shape in fields:
        name = wire_name(f)
        fpath = f"{path}.{name}" if path else name
        if name not in data or data[name] is None:
            if _has_default(f):
                continue
            if shape.optional:
                kwargs[f.name] = None
                continue
            raise InputError("missing required field", field=fpath)
        kwargs[f.name] = _read(shape, data[name], fpath, strict)
    return cls(**kwargs)


def apply_defaults(value: Any, schema: Mapping[str, Any]) -> Any:
    """Fill absent fields that have a ``default``, recursively (in place; returns value), as
    the API server does before it stores an object (structural schema defaulting)."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                apply_defaults(value[name], sub)
        add = schema.get("additionalProperties")
        if isinstance(add, Mapping):
            for k in value:
                apply_defaults(value[k], add)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            apply_defaults(item, schema["items"])
    return value
