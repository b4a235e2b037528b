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

Modules: :mod:`~support.fakeapi.server` (state and verbs), :mod:`~support.fakeapi.handler`
(HTTP), :mod:`~support.fakeapi.admission`, :mod:`~support.fakeapi.ownership` and
:mod:`~support.fakeapi.fields` (server-side apply), :mod:`~support.fakeapi.patches`,
:mod:`~support.fakeapi.selectors`, :mod:`~support.fakeapi.resources`,
:mod:`~support.fakeapi.records`, :mod:`~support.fakeapi.errors`.
"""

from support.fakeapi.errors import ApiStatusError
from support.fakeapi.patches import json_merge_patch, json_patch
from support.fakeapi.records import Fault, RequestRecord
from support.fakeapi.resources import BUILTINS, ResourceType, crd_manifests, resource_from_crd
from support.fakeapi.selectors import parse_selector
from support.fakeapi.server import FakeApiServer

__all__ = [
    "BUILTINS",
    "ApiStatusError",
    "FakeApiServer",
    "Fault",
    "RequestRecord",
    "ResourceType",
    "crd_manifests",
    "json_merge_patch",
    "json_patch",
    "parse_selector",
    "resource_from_crd",
]
