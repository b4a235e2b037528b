"""The client side of ``bench.router``: streams, short requests and share counts sent to
one path (the engine directly or a router), and the percentiles and added latencies made
of their samples. Times are seconds in the samples, milliseconds in the summaries.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; NaN when there are none."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


async def _stream(session: Any, url: str, chunks: int, ttfb: list[float], lag: list[float]) -> bool:
    """One streamed completion of ``chunks`` chunks; its time to first byte and each chunk's
    lag after the engine sent it (seconds) are appended. False when not answered 200."""
    body = {"model": "m", "prompt": "hello", "max_tokens": chunks, "stream": True}
    t0 = time.monotonic()
    first = True
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            await r.read()
            return False
        buf = b""
        async for data in r.content.iter_any():
            now = time.monotonic()
            if first:
                ttfb.append(now - t0)
                first = False
            buf += data
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if ev.startswith(b"data: {"):
                    lag.append(now - json.loads(ev[6:])["mono_s"])
    return True


async def latency_level(url: str, streams: int, chunks: int, chunk_rate: float) -> dict[str, Any]:
    """``streams`` concurrent streams to ``url`` (engine sending ``chunk_rate`` chunks/s in
    all), after one short warm-up request each: completed count and samples (seconds)."""
    import aiohttp

    interval_s = streams / chunk_rate
    ttfb: list[float] = []
    lag: list[float] = []
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        # Warm-up: one short request per stream, so both paths start with open connections
        # (clients of a router keep theirs alive; a cold start measures TCP set-up instead).
        warm = {"model": "m", "prompt": "hi", "max_tokens": 0}

        async def short() -> None:
            async with s.post(f"{url}/v1/completions", json=warm) as r:
                await r.read()

        await asyncio.gather(*(short() for _ in range(streams)), return_exceptions=True)

        async def one(i: int) -> bool:
            await asyncio.sleep(interval_s * i / streams)  # spread the starts over one interval
            return await _stream(s, url, chunks, ttfb, lag)

        ok = await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)
    done = sum(1 for x in ok if x is True)
    return {
        "streams": streams,
        "completed": done,
        "chunk_interval_ms": round(interval_s * 1000, 1),
        "samples": {"ttfb_ms": ttfb, "chunk_lag_ms": lag},
    }


def pooled(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Percentiles over the samples of every round of one path (the samples dropped)."""
    out: dict[str, Any] = {
        "streams": runs[0]["streams"],
        "completed": sum(r["completed"] for r in runs),
        "chunk_interval_ms": runs[0]["chunk_interval_ms"],
        "rounds": len(runs),
    }
    for k in ("ttfb_ms", "chunk_lag_ms"):
        values = [v for r in runs for v in r["samples"][k]]
        out[k] = {"p50": pct(values, 0.5) * 1e3, "p99": pct(values, 0.99) * 1e3}
    return out


def round_added(runs: dict[str, list[dict[str, Any]]], path: str) -> dict[str, Any]:
    """Added latency round by round (each round's path against that round's direct run)
    and the median over the rounds: one round disturbed by other work on the host moves
    the pooled percentiles, not this median."""
    per = [
        added_ms(pooled([r]), pooled([d])) for r, d in zip(runs[path], runs["direct"], strict=True)
    ]
    med = {
        k: {q: round(statistics.median(x[k][q] for x in per), 3) for q in ("p50", "p99")}
        for k in ("ttfb_ms", "chunk_lag_ms")
    }
    return {"median": med, "rounds": per}


def added_ms(routed: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    """Routed percentile - direct percentile (ms), p50 and p99, per measured figure."""
    return {
        k: {q: round(routed[k][q] - direct[k][q], 3) for q in ("p50", "p99")}
        for k in ("ttfb_ms", "chunk_lag_ms")
    }


async def short_rate(url: str, seconds: float, clients: int) -> dict[str, Any]:
    """``clients`` closed loops of requests with no generation for ``seconds`` s: requests/s
    answered 200 and the count of other answers."""
    import aiohttp

    body = {"model": "m", "prompt": "hi", "max_tokens": 0}
    done = [0, 0]
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def loop() -> None:
            while time.monotonic() < end:
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    await r.read()
                    done[0 if r.status == 200 else 1] += 1

        t0 = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(clients)))
        wall = time.monotonic() - t0
    return {"requests_per_s": round(done[0] / wall, 1), "errors": done[1], "clients": clients}


async def achieved_shares(url: str, requests: int, clients: int) -> list[float]:
    """``requests`` short completions through the router at ``url``; each rank's achieved
    share (0..1) of the default tier, from ``/router/status``."""
    import aiohttp

    body = {"model": "m", "prompt": "x" * 64, "max_tokens": 8}
    left = [requests]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def loop() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    await r.read()

        await asyncio.gather(*(loop() for _ in range(clients)))
        async with s.get(f"{url}/router/status") as r:
            status = await r.json()
    return [float(x["achieved_share"]) for x in status["tiers"]["default"]]
