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
the tier is at its queue limit: 429 with ``Retry-After``; when every instance that could
take it is at its batch limit, the request waits for a slot (:class:`.fleet.SlotQueue`,
bounded in number and time), then 429.

The client side before routing (error answers, body bounds) is :mod:`.intake`; the
listening socket's head deadline and the collector settings are :mod:`.listener`
(:func:`tune_gc` is re-exported here, where the console script and the benchmark take it).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog
from aiohttp import web
from mixfleet.v1 import engine_pb2
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from yarl import URL

from controlplane.router.balance import RankState
from controlplane.router.fleet import Fleet, Turn, plain_target
from controlplane.router.health import CheckThread, HealthBook
from controlplane.router.intake import (
    BodyBudget,
    ClientGoneError,
    RefusedError,
    error,
    read_body,
)
from controlplane.router.listener import GuardedSite, peer_name, tune_gc
from controlplane.router.metrics import RouterMetrics
from controlplane.router.passthrough import DROP_BACK, relay_client
from controlplane.router.pd import PairError, open_pair
from controlplane.router.relay import EngineConnection, EngineError, EnginePool
from controlplane.router.requests import (
    RANK_HEADER,
    TokenCounter,
    Work,
    chars_estimate,
    estimate_work,
    parse_body,
    pick_tier,
    pinned_body,
)
from controlplane.router.settings import RouterSettings
from controlplane.router.state import RouterState
from controlplane.router.traffic import Sample
from policies.errors import InputError

if TYPE_CHECKING:
    from controlplane.router.routing import RoutingWatcher

__all__ = ["KEEPALIVE_S", "POOL_KEEPALIVE_S", "ROUTED_PATHS", "BodyBudget", "Router", "tune_gc"]

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
_RETRYABLE_STATUS = frozenset((502, 503, 504))
_JSON = {"Content-Type": "application/json"}
#: Seconds an idle engine connection is kept for reuse by aiohttp's client (https engines):
#: below uvicorn's default keep-alive of 5 s, so a reused connection is not one the engine
#: is closing (aiohttp cannot tell that from an unreachable engine).
KEEPALIVE_S = 4.0
#: Seconds an idle engine connection is kept by the relay's pool: an engine's own close of
#: an idle connection removes it from the pool when it arrives, and a request that meets a
#: connection closed in that instant (no byte back) goes once more on a new connection.
POOL_KEEPALIVE_S = 60.0


#: The engine failed before anything was sent back: the request may be tried again.
_UnreachableError = EngineError


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
        self.metrics = RouterMetrics(
            self.state.tier_ranks, lambda: self.fleet.slots.waiting_by_tier()
        )
        self.health = HealthBook(settings.eject_after, settings.readmit_after)
        self.health.on_change = self._health_changed
        self.bodies = BodyBudget(settings.max_inflight_body_bytes)
        self._tier_headers = settings.honour_tier_headers
        self._urls: dict[tuple[str, str], URL] = {}
        self.pool: EnginePool | None = None
        #: instance -> (host, port, Host header) of the engines reached over plain HTTP (the
        #: pool's relay); others (https) go through the aiohttp client.
        self.plain: dict[str, tuple[str, int, bytes]] = {}
        for name, inst in self.state.instances.items():
            if (target := plain_target(inst.spec.url)) is not None:
                self.plain[name] = target
        self.fleet = Fleet(self)
        self.checks: CheckThread | None = None
        watches = [*settings.deployments, *(f"instances/{w.name}" for w in settings.watched)]
        self.connected: dict[str, bool] = dict.fromkeys(watches, False)
        self.watcher: RoutingWatcher | None = None
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.port = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._turns = itertools.count()  # round robin over a pair's URL sets

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

    async def start(self, *, reuse_port: bool = False) -> int:
        """Start serving; returns the bound port.

        Args:
            reuse_port: listen with ``SO_REUSEPORT`` (several router processes on one port).
        """
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
            cookie_jar=aiohttp.DummyCookieJar(),  # a proxy keeps no cookies of its own
        )
        self.pool = EnginePool(s.connect_timeout_s, s.read_timeout_s, POOL_KEEPALIVE_S)
        self.pool.start()
        self.health.admit_all(self.state.instances)
        self.checks = CheckThread(
            self.health,
            {n: i.spec.url for n, i in self.state.instances.items()},
            interval_s=s.health_interval_s,
            timeout_s=s.health_timeout_s,
            home=asyncio.get_running_loop(),
        )
        self.checks.start()
        if s.deployments or s.watched:  # gRPC only with a controller (static routers: none)
            from controlplane.router.routing import RoutingWatcher

            self.watcher = w = RoutingWatcher(
                s, self._on_routing, self._on_connected, self.fleet.on_instances
            )
            w.start()
        watcher = self.watcher
        self.fleet.start(
            None if watcher is None else lambda rep: watcher.report(rep, s.connect_timeout_s * 2)
        )
        self.runner = web.AppRunner(
            self.app(),
            access_log=None,
            handle_signals=False,
            keepalive_timeout=s.idle_timeout_s,
        )
        await self.runner.setup()
        site = GuardedSite(
            self.runner,
            header_timeout_s=s.header_timeout_s,
            host=s.listen_host,
            port=s.listen_port,
            backlog=4096,
            reuse_port=reuse_port or None,
        )
        await site.start()
        self.port = site.port
        log.info("router listening", host=s.listen_host, port=self.port)
        return self.port

    async def stop(self) -> None:
        if self.checks is not None:
            await asyncio.to_thread(self.checks.stop)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.fleet.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()
        if self.pool is not None:
            await self.pool.close()

    # ------------------------------------------------------------- callbacks

    def _on_routing(self, routing: engine_pb2.Routing) -> None:
        changed = self.state.apply_routing(routing)
        self.metrics.version.labels(routing.deployment).set(routing.version)
        if changed:
            self.fleet.slots.wake_all()  # an instance that had no weights may take requests
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
        self.fleet.slots.wake_all()
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
        held = 0
        try:
            raw = await read_body(request, self.settings, self.bodies)
            held = len(raw) if request.content_length is None else request.content_length
            body = parse_body(raw, s.max_json_depth)
            tier = pick_tier(
                request.headers,
                tiers=self.state.tiers,
                api_key_tiers=s.api_key_tiers,
                priority_tiers=s.priority_tiers,
                default_tier=s.default_tier,
                tier_headers=self._tier_headers,
            )
            work = estimate_work(
                request.path,
                body,
                self.count_tokens,
                s.default_output_tokens,
                s.max_output_tokens,
            )
            return await self._dispatch(request, raw, body, work, tier, arrived)
        except InputError as exc:
            self.metrics.rejects.labels(tier, "bad_request").inc()
            return error(400, str(exc) if exc.field else f"body: {exc}")
        except RefusedError as exc:
            self.metrics.rejects.labels(tier, exc.reason).inc()
            return exc.response
        except ClientGoneError:
            return web.Response(status=400)  # nobody is there to read it
        except Exception as exc:  # the handler's boundary: one line, never a traceback
            log.error(
                "request failed",
                path=request.path,
                error=type(exc).__name__,
                detail=str(exc)[:200],
            )
            return error(500, "internal error of the router (logged)")
        finally:
            self.bodies.give(held)

    def _upstream_url(self, base: str, path: str) -> URL:
        """The engine URL of ``path`` at ``base``, parsed once and kept."""
        url = self._urls.get((base, path))
        if url is None:
            url = self._urls[(base, path)] = URL(base + path)
        return url

    async def _dispatch(
        self,
        request: web.Request,
        raw: bytes,
        body: dict[str, Any],
        work: Work,
        tier: str,
        arrived: float,
    ) -> web.StreamResponse:
        s = self.settings
        tried: set[str] = set()
        last = ""
        attempt = 0
        turn = Turn()
        counted = self.fleet.arrive(tier)  # demand from its arrival, queued or refused
        while attempt < s.max_attempts:
            choice = await self.fleet.claim(tier, work.tokens, tried, turn)
            if choice.rank is None:
                if choice.reason in ("batch_full", "overloaded"):
                    return self._refuse(tier, choice.reason)
                break
            rank = choice.rank
            if attempt:
                self.metrics.retries.inc()
            elif not counted:  # a shared tier: the deployment is known once routed
                self.fleet.traffic.arrive(self.state.instances[rank.instance].spec.source)
            attempt += 1
            try:
                return await self._forward(request, raw, body, work, rank, arrived)
            except _UnreachableError as exc:
                last = str(exc)
                tried.add(rank.instance)
                if exc.refused:
                    self.health.eject(rank.instance)
                else:
                    self.health.record(rank.instance, False)
            finally:
                self.fleet.finished(rank, work.tokens)
        if last:
            self.metrics.rejects.labels(tier, "upstream").inc()
            return error(502, f"no engine answered: {last}")
        self.metrics.rejects.labels(tier, "no_rank").inc()
        return error(503, f"tier {tier!r} has no admitted rank with weight > 0")

    def _refuse(self, tier: str, reason: str) -> web.Response:
        """429: every rank at its queue limit, or no batch slot within the wait."""
        s = self.settings
        self.metrics.rejects.labels(tier, reason).inc()
        why = (
            f"every instance of tier {tier!r} is at its batch limit (waited up to "
            f"{s.batch_wait_s} s, {s.batch_queue} requests at most)"
            if reason == "batch_full"
            else f"every rank of tier {tier!r} is at its queue limit ({s.queue_limit} open "
            "requests)"
        )
        return error(429, why, **{"Retry-After": str(s.retry_after_s)})

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
        requests, tokens = self.metrics.rank_counters(rank.tier, rank.instance, rank.rank)
        requests.inc()
        tokens.inc(work.tokens)
        seen = self.fleet.sample(inst, arrived, work.prompt_tokens, work.output_tokens)
        assert self.session is not None
        try:
            if inst.spec.pd:
                return await self._pair(request, body, headers, rank, arrived, seen)
            data = pinned_body(inst.engine, raw, body, headers, rank.rank)
            plain = self.plain.get(rank.instance)
            if plain is not None and request.version >= (1, 1):
                return await self._exchange(request, plain, data, headers, rank, arrived, seen)
            try:
                upstream = await self.session.post(
                    self._upstream_url(inst.spec.url, request.path), data=data, headers=headers
                )
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                refused = isinstance(exc, aiohttp.ClientConnectorError) and isinstance(
                    exc.os_error, ConnectionRefusedError
                )
                raise _UnreachableError(f"{rank.instance}: {exc!r}", refused=refused) from exc
            async with upstream:
                if upstream.status in _RETRYABLE_STATUS:
                    raise _UnreachableError(f"{rank.instance}: HTTP {upstream.status}")
                self.health.answered(rank.instance)
                return await relay_client(request, upstream, rank, self.metrics, arrived, seen)
        except _UnreachableError:
            seen = None  # no answer: another instance may take it
            raise
        finally:
            if seen is not None and seen.status:
                self.fleet.traffic.finish(seen)

    async def _pair(
        self,
        request: web.Request,
        body: dict[str, Any],
        headers: dict[str, str],
        rank: RankState,
        arrived: float,
        seen: Sample | None,
    ) -> web.StreamResponse:
        """Through a prefill/decode pair (:mod:`.pd`); the decode answer is relayed."""
        assert self.session is not None
        spec = self.state.instances[rank.instance].spec
        try:
            upstream = await open_pair(
                self.session, spec, request.path, body, headers, rank.rank, next(self._turns)
            )
        except PairError as exc:
            if exc.status:  # the prefill server refused the request: its answer
                return web.Response(status=exc.status, body=exc.body, headers=_JSON)
            raise _UnreachableError(f"{rank.instance}: {exc}") from exc
        async with upstream:
            if upstream.status in _RETRYABLE_STATUS:
                raise _UnreachableError(f"{rank.instance}: decode HTTP {upstream.status}")
            self.health.answered(rank.instance)
            return await relay_client(request, upstream, rank, self.metrics, arrived, seen)

    async def _exchange(
        self,
        request: web.Request,
        engine: tuple[str, int, bytes],
        data: bytes,
        headers: dict[str, str],
        rank: RankState,
        arrived: float,
        seen: Sample | None,
    ) -> web.StreamResponse:
        """Forward over the engine pool (:mod:`.relay`): the engine's body goes to the
        client from the engine connection's own reads."""
        assert self.pool is not None
        host, port, host_line = engine
        head = b"".join(
            (
                b"POST ",
                request.path.encode(),
                b" HTTP/1.1\r\n",
                host_line,
                *(f"{k}: {v}\r\n".encode("utf-8", "surrogateescape") for k, v in headers.items()),
                b"Content-Length: %d\r\n\r\n" % len(data),
            )
        )
        conn = await self._send((head, data), host, port, rank, seen)
        try:
            status = conn.head.status if conn.head is not None else 0
            if status in _RETRYABLE_STATUS:
                raise _UnreachableError(f"{rank.instance}: HTTP {status}")
            self.health.answered(rank.instance)
            assert conn.first_fut is not None and conn.done_fut is not None
            await conn.first_fut
            if conn.error or conn.head is None:  # nothing sent to the client yet
                raise _UnreachableError(f"{rank.instance}: {conn.error}")
            back = CIMultiDict((k, v) for k, v in conn.head.headers if k.lower() not in DROP_BACK)
            if seen is not None:
                seen.answer(status, back.get("Content-Type", ""))
            whole = conn.whole_body()
            if whole is not None:  # a short answer, all in: head and body in one write
                self.metrics.tier_ttfb(rank.tier).observe(time.perf_counter() - arrived)
                return web.Response(status=status, headers=back, body=whole)
            resp = web.StreamResponse(status=status, headers=back)
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            await resp.write(b"")  # the head, alone: the body goes straight to the transport
            self.metrics.tier_ttfb(rank.tier).observe(time.perf_counter() - arrived)
            sink = request.transport
            if sink is None or sink.is_closing():
                log.info("client went away before its answer", instance=rank.instance)
                return resp
            conn.attach(sink)
            outcome = await conn.done_fut
        finally:
            self.pool.release(conn)
        if outcome == "complete":
            await resp.write_eof()
        elif outcome == "client_gone":
            log.info(
                "client went away during its answer", peer=peer_name(sink), instance=rank.instance
            )
            sink.close()  # gone, or too slow to read: either way its connection ends
        else:
            self.metrics.stream_aborts.inc()
            log.warning("answer cut by the engine; not retried", instance=rank.instance)
            sink.close()
        return resp

    async def _send(
        self,
        request: Sequence[bytes],
        host: str,
        port: int,
        rank: RankState,
        seen: Sample | None = None,
    ) -> EngineConnection:
        """Send ``request`` on a pooled connection and wait for the response head; a pooled
        connection that the engine had closed is replaced once.

        Raises:
            _UnreachableError: no head came back (the request may go elsewhere).
        """
        assert self.pool is not None
        for _ in range(2):
            try:
                conn, reused = await self.pool.acquire(host, port)
            except EngineError as exc:
                raise _UnreachableError(f"{rank.instance}: {exc}", refused=exc.refused) from exc
            conn.send(request, None if seen is None else seen.body)
            assert conn.head_fut is not None
            await conn.head_fut
            if not conn.error:
                return conn
            self.pool.release(conn)
            if not (reused and not conn.got_bytes and not conn.timed_out):
                break
        raise _UnreachableError(f"{rank.instance}: {conn.error}")

    async def _models(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        for name in sorted(self.health.healthy):
            if (inst := self.state.instances.get(name)) is None:
                continue  # an instance removed since its last check
            try:
                async with self.session.get(inst.spec.url + "/v1/models") as r:
                    return web.Response(
                        status=r.status,
                        body=await r.read(),
                        content_type=r.content_type or "application/json",
                    )
            except (aiohttp.ClientError, OSError, TimeoutError):
                continue
        return error(503, "no admitted engine instance")

    async def _health(self, request: web.Request) -> web.StreamResponse:
        ok = bool(self.state.serving(self.health.healthy))
        return web.Response(status=200 if ok else 503, text="ok\n" if ok else "no rank\n")

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def _status(self, request: web.Request) -> web.StreamResponse:
        doc = self.state.status(
            self.health.healthy, dict(self.connected), self.fleet.slots.waiting_by_tier()
        )
        return web.json_response(doc)
