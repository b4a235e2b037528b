"""Several router workers on one port (SO_REUSEPORT): each keeps its own stride state and
the shares summed over the workers still follow the plan."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from support.openai_engine import LoopbackEngine

from controlplane.router.balance import shares
from controlplane.router.proxy import Router
from controlplane.router.settings import RouterSettings, check, parse_instance

pytestmark = pytest.mark.timeout(120)

WEIGHTS = (3.0, 1.0, 2.0, 2.0)
REPO = Path(__file__).resolve().parents[3]


def test_two_workers_on_one_port_give_the_planned_shares_together() -> None:
    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[5000.0] * 4).start()
        spec = parse_instance(
            f"url={engine.url},name=e0,weights=" + ":".join(map(str, WEIGHTS)), "default"
        )
        base = RouterSettings(instances=(spec,), listen_host="127.0.0.1", listen_port=0)
        first = Router(check(base))
        port = await first.start(reuse_port=True)
        second = Router(check(dataclasses.replace(base, listen_port=port)))
        await second.start(reuse_port=True)
        try:
            # a new connection per request, so the kernel spreads them over both sockets
            conn = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=conn) as s:
                left = [400]

                async def loop() -> None:
                    while left[0] > 0:
                        left[0] -= 1
                        body = {"prompt": "x" * 40, "max_tokens": 4}
                        async with s.post(
                            f"http://127.0.0.1:{port}/v1/completions", json=body
                        ) as r:
                            assert r.status == 200

                await asyncio.gather(*(loop() for _ in range(16)))
            per_worker = [
                sum(r.routed_requests for r in w.state.tiers["default"]) for w in (first, second)
            ]
            assert sum(per_worker) == 400 and min(per_worker) >= 40, per_worker
            ranks = first.state.tiers["default"]
            planned, _ = shares(ranks)
            routed = [
                a.routed_tokens + b.routed_tokens
                for a, b in zip(ranks, second.state.tiers["default"], strict=True)
            ]
            achieved = [t / sum(routed) for t in routed]
            assert max(abs(a - p) for a, p in zip(achieved, planned, strict=True)) <= 0.01
            engine_share = engine.share()
            assert max(abs(a - p) for a, p in zip(engine_share, planned, strict=True)) <= 0.01
        finally:
            await second.stop()
            await first.stop()
            await engine.stop()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_the_console_script_runs_workers_and_they_stop_with_it() -> None:
    async def main() -> None:
        engine = await LoopbackEngine(tokens_per_s=[5000.0] * 2).start()
        port = _free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "controlplane.cli",
                "router",
                "run",
                "--workers",
                "2",
                "--listen",
                f"127.0.0.1:{port}",
                "--log-level",
                "warning",
                "--instance",
                f"url={engine.url},ranks=2",
            ],
            cwd=REPO,
        )
        try:
            url = f"http://127.0.0.1:{port}/v1/completions"
            async with aiohttp.ClientSession() as s:
                end = time.monotonic() + 60  # a hang guard for start-up, not a speed claim
                while True:
                    try:
                        async with s.post(url, json={"prompt": "x", "max_tokens": 1}) as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    assert time.monotonic() < end and proc.poll() is None
                    await asyncio.sleep(0.2)
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            assert len(children) >= 1  # the second worker
        finally:
            proc.send_signal(signal.SIGINT)
            await asyncio.to_thread(proc.wait, 30)
            await engine.stop()
        for pid in children:  # the workers went with the parent
            for _ in range(100):
                if not os.path.exists(f"/proc/{pid}") or "Z" in _state(pid):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"worker {pid} outlived the router")

    asyncio.run(main())


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
