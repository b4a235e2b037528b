"""The CLI's mutual-TLS files, checked before a connection is opened, so that a bad file is
reported as what it is, naming the option that gave it: a file that cannot be read, a
certificate or key that is not PEM, a certificate outside its validity period, a key that
is not the certificate's, a certificate given without its key. gRPC would report each of
these as a failed handshake (and log several lines of its own on stderr).

:func:`client_credentials` returns the three files' bytes once they passed;
:func:`describe_certificate` words a certificate for the error raised when the controller
closes a handshake (it refused the certificate, or wanted one).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from policies.errors import InputError

if TYPE_CHECKING:
    from cryptography import x509

#: Option -> where else its value may come from, for the "To fix" of an error.
SOURCES = {
    "--tls-ca": "--tls-ca, MIXFLEET_TLS_CA or tlsCa of the client config's context",
    "--tls-cert": "--tls-cert, MIXFLEET_TLS_CERT or tlsCert of the client config's context",
    "--tls-key": "--tls-key, MIXFLEET_TLS_KEY or tlsKey of the client config's context",
}
#: Largest PEM file read, bytes (a certificate chain is a few KiB).
MAX_PEM_BYTES = 1 << 20


@dataclass(frozen=True)
class ClientTls:
    """PEM bytes for ``grpc.ssl_channel_credentials``: the CA, and the client's
    certificate chain and key (both or neither)."""

    ca: bytes
    cert: bytes | None
    key: bytes | None


def _read(path: str, flag: str) -> bytes:
    p = Path(path).expanduser()
    try:
        with p.open("rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise InputError(
            f"cannot read {path} ({reason}). To fix: give a readable PEM file in {SOURCES[flag]}",
            field=flag,
        ) from None
    if len(data) > MAX_PEM_BYTES:
        raise InputError(f"{path} is larger than {MAX_PEM_BYTES} bytes: not a PEM file", field=flag)
    return data


def _certificate(data: bytes, path: str, flag: str) -> x509.Certificate:
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise InputError(
            f"{path} is not a PEM certificate. To fix: give the certificate "
            f"(-----BEGIN CERTIFICATE-----) in {SOURCES[flag]}",
            field=flag,
        ) from None


def _utc(when: dt.datetime) -> str:
    return when.strftime("%Y-%m-%d %H:%M UTC")


def describe_certificate(cert: x509.Certificate) -> str:
    """``CN mixfleet-admin, issued by CN mixfleet development CA, valid 2026-01-01 00:00 UTC
    to 2027-01-01 00:00 UTC``."""
    from cryptography.x509.oid import NameOID

    def cn(name: x509.Name) -> str:
        found = name.get_attributes_for_oid(NameOID.COMMON_NAME)
        return f"CN {found[0].value!s}" if found else name.rfc4514_string()

    return (
        f"{cn(cert.subject)}, issued by {cn(cert.issuer)}, valid "
        f"{_utc(cert.not_valid_before_utc)} to {_utc(cert.not_valid_after_utc)}"
    )


def check_validity(cert: x509.Certificate, path: str, flag: str, now: dt.datetime) -> None:
    """Raise :class:`InputError` when ``now`` (UTC) is outside the certificate's validity."""
    if now > cert.not_valid_after_utc:
        raise InputError(
            f"the client certificate {path} expired on {_utc(cert.not_valid_after_utc)} "
            f"({describe_certificate(cert)}). To fix: issue a new one from the controller's "
            f"CA and give it in {SOURCES[flag]}",
            field=flag,
        )
    if now < cert.not_valid_before_utc:
        raise InputError(
            f"the client certificate {path} is not valid before "
            f"{_utc(cert.not_valid_before_utc)} ({describe_certificate(cert)}); this "
            "machine's clock may be wrong. To fix: check the clock, or issue a certificate "
            "valid now",
            field=flag,
        )


def check_key_pair(cert: x509.Certificate, key_pem: bytes, cert_path: str, key_path: str) -> None:
    """Raise :class:`InputError` when ``key_pem`` is not a PEM private key, or not the
    private key of ``cert``."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise InputError(
            f"{key_path} is not an unencrypted PEM private key. To fix: give the key of "
            f"{cert_path} in {SOURCES['--tls-key']}",
            field="--tls-key",
        ) from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise InputError(
            f"{key_path} is not the private key of the certificate {cert_path} "
            f"({describe_certificate(cert)}). To fix: give the key issued with that "
            f"certificate (e.g. admin-key.pem with admin.pem) in {SOURCES['--tls-key']}",
            field="--tls-key",
        )


def client_credentials(
    ca: str, cert: str | None, key: str | None, *, now: dt.datetime | None = None
) -> ClientTls:
    """Read and check the TLS files of a client connection (paths as given; ``~``
    expanded); ``now`` is the UTC time the certificate must be valid at (default: now).

    Raises:
        InputError: a file cannot be read or parsed, the certificate is expired or not yet
            valid, the key is not the certificate's, or only one of the two is given; the
            error's field names the option.
    """
    ca_pem = _read(ca, "--tls-ca")
    _certificate(ca_pem, ca, "--tls-ca")
    if bool(cert) != bool(key):
        given, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
        raise InputError(
            f"{given} is given without {missing}: a client certificate needs its private "
            f"key. To fix: give both (in {SOURCES[missing]}), or neither for a controller "
            "that does not ask for client certificates",
            field=missing,
        )
    if not cert or not key:
        return ClientTls(ca_pem, None, None)
    cert_pem = _read(cert, "--tls-cert")
    key_pem = _read(key, "--tls-key")
    parsed = _certificate(cert_pem, cert, "--tls-cert")
    check_validity(parsed, cert, "--tls-cert", now or dt.datetime.now(dt.UTC))
    check_key_pair(parsed, key_pem, cert, key)
    return ClientTls(ca_pem, cert_pem, key_pem)


def certificate_summary(cert_pem: bytes) -> str:
    """:func:`describe_certificate` of PEM bytes that :func:`client_credentials` accepted."""
    from cryptography import x509

    return describe_certificate(x509.load_pem_x509_certificate(cert_pem))
