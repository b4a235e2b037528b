"""Field ownership (``metadata.managedFields``) and the steps of server-side apply.

A manager is ``(name, operation, subresource)``: ``operation`` is ``Update`` for create,
PUT and PATCH, ``Apply`` for server-side apply. :func:`update_managers` moves the fields an
update changed to its manager. Server-side apply (``FakeApiServer.apply``) takes these
steps: :func:`check_apply_request`, :func:`applied_configuration`,
:func:`claim_fields` (409 Conflict on a field another manager owns with a different
value, unless ``force``), :func:`merge_configuration`, then :func:`drop_unapplied`
removes the fields the manager applied before and no longer does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from support.fakeapi.errors import ApiStatusError, Json
from support.fakeapi.fields import (
    META_SCHEMA,
    META_TRACKED,
    MISSING,
    Path,
    child_schema,
    dotted,
    leaves,
    merge_applied,
    object_fields,
    remove_at,
    value_at,
)
from support.fakeapi.resources import ResourceType
from support.structural import Cause

Manager = tuple[str, str, str]
"""A field manager: (name, operation ``Update`` | ``Apply``, subresource or "")."""

Managers = dict[Manager, set[Path]]
"""The fields each manager owns."""


def update_managers(
    rt: ResourceType,
    managers: Mapping[Manager, set[Path]],
    old: Json | None,
    new: Json,
    manager: str,
    scope: str,
) -> Managers:
    """Ownership after an update from ``old`` to ``new`` by ``manager``: fields it removed
    leave every manager, leaves it changed leave the other managers, and it owns every
    field it added or changed. Managers left owning nothing are dropped."""
    out = {k: set(v) for k, v in managers.items()}
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
    for k in out:
        out[k] -= removed
        if k != mine:
            out[k] -= changed & new_leaves
    out.setdefault(mine, set()).update(changed)
    return {k: v for k, v in out.items() if v}


def check_apply_request(rt: ResourceType, name: str, body: Json, manager: str) -> None:
    """An apply names its field manager, the resource's apiVersion and kind, and the name
    of the URL, and carries no managedFields.

    Raises:
        ApiStatusError: 422 without a field manager, else 400.
    """
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


def applied_configuration(rt: ResourceType, body: Json, sub: str) -> Json:
    """The part of an apply body its manager owns: metadata's tracked fields and the rest
    of the object, less ``status`` (main resource) or only ``status`` (``sub`` "status")."""
    meta = body.get("metadata") or {}
    applied = {k: v for k, v in body.items() if k not in ("apiVersion", "kind")}
    applied["metadata"] = {k: v for k, v in meta.items() if k in META_TRACKED}
    if rt.status_subresource:
        if sub:
            applied = {
                "metadata": {},
                **({"status": body["status"]} if "status" in body else {}),
            }
        else:
            applied.pop("status", None)
    return applied


def manager_text(manager: Manager, api_version: str) -> str:
    """A manager as kube-apiserver names it in a conflict (``printManager`` of its field
    manager): ``"admin"``, ``"x" with subresource "status"``, and for an ``Update``
    (create, PUT, PATCH) ``... using mixfleet.io/v1alpha1``. Never a time: the server
    builds the manager identifier without it (apimachinery's
    ``managedfields/internal/managedfields.go``, ``BuildManagerIdentifier``: "Never include
    the time in the manager identifier"), so ``printManager`` has none to print."""
    name, operation, sub = manager
    out = f'"{name}"'
    if sub:
        out += f' with subresource "{sub}"'
    if operation == "Update":
        out += f" using {api_version}"
    return out


def claim_fields(
    rt: ResourceType,
    applied: Json,
    applied_fields: set[Path],
    live: Json,
    managers: Managers,
    mine: Manager,
    force: bool,
) -> None:
    """Check the applied leaves against the live values: a leaf another manager owns with
    a different value is a conflict; with ``force`` it is taken from that manager instead
    (``managers`` is changed in place).

    Raises:
        ApiStatusError: 409 Conflict as kube-apiserver words it (its ``conflict.go``): one
            cause per field (``FieldManagerConflict``, ``conflict with MANAGER``), and the
            message ``Apply failed with 1 conflict: conflict with MANAGER: PATH`` or
            ``Apply failed with N conflicts: conflicts with MANAGER:\n- PATH...`` by manager.
    """
    conflicts: list[tuple[str, Path]] = []
    for p in sorted(leaves(applied_fields)):
        av = value_at(applied, p)
        lv = value_at(live, p)
        if lv is MISSING or lv == av:
            continue
        for k, paths in sorted(managers.items()):
            if k != mine and p in paths:
                if force:
                    paths.discard(p)
                else:
                    conflicts.append((manager_text(k, rt.api_version), p))
    if conflicts:
        causes = [
            Cause(dotted(p), f"conflict with {who}", "FieldManagerConflict") for who, p in conflicts
        ]
        if len(conflicts) == 1:
            who, p = conflicts[0]
            message = f"Apply failed with 1 conflict: conflict with {who}: {dotted(p)}"
        else:
            lines: list[str] = []
            for who in sorted({w for w, _ in conflicts}):
                lines.append(f"conflicts with {who}:")
                lines += [f"- {dotted(p)}" for w, p in conflicts if w == who]
            message = f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)
        raise ApiStatusError(409, "Conflict", message, causes)


def merge_configuration(rt: ResourceType, live: Json, applied: Json) -> Json:
    """The live object with the applied configuration merged in (a new object)."""
    merged = copy.deepcopy(live)
    for field_name, v in applied.items():
        if field_name == "metadata":
            for mk, mv in v.items():
                merged["metadata"][mk] = (
                    merge_applied(
                        merged["metadata"].get(mk, MISSING),
                        mv,
                        META_SCHEMA["properties"][mk],
                    )
                    if mk in merged["metadata"]
                    else copy.deepcopy(mv)
                )
        else:
            merged[field_name] = (
                merge_applied(merged[field_name], v, child_schema(rt.schema, field_name))
                if field_name in merged
                else copy.deepcopy(v)
            )
    return merged


def drop_unapplied(
    merged: Json, managers: Mapping[Manager, set[Path]], mine: Manager, applied_fields: set[Path]
) -> None:
    """Remove from ``merged`` (in place) the fields ``mine`` applied before and no longer
    does, unless another manager owns them or something inside them; a removed map-list
    element or object goes whole."""
    others: set[Path] = set()
    for k, owned in managers.items():
        if k != mine:
            others |= owned
    removable = {
        p
        for p in managers.get(mine, set()) - applied_fields
        if not any(o[: len(p)] == p for o in others)
    }
    for p in sorted(removable, key=len):
        if not any(p[:i] in removable for i in range(1, len(p))):
            remove_at(merged, p)
