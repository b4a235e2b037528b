"""The serving side of the demo's fleet-plan step (:mod:`demo.instances_step`): what stands
in for the GPUs, the users and the router.

- :class:`EngineFarm`: one loopback engine per instance the controller lists (an SGLang
  prefill instance's bootstrap server beside it), started and retired as WatchInstances
  changes; each generates one token per predicted TPOT of its instance.
- :class:`Client`: the users, Poisson arrivals of equal-sized completions through the
  router, every :data:`STREAM_EVERY`-th request streamed; each request's :class:`Answer`.
- :class:`Router`: the ``mixfleet-router --deployment`` process (:func:`start_router`) and
  :func:`routed`, the wait until it routes to every live instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from mixfleet.v1 import engine_pb2

from demo.router_step import _engine_class, _free_port
from demo.session import PROGRESS_S, say

if TYPE_CHECKING:
    from support.openai_engine import LoopbackEngine

REPO = Path(__file__).resolve().parents[2]
ADDRESS = "127.0.0.1"  # where every simulated node says its engines serve
STREAM_EVERY = 4  # every 4th request is streamed (TTFT and TPOT are seen on streams)
RETIRE_LIMIT_S = 30.0  # longest wait for a removed instance's open requests, s


# ------------------------------------------------------------------------- engines


@dataclass
class Running:
    """One instance's loopback engine (and an SGLang prefill's bootstrap server)."""

    instance: engine_pb2.Instance
    engine: LoopbackEngine
    bootstrap: web.AppRunner | None = None

    def requests(self) -> int:
        """Requests this instance has served (a prefill side: the prefills it ran)."""
        if self.instance.role == "prefill":
            return len(self.engine.pd_seen)
        return sum(1 for r in self.engine.records if r.done)


async def _bootstrap_server(port: int, prefill_url: str) -> web.AppRunner:
    """A prefill instance's bootstrap server on ``port`` (SGLang runs one beside each prefill
    server, at ``--disaggregation-bootstrap-port``): a decode side's KV lookup
    (``GET /loopback/kv/{key}``) is handed to the prefill engine."""
    session = aiohttp.ClientSession()

    async def kv(request: web.Request) -> web.Response:
        async with session.get(f"{prefill_url}/loopback/kv/{request.match_info['key']}") as r:
            return web.Response(status=r.status, text=await r.text())

    async def close(_: web.Application) -> None:
        await session.close()

    app = web.Application()
    app.router.add_get("/loopback/kv/{key}", kv)
    app.on_cleanup.append(close)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, ADDRESS, port).start()
    return runner


@dataclass
class EngineFarm:
    """The loopback engines of the deployment's instances, started as WatchInstances lists
    them. An engine whose instance is no longer listed (or is listed again at another url
    or role: names and ports are reused) is retired: stopped once its open requests have
    finished, within :data:`RETIRE_LIMIT_S`.

    Attributes:
        protocol: the engines' protocol (``Instances.engine``).
        gpus: GPUs per node (an engine gets one DP rank per GPU of its nodes).
        running: by instance name.
    """

    protocol: str
    gpus: dict[str, int]
    running: dict[str, Running] = field(default_factory=dict)
    _retiring: dict[int, asyncio.Task[None]] = field(default_factory=dict)

    async def sync(self, msg: engine_pb2.Instances) -> list[str]:
        """Retire the engines of instances gone or moved; start one for every listed
        instance that has none. Returns the names started."""
        self.protocol = msg.engine or self.protocol
        listed = {i.name: i for i in msg.instances}
        for name, run in list(self.running.items()):
            now = listed.get(name)
            if now is None or now.url != run.instance.url or now.role != run.instance.role:
                del self.running[name]
                self._retiring[run.engine.port] = asyncio.create_task(self._retire(run))
        started = []
        for inst in msg.instances:
            if inst.name in self.running or not inst.url:
                continue
            port = urlsplit(inst.url).port or 80
            for busy in (port, inst.bootstrap_port):
                if busy in self._retiring:
                    await self._retiring.pop(busy)
            self.running[inst.name] = await self._start(inst)
            started.append(inst.name)
        for inst in msg.instances:  # the newest record of each (draining, share)
            if inst.name in self.running:
                self.running[inst.name].instance = inst
        return started

    async def _start(self, inst: engine_pb2.Instance) -> Running:
        ranks = max(1, sum(self.gpus.get(n, 1) for n in inst.nodes))
        tpot_ms = inst.tpot_ms if inst.tpot_ms > 0 else 20.0
        try:
            engine = await _engine_class()(
                engine=self.protocol,
                role=inst.role,
                port=urlsplit(inst.url).port or 80,
                tokens_per_s=[1000.0 / tpot_ms] * ranks,
                model=inst.name,
            ).start()
            run = Running(inst, engine)
            if inst.role == "prefill" and self.protocol == "sglang" and inst.bootstrap_port:
                run.bootstrap = await _bootstrap_server(inst.bootstrap_port, engine.url)
        except OSError as exc:
            raise RuntimeError(
                f"cannot serve instance {inst.name} at {inst.url} (bootstrap port "
                f"{inst.bootstrap_port}): {exc}; is another run using the port?"
            ) from exc
        return run

    async def _retire(self, run: Running) -> None:
        t0 = time.monotonic()
        while any(not r.done for r in run.engine.records):
            if time.monotonic() - t0 > RETIRE_LIMIT_S:
                break
            await asyncio.sleep(0.1)
        await run.engine.stop()
        if run.bootstrap is not None:
            await run.bootstrap.cleanup()

    def counts(self) -> dict[str, int]:
        """Requests each running engine has served, by instance name."""
        return {name: r.requests() for name, r in self.running.items()}

    async def stop(self) -> None:
        """Stop every engine (those being retired once their open requests end)."""
        for task in self._retiring.values():
            await task
        for r in self.running.values():
            await r.engine.stop()
            if r.bootstrap is not None:
                await r.bootstrap.cleanup()


# ------------------------------------------------------------------------- client


@dataclass
class Answer:
    """One client request: when it was sent (monotonic s), its status (0: the connection
    failed), and for a streamed one its TTFT and TPOT, s (nan when not seen)."""

    sent_s: float
    status: int
    stream: bool
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    complete: bool = False
    error: str = ""


@dataclass
class Client:
    """The demo's users: Poisson arrivals of equal-sized completions through the router.

    Attributes:
        url: the router. prompt_tokens, output_tokens: every request's size, tokens.
        rate_rps: the arrival rate now, requests/s (changed while it runs).
        answers: every request so far.
    """

    url: str
    prompt_tokens: int
    output_tokens: int
    rate_rps: float
    answers: list[Answer] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _body: dict[bool, bytes] = field(default_factory=dict)

    def body(self, stream: bool) -> bytes:
        """The request body: the prompt as token ids (the router counts them exactly)."""
        if stream not in self._body:
            doc = {
                "model": "qwen3",
                "prompt": [1] * self.prompt_tokens,
                "max_tokens": self.output_tokens,
                "stream": stream,
            }
            self._body[stream] = json.dumps(doc, separators=(",", ":")).encode()
        return self._body[stream]

    async def send(self, session: aiohttp.ClientSession, stream: bool) -> None:
        """One request; its :class:`Answer` is appended to :attr:`answers`."""
        ans = Answer(time.monotonic(), 0, stream)
        self.answers.append(ans)
        headers = {"Content-Type": "application/json"}
        try:
            async with session.post(
                f"{self.url}/v1/completions", data=self.body(stream), headers=headers
            ) as r:
                ans.status = r.status
                if r.status != 200:
                    ans.error = (await r.read())[:200].decode(errors="replace")
                    return
                if not stream:
                    await r.read()
                    ans.complete = r.status == 200
                    return
                first = last = 0.0
                tokens = 0
                async for line in r.content:
                    if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                        ans.complete = ans.complete or line.startswith(b"data: [DONE]")
                        continue
                    last = time.monotonic()
                    first = first or last
                    tokens += 1
                if first:
                    ans.ttft_s = first - ans.sent_s
                if tokens > 1:
                    ans.tpot_s = (last - first) / (tokens - 1)
        except (aiohttp.ClientError, OSError) as exc:
            ans.complete = False
            ans.error = f"{type(exc).__name__}: {exc}"

    async def run(self, stop: asyncio.Event, rng: random.Random) -> None:
        """Send until ``stop``, then wait for every open request. Arrivals keep their
        schedule (each gap drawn at the rate in force) even when the loop falls behind: a
        late request goes out at once, so the rate holds on a busy machine."""
        timeout = aiohttp.ClientTimeout(total=120)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            i = 0
            due = time.monotonic()
            while not stop.is_set():
                task = asyncio.create_task(self.send(session, i % STREAM_EVERY == 0))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                i += 1
                due += rng.expovariate(self.rate_rps)
                wait_s = due - time.monotonic()
                if wait_s > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait_s)
            if self._tasks:
                await asyncio.gather(*self._tasks)


# ------------------------------------------------------------------------- the router


@dataclass
class Router:
    """The ``mixfleet-router`` process: its process, URL and log file."""

    proc: asyncio.subprocess.Process
    url: str
    log_path: Path

    def tail(self) -> str:
        """The last lines of its log, for an error message."""
        lines = (
            self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        )
        return "; ".join(lines[-3:]) or "no log lines"

    async def status(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        """Its ``GET /router/status`` document."""
        async with session.get(f"{self.url}/router/status") as r:
            doc: dict[str, Any] = await r.json()
            return doc

    async def stop(self) -> None:
        """Terminate it (killed after 10 s)."""
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def start_router(controller: str, deployment: str, log_dir: Path) -> Router:
    """``mixfleet-router --deployment NAME`` as its own process on a free port."""
    port = _free_port()
    log_path = log_dir / "router-instances.log"
    cmd = [
        sys.executable, "-m", "controlplane.cli", "router", "run",
        "--listen", f"{ADDRESS}:{port}",
        "--controller", controller,
        "--deployment", deployment,
        "--traffic-report-s", "1",
        "--health-interval-s", "0.2",
        "--log-level", "warning",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=REPO, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log
        )
    return Router(proc, f"http://{ADDRESS}:{port}", log_path)


def current(i: engine_pb2.Instance) -> bool:
    """Whether ``i`` is one of the current plan's instances: not retiring (a newer plan
    dropped it; it serves until its replacements commit) and not draining."""
    return not i.draining and not i.retiring


def router_names(msg: engine_pb2.Instances) -> set[str]:
    """The router's instances for the current plan in ``msg``: each aggregated instance by
    its name, each prefill/decode pool as one pair named ``<deployment>/<pool>``."""
    names = set()
    for i in msg.instances:
        if not current(i):
            continue
        names.add(i.name if i.role == "aggregated" else f"{msg.deployment}/{i.pool}")
    return names


async def routed(
    router: Router, session: aiohttp.ClientSession, msg: engine_pb2.Instances, limit_s: float
) -> float:
    """Wait until the router routes to every live instance of ``msg`` (a prefill/decode
    pool: to its pair): each ``serving`` in its status, healthy and with its DP ranks (the
    router learns an instance from ``WatchInstances`` and its ranks from the instance's own
    ``WatchRouting`` stream, which may come later; until then a request finds no rank:
    503). Returns the seconds waited."""
    want = router_names(msg)
    t0 = last = time.monotonic()
    while True:
        if router.proc.returncode is not None:
            raise RuntimeError(f"the router exited ({router.tail()})")
        with contextlib.suppress(aiohttp.ClientError, ValueError, KeyError):
            doc = await router.status(session)
            ok = {i["name"] for i in doc["instances"] if i.get("serving")}
            if want <= ok:
                return time.monotonic() - t0
        now = time.monotonic()
        if now - t0 > limit_s:
            raise TimeoutError(f"the router does not route to {sorted(want)} ({router.tail()})")
        if now - last >= PROGRESS_S:
            say(f"  ... waiting for the router to route to every instance ({now - t0:.0f} s)")
            last = now
        await asyncio.sleep(0.2)
