"""Health probes and leader election of ``mixfleetctl controller run``.

``--health-listen HOST:PORT`` serves the standard gRPC health service in plaintext (the
kubelet's ``grpc:`` probes carry no client certificate), next to the mutual-TLS API:

=============================  ==========================================================
service                        SERVING when
=============================  ==========================================================
``liveness``                   the process's event loop answers (it is up, leading or not)
``""`` (readiness)             this replica serves the API: it leads (with
                               ``--leader-elect``) and its gRPC server is started
``mixfleet.controller.Leader``  it holds the Lease
=============================  ==========================================================

``--leader-elect`` (Kubernetes store only) runs :class:`apis.kube.leader.LeaderElector` - the
implementation the operator uses - on the Lease ``--lease-name`` in ``--lease-namespace``
before the controller reads any state: a standby neither reads nor listens. Once it leads,
every write of the store checks the lease (:meth:`KubernetesStore.guard_writes`), so a
replica on a partitioned node that cannot renew stops writing before the lease expires
for anyone else. Losing the lease ends the process with status 1 (the kubelet restarts it
as a standby), as client-go's ``OnStoppedLeading`` does; a clean stop releases the lease
so the next replica takes over at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import uuid
from typing import TYPE_CHECKING, Any

from apis.cliargs import positive_float
from policies.errors import InputError

if TYPE_CHECKING:  # asyncio is imported when the controller runs, not for --help
    import asyncio

LEADER_SERVICE = "mixfleet.controller.Leader"


def add_ha_arguments(p: argparse.ArgumentParser) -> None:
    """The health and leader-election options of ``controller run``."""
    p.add_argument(
        "--health-listen",
        metavar="HOST:PORT",
        help="plaintext gRPC health service for the kubelet's probes (default: none)",
    )
    p.add_argument(
        "--leader-elect",
        action="store_true",
        help="lead on a Lease before serving (Kubernetes store only)",
    )
    p.add_argument(
        "--lease-name", default="mixfleet-controller", help="Lease name (default %(default)s)"
    )
    p.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE", ""),
        help="namespace of the Lease (default $POD_NAMESPACE, else the store's namespace)",
    )
    p.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}",
        help="this replica's id in the Lease (default $POD_NAME, else host name and a "
        "random suffix: two processes on one host must not share it)",
    )
    for flag, default, what in (
        ("--lease-duration-s", 15.0, "a lease not renewed for this long is free"),
        ("--renew-deadline-s", 10.0, "a leader that cannot renew for this long steps down"),
        ("--retry-period-s", 2.0, "time between two election attempts"),
    ):
        p.add_argument(
            flag,
            type=positive_float,
            default=default,
            metavar="S",
            help=f"{what}, s (default {default})",
        )


class HighAvailability:
    """The probes and (with ``--leader-elect``) the election of one controller process.

    Use :meth:`start`, then :meth:`serving` once the API is up, :meth:`until` to wait for a
    stop or the loss of the lease, and :meth:`close` after the last write.
    """

    def __init__(self, probes: Any, health: Any, elector: Any) -> None:
        import asyncio

        self._probes = probes  # grpc.aio.Server or None
        self._health = health  # its HealthServicer or None
        self.elector = elector  # LeaderElector or None
        self.lost = asyncio.Event()
        self.stopped = False
        self._closing = False

    @classmethod
    async def start(cls, args: argparse.Namespace, store: Any) -> HighAvailability:
        """Start the probes; with ``--leader-elect`` wait until this replica leads (or a
        SIGINT/SIGTERM arrives first: then :attr:`stopped` is True).

        Raises:
            InputError: ``--leader-elect`` without the Kubernetes store, bad lease timing,
                or the health address cannot be bound.
        """
        probes = health = None
        if args.health_listen:
            probes, health = await _start_probes(args.health_listen)
        ha = cls(probes, health, None)
        if args.leader_elect:
            await ha._lead(args, store)
        return ha

    async def _lead(self, args: argparse.Namespace, store: Any) -> None:
        import asyncio

        from apis.kube.client import Kube
        from apis.kube.leader import LeaderElector, LeaderSettings
        from controlplane.store.kubernetes import KubernetesStore

        if not isinstance(store, KubernetesStore):
            raise InputError(
                "--leader-elect needs --store kubernetes:NAMESPACE (the Lease lives in the "
                "cluster). To fix: drop --leader-elect; a SQLite store is one process's file",
                field="--leader-elect",
            )
        loop = asyncio.get_running_loop()
        leading = asyncio.Event()

        def started_leading() -> None:
            loop.call_soon_threadsafe(leading.set)

        def stopped_leading() -> None:
            if not self._closing:
                loop.call_soon_threadsafe(self.lost.set)

        settings = LeaderSettings(
            lease_name=args.lease_name,
            namespace=args.lease_namespace or store.namespace,
            identity=args.identity,
            lease_duration_s=args.lease_duration_s,
            renew_deadline_s=args.renew_deadline_s,
            retry_period_s=args.retry_period_s,
        )
        self.elector = LeaderElector(
            Kube(store.api_client, field_manager="mixfleet-controller-lease"),
            settings,
            on_started_leading=started_leading,
            on_stopped_leading=stopped_leading,
        )
        store.guard_writes(self.elector.is_leader)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        self.elector.start()
        waits = [asyncio.ensure_future(e.wait()) for e in (leading, stop)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        self.stopped = stop.is_set() and not leading.is_set()
        if leading.is_set():
            await self._set(LEADER_SERVICE, True)

    async def serving(self) -> None:
        """The API is up on this replica: ready."""
        await self._set("", True)

    async def until(self, stop: asyncio.Event) -> int:
        """Wait for ``stop`` (returns 0) or the loss of the lease (returns 1)."""
        import asyncio

        waits = [asyncio.ensure_future(e.wait()) for e in (stop, self.lost)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if self.lost.is_set() and not stop.is_set():
            await self._set("", False)
            await self._set(LEADER_SERVICE, False)
            return 1
        return 0

    async def close(self) -> None:
        """Release the lease (after the controller's last write) and stop the probes."""
        import asyncio

        self._closing = True
        await self._set("", False)
        if self.elector is not None:
            await asyncio.to_thread(self.elector.stop)
        await self._set(LEADER_SERVICE, False)
        if self._probes is not None:
            await self._probes.stop(grace=0.5)

    async def _set(self, service: str, up: bool) -> None:
        if self._health is None:
            return
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse
        await self._health.set(service, status.SERVING if up else status.NOT_SERVING)


async def _start_probes(address: str) -> tuple[Any, Any]:
    """A plaintext gRPC server with only the health service: liveness SERVING, readiness
    and leadership NOT_SERVING until :class:`HighAvailability` says otherwise.

    Raises:
        InputError: the address cannot be bound.
    """
    import grpc
    from grpc_health.v1 import _async as health_aio
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = grpc.aio.server()
    servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        bound, why = 0, str(exc)
    else:
        why = "the address is in use or not local"
    if not bound:
        raise InputError(
            f"cannot listen on {address!r}: {why}. To fix: pick a free HOST:PORT",
            field="--health-listen",
        )
    await server.start()
    status = health_pb2.HealthCheckResponse
    await servicer.set("liveness", status.SERVING)
    await servicer.set("", status.NOT_SERVING)
    await servicer.set(LEADER_SERVICE, status.NOT_SERVING)
    return server, servicer
