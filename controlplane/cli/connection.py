"""How the controller's clients (``nodes``, ``deploy``, ``plans``, ``watch``) reach it.

Connection options (accepted before the command, ``mixfleetctl --controller ADDR nodes list``,
when the main parser adds them with :func:`add_connection_args`, and after it on every
client command, :func:`add_client`): ``--controller`` (env ``MIXFLEET_CONTROLLER``, default
``127.0.0.1:7070``), ``--token-file`` (env ``MIXFLEET_TOKEN_FILE``; its first admin, else
viewer, token is sent), ``--token`` (env ``MIXFLEET_TOKEN``), ``--tls-ca`` / ``--tls-cert`` /
``--tls-key`` (mutual TLS; plaintext without ``--tls-ca``).

:func:`call` runs one PlanService call and words gRPC errors for the user
(:func:`rpc_error`); :func:`to_json`, :func:`age` and :func:`ms` format replies.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from mixfleet.v1 import plan_pb2_grpc

from controlplane.cli.output import Groups, Handler, add_leaf
from policies.errors import InputError, MixfleetError
from policies.limits import MAX_REPLY_BYTES, MAX_REQUEST_BYTES

DEFAULT_CONTROLLER = "127.0.0.1:7070"


# ------------------------------------------------------------------------ options


def add_connection_args(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """Add ``--controller``, ``--token-file``, ``--token``, ``--tls-*`` to ``parser``.

    With ``suppress`` the options leave no default behind, so a value given before the
    command is not overwritten by a subcommand's default.
    """
    default: Any = argparse.SUPPRESS if suppress else None
    g = parser.add_argument_group("controller connection")
    g.add_argument(
        "--controller",
        metavar="ADDR",
        default=default,
        help=f"controller HOST:PORT (env MIXFLEET_CONTROLLER; default {DEFAULT_CONTROLLER})",
    )
    g.add_argument(
        "--token-file",
        metavar="FILE",
        default=default,
        help="bearer token file (env MIXFLEET_TOKEN_FILE)",
    )
    g.add_argument(
        "--token", metavar="TOKEN", default=default, help="bearer token (env MIXFLEET_TOKEN)"
    )
    g.add_argument("--tls-ca", metavar="PEM", default=default, help="CA of the controller")
    g.add_argument("--tls-cert", metavar="PEM", default=default, help="client certificate")
    g.add_argument("--tls-key", metavar="PEM", default=default, help="client key")


def add_client(
    group: Groups,
    name: str,
    handler: Handler,
    help_text: str,
) -> argparse.ArgumentParser:
    """Add client command ``name`` to ``group``: connection options and ``-o table|json``."""
    p = add_leaf(group, name, handler, help_text)
    add_connection_args(p, suppress=True)
    p.add_argument(
        "-o",
        "--output",
        choices=("table", "json"),
        default="table",
        help="output format (default: table)",
    )
    return p


# ------------------------------------------------------------------------ calls


def _opt(args: argparse.Namespace, name: str, env: str | None = None) -> str | None:
    value = getattr(args, name, None)
    if value is None and env:
        value = os.environ.get(env) or None
    return value


def _token(args: argparse.Namespace) -> str | None:
    token = _opt(args, "token", "MIXFLEET_TOKEN")
    if token:
        return token
    path = _opt(args, "token_file", "MIXFLEET_TOKEN_FILE")
    if not path:
        return None
    from controlplane.server.certs import token_for

    for role in ("admin", "viewer", "engine"):
        with contextlib.suppress(InputError):
            return token_for(path, role)
    raise InputError(f"no token in {path}", field="--token-file")


def channel(args: argparse.Namespace) -> grpc.Channel:
    """A (blocking) channel to the controller from the connection options."""
    address = _opt(args, "controller", "MIXFLEET_CONTROLLER") or DEFAULT_CONTROLLER
    ca = _opt(args, "tls_ca")
    # the controller's limits (policies.limits): a larger request is refused before it is sent
    options = [
        ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
        ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
    ]
    if ca is None:
        return grpc.insecure_channel(address, options=options)
    cert, key = _opt(args, "tls_cert"), _opt(args, "tls_key")
    try:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(ca).read_bytes(),
            private_key=Path(key).read_bytes() if key else None,
            certificate_chain=Path(cert).read_bytes() if cert else None,
        )
    except OSError as exc:
        raise InputError(f"cannot read TLS files: {exc}", field="--tls-ca") from exc
    return grpc.secure_channel(address, creds, options=options)


def metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    token = _token(args)
    return (("authorization", f"Bearer {token}"),) if token else ()


def call(args: argparse.Namespace, fn: Callable[[plan_pb2_grpc.PlanServiceStub, Any], Any]) -> Any:
    """Run one PlanService call, turning gRPC errors into the CLI's errors."""
    with channel(args) as ch:
        stub = plan_pb2_grpc.PlanServiceStub(ch)
        try:
            return fn(stub, metadata(args))
        except grpc.RpcError as exc:
            raise rpc_error(args, exc) from exc


def rpc_error(args: argparse.Namespace, exc: grpc.RpcError) -> MixfleetError:
    code: grpc.StatusCode = exc.code()
    details: str = exc.details() or ""
    address = _opt(args, "controller", "MIXFLEET_CONTROLLER") or DEFAULT_CONTROLLER
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InputError(details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return MixfleetError(
            f"cannot reach the controller at {address} ({details}). To fix: check --controller "
            "and that 'mixfleetctl controller run' is up"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return MixfleetError(f"{details}")
    return MixfleetError(f"{code.name.lower()}: {details}")


# ------------------------------------------------------------------------ replies


def to_json(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def age(unix_s: float) -> str:
    if unix_s <= 0:
        return "-"
    s = max(0.0, dt.datetime.now(dt.UTC).timestamp() - unix_s)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def ms(us: float) -> str:
    return f"{us / 1000:.2f}" if us else "-"
