"""A small, typed door to the Kubernetes API over the official Python client.

Everything the operator (and the Kubernetes store of the controller) does with the API
goes through :class:`Kube`: get, list, watch, create, server-side apply, JSON merge
patch, delete. Objects are plain wire dictionaries; errors are the operator's own
(:mod:`apis.kube.errors`) with the client's exception chained. The client's configuration
(kubeconfig or in-cluster service account, TLS, bearer tokens) is used unchanged.

Every write first asks ``write_guard`` - the leader elector - so a replica that lost its
lease cannot write even if a reconcile was already under way.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import urllib3
from kubernetes import client as k8s_client

from apis.kube.errors import (
    ApiError,
    ConflictError,
    CrdMissingError,
    GoneError,
    InvalidError,
    KubeConfigError,
    NotFoundError,
    NotLeaderError,
    UnavailableError,
)
from apis.kube.v1alpha1 import (
    GPUNODE,
    GROUP,
    MODEL_DEPLOYMENT,
    PARTITION_PLAN,
    PLACEMENT_POLICY,
    VERSION,
    CrdDef,
)

Json = dict[str, Any]
APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class Resource:
    """A REST resource.

    Attributes:
        group: API group, ``""`` for the core group.
        version: API version (``v1``, ``v1alpha1``).
        plural: resource name in URLs.
        kind: object kind.
        namespaced: objects live in a namespace.
    """

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        """URL path: ``/apis/G/V[/namespaces/NS]/PLURAL[/NAME[/SUB]]``."""
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{quote(namespace, safe='')}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{quote(name, safe='')}"
            if subresource:
                base += f"/{subresource}"
        return base


def crd_resource(crd: CrdDef) -> Resource:
    """The REST resource of one of mixfleet's CRDs."""
    return Resource(GROUP, VERSION, crd.plural, crd.kind, crd.namespaced)


GPUNODES = crd_resource(GPUNODE)
PLACEMENT_POLICIES = crd_resource(PLACEMENT_POLICY)
MODEL_DEPLOYMENTS = crd_resource(MODEL_DEPLOYMENT)
PARTITION_PLANS = crd_resource(PARTITION_PLAN)
#: Every resource of mixfleet's CRDs.
MIXFLEET_RESOURCES = (GPUNODES, PLACEMENT_POLICIES, MODEL_DEPLOYMENTS, PARTITION_PLANS)
CONFIGMAPS = Resource("", "v1", "configmaps", "ConfigMap", True)
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease", True)


@dataclass(frozen=True)
class WatchEvent:
    """One watch event: ``ADDED`` | ``MODIFIED`` | ``DELETED`` | ``BOOKMARK`` and the object."""

    type: str
    object: Json

    @property
    def resource_version(self) -> str:
        return str(self.object.get("metadata", {}).get("resourceVersion", ""))


def _error_from(status: int, body: bytes | str | None, fallback: str) -> ApiError:
    reason, message, causes = fallback, fallback, []
    try:
        doc = json.loads(body) if body else {}
    except (ValueError, TypeError):
        doc = {}
    if isinstance(doc, Mapping):
        reason = str(doc.get("reason") or fallback)
        message = str(doc.get("message") or message)
        details = doc.get("details") or {}
        for c in details.get("causes") or [] if isinstance(details, Mapping) else []:
            causes.append(f"{c.get('field', '')}: {c.get('message', '')}")
    if status == 404:
        return NotFoundError(status, reason, message, causes)
    if status == 409:
        return ConflictError(status, reason, message, causes)
    if status == 410:
        return GoneError(status, reason, message, causes)
    if status == 422:
        return InvalidError(status, reason, message, causes)
    if status == 0 or status == 429 or status >= 500:
        return UnavailableError(status, reason, message, causes)
    return ApiError(status, reason, message, causes)


class Kube:
    """Typed access to the API server.

    Args:
        api_client: a configured ``kubernetes.client.ApiClient``.
        field_manager: server-side apply field manager of this writer.
        write_guard: called before every write; returns False when this replica must not
            write (it is not the leader). Default: always allowed.
        request_timeout_s: timeout of one non-watch request, seconds.
    """

    def __init__(
        self,
        api_client: Any,
        *,
        field_manager: str,
        write_guard: Callable[[], bool] | None = None,
        request_timeout_s: float = 30.0,
    ) -> None:
        self.api_client = api_client
        self.field_manager = field_manager
        self.write_guard = write_guard
        self.request_timeout_s = request_timeout_s
        self._lock = threading.Lock()
        #: writes done, by ``"VERB plural"`` (for tests and metrics).
        self.writes: Counter[str] = Counter()

    # ------------------------------------------------------------------ transport

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        body: Any = None,
        content_type: str | None = None,
        timeout: float | tuple[float, float] | None = None,
        stream: bool = False,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        elif body is not None:
            headers["Content-Type"] = "application/json"
        try:
            m, url, hdrs, data, _ = self.api_client.param_serialize(
                method=method,
                resource_path=path,
                query_params=list(query) or None,
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            resp = self.api_client.call_api(
                m,
                url,
                header_params=hdrs,
                body=data,
                _request_timeout=timeout or self.request_timeout_s,
            )
        except k8s_client.exceptions.ApiException as exc:
            raise _error_from(int(exc.status or 0), exc.body, str(exc.reason)) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise UnavailableError(0, "Unavailable", f"{method} {path}: {exc}") from exc
        if stream and 200 <= resp.status < 300:
            return resp
        try:
            raw = resp.read()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise UnavailableError(0, "Unavailable", f"{method} {path}: {exc}") from exc
        if not 200 <= resp.status < 300:
            raise _error_from(resp.status, raw, str(resp.reason))
        return json.loads(raw) if raw else {}

    def _guard(self, verb: str, res: Resource) -> None:
        if self.write_guard is not None and not self.write_guard():
            raise NotLeaderError(f"not the leader: refusing {verb} {res.plural}")
        with self._lock:
            self.writes[f"{verb} {res.plural}"] += 1

    # ---------------------------------------------------------------------- reads

    def get(self, res: Resource, name: str, namespace: str | None = None) -> Json | None:
        """The object, or None when it does not exist."""
        try:
            out: Json = self._request("GET", res.path(namespace, name))
        except NotFoundError:
            return None
        return out

    def list(
        self,
        res: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
    ) -> tuple[list[Json], str]:
        """Objects (in a namespace, or all) and the list's resourceVersion.

        Raises:
            CrdMissingError: a mixfleet.io resource the API server does not serve.
        """
        query = [("labelSelector", label_selector)] if label_selector else []
        try:
            doc = self._request("GET", res.path(namespace), query=query)
        except NotFoundError as exc:
            raise crd_missing(res, exc) from exc
        items = [dict(i, apiVersion=res.api_version, kind=res.kind) for i in doc.get("items") or []]
        return items, str((doc.get("metadata") or {}).get("resourceVersion", ""))

    def watch(
        self,
        res: Resource,
        resource_version: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        timeout_s: int = 300,
        stop: threading.Event | None = None,
    ) -> Iterator[WatchEvent]:
        """Events after ``resource_version`` until the server ends the watch.

        Raises:
            GoneError: the resourceVersion is too old (list again, then watch).
        """
        query = [
            ("watch", "true"),
            ("resourceVersion", resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(timeout_s)),
        ]
        if label_selector:
            query.append(("labelSelector", label_selector))
        try:
            resp = self._request(
                "GET",
                res.path(namespace),
                query=query,
                timeout=(10.0, timeout_s + 30.0),
                stream=True,
            )
        except NotFoundError as exc:
            raise crd_missing(res, exc) from exc
        finished = False
        try:
            buf = b""
            for chunk in resp.response.stream(amt=None, decode_content=True):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    ev = json.loads(line)
                    obj = ev.get("object") or {}
                    if ev.get("type") == "ERROR":
                        raise _error_from(int(obj.get("code") or 0), json.dumps(obj), "Error")
                    yield WatchEvent(str(ev.get("type")), obj)
                if stop is not None and stop.is_set():
                    return
            finished = True
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise UnavailableError(0, "Unavailable", f"watch {res.plural}: {exc}") from exc
        finally:
            # A stream left half-read must not go back to the connection pool.
            if finished:
                resp.response.release_conn()
            else:
                resp.response.close()

    # --------------------------------------------------------------------- writes

    def create(self, res: Resource, body: Json) -> Json:
        """Create an object (409 ``AlreadyExists`` raises :class:`ConflictError`)."""
        self._guard("create", res)
        ns = body.get("metadata", {}).get("namespace")
        out: Json = self._request(
            "POST", res.path(ns), body=body, query=[("fieldManager", self.field_manager)]
        )
        return out

    def apply(
        self,
        res: Resource,
        body: Json,
        *,
        subresource: str | None = None,
        force: bool = False,
    ) -> Json:
        """Server-side apply ``body`` under this client's field manager.

        ``body`` is the full intent of this manager for the object (or its status): fields
        it applied before and leaves out now are removed, and it owns only the fields it
        sends. Without ``force`` a field another manager owns with a different value is a
        409 (:class:`ConflictError` listing the fields and their managers), as for
        ``kubectl apply --server-side``: what a user edits (a ModelDeployment's or a
        GPUNode's spec) is applied without it. ``force`` takes such fields over; writers use
        it only for fields they alone are the authority for (their status, their own
        ConfigMaps), as the Kubernetes documentation recommends for controllers.
        """
        self._guard(f"apply{'/' + subresource if subresource else ''}", res)
        meta = body.get("metadata", {})
        query = [("fieldManager", self.field_manager)]
        if force:
            query.append(("force", "true"))
        out: Json = self._request(
            "PATCH",
            res.path(meta.get("namespace"), meta["name"], subresource),
            query=query,
            body=dict(body, apiVersion=res.api_version, kind=res.kind),
            content_type=APPLY_PATCH,
        )
        return out

    def merge_patch(
        self,
        res: Resource,
        name: str,
        patch: Json,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
    ) -> Json:
        """JSON merge patch; put ``metadata.resourceVersion`` in the patch for an
        optimistic-concurrency precondition (stale: :class:`ConflictError`)."""
        self._guard("patch", res)
        out: Json = self._request(
            "PATCH",
            res.path(namespace, name, subresource),
            query=[("fieldManager", self.field_manager)],
            body=patch,
            content_type=MERGE_PATCH,
        )
        return out

    def replace(self, res: Resource, body: Json) -> Json:
        """PUT the whole object (needs ``metadata.resourceVersion`` for CRDs)."""
        self._guard("update", res)
        meta = body["metadata"]
        out: Json = self._request(
            "PUT",
            res.path(meta.get("namespace"), meta["name"]),
            body=body,
            query=[("fieldManager", self.field_manager)],
        )
        return out

    def delete(
        self,
        res: Resource,
        name: str,
        namespace: str | None = None,
        *,
        uid: str | None = None,
        propagation: str = "Background",
    ) -> bool:
        """Delete; False when it was already gone. ``uid`` is a precondition."""
        self._guard("delete", res)
        body: Json = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self._request("DELETE", res.path(namespace, name), body=body)
        except NotFoundError:
            return False
        return True


def crd_missing(res: Resource, exc: NotFoundError) -> NotFoundError:
    """What a 404 on a collection means: for a mixfleet.io resource, that its CRD is not
    installed (a :class:`CrdMissingError` that says so and how to install them); for others
    ``exc`` as it is."""
    if res.group != GROUP:
        return exc
    crds = ", ".join(f"{r.plural}.{GROUP}" for r in MIXFLEET_RESOURCES)
    return CrdMissingError(
        exc.status,
        exc.reason,
        f"the API server does not serve {res.plural}.{res.group}/{res.version}: the mixfleet "
        f"CRDs ({crds}) are not installed in this cluster. To fix: kubectl apply "
        "--server-side -f charts/mixfleet/crds/ (or install the Helm chart, which installs "
        "them), then start again",
    )


def api_client_from(kubeconfig: str | None = None, *, context: str | None = None) -> Any:
    """An ``ApiClient``: from ``kubeconfig`` when given, else in-cluster (the pod's service
    account), else ``$KUBECONFIG`` or ``~/.kube/config``.

    Raises:
        KubeConfigError: no usable configuration; says what was tried and how to fix it.
    """
    from kubernetes import config as config_module

    k8s_config: Any = config_module  # its loaders are untyped
    cfg = k8s_client.Configuration()
    try:
        if kubeconfig:
            k8s_config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=cfg
            )
        else:
            try:
                k8s_config.load_incluster_config(client_configuration=cfg)
            except k8s_config.ConfigException:
                k8s_config.load_kube_config(context=context, client_configuration=cfg)
    except Exception as exc:  # the loaders raise several unrelated types (config, I/O, YAML)
        where = kubeconfig or "in-cluster service account, then $KUBECONFIG or ~/.kube/config"
        raise KubeConfigError(
            f"no usable Kubernetes configuration ({where}): {exc}. To fix: run in a pod "
            "with a service account, or pass --kubeconfig / set KUBECONFIG to a kubeconfig "
            "file with a current context"
        ) from exc
    return k8s_client.ApiClient(cfg)
