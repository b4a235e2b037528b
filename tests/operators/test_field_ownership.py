"""Field ownership as kube-apiserver enforces it: mixfleet's writers own only the fields they
set, so an administrator's server-side apply of a GPUNode's or ModelDeployment's spec needs
no ``--force-conflicts``; a conflicting apply is refused the way the real server words it;
and the writers apply without ``force`` where the object is the user's."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from k8s_builders import inventory
from k8s_cluster import RUN_LABEL, Cluster, token_kubeconfig
from support.fakeapi import FakeApiServer

from apis.kube.client import GPUNODES, MODEL_DEPLOYMENTS, Json
from apis.kube.errors import ConflictError
from apis.kube.v1alpha1 import API_VERSION
from controlplane.errors import PreconditionError
from controlplane.store.base import StoredNode
from controlplane.store.kubernetes import KubernetesStore
from policies.spec.build import DeploymentSpec, WorkloadSpec

ROOT = Path(__file__).resolve().parents[2]
CORDON_EXAMPLE = ROOT / "examples" / "k8s" / "gpunode-cordon.yaml"
SPEC = DeploymentSpec(
    name="mx",
    model="mixtral-8x7b",
    policy="greedy",
    workload=WorkloadSpec(tokens_per_gpu=16, tokens_per_gpu_set=True),
)


def _store(cluster: Cluster) -> KubernetesStore:
    return KubernetesStore(
        cluster.kube("mixfleet-controller"), cluster.namespace, cordon_refresh_s=0.0
    )


def _register(store: KubernetesStore, name: str, labels: dict[str, str]) -> None:
    inv = dataclasses.replace(inventory(name, "h100-0"), labels=labels)
    store.upsert_node(StoredNode(name, inv, "sess-1", 10.0, 11.0))


def _owned(obj: Json, manager: str) -> list[Json]:
    """The fieldsV1 of every managedFields entry of ``manager``."""
    return [
        e.get("fieldsV1") or {}
        for e in obj["metadata"].get("managedFields") or []
        if e["manager"] == manager
    ]


def test_an_admin_cordons_a_gpunode_the_controller_registered_without_force(
    cluster: Cluster,
) -> None:
    store = _store(cluster)
    name = cluster.name("h100-0")
    _register(store, name, {RUN_LABEL: cluster.run, "rack": "r1"})
    obj = cluster.kube().get(GPUNODES, name)
    assert obj is not None
    assert all("f:spec" not in f for f in _owned(obj, "mixfleet-controller"))
    admin = cluster.kube("admin")
    cordon = {
        "apiVersion": API_VERSION,
        "kind": "GPUNode",
        "metadata": {"name": name, "labels": {"rack": "r1"}},
        "spec": {"cordon": True, "tier": "hopper"},
    }
    out = admin.apply(GPUNODES, cordon)  # not forced
    assert out["spec"] == {"cordon": True, "tier": "hopper"}
    assert store.cordoned_nodes() == {name}
    # The agent registers again and heartbeats: the administrator's spec stays.
    _register(store, name, {RUN_LABEL: cluster.run, "rack": "r1"})
    store.update_node_status(name, last_heartbeat_s=30.0)
    obj = cluster.kube().get(GPUNODES, name)
    assert obj is not None and obj["spec"] == {"cordon": True, "tier": "hopper"}
    admin.apply(GPUNODES, {**cordon, "spec": {"cordon": False, "tier": "hopper"}})
    assert store.cordoned_nodes() == frozenset()


def test_kubectl_server_side_apply_of_the_cordon_example_needs_no_force(
    cluster: Cluster, fake_only: FakeApiServer, tmp_path: Path
) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("needs the kubectl binary")
    store = _store(cluster)
    _register(store, "h100-0", {"rack": "r1"})  # the example's node and label
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(token_kubeconfig(fake_only.url))
    # The command examples/k8s/gpunode-cordon.yaml documents, without --force-conflicts.
    cmd = [kubectl, "--kubeconfig", str(kubeconfig), "apply", "--server-side"]
    cmd += ["--field-manager=admin", "-f", str(CORDON_EXAMPLE)]
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "gpunode.mixfleet.io/h100-0 serverside-applied" in done.stdout
    assert store.cordoned_nodes() == {"h100-0"}
    patch = [
        r for r in fake_only.requests if r.method == "PATCH" and r.user_agent.startswith("kubectl")
    ]
    assert [(r.query.get("fieldManager"), r.query.get("force")) for r in patch] == [
        ("admin", "false")
    ]


def test_a_conflicting_apply_is_refused_as_kube_apiserver_words_it(cluster: Cluster) -> None:
    """The 409 of a conflicting apply, word for word as kube-apiserver v1.36 writes it: the
    manager is named with its API version and no time (the server strips the time from the
    manager identifier before it prints one), one cause per field."""
    name = cluster.name("h100-9")
    creator = cluster.kube("mixfleet-old")
    creator.create(  # a create (an Update operation) owns every field it set, defaults too
        GPUNODES,
        {
            "apiVersion": API_VERSION,
            "kind": "GPUNode",
            "metadata": {"name": name, "labels": {RUN_LABEL: cluster.run}},
            "spec": {},
        },
    )
    admin = cluster.kube("admin")
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "GPUNode",
        "metadata": {"name": name},
        "spec": {"cordon": True, "tier": "hopper"},
    }
    with pytest.raises(ConflictError) as two:
        admin.apply(GPUNODES, body)
    who = f'"mixfleet-old" using {API_VERSION}'
    assert str(two.value).startswith(
        f"409 Conflict: Apply failed with 2 conflicts: conflicts with {who}:\n"
        "- .spec.cordon\n- .spec.tier\n  - "
    )
    assert sorted(two.value.causes) == [
        f".spec.cordon: conflict with {who}",
        f".spec.tier: conflict with {who}",
    ]
    with pytest.raises(ConflictError) as one:
        admin.apply(GPUNODES, {**body, "spec": {"cordon": True}})
    assert str(one.value).startswith(
        f"409 Conflict: Apply failed with 1 conflict: conflict with {who}: .spec.cordon\n  - "
    )
    # The same value is no conflict (the field is then shared); force takes it over.
    admin.apply(GPUNODES, {**body, "spec": {"tier": ""}})
    out = admin.apply(GPUNODES, body, force=True)
    assert out["spec"] == {"cordon": True, "tier": "hopper"}


def test_the_controller_owns_only_the_deployment_fields_it_sets(cluster: Cluster) -> None:
    store = _store(cluster)
    ns = cluster.namespace
    store.put_deployment(SPEC, now_s=100.0)
    obj = cluster.kube().get(MODEL_DEPLOYMENTS, "mx", ns)
    assert obj is not None
    (owned,) = [f for f in _owned(obj, "mixfleet-controller") if "f:spec" in f]
    workload = owned["f:spec"]["f:workload"]
    assert set(workload) == {"f:tokensPerGpu"}  # phase, contextLen... are the CRD's defaults
    assert "f:rebalance" not in owned["f:spec"]
    assert obj["spec"]["workload"]["kvCacheDtype"] == "bf16"  # defaulted by the server
    # An administrator sets what mixfleetctl leaves at its default, and a policyRef:
    admin = cluster.kube("admin")
    admin.apply(
        MODEL_DEPLOYMENTS,
        {
            "apiVersion": API_VERSION,
            "kind": "ModelDeployment",
            "metadata": {"name": "mx", "namespace": ns},
            "spec": {"workload": {"contextLen": 8192}, "policyRef": {"name": "fast"}},
        },
    )
    d = store.get_deployment("mx")
    assert d is not None and d.spec.workload.context_len == 8192
    # The controller changes its own field: no conflict, the administrator's fields stay.
    changed = dataclasses.replace(
        SPEC, workload=dataclasses.replace(SPEC.workload, tokens_per_gpu=32, context_len=8192)
    )
    store.put_deployment(changed, now_s=101.0)
    obj = cluster.kube().get(MODEL_DEPLOYMENTS, "mx", ns)
    assert obj is not None and obj["spec"]["policyRef"] == {"name": "fast"}
    assert obj["spec"]["workload"]["tokensPerGpu"] == 32
    # Changing a field another writer set is refused, naming the field and the writer.
    with pytest.raises(PreconditionError) as exc:
        store.put_deployment(
            dataclasses.replace(
                changed, workload=dataclasses.replace(changed.workload, context_len=4096)
            ),
            now_s=102.0,
        )
    assert '"admin"' in str(exc.value) and ".spec.workload.contextLen" in str(exc.value)
    obj = cluster.kube().get(MODEL_DEPLOYMENTS, "mx", ns)
    assert obj is not None and obj["spec"]["workload"]["contextLen"] == 8192


def test_writers_apply_user_objects_without_force(
    cluster: Cluster, fake_only: FakeApiServer
) -> None:
    store = _store(cluster)
    _register(store, cluster.name("h100-0"), {"rack": "r1"})
    store.put_deployment(SPEC, now_s=100.0)
    store.set_deployment_status("mx", {"phase": "pending"})
    applies = [
        (r.path.rsplit("/", 1)[-1] if r.path.endswith("/status") else "main", r.path, r.query)
        for r in fake_only.requests
        if r.method == "PATCH" and r.user_agent.startswith("mixfleet-controller")
    ]
    main = [(p, q.get("force")) for scope, p, q in applies if scope == "main"]
    status = [(p, q.get("force")) for scope, p, q in applies if scope == "status"]
    assert main and all(force is None for _, force in main), main  # GPUNode, ModelDeployment
    assert status and all(force == "true" for _, force in status), status  # their own status
