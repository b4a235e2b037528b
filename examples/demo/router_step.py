"""The demo's request path: ``mixfleet-router`` in front of a loopback engine, by the plan.

The router runs as its own process (``python -m controlplane.cli router run``, the same
program as the ``mixfleet-router`` console script) on 127.0.0.1, following the deployment's
committed routing through ``EngineService.WatchRouting``. Behind it, one small
OpenAI-compatible engine instance in the demo's process with the deployment's DP attention
ranks (the DeepSeek-V3 deployment is one engine spanning all its GPUs, as one SGLang server
with data-parallel attention is); it reads the rank each request pins where the plan's
engine reads it and records it. A burst of equal-sized chat requests (half of them
streamed) goes through the router; the table compares each rank's planned share (the plan's
``dp_weight`` of the rank over their sum) with the share of the requests the engine saw on
it. After the re-plan the router picks up the new weights live and a second burst shows
them.

The engine is the router tests' loopback engine (``tests/support/openai_engine.py``, checked
against the engines' source); the demo imports that one module instead of keeping a second
copy of it, so :func:`_engine_class` puts the repository's ``tests`` directory on the path.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from mixfleet.v1 import engine_pb2

from controlplane.router.state import rank_weights
from demo.session import DEPLOYMENT, MODEL, Demo, say

if TYPE_CHECKING:
    from support.openai_engine import LoopbackEngine

REPO = Path(__file__).resolve().parents[2]
REQUESTS = 480  # per burst; one request is 1/480 = 0.0021 of the traffic
CLIENTS = 16  # concurrent clients of a burst
MAX_TOKENS = 4  # output tokens per request (all requests the same size)
TOKENS_PER_S = 2000.0  # generation rate of every engine rank
READY_TIMEOUT_S = 60.0  # the router's start and its first routing, on a loaded machine
SAME_SHARE = 0.001  # planned shares closer than this to the previous ones count as unchanged


def _engine_class() -> type[LoopbackEngine]:
    """The loopback engine of the router tests (module docstring: why from ``tests/``)."""
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.append(tests)
    from support.openai_engine import LoopbackEngine

    return LoopbackEngine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def planned_shares(routing: engine_pb2.Routing) -> list[float]:
    """Each engine DP rank's planned share of the requests: its weight over their sum."""
    weights = rank_weights(routing)
    total = sum(weights) or 1.0
    return [w / total for w in weights]


def _rank_gpus(routing: engine_pb2.Routing) -> list[str]:
    ranks = list(routing.dp_ranks) or list(range(len(routing.rank_gpus)))
    names: dict[int, list[str]] = {}
    for r, gpu in zip(ranks, routing.rank_gpus, strict=False):
        names.setdefault(r, []).append(gpu)
    return [",".join(names.get(r, [])) for r in range(max(ranks, default=-1) + 1)]


@dataclass
class RouterPath:
    """The running engine, router process and client session of the demo."""

    demo: Demo
    engine: LoopbackEngine
    proc: asyncio.subprocess.Process
    url: str
    session: aiohttp.ClientSession
    log_path: Path

    async def status(self) -> dict[str, Any]:
        async with self.session.get(f"{self.url}/router/status") as r:
            doc: dict[str, Any] = await r.json()
            return doc

    async def wait_version(self, version: int) -> float:
        """Wait until the router routes on plan ``version``; returns the seconds waited."""
        t0 = time.monotonic()
        while True:
            if self.proc.returncode is not None:
                raise RuntimeError(f"the router exited ({self._log_tail()})")
            with contextlib.suppress(aiohttp.ClientError, ValueError):
                inst = (await self.status())["instances"][0]
                if inst["version"] >= version and inst["healthy"]:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                raise TimeoutError(f"the router has no v{version} routing ({self._log_tail()})")
            await asyncio.sleep(0.1)

    def _log_tail(self) -> str:
        lines = (
            self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        )
        return "; ".join(lines[-3:]) or "no log lines"

    async def _one(self, i: int) -> int:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Where is the expert?"}],
            "max_tokens": MAX_TOKENS,
            "stream": i % 2 == 1,
        }
        try:
            async with self.session.post(f"{self.url}/v1/chat/completions", json=body) as r:
                await r.read()
                return r.status
        except aiohttp.ClientError as exc:
            raise RuntimeError(f"a request through the router failed: {exc}") from exc

    async def burst(self) -> tuple[list[int], list[int], float]:
        """REQUESTS requests from CLIENTS concurrent clients; (statuses, rank of each request
        as the engine saw it, seconds)."""
        first = len(self.engine.records)
        todo = iter(range(REQUESTS))
        statuses: list[int] = []

        async def client() -> None:
            for i in todo:
                statuses.append(await self._one(i))

        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(CLIENTS)))
        seen = self.engine.records[first:]
        if not all(r.pinned for r in seen) and self.engine.engine != "trtllm":
            raise RuntimeError("a request reached the engine without its rank")
        return statuses, [r.rank for r in seen], time.monotonic() - t0

    async def show(self, version: int, previous: Sequence[float] = ()) -> list[float]:
        """A burst on plan ``version`` and the table of planned vs achieved share per rank;
        returns the planned shares."""
        routing: engine_pb2.Routing = await self.demo.engines.GetRouting(
            engine_pb2.GetRoutingRequest(deployment=DEPLOYMENT), timeout=30
        )
        if routing.version != version:  # committed again meanwhile: show the newest
            await self.wait_version(routing.version)
            version = routing.version
        planned = planned_shares(routing)
        statuses, ranks, took_s = await self.burst()
        achieved = [ranks.count(r) / max(1, len(ranks)) for r in range(len(planned))]
        codes = ", ".join(f"{statuses.count(c)}x {c}" for c in sorted(set(statuses)))
        err = max(abs(a - p) for a, p in zip(achieved, planned, strict=True))
        say(
            f"router       v{version}: {REQUESTS} chat requests ({CLIENTS} clients, half "
            f"streamed) through the router in {took_s:.1f} s: {codes}; largest "
            f"|achieved - planned| {err:.4f} (one request = {1 / REQUESTS:.4f})"
        )
        moved = max((abs(p - b) for p, b in zip(planned, previous, strict=False)), default=1.0)
        if previous and moved < SAME_SHARE:
            say(
                f"  every rank's planned share is within {SAME_SHARE} of v1's (largest change "
                f"{moved:.5f}): the shares and the table above stand"
            )
            return planned
        head = ["rank", "GPUs", "planned"] + (["before"] if previous else []) + ["achieved", "diff"]
        rows = [head]
        for r, (p, a, gpus) in enumerate(zip(planned, achieved, _rank_gpus(routing), strict=False)):
            was = [f"{previous[r]:.4f}"] if previous else []
            rows.append([str(r), gpus, f"{p:.4f}", *was, f"{a:.4f}", f"{a - p:+.4f}"])
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        for row in rows:
            say("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        return planned

    async def stop(self) -> None:
        await self.session.close()
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        await self.engine.stop()


async def start_router(demo: Demo, controller: str, log_dir: Path) -> RouterPath:
    """Start the engine and the router process (its log: ``log_dir/router.log``); wait
    until the router routes on v1."""
    routing: engine_pb2.Routing = await demo.engines.GetRouting(
        engine_pb2.GetRoutingRequest(deployment=DEPLOYMENT), timeout=30
    )
    ranks = len(rank_weights(routing))
    # The rank field the plan's engine reads; mixfleet's native runtime reads vLLM's header.
    kind = routing.engine if routing.engine in ("sglang", "vllm", "trtllm") else "vllm"
    engine = await _engine_class()(
        engine=kind, tokens_per_s=[TOKENS_PER_S] * ranks, model=MODEL
    ).start()
    port = _free_port()
    log_path = log_dir / "router.log"
    cmd = [
        sys.executable, "-m", "controlplane.cli", "router", "run",
        "--listen", f"127.0.0.1:{port}",
        "--controller", controller,
        "--instance", f"url={engine.url},name=ds3,deployment={DEPLOYMENT}",
        "--health-interval-s", "0.2",
        "--log-level", "warning",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=REPO, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log
        )
    path = RouterPath(
        demo, engine, proc, f"http://127.0.0.1:{port}", aiohttp.ClientSession(), log_path
    )
    try:
        waited = await path.wait_version(1)
    except BaseException:
        await path.stop()
        raise
    say()
    say(
        f"router       mixfleet-router (pid {proc.pid}) on {path.url} in front of one engine "
        f"instance ({kind} rank field, {ranks} DP ranks) at {engine.url}; routing on v1 "
        f"from WatchRouting after {waited:.1f} s"
    )
    return path


async def show_live_update(path: RouterPath, version: int, previous: Sequence[float]) -> None:
    """The router picks up the re-plan's weights by itself; a burst on them."""
    await path.wait_version(version)
    say()
    say(f"router       v{version} applied live (WatchRouting), no restart")
    await path.show(version, previous)
