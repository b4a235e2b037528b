"""``mixfleetctl controller run`` on the Kubernetes store as the chart runs it (against the
fake API server, and the cluster of ``MIXFLEET_E2E_KUBECONFIG`` when set): gRPC health on
``--health-listen`` for the kubelet's probes, leader election on a Lease (a standby is alive
but not ready and does not serve; a stopped leader releases the Lease and the standby takes
over), and one ``error:`` line - no traceback - when there is no Kubernetes configuration,
for the controller and for the operator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from k8s_cluster import E2E_ENV, Cluster, token_kubeconfig, wait_for
from support.fakeapi import FakeApiServer

from apis.kube.client import LEASES, Resource
from apis.kube.errors import CrdMissingError
from apis.kube.v1alpha1 import GROUP, VERSION

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status)
        except grpc.RpcError:
            return -1


def _no_kube_env(tmp_path: Path) -> dict[str, str]:
    """An environment without any Kubernetes configuration (no service account, no
    kubeconfig)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "POD_"))}
    return {**env, "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}


def _run_without_kube(tmp_path: Path, cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """``cmd`` run to its end in an environment without Kubernetes configuration
    (:func:`_no_kube_env`), its output captured."""
    return subprocess.run(
        cmd,
        cwd=ROOT,
        env=_no_kube_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _one_error_line(err: str) -> str:
    """The one ``error:`` line of ``err``, which holds no traceback."""
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


def test_the_operator_without_a_kubeconfig_prints_one_error_line(tmp_path: Path) -> None:
    for extra in ([], ["--kubeconfig", str(tmp_path / "missing")]):
        done = _run_without_kube(
            tmp_path, [sys.executable, "-m", "operators", "run", "--metrics-port", "0", *extra]
        )
        assert done.returncode == 1, done.stderr
        line = _one_error_line(done.stderr)
        assert "no usable Kubernetes configuration" in line and "To fix:" in line


def test_the_controller_without_a_kubeconfig_prints_one_error_line(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "controlplane.cli", "controller", "run", "--insecure"]
    cmd += ["--listen", "127.0.0.1:0", "--store", "kubernetes:mixfleet-system", "--leader-elect"]
    done = _run_without_kube(tmp_path, cmd)
    assert done.returncode == 1, done.stderr
    line = _one_error_line(done.stderr)
    assert "store kubernetes:mixfleet-system" in line and "To fix:" in line


def test_leader_election_needs_the_kubernetes_store(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "controlplane.cli", "controller", "run", "--insecure"]
    cmd += ["--listen", "127.0.0.1:0", "--store", f"sqlite:{tmp_path / 's.db'}", "--store-new"]
    cmd += ["--leader-elect"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "--leader-elect needs --store kubernetes:NAMESPACE" in _one_error_line(done.stderr)


def _controller(
    cluster: Cluster, kubeconfig: Path, identity: str, health: int
) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "controlplane.cli", "controller", "run", "--insecure"]
    cmd += ["--listen", "127.0.0.1:0", "--store", f"kubernetes:{cluster.namespace}"]
    cmd += ["--health-listen", f"127.0.0.1:{health}", "--leader-elect", "--identity", identity]
    cmd += ["--lease-name", cluster.name("ctl-lease"), "--lease-namespace", cluster.namespace]
    cmd += ["--lease-duration-s", "4", "--renew-deadline-s", "3", "--retry-period-s", "0.2"]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_controllers_one_leads_and_serves_the_other_waits_then_takes_over(
    cluster: Cluster, tmp_path: Path
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    if cluster.fake is not None:
        kubeconfig.write_text(token_kubeconfig(cluster.fake.url))
    else:
        kubeconfig = Path(os.environ[E2E_ENV])
    ports = {"a": _free_port(), "b": _free_port()}
    a = _controller(cluster, kubeconfig, "a", ports["a"])
    b: subprocess.Popen[str] | None = None
    k = cluster.kube()
    lease_name = cluster.name("ctl-lease")
    try:
        wait_for(lambda: _health(ports["a"], "") == SERVING, timeout_s=90, what="a ready")
        assert _health(ports["a"], "mixfleet.controller.Leader") == SERVING
        lease = k.get(LEASES, lease_name, cluster.namespace)
        assert lease is not None and lease["spec"]["holderIdentity"] == "a"
        b = _controller(cluster, kubeconfig, "b", ports["b"])
        wait_for(lambda: _health(ports["b"], "liveness") == SERVING, timeout_s=90, what="b up")
        assert _health(ports["b"], "") == NOT_SERVING  # a standby is alive, not ready
        assert _health(ports["b"], "mixfleet.controller.Leader") == NOT_SERVING
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=30) == 0
        wait_for(lambda: _health(ports["b"], "") == SERVING, timeout_s=30, what="b takes over")
        lease = k.get(LEASES, lease_name, cluster.namespace)
        assert lease is not None and lease["spec"]["holderIdentity"] == "b"
        b.send_signal(signal.SIGTERM)
        assert b.wait(timeout=30) == 0
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
    out_a, _ = a.communicate(timeout=10)
    assert "listening on 127.0.0.1:" in out_a
    assert b is not None
    out_b, _ = b.communicate(timeout=10)
    assert "listening on 127.0.0.1:" in out_b  # only once it led
    lease = k.get(LEASES, lease_name, cluster.namespace)
    assert lease is not None and not lease["spec"].get("holderIdentity")  # released


def test_without_the_crds_the_controller_says_which_to_install(tmp_path: Path) -> None:
    """A cluster without mixfleet's CRDs: ``controller run --kubeconfig`` exits with one
    error line that names them and the command that installs them (not a bare 404)."""
    fake = FakeApiServer([])
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(token_kubeconfig(fake.start()))
    try:
        cmd = [sys.executable, "-m", "controlplane.cli", "controller", "run", "--insecure"]
        cmd += ["--listen", "127.0.0.1:0", "--store", "kubernetes:mixfleet-system"]
        cmd += ["--kubeconfig", str(kubeconfig)]
        done = _run_without_kube(tmp_path, cmd)
    finally:
        fake.stop()
    assert done.returncode == 1, done.stderr
    line = _one_error_line(done.stderr)
    assert "modeldeployments.mixfleet.io" in line and "gpunodes.mixfleet.io" in line, line
    assert "kubectl apply --server-side -f charts/mixfleet/crds/" in line, line


def test_a_mixfleet_resource_the_server_does_not_serve_names_the_crds(cluster: Cluster) -> None:
    """What kube-apiserver answers for a collection nobody defined (404), read as a missing
    CRD - on the fake and on a real API server."""
    absent = Resource(GROUP, VERSION, "nosuchwidgets", "NoSuchWidget", True)
    with pytest.raises(CrdMissingError) as missing:
        cluster.kube().list(absent, cluster.namespace)
    assert missing.value.status == 404
    assert "does not serve nosuchwidgets.mixfleet.io/v1alpha1" in str(missing.value)
    assert "partitionplans.mixfleet.io" in str(missing.value)
