"""The router's controller-listed side: instances that come and go with each
``WatchInstances`` message (:mod:`.instances`), the requests that wait while every instance
of their tier is at its batch limit (:class:`SlotQueue`), and the traffic windows of the
watched deployments (:mod:`.traffic`).

An instance set applies at once: new instances are admitted (the health checks eject the
dead ones), start their routing watch and take requests once their weights arrive;
instances that are not ready, are draining or are no longer listed get no new request, and
those no longer listed are removed once their open requests have ended (checked every
health interval). A stream is never cut because its instance left.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Awaitable, Callable, Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
from mixfleet.v1 import engine_pb2
from yarl import URL

from controlplane.router.balance import Choice, RankState, choose
from controlplane.router.instances import instance_set
from controlplane.router.settings import RouterSettings
from controlplane.router.state import InstanceState
from controlplane.router.traffic import Sample, TrafficBook, report_forever
from policies.serving.traffic import Slo

if TYPE_CHECKING:
    from controlplane.router.proxy import Router

log = structlog.get_logger("mixfleet.router.fleet")


def plain_target(url: str) -> tuple[str, int, bytes] | None:
    """(host, port, Host header line) of an engine reached over plain HTTP through the
    relay pool; None for one reached through aiohttp's client (https)."""
    u = URL(url)
    if u.scheme == "http" and u.host is not None and u.port is not None:
        return u.host, u.port, f"Host: {u.host}:{u.port}\r\n".encode()
    return None


class SlotQueue:
    """Requests waiting, per tier, for an instance below its batch limit.

    Every slot that frees up (:meth:`Fleet.finished`: each ended request frees one) wakes
    the longest waiting request, which then looks for a slot itself: a condition re-checked
    by the woken request, so two slots freed before the first woken request runs wake two
    requests, and a slot taken meanwhile by another request sends the woken one back to its
    place in the queue (ahead of those that came later) until the next slot frees up. A
    woken request that leaves without looking (deadline, client gone) passes its wake on.

    Args:
        limit: most requests waiting in one tier (a request going back to its place is not
            refused).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: tier -> (place, future) of the requests waiting and not yet woken, by place
        self._waiting: dict[str, list[tuple[int, asyncio.Future[None]]]] = {}
        self._places = itertools.count()

    def waiting(self, tier: str) -> int:
        """Requests of ``tier`` waiting for a slot (not yet woken)."""
        return len(self._waiting.get(tier, ()))

    def waiting_by_tier(self) -> dict[str, int]:
        """Requests waiting for a slot, per tier (tiers that had a queue; 0 when empty)."""
        return {tier: len(q) for tier, q in self._waiting.items()}

    def place(self) -> int:
        """A new place in the queues (later than every place given before)."""
        return next(self._places)

    async def wait(
        self, tier: str, deadline: float, place: int | None = None, *, again: bool = False
    ) -> bool:
        """Wait for a slot of ``tier`` until ``deadline`` (the loop's clock, seconds);
        False when the queue is full or the deadline passed.

        Args:
            place: the request's place (:meth:`place`); None = a new one, at the end.
            again: the request waited at ``place`` before and was woken, but found no slot:
                it goes back to its place, even when the queue is full.
        """
        q = self._waiting.setdefault(tier, [])
        if not again and len(q) >= self.limit:
            return False
        fut = asyncio.get_running_loop().create_future()
        entry = (self.place() if place is None else place, fut)
        bisect.insort(q, entry, key=_place)
        woken = False
        try:
            async with asyncio.timeout_at(deadline):
                await fut
            woken = True
            return True
        except TimeoutError:
            return False
        finally:
            if entry in q:
                q.remove(entry)
            if not woken and fut.done() and not fut.cancelled():
                self.wake(tier)  # woken, but gone (deadline, client): the slot goes on

    def wake(self, tier: str) -> None:
        """A slot of ``tier`` is free: the longest waiting request may look for it."""
        q = self._waiting.get(tier)
        while q:
            _, fut = q.pop(0)
            if not fut.done():
                fut.set_result(None)
                return

    def wake_all(self) -> None:
        """The instances changed: every waiting request looks again."""
        for tier, q in self._waiting.items():
            for _ in range(len(q)):
                self.wake(tier)


def _place(entry: tuple[int, asyncio.Future[None]]) -> int:
    return entry[0]


@dataclass
class Turn:
    """One request's place in its tier's slot queue, kept across its waits and tries.

    Attributes:
        deadline: when its wait for a batch slot ends (the loop's clock, seconds; 0 = it
            has not waited yet).
        place: its place in the queue (:meth:`SlotQueue.place`; None = it has not waited).
    """

    deadline: float = 0.0
    place: int | None = None


class Fleet:
    """The controller-listed instances of one router (module docstring).

    Args:
        router: the router whose state, health checks and watches it keeps in step.
    """

    def __init__(self, router: Router) -> None:
        self.router = router
        s: RouterSettings = router.settings
        self.watched = {w.name: w for w in s.watched}
        self.slots = SlotQueue(s.batch_queue)
        self.traffic = TrafficBook(list(self.watched), router.metrics.registry)
        by_tier: dict[str, list[str]] = {}
        for w in s.watched:
            by_tier.setdefault(w.tier, []).append(w.name)
        #: tier -> the watched deployment that alone serves it (its requests count as that
        #: deployment's demand from their arrival)
        static = {i.tier for i in s.instances}
        self.tier_deployment = {
            t: ds[0] for t, ds in by_tier.items() if len(ds) == 1 and t not in static
        }
        self._noted: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, send: Callable[[engine_pb2.TrafficReport], Awaitable[None]] | None) -> None:
        """Start pruning (and, with a watcher, reporting traffic through ``send``)."""
        s = self.router.settings
        self._tasks.append(asyncio.create_task(self._prune_forever(), name="fleet-prune"))
        if self.watched and send is not None:
            self._tasks.append(
                asyncio.create_task(
                    report_forever(
                        self.traffic, send, reporter=s.reporter, window_s=s.traffic_report_s
                    ),
                    name="traffic-reports",
                )
            )

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def on_instances(self, deployment: str, message: engine_pb2.Instances) -> None:
        """Apply one ``Instances`` message of the watched ``deployment``."""
        watched = self.watched.get(deployment)
        if watched is None:
            return
        r = self.router
        m = message
        self.traffic.set_slo(deployment, Slo(m.slo_ttft_ms, m.slo_tpot_ms, m.slo_percentile))
        got = instance_set(message, watched)
        for line in got.skipped:
            if line not in self._noted:  # once per router, not once per message
                self._noted.add(line)
                log.warning("instance left out", deployment=deployment, why=line)
        added = r.state.sync(watched.name, [(i.spec, i.routable) for i in got.listed])
        r.health.admit_all(added)
        self._changed()
        log.info(
            "instances applied",
            deployment=deployment,
            generation=message.generation,
            routable=sorted(i.spec.name for i in got.listed if i.routable),
            added=added,
        )

    def prune(self) -> list[str]:
        """Remove the idle instances that are no longer listed; their names."""
        r = self.router
        gone = r.state.prune()
        for name in gone:
            r.health.forget(name)
            r.plain.pop(name, None)
        if gone:
            self._changed()
            log.info("instances removed", instances=gone)
        return gone

    def _changed(self) -> None:
        """Health checks, plain-HTTP targets and routing watches follow the instances."""
        r = self.router
        urls = {n: i.spec.url for n, i in r.state.instances.items()}
        if r.checks is not None:
            r.checks.set_urls(urls)
        for name, inst in r.state.instances.items():
            target = plain_target(inst.spec.url)
            if target is None:
                r.plain.pop(name, None)
            else:
                r.plain[name] = target
        if r.watcher is not None:
            keys = r.state.routing_keys()
            for key in keys - r.watcher.watched_routings:
                r.watcher.watch(key)
            for key in r.watcher.watched_routings - keys:
                r.watcher.unwatch(key)
        self.slots.wake_all()

    async def _prune_forever(self) -> None:
        while True:
            await asyncio.sleep(self.router.settings.health_interval_s)
            self.prune()

    def arrive(self, tier: str) -> bool:
        """A request of ``tier`` arrived (its body read and valid): it is demand of the
        watched deployment that alone serves the tier from now on, whether it is then
        queued, refused with 429 or fails upstream (:mod:`.traffic`). Returns whether it
        was counted: False in a tier that no watched deployment serves alone (it counts
        for the deployment of the instance it is routed to)."""
        deployment = self.tier_deployment.get(tier)
        if deployment is None:
            return False
        self.traffic.arrive(deployment)
        return True

    async def claim(
        self, tier: str, work_tokens: float, exclude: Container[str], turn: Turn
    ) -> Choice:
        """Choose a rank of ``tier`` for a request of ``work_tokens`` tokens
        (:func:`.balance.choose`) and count the request open on it (rank and instance);
        while every instance that could take it is at its batch limit, wait for a slot
        (behind the requests that wait already, until ``turn.deadline``). The chosen rank
        must be given back with :meth:`finished`.

        Returns:
            the choice; without a rank, why (``batch_full`` once the wait is over).
        """
        r = self.router
        queued = not exclude and self.slots.waiting(tier)  # behind those that wait already
        if queued and not await self._wait(tier, turn):
            return Choice(None, "batch_full")
        while True:
            choice = choose(
                r.state.tiers.get(tier, []),
                work_tokens,
                queue_limit=r.settings.queue_limit,
                healthy=r.health.healthy,
                exclude=exclude,
                full=r.state.full,
            )
            if choice.rank is not None:
                choice.rank.acquire(work_tokens)
                r.state.acquire(r.state.instances[choice.rank.instance])
                return choice
            if choice.reason != "batch_full" or not await self._wait(tier, turn):
                return choice

    def finished(self, rank: RankState, work_tokens: float) -> None:
        """The request of ``work_tokens`` tokens that :meth:`claim` put on ``rank`` has
        ended (answered, failed or cancelled): its slot is free."""
        rank.release(work_tokens)
        inst = self.router.state.instances.get(rank.instance)
        if inst is not None:
            self.router.state.release(inst)
        self.slots.wake(rank.tier)  # one slot freed: one waiting request looks for it

    async def _wait(self, tier: str, turn: Turn) -> bool:
        """Wait for a slot of ``tier`` until the turn's deadline (set at its first wait)."""
        if not turn.deadline:
            turn.deadline = asyncio.get_running_loop().time() + self.router.settings.batch_wait_s
        again = turn.place is not None
        if turn.place is None:
            turn.place = self.slots.place()
        return await self.slots.wait(tier, turn.deadline, turn.place, again=again)

    def sample(
        self, inst: InstanceState, arrived_s: float, prompt: int, output: int
    ) -> Sample | None:
        """A measurement of a request routed to ``inst`` (None when it is not a watched
        deployment's instance)."""
        if not inst.spec.source:
            return None
        return Sample(inst.spec.source, arrived_s, prompt, output)
