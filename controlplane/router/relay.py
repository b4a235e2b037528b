"""The engine side of the request path: HTTP/1.1 connections to the engines, kept alive in a
pool, whose response bodies go to the client's connection as they arrive, from the
connection's own ``data_received``, with no task, stream reader or writer in between.

Why: profiled under 100 streams, most of the router's own time went to relaying chunks
(aiohttp's client parses each chunk into a stream reader and wakes the handler, its server
writer frames it again). Here an engine's chunked body is forwarded byte for byte (its
chunk framing is the client's: the client's response is chunked too), except the final
zero-size chunk, which the client's writer sends at the end; a body with a length, or read
until the engine closes, is framed as chunks on the way. One write per engine read.

Rules, as :mod:`.proxy` relies on them:

* Nothing goes to the client before the first body bytes are in: a failure before that
  (connect, reset, the engine's silence past ``read_timeout_s``, no head) raises
  :class:`EngineError` and the request may be tried on another instance. A pooled
  connection the engine had closed is replaced once, silently.
* After that, a failure cuts the client's response (:attr:`Exchange.cut`).
* A client that goes away stops the relay; the engine connection is closed, not reused.
* Backpressure: when the client's send buffer passes :data:`HIGH_WATER_BYTES` the engine
  connection stops reading until it drains below :data:`LOW_WATER_BYTES` (checked by the
  pool's sweep, every ``sweep_s``); a client that reads nothing for ``read_timeout_s``
  is let go (its answer cut, the engine connection closed).
* ``read_timeout_s`` is the longest silence of an engine while a request is open, checked
  by the same sweep (so it fires within ``sweep_s`` after it passes).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

#: Client send buffer above which the engine connection stops reading, bytes.
HIGH_WATER_BYTES = 1 << 20
#: ... and below which it reads again, bytes.
LOW_WATER_BYTES = 256 << 10
#: Largest response head accepted from an engine, bytes.
MAX_HEAD_BYTES = 64 << 10


class EngineError(Exception):
    """The engine failed before any body byte went to the client (the request may be tried
    elsewhere).

    Attributes:
        refused: nothing listens at the engine's address.
    """

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass
class Head:
    """An engine's response head.

    Attributes:
        status: HTTP status.
        headers: (name, value) pairs as sent.
    """

    status: int
    headers: list[tuple[str, str]]


_NO_BODY = frozenset((204, 304))


class EngineConnection(asyncio.Protocol):
    """One HTTP/1.1 connection to an engine, used by one request at a time."""

    def __init__(self, pool: EnginePool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.reusable = False
        self.last_s = 0.0
        self.idle_since_s = 0.0
        self._reset()

    def _reset(self) -> None:
        self.error = ""
        self.head_fut: asyncio.Future[None] | None = None
        self.first_fut: asyncio.Future[None] | None = None
        self.done_fut: asyncio.Future[str] | None = None
        self.sink: asyncio.Transport | None = None
        self._buf = b""
        self.head: Head | None = None
        self._mode = ""  # "chunked" | "length" | "close"
        self._left = 0  # length mode: bytes left; chunked mode: bytes of this chunk left
        self._pending: list[bytes] = []  # framed, before the sink is attached
        self._held: list[bytes] = []  # a body with a length, unframed, before the sink
        self._forwarded = False
        self._ended = False
        self._trailer = False
        self.paused = False
        self.paused_since_s = 0.0
        self.timed_out = False
        self.got_bytes = False
        self.observe: Callable[[bytes], None] | None = None  # sees the body's bytes

    # ------------------------------------------------------------ protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.reusable = False
        self.pool.forget(self)
        if self._ended:
            return
        if self._mode == "close" and exc is None and not self.timed_out:
            self._end()  # a body read until the engine closes
            return
        why = "TimeoutError: engine silent" if self.timed_out else repr(exc or "closed")
        self._fail(f"connection lost: {why}")

    def data_received(self, data: bytes) -> None:
        self.last_s = self.loop.time()
        self.got_bytes = True
        if self.head is None:
            self._buf += data
            if not self._parse_head():
                return
            data, self._buf = self._buf, b""
            if not data:
                return
        if self.observe is not None:
            self.observe(data)
        if self._mode == "chunked":
            self._chunked(data)
        else:
            if self._mode == "length":
                data = data[: self._left]
                self._left -= len(data)
            if data:
                if self.sink is None and self._mode == "length":
                    self._held.append(data)  # kept unframed: see :meth:`whole_body`
                    self._first()
                else:
                    self._emit(b"%x\r\n%s\r\n" % (len(data), data))
            if self._mode == "length" and self._left == 0:
                self._end()

    # ------------------------------------------------------------ parsing

    def _parse_head(self) -> bool:
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD_BYTES:
                    self._fail("response head too large")
                return False
            lines = self._buf[:end].decode("latin-1").split("\r\n")
            self._buf = self._buf[end + 4 :]
            try:
                version, code = lines[0].split(" ", 2)[:2]
                status = int(code)
                headers = [
                    (n.strip(), v.strip()) for n, _, v in (x.partition(":") for x in lines[1:])
                ]
            except ValueError:
                self._fail(f"malformed response head {lines[0][:80]!r}")
                return False
            if 100 <= status < 200:
                continue  # an interim answer (100 Continue): the real head follows
            break
        names = {n.lower(): v.lower() for n, v in headers}
        self.reusable = version == "HTTP/1.1" and names.get("connection") != "close"
        if "chunked" in names.get("transfer-encoding", ""):
            self._mode = "chunked"
        elif status in _NO_BODY or "content-length" in names:
            self._mode = "length"
            self._left = 0 if status in _NO_BODY else int(names["content-length"] or 0)
        else:
            self._mode, self.reusable = "close", False
        self.head = Head(status, headers)
        assert self.head_fut is not None
        if not self.head_fut.done():
            self.head_fut.set_result(None)
        if self._mode == "length" and self._left == 0:
            self._end()
        return True

    def _chunked(self, data: bytes) -> None:
        """Forward the whole framed chunks of ``data`` (after what was held back), hold a
        size line cut in two back, stop at the last (zero-size) chunk."""
        buf = self._buf + data if self._buf else data
        self._buf = b""
        pos = 0
        out_from = 0
        n = len(buf)
        while pos < n:
            if self._trailer:  # after the last chunk: trailers, then an empty line
                rest = buf[pos:]
                if rest.startswith(b"\r\n") or b"\r\n\r\n" in rest:
                    self._end()
                else:
                    self._buf = rest
                return
            if self._left:
                step = min(self._left, n - pos)
                pos += step
                self._left -= step
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if pos > out_from:
                    self._emit(buf[out_from:pos])
                self._buf = buf[pos:]
                return
            try:
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
            except ValueError:
                self._fail("malformed chunk size")
                return
            if size == 0:
                if pos > out_from:
                    self._emit(buf[out_from:pos])
                self._trailer = True
                pos = eol + 2
                out_from = pos
                if pos == n:
                    return
                continue
            self._left = size + 2  # the data and its CRLF
            pos = eol + 2
        if pos > out_from:
            self._emit(buf[out_from:pos])

    # ------------------------------------------------------------ relay

    def _first(self) -> None:
        first = self.first_fut
        if first is not None and not first.done():
            first.set_result(None)

    def _emit(self, framed: bytes) -> None:
        sink = self.sink
        if sink is None:
            self._pending.append(framed)
            self._first()
            return
        if sink.is_closing():
            self._client_gone()
            return
        self._forwarded = True
        sink.write(framed)
        if sink.get_write_buffer_size() > HIGH_WATER_BYTES and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
            self.paused_since_s = self.loop.time()

    def _end(self) -> None:
        self._ended = True
        for fut in (self.first_fut, self.head_fut):
            if fut is not None and not fut.done():
                fut.set_result(None)
        if self.sink is not None and self.done_fut is not None and not self.done_fut.done():
            self.done_fut.set_result("complete")

    def _fail(self, why: str) -> None:
        self._ended = True
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()
        self.error = why
        for fut in (self.head_fut, self.first_fut):
            if fut is not None and not fut.done():
                fut.set_result(None)
        if self.done_fut is not None and not self.done_fut.done():
            self.done_fut.set_result("cut" if self._forwarded else "failed")

    def _client_gone(self) -> None:
        self._ended = True
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()
        if self.done_fut is not None and not self.done_fut.done():
            self.done_fut.set_result("client_gone")

    # ------------------------------------------------------------ for the exchange

    def send(
        self, request: Sequence[bytes], observe: Callable[[bytes], None] | None = None
    ) -> None:
        """Write ``request`` (the parts of a whole HTTP/1.1 request: head, body) on this
        connection, without joining them (a large body is not copied again); ``observe``
        is shown the response body's bytes as they arrive (framing included)."""
        self._reset()
        self.observe = observe
        self.head_fut = self.loop.create_future()
        self.first_fut = self.loop.create_future()
        self.done_fut = self.loop.create_future()
        self.last_s = self.loop.time()
        assert self.transport is not None
        self.transport.writelines(request)

    def whole_body(self) -> bytes | None:
        """The body, when it had a length and is all in before any was relayed (a short
        answer: the client gets it with its head in one write); else None."""
        if self._mode != "length" or not self._ended or self.error or self.sink is not None:
            return None
        return b"".join(self._held)

    def attach(self, sink: asyncio.Transport) -> None:
        """Relay the body to ``sink`` from now on (what came already goes first)."""
        self.sink = sink
        held, self._held = self._held, []
        pending = [b"%x\r\n%s\r\n" % (len(d), d) for d in held]
        pending += self._pending
        self._pending = []
        if pending:
            if sink.is_closing():
                self._client_gone()
                return
            self._forwarded = True
            sink.write(b"".join(pending))
        if self._ended and self.done_fut is not None and not self.done_fut.done():
            self.done_fut.set_result("complete")

    def body_ended(self) -> bool:
        return self._ended


@dataclass
class EnginePool:
    """Kept-alive engine connections by (host, port), and the sweep that enforces the read
    timeout, closes idle connections and resumes paused relays.

    Attributes:
        connect_timeout_s: connect timeout, seconds.
        read_timeout_s: longest silence of an engine inside a response, seconds.
        keepalive_s: how long an idle connection is kept, seconds (an engine that closes
            one first takes it out of the pool by doing so).
    """

    connect_timeout_s: float
    read_timeout_s: float
    keepalive_s: float
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    _idle: dict[tuple[str, int], list[EngineConnection]] = field(default_factory=dict)
    _busy: set[EngineConnection] = field(default_factory=set)
    _sweeper: asyncio.Task[None] | None = None

    @property
    def sweep_s(self) -> float:
        return min(self.read_timeout_s / 4, 0.25)

    def start(self) -> None:
        self._sweeper = self.loop.create_task(self._sweep(), name="engine-pool-sweep")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for conns in self._idle.values():
            for c in conns:
                if c.transport is not None:
                    c.transport.close()
        for c in list(self._busy):
            if c.transport is not None:
                c.transport.abort()
        self._idle.clear()

    async def acquire(self, host: str, port: int) -> tuple[EngineConnection, bool]:
        """A connection to ``host:port`` and whether it was reused.

        Raises:
            EngineError: cannot connect (``refused`` when nothing listens).
        """
        key = (host, port)
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                self._busy.add(conn)
                return conn, True
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, proto = await self.loop.create_connection(
                    lambda: EngineConnection(self, key), host, port
                )
        except ConnectionRefusedError as exc:
            raise EngineError(f"connect: {exc!r}", refused=True) from exc
        except (OSError, TimeoutError) as exc:
            raise EngineError(f"connect: {exc!r}") from exc
        self._busy.add(proto)
        return proto, False

    def release(self, conn: EngineConnection) -> None:
        """The request is over: keep the connection if its response ended cleanly."""
        self._busy.discard(conn)
        t = conn.transport
        if conn.reusable and conn.body_ended() and t is not None and not t.is_closing():
            if conn.paused:
                t.resume_reading()
                conn.paused = False
            conn.idle_since_s = self.loop.time()
            conn._reset()
            self._idle.setdefault(conn.key, []).append(conn)
        elif t is not None:
            t.abort()

    def forget(self, conn: EngineConnection) -> None:
        self._busy.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            now = self.loop.time()
            for c in list(self._busy):
                if c.paused:
                    sink = c.sink
                    if sink is None or sink.is_closing():
                        c._client_gone()
                    elif sink.get_write_buffer_size() < LOW_WATER_BYTES:
                        c.paused = False
                        c.last_s = now
                        if c.transport is not None:
                            c.transport.resume_reading()
                    elif now - c.paused_since_s > self.read_timeout_s:
                        c._client_gone()  # a client that does not read is let go
                elif not c.body_ended() and now - c.last_s > self.read_timeout_s:
                    c.timed_out = True
                    if c.transport is not None:
                        c.transport.abort()
            for conns in self._idle.values():
                for c in [c for c in conns if now - c.idle_since_s > self.keepalive_s]:
                    conns.remove(c)
                    if c.transport is not None:
                        c.transport.close()
