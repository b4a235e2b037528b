"""A pytest plugin for every test (loaded by the root conftest.py): no
test reads the client config of the machine it runs on. A developer's
``~/.config/mixfleet/config.yaml`` (a current context with TLS files, a token) or a
``MIXFLEET_*`` variable must not change what a ``mixfleetctl`` under test connects to."""

from __future__ import annotations

from pathlib import Path

import pytest

_CLIENT_ENV = (
    "MIXFLEET_CONTEXT",
    "MIXFLEET_CONTROLLER",
    "MIXFLEET_TLS_CA",
    "MIXFLEET_TLS_CERT",
    "MIXFLEET_TLS_KEY",
    "MIXFLEET_TOKEN",
    "MIXFLEET_TOKEN_FILE",
)


@pytest.fixture(autouse=True)
def _no_client_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIXFLEET_CONFIG", str(tmp_path / "no-client-config.yaml"))
    for name in _CLIENT_ENV:
        monkeypatch.delenv(name, raising=False)
