"""The engine relay's framing (:mod:`controlplane.router.relay`): whatever way an engine's
response is cut into reads, the client receives exactly the body, framed as chunks, and the
end of the response is found exactly (a connection is reused only then)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from controlplane.router.relay import EngineConnection


class _Sink:
    """The client's transport: what was written to it."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: bytes) -> None:
        self.data += b

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


class _EngineSide:
    """The engine connection's transport."""

    def __init__(self) -> None:
        self.sent = bytearray()
        self.aborted = False

    def write(self, b: bytes) -> None:
        self.sent += b

    def writelines(self, parts: list[bytes]) -> None:
        self.sent += b"".join(parts)

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted

    def get_extra_info(self, name: str) -> Any:
        return None

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class _Pool:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def forget(self, conn: EngineConnection) -> None: ...


def _dechunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol].split(b";")[0], 16)
        if size == 0:
            assert data[eol + 2 :] == b"\r\n", data[eol:]  # nothing after the last chunk
            return bytes(out)
        out += data[eol + 2 : eol + 2 + size]
        assert data[eol + 2 + size : eol + 4 + size] == b"\r\n"
        pos = eol + 4 + size


def _relay(wire: bytes, cuts: list[int]) -> tuple[EngineConnection, _Sink]:
    loop = asyncio.new_event_loop()
    try:
        conn = EngineConnection(_Pool(loop), ("h", 1))  # type: ignore[arg-type]
        conn.connection_made(_EngineSide())  # type: ignore[arg-type]
        conn.send((b"POST / HTTP/1.1\r\n\r\n",))
        sink = _Sink()
        points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
        for a, b in itertools.pairwise(points):
            if b > a:
                conn.data_received(wire[a:b])
            if conn.head is not None and conn.sink is None:
                conn.attach(sink)  # type: ignore[arg-type]
        return conn, sink
    finally:
        loop.close()


@given(
    chunks=st.lists(st.binary(min_size=1, max_size=40), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
    extension=st.booleans(),
    trailer=st.booleans(),
)
def test_a_chunked_body_arrives_exactly_however_it_is_cut(
    chunks: list[bytes], cuts: list[int], extension: bool, trailer: bool
) -> None:
    ext = b";name=value" if extension else b""
    body = b"".join(b"%x%s\r\n%s\r\n" % (len(c), ext, c) for c in chunks)
    body += b"0\r\n" + (b"X-Trailer: 1\r\n" if trailer else b"") + b"\r\n"
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n" + body
    conn, sink = _relay(wire, cuts)
    assert conn.head is not None and conn.head.status == 200
    assert ("X-A", "b") in conn.head.headers
    assert conn.body_ended() and conn.reusable and not conn.error
    # the client's writer adds the last chunk at the end (write_eof)
    assert _dechunk(bytes(sink.data) + b"0\r\n\r\n") == b"".join(chunks)


@given(
    data=st.binary(max_size=300),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
    interim=st.booleans(),
)
def test_a_body_with_a_length_arrives_exactly_as_chunks(
    data: bytes, cuts: list[int], interim: bool
) -> None:
    head = b"HTTP/1.1 100 Continue\r\n\r\n" if interim else b""
    head += b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data)
    conn, sink = _relay(head + data, cuts)
    assert conn.head is not None and conn.head.status == 200
    assert conn.body_ended() and conn.reusable
    assert _dechunk(bytes(sink.data) + b"0\r\n\r\n") == data


def test_a_short_answer_all_in_before_the_client_is_attached_is_one_body() -> None:
    loop = asyncio.new_event_loop()
    try:
        conn = EngineConnection(_Pool(loop), ("h", 1))  # type: ignore[arg-type]
        conn.connection_made(_EngineSide())  # type: ignore[arg-type]
        conn.send((b"POST / HTTP/1.1\r\n\r\n",))
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello")
        assert conn.whole_body() is None  # not all in yet
        conn.data_received(b" world")
        assert conn.whole_body() == b"hello world" and conn.reusable
    finally:
        loop.close()


def test_a_body_read_until_close_ends_with_the_connection_and_is_not_reused() -> None:
    conn, sink = _relay(b"HTTP/1.0 200 OK\r\n\r\nhello ", [])
    conn.data_received(b"world")
    assert not conn.body_ended()
    conn.connection_lost(None)
    assert conn.body_ended() and not conn.reusable and not conn.error
    assert _dechunk(bytes(sink.data) + b"0\r\n\r\n") == b"hello world"


def test_an_engine_that_closes_mid_body_is_an_error_not_an_end() -> None:
    conn, _ = _relay(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel", [])
    conn.connection_lost(ConnectionResetError())
    assert conn.error and not conn.reusable
    assert conn.done_fut is not None and conn.done_fut.result() == "cut"


def test_a_malformed_head_or_chunk_size_is_an_error() -> None:
    conn, _ = _relay(b"NOT HTTP\r\n\r\n", [])
    assert conn.error.startswith("malformed response head")
    conn, _ = _relay(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", [])
    assert conn.error == "malformed chunk size"


def test_a_pooled_connection_the_engine_closed_is_not_a_failure() -> None:
    import aiohttp
    from router_world import running_router
    from support.openai_engine import LoopbackEngine

    from controlplane.router.settings import InstanceSpec

    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[5000.0]).start()
        async with (
            running_router(instances=(InstanceSpec("e0", engine.url, "default"),)) as router,
            aiohttp.ClientSession() as s,
        ):
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            for stream in (False, True, False, True):
                body = {"prompt": "x", "max_tokens": 3, "stream": stream}
                async with s.post(url, json=body) as r:
                    assert r.status == 200
                    await r.read()
                for p in list(engine._protocols):  # the engine closes its idle connections
                    if p.transport is not None:
                        p.transport.close()
            assert router.health.healthy == {"e0"}
            assert router.metrics.retries._value.get() == 0  # never tried elsewhere
        await engine.stop()

    asyncio.run(main())


def test_a_slow_client_pauses_the_engine_connection_until_it_drains() -> None:
    from controlplane.router.relay import HIGH_WATER_BYTES, EnginePool

    class _Engine(_EngineSide):
        paused = False

        def pause_reading(self) -> None:
            self.paused = True

        def resume_reading(self) -> None:
            self.paused = False

    class _SlowSink(_Sink):
        backlog = 0

        def get_write_buffer_size(self) -> int:
            return self.backlog

    async def main() -> None:
        pool = EnginePool(connect_timeout_s=1.0, read_timeout_s=0.4, keepalive_s=60.0)
        pool.start()
        try:
            conn = EngineConnection(pool, ("h", 1))
            engine = _Engine()
            conn.connection_made(engine)  # type: ignore[arg-type]
            pool._busy.add(conn)
            conn.send((b"POST / HTTP/1.1\r\n\r\n",))
            conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            sink = _SlowSink()
            conn.attach(sink)  # type: ignore[arg-type]
            sink.backlog = HIGH_WATER_BYTES + 1  # the client does not read
            conn.data_received(b"3\r\nabc\r\n")
            assert (engine.paused, conn.paused) == (True, True)
            await asyncio.sleep(0.1)
            assert (engine.paused, conn.timed_out, engine.aborted) == (True, False, False)
            sink.backlog = 0  # the client drained
            for _ in range(100):
                if not engine.paused:
                    break
                await asyncio.sleep(0.05)
            assert (engine.paused, conn.paused) == (False, False)
            conn.data_received(b"0\r\n\r\n")
            assert conn.body_ended() and _dechunk(bytes(sink.data) + b"0\r\n\r\n") == b"abc"

            # A client that never reads again is let go after the read timeout.
            conn.send((b"POST / HTTP/1.1\r\n\r\n",))
            pool._busy.add(conn)
            conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            conn.attach(sink)  # type: ignore[arg-type]
            sink.backlog = HIGH_WATER_BYTES + 1
            conn.data_received(b"3\r\nabc\r\n")
            assert conn.done_fut is not None
            assert await asyncio.wait_for(conn.done_fut, 30) == "client_gone"
            assert engine.aborted and not conn.reusable
        finally:
            await pool.close()

    asyncio.run(main())
