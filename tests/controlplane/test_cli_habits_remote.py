"""``mixfleetctl`` habits against a real in-process controller: ``watch`` survives a
controller restart on the same port, a plaintext client meeting a TLS controller (and the
reverse) is told so, ``fleet export`` writes a Fleet file the offline commands read, and
``deploy get -o yaml`` applies back unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import io
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_fakes import FakeAgent, small_inventories, wait_until

from controlplane.cli import main
from controlplane.cli.files import read_fleet
from controlplane.server.certs import init_dev_pki
from controlplane.server.inprocess import start_controller
from controlplane.server.services import TlsFiles

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deployments" / "mixtral-small.yaml"


class Background:
    """A controller (with fake agents) on its own event loop in a thread; :meth:`stop`
    ends it, :meth:`start` starts it again on the same port and store."""

    def __init__(self, tmp_path: Path, **options: Any) -> None:
        self.tmp_path, self.options = tmp_path, options
        self.port = 0
        self.controller: Any = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self, *, agents: bool = True) -> Background:
        ready = threading.Event()
        loop = asyncio.new_event_loop()

        async def serve() -> None:
            async with start_controller(self.tmp_path, port=self.port, **self.options) as ctl:
                fakes = [FakeAgent(ctl.address, inv) for inv in small_inventories()]
                if agents:
                    for a in fakes:
                        await a.start()
                self.port, self.controller = ctl.port, ctl
                self._stop = asyncio.Event()
                self._loop = loop
                ready.set()
                await self._stop.wait()
                if agents:
                    for a in fakes:
                        await a.stop()

        self._thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
        self._thread.start()
        assert ready.wait(30)
        return self

    def stop(self) -> None:
        assert self._stop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
def no_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIXFLEET_CONFIG", str(tmp_path / "absent.yaml"))
    for env in ("MIXFLEET_CONTROLLER", "MIXFLEET_TOKEN", "MIXFLEET_TOKEN_FILE", "MIXFLEET_TLS_CA"):
        monkeypatch.delenv(env, raising=False)


@pytest.fixture
def controller(tmp_path: Path, no_config: None) -> Iterator[Background]:
    bg = Background(tmp_path).start()
    yield bg
    bg.stop()


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _committed(bg: Background, name: str) -> None:
    store = bg.controller.controller.store
    asyncio.run(
        wait_until(
            lambda: (d := store.get_deployment(name)) is not None and bool(d.committed_version),
            what="committed",
        )
    )


def test_deploy_get_yaml_applies_back(controller: Background, tmp_path: Path) -> None:
    addr = ["--controller", controller.address]
    assert run(*addr, "deploy", "apply", "-f", str(EXAMPLE))[0] == 0
    _committed(controller, "mixtral")
    code, out, err = run(*addr, "deploy", "get", "mixtral", "-o", "yaml")
    assert code == 0, err
    doc = yaml.safe_load(out)
    assert doc["kind"] == "ModelDeployment" and "tokensPerGpu" in doc["spec"]["workload"]
    assert doc["status"]["committedVersion"] == 1
    saved = tmp_path / "got.yaml"
    saved.write_text(out)
    code, out, err = run(*addr, "deploy", "apply", "-f", str(saved), "-o", "yaml")
    assert code == 0, err
    again = yaml.safe_load(out)
    assert again["spec"] == doc["spec"]  # the same spec: apply(get -o yaml) is a no-op
    assert again["status"]["generation"] == doc["status"]["generation"]
    code, out, _ = run(*addr, "deploy", "get", "-o", "yaml")  # a List applies too
    saved.write_text(out)
    assert run(*addr, "deploy", "apply", "-f", str(saved), "-o", "name")[1] == (
        "deployment/mixtral\n"
    )


def test_fleet_export_reads_back(controller: Background, tmp_path: Path) -> None:
    out_file = tmp_path / "exported.yaml"
    code, _, err = run(
        "fleet", "export", "--controller", controller.address, "--name", "live", "--out",
        str(out_file),
    )  # fmt: skip
    assert code == 0, err
    fleet = read_fleet(out_file)
    assert fleet.name == "live" and [n.name for n in fleet.nodes] == ["n0", "n1", "n2"]
    want = {inv.node: len(inv.gpus) for inv in small_inventories()}
    assert {n.name: len(n.gpus) for n in fleet.nodes} == want
    doc = yaml.safe_load(out_file.read_text())
    assert all(len(n["gpus"]) == 1 for n in doc["spec"]["nodes"])  # one group per node
    code, out, _ = run("nodes", "list", "--controller", controller.address, "-o", "name")
    assert out.split() == ["node/n0", "node/n1", "node/n2"]
    code, out, _ = run("nodes", "list", "--controller", controller.address, "-o", "yaml")
    assert [n["inventory"]["node"] for n in yaml.safe_load(out)] == ["n0", "n1", "n2"]


def test_watch_reconnects_after_a_restart(tmp_path: Path, no_config: None) -> None:
    bg = Background(tmp_path).start()
    addr = ["--controller", bg.address]
    assert run(*addr, "deploy", "apply", "-f", str(EXAMPLE))[0] == 0
    _committed(bg, "mixtral")
    watch = subprocess.Popen(  # a process of its own: its stdout is its own
        [sys.executable, "-m", "controlplane.cli", *addr, "watch", "--count", "2", "--timeout",
         "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert watch.stdout is not None
        first = watch.stdout.readline()  # v1 committed, replayed on connect
        assert "mixtral v1 committed" in first, first
        bg.stop()  # the controller goes away ...
        bg.start()  # ... and comes back on the same port with the same store
        changed = tmp_path / "changed.yaml"  # a new version: an event after the restart
        changed.write_text(EXAMPLE.read_text().replace("tokensPerGpu: 32", "tokensPerGpu: 16"))
        assert run(*addr, "deploy", "apply", "-f", str(changed))[0] == 0
        out, err = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
        bg.stop()
    assert watch.returncode == 0, err
    assert "lost the controller" in err and "reconnecting" in err
    lines = out.splitlines()
    assert len(lines) == 1 and "mixtral v2" in lines[0], out  # v1 is not printed again


def test_plaintext_client_meets_tls_controller(tmp_path: Path, no_config: None) -> None:
    pki = init_dev_pki(tmp_path / "pki")
    tls = TlsFiles(pki / "server.pem", pki / "server-key.pem", pki / "ca.pem")
    bg = Background(tmp_path, tls=tls, token_file=pki / "tokens").start(agents=False)
    try:
        code, _, err = run("--controller", f"localhost:{bg.port}", "nodes", "list")
        assert code == 1 and "requires TLS" in err and "--tls-ca" in err, err
        tls_args = ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "admin.pem")]
        tls_args += ["--tls-key", str(pki / "admin-key.pem"), "--token-file", str(pki / "tokens")]
        code, _, err = run("--controller", f"localhost:{bg.port}", *tls_args, "nodes", "list")
        assert code == 0, err
    finally:
        bg.stop()
    plain = Background(tmp_path).start(agents=False)
    try:
        code, _, err = run("--controller", f"localhost:{plain.port}", *tls_args, "nodes", "list")
        assert code == 1 and "TLS handshake" in err and "plaintext" in err, err
    finally:
        plain.stop()
