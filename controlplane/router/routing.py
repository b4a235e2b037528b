"""Live weights from the controller: one ``EngineService.WatchRouting`` stream per
deployment, reopened with exponential backoff (and jitter) whenever it fails or ends.

While the controller is unreachable the router keeps the last committed weights it
received; a deployment it never heard of keeps its instances unroutable (no weights).
A new version is handed to ``on_routing`` as soon as its message arrives: weights are read
at the next choice, so streams already open are not touched.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

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
    """Watches the committed routing of each deployment (module docstring).

    Args:
        settings: controller address, credentials, backoff.
        on_routing: called with every Routing message received.
        on_connected: called with (deployment, connected) when a watch opens or drops.
    """

    def __init__(
        self,
        settings: RouterSettings,
        on_routing: Callable[[engine_pb2.Routing], None],
        on_connected: Callable[[str, bool], None],
    ) -> None:
        self.settings = settings
        self.on_routing = on_routing
        self.on_connected = on_connected
        self._channel: aio.Channel | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Open the channel and one watch task per deployment."""
        self._channel = controller_channel(self.settings)
        stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        for d in self.settings.deployments:
            self._tasks.append(asyncio.create_task(self._watch(stub, d), name=f"watch-{d}"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._channel is not None:
            await self._channel.close(grace=None)

    async def _watch(self, stub: engine_pb2_grpc.EngineServiceAsyncStub, deployment: str) -> None:
        s = self.settings
        md = (("authorization", f"Bearer {s.token}"),) if s.token else None
        backoff = s.backoff_initial_s
        request = engine_pb2.GetRoutingRequest(
            deployment=deployment, format=engine_pb2.ROUTING_FORMAT_NATIVE
        )
        while True:
            connected = False
            try:
                async for routing in stub.WatchRouting(request, metadata=md):
                    if not connected:
                        connected = True
                        self.on_connected(deployment, True)
                    backoff = s.backoff_initial_s
                    self.on_routing(routing)
                log.warning("routing watch ended", deployment=deployment)
            except aio.AioRpcError as exc:
                permanent = exc.code() in _PERMANENT
                (log.error if permanent else log.warning)(
                    "routing watch failed; keeping the last committed weights",
                    deployment=deployment,
                    code=exc.code().name,
                    details=exc.details(),
                    retry_in_s=round(s.backoff_max_s if permanent else backoff, 3),
                )
                if permanent:
                    backoff = s.backoff_max_s
            if connected:
                self.on_connected(deployment, False)
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, s.backoff_max_s)
