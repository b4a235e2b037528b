"""Health of the engine instances: active checks (``GET /health``) and passive reports
(a request that could not reach the engine).

An instance is ejected after ``eject_after`` consecutive failed checks, or at once when a
request cannot connect to it; it is re-admitted after ``readmit_after`` consecutive passed
checks. :class:`HealthBook` is the pure bookkeeping; :func:`check_loop` runs the checks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp
import structlog

log = structlog.get_logger("mixfleet.router.health")


@dataclass
class HealthBook:
    """Admitted instances and the counters that move them in and out.

    Attributes:
        eject_after: consecutive failures that eject.
        readmit_after: consecutive successes that re-admit.
        healthy: admitted instance names.
        on_change: called with (instance, admitted) when an instance moves.
    """

    eject_after: int
    readmit_after: int
    healthy: set[str] = field(default_factory=set)
    on_change: Callable[[str, bool], None] = lambda name, ok: None
    _fails: dict[str, int] = field(default_factory=dict)
    _passes: dict[str, int] = field(default_factory=dict)

    def admit_all(self, names: Iterable[str]) -> None:
        """Start with every instance admitted (the first checks eject the dead ones)."""
        for n in names:
            self.healthy.add(n)
            self.on_change(n, True)

    def record(self, name: str, ok: bool) -> None:
        """One check result."""
        if ok:
            self._fails[name] = 0
            self._passes[name] = self._passes.get(name, 0) + 1
            if name not in self.healthy and self._passes[name] >= self.readmit_after:
                self.healthy.add(name)
                self.on_change(name, True)
        else:
            self._passes[name] = 0
            self._fails[name] = self._fails.get(name, 0) + 1
            if name in self.healthy and self._fails[name] >= self.eject_after:
                self.eject(name)

    def eject(self, name: str) -> None:
        """Take an instance out now (a request could not reach it)."""
        self._passes[name] = 0
        if name in self.healthy:
            self.healthy.discard(name)
            self.on_change(name, False)


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """True when ``GET url/health`` answers 200 within ``timeout_s``."""
    try:
        async with session.get(
            f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def check_loop(
    book: HealthBook,
    session: aiohttp.ClientSession,
    urls: dict[str, str],
    *,
    interval_s: float,
    timeout_s: float,
) -> None:
    """Check every instance every ``interval_s`` until cancelled."""
    while True:
        names = list(urls)
        results = await asyncio.gather(*(probe(session, urls[n], timeout_s) for n in names))
        for n, ok in zip(names, results, strict=True):
            book.record(n, ok)
        await asyncio.sleep(interval_s)
