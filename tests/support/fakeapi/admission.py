"""Admission of a write, as kube-apiserver does it before storing an object.

* Subresource rules: a write to the main resource keeps the stored ``status``, a write to
  ``/status`` keeps everything else.
* Metadata rules: the server's fields (uid, resourceVersion, generation, timestamps) are
  carried over; the name must be a DNS subdomain; labels and annotations are strings; no
  new finalizers once the object is being deleted.
* Custom resources: defaults, pruning of unknown fields (reported as warnings), the
  structural schema and the CRD's CEL rules including transition rules
  (:func:`support.structural.admit`) -> 422 Invalid with causes.
"""

from __future__ import annotations

import copy
import re

from apis.kube.schema import apply_defaults
from support.fakeapi.errors import ApiStatusError, Json
from support.fakeapi.resources import ResourceType
from support.structural import Cause, admit, validate

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

#: ObjectMeta fields only the server sets: a write keeps the stored values.
_SERVER_META = (
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
)


def admit_object(
    rt: ResourceType, new: Json, old: Json | None, scope: str
) -> tuple[Json, list[str]]:
    """Apply subresource rules, metadata rules, defaults, pruning and validation.

    Args:
        rt: the resource.
        new: the object as written (not modified).
        old: the stored object, None on create.
        scope: ``main`` or ``status`` (the subresource written).

    Returns:
        The object to store (without apiVersion / kind) and the warnings to answer with.

    Raises:
        ApiStatusError: 422 Invalid.
    """
    new = copy.deepcopy(new)
    new.pop("apiVersion", None)
    new.pop("kind", None)
    new.setdefault("metadata", {}).pop("managedFields", None)
    if old is not None:
        new = _carry_over(rt, new, old, scope)
        _check_no_new_finalizers(new["metadata"], old["metadata"])
    elif rt.status_subresource:
        new.pop("status", None)
    meta = new["metadata"]
    name = str(meta.get("name") or "")
    _check_metadata(meta, name)
    if rt.custom:
        return _admit_custom(rt, new, old, name)
    body = {k: v for k, v in new.items() if k != "metadata"}
    admitted, _dropped, causes = admit(body, rt.schema)
    if causes:
        raise ApiStatusError(422, "Invalid", "; ".join(str(c) for c in causes[:10]), causes)
    if rt.plural == "customresourcedefinitions" and scope == "main":
        _check_crd_defaults(admitted, name)
    return {"metadata": meta, **admitted}, []


def _check_crd_defaults(crd: Json, name: str) -> None:
    """A CRD whose schema defaults fail validation (their own schema or its CEL rules) is
    refused, as kube-apiserver refuses it: ``CustomResourceDefinition.apiextensions.k8s.io
    "NAME" is invalid: spec.validation.openAPIV3Schema.properties[spec]...default: Invalid
    value: MESSAGE`` (several: ``[A, B]``)."""
    causes: list[Cause] = []
    for version in (crd.get("spec") or {}).get("versions") or []:
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if isinstance(schema, dict):
            causes += _default_causes(schema, "spec.validation.openAPIV3Schema")
    if causes:
        # Go's error aggregate: one error as it is, several in brackets.
        detail = str(causes[0]) if len(causes) == 1 else f"[{', '.join(map(str, causes))}]"
        raise ApiStatusError(
            422,
            "Invalid",
            f'CustomResourceDefinition.apiextensions.k8s.io "{name}" is invalid: {detail}',
            causes,
        )


def _default_causes(schema: Json, where: str) -> list[Cause]:
    """``default: Invalid value`` causes of every default below ``schema`` that fails it."""
    causes: list[Cause] = []
    if "default" in schema:
        sub = {k: v for k, v in schema.items() if k != "default"}
        value = apply_defaults(copy.deepcopy(schema["default"]), sub)
        for c in validate(value, sub):
            causes.append(Cause(f"{where}.default", f"Invalid value: {c.message}"))
    for key, sub in (schema.get("properties") or {}).items():
        causes += _default_causes(sub, f"{where}.properties[{key}]")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            causes += _default_causes(schema[key], f"{where}.{key}")
    return causes


def _carry_over(rt: ResourceType, new: Json, old: Json, scope: str) -> Json:
    """What an update keeps of the stored object: the part of it the written subresource
    does not cover, and the server's metadata fields."""
    if scope == "status" and rt.status_subresource:
        status = new.get("status")
        new = copy.deepcopy({k: v for k, v in old.items() if k != "status"})
        if status is not None:
            new["status"] = status
    elif rt.status_subresource:
        new.pop("status", None)
        if "status" in old:
            new["status"] = copy.deepcopy(old["status"])
    meta, om = new["metadata"], old["metadata"]
    for k in _SERVER_META:
        if k in om:
            meta[k] = om[k]
        else:
            meta.pop(k, None)
    return new


def _check_no_new_finalizers(meta: Json, old_meta: Json) -> None:
    """An object being deleted takes no new finalizers."""
    if not old_meta.get("deletionTimestamp"):
        return
    added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
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


def _check_metadata(meta: Json, name: str) -> None:
    """The name is a DNS subdomain; label and annotation values are strings."""
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


def _admit_custom(
    rt: ResourceType, new: Json, old: Json | None, name: str
) -> tuple[Json, list[str]]:
    """A custom resource: the schema's name length, then defaults, pruning (unknown fields
    become warnings) and validation against the stored object (transition rules)."""
    meta = new["metadata"]
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
    old_body = {k: v for k, v in old.items() if k != "metadata"} if old is not None else None
    admitted, dropped, more = admit(body, rt.schema, old=old_body)
    causes += more
    if causes:
        detail = "; ".join(str(c) for c in causes[:10])
        raise ApiStatusError(
            422, "Invalid", f'{rt.kind}.{rt.group} "{name}" is invalid: {detail}', causes
        )
    warnings = [f'unknown field "{p}"' for p in dropped]
    return {"metadata": meta, **admitted}, warnings
