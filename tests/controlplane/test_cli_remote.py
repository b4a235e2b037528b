"""The remote CLI against a real controller (running in a background thread)."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_fakes import controller_in_thread, small_inventories, wait_until

from controlplane.cli import certs, connection, deploy, nodes, plans, watch
from controlplane.cli import controller as controller_cli
from controlplane.server.inprocess import RunningController
from policies.errors import InputError, MixfleetError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deployments" / "mixtral-small.yaml"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mixfleetctl")
    connection.add_connection_args(p)
    groups = p.add_subparsers(dest="command")
    for module in (controller_cli, certs, nodes, deploy, plans, watch):
        module.register(groups)
    return p


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    args = parser().parse_args(list(argv))
    assert args.handler(args) == 0
    return capsys.readouterr().out


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[RunningController]:
    """A controller with three fake agents on its own event loop in a thread."""
    yield from controller_in_thread(tmp_path, small_inventories())


def test_nodes_deploy_plans_watch(
    controller: RunningController, capsys: pytest.CaptureFixture[str]
) -> None:
    addr = ["--controller", controller.address]
    out = cli(capsys, *addr, "nodes", "list")
    assert out.splitlines()[0].split() == [
        "NODE",
        "HEALTH",
        "GPUS",
        "MODELS",
        "LABELS",
        "ADDRESS",
        "SIMULATED",
        "SEEN",
    ]
    assert "n0" in out and "2/2" in out
    nodes = json.loads(cli(capsys, "nodes", "list", "-o", "json", *addr))  # options after, too
    assert [n["inventory"]["node"] for n in nodes] == ["n0", "n1", "n2"]
    assert "H100-SXM5-80GB" in cli(capsys, *addr, "nodes", "show", "n0")

    assert "deployment/mixtral applied" in cli(capsys, *addr, "deploy", "apply", "-f", str(EXAMPLE))
    store = controller.controller.store
    asyncio.run(
        wait_until(
            lambda: (d := store.get_deployment("mixtral")) is not None and d.committed_version == 1,
            what="committed",
        )
    )
    out = cli(capsys, *addr, "deploy", "get")
    assert "mixtral" in out and "ready" in out
    got = json.loads(cli(capsys, *addr, "deploy", "get", "mixtral", "-o", "json"))
    assert got["kind"] == "ModelDeployment" and got["metadata"]["name"] == "mixtral"
    assert got["status"]["committedVersion"] == 1  # camelCase: the document apply reads
    usd = got["status"]["costPerMillionTokensUsd"]
    assert usd > 0 and "USD_PER_MTOK" in out and f"{usd:.3f}" in out
    assert got["status"]["nodes"] == ["n1"]  # nodeSelector rack: r1

    out = cli(capsys, *addr, "plans", "list")
    assert "committed" in out and "deployment created" in out
    show = json.loads(cli(capsys, *addr, "plans", "show", "mixtral", "-o", "json"))
    assert show["plan"]["version"] == 1 and show["record"]["state"] == "committed"
    assert show["record"]["version"] == 1  # a number, as users write it
    assert "n1/gpu0" in cli(capsys, *addr, "plans", "show", "mixtral")
    history = cli(capsys, *addr, "plans", "history", "mixtral").splitlines()
    assert "CREATED" in history[0] and set(history[1]) <= {"-", " "}  # the rule line
    assert "committed" in history[2]
    out = cli(capsys, *addr, "watch", "--count", "1")
    assert "mixtral v1 committed" in out

    with pytest.raises(MixfleetError, match="no served version before 1"):
        cli(capsys, *addr, "plans", "diff", "mixtral")
    assert "deleted" in cli(capsys, *addr, "deploy", "delete", "mixtral")


def test_bad_files_and_unreachable_controller(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: mixfleet.io/v1alpha1\nkind: ModelDeployment\n"
        "metadata: {name: x}\nspec: {model: mixtral-8x7b, policy: magic}\n"
    )
    with pytest.raises(InputError, match=r"spec\.policy"):
        cli(capsys, "deploy", "apply", "-f", str(bad))
    with pytest.raises(MixfleetError, match="cannot reach the controller"):
        cli(capsys, "--controller", "127.0.0.1:1", "nodes", "list")


def test_certs_init_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = cli(capsys, "certs", "init", str(tmp_path / "pki"), "--san", "ctl.example")
    assert "--tls-cert server.pem" in out
    assert (tmp_path / "pki" / "tokens").exists()


def test_controller_run_serves_and_logs_json(tmp_path: Path) -> None:
    """``mixfleetctl controller run`` in a subprocess: serves health, logs JSON lines with ids,
    stops cleanly on SIGTERM."""
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        metrics_port = sock.getsockname()[1]
    code = (
        "import argparse, sys; from controlplane.cli import controller; "
        "p = argparse.ArgumentParser(); controller.register(p.add_subparsers()); "
        "a = p.parse_args(sys.argv[1:]); sys.exit(a.handler(a))"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "controller",
            "run",
            "--listen",
            "127.0.0.1:0",
            "--insecure",
            "--store",
            f"sqlite:{tmp_path}/state.db",
            "--store-new",
            "--metrics-port",
            str(metrics_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line
        address = line.split()[-1]
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with direct.open(url, timeout=10) as page:
            text = page.read().decode()
        assert 'mixfleet_rpc_seconds_count{code="OK",method="/grpc.health.v1.Health/Check"}' in text
        assert "mixfleet_healthy_nodes" in text
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        events = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
        listening = next(e for e in events if e["event"] == "controller listening")
        assert listening["address"] == address and listening["level"] == "info"
        assert "timestamp" in listening
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / "state.db").exists()
