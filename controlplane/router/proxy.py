"""The router's HTTP side: an aiohttp server in front of the engine instances.

Routes: ``POST /v1/chat/completions``, ``/v1/completions``, ``/generate`` (routed by the
plan, streamed or not); ``GET /v1/models`` (from an admitted instance); ``GET /health``
(200 when some tier can route); ``GET /metrics`` (Prometheus); ``GET /router/status``
(JSON, read by ``mixfleetctl router status``).

A routed request: parse the JSON body, pick the tier (:func:`.requests.pick_tier`), estimate
its work, choose a rank (:func:`.balance.choose`), pin the rank (:func:`.requests.pinned_body`:
the client's bytes, with SGLang's field appended, not serialised again) and forward over one
shared keep-alive connection pool; a streamed answer is relayed chunk by chunk as it
arrives (``iter_any``), with no task per chunk and no log line or metric label lookup per
request (the per-rank metric children are kept). When the engine cannot be reached or answers 502/503/504 *before anything was
sent back*, the instance is ejected and the request tried on another instance (at most
``max_attempts`` tries); once a byte has gone to the client a failure cuts the response and
is never retried (a half-streamed answer must not be generated twice). When every rank of
the tier is at its queue limit: 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog
from aiohttp import web
from mixfleet.v1 import engine_pb2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.router.balance import RankState, choose
from controlplane.router.health import HealthBook, check_loop
from controlplane.router.metrics import RouterMetrics
from controlplane.router.requests import (
    RANK_HEADER,
    TokenCounter,
    Work,
    chars_estimate,
    estimate_work,
    pick_tier,
    pinned_body,
)
from controlplane.router.settings import RouterSettings
from controlplane.router.state import RouterState
from policies.errors import InputError

if TYPE_CHECKING:
    from controlplane.router.routing import RoutingWatcher

log = structlog.get_logger("mixfleet.router")

ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate")
#: Not forwarded: hop-by-hop headers, and the rank header a client might send itself.
_DROP = frozenset(
    h.lower()
    for h in (
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        RANK_HEADER,
    )
)
_DROP_BACK = frozenset(("content-length", "transfer-encoding", "connection", "keep-alive"))
_RETRYABLE_STATUS = frozenset((502, 503, 504))
#: Seconds an idle engine connection is kept for reuse.
KEEPALIVE_S = 4.0


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


class _UnreachableError(Exception):
    """The engine failed before anything was sent back: the request may be tried again."""


def _error(status: int, message: str, **headers: str) -> web.Response:
    body = {"error": {"message": message, "type": "mixfleet_router", "code": status}}
    return web.json_response(body, status=status, headers=headers)


class Router:
    """One router: state, health checks, controller watch and the HTTP app.

    Args:
        settings: checked settings (:func:`.settings.check`).
        count_tokens: prompt token counter (default: characters / 4).
    """

    def __init__(
        self, settings: RouterSettings, count_tokens: TokenCounter = chars_estimate
    ) -> None:
        self.settings = settings
        self.count_tokens = count_tokens
        self.state = RouterState.from_specs(settings.instances)
        self.metrics = RouterMetrics(self.state.tier_ranks)
        self.health = HealthBook(settings.eject_after, settings.readmit_after)
        self.health.on_change = self._health_changed
        self.connected: dict[str, bool] = dict.fromkeys(settings.deployments, False)
        self.watcher: RoutingWatcher | None = None
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.port = 0
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------- lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes)
        for path in ROUTED_PATHS:
            app.router.add_post(path, self._route)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/router/status", self._status)
        return app

    async def start(self) -> int:
        """Start serving; returns the bound port."""
        s = self.settings
        self.session = aiohttp.ClientSession(
            # One pool for every request: no cap on connections (the per-rank queue limit
            # bounds them), idle ones kept below uvicorn's default keep-alive of 5 s (SGLang
            # and vLLM serve on uvicorn) so a reused connection is not one the engine is
            # closing (that would read as an unreachable engine). aiohttp sets TCP_NODELAY.
            connector=aiohttp.TCPConnector(
                limit=0, ttl_dns_cache=300, keepalive_timeout=KEEPALIVE_S
            ),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=s.connect_timeout_s, sock_read=s.read_timeout_s
            ),
            auto_decompress=False,
        )
        self.health.admit_all(self.state.instances)
        urls = {n: i.spec.url for n, i in self.state.instances.items()}
        self._tasks.append(
            asyncio.create_task(
                check_loop(
                    self.health,
                    self.session,
                    urls,
                    interval_s=s.health_interval_s,
                    timeout_s=s.health_timeout_s,
                ),
                name="health",
            )
        )
        if s.deployments:  # gRPC only when a controller is used (static routers need none)
            from controlplane.router.routing import RoutingWatcher

            self.watcher = RoutingWatcher(s, self._on_routing, self._on_connected)
            self.watcher.start()
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, s.listen_host, s.listen_port, backlog=4096)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else s.listen_port
        log.info("router listening", host=s.listen_host, port=self.port)
        return self.port

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.watcher is not None:
            await self.watcher.stop()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------- callbacks

    def _on_routing(self, routing: engine_pb2.Routing) -> None:
        changed = self.state.apply_routing(routing)
        self.metrics.version.labels(routing.deployment).set(routing.version)
        if changed:
            log.info(
                "weights applied",
                deployment=routing.deployment,
                version=routing.version,
                plan_id=routing.plan_id,
                instances=changed,
            )

    def _on_connected(self, deployment: str, up: bool) -> None:
        self.connected[deployment] = up
        self.metrics.connected.labels(deployment).set(1 if up else 0)

    def _health_changed(self, name: str, ok: bool) -> None:
        self.metrics.healthy.labels(name).set(1 if ok else 0)
        if not ok:
            self.metrics.ejections.labels(name).inc()
            log.warning("instance ejected", instance=name)
        elif self.session is not None:
            log.info("instance admitted", instance=name)

    # ------------------------------------------------------------- handlers

    async def _route(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        s = self.settings
        tier = s.default_tier
        try:
            raw = await request.read()
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise InputError("must be a JSON object", field="body")
            tier = pick_tier(
                request.headers,
                tiers=self.state.tiers,
                api_key_tiers=s.api_key_tiers,
                priority_tiers=s.priority_tiers,
                default_tier=s.default_tier,
            )
            work = estimate_work(request.path, body, self.count_tokens, s.default_output_tokens)
        except (ValueError, InputError) as exc:  # JSONDecodeError is a ValueError
            self.metrics.rejects.labels(tier, "bad_request").inc()
            where = exc.field if isinstance(exc, InputError) and exc.field else "body"
            return _error(400, f"{where}: {exc}")
        tried: set[str] = set()
        last = ""
        for attempt in range(s.max_attempts):
            choice = choose(
                self.state.tiers.get(tier, []),
                work.tokens,
                queue_limit=s.queue_limit,
                healthy=self.health.healthy,
                exclude=tried,
            )
            if choice.rank is None:
                if choice.reason == "overloaded":
                    self.metrics.rejects.labels(tier, "overloaded").inc()
                    return _error(
                        429,
                        f"every rank of tier {tier!r} is at its queue limit "
                        f"({s.queue_limit} open requests)",
                        **{"Retry-After": str(s.retry_after_s)},
                    )
                break
            if attempt:
                self.metrics.retries.inc()
            rank = choice.rank
            try:
                return await self._forward(request, raw, body, work, rank, arrived)
            except _UnreachableError as exc:
                last = str(exc)
                tried.add(rank.instance)
                self.health.eject(rank.instance)
        if last:
            self.metrics.rejects.labels(tier, "upstream").inc()
            return _error(502, f"no engine answered: {last}")
        self.metrics.rejects.labels(tier, "no_rank").inc()
        return _error(503, f"tier {tier!r} has no admitted rank with weight > 0")

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        body: dict[str, Any],
        work: Work,
        rank: RankState,
        arrived: float,
    ) -> web.StreamResponse:
        inst = self.state.instances[rank.instance]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        headers["Content-Type"] = "application/json"
        data = pinned_body(inst.engine, raw, body, headers, rank.rank)
        requests, tokens = self.metrics.rank_counters(rank.tier, rank.instance, rank.rank)
        requests.inc()
        tokens.inc(work.tokens)
        rank.acquire(work.tokens)
        assert self.session is not None
        try:
            try:
                upstream = await self.session.post(
                    inst.spec.url + request.path, data=data, headers=headers
                )
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                raise _UnreachableError(f"{rank.instance}: {exc!r}") from exc
            async with upstream:
                if upstream.status in _RETRYABLE_STATUS:
                    raise _UnreachableError(f"{rank.instance}: HTTP {upstream.status}")
                return await self._relay(request, upstream, rank, arrived)
        finally:
            rank.release(work.tokens)

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        rank: RankState,
        arrived: float,
    ) -> web.StreamResponse:
        back = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_BACK}
        stream = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        if not stream:
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                raise _UnreachableError(f"{rank.instance}: {exc!r}") from exc
            self.metrics.tier_ttfb(rank.tier).observe(time.perf_counter() - arrived)
            return web.Response(status=upstream.status, body=data, headers=back)
        resp = web.StreamResponse(status=upstream.status, headers=back)
        first = True
        try:
            async for chunk in upstream.content.iter_any():
                if first:
                    await resp.prepare(request)
                    self.metrics.tier_ttfb(rank.tier).observe(time.perf_counter() - arrived)
                    first = False
                try:
                    await resp.write(chunk)
                except (ConnectionError, RuntimeError):  # the client went away
                    return resp
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            if first:  # nothing sent yet: another rank may take it
                raise _UnreachableError(f"{rank.instance}: {exc!r}") from exc
            self.metrics.stream_aborts.inc()
            log.warning("stream cut by the engine; not retried", instance=rank.instance)
            if request.transport is not None:
                request.transport.close()
            return resp
        if first:
            await resp.prepare(request)
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        for name in sorted(self.health.healthy):
            inst = self.state.instances[name]
            try:
                async with self.session.get(inst.spec.url + "/v1/models") as r:
                    return web.Response(
                        status=r.status,
                        body=await r.read(),
                        content_type=r.content_type or "application/json",
                    )
            except (aiohttp.ClientError, OSError, TimeoutError):
                continue
        return _error(503, "no admitted engine instance")

    async def _health(self, request: web.Request) -> web.StreamResponse:
        ok = any(
            r.weight > 0 and r.instance in self.health.healthy
            for ranks in self.state.tiers.values()
            for r in ranks
        )
        return web.Response(status=200 if ok else 503, text="ok\n" if ok else "no rank\n")

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def _status(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.state.status(self.health.healthy, dict(self.connected)))
