"""Errors of the operator, in the two kinds a control loop must tell apart (kopf's
``PermanentError`` / ``TemporaryError``):

* :class:`PermanentError` - the spec is wrong (unknown model, infeasible placement, missing
  policy). Retrying cannot help; the reconciler reports it as a condition with a reason and
  waits for the spec or the fleet to change.
* :class:`TemporaryError` - the world is briefly wrong (API server unreachable, a 409
  conflict, a 5xx). The work queue retries with exponential backoff.

Errors of the Kubernetes client are wrapped into these, with the cause chained.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.errors import MixfleetError


class OperatorError(MixfleetError):
    """Base of the operator's errors."""


class PermanentError(OperatorError):
    """A spec error: reported in status, not retried until the inputs change.

    Attributes:
        reason: CamelCase condition reason (``UnknownModel``, ``Infeasible``...).
    """

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class TemporaryError(OperatorError):
    """A transient failure; retry after ``delay_s`` seconds (None: the queue's backoff)."""

    def __init__(self, message: str, *, delay_s: float | None = None) -> None:
        self.delay_s = delay_s
        super().__init__(message)


class ApiError(OperatorError):
    """The API server answered with an error status.

    Attributes:
        status: HTTP status code (0 when no answer came back).
        reason: the ``Status.reason`` (``Conflict``, ``NotFound``, ``Invalid``...).
        causes: ``field: message`` lines of ``Status.details.causes``.
    """

    def __init__(self, status: int, reason: str, message: str, causes: Sequence[str] = ()) -> None:
        self.status = status
        self.reason = reason
        self.causes = tuple(causes)
        detail = "".join(f"\n  - {c}" for c in self.causes)
        super().__init__(f"{status} {reason}: {message}{detail}")


class NotFoundError(ApiError):
    """404: the object does not exist."""


class CrdMissingError(NotFoundError):
    """404 on a collection of mixfleet.io: the API server does not serve the resource - its
    CustomResourceDefinition is not installed. The message names the CRDs and how to
    install them."""


class ConflictError(ApiError, TemporaryError):
    """409: stale resourceVersion, an apply conflict, or the object already exists."""

    def __init__(self, status: int, reason: str, message: str, causes: Sequence[str] = ()) -> None:
        ApiError.__init__(self, status, reason, message, causes)
        self.delay_s = None


class GoneError(ApiError):
    """410: a watch's resourceVersion is too old; list again."""


class InvalidError(ApiError):
    """422: the object fails validation (schema, CEL rule, immutable field)."""


class UnavailableError(ApiError, TemporaryError):
    """No answer, 429 or 5xx: the API server is unreachable or overloaded."""

    def __init__(self, status: int, reason: str, message: str, causes: Sequence[str] = ()) -> None:
        ApiError.__init__(self, status, reason, message, causes)
        self.delay_s = None


class NotLeaderError(TemporaryError):
    """This replica lost (or never had) the leader lease; it must not write."""


class KubeConfigError(OperatorError):
    """No usable Kubernetes client configuration (no kubeconfig, no service account)."""
