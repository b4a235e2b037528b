"""Errors of the controller, one class per gRPC status they leave through.

Plain functions raise these (and :class:`policies.errors.InputError` for bad input); the
server's error mapping (:func:`controlplane.server.services.status_for`) turns each into
``context.abort(code, message)``. Messages name the field and say what to do ("To fix: ...").
"""

from __future__ import annotations

from policies.errors import MixfleetError


class ControlPlaneError(MixfleetError):
    """Base of the controller's own errors.

    Attributes:
        field: dotted path of the field the error is about ("" when none).
    """

    def __init__(self, message: str, *, field: str = "") -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class NotFoundError(ControlPlaneError):
    """The named node, deployment or plan version does not exist (NOT_FOUND)."""


class AlreadyExistsError(ControlPlaneError):
    """Create of something that exists (ALREADY_EXISTS)."""


class PreconditionError(ControlPlaneError):
    """The request is well formed but the state does not allow it (FAILED_PRECONDITION):
    an ack for a rollout that is over, a stale session, nothing committed yet."""


class UnauthenticatedError(ControlPlaneError):
    """No credentials, or credentials nobody issued (UNAUTHENTICATED)."""


class PermissionDeniedError(ControlPlaneError):
    """Known caller, not allowed to do this (PERMISSION_DENIED)."""


class StoreError(ControlPlaneError):
    """The state store failed or holds data this version cannot read (a temporary error
    when the cause is I/O; permanent when the schema is newer than this controller)."""
