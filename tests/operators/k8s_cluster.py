"""An API server for the operator tests: the fake one, or a real cluster.

Tests that take the ``cluster`` fixture (tests/operators/conftest.py) run twice:

* ``fake`` - against :class:`support.fakeapi.FakeApiServer` on loopback (always);
* ``real`` - against the cluster of the kubeconfig in ``MIXFLEET_E2E_KUBECONFIG`` (skipped
  when it is not set). The fixture installs the CRDs from charts/mixfleet/crds, works in a
  fresh namespace, prefixes cluster-scoped names with the run id, labels its GPUNodes with
  ``mixfleet.io/e2e-run`` and deletes everything afterwards. Do not run it where a mixfleet
  operator already serves that namespace. See docs/kubernetes.md.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import urllib3
import yaml
from kubernetes import client as k8s_client
from support.fakeapi import FakeApiServer, crd_manifests
from support.waits import hang_guard_s

from apis.kube.client import (
    GPUNODES,
    MODEL_DEPLOYMENTS,
    PARTITION_PLANS,
    PLACEMENT_POLICIES,
    Json,
    Kube,
    Resource,
)
from apis.kube.errors import ConflictError, NotFoundError
from apis.kube.gpunode import gpunode_object, gpunode_status
from apis.kube.schema import to_wire
from apis.kube.v1alpha1 import GPUNodeSpec
from policies.hardware.fleet import Fleet, parse_fleet
from policies.hardware.inventory import NodeInventory

E2E_ENV = "MIXFLEET_E2E_KUBECONFIG"
CRD_DIR = Path(__file__).resolve().parents[2] / "charts" / "mixfleet" / "crds"
RUN_LABEL = "mixfleet.io/e2e-run"


@dataclass
class Cluster:
    """An API server for one test.

    Attributes:
        mode: ``fake`` or ``real``.
        fake: the fake server (None on a real cluster).
        namespace: namespace for namespaced objects (and Leases).
        prefix: prefix for cluster-scoped names (empty on the fake).
        run: value of the ``mixfleet.io/e2e-run`` label on this test's GPUNodes.
    """

    mode: str
    fake: FakeApiServer | None
    namespace: str
    prefix: str
    run: str
    _configure: Callable[[k8s_client.Configuration], None]
    _clients: list[Any] = field(default_factory=list)

    def api_client(self, user_agent: str = "mixfleet-test") -> Any:
        cfg = k8s_client.Configuration()
        self._configure(cfg)
        api = k8s_client.ApiClient(cfg)
        api.user_agent = user_agent
        self._clients.append(api)
        return api

    def kube(self, manager: str = "mixfleet-test", user_agent: str | None = None) -> Kube:
        return Kube(self.api_client(user_agent or manager), field_manager=manager)

    def fleet(self, name: str, nodes: Iterable[tuple[str, str]]) -> Fleet:
        """A fleet named ``name`` of 2-GPU nodes ``(base name, GPU model)``, each with one
        400 Gbit/s NIC on ``ib0``, named for this run (:meth:`name`) and labelled with it."""
        doc_nodes = [
            {
                "name": self.name(base),
                "labels": {RUN_LABEL: self.run},
                "gpus": [{"model": model, "count": 2}],
                "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib0"}],
            }
            for base, model in nodes
        ]
        return parse_fleet({"metadata": {"name": name}, "spec": {"nodes": doc_nodes}})

    def registered(self, fleet: Fleet) -> bool:
        """Every node of ``fleet`` has registered: its GPUNode carries an inventory."""
        k = self.kube()
        for n in fleet.nodes:
            obj = k.get(GPUNODES, n.name) or {}
            if not (obj.get("status") or {}).get("inventory"):
                return False
        return True

    def name(self, base: str) -> str:
        """A cluster-scoped name for this run."""
        return f"{self.prefix}{base}"

    def put_gpunode(
        self,
        kube: Kube,
        base: str,
        inv: NodeInventory,
        *,
        heartbeat: datetime | None = None,
        spec: GPUNodeSpec | None = None,
        labels: dict[str, str] | None = None,
    ) -> str:
        """Register a GPUNode as the controller does (a non-forced server-side apply of its
        labels, then its status), with ``spec`` applied by an administrator (field manager
        ``admin``, not forced either); returns its name."""
        name = self.name(base)
        obj = gpunode_object(name, labels={RUN_LABEL: self.run, **(labels or {})})
        del obj["spec"]
        kube.apply(GPUNODES, obj)
        if spec is not None:
            admin = Kube(kube.api_client, field_manager="admin")
            admin.apply(
                GPUNODES,
                {"metadata": {"name": name}, "spec": gpunode_object(name, spec=spec)["spec"]},
            )
        self.heartbeat(kube, name, inv, heartbeat)
        return name

    def heartbeat(
        self, kube: Kube, name: str, inv: NodeInventory, at: datetime | None = None
    ) -> None:
        import dataclasses

        status = gpunode_status(dataclasses.replace(inv, node=name), at or datetime.now(UTC))
        kube.apply(  # forced, as the controller does: it alone writes GPUNode status
            GPUNODES,
            {"metadata": {"name": name}, "status": to_wire(status)},
            subresource="status",
            force=True,
        )

    def close(self) -> None:
        for api in self._clients:
            api.close()


def wait_for(
    fn: Callable[[], Any], *, timeout_s: float = 90.0, interval_s: float = 0.1, what: str = ""
) -> Any:
    """Poll ``fn`` until it returns a truthy value; fail with ``what`` after ``timeout_s``
    (at least :data:`support.waits.HANG_GUARD_S`: a hang guard, not a speed claim)."""
    timeout_s = hang_guard_s(timeout_s)
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or fn}: last {last!r}")


CRDS = Resource(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False
)


def install_crds(kube: Kube) -> None:
    """Server-side apply the chart's CRDs (forced, as ``helm`` and ``kubectl apply
    --server-side --force-conflicts`` upgrade them) and wait until they are Established."""
    crd_res = CRDS
    for doc in crd_manifests(str(CRD_DIR)):
        name = doc["metadata"]["name"]
        kube.apply(crd_res, doc, force=True)

        def established(n: str = name) -> bool:
            status = (kube.get(crd_res, n) or {}).get("status") or {}
            # Right after the create the server stores "conditions": null.
            return any(
                c.get("type") == "Established" and c.get("status") == "True"
                for c in status.get("conditions") or []
            )

        wait_for(established, timeout_s=60, what=f"CRD {name} established")


def cleanup_real(kube: Kube, c: Cluster) -> None:
    ns_res = Resource("", "v1", "namespaces", "Namespace", False)
    for res in (MODEL_DEPLOYMENTS, PARTITION_PLANS):
        items, _ = kube.list(res, c.namespace)
        for o in items:
            if o["metadata"].get("finalizers"):
                with contextlib.suppress(NotFoundError, ConflictError):
                    kube.merge_patch(
                        res, o["metadata"]["name"], {"metadata": {"finalizers": None}}, c.namespace
                    )
    for res in (GPUNODES, PLACEMENT_POLICIES):
        items, _ = kube.list(res)
        for o in items:
            if o["metadata"]["name"].startswith(c.prefix):
                kube.delete(res, o["metadata"]["name"])
    kube.delete(ns_res, c.namespace)


@contextlib.contextmanager
def api_outage(kube: Kube) -> Iterator[None]:
    """The API server stops answering ``kube``: every request of its client fails as a
    refused connection does (urllib3's ``MaxRetryError`` from ``NewConnectionError``), at
    the transport, whatever the kubeconfig. (Pointing ``configuration.host`` elsewhere is no
    outage: with a token kubeconfig the client's loader sets the host again before every
    request.)"""
    pool = kube.api_client.rest_client.pool_manager

    def refused(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        raise urllib3.exceptions.MaxRetryError(
            pool, url, urllib3.exceptions.NewConnectionError(pool, "Connection refused")
        )

    pool.request = refused
    try:
        yield
    finally:
        del pool.request  # the class's method again


def token_kubeconfig(server: str, token: str = "mixfleet-test-token") -> str:
    """A kubeconfig (YAML) that reaches ``server`` with a bearer token."""
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": server}}],
            "users": [{"name": "u", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
            "current-context": "fake",
        }
    )


def load_yaml(path: Path) -> list[Json]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]
