"""How an agent reaches its controller and how it reads the controller's refusals.

Owns the agent's settings (:class:`AgentSettings`, :class:`TlsFiles`), the grpc.aio channel
built from them (:func:`make_channel`), and the sorting of gRPC status codes into temporary
(retry with backoff) and fatal (stop, with a message that says what to fix).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from agents.backoff import BackoffSettings
from policies.errors import InputError
from policies.limits import MAX_REPLY_BYTES, MAX_REQUEST_BYTES

#: The agents' default retry delays: jittered exponential from 0.5 s, capped at 4 s. With the
#: channel's own reconnects every <= 2 s, an agent is back within ~6 s of its controller.
RECONNECT_BACKOFF = BackoffSettings(initial_s=0.5, max_s=4.0, multiplier=2.0, jitter=0.5)

#: Status codes that mean "try again later" (controller down, restarting, overloaded).
TEMPORARY_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)
#: Status codes of Register that retrying cannot fix.
FATAL_CODES = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)


#: gRPC status codes by their number (``AckResponse.code``).
STATUS_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}
#: What ``read()`` of a grpc.aio stream returns at its end (missing from the type stubs).
STREAM_EOF: Any = getattr(aio, "EOF")  # noqa: B009


@dataclass(frozen=True)
class TlsFiles:
    """Client side of mutual TLS (PEM files).

    Attributes:
        cert: this agent's certificate.
        key: its private key.
        ca: the CA that signed the controller's certificate.
        server_name: name to check in the controller's certificate when it differs from
            the address's host (e.g. ``localhost`` when dialing 127.0.0.1); "" = the host.
    """

    cert: Path
    key: Path
    ca: Path
    server_name: str = ""


@dataclass(frozen=True)
class AgentSettings:
    """How an agent talks to its controller.

    Attributes:
        controller: ``host:port`` of the controller.
        tls: mutual-TLS files; None only together with ``insecure``.
        insecure: plaintext channel (loopback development only).
        token: bearer token sent as ``authorization`` metadata ("" = none).
        heartbeat_interval_s: heartbeat period, seconds; 0 = use the controller's.
        heartbeat_jitter: each period is scaled by a random factor in ``1 +- jitter``.
        rpc_timeout_s: deadline of each unary RPC, seconds.
        ack_attempts: tries of one Ack before leaving it to the stream's replay.
        rediscover_interval_s: re-run discovery this often to refresh GPU health, seconds;
            0 = never (static and simulated nodes).
        backoff: retry delays after failures; capped at :data:`RECONNECT_BACKOFF` 's 4 s
            by default, so a fleet whose controller restarted is back within seconds (the
            controller gives it the time it was down on top of ``node_lost_after_s``).
    """

    controller: str
    tls: TlsFiles | None = None
    insecure: bool = False
    token: str = ""
    heartbeat_interval_s: float = 0.0
    heartbeat_jitter: float = 0.1
    rpc_timeout_s: float = 10.0
    ack_attempts: int = 5
    rediscover_interval_s: float = 0.0
    backoff: BackoffSettings = field(default_factory=lambda: RECONNECT_BACKOFF)

    def __post_init__(self) -> None:
        if self.tls is None and not self.insecure:
            raise InputError(
                "no TLS credentials. To fix: pass --tls-cert, --tls-key and --tls-ca, or "
                "--insecure for a plaintext loopback connection",
                field="tls",
            )
        if self.heartbeat_interval_s < 0:
            raise InputError(
                f"must be >= 0, got {self.heartbeat_interval_s}", field="heartbeat_interval_s"
            )
        if not 0 <= self.heartbeat_jitter < 1:
            raise InputError(
                f"must be in [0, 1), got {self.heartbeat_jitter}", field="heartbeat_jitter"
            )


#: Channel options: keepalive so a dead controller is noticed within ~30 s even on an idle
#: stream, and reconnect attempts at least every 2 s, so a call after the controller is back
#: finds a connection (calls on a channel in TRANSIENT_FAILURE fail at once).
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # the controller's limits (policies.limits): larger requests are refused unread
    ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
)


def make_channel(settings: AgentSettings, *, own_connection: bool = False) -> aio.Channel:
    """A grpc.aio channel to the controller with the settings' credentials.

    Args:
        own_connection: do not share a TCP connection with other channels of this process
            (gRPC shares one between channels of equal arguments).

    Raises:
        InputError: a TLS file cannot be read (the message names it).
    """
    options = list(CHANNEL_OPTIONS)
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if settings.tls is None:
        return aio.insecure_channel(settings.controller, options=options)
    t = settings.tls
    pems: dict[str, bytes] = {}
    for name, path in (("tls_cert", t.cert), ("tls_key", t.key), ("tls_ca", t.ca)):
        try:
            pems[name] = Path(path).read_bytes()
        except OSError as exc:
            raise InputError(
                f"cannot read {str(path)!r}: {exc.strerror or exc}. To fix: make the files "
                "with `mixfleetctl certs init` and pass their paths",
                field=name,
            ) from exc
    creds = grpc.ssl_channel_credentials(
        root_certificates=pems["tls_ca"],
        private_key=pems["tls_key"],
        certificate_chain=pems["tls_cert"],
    )
    if t.server_name:
        options.append(("grpc.ssl_target_name_override", t.server_name))
    return aio.secure_channel(settings.controller, creds, options=options)


def fatal_message(exc: aio.AioRpcError) -> str:
    """The message of a fatal refusal: the code, the controller's details, what to fix."""
    code = exc.code()
    hint = {
        grpc.StatusCode.UNAUTHENTICATED: "To fix: check --tls-cert/--tls-key/--tls-ca (or the "
        "token) against the controller's CA and token file",
        grpc.StatusCode.PERMISSION_DENIED: "To fix: use the certificate issued for this node "
        "(CN node:<name>) or the fleet agent certificate",
        grpc.StatusCode.INVALID_ARGUMENT: "To fix: correct the reported inventory field named "
        "above (discovery configuration or Fleet file)",
    }.get(code, "")
    return f"controller refused the agent ({code.name}): {exc.details()}. {hint}".strip()
