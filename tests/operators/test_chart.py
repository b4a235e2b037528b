"""The Helm chart, rendered by Helm's own engine (helm-python-sdk), for several value sets;
every object validated for Kubernetes 1.29-1.35 with kubernetes-validate (strict), custom
resources against the mixfleet CRDs, and the chart linted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from support.structural import admit

from apis.kube.v1alpha1 import CRDS
from operators import crdgen

CHART = Path(__file__).resolve().parents[2] / "charts" / "mixfleet"
K8S_VERSIONS = ("1.29", "1.30", "1.31", "1.32", "1.33", "1.34", "1.35")
RELEASE, NAMESPACE = "mixfleet", "mixfleet-system"
#: Kinds kubernetes-validate cannot know (CRDs of other projects), with their required paths.
FOREIGN_KINDS = {
    ("cert-manager.io/v1", "Certificate"): ("spec.secretName", "spec.issuerRef.name"),
    ("cert-manager.io/v1", "Issuer"): ("spec",),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("spec.selector", "spec.endpoints"),
}
CRD_BY_KIND = {c.kind: c for c in CRDS}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cert-manager": {"tls": {"mode": "certManager"}},
    "cert-manager-own-issuer": {
        "tls": {
            "mode": "certManager",
            "certManager": {
                "issuerRef": {
                    "name": "corp-ca",
                    "kind": "ClusterIssuer",
                    "group": "cert-manager.io",
                }
            },
        }
    },
    "servicemonitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "no-agent": {"agent": {"enabled": False}},
    "namespaced-operator": {
        "operator": {"watchNamespaces": ["team-a", "team-b"]},
        "auth": {"tokenSecret": "mixfleet-tokens"},
    },
    "single-replica": {
        "controller": {"replicas": 1, "leaderElection": {"enabled": False}},
        "operator": {"leaderElection": {"enabled": False}},
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def objects(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _get(doc: dict[str, Any], dotted: str) -> Any:
    cur: Any = doc
    for p in dotted.split("."):
        cur = cur.get(p) if isinstance(cur, dict) else None
    return cur


@pytest.fixture(scope="module", params=list(VALUE_SETS), ids=list(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    yield request.param, render(VALUE_SETS[request.param])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_is_valid(
    rendered: tuple[str, list[dict[str, Any]]], version: str
) -> None:
    _, docs = rendered
    assert docs
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if doc["apiVersion"].startswith("mixfleet.io/"):
            _, dropped, causes = admit(doc, CRD_BY_KIND[doc["kind"]].schema())
            assert (dropped, causes) == ([], []), doc["metadata"]["name"]
        elif key in FOREIGN_KINDS:
            for path in FOREIGN_KINDS[key]:
                assert _get(doc, path), f"{doc['kind']} {doc['metadata']['name']} lacks {path}"
        else:
            assert kubernetes_validate.validate(doc, version, strict=True) == version


def test_chart_crds_are_the_generated_ones() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        crds = {c["filename"].split("/")[-1]: c["data"] for c in chart.crds}
    assert crds == crdgen.expected_files()


@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_helm_lint_is_clean(values: dict[str, Any]) -> None:
    for kube in ("v1.29.0", "v1.35.0"):
        report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE, kube_version=kube)
        assert report["errors"] == [] and report["messages"] == [], report


def test_defaults_controller_two_replicas_with_grpc_probes_and_pdb() -> None:
    docs = render({})
    (dep,) = objects(docs, "Deployment")
    assert dep["spec"]["replicas"] == 2
    containers = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"controller", "operator"}
    for c in containers.values():
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert "grpc" in c[probe], (c["name"], probe)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert containers["operator"]["livenessProbe"]["grpc"]["service"] == "liveness"
    op_args = containers["operator"]["args"]
    assert "--lease-name=mixfleet-operator" in op_args and "--identity=$(POD_NAME)" in op_args
    assert "--leader-elect" in containers["controller"]["args"]
    (pdb,) = objects(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    (svc,) = objects(docs, "Service")
    assert {p["name"] for p in svc["spec"]["ports"]} == {"grpc", "metrics", "op-metrics"}
    (policy,) = objects(docs, "PlacementPolicy")
    assert policy["metadata"]["name"] == "default"


def test_agent_daemonset_runs_on_gpu_nodes_without_api_access() -> None:
    docs = render({})
    (ds,) = objects(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["automountServiceAccountToken"] is False
    (vol,) = [v for v in pod["volumes"] if v["name"] == "plans"]
    assert vol["hostPath"] == {"path": "/var/lib/mixfleet/plans", "type": "DirectoryOrCreate"}
    (agent,) = pod["containers"]
    assert "--controller=mixfleet-controller.mixfleet-system.svc:7443" in agent["args"]
    assert "resources" in agent and "nvidia.com/gpu" not in agent["resources"].get("limits", {})
    sa = [
        s
        for s in objects(docs, "ServiceAccount")
        if s["metadata"]["name"] == pod["serviceAccountName"]
    ]
    assert sa and sa[0]["automountServiceAccountToken"] is False
    bound = {
        s["name"]
        for b in objects(docs, "ClusterRoleBinding") + objects(docs, "RoleBinding")
        for s in b["subjects"]
    }
    assert pod["serviceAccountName"] not in bound


def _rules(docs: list[dict[str, Any]], kind: str) -> list[tuple[str | None, dict[str, Any]]]:
    return [
        (r["metadata"].get("namespace"), rule) for r in objects(docs, kind) for rule in r["rules"]
    ]


def test_rbac_is_least_privilege() -> None:
    docs = render({})
    for _, rule in _rules(docs, "ClusterRole") + _rules(docs, "Role"):
        assert (
            "*" not in rule["verbs"]
            and "*" not in rule["resources"]
            and "*" not in rule["apiGroups"]
        )
        assert "secrets" not in rule["resources"]
    cluster_resources = {res for _, r in _rules(docs, "ClusterRole") for res in r["resources"]}
    assert "leases" not in cluster_resources
    lease_rules = [(ns, r) for ns, r in _rules(docs, "Role") if "leases" in r["resources"]]
    assert {ns for ns, _ in lease_rules} == {NAMESPACE}
    named = [r for _, r in lease_rules if "update" in r["verbs"]]
    assert named and all(
        r["resourceNames"] == ["mixfleet-controller", "mixfleet-operator"] for r in named
    )
    plan_verbs = next(
        r["verbs"] for _, r in _rules(docs, "ClusterRole") if r["resources"] == ["partitionplans"]
    )
    assert (
        "update" not in plan_verbs and "patch" not in plan_verbs
    )  # plans are immutable: create, delete


def test_namespaced_operator_gets_roles_instead_of_cluster_wide_configmaps() -> None:
    docs = render(VALUE_SETS["namespaced-operator"])
    assert "configmaps" not in {
        res for _, r in _rules(docs, "ClusterRole") for res in r["resources"]
    }
    by_ns = {ns for ns, r in _rules(docs, "Role") if "modeldeployments" in r["resources"]}
    assert by_ns == {"team-a", "team-b"}
    (dep,) = objects(docs, "Deployment")
    op = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "operator")
    assert {"--namespace=team-a", "--namespace=team-b"} <= set(op["args"])
    ctl = next(
        c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "controller"
    )
    assert "--token-file=/etc/mixfleet/auth/tokens" in ctl["args"]


def test_cert_manager_issues_a_ca_a_server_and_a_client_certificate() -> None:
    docs = render(VALUE_SETS["cert-manager"])
    certs = {c["metadata"]["name"]: c for c in objects(docs, "Certificate")}
    assert set(certs) == {"mixfleet-ca", "mixfleet-controller", "mixfleet-agent"}
    assert certs["mixfleet-ca"]["spec"]["isCA"] is True
    assert (
        "mixfleet-controller.mixfleet-system.svc"
        in certs["mixfleet-controller"]["spec"]["dnsNames"]
    )
    assert "server auth" in certs["mixfleet-controller"]["spec"]["usages"]
    assert certs["mixfleet-agent"]["spec"]["commonName"] == "mixfleet-agent"
    assert "client auth" in certs["mixfleet-agent"]["spec"]["usages"]
    (dep,) = objects(docs, "Deployment")
    (tls,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["secretName"] == certs["mixfleet-controller"]["spec"]["secretName"]
    own = render(VALUE_SETS["cert-manager-own-issuer"])
    assert {c["metadata"]["name"] for c in objects(own, "Certificate")} == {
        "mixfleet-controller",
        "mixfleet-agent",
    }
    assert not objects(own, "Issuer")


def test_optional_parts_follow_their_switches() -> None:
    assert not objects(render({}), "ServiceMonitor")
    (sm,) = objects(render(VALUE_SETS["servicemonitor"]), "ServiceMonitor")
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics", "op-metrics"]
    assert sm["metadata"]["labels"]["release"] == "prom"
    no_agent = render(VALUE_SETS["no-agent"])
    assert not objects(no_agent, "DaemonSet")
    assert [s["metadata"]["name"] for s in objects(no_agent, "ServiceAccount")] == [
        "mixfleet-controller"
    ]


def test_two_replicas_without_leader_election_are_refused() -> None:
    with (
        helm.Chart.load(str(CHART)) as chart,
        pytest.raises(helm.HelmRenderError, match="leader election"),
    ):
        chart.render(
            {"operator": {"leaderElection": {"enabled": False}}}, name=RELEASE, namespace=NAMESPACE
        )


@pytest.mark.parametrize(
    "values",
    [
        {"tls": {"mode": "plaintext"}},
        {"controller": {"replicas": 0}},
        {"operator": {"watchNamespaces": ["Not_A_Namespace"]}},
        {"agent": {"planDir": "relative/path"}},
        {"unknownKey": 1},
    ],
    ids=["tls-mode", "replicas", "namespace-name", "plan-dir", "unknown-key"],
)
def test_values_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)
