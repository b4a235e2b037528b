"""A development certificate authority for mutual TLS (``mixfleetctl certs init DIR``).

Writes into DIR (private keys and the token file mode 0600, certificates 0644; each file is
written new and renamed into place, so ``--force`` resets the modes and replaces a link
planted at a file's path instead of writing through it):

* ``ca.pem`` / ``ca-key.pem`` - the CA (give ``ca.pem`` to every party);
* ``server.pem`` / ``server-key.pem`` - the controller (SANs: localhost, 127.0.0.1, ::1 and
  any ``--san`` names);
* ``agent.pem`` / ``agent-key.pem`` - CN ``mixfleet-agent``: an agent for any node;
* ``admin.pem`` / ``admin-key.pem`` - CN ``mixfleet-admin``: the CLI;
* ``engine.pem`` / ``engine-key.pem`` - CN ``mixfleet-engine``: inference engines;
* ``tokens`` - bearer tokens (admin, viewer, engine) for ``--token-file``.

For production use your own PKI; node-bound agent certificates use CN ``node:<name>``
(:func:`issue` makes one).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from apis.documents import read_limited
from controlplane.server.auth import ADMIN_CN, AGENT_CN, ENGINE_CN
from policies.errors import InputError
from policies.limits import decode_utf8

VALID_DAYS = 365


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "mixfleet development"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write_private(path, data)


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600 (:func:`_write_new`)."""
    _write_new(path, data, 0o600)


def _write_public(path: Path, data: bytes) -> None:
    """Write a certificate to ``path`` with mode 0644 (:func:`_write_new`)."""
    _write_new(path, data, 0o644)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a new file beside ``path`` (created exclusively, never through a
    link, with ``mode``) and rename it over ``path``. Whatever was at ``path`` is replaced,
    not written to: ``--force`` over a file of a looser mode leaves ``mode``, and a symlink
    planted at a key path is replaced by the key instead of the link's target receiving it.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # the umask may have narrowed it
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _load_ca(out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((out / "ca-key.pem").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InputError("ca-key.pem is not an EC key made by certs init", field="ca-key.pem")
    return cert, key


def make_ca(out: Path, *, now: dt.datetime | None = None) -> Issued:
    """A self-signed CA in ``out``."""
    now = now or dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("mixfleet development CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write_public(out / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    _write_key(out / "ca-key.pem", key)
    return Issued(out / "ca.pem", out / "ca-key.pem")


def issue(
    out: Path,
    stem: str,
    common_name: str,
    *,
    server: bool = False,
    sans: Sequence[str] = (),
    now: dt.datetime | None = None,
) -> Issued:
    """A certificate signed by the CA in ``out``, written as ``STEM.pem`` / ``STEM-key.pem``."""
    now = now or dt.datetime.now(dt.UTC)
    ca_cert, ca_key = _load_ca(out)
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        names: list[x509.GeneralName] = []
        for san in ("localhost", "127.0.0.1", "::1", *sans):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(san)))
            except ValueError:
                names.append(x509.DNSName(san))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_public(out / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM))
    _write_key(out / f"{stem}-key.pem", key)
    return Issued(out / f"{stem}.pem", out / f"{stem}-key.pem")


def init_dev_pki(out: str | Path, *, sans: Sequence[str] = (), force: bool = False) -> Path:
    """Write the development CA, certificates and token file (module docstring) to ``out``.

    Raises:
        InputError: ``out`` already holds a CA and ``force`` is False.
    """
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    if (d / "ca.pem").exists() and not force:
        raise InputError(
            f"{d} already holds a CA. To fix: choose another directory or pass --force",
            field="DIR",
        )
    make_ca(d)
    issue(d, "server", "mixfleet-controller", server=True, sans=sans)
    issue(d, "agent", AGENT_CN)
    issue(d, "admin", ADMIN_CN)
    issue(d, "engine", ENGINE_CN)
    lines = [
        "# mixfleet bearer tokens: <token> <role> <name>",
        f"{secrets.token_urlsafe(24)} admin cli",
        f"{secrets.token_urlsafe(24)} viewer dashboard",
        f"{secrets.token_urlsafe(24)} engine engines",
    ]
    _write_private(d / "tokens", ("\n".join(lines) + "\n").encode())
    return d


def token_for(path: str | Path, role: str) -> str:
    """The first token of ``role`` in a token file (for the CLI and tests).

    Raises:
        InputError: no token of that role.
    """
    where = f"token file {str(path)!r}"
    try:
        text = decode_utf8(read_limited(path, "token file", "token"), where)
    except InputError as exc:
        raise InputError(str(exc), field="token_file") from exc
    for raw in text.splitlines():
        parts = raw.split("#", 1)[0].split()
        if len(parts) >= 2 and parts[1] == role:
            return parts[0]
    raise InputError(f"no {role} token in {path}", field="token_file")
