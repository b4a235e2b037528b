"""The fake API server's error answers: :class:`ApiStatusError` and the ``Status``
documents (``kind: Status``) kube-apiserver sends for them, in a response body or as a
watch's ``ERROR`` event."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from support.structural import Cause

Json = dict[str, Any]


class ApiStatusError(Exception):
    """An error answer: HTTP code, Status reason, message and causes."""

    def __init__(self, code: int, reason: str, message: str, causes: Sequence[Cause] = ()) -> None:
        self.code = code
        self.reason = reason
        self.message = message
        self.causes = tuple(causes)
        super().__init__(f"{code} {reason}: {message}")


def status_doc(code: int, reason: str, message: str, causes: Sequence[Cause] = ()) -> Json:
    """A failure ``Status`` document, with its causes as ``details.causes``."""
    out: Json = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if causes:
        out["details"] = {
            "causes": [{"field": c.field, "message": c.message, "reason": c.reason} for c in causes]
        }
    return out


def status_event(code: int, reason: str, message: str) -> Json:
    """A watch event carrying an error Status."""
    return {"type": "ERROR", "object": status_doc(code, reason, message)}
