"""Health of the engine instances: active checks (``GET /health``) and passive reports
(what real requests met).

An instance is ejected after ``eject_after`` consecutive failures, counting failed checks
and requests that could not get an answer from it alike; at once when a request finds
nothing listening (connection refused); it is re-admitted after ``readmit_after``
consecutive passed checks. A request that got an answer resets the failure count.

The active checks run on a thread with its own event loop and its own connection pool
(:class:`CheckThread`), so the router's own load cannot fail them: under overload the
request loop may be late by seconds, and a check timed on that loop would read the
router's lateness as the engine's (an earlier version ejected all 8 healthy engines of a
500-stream benchmark within 50 ms that way). :class:`HealthBook` is the pure bookkeeping,
touched only on the request loop (the thread hands its results over).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
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
        """One check result (or, with ``ok`` False, a request that got no answer)."""
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

    def answered(self, name: str) -> None:
        """A real request got an answer from the instance: its failure count restarts."""
        if self._fails.get(name):
            self._fails[name] = 0

    def forget(self, name: str) -> None:
        """An instance that is gone: no more bookkeeping for it."""
        self.healthy.discard(name)
        self._fails.pop(name, None)
        self._passes.pop(name, None)

    def eject(self, name: str) -> None:
        """Take an instance out now (a request found nothing listening)."""
        self._passes[name] = 0
        if name in self.healthy:
            self.healthy.discard(name)
            self.on_change(name, False)


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """True when ``GET url/health`` answers 200 within ``timeout_s`` seconds."""
    try:
        async with session.get(
            f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


class CheckThread:
    """Active checks of every instance every ``interval_s`` seconds, on their own thread and
    event loop; each round's results are handed to ``book`` on the loop ``home``.

    Args:
        book: the bookkeeping (only touched on ``home``).
        urls: instance name -> base URL.
        interval_s: time between the starts of two rounds, seconds.
        timeout_s: timeout of one check, seconds.
        home: the router's event loop.
    """

    def __init__(
        self,
        book: HealthBook,
        urls: Mapping[str, str],
        *,
        interval_s: float,
        timeout_s: float,
        home: asyncio.AbstractEventLoop,
    ) -> None:
        self.book = book
        self.urls = dict(urls)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.home = home
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="router-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def set_urls(self, urls: Mapping[str, str]) -> None:
        """Check these instances (name -> base URL) from the next round on."""
        self.urls = dict(urls)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the checks and wait for the thread, at most ``timeout_s`` seconds."""
        self._stop.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop has ended already
                loop.call_soon_threadsafe(wake.set)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        asyncio.run(self._checks())

    def _hand_over(self, names: Sequence[str], results: Sequence[bool]) -> None:
        for n, ok in zip(names, results, strict=True):
            if n in self.urls:  # not an instance removed during the round
                self.book.record(n, ok)

    async def _checks(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        wake = self._wake = asyncio.Event()
        async with aiohttp.ClientSession() as session:
            while not self._stop.is_set():
                start = loop.time()
                urls = self.urls  # one round checks one set (set_urls replaces it whole)
                names = list(urls)
                results = await asyncio.gather(
                    *(probe(session, urls[n], self.timeout_s) for n in names)
                )
                if self._stop.is_set():
                    return
                try:
                    self.home.call_soon_threadsafe(self._hand_over, names, results)
                except RuntimeError:  # the router's loop is closed: nothing to report to
                    return
                # One wake-up per round (a thread that woke often would take the GIL from
                # the request loop as often); stop() wakes it at once.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), start + self.interval_s - loop.time())
