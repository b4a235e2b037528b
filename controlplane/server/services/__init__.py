"""The controller's gRPC server: AgentService, PlanService, EngineService, health, reflection.

Servicers are thin: they turn messages into plain values, call the
:class:`controlplane.server.controller.Controller`, and turn the answer back into messages. One
servicer per module (:mod:`.agent`, :mod:`.plan`, :mod:`.engine`); one interceptor
(:class:`~.guard.Guard`) wraps every method: it authenticates and authorizes the caller
(:mod:`controlplane.server.auth`), maps the project's errors to status codes with
``context.abort`` (:func:`~.guard.status_for`), logs and times the call. :mod:`.server` builds
the server.

:func:`create_server` returns ``(server, port)`` so tests bind port 0.
"""

from controlplane.server.services.agent import AgentServicer
from controlplane.server.services.engine import EngineServicer
from controlplane.server.services.guard import status_for
from controlplane.server.services.plan import PlanServicer
from controlplane.server.services.server import (
    MIB,
    SERVICE_NAMES,
    ServerOptions,
    TlsFiles,
    check_options,
    create_server,
    is_loopback,
    mark_serving,
)

__all__ = [
    "MIB",
    "SERVICE_NAMES",
    "AgentServicer",
    "EngineServicer",
    "PlanServicer",
    "ServerOptions",
    "TlsFiles",
    "check_options",
    "create_server",
    "is_loopback",
    "mark_serving",
    "status_for",
]
