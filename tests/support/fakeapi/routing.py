"""URL routing and API discovery of the fake API server: which resource a path names, and
the discovery documents (``/api``, ``/apis``, ``/api/v1``, ``/apis/GROUP/VERSION``) that
clients such as ``kubectl`` read to map a kind to its resource before they write, with the
part of ``/openapi/v3`` kubectl's ``--validate=strict`` reads to learn that PATCH takes
``fieldValidation`` (then it leaves validation to the server)."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import unquote

from support.fakeapi.errors import ApiStatusError, Json
from support.fakeapi.resources import ResourceType

Types = Mapping[tuple[str, str, str], ResourceType]


def _not_found(path: str) -> ApiStatusError:
    return ApiStatusError(
        404, "NotFound", f"the server could not find the requested resource {path}"
    )


def route(types: Types, path: str) -> tuple[ResourceType, str, str | None, str | None]:
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
        raise _not_found(path)
    ns = ""
    if len(rest) >= 2 and rest[0] == "namespaces":
        ns, rest = rest[1], rest[2:]
    if not rest:
        raise _not_found(path)
    rt = types.get((group, version, rest[0]))
    if rt is None:
        raise _not_found(path)
    if ns and not rt.namespaced:
        raise ApiStatusError(404, "NotFound", f"{rt.plural} is not namespaced")
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    if sub is not None and not (sub == "status" and rt.status_subresource):
        raise ApiStatusError(404, "NotFound", f"no subresource {sub!r} on {rt.plural}")
    if name is not None and rt.namespaced and not ns:
        raise ApiStatusError(404, "NotFound", f"{rt.plural} is namespaced: use /namespaces/NS/")
    return rt, ns, name, sub


_VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


def _resource_list(types: Types, group: str, version: str) -> Json:
    resources: list[Json] = []
    for (g, v, _), rt in sorted(types.items()):
        if (g, v) != (group, version):
            continue
        resources.append(
            {
                "name": rt.plural,
                "singularName": rt.kind.lower(),
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": _VERBS,
            }
        )
        if rt.status_subresource:
            resources.append(
                {
                    "name": f"{rt.plural}/status",
                    "singularName": "",
                    "namespaced": rt.namespaced,
                    "kind": rt.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }


def _openapi_group(types: Types, group: str, version: str) -> Json:
    """An OpenAPI v3 document of one group version: each resource's PATCH operation with
    its group-version-kind and query parameters (schemas are not served)."""
    paths: Json = {}
    for (g, v, _), rt in sorted(types.items()):
        if (g, v) != (group, version):
            continue
        base = f"/apis/{g}/{v}" if g else f"/api/{v}"
        ns = "/namespaces/{namespace}" if rt.namespaced else ""
        paths[f"{base}{ns}/{rt.plural}/{{name}}"] = {
            "patch": {
                "x-kubernetes-group-version-kind": {"group": g, "version": v, "kind": rt.kind},
                "parameters": [
                    {"name": q, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
                    for q in ("dryRun", "fieldManager", "fieldValidation", "force")
                ],
                "responses": {"200": {"description": "OK"}},
            }
        }
    return {"openapi": "3.0.0", "info": {"title": "fake", "version": "v0"}, "paths": paths}


def discovery(types: Types, path: str) -> Json | None:
    """The legacy (unaggregated) discovery document of ``path``, or None when ``path`` is
    not a discovery path. Groups and versions are those of the served resources."""
    parts = [p for p in path.strip("/").split("/") if p]
    groups = sorted({(g, v) for g, v, _ in types if g})
    if parts == ["api"]:
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
    if parts == ["apis"]:
        out = []
        for g in sorted({g for g, _ in groups}):
            versions = [{"groupVersion": f"{g}/{v}", "version": v} for gg, v in groups if gg == g]
            out.append({"name": g, "versions": versions, "preferredVersion": versions[0]})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": out}
    if parts == ["api", "v1"]:
        return _resource_list(types, "", "v1")
    if parts == ["openapi", "v3"]:
        gvs = [("", "v1"), *groups]
        return {
            "paths": {
                (f"apis/{g}/{v}" if g else "api/v1"): {
                    "serverRelativeURL": f"/openapi/v3/{f'apis/{g}/{v}' if g else 'api/v1'}"
                }
                for g, v in gvs
            }
        }
    if parts[:2] == ["openapi", "v3"] and len(parts) in (4, 5):
        group, version = ("", parts[3]) if parts[2] == "api" else (parts[3], parts[4])
        return _openapi_group(types, group, version)
    if len(parts) == 3 and parts[0] == "apis" and (parts[1], parts[2]) in groups:
        return _resource_list(types, parts[1], parts[2])
    return None
