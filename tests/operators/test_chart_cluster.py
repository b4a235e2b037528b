"""The Helm chart against a real API server (``MIXFLEET_E2E_KUBECONFIG``; skipped on the
fake, which serves mixfleet's kinds only):

* every value set of test_chart.py, rendered by Helm's engine, applies with a server-side
  dry run - the API server's own validation and admission of every object (the third-party
  kinds a value set needs - cert-manager's Certificate and Issuer, the Prometheus
  Operator's ServiceMonitor - get minimal stand-in CRDs, see :data:`STUB_CRDS`);
* the chart's RBAC, created for real, is asked with SubjectAccessReviews (what ``kubectl
  auth can-i --as=system:serviceaccount:NS:SA`` asks) for every permission the controller's
  and the operator's code needs (test_rbac.needed: their calls read from the source), where
  the chart runs them - all allowed - and for a few it must not have - all denied.

Objects are renamed for the run so that nothing of a real installation is touched:
cluster-scoped names get the run's prefix, the release namespace becomes the run's
namespace and the value sets' other namespaces get the run's namespace as a prefix.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
from k8s_cluster import CRDS, Cluster, wait_for
from kubernetes import dynamic
from test_chart import NAMESPACE, VALUE_SETS, objects, render
from test_rbac import ALL, needed

from apis.kube.client import Kube, Resource
from apis.kube.errors import NotFoundError

pytestmark = pytest.mark.slow

STUB_LABEL = "mixfleet.io/e2e-stub-crd"
#: Test fixtures, not the real definitions: CRDs that let the API server accept the
#: third-party kinds the chart renders (any content: ``x-kubernetes-preserve-unknown-fields``).
#: Installed only where the cluster lacks them, labelled ``mixfleet.io/e2e-stub-crd``, and
#: deleted afterwards.
STUB_CRDS = (
    ("cert-manager.io", "certificates", "Certificate", True),
    ("cert-manager.io", "issuers", "Issuer", True),
    ("monitoring.coreos.com", "servicemonitors", "ServiceMonitor", True),
)
#: The kubernetes client's dynamic client class (untyped; any kind by discovery).
_DYNAMIC: Any = dynamic.DynamicClient
NAMESPACES = Resource("", "v1", "namespaces", "Namespace", False)
SAR = Resource("authorization.k8s.io", "v1", "subjectaccessreviews", "SubjectAccessReview", False)
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def _stub_crd(group: str, plural: str, kind: str, namespaced: bool) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}", "labels": {STUB_LABEL: "true"}},
        "spec": {
            "group": group,
            "scope": "Namespaced" if namespaced else "Cluster",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


@pytest.fixture
def real(cluster: Cluster) -> Iterator[tuple[Cluster, Any]]:
    """The real cluster with the stand-in third-party CRDs it lacks (removed afterwards)."""
    if cluster.fake is not None:
        pytest.skip("the fake API server serves mixfleet's kinds only")
    k = cluster.kube("mixfleet-e2e-setup")
    created = []
    for group, plural, kind, namespaced in STUB_CRDS:
        name = f"{plural}.{group}"
        if k.get(CRDS, name) is None:
            k.create(CRDS, _stub_crd(group, plural, kind, namespaced))
            created.append(name)

            def established(n: str = name) -> bool:
                conds = ((k.get(CRDS, n) or {}).get("status") or {}).get("conditions") or []
                return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

            wait_for(established, timeout_s=60, what=f"stub CRD {name}")
    try:
        yield cluster, _DYNAMIC(cluster.api_client("mixfleet-e2e-chart"))
    finally:
        for name in created:
            with contextlib.suppress(NotFoundError):
                k.delete(CRDS, name)


class Renamer:
    """Names of one value set's objects for this run (module docstring)."""

    def __init__(self, cluster: Cluster, tag: str) -> None:
        self.cluster = cluster
        self.prefix = f"{cluster.prefix}{tag}-"
        self.namespaces: dict[str, str] = {NAMESPACE: f"{cluster.namespace}-{tag}"}

    def namespace(self, ns: str) -> str:
        if ns not in self.namespaces:
            self.namespaces[ns] = f"{self.namespaces[NAMESPACE]}-{ns}"
        return self.namespaces[ns]

    def doc(self, doc: dict[str, Any], namespaced: bool) -> dict[str, Any]:
        out = copy.deepcopy(doc)
        meta = out["metadata"]
        if namespaced:
            meta["namespace"] = self.namespace(meta.get("namespace") or NAMESPACE)
        else:
            meta["name"] = self.prefix + meta["name"]
            meta.pop("namespace", None)
        if out["kind"] in ("ClusterRoleBinding", "RoleBinding"):
            if out["roleRef"]["kind"] == "ClusterRole":
                out["roleRef"]["name"] = self.prefix + out["roleRef"]["name"]
            for s in out.get("subjects") or []:
                if s.get("namespace"):
                    s["namespace"] = self.namespace(s["namespace"])
        return out


def _value_sets_and_tags() -> list[tuple[str, str]]:
    return [(name, f"v{i}") for i, name in enumerate(VALUE_SETS)]


def test_every_rendered_object_applies_with_a_server_side_dry_run(
    real: tuple[Cluster, Any],
) -> None:
    cluster, dyn = real
    refused: list[str] = []
    for value_set, tag in _value_sets_and_tags():
        refused += _dry_run(cluster, dyn, value_set, tag)
    assert refused == [], refused


def _dry_run(cluster: Cluster, dyn: Any, value_set: str, tag: str) -> list[str]:
    """The value set's objects the API server refuses (``VALUE_SET KIND/NAME: why``)."""
    docs = render(VALUE_SETS[value_set])
    names = Renamer(cluster, tag)
    k = cluster.kube("mixfleet-e2e-setup")
    kinds = {
        (d["apiVersion"], d["kind"]): dyn.resources.get(api_version=d["apiVersion"], kind=d["kind"])
        for d in docs
    }
    renamed = [names.doc(d, kinds[d["apiVersion"], d["kind"]].namespaced) for d in docs]
    for ns in sorted(set(names.namespaces.values())):
        k.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    refused = []
    try:
        for doc in renamed:
            res = kinds[doc["apiVersion"], doc["kind"]]
            try:
                dyn.server_side_apply(
                    res,
                    body=doc,
                    namespace=doc["metadata"].get("namespace"),
                    query_params=[("dryRun", "All"), ("fieldManager", "helm")],
                )
            except Exception as exc:  # the API server's refusal, reported per object
                refused.append(f"{value_set} {doc['kind']}/{doc['metadata']['name']}: {exc}")
    finally:
        for ns in names.namespaces.values():
            with contextlib.suppress(NotFoundError):
                k.delete(NAMESPACES, ns)
    assert len(renamed) >= 10, value_set
    return refused


def test_the_service_account_may_do_what_the_code_calls_and_no_more(
    real: tuple[Cluster, Any],
) -> None:
    cluster, dyn = real
    for value_set, tag in _value_sets_and_tags():
        _access_reviews(cluster, dyn, value_set, tag)


def _access_reviews(cluster: Cluster, dyn: Any, value_set: str, tag: str) -> None:
    """Create the value set's RBAC, ask the SubjectAccessReviews, delete it again."""
    values = VALUE_SETS[value_set]
    docs = render(values)
    names = Renamer(cluster, tag)
    k = cluster.kube("mixfleet-e2e-setup")
    made: list[tuple[Any, dict[str, Any]]] = []
    (sa,) = [
        d for d in objects(docs, "ServiceAccount") if d["metadata"]["name"] == "mixfleet-controller"
    ]
    user = f"system:serviceaccount:{names.namespace(NAMESPACE)}:{sa['metadata']['name']}"
    want = needed(docs, values)
    try:
        _create_rbac(k, dyn, names, [d for d in docs if d["kind"] in RBAC_KINDS], made)

        def allowed(ns: str, group: str, resource: str, verb: str, name: str) -> bool:
            return _allowed(k, user, ns, group, resource, verb, name)

        def where(w: str) -> str:
            if w == "cluster":
                return ""
            if w == ALL:
                return names.namespace("any-namespace")
            return names.namespace(w)

        # RBAC takes effect as the authorizer's informer sees it: wait for the first grant.
        first = sorted(want)[0]
        wait_for(lambda: allowed(where(first[0]), *first[1:]), timeout_s=30, what="RBAC in effect")
        denied = [g for g in sorted(want) if not allowed(where(g[0]), *g[1:])]
        assert denied == [], f"{value_set}: {user} is refused what the code calls: {denied}"
        never = [
            ("", "", "secrets", "get", ""),
            ("", "", "pods", "create", ""),
            ("", "mixfleet.io", "partitionplans", "update", ""),
        ]
        extra = [g for g in never if allowed(names.namespace(NAMESPACE), *g[1:])]
        assert extra == [], f"{value_set}: {user} may do what no code calls: {extra}"
        assert len(want) >= 20, value_set
    finally:
        _delete_made(k, dyn, made)


def _create_rbac(
    k: Kube,
    dyn: Any,
    names: Renamer,
    rbac: list[dict[str, Any]],
    made: list[tuple[Any, dict[str, Any]]],
) -> None:
    """Server-side apply the renamed RBAC documents ``rbac`` (creating each namespace they
    need first), appending every object made to ``made`` (resource, or ``None`` for a
    namespace; document) as it is made, so that a failure part-way still cleans up."""
    for doc in rbac:
        res = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        out = names.doc(doc, res.namespaced)
        if res.namespaced and not any(
            m[1]["metadata"].get("name") == out["metadata"]["namespace"]
            for m in made
            if m[1]["kind"] == "Namespace"
        ):
            ns_doc = {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": out["metadata"]["namespace"]},
            }
            with contextlib.suppress(Exception):
                k.create(NAMESPACES, ns_doc)
            made.append((None, ns_doc))
        dyn.server_side_apply(
            res,
            body=out,
            namespace=out["metadata"].get("namespace"),
            query_params=[("fieldManager", "helm")],
        )
        made.append((res, out))


def _allowed(k: Kube, user: str, ns: str, group: str, resource: str, verb: str, name: str) -> bool:
    """Whether a SubjectAccessReview allows service account ``user`` ``verb`` on
    ``resource`` (``plural`` or ``plural/subresource``) of API group ``group``, in namespace
    ``ns`` (``""``: cluster-wide) and for object ``name`` (``""``: any)."""
    plural, _, sub = resource.partition("/")
    attrs = {"group": group, "resource": plural, "verb": verb}
    if sub:
        attrs["subresource"] = sub
    if name:
        attrs["name"] = name
    if ns:
        attrs["namespace"] = ns
    body = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "groups": ["system:serviceaccounts", "system:authenticated"],
            "resourceAttributes": attrs,
        },
    }
    return bool((k.create(SAR, body).get("status") or {}).get("allowed"))


def _delete_made(k: Kube, dyn: Any, made: list[tuple[Any, dict[str, Any]]]) -> None:
    """Delete what :func:`_create_rbac` made, newest first, ignoring failures."""
    for res, out in reversed(made):
        with contextlib.suppress(Exception):
            if res is None:
                k.delete(NAMESPACES, out["metadata"]["name"])
            else:
                dyn.delete(
                    res,
                    name=out["metadata"]["name"],
                    namespace=out["metadata"].get("namespace"),
                )
