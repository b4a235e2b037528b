"""The controller's gRPC server: options, and :func:`create_server` registering AgentService,
PlanService, EngineService, health and reflection behind the :class:`Guard` interceptor.

:func:`create_server` returns ``(server, port)`` so tests bind port 0.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from mixfleet.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    plan_pb2,
    plan_pb2_grpc,
)

from controlplane.server.auth import DEV_MODE_WARNING, Authenticator, load_tokens
from controlplane.server.controller import Controller
from controlplane.server.services.agent import AgentServicer
from controlplane.server.services.engine import EngineServicer
from controlplane.server.services.guard import Guard
from controlplane.server.services.plan import PlanServicer
from policies.errors import InputError
from policies.limits import MAX_REPLY_BYTES, MAX_REQUEST_BYTES

MIB = 1 << 20
SERVICE_NAMES = (
    agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
    plan_pb2.DESCRIPTOR.services_by_name["PlanService"].full_name,
    engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name,
)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of the server side of mutual TLS.

    Attributes:
        cert: server certificate (chain).
        key: its private key.
        ca: CA that signed the client certificates to accept.
    """

    cert: Path
    key: Path
    ca: Path


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and whom it lets in.

    Attributes:
        tls: mutual TLS files; None = plaintext (needs ``insecure`` and a loopback address).
        token_file: bearer tokens (see :mod:`controlplane.server.auth`); None = no tokens.
        insecure: allow plaintext; only on a loopback address.
        max_receive_message_bytes: largest request message accepted, bytes (a larger one
            is refused with RESOURCE_EXHAUSTED before it is decoded).
        max_send_message_bytes: largest response message sent, bytes (clients accept as
            much: :data:`policies.limits.MAX_REPLY_BYTES`).
        max_pending_rpcs: calls gRPC may hold that the server has not picked up yet (its
            ``grpc.server.max_pending_requests``; the hard limit is twice this). gRPC's
            default of 1,000 is too small for a fleet: every agent keeps a WatchAssignments
            stream open and heartbeats, so when the event loop is busy for a moment (a
            rollout to 2,000 nodes) more than 1,000 calls arrive before it picks them up, and
            gRPC refuses the excess - streams that never open, heartbeats that fail, nodes
            declared lost.
    """

    tls: TlsFiles | None = None
    token_file: Path | None = None
    insecure: bool = False
    max_receive_message_bytes: int = MAX_REQUEST_BYTES
    max_send_message_bytes: int = MAX_REPLY_BYTES
    max_pending_rpcs: int = 32_768


# --------------------------------------------------------------------------- server


def is_loopback(address: str) -> bool:
    """Whether ``HOST:PORT`` names a loopback host."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_options(address: str, opts: ServerOptions) -> Authenticator:
    """Check what :func:`create_server` needs before anything is opened or created (a
    refused start leaves no file behind), and load the token file.

    Returns:
        the authenticator of the token file (development mode without TLS and tokens).

    Raises:
        InputError: plaintext without ``insecure`` or off loopback; a TLS file, or an empty,
            unreadable or non-UTF-8 token file (the reason named).
    """
    if opts.tls is None:
        if not opts.insecure:
            raise InputError(
                "no TLS configured. To fix: pass --tls-cert/--tls-key/--tls-ca (make them "
                "with 'mixfleetctl certs init DIR'), or --insecure on a loopback address",
                field="tls",
            )
        if not is_loopback(address):
            raise InputError(
                f"--insecure is only allowed on loopback, not {address}. To fix: listen on "
                "127.0.0.1 or configure TLS",
                field="listen",
            )
    else:
        tls = opts.tls
        for flag, path in (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-ca", tls.ca)):
            if not path.is_file():
                raise InputError(f"cannot read TLS file {str(path)!r}: no such file", field=flag)
    tokens = load_tokens(opts.token_file) if opts.token_file is not None else None
    return Authenticator(tokens, dev_mode=opts.tls is None and opts.insecure)


def create_server(
    address: str, controller: Controller, options: ServerOptions | None = None
) -> tuple[grpc.aio.Server, int]:
    """Build (not start) the server on ``address`` (``HOST:PORT``; port 0 = any free port).

    Returns:
        ``(server, port)``; ``await server.start()`` to serve.

    Raises:
        InputError: plaintext without ``insecure`` or off loopback, unreadable TLS or token
            files, or the address cannot be bound.
    """
    opts = options or ServerOptions()
    auth = check_options(address, opts)
    if auth.dev_mode:
        structlog.get_logger("mixfleet.server").warning(DEV_MODE_WARNING, address=address)
    server = grpc.aio.server(
        interceptors=[Guard(auth, controller)],
        options=[
            ("grpc.max_receive_message_length", opts.max_receive_message_bytes),
            ("grpc.max_send_message_length", opts.max_send_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.server.max_pending_requests", opts.max_pending_rpcs),
            ("grpc.server.max_pending_requests_hard_limit", 2 * opts.max_pending_rpcs),
        ],
    )
    agent_pb2_grpc.add_AgentServiceServicer_to_server(AgentServicer(controller), server)
    plan_pb2_grpc.add_PlanServiceServicer_to_server(PlanServicer(controller), server)
    engine_pb2_grpc.add_EngineServiceServicer_to_server(EngineServicer(controller), server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        if opts.tls is not None:
            creds = grpc.ssl_server_credentials(
                [(opts.tls.key.read_bytes(), opts.tls.cert.read_bytes())],
                root_certificates=opts.tls.ca.read_bytes(),
                require_client_auth=True,
            )
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except OSError as exc:
        raise InputError(f"cannot read TLS files: {exc}", field="tls") from exc
    except RuntimeError as exc:
        raise InputError(f"cannot listen on {address}: {exc}", field="listen") from exc
    if port == 0:
        raise InputError(f"cannot listen on {address}", field="listen")
    server.mixfleet_health = health_servicer  # type: ignore[attr-defined]
    return server, port


async def mark_serving(server: grpc.aio.Server) -> None:
    """Set the health status of the whole server and each service to SERVING."""
    h: health_aio.HealthServicer = server.mixfleet_health  # type: ignore[attr-defined]
    for name in ("", *SERVICE_NAMES):
        await h.set(name, health_pb2.HealthCheckResponse.SERVING)
