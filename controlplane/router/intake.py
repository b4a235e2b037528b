"""A routed request's client side before routing: the error answers, the refusals that
end a request early, the bound on request body bytes held at once (:class:`BodyBudget`)
and the reading of a body within its size, time and in-flight bounds (:func:`read_body`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web

from controlplane.router.listener import peer_name
from controlplane.router.settings import RouterSettings

log = structlog.get_logger("mixfleet.router")


class RefusedError(Exception):
    """A request refused before routing; carries the answer.

    Attributes:
        response: what the client gets.
        reason: the ``reason`` label of ``mixfleet_router_rejects_total``.
    """

    def __init__(self, response: web.Response, reason: str) -> None:
        super().__init__(reason)
        self.response = response
        self.reason = reason


class ClientGoneError(Exception):
    """The client closed its connection before its request was in."""


def error(status: int, message: str, **headers: str) -> web.Response:
    """An error answer in the OpenAI shape (``error.message``, ``type``, ``code``)."""
    body = {"error": {"message": message, "type": "mixfleet_router", "code": status}}
    return web.json_response(body, status=status, headers=headers)


def closing(status: int, message: str, **headers: str) -> web.Response:
    """An error answer after which the connection is closed (its body was not read)."""
    resp = error(status, message, **headers)
    resp.force_close()
    return resp


@dataclass
class BodyBudget:
    """Bytes of request bodies held at once, all requests together, bounded.

    Attributes:
        limit_bytes: the bound, bytes.
        held_bytes: bytes taken and not yet given back.
    """

    limit_bytes: int
    held_bytes: int = 0

    def take(self, n: int) -> bool:
        """Take ``n`` bytes if that stays within the bound; False (nothing taken) if not."""
        if self.held_bytes + n > self.limit_bytes:
            return False
        self.held_bytes += n
        return True

    def give(self, n: int) -> None:
        """Give back ``n`` bytes taken earlier."""
        self.held_bytes -= n


def busy(settings: RouterSettings) -> RefusedError:
    """The 429 refusal of a body that would go over ``max_inflight_body_bytes``."""
    s = settings
    return RefusedError(
        closing(
            429,
            f"request bodies in flight are at the router's bound "
            f"({s.max_inflight_body_bytes} bytes)",
            **{"Retry-After": str(s.retry_after_s)},
        ),
        "bodies_in_flight",
    )


async def read_body(request: web.Request, settings: RouterSettings, bodies: BodyBudget) -> bytes:
    """The request's body, within the size, time and in-flight bounds; the bytes stay
    counted in ``bodies`` (as the declared length, else the length read) until the
    caller gives them back.

    Raises:
        RefusedError: 413 (larger than ``max_body_bytes``), 429 (the in-flight bound),
            408 (not in within ``body_timeout_s``).
        ClientGoneError: the client went away (logged as one line).
    """
    s = settings
    declared = request.content_length
    if declared is not None:
        if declared > s.max_body_bytes:
            raise RefusedError(
                closing(413, f"body of {declared} bytes is over {s.max_body_bytes}"),
                "too_large",
            )
        if not bodies.take(declared):
            raise busy(s)
    taken = declared or 0
    if declared is not None and request.content.is_eof():
        return await request.read()  # all in already (the common case): no timer
    try:
        async with asyncio.timeout(s.body_timeout_s):
            if declared is not None:
                return await request.read()
            parts: list[bytes] = []
            while chunk := await request.content.readany():
                if taken + len(chunk) > s.max_body_bytes:
                    raise RefusedError(
                        closing(413, f"body is over {s.max_body_bytes} bytes"), "too_large"
                    )
                if not bodies.take(len(chunk)):
                    raise busy(s)
                taken += len(chunk)
                parts.append(chunk)
            return b"".join(parts)
    except TimeoutError:
        bodies.give(taken)
        log.info(
            "client too slow: body not in time",
            peer=peer_name(request.transport),
            body_timeout_s=s.body_timeout_s,
        )
        raise RefusedError(
            closing(408, f"body not received within {s.body_timeout_s} s"), "slow_client"
        ) from None
    except (ConnectionError, aiohttp.ClientPayloadError, web.HTTPException) as exc:
        bodies.give(taken)
        log.info(
            "client went away while sending its body",
            peer=peer_name(request.transport),
            error=type(exc).__name__,
        )
        raise ClientGoneError from None
    except BaseException:
        bodies.give(taken)
        raise
