"""An engine's answer read through aiohttp's client, passed to the client: the path of an
``https`` engine, an HTTP/1.0 client and a prefill/decode pair's decode side (plain-HTTP
engines go through :mod:`.relay`). A streamed answer is written chunk by chunk as it
arrives (``iter_any``); nothing goes to the client before the first chunk is in, so a
failure before that may be tried elsewhere (:class:`.relay.EngineError`), and one after it
cuts the response.
"""

from __future__ import annotations

import time

import aiohttp
import structlog
from aiohttp import web

from controlplane.router.balance import RankState
from controlplane.router.listener import peer_name
from controlplane.router.metrics import RouterMetrics
from controlplane.router.relay import EngineError
from controlplane.router.traffic import Sample

log = structlog.get_logger("mixfleet.router")

#: Headers of an engine's answer that are not passed on (the router frames its own).
DROP_BACK = frozenset(("content-length", "transfer-encoding", "connection", "keep-alive"))


async def relay_client(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    rank: RankState,
    metrics: RouterMetrics,
    arrived: float,
    seen: Sample | None = None,
) -> web.StreamResponse:
    """Pass ``upstream`` (the engine's answer to ``request``, sent to ``rank``) on.

    Args:
        arrived: when the request arrived (``time.perf_counter``, seconds).
        seen: the request's traffic measurement, shown the answer's bytes (None: none).

    Raises:
        EngineError: the answer failed before anything was sent to the client.
    """
    back = {k: v for k, v in upstream.headers.items() if k.lower() not in DROP_BACK}
    ctype = upstream.headers.get("Content-Type", "")
    if seen is not None:
        seen.answer(upstream.status, ctype)
    if not ctype.startswith("text/event-stream"):
        try:
            data = await upstream.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise EngineError(f"{rank.instance}: {exc!r}") from exc
        metrics.tier_ttfb(rank.tier).observe(time.perf_counter() - arrived)
        if seen is not None:
            seen.body(data)
        return web.Response(status=upstream.status, body=data, headers=back)
    resp = web.StreamResponse(status=upstream.status, headers=back)
    first = True
    try:
        async for chunk in upstream.content.iter_any():
            if first:
                await resp.prepare(request)
                metrics.tier_ttfb(rank.tier).observe(time.perf_counter() - arrived)
                first = False
            if seen is not None:
                seen.body(chunk)
            try:
                await resp.write(chunk)
            except (ConnectionError, RuntimeError):  # the client went away
                log.info(
                    "client went away during its stream",
                    peer=peer_name(request.transport),
                    instance=rank.instance,
                )
                return resp
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        if first:  # nothing sent yet: another rank may take it
            raise EngineError(f"{rank.instance}: {exc!r}") from exc
        metrics.stream_aborts.inc()
        log.warning("stream cut by the engine; not retried", instance=rank.instance)
        if request.transport is not None:
            request.transport.close()
        return resp
    if first:
        await resp.prepare(request)
    await resp.write_eof()
    return resp
