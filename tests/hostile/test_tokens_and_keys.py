"""Token files and keys: a bad token file stops the start with the reason (and no file
created); keys, token files and the SQLite store are owner-only (0600), also after
``certs init --force``; development mode says so at start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.cli import main as mixfleetctl
from controlplane.server.auth import DEV_MODE_WARNING, load_tokens
from controlplane.server.certs import init_dev_pki
from controlplane.store.sqlite import SqliteStore
from policies.errors import InputError

PRIVATE = ("ca-key.pem", "server-key.pem", "agent-key.pem", "admin-key.pem", "engine-key.pem")


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "holds no token"),
        (b"# only a comment\n\n", "holds no token"),
        (b"\x80\x81 admin\n", "is not UTF-8 text: byte 0"),
        (b"admin-token-0123456789abcdef admin caf\xe9\n", "byte 38"),
        (b"short admin\n", "shorter than 16"),
        (b"agent-token-0123456789abcdef agent node:\n", "names no node"),
    ],
)
def test_bad_token_files_are_refused_with_the_reason(
    tmp_path: Path, content: bytes, needle: str
) -> None:
    path = tmp_path / "tokens"
    path.write_bytes(content)
    with pytest.raises(InputError, match="token_file") as err:
        load_tokens(path)
    assert needle in str(err.value)


def test_unreadable_and_missing_token_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(InputError, match="does not exist"):
        load_tokens(tmp_path / "absent")
    with pytest.raises(InputError, match="is a directory"):
        load_tokens(tmp_path)
    path = tmp_path / "tokens"
    path.write_text("admin-token-0123456789abcdef admin\n")
    path.chmod(0)

    def denied(self: Path, *args: object, **kwargs: object) -> object:
        raise PermissionError(13, "Permission denied", str(self))

    if os.geteuid() == 0:  # root reads a 0000 file: make the open fail as it would for a user
        monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(InputError, match="permission denied"):
        load_tokens(path)


def test_certs_init_force_resets_key_modes_to_0600(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    init_dev_pki(d)
    for name in (*PRIVATE, "tokens"):
        assert (d / name).stat().st_mode & 0o777 == 0o600, name
        (d / name).chmod(0o644)  # e.g. copied with a loose umask
    assert mixfleetctl(["certs", "init", str(d), "--force"]) == 0
    for name in (*PRIVATE, "tokens"):
        assert (d / name).stat().st_mode & 0o777 == 0o600, name
    assert (d / "ca.pem").stat().st_mode & 0o077 != 0o077  # certificates stay readable


@pytest.mark.parametrize("name", ["server-key.pem", "tokens", "ca.pem"])
def test_certs_init_force_replaces_a_planted_link_and_never_writes_through_it(
    tmp_path: Path, name: str
) -> None:
    d = tmp_path / "pki"
    init_dev_pki(d)
    victim = tmp_path / "victim"
    victim.write_text("not yours\n")
    victim.chmod(0o644)
    (d / name).unlink()
    (d / name).symlink_to(victim)  # planted by someone who can write DIR
    assert mixfleetctl(["certs", "init", str(d), "--force"]) == 0
    assert victim.read_text() == "not yours\n"  # never written through the link
    assert victim.stat().st_mode & 0o777 == 0o644
    assert not (d / name).is_symlink() and (d / name).read_bytes() != b"not yours\n"
    if name != "ca.pem":
        assert (d / name).stat().st_mode & 0o777 == 0o600


def test_the_sqlite_store_is_created_0600(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state" / "mixfleet.db")
    try:
        store.record_alive(1.0)  # a write: the WAL and shared-memory files exist now
        made = [p for p in (tmp_path / "state").iterdir() if p.name.startswith("mixfleet.db")]
        assert {p.name for p in made} >= {"mixfleet.db", "mixfleet.db-wal"}
        for p in made:
            assert p.stat().st_mode & 0o077 == 0, (p.name, oct(p.stat().st_mode))
    finally:
        store.close()


def _controller(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "controlplane.cli", "controller", "run", "--insecure"]
    argv += ["--listen", "127.0.0.1:0", "--store", f"sqlite:{tmp_path / 'state.db'}", *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_refused_start_creates_no_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_bytes(b"\xff\xfe")
    p = _controller(tmp_path, "--token-file", str(tokens))
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and err.startswith("error: token_file: token file"), err
    assert "byte 0" in err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["tokens"]


def test_development_mode_is_announced_at_start(tmp_path: Path) -> None:
    p = _controller(tmp_path, "--store-new", "--log-format", "console")
    try:
        assert p.stdout is not None and p.stderr is not None
        line = p.stdout.readline()  # "listening on ..." once it serves (pytest-timeout bounds it)
        assert line.startswith("listening on"), line
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert f"warning: {DEV_MODE_WARNING}" in err.splitlines()
