"""Errors raised by the planning core.

Every error a user can cause carries a message that says what is wrong and how to fix it
("To fix: ..."). Callers at the edge (CLI, gRPC, operator) turn these into exit code 2,
INVALID_ARGUMENT / FAILED_PRECONDITION, or a status condition.
"""

from __future__ import annotations


class MixfleetError(Exception):
    """Base of all mixfleet errors."""


class InputError(MixfleetError):
    """A user-supplied input (fleet, model, workload, option) is invalid.

    Attributes:
        field: dotted path of the offending field, e.g. ``spec.nodes[2].gpus[0].model``.
    """

    def __init__(self, message: str, *, field: str = "") -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class InfeasibleError(MixfleetError):
    """A placement cannot satisfy its constraints (memory, slots, coverage).

    Attributes:
        reasons: one human-readable line per violated constraint.
    """

    def __init__(self, message: str, reasons: tuple[str, ...] = ()) -> None:
        self.reasons = reasons
        detail = "".join(f"\n  - {r}" for r in reasons)
        super().__init__(message + detail)


class SolverError(MixfleetError):
    """The MILP solver failed for a reason other than infeasibility."""
