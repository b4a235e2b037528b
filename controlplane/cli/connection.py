"""How the controller's clients (``nodes``, ``deploy``, ``plans``, ``watch``, ``fleet
export``) reach it.

Connection options (accepted before the command, ``mixfleetctl --controller ADDR nodes list``,
when the main parser adds them with :func:`add_connection_args`, and after it on every
client command, :func:`add_client`): ``--controller``, ``--token-file``, ``--token``,
``--tls-ca`` / ``--tls-cert`` / ``--tls-key`` (mutual TLS; plaintext without a CA) and
``--use-context NAME``. Each falls back to its environment variable (``MIXFLEET_CONTROLLER``,
``MIXFLEET_TOKEN``, ...), then to the context of the client config
(:mod:`controlplane.cli.clientconfig`), then to the default ``127.0.0.1:7070`` in plaintext.

:func:`call` runs one PlanService call and words gRPC errors for the user
(:func:`rpc_error`), including a plaintext client meeting a TLS controller and the reverse;
:func:`to_json`, :func:`age` and :func:`ms` format replies. grpc is imported when a command
runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.cli.output import Groups, Handler, add_leaf, add_output_arg
from policies.errors import InputError, MixfleetError

if TYPE_CHECKING:
    import grpc
    from google.protobuf.message import Message
    from mixfleet.v1 import plan_pb2_grpc

DEFAULT_CONTROLLER = "127.0.0.1:7070"


# ------------------------------------------------------------------------ options


def add_connection_args(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """Add ``--controller``, ``--token-file``, ``--token``, ``--tls-*``, ``--use-context``.

    With ``suppress`` the options leave no default behind, so a value given before the
    command is not overwritten by a subcommand's default.
    """
    default: Any = argparse.SUPPRESS if suppress else None
    g = parser.add_argument_group(
        "controller connection (flag, else environment, else the client config's context)"
    )
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
    g.add_argument(
        "--tls-ca",
        metavar="PEM",
        default=default,
        help="CA of the controller (env MIXFLEET_TLS_CA)",
    )
    g.add_argument(
        "--tls-cert",
        metavar="PEM",
        default=default,
        help="client certificate (env MIXFLEET_TLS_CERT)",
    )
    g.add_argument(
        "--tls-key", metavar="PEM", default=default, help="client key (env MIXFLEET_TLS_KEY)"
    )
    g.add_argument(
        "--use-context",
        metavar="NAME",
        default=default,
        help="context of the client config (env MIXFLEET_CONTEXT; default: its currentContext)",
    )


def add_client(
    group: Groups,
    name: str,
    handler: Handler,
    help_text: str,
) -> argparse.ArgumentParser:
    """Add client command ``name`` to ``group``: connection options and ``-o``."""
    p = add_leaf(group, name, handler, help_text)
    add_connection_args(p, suppress=True)
    add_output_arg(p)
    return p


# ------------------------------------------------------------------------ calls


def settings(args: argparse.Namespace) -> dict[str, str | None]:
    """The connection settings (flag, environment, context), once per command."""
    cached: dict[str, str | None] | None = getattr(args, "_connection", None)
    if cached is None:
        from controlplane.cli.clientconfig import resolve

        cached = resolve(args)
        args._connection = cached
    return cached


def address(args: argparse.Namespace) -> str:
    """The controller's ``HOST:PORT``."""
    return settings(args)["controller"] or DEFAULT_CONTROLLER


def _token(args: argparse.Namespace) -> str | None:
    s = settings(args)
    if s["token"]:
        return s["token"]
    path = s["tokenFile"]
    if not path:
        return None
    from controlplane.server.certs import token_for

    path = str(Path(path).expanduser())
    for role in ("admin", "viewer", "engine"):
        with contextlib.suppress(InputError):
            return token_for(path, role)
    raise InputError(f"no token in {path}", field="--token-file")


def channel(args: argparse.Namespace) -> grpc.Channel:
    """A (blocking) channel to the controller from the connection options."""
    import grpc

    from policies.limits import MAX_REPLY_BYTES, MAX_REQUEST_BYTES

    s = settings(args)
    ca = s["tlsCa"]
    # the controller's limits (policies.limits): a larger request is refused before it is sent
    options = [
        ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
        ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
    ]
    if ca is None:
        return grpc.insecure_channel(address(args), options=options)
    from controlplane.cli.tlsfiles import client_credentials

    files = client_credentials(ca, s["tlsCert"], s["tlsKey"])
    creds = grpc.ssl_channel_credentials(
        root_certificates=files.ca, private_key=files.key, certificate_chain=files.cert
    )
    return grpc.secure_channel(address(args), creds, options=options)


def metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    token = _token(args)
    return (("authorization", f"Bearer {token}"),) if token else ()


def call(args: argparse.Namespace, fn: Callable[[plan_pb2_grpc.PlanServiceStub, Any], Any]) -> Any:
    """Run one PlanService call, turning gRPC errors into the CLI's errors."""
    import grpc
    from mixfleet.v1 import plan_pb2_grpc

    with channel(args) as ch:
        stub = plan_pb2_grpc.PlanServiceStub(ch)
        try:
            return fn(stub, metadata(args))
        except grpc.RpcError as exc:
            raise rpc_error(args, exc) from exc


#: Words in gRPC's UNAVAILABLE details when a plaintext client meets a TLS server (the
#: server drops the connection at the first bytes, which are not a TLS ClientHello).
_PLAINTEXT_TO_TLS = ("socket closed", "connection reset", "end of file", "eof", "recvmsg")
#: ... and when a TLS client meets a plaintext server (the reply is not a TLS record).
_TLS_TO_PLAINTEXT = ("ssl", "handshake", "wrong_version", "tsi_", "record")
#: ... and when a TLS server closes the connection after the client's part of the handshake:
#: it wanted a client certificate, or did not accept the one it was given.
_TLS_CLOSED = ("socket closed", "connection reset", "end of file", "eof")


def _refused_client_certificate(args: argparse.Namespace, where: str, details: str) -> str:
    """The message for a TLS controller that closed the handshake."""
    cert = settings(args)["tlsCert"]
    if not cert:
        return (
            f"the controller at {where} closed the TLS connection: it requires a client "
            f"certificate (mutual TLS) and none was given ({details}). To fix: pass "
            "--tls-cert and --tls-key (e.g. admin.pem and admin-key.pem from 'mixfleetctl "
            "certs init'), or set tlsCert and tlsKey in the client config's context"
        )
    from controlplane.cli.tlsfiles import certificate_summary

    summary = certificate_summary(Path(cert).expanduser().read_bytes())
    return (
        f"the controller at {where} refused the client certificate {cert} ({summary}): it "
        f"accepts only certificates signed by the CA it was started with (its --tls-ca) "
        f"({details}). To fix: give a certificate and key issued by that CA"
    )


def rpc_error(args: argparse.Namespace, exc: grpc.RpcError) -> MixfleetError:
    import grpc

    code: grpc.StatusCode = exc.code()
    details: str = exc.details() or ""
    where = address(args)
    tls = settings(args)["tlsCa"] is not None
    low = details.lower()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InputError(details)
    if code == grpc.StatusCode.UNAVAILABLE:
        if not tls and any(w in low for w in _PLAINTEXT_TO_TLS):
            return MixfleetError(
                f"the controller at {where} closed a plaintext connection: it probably "
                f"requires TLS ({details}). To fix: pass --tls-ca (with --tls-cert and "
                "--tls-key for mutual TLS), or set tlsCa in the client config's context"
            )
        if tls and any(w in low for w in _TLS_TO_PLAINTEXT):
            return MixfleetError(
                f"the TLS handshake with the controller at {where} failed: it may serve "
                f"plaintext (--insecure) or another CA signed its certificate ({details}). "
                "To fix: drop --tls-ca for a plaintext controller, or give the CA that "
                "signed its certificate"
            )
        if tls and any(w in low for w in _TLS_CLOSED):
            return MixfleetError(_refused_client_certificate(args, where, details))
        return MixfleetError(
            f"cannot reach the controller at {where} ({details}). To fix: check --controller "
            "(or the client config's context) and that 'mixfleetctl controller run' is up"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return MixfleetError(f"{details}")
    return MixfleetError(f"{code.name.lower()}: {details}")


# ------------------------------------------------------------------------ replies


def to_json(msg: Message, *, proto_names: bool = True) -> dict[str, Any]:
    """A reply as a document for ``-o json|yaml``, in the words users write: enum values as
    their lower-case names without the enum's prefix (``committed``, not
    ``PLAN_STATE_COMMITTED``), 64-bit integers as numbers (``version: 1``, not ``'1'``).
    Field names are the proto's (``committed_version``), or with ``proto_names=False`` the
    camelCase JSON names that ModelDeployment documents use."""
    from google.protobuf import json_format

    doc = json_format.MessageToDict(msg, preserving_proto_field_name=proto_names)
    return _user_words(doc, msg.DESCRIPTOR, proto_names)


def enum_word(enum: Any, number: int) -> str:
    """``PLAN_STATE_COMMITTED`` of enum ``PlanState`` -> ``committed``: the value's name less
    the prefix all the enum's names share, in lower case."""
    names = [v.name for v in enum.values]
    prefix = names[0]
    for n in names[1:]:
        while not n.startswith(prefix):
            prefix = prefix[:-1]
    prefix = prefix[: prefix.rfind("_") + 1]
    value = enum.values_by_number.get(number)
    return value.name.removeprefix(prefix).lower() if value is not None else str(number)


def _user_value(value: Any, field: Any, proto_names: bool) -> Any:
    if field.enum_type is not None:
        if isinstance(value, str) and value in field.enum_type.values_by_name:
            return enum_word(field.enum_type, field.enum_type.values_by_name[value].number)
        return value
    if field.message_type is not None and isinstance(value, dict):
        return _user_words(value, field.message_type, proto_names)
    from google.protobuf.descriptor import FieldDescriptor

    int64 = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)
    if field.cpp_type in int64 and isinstance(value, str):  # json_format writes them quoted
        return int(value)
    return value


def _user_words(doc: dict[str, Any], descriptor: Any, proto_names: bool) -> dict[str, Any]:
    """:func:`to_json`'s rewrite of one message's dict, recursively."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        field = (
            descriptor.fields_by_name.get(key)
            if proto_names
            else next((f for f in descriptor.fields if f.json_name == key), None)
        )
        if field is None:  # well-known types (Struct, Timestamp): as json_format wrote them
            out[key] = value
            continue
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            inner = entry.fields_by_name["value"]
            out[key] = {k: _user_value(v, inner, proto_names) for k, v in value.items()}
        elif isinstance(value, list):
            out[key] = [_user_value(v, field, proto_names) for v in value]
        else:
            out[key] = _user_value(value, field, proto_names)
    return out


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
