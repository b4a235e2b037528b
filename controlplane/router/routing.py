"""Live weights and instances from the controller: one ``EngineService.WatchRouting`` stream
per deployment whose routing an instance takes, one ``WatchInstances`` stream per
``--deployment``, each reopened with exponential backoff (and jitter) whenever it fails or
ends; and the ``ReportTraffic`` calls of the traffic reporter (:mod:`.traffic`).

While the controller is unreachable the router keeps the last committed weights and the
last instance set it received; a deployment it never heard of keeps its instances
unroutable (no weights). A code that will not heal by itself (NOT_FOUND: the deployment
may be created later; a bad token) is logged as an error and retried at the longest
backoff. A new version is handed to ``on_routing`` as soon as its message arrives: weights
are read at the next choice, so streams already open are not touched.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import AsyncIterable, Callable
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc import aio
from mixfleet.v1 import engine_pb2, engine_pb2_grpc

from controlplane.router.settings import RouterSettings
from policies.errors import InputError
from policies.limits import MAX_REPLY_BYTES, MAX_REQUEST_BYTES

log = structlog.get_logger("mixfleet.router.routing")

#: Codes that will not heal by themselves: logged as errors (the watch still retries, at
#: the longest backoff, so a fixed deployment or token is picked up).
_PERMANENT = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
}


def controller_channel(settings: RouterSettings) -> aio.Channel:
    """A grpc.aio channel to the controller (mutual TLS when ``settings.tls`` is set).

    Raises:
        InputError: a TLS file cannot be read (the message names the flag).
    """
    options = [
        ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
        ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
    ]
    t = settings.tls
    if t is None:
        return aio.insecure_channel(settings.controller, options=options)
    pems: dict[str, bytes | None] = {}
    for flag, path in (("--tls-ca", t.ca), ("--tls-cert", t.cert), ("--tls-key", t.key)):
        try:
            pems[flag] = Path(path).read_bytes() if path else None
        except OSError as exc:
            raise InputError(
                f"cannot read {path!r}: {exc.strerror or exc}. To fix: make the files with "
                "`mixfleetctl certs init` and pass their paths",
                field=flag,
            ) from exc
    creds = grpc.ssl_channel_credentials(
        root_certificates=pems["--tls-ca"],
        private_key=pems["--tls-key"],
        certificate_chain=pems["--tls-cert"],
    )
    return aio.secure_channel(settings.controller, creds, options=options)


class RoutingWatcher:
    """Watches the controller (module docstring).

    Args:
        settings: controller address, credentials, backoff, watched deployments.
        on_routing: called with every Routing message received.
        on_connected: called with (deployment, connected) when a routing watch opens or
            drops (``instances/<deployment>`` for an instances watch).
        on_instances: called with (deployment, message) for every Instances message of a
            ``--deployment``.
    """

    def __init__(
        self,
        settings: RouterSettings,
        on_routing: Callable[[engine_pb2.Routing], None],
        on_connected: Callable[[str, bool], None],
        on_instances: Callable[[str, engine_pb2.Instances], None] = lambda d, m: None,
    ) -> None:
        self.settings = settings
        self.on_routing = on_routing
        self.on_connected = on_connected
        self.on_instances = on_instances
        self._channel: aio.Channel | None = None
        self._stub: engine_pb2_grpc.EngineServiceAsyncStub | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        s = settings
        self._md = (("authorization", f"Bearer {s.token}"),) if s.token else None

    def start(self) -> None:
        """Open the channel, a routing watch per deployment of the ``--instance`` flags and
        an instances watch per ``--deployment``."""
        self._channel = controller_channel(self.settings)
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        for d in self.settings.deployments:
            self.watch(d)
        stub = self._stub
        for w in self.settings.watched:
            request = engine_pb2.GetInstancesRequest(deployment=w.name)
            self._tasks[f"instances/{w.name}"] = asyncio.create_task(
                self._follow(
                    f"instances/{w.name}",
                    functools.partial(stub.WatchInstances, request, metadata=self._md),
                    functools.partial(self.on_instances, w.name),
                ),
                name=f"instances-{w.name}",
            )

    def watch(self, deployment: str) -> None:
        """Follow ``deployment``'s committed routing (no-op when already followed)."""
        if deployment in self._tasks or self._stub is None:
            return
        stub = self._stub
        request = engine_pb2.GetRoutingRequest(
            deployment=deployment, format=engine_pb2.ROUTING_FORMAT_NATIVE
        )
        self._tasks[deployment] = asyncio.create_task(
            self._follow(
                deployment,
                functools.partial(stub.WatchRouting, request, metadata=self._md),
                self.on_routing,
            ),
            name=f"watch-{deployment}",
        )

    def unwatch(self, deployment: str) -> None:
        """Stop following ``deployment``'s routing."""
        task = self._tasks.pop(deployment, None)
        if task is not None:
            task.cancel()

    @property
    def watched_routings(self) -> set[str]:
        return {k for k in self._tasks if not k.startswith("instances/")}

    async def report(self, report: engine_pb2.TrafficReport, timeout_s: float) -> None:
        """Send one traffic report.

        Raises:
            grpc.aio.AioRpcError: the call failed.
        """
        assert self._stub is not None
        await self._stub.ReportTraffic(report, metadata=self._md, timeout=timeout_s)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._channel is not None:
            await self._channel.close(grace=None)

    async def _follow(
        self,
        key: str,
        call: Callable[[], AsyncIterable[Any]],
        on_message: Callable[[Any], None],
    ) -> None:
        """Read the stream ``call()`` opens, handing each message to ``on_message``; reopen
        it with backoff whenever it fails or ends."""
        s = self.settings
        backoff = s.backoff_initial_s
        while True:
            connected = False
            try:
                async for message in call():
                    if not connected:
                        connected = True
                        self.on_connected(key, True)
                    backoff = s.backoff_initial_s
                    on_message(message)
                log.warning("controller watch ended", watch=key)
            except aio.AioRpcError as exc:
                permanent = exc.code() in _PERMANENT
                (log.error if permanent else log.warning)(
                    "controller watch failed; keeping the last state received",
                    watch=key,
                    code=exc.code().name,
                    details=exc.details(),
                    retry_in_s=round(s.backoff_max_s if permanent else backoff, 3),
                )
                if permanent:
                    backoff = s.backoff_max_s
            if connected:
                self.on_connected(key, False)
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, s.backoff_max_s)
