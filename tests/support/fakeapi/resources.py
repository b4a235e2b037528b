"""The resources the fake API server serves: built-in ConfigMaps and Leases,
CustomResourceDefinitions, and custom resources read from their manifests."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from support.fakeapi.errors import Json


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


#: CustomResourceDefinitions themselves: a CRD written to the server is served once it is
#: established (:mod:`support.fakeapi.server`).
CRD_TYPE = ResourceType(
    "apiextensions.k8s.io",
    "v1",
    "customresourcedefinitions",
    "CustomResourceDefinition",
    False,
    {
        "type": "object",
        "properties": {
            "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    },
    status_subresource=True,
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


def crd_manifests(directory: str) -> list[Json]:
    """Load every CRD manifest in a directory (``charts/mixfleet/crds``)."""
    from pathlib import Path as FsPath

    docs = []
    for p in sorted(FsPath(directory).glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(p.read_text()) if d]
    return docs
