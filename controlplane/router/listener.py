"""The router's listening side: aiohttp's connection handler with a deadline on request
heads (:class:`GuardedHandler`), the TCP site whose connections get it (:class:`GuardedSite`),
and the garbage-collector settings of a serving router process (:func:`tune_gc`).
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = structlog.get_logger("mixfleet.router")

#: Collector thresholds of a serving router: a young collection every 5,000 net allocations
#: (CPython's default is 700), the middle one every 50 young ones, the full one every 100
#: middle ones (defaults 10 and 10).
GC_THRESHOLDS = (5_000, 50, 100)


def tune_gc() -> None:
    """Set the garbage collector up for a serving router process; call once, after start.

    With CPython's defaults a router holding hundreds of open streams runs a full
    collection every few seconds, and it pauses the event loop for tens of milliseconds
    (it scans every open stream's objects): far more than a p99 budget of 5 ms.
    Everything alive after start (modules, gRPC, metrics) is moved out of the collector's
    sight (``gc.freeze``) and the thresholds are raised (:data:`GC_THRESHOLDS`): young
    collections become rarer and the full ones that scan every open stream's objects all
    but stop. Reference cycles are still collected. Process-wide: the console script and
    the benchmark call it; an embedding program decides for itself.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class GuardedHandler(RequestHandler):
    """aiohttp's connection handler, plus a deadline on request heads.

    aiohttp's keep-alive timer bounds a connection that sends nothing; a client that
    trickles the bytes of a request head (slowloris) would keep the connection until that
    timer ends. Here the first bytes of a head, arriving while the connection waits for a
    request, start a timer of ``header_timeout_s`` seconds; a head still incomplete when it
    fires closes the connection (one log line).
    """

    def __init__(self, manager: web.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        count = self._request_count
        super().data_received(data)
        if self._request_count != count:  # a head completed
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            return
        waiter = self._waiter
        if self._head_timer is None and waiter is not None and not waiter.done():
            self._head_timer = self._loop.call_later(
                self._head_timeout_s, self._head_expired, count
            )

    def _head_expired(self, count: int) -> None:
        self._head_timer = None
        if self._request_count == count and self.transport is not None:
            log.info(
                "client connection closed: request head incomplete",
                peer=peer_name(self.transport),
                header_timeout_s=self._head_timeout_s,
            )
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


def peer_name(transport: asyncio.BaseTransport | None) -> str:
    """The client's ``host:port`` for a log line; ``?`` when the transport has none."""
    peer = transport.get_extra_info("peername") if transport is not None else None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"


class GuardedSite(web.TCPSite):
    """A TCP site whose connections get :class:`GuardedHandler`."""

    def __init__(self, runner: web.AppRunner, *, header_timeout_s: float, **kw: Any) -> None:
        super().__init__(runner, **kw)
        self._header_timeout_s = header_timeout_s

    async def start(self) -> None:
        self._runner._reg_site(self)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        # What web.Server.__call__ does, with the guarded handler class.
        kwargs = server._kwargs

        def factory() -> RequestHandler:
            return GuardedHandler(
                server, loop=loop, header_timeout_s=self._header_timeout_s, **kwargs
            )

        self._server = await loop.create_server(
            factory,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        socks = self._server.sockets
        self._bound_port = socks[0].getsockname()[1] if socks else self._port
