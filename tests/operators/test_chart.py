"""The Helm chart, rendered by Helm's own engine (helm-python-sdk), for several value sets;
every object validated for Kubernetes 1.29-1.35 with kubernetes-validate (strict), custom
resources against the mixfleet CRDs, the chart linted, and every container's command line
parsed by the program's own argument parser. (RBAC against the code: test_rbac.py.)"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator
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
        "operator": {"watchNamespaces": ["team-a", "team-b"], "drainGraceS": 120},
        "auth": {"tokenSecret": "mixfleet-tokens"},
    },
    "no-leader-election": {
        "controller": {"replicas": 1, "leaderElection": {"enabled": False}},
        "operator": {"leaderElection": {"enabled": False}},
    },
    # The store namespace is not among the watched ones: the controller keeps its access.
    "store-namespace-not-watched": {
        "controller": {"storeNamespace": "models"},
        "operator": {"watchNamespaces": ["team-a"]},
    },
    "operator-disabled": {"operator": {"enabled": False}},
    "router": {
        "router": {
            "enabled": True,
            "instances": ["url=http://e:30000,deployment=ds3"],
            "deployments": ["qwen,tier=batch"],
        }
    },
    "operator-without-election": {"operator": {"leaderElection": {"enabled": False}}},
    "curve-cache-on-a-claim": {"operator": {"curveCache": {"existingClaim": "mixfleet-curves"}}},
    "curve-cache-off": {"operator": {"curveCache": {"enabled": False}}},
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


#: The program each container command runs -> its own argument parser and the words of the
#: command line that select the subcommand.
def _parsers() -> dict[tuple[str, ...], tuple[Callable[[], argparse.ArgumentParser], list[str]]]:
    import agents.cli
    import controlplane.cli
    import operators.cli

    return {
        ("mixfleetctl", "controller", "run"): (
            controlplane.cli.build_parser,
            ["controller", "run"],
        ),
        ("python", "-m", "operators", "run"): (operators.cli.build_parser, ["run"]),
        ("mixfleet-agent", "run"): (agents.cli.build_parser, ["run"]),
        ("mixfleet-router",): (controlplane.cli.build_parser, ["router", "run"]),
    }


def parsed_commands(docs: list[dict[str, Any]]) -> dict[str, argparse.Namespace]:
    """Every container of the rendered workloads, its command line parsed by the program's
    own parser (``kind/name/container`` -> arguments). Fails on an unknown program, an
    option the program does not have, or a ``$(VAR)`` the container does not define (the
    kubelet would pass it on literally)."""
    parsers = _parsers()
    out: dict[str, argparse.Namespace] = {}
    for doc in objects(docs, "Deployment") + objects(docs, "DaemonSet"):
        for c in doc["spec"]["template"]["spec"]["containers"]:
            where = f"{doc['kind']}/{doc['metadata']['name']}/{c['name']}"
            command, args = tuple(c["command"]), list(c.get("args") or [])
            assert command in parsers, f"{where} runs {command}, which no test knows"
            env = {e["name"] for e in c.get("env") or []}
            for arg in args:
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert var in env, f"{where}: {arg} names $({var}), not in its env"
            build, words = parsers[command]
            try:
                out[where] = build().parse_args([*words, *args])
            except SystemExit as exc:  # argparse's own error exit
                raise AssertionError(f"{where}: {command} rejects {args}") from exc
            except Exception as exc:
                raise AssertionError(f"{where}: {command} rejects {args}: {exc}") from exc
    return out


def test_every_container_command_line_parses_with_the_programs_own_parser(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    name, docs = rendered
    values = VALUE_SETS[name]
    parsed = parsed_commands(docs)
    ctl = parsed["Deployment/mixfleet-controller/controller"]
    c_values = values.get("controller", {})
    c_elect = c_values.get("leaderElection", {}).get("enabled", True)
    assert ctl.store == f"kubernetes:{c_values.get('storeNamespace') or NAMESPACE}"
    assert ctl.health_listen == "0.0.0.0:8081" and ctl.listen == "0.0.0.0:7443"
    assert ctl.leader_elect is c_elect
    if c_elect:
        assert (ctl.lease_name, ctl.lease_duration_s, ctl.renew_deadline_s) == (
            "mixfleet-controller",
            15.0,
            10.0,
        )
    o_values = values.get("operator", {})
    op = parsed.get("Deployment/mixfleet-controller/operator")
    assert (op is None) == (o_values.get("enabled", True) is False)
    if op is not None:
        assert op.namespace == o_values.get("watchNamespaces", [])
        assert op.no_leader_election is not o_values.get("leaderElection", {}).get("enabled", True)
        assert op.health_listen == "0.0.0.0:8082"
        assert op.drain_grace == o_values.get("drainGraceS", 30.0)
        cache = o_values.get("curveCache", {})
        on = cache.get("enabled", True)
        assert op.curve_cache == ("/var/cache/mixfleet/curves" if on else "")
    agent = parsed.get("DaemonSet/mixfleet-agent/agent")
    assert (agent is None) == (values.get("agent", {}).get("enabled", True) is False)


def test_a_container_option_the_program_lacks_is_caught() -> None:
    docs = render({"controller": {"extraArgs": ["--no-such-flag"]}})
    with pytest.raises(AssertionError, match="rejects"):
        parsed_commands(docs)


def test_defaults_one_controller_recreated_fenced_by_a_lease_with_grpc_probes() -> None:
    docs = render({})
    (dep,) = objects(docs, "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    containers = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"controller", "operator"}
    for c in containers.values():
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert "grpc" in c[probe], (c["name"], probe)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert containers["operator"]["livenessProbe"]["grpc"]["service"] == "liveness"
    ctl = containers["controller"]
    # Waiting for the Lease is alive, not ready: startup and liveness ask "liveness".
    assert [ctl[p]["grpc"].get("service", "") for p in ("startupProbe", "livenessProbe")] == [
        "liveness",
        "liveness",
    ]
    assert ctl["readinessProbe"]["grpc"].get("service", "") == ""
    op_args = containers["operator"]["args"]
    assert "--lease-name=mixfleet-operator" in op_args and "--identity=$(POD_NAME)" in op_args
    # The operator binds loopback by default; in the pod the kubelet and the scraper need
    # every address, which the chart asks for explicitly.
    assert "--metrics-address=0.0.0.0" in op_args
    assert any(a.startswith("--health-listen=0.0.0.0:") for a in op_args)
    assert "--leader-elect" in ctl["args"]
    # One replica: a PodDisruptionBudget would block every node drain.
    assert not objects(docs, "PodDisruptionBudget")
    (pdb,) = objects(render({"controller": {"pdb": {"enabled": True}}}), "PodDisruptionBudget")
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
    # The watched namespaces for the operator, and the controller's store namespace (not
    # watched here: without its Role the controller could not list its ModelDeployments).
    assert by_ns == {"team-a", "team-b", NAMESPACE}
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


def _operator_pod(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The controller pod's spec and its operator container."""
    (dep,) = [
        d for d in objects(docs, "Deployment") if d["metadata"]["name"].endswith("controller")
    ]
    pod = dep["spec"]["template"]["spec"]
    (op,) = [c for c in pod["containers"] if c["name"] == "operator"]
    return pod, op


def test_the_operators_curve_cache_is_a_volume_an_empty_dir_or_a_claim() -> None:
    pod, op = _operator_pod(render({}))
    (mount,) = [m for m in op["volumeMounts"] if m["name"] == "curve-cache"]
    assert mount["mountPath"] == "/var/cache/mixfleet/curves"
    assert "--curve-cache=/var/cache/mixfleet/curves" in op["args"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["curve-cache"]["emptyDir"] == {"sizeLimit": "256Mi"}
    pod, op = _operator_pod(render(VALUE_SETS["curve-cache-on-a-claim"]))
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["curve-cache"] == {
        "name": "curve-cache",
        "persistentVolumeClaim": {"claimName": "mixfleet-curves"},
    }
    pod, op = _operator_pod(render(VALUE_SETS["curve-cache-off"]))
    assert "curve-cache" not in {v["name"] for v in pod["volumes"]}
    assert not [a for a in op["args"] if a.startswith("--curve-cache")]
    without = render(VALUE_SETS["operator-disabled"])
    (dep,) = [
        d for d in objects(without, "Deployment") if d["metadata"]["name"].endswith("controller")
    ]
    assert "curve-cache" not in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}


@pytest.mark.parametrize(
    "values",
    [
        {"tls": {"mode": "plaintext"}},
        {"controller": {"replicas": 0}},
        {"controller": {"replicas": 2}},
        {"operator": {"watchNamespaces": ["Not_A_Namespace"]}},
        {"agent": {"planDir": "relative/path"}},
        {"unknownKey": 1},
        {"operator": {"drainGraceS": -1}},
        {"operator": {"curveCache": {"path": "relative/curves"}}},
        {"operator": {"curveCache": {"existingClaim": "Not A Claim"}}},
        {"router": {"workers": 0}},
    ],
    ids=[
        "tls-mode",
        "replicas",
        "two-replicas",
        "namespace-name",
        "plan-dir",
        "unknown-key",
        "drain-grace",
        "curve-cache-path",
        "curve-cache-claim",
        "router-workers",
    ],
)
def test_values_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)


def test_router_runs_against_the_controller_with_mtls_and_its_flags_are_valid() -> None:
    docs = render(VALUE_SETS["router"])
    parsed = parsed_commands(docs)["Deployment/mixfleet-router/router"]
    assert parsed.controller == "mixfleet-controller.mixfleet-system.svc:7443"
    assert parsed.instance == ["url=http://e:30000,deployment=ds3"]
    assert parsed.tls_ca == "/etc/mixfleet/tls/ca.crt" and parsed.listen == "0.0.0.0:8000"
    assert parsed.workers == 2  # one per CPU the pod requests
    from controlplane.cli.router import settings_from_args

    assert parsed.deployment == ["qwen,tier=batch"]
    settings = settings_from_args(parsed)  # the same checks as at start
    assert settings.deployments == ("ds3",)
    assert [(w.name, w.tier) for w in settings.watched] == [("qwen", "batch")]
    (svc,) = [s for s in objects(docs, "Service") if s["metadata"]["name"] == "mixfleet-router"]
    assert svc["spec"]["ports"][0]["port"] == 8000
    assert not [d for d in objects(render({}), "Deployment") if "router" in d["metadata"]["name"]]
