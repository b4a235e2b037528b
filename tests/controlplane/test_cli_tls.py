"""TLS errors name their cause: ``mixfleetctl`` against a real loopback controller that
requires mutual TLS, with real certificates from the development CA (``certs init``). Each
bad client file is one ``error:`` line naming the option and what is wrong with it (an
expired certificate, a missing file, a key of another certificate), and a controller that
closes the handshake is reported as wanting, or refusing, a client certificate. The CLI
runs as a subprocess so that anything gRPC itself writes on stderr is seen."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_fakes import controller_in_thread

from controlplane.cli.tlsfiles import client_credentials
from controlplane.server.auth import ADMIN_CN
from controlplane.server.certs import init_dev_pki, issue
from controlplane.server.inprocess import RunningController
from controlplane.server.services import TlsFiles
from policies.errors import InputError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = init_dev_pki(tmp_path_factory.mktemp("pki"))
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=400)
    issue(d, "expired", ADMIN_CN, now=long_ago)  # valid for 365 days, 400 days ago
    return d


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_dev_pki(tmp_path_factory.mktemp("foreign"))  # a CA the controller distrusts


@pytest.fixture(scope="module")
def controller(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningController]:
    tls = TlsFiles(pki / "server.pem", pki / "server-key.pem", pki / "ca.pem")
    yield from controller_in_thread(
        tmp_path_factory.mktemp("ctl"), [], tls=tls, token_file=pki / "tokens"
    )


def _cli(controller: RunningController, pki: Path, *tls: str) -> tuple[int, str, str]:
    """``mixfleetctl nodes list`` as a fresh process, with the admin token and ``tls``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXFLEET_")}
    env["MIXFLEET_CONFIG"] = str(pki / "no-client-config.yaml")
    argv = [
        sys.executable,
        "-m",
        "controlplane.cli",
        "--controller",
        f"localhost:{controller.port}",
    ]
    argv += ["--token-file", str(pki / "tokens"), *tls, "nodes", "list"]
    done = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    return done.returncode, done.stdout, done.stderr


def _one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_the_right_certificate_gets_in(controller: RunningController, pki: Path) -> None:
    tls = ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "admin.pem")]
    code, out, err = _cli(controller, pki, *tls, "--tls-key", str(pki / "admin-key.pem"))
    assert code == 0, err
    assert out.startswith("NODE") and err == ""


def test_an_expired_client_certificate_is_named_as_expired(
    controller: RunningController, pki: Path
) -> None:
    tls = ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "expired.pem")]
    code, _, err = _cli(controller, pki, *tls, "--tls-key", str(pki / "expired-key.pem"))
    line = _one_error_line(err)
    assert code == 2
    assert line.startswith("error: --tls-cert: the client certificate ")
    assert "expired on" in line and "CN mixfleet-admin" in line
    assert "cannot reach" not in line and "controller run" not in line


def test_a_missing_client_certificate_is_named_as_missing(
    controller: RunningController, pki: Path
) -> None:
    code, _, err = _cli(controller, pki, "--tls-ca", str(pki / "ca.pem"))
    line = _one_error_line(err)
    assert code == 1
    assert "requires a client certificate" in line and "none was given" in line
    assert "--tls-cert and --tls-key" in line and "controller run" not in line


def test_a_certificate_of_another_ca_is_named_as_refused(
    controller: RunningController, pki: Path, foreign: Path
) -> None:
    tls = ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(foreign / "admin.pem")]
    code, _, err = _cli(controller, pki, *tls, "--tls-key", str(foreign / "admin-key.pem"))
    line = _one_error_line(err)
    assert code == 1
    assert f"refused the client certificate {foreign / 'admin.pem'}" in line
    assert "controller run" not in line


def test_a_missing_certificate_file_is_named_as_tls_cert(
    controller: RunningController, pki: Path, tmp_path: Path
) -> None:
    absent = tmp_path / "absent.pem"
    tls = ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(absent)]
    code, _, err = _cli(controller, pki, *tls, "--tls-key", str(pki / "admin-key.pem"))
    line = _one_error_line(err)
    assert code == 2
    assert line.startswith(f"error: --tls-cert: cannot read {absent} (No such file")
    assert "--tls-ca:" not in line


def test_a_key_of_another_certificate_is_one_clear_line(
    controller: RunningController, pki: Path
) -> None:
    tls = ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "admin.pem")]
    code, _, err = _cli(controller, pki, *tls, "--tls-key", str(pki / "agent-key.pem"))
    line = _one_error_line(err)  # and no log line of gRPC's
    assert code == 2
    assert line.startswith(f"error: --tls-key: {pki / 'agent-key.pem'} is not the private key")
    assert "handshake" not in line and "plaintext" not in line


# ------------------------------------------------------------ the checks on their own


def test_a_certificate_without_its_key_is_refused(pki: Path) -> None:
    with pytest.raises(InputError) as err:
        client_credentials(str(pki / "ca.pem"), str(pki / "admin.pem"), None)
    assert err.value.field == "--tls-key" and "without --tls-key" in str(err.value)


def test_a_key_given_as_the_ca_is_not_a_certificate(pki: Path) -> None:
    with pytest.raises(InputError) as err:
        client_credentials(str(pki / "ca-key.pem"), None, None)
    assert err.value.field == "--tls-ca" and "is not a PEM certificate" in str(err.value)


def test_a_certificate_given_as_the_key_is_not_a_key(pki: Path) -> None:
    with pytest.raises(InputError) as err:
        client_credentials(str(pki / "ca.pem"), str(pki / "admin.pem"), str(pki / "admin.pem"))
    assert err.value.field == "--tls-key" and "not an unencrypted PEM private key" in str(err.value)


def test_a_certificate_not_yet_valid_points_at_the_clock(pki: Path) -> None:
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=1000)
    ca, cert, key = str(pki / "ca.pem"), str(pki / "admin.pem"), str(pki / "admin-key.pem")
    with pytest.raises(InputError) as err:
        client_credentials(ca, cert, key, now=long_ago)
    assert err.value.field == "--tls-cert" and "clock" in str(err.value)
    files = client_credentials(ca, cert, key)
    assert files.cert == (pki / "admin.pem").read_bytes()
    assert files.key == (pki / "admin-key.pem").read_bytes()
