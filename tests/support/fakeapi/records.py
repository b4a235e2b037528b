"""What tests read and steer besides the objects: the log of answered requests and the
faults to inject."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class RequestRecord:
    """One request the server answered.

    Attributes:
        method, path: HTTP method and path.
        query: query parameters (first value of each).
        user_agent: User-Agent header.
        status: HTTP status answered.
    """

    method: str
    path: str
    query: Mapping[str, str]
    user_agent: str
    status: int


@dataclass
class Fault:
    """Answer matching requests with an error instead of serving them.

    Attributes:
        method: HTTP method (``*`` for any).
        path_regex: searched in the request path.
        code: HTTP status to answer.
        reason: Status reason.
        remaining: how many more requests to fail (-1: forever).
    """

    method: str
    path_regex: str
    code: int
    reason: str = "InternalError"
    remaining: int = 1
