"""The router against hostile or broken clients, on loopback: every case refused or bounded,
never a traceback, never a rank taken out of rotation. Each test waits for the behaviour
(bounded by pytest-timeout and generous deadlines), never asserts how fast it came."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import aiohttp
import pytest
import structlog
from router_world import running_router, until
from support.openai_engine import LoopbackEngine

from controlplane.router.requests import estimate_work, pick_tier
from controlplane.router.settings import InstanceSpec, RouterSettings

pytestmark = pytest.mark.timeout(120)

#: A deadline for something that must happen; far above the timeouts set in the tests.
WAIT_S = 20.0


@contextmanager
def router_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every log event of the block, whatever level an earlier test's structlog
    configuration filters at (a filtering wrapper drops info lines before any processor, so
    ``capture_logs`` alone sees nothing after, say, a controller test set WARNING)."""
    before = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**before)


def _static(engine: LoopbackEngine, name: str = "e0", tier: str = "default") -> InstanceSpec:
    return InstanceSpec(name, engine.url, tier, ranks=len(engine.tokens_per_s))


async def _post(
    s: aiohttp.ClientSession, url: str, body: bytes, path: str = "/v1/chat/completions"
) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    async with s.post(url + path, data=body, headers=headers) as r:
        return r.status, await r.text()


async def _raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def _head(length: int, path: str = "/v1/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the router sends until it closes the connection (a reset counts as a
    close: bytes the client sent after the close make the kernel answer with one)."""
    got = bytearray()
    try:
        async with asyncio.timeout(WAIT_S):
            while chunk := await reader.read(65536):
                got += chunk
    except ConnectionError:  # reset, or a broken pipe for what the client still sent
        pass
    return bytes(got)


def _aiohttp_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("aiohttp") and (r.levelno >= logging.ERROR or r.exc_info)
    ]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [], "max_tokens": 10**300}),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 2**53}),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 1e30}),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 10**400}),
        ("/v1/completions", {"prompt": "x", "max_tokens": float("inf")}),
        ("/v1/chat/completions", {"messages": [], "max_completion_tokens": 10**300}),
        (
            "/v1/chat/completions",
            {"messages": [], "max_completion_tokens": None, "max_tokens": 10**9},
        ),
        ("/v1/chat/completions", {"messages": [], "max_completion_tokens": 8, "max_tokens": 10**9}),
        ("/v1/chat/completions", {"messages": [], "max_tokens": -1}),
        ("/v1/chat/completions", {"messages": [], "max_tokens": "64"}),
        ("/v1/chat/completions", {"messages": [], "max_tokens": True}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 10**300}}),
    ],
)
def test_an_output_limit_out_of_range_is_refused_and_no_rank_leaves_rotation(
    path: str, body: dict[str, Any]
) -> None:
    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[5000.0] * 4).start()
        timeout = aiohttp.ClientTimeout(total=WAIT_S)
        async with (
            running_router(instances=(_static(engine),)) as router,
            aiohttp.ClientSession(timeout=timeout) as s,
        ):
            url = f"http://127.0.0.1:{router.port}"
            status, text = await _post(s, url, json.dumps(body).encode(), path)
            assert status == 400, text
            field = next(k for k in ("max_completion_tokens", "max_tokens", "max_new") if k in text)
            assert "must be" in json.loads(text)["error"]["message"], field
            engine.records.clear()
            for _ in range(40):
                ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                assert (await _post(s, url, json.dumps(ok).encode()))[0] == 200
            per_rank = Counter(r.rank for r in engine.records)
            assert sorted(per_rank) == [0, 1, 2, 3] and min(per_rank.values()) == 10
        await engine.stop()

    asyncio.run(main())


def test_the_output_limit_is_a_setting_and_an_integral_float_is_an_integer() -> None:
    def out(body: dict[str, Any], cap: int = 1000) -> int:
        return estimate_work("/v1/completions", body, len, 7, cap).output_tokens

    assert out({"max_tokens": 1000}) == 1000
    assert out({"max_tokens": 12.0}) == 12
    assert out({"max_tokens": None}) == 7
    assert out({}) == 7
    with pytest.raises(Exception, match="between 0 and 1000"):
        out({"max_tokens": 1001})


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 1000 + b"]" * 1000,
        b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        b'{"messages": [' + b'{"content": ' * 900 + b'"x"' + b"}" * 900 + b"]}",
        b'{"a": ' * 100_000,
        b'{"messages": [], "max_tokens": 1' + b"0" * 5000 + b"}",
        b"\xff\xfe\x00garbage",
        b"[]",
    ],
)
def test_malformed_or_deep_json_is_a_400_and_never_a_traceback(
    raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[5000.0] * 2).start()
        async with running_router(instances=(_static(engine),)) as router:
            url = f"http://127.0.0.1:{router.port}"
            with router_logs() as logs:
                async with aiohttp.ClientSession() as s:
                    status, text = await _post(s, url, raw)
            assert status == 400, text
            assert json.loads(text)["error"]["message"].startswith("body: ")
            assert len(text) < 1000
            assert not [e for e in logs if e["log_level"] in ("error", "critical")]
        await engine.stop()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert not _aiohttp_errors(caplog)


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[5000.0] * 2).start()
        async with (
            running_router(instances=(_static(engine),)) as router,
            aiohttp.ClientSession() as s,
        ):
            text = '[{"' * 2000 + '\\"]}'
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
            status, answer = await _post(
                s, f"http://127.0.0.1:{router.port}", json.dumps(body).encode()
            )
            assert status == 200, answer
        await engine.stop()

    asyncio.run(main())


def test_a_huge_declared_body_is_answered_413_at_once() -> None:
    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[5000.0]).start()
        async with running_router(instances=(_static(engine),)) as router:
            reader, writer = await _raw(router.port)
            writer.write(_head(10**12) + b"{")
            line = await asyncio.wait_for(reader.readline(), WAIT_S)
            assert line.startswith(b"HTTP/1.1 413"), line
            writer.close()
        await engine.stop()

    asyncio.run(main())


def test_slow_clients_are_cut_by_the_header_body_and_idle_timeouts() -> None:
    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[5000.0]).start()
        timeouts = {"header_timeout_s": 0.3, "body_timeout_s": 0.3, "idle_timeout_s": 0.5}
        async with running_router(instances=(_static(engine),), **timeouts) as router:
            # A head trickled one header line at a time (slowloris): closed mid-head.
            reader, writer = await _raw(router.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n")
            sent = 0
            while not reader.at_eof() and sent < 100:
                await asyncio.sleep(0.05)
                try:
                    writer.write(f"X-Slow-{sent}: 1\r\n".encode())
                    await writer.drain()
                except ConnectionError:
                    break
                sent += 1
            assert await _closed(reader) == b""  # closed without an answer
            assert sent < 100, "the router kept a trickled head open"
            writer.close()

            # A body that stops half way: 408, then closed.
            reader, writer = await _raw(router.port)
            writer.write(_head(100) + b'{"prompt": ')
            answer = await _closed(reader)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            writer.close()

            # A connection that never sends anything: closed by the idle timeout.
            reader, writer = await _raw(router.port)
            assert await _closed(reader) == b""
            writer.close()

            # The router still serves.
            async with aiohttp.ClientSession() as s:
                body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
                url = f"http://127.0.0.1:{router.port}"
                assert (await _post(s, url, body, "/v1/completions"))[0] == 200
        await engine.stop()

    asyncio.run(main())


def test_body_bytes_in_flight_are_bounded_413_for_one_too_large_429_past_the_bound() -> None:
    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[5000.0]).start()
        limits = {"max_body_bytes": 64 << 10, "max_inflight_body_bytes": 100 << 10}
        async with running_router(instances=(_static(engine),), **limits) as router:
            url = f"http://127.0.0.1:{router.port}"

            def body(n: int) -> bytes:
                head = b'{"prompt": "'
                tail = b'", "max_tokens": 1}'
                return head + b"x" * (n - len(head) - len(tail)) + tail

            # A slow client holds 60 KiB of the 100 KiB bound...
            slow = body(60 << 10)
            reader, writer = await _raw(router.port)
            writer.write(_head(len(slow)) + slow[:1000])
            await writer.drain()
            await until(lambda: router.bodies.held_bytes > 0, WAIT_S, "the slow body counted")
            async with aiohttp.ClientSession() as s:
                # ... so another 60 KiB body does not fit: 429 with Retry-After.
                async with s.post(f"{url}/v1/completions", data=body(60 << 10)) as r:
                    assert r.status == 429 and r.headers["Retry-After"] == "1"
                # One larger than the per-request bound: 413, declared or chunked.
                assert (await _post(s, url, body(70 << 10), "/v1/completions"))[0] == 413

                async def chunks() -> AsyncIterator[bytes]:
                    data = body(70 << 10)
                    for i in range(0, len(data), 8192):
                        yield data[i : i + 8192]

                async with s.post(f"{url}/v1/completions", data=chunks()) as r:
                    assert r.status == 413
                # Small requests still pass.
                assert (await _post(s, url, body(1000), "/v1/completions"))[0] == 200
                # The slow body completes and is served; its bytes are given back.
                writer.write(slow[1000:])
                assert (await asyncio.wait_for(reader.readline(), WAIT_S)).startswith(
                    b"HTTP/1.1 200"
                )
                await until(lambda: router.bodies.held_bytes == 0, WAIT_S, "bytes given back")
                async with s.post(f"{url}/v1/completions", data=body(60 << 10)) as r:
                    assert r.status == 200
            writer.close()
        await engine.stop()

    asyncio.run(main())


def test_a_client_leaving_mid_body_is_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[MutableMapping[str, Any]]:
        engine = await LoopbackEngine(tokens_per_s=[5000.0]).start()
        async with running_router(instances=(_static(engine),)) as router:
            with router_logs() as logs:
                for _ in range(3):
                    _, writer = await _raw(router.port)
                    writer.write(_head(5000) + b'{"prompt": "' + b"x" * 100)
                    await writer.drain()
                    await until(lambda: router.bodies.held_bytes > 0, WAIT_S, "body started")
                    writer.transport.abort()  # a reset, as a killed client leaves it
                    await until(lambda: router.bodies.held_bytes == 0, WAIT_S, "bytes given back")
            await asyncio.sleep(0.1)
        await engine.stop()
        return logs

    with caplog.at_level(logging.DEBUG):
        logs = asyncio.run(main())
    gone = [e for e in logs if e["event"] == "client went away while sending its body"]
    assert len(gone) == 3
    assert not [e for e in logs if e["log_level"] in ("error", "critical", "exception")]
    assert not _aiohttp_errors(caplog)


def test_a_stalled_engine_is_given_up_after_the_read_timeout() -> None:
    async def main() -> None:
        async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1 << 16)  # takes the request, never answers
            await asyncio.sleep(3600)

        server = await asyncio.start_server(stall, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stalled = InstanceSpec("stalled", f"http://127.0.0.1:{port}", "default")
        async with (
            running_router(instances=(stalled,), read_timeout_s=0.3) as router,
            aiohttp.ClientSession() as s,
        ):
            body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
            url = f"http://127.0.0.1:{router.port}"
            status, text = await _post(s, url, body, "/v1/completions")
            assert status == 502 and "TimeoutError" in text, text
        server.close()

    asyncio.run(main())


def test_timeouts_and_limits_are_flags() -> None:
    import argparse

    from controlplane.cli.router import add_run_args, settings_from_args

    p = argparse.ArgumentParser()
    add_run_args(p)
    flags = {
        "--read-timeout-s": ("read_timeout_s", 7.5),
        "--connect-timeout-s": ("connect_timeout_s", 1.5),
        "--health-timeout-s": ("health_timeout_s", 0.5),
        "--header-timeout-s": ("header_timeout_s", 3.0),
        "--body-timeout-s": ("body_timeout_s", 4.0),
        "--idle-timeout-s": ("idle_timeout_s", 5.0),
        "--max-body-bytes": ("max_body_bytes", 1000),
        "--max-inflight-body-bytes": ("max_inflight_body_bytes", 5000),
        "--max-output-tokens": ("max_output_tokens", 4096),
        "--max-json-depth": ("max_json_depth", 16),
    }
    argv = ["--instance", "url=http://h:1"]
    for flag, (_, value) in flags.items():
        argv += [flag, str(value)]
    settings = settings_from_args(p.parse_args([*argv, "--tier-headers"]))
    for _, (name, value) in flags.items():
        assert getattr(settings, name) == value, name
    assert settings.honour_tier_headers
    defaults = settings_from_args(p.parse_args(["--instance", "url=http://h:1"]))
    assert defaults == RouterSettings(instances=defaults.instances)  # flags default as settings


def test_tier_headers_are_ignored_where_api_keys_define_tiers() -> None:
    keyed = RouterSettings(instances=(), api_key_tiers={"k": "interactive"})
    assert not keyed.honour_tier_headers
    assert RouterSettings(instances=()).honour_tier_headers
    assert RouterSettings(
        instances=(), api_key_tiers={"k": "i"}, tier_headers=True
    ).honour_tier_headers

    def tier(headers: dict[str, str], allowed: bool) -> str:
        return pick_tier(
            headers,
            tiers={"batch", "interactive"},
            api_key_tiers={"k": "interactive"},
            priority_tiers={"high": "interactive"},
            default_tier="batch",
            tier_headers=allowed,
        )

    assert tier({"X-Mixfleet-Tier": "interactive"}, False) == "batch"
    assert tier({"X-Priority-Class": "high"}, False) == "batch"
    assert tier({"X-Mixfleet-Tier": "gold", "Authorization": "Bearer k"}, False) == "interactive"

    async def main() -> None:
        batch = await LoopbackEngine(tokens_per_s=[5000.0]).start()
        inter = await LoopbackEngine(tokens_per_s=[5000.0]).start()
        instances = (_static(batch, "b", "batch"), _static(inter, "i", "interactive"))
        async with (
            running_router(
                instances=instances, default_tier="batch", api_key_tiers={"k": "interactive"}
            ) as router,
            aiohttp.ClientSession() as s,
        ):
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            body = {"prompt": "x", "max_tokens": 1}
            for headers in ({"X-Mixfleet-Tier": "interactive"}, {"X-Priority-Class": "high"}):
                async with s.post(url, json=body, headers=headers) as r:
                    assert r.status == 200
            async with s.post(url, json=body, headers={"Authorization": "Bearer k"}) as r:
                assert r.status == 200
            assert (len(batch.records), len(inter.records)) == (2, 1)
        await batch.stop()
        await inter.stop()

    asyncio.run(main())


@contextmanager
def _engine_on_its_own_loop(ranks: int) -> Iterator[LoopbackEngine]:
    """A test engine served by a thread with its own event loop (as an engine process is
    independent of the router's)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = LoopbackEngine(tokens_per_s=[5000.0] * ranks)
    asyncio.run_coroutine_threadsafe(engine.start(), loop).result(WAIT_S)
    try:
        yield engine
    finally:
        asyncio.run_coroutine_threadsafe(engine.stop(), loop).result(WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)
        loop.close()


def test_health_checks_pass_while_the_request_loop_is_overloaded() -> None:
    """The router's own lateness must not eject a healthy engine: here every turn of its
    event loop takes 150 ms (as with hundreds of streams on a busy machine), so anything
    that needs two turns of it takes longer than the 0.2 s check timeout."""

    async def main(engine: LoopbackEngine) -> None:
        fast = {"health_interval_s": 0.05, "health_timeout_s": 0.2, "eject_after": 2}
        async with running_router(instances=(_static(engine),), **fast) as router:
            loop = asyncio.get_running_loop()
            end = loop.time() + 2.0

            def busy() -> None:
                time.sleep(0.15)
                if loop.time() < end:
                    loop.call_soon(busy)

            loop.call_soon(busy)
            await asyncio.sleep(2.3)
            assert router.health.healthy == {"e0"}
            assert router.metrics.ejections.labels("e0")._value.get() == 0

    with _engine_on_its_own_loop(2) as engine:
        asyncio.run(main(engine))
