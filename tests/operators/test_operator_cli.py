"""``python -m operators run`` as a process: kubeconfig, gRPC health for the kubelet's probes,
leader election, a deployment solved, clean shutdown on SIGTERM (lease released)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from k8s_builders import inventory, md_object, policy_object
from k8s_cluster import Cluster, wait_for

from apis.kube.client import LEASES, MODEL_DEPLOYMENTS, PLACEMENT_POLICIES

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
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


def test_operator_process_serves_health_leads_solves_and_stops(
    cluster: Cluster, tmp_path: Path
) -> None:
    if cluster.fake is None:
        pytest.skip("starts the operator against the fake API server")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": cluster.fake.url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
                "current-context": "fake",
            }
        )
    )
    k = cluster.kube()
    k.create(PLACEMENT_POLICIES, policy_object("default", policy="greedy"))
    cluster.put_gpunode(k, "h100-0", inventory("h100-0"))
    port = _free_port()
    cmd = [
        sys.executable, "-m", "operators", "run",
        "--kubeconfig", str(kubeconfig),
        "--namespace", cluster.namespace,
        "--lease-namespace", cluster.namespace,
        "--identity", "op-cli",
        "--health-listen", f"127.0.0.1:{port}",
        "--metrics-port", "0",
        "--lease-duration-s", "3", "--renew-deadline-s", "2", "--retry-period-s", "0.2",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        serving = health_pb2.HealthCheckResponse.SERVING
        wait_for(lambda: _health(port, "") == serving, timeout_s=90, what="ready")
        assert _health(port, "liveness") == serving
        wait_for(
            lambda: _health(port, "mixfleet.operator.Leader") == serving,
            timeout_s=60,
            what="leader",
        )
        k.create(MODEL_DEPLOYMENTS, md_object("mx", cluster.namespace))

        def solved() -> bool:
            obj = k.get(MODEL_DEPLOYMENTS, "mx", cluster.namespace) or {}
            conds = (obj.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Solved" and c["status"] == "True" for c in conds)

        wait_for(solved, timeout_s=90, what="Solved")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=10)
    assert '"event": "operator started"' in err
    lease = k.get(LEASES, "mixfleet-operator", cluster.namespace)
    assert lease is not None and not lease["spec"].get("holderIdentity")  # released on exit


def test_metrics_and_health_bind_loopback_unless_told_otherwise() -> None:
    from operators.cli import build_parser

    args = build_parser().parse_args(["run"])
    assert (args.health_listen, args.metrics_address) == ("127.0.0.1:8081", "127.0.0.1")
    args = build_parser().parse_args(
        ["run", "--health-listen", "0.0.0.0:8081", "--metrics-address", "0.0.0.0"]
    )
    assert (args.health_listen, args.metrics_address) == ("0.0.0.0:8081", "0.0.0.0")
