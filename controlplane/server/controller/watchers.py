"""The controller's open streams: each node's assignment stream and the plan, routing and
instance watchers of PlanService and EngineService.

:class:`Watchers` owns the queues behind those streams. Other parts push events into them
(:meth:`Watchers.send`, :meth:`Watchers.emit`, :meth:`Watchers.emit_routing`,
:meth:`Watchers.instances_changed`); the servicers read them through the async iterators
here. Every queue ends with a stop marker when the controller stops.

Instance watchers (``EngineService.WatchInstances``) are told that *something* changed (a
commit, a deployment or instance record written, a node's address); each reads its
deployment's instances again - one read per deployment and change, shared by all of its
streams; a burst of changes merges into a few - and sends them only when they differ from
what it sent last. Every message carries a generation from one
counter of the controller, started at its start time in milliseconds: it grows with every
change, across streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from controlplane.errors import NotFoundError
from controlplane.server.controller.common import AssignmentEvent, Context
from controlplane.server.controller.endpoints import InstanceSet
from controlplane.store import StoredPlan

_STOP: Any = object()


@dataclass
class _Stream:
    session_id: str
    queue: asyncio.Queue[AssignmentEvent | None] = field(default_factory=asyncio.Queue)


class Watchers:
    """Assignment streams (one per connected node) and plan / routing watchers.

    Args:
        ctx: the controller's shared dependencies.
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._streams: dict[str, _Stream] = {}
        self._plan_watchers: set[asyncio.Queue[StoredPlan]] = set()
        self._routing_watchers: dict[str, set[asyncio.Queue[StoredPlan]]] = {}
        self._instance_watchers: set[asyncio.Event] = set()
        #: deployment -> its instances being read for the current generation (shared)
        self._instance_reads: dict[str, asyncio.Future[InstanceSet]] = {}
        self._instances_generation = int(ctx.clock() * 1000)
        self._stopped = False

    def stop(self) -> None:
        """End every stream and watcher."""
        self._stopped = True
        for ev in self._instance_watchers:
            ev.set()
        for s in self._streams.values():
            s.queue.put_nowait(None)
        for q in self._plan_watchers:
            q.put_nowait(_STOP)
        for qs in self._routing_watchers.values():
            for q in qs:
                q.put_nowait(_STOP)

    # ----------------------------------------------------------------- assignments

    def send(self, node: str, event: AssignmentEvent) -> None:
        """Queue ``event`` on the node's stream (dropped when the node is not connected: it
        gets a snapshot when it connects)."""
        stream = self._streams.get(node)
        if stream is not None:
            stream.queue.put_nowait(event)

    def end_stream(self, node: str) -> None:
        """End the node's current stream (it registered again)."""
        old = self._streams.pop(node, None)
        if old is not None:
            old.queue.put_nowait(None)

    async def assignments(
        self,
        node: str,
        session_id: str,
        opened: Callable[[], None],
        snapshot: Callable[[], list[AssignmentEvent]],
    ) -> AsyncIterator[AssignmentEvent]:
        """The node's new stream (ending its old one): ``snapshot()``, then each event sent.

        ``opened()`` runs first, on the first read: it checks the node may connect (raising
        otherwise) and records the sign of life.
        """
        opened()
        old = self._streams.get(node)
        if old is not None:
            old.queue.put_nowait(None)
        stream = _Stream(session_id)
        self._streams[node] = stream
        try:
            for event in snapshot():
                yield event
            while True:
                item = await stream.queue.get()
                if item is None:
                    return
                yield item
        finally:
            if self._streams.get(node) is stream:
                del self._streams[node]

    # ----------------------------------------------------------------- plans and routing

    def emit(self, stored: StoredPlan) -> None:
        """Tell every plan watcher about a plan record."""
        for q in self._plan_watchers:
            q.put_nowait(stored)

    def emit_version(self, deployment: str, version: int) -> StoredPlan | None:
        """Tell every plan watcher about the stored record of a version; returns it."""
        stored = self.ctx.store.get_plan(deployment, version, with_plan=False)
        if stored is not None:
            self.emit(stored)
        return stored

    def emit_routing(self, deployment: str, stored: StoredPlan) -> None:
        """Tell the deployment's routing watchers about its newly committed plan (and the
        instance watchers: a committed version is part of what they list)."""
        for q in self._routing_watchers.get(deployment, set()):
            q.put_nowait(stored)
        self.instances_changed()

    def instances_changed(self) -> None:
        """Something an instance watcher lists may have changed: each reads its
        deployment's instances again."""
        self._instances_generation += 1
        self._instance_reads.clear()
        for ev in self._instance_watchers:
            ev.set()

    async def _read_instances(
        self, deployment: str, read: Callable[[], InstanceSet]
    ) -> InstanceSet:
        """``read()`` in a thread, shared by every watcher of ``deployment`` woken by the
        same change: one store read per deployment and change, not one per stream."""
        shared = self._instance_reads.get(deployment)
        if shared is None:
            shared = asyncio.ensure_future(asyncio.to_thread(read))
            shared.add_done_callback(lambda t: None if t.cancelled() else t.exception())
            self._instance_reads[deployment] = shared
        return await asyncio.shield(shared)

    async def watch_plans(self, deployment: str = "") -> AsyncIterator[StoredPlan]:
        """Latest record of each (matching) deployment, then every change."""
        store = self.ctx.store
        q: asyncio.Queue[StoredPlan] = asyncio.Queue()
        self._plan_watchers.add(q)
        try:
            names = [deployment] if deployment else [d.name for d in store.list_deployments()]
            for name in names:
                latest = store.list_plans(name, limit=1)
                if latest:
                    yield latest[0]
            while True:
                item = await q.get()
                if item is _STOP:
                    return
                if not deployment or item.deployment == deployment:
                    yield item
        finally:
            self._plan_watchers.discard(q)

    async def watch_routing(self, deployment: str) -> AsyncIterator[StoredPlan]:
        """The committed plan now (when there is one), then each newly committed one.

        Raises:
            NotFoundError: unknown deployment.
        """
        store = self.ctx.store
        if store.get_deployment(deployment) is None:
            raise NotFoundError(f"no deployment {deployment!r}", field="deployment")
        q: asyncio.Queue[StoredPlan] = asyncio.Queue()
        self._routing_watchers.setdefault(deployment, set()).add(q)
        try:
            # Plan documents grow with the fleet: read them off the loop.
            current = await asyncio.to_thread(store.committed_plan, deployment)
            if current is not None:
                yield current
            while True:
                item = await q.get()
                if item is _STOP:
                    return
                full = await asyncio.to_thread(store.get_plan, deployment, item.version)
                if full is not None:
                    yield full
        finally:
            self._routing_watchers.get(deployment, set()).discard(q)

    async def watch_instances(
        self, deployment: str, read: Callable[[], InstanceSet]
    ) -> AsyncIterator[tuple[int, InstanceSet]]:
        """``(generation, instances)`` of ``deployment`` now, then again each time
        ``read()`` (run in a thread: it reads the store) answers differently after
        :meth:`instances_changed`.

        Raises:
            NotFoundError: unknown deployment (on the first read; later, when it is deleted,
                ending the stream).
        """
        event = asyncio.Event()
        self._instance_watchers.add(event)
        try:
            generation = self._instances_generation
            current = await asyncio.to_thread(read)
            yield generation, current
            while not self._stopped:
                await event.wait()
                event.clear()
                if self._stopped:
                    return
                now = self._instances_generation
                fresh = await self._read_instances(deployment, read)
                if fresh == current:
                    continue
                if now <= generation:  # changed without a word: a generation of its own
                    self._instances_generation += 1
                    now = self._instances_generation
                generation, current = now, fresh
                yield generation, current
        finally:
            self._instance_watchers.discard(event)
