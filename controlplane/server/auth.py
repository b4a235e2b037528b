"""Who may call what.

Callers are identified, in this order:

1. a bearer token (``authorization: Bearer <token>`` metadata) from the token file; an
   unknown token is refused (UNAUTHENTICATED) even when a certificate is also presented.
   With a node certificate (below) the token's identity stays bound to that certificate's
   node: a node credential acts only for its own node whatever the token says;
2. the common name of a client certificate verified against the controller's CA (mutual
   TLS): ``mixfleet-agent`` = an agent for any node, ``node:<name>`` = the agent of node
   ``<name>`` only, ``mixfleet-admin`` = admin, ``mixfleet-engine`` = engine, anything else
   = a client with no role (it needs a token);
3. development mode (``--insecure`` on loopback *and* no token file): everyone is trusted.

Otherwise the call is refused with UNAUTHENTICATED.

Roles and what they may call (:func:`allowed_roles`): ``agent`` -> AgentService; ``engine``
-> EngineService; ``viewer`` -> PlanService reads and dry runs (Get*, List*, Watch*,
DiffPlans, Solve, Advise*, EstimateCost, MinCost); ``admin`` -> PlanService and
EngineService. Health checks and reflection are open.

Token file: one token a line, ``<token> <role> [<name>]``; ``#`` starts a comment. Tokens
must be at least 16 characters; an agent token named ``node:<name>`` acts for that node
only. An empty, unreadable or non-UTF-8 file is refused at start. Tokens are compared in
constant time. ``mixfleetctl certs init`` writes one (mode 0600) with an admin, a viewer and
an engine token.
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from apis.documents import read_limited
from controlplane.errors import PermissionDeniedError, UnauthenticatedError
from policies.errors import InputError
from policies.limits import decode_utf8

Role = Literal["admin", "viewer", "engine", "agent", "client", "dev"]
ROLES: tuple[str, ...] = ("admin", "viewer", "engine", "agent")
AGENT_CN = "mixfleet-agent"
ADMIN_CN = "mixfleet-admin"
ENGINE_CN = "mixfleet-engine"
NODE_CN_PREFIX = "node:"
MIN_TOKEN_CHARS = 16
#: Logged and printed when the controller starts in development mode.
DEV_MODE_WARNING = (
    "development mode: every caller is admin (plaintext on loopback, no token file). "
    "To fix: for anything but a trial on this machine, give --tls-* and --token-file"
)
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
#: PlanService methods a viewer may call: reads and dry runs (Solve, the strategy advice).
_READ_PREFIXES = ("Get", "List", "Watch", "Diff", "Solve", "Advise", "EstimateCost", "MinCost")


@dataclass(frozen=True)
class Identity:
    """An authenticated caller.

    Attributes:
        name: token name or certificate common name.
        role: ``admin`` | ``viewer`` | ``engine`` | ``agent`` | ``client`` (no role) |
            ``dev`` (development mode: everything).
        node: for a node-bound agent certificate, the only node it may act for.
        via: ``token`` | ``certificate`` | ``insecure``.
    """

    name: str
    role: Role
    node: str | None = None
    via: str = "token"

    def may_act_for(self, node: str) -> bool:
        return self.node is None or self.node == node


def _bound(identity: Identity, cert: Identity | None) -> Identity:
    """A token's identity, kept to the node of a node certificate presented with it: a node
    credential acts only for its own node whatever the token says.

    Raises:
        PermissionDeniedError: the token and the certificate are bound to different nodes.
    """
    if cert is None or cert.node is None:
        return identity
    if identity.node is not None and identity.node != cert.node:
        raise PermissionDeniedError(
            f"token {identity.name} is bound to node {identity.node!r} but the certificate "
            f"{cert.name} to {cert.node!r}. To fix: use the token of the certificate's node",
            field="authorization",
        )
    return replace(identity, node=cert.node)


current_identity: contextvars.ContextVar[Identity | None] = contextvars.ContextVar(
    "mixfleet_identity", default=None
)


def load_tokens(path: str | Path) -> dict[str, Identity]:
    """Read a token file (module docstring). A token named ``node:<name>`` with role
    ``agent`` acts for node ``<name>`` only, like a node certificate.

    Raises:
        InputError: unreadable, over 1 MiB, not UTF-8 (byte offset named), holding no token,
            or a line with an unknown role, a short or duplicate token (line named).
    """
    where = f"token file {str(path)!r}"
    try:
        text = decode_utf8(read_limited(path, "token file", "token"), where)
    except InputError as exc:
        raise InputError(str(exc), field="token_file") from exc
    out: dict[str, Identity] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where_line = f"token_file:{lineno}"
        if len(parts) < 2 or parts[1] not in ROLES:
            raise InputError(
                f"expected '<token> <role> [<name>]' with role one of {ROLES}", field=where_line
            )
        token, role = parts[0], parts[1]
        if len(token) < MIN_TOKEN_CHARS:
            raise InputError(f"token shorter than {MIN_TOKEN_CHARS} characters", field=where_line)
        if token in out:
            raise InputError("duplicate token", field=where_line)
        name = parts[2] if len(parts) > 2 else f"{role}-{lineno}"
        node = (
            name[len(NODE_CN_PREFIX) :]
            if role == "agent" and name.startswith(NODE_CN_PREFIX)
            else None
        )
        if node == "":
            raise InputError("'node:' names no node", field=where_line)
        out[token] = Identity(name, role, node=node, via="token")  # type: ignore[arg-type]
    if not out:
        raise InputError(
            f"{where} holds no token. To fix: write one '<token> <role> [<name>]' line per "
            "caller (mixfleetctl certs init writes a file with an admin, a viewer and an "
            "engine token), or leave --token-file out",
            field="token_file",
        )
    return out


def allowed_roles(method: str) -> frozenset[str] | None:
    """Roles that may call a full method name (``/mixfleet.v1.PlanService/ListPlans``);
    None = open to everyone (health, reflection)."""
    if method.startswith(_OPEN_PREFIXES):
        return None
    service, _, name = method.rpartition("/")
    if service.endswith("AgentService"):
        return frozenset({"agent"})
    if service.endswith("EngineService"):
        return frozenset({"engine", "admin"})
    if service.endswith("PlanService"):
        if name.startswith(_READ_PREFIXES):
            return frozenset({"admin", "viewer"})
        return frozenset({"admin"})
    return frozenset({"admin"})


class Authenticator:
    """Identify and authorize callers (see the module docstring).

    Args:
        tokens: token -> identity; None when no token file is configured.
        dev_mode: trust callers without credentials (``--insecure`` without tokens).
    """

    def __init__(self, tokens: Mapping[str, Identity] | None, *, dev_mode: bool) -> None:
        self.tokens = dict(tokens) if tokens is not None else None
        self.dev_mode = dev_mode and tokens is None

    def identify(
        self, metadata: Sequence[tuple[str, str | bytes]], peer_cns: Sequence[str]
    ) -> Identity:
        """The caller's identity from its metadata and verified certificate names.

        Raises:
            UnauthenticatedError: no usable credential.
        """
        bearer = None
        for key, value in metadata:
            if key.lower() == "authorization":
                text = value.decode(errors="replace") if isinstance(value, bytes) else value
                if text.lower().startswith("bearer "):
                    bearer = text[7:].strip()
        cert = self._certificate(peer_cns)
        if bearer is not None:
            identity = self._token(bearer)
            if identity is None:
                raise UnauthenticatedError(
                    "unknown bearer token. To fix: use a token from the controller's token file",
                    field="authorization",
                )
            return _bound(identity, cert)
        if cert is not None:
            return cert
        if self.dev_mode:
            return Identity("anonymous", "dev", via="insecure")
        raise UnauthenticatedError(
            "no credentials. To fix: send 'authorization: Bearer <token>' (mixfleetctl "
            "--token-file) or a client certificate signed by the controller's CA",
            field="authorization",
        )

    @staticmethod
    def _certificate(peer_cns: Sequence[str]) -> Identity | None:
        """The identity a verified client certificate names (its first common name)."""
        for cn in peer_cns:
            if cn == AGENT_CN:
                return Identity(cn, "agent", via="certificate")
            if cn.startswith(NODE_CN_PREFIX):
                return Identity(cn, "agent", node=cn[len(NODE_CN_PREFIX) :], via="certificate")
            if cn == ADMIN_CN:
                return Identity(cn, "admin", via="certificate")
            if cn == ENGINE_CN:
                return Identity(cn, "engine", via="certificate")
            return Identity(cn, "client", via="certificate")
        return None

    def _token(self, token: str) -> Identity | None:
        """The identity of a bearer token. Every known token is compared, in constant time
        (:func:`hmac.compare_digest`), so the time taken says nothing about which matched."""
        if not self.tokens:
            return None
        given = token.encode()
        found = None
        for known, identity in self.tokens.items():
            if hmac.compare_digest(known.encode(), given):
                found = identity
        return found

    def authorize(self, identity: Identity, method: str) -> None:
        """Raises PermissionDeniedError when ``identity`` may not call ``method``."""
        roles = allowed_roles(method)
        if roles is None or identity.role == "dev" or identity.role in roles:
            return
        raise PermissionDeniedError(
            f"{identity.name} (role {identity.role}) may not call {method}; it needs one of "
            f"{', '.join(sorted(roles))}",
            field="authorization",
        )
