"""Fixtures of the operator tests (see k8s_cluster.py): ``cluster`` runs each test against
the fake API server and, when ``MIXFLEET_E2E_KUBECONFIG`` is set, against a real cluster;
``fleet3`` puts three 2-GPU H100 GPUNodes and a greedy default policy on it."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from k8s_builders import inventory, policy_object
from k8s_cluster import (
    CRD_DIR,
    E2E_ENV,
    Cluster,
    cleanup_real,
    install_crds,
    token_kubeconfig,
)
from kubernetes import client as k8s_client
from support.fakeapi import FakeApiServer, crd_manifests

from apis.kube.client import PLACEMENT_POLICIES, Kube, Resource


@pytest.fixture(params=["fake", "real"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    run = secrets.token_hex(3)
    if request.param == "real":
        kubeconfig = os.environ.get(E2E_ENV)
        if not kubeconfig:
            pytest.skip(
                f"set {E2E_ENV}=/path/to/kubeconfig to run this test against a real cluster"
            )
        from kubernetes import config as k8s_config

        loader: Any = k8s_config

        def configure(cfg: k8s_client.Configuration) -> None:
            loader.load_kube_config(config_file=kubeconfig, client_configuration=cfg)

        c = Cluster("real", None, f"mixfleet-e2e-{run}", f"e2e-{run}-", run, configure)
        admin = c.kube("mixfleet-e2e-setup")
        install_crds(admin)
        ns_res = Resource("", "v1", "namespaces", "Namespace", False)
        admin.create(
            ns_res, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": c.namespace}}
        )
        try:
            yield c
        finally:
            cleanup_real(admin, c)
            c.close()
        return
    fake = FakeApiServer(crd_manifests(str(CRD_DIR)))
    url = fake.start()
    # Through a token kubeconfig and the client's own loader, as against a real cluster:
    # the loader re-sets the configuration (host included) before every request.
    fake_kubeconfig = request.getfixturevalue("tmp_path") / "fake-kubeconfig"
    fake_kubeconfig.write_text(token_kubeconfig(url))

    def configure_fake(cfg: k8s_client.Configuration) -> None:
        from kubernetes import config as k8s_config

        loader: Any = k8s_config
        loader.load_kube_config(config_file=str(fake_kubeconfig), client_configuration=cfg)

    c = Cluster("fake", fake, "team-a", "", run, configure_fake)
    try:
        yield c
    finally:
        c.close()
        fake.stop()


@pytest.fixture
def fake_only(cluster: Cluster) -> FakeApiServer:
    """The fake server; the test is skipped on a real cluster (it inspects server internals)."""
    if cluster.fake is None:
        pytest.skip("inspects the fake API server's internals")
    return cluster.fake


@pytest.fixture
def fleet3(cluster: Cluster) -> Iterator[Kube]:
    """Three 2-GPU H100 GPUNodes and a greedy default policy; yields the test's client."""
    k = cluster.kube("mixfleet-test")
    k.create(PLACEMENT_POLICIES, policy_object(cluster.name("default"), policy="greedy"))
    for n in ("h100-0", "h100-1", "h100-2"):
        cluster.put_gpunode(k, n, inventory(n, "h100-0"), labels={"rack": "r1"})
    yield k
