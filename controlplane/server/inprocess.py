"""Start a real controller in-process, for tests, demos and benchmarks.

Example::

    async with start_controller(tmp_path, insecure=True) as ctl:
        channel = grpc.aio.insecure_channel(ctl.address)
        ...

The controller listens on 127.0.0.1 on a free port, keeps its state in
``tmp_path / "state.db"`` (SQLite), and is stopped (streams closed, store closed) when the
block exits. ``restart=...`` on the same path reopens the same state, like a real restart.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from controlplane.server.controller import Controller, ControllerSettings
from controlplane.server.services import ServerOptions, TlsFiles, create_server, mark_serving
from controlplane.store.base import Store
from controlplane.store.sqlite import SqliteStore

#: Settings that make tests quick: fast ticks, short timeouts.
FAST = ControllerSettings(
    heartbeat_interval_s=0.2,
    node_lost_after_s=1.5,
    tick_s=0.05,
    retry_after_abort_s=0.5,
    retry_after_error_s=0.5,
    solver_processes=0,
    min_tick_interval_s=0.0,
    contingency_processes=0,
    contingency_max_nodes=0,  # tests that want contingency plans turn them on
    alive_record_s=0.2,
)


@dataclass
class RunningController:
    """A controller started by :func:`start_controller`.

    Attributes:
        address: ``127.0.0.1:PORT`` to connect to.
        port: the bound port.
        controller: the controller (its store, settings, clock).
        server: the gRPC server.
        db_path: the SQLite file (None when the controller runs on another store).
    """

    address: str
    port: int
    controller: Controller
    server: grpc.aio.Server
    db_path: Path | None

    async def crash(self) -> None:
        """Stop serving without closing the store cleanly (what a kill -9 leaves behind is
        the same: SQLite's WAL holds every committed transaction)."""
        await self.server.stop(grace=None)
        await self.controller.stop()


@asynccontextmanager
async def start_controller(
    tmp_path: Path,
    *,
    insecure: bool = True,
    tls: TlsFiles | None = None,
    token_file: Path | None = None,
    settings: ControllerSettings = FAST,
    clock: Callable[[], float] = time.time,
    max_receive_message_bytes: int = 16 << 20,
    port: int = 0,
    run_loop: bool = True,
    store: Store | None = None,
) -> AsyncIterator[RunningController]:
    """Start a controller on a temporary SQLite store (see the module docstring).

    Args:
        tmp_path: directory for ``state.db``.
        insecure: plaintext on loopback (ignored when ``tls`` is given).
        tls: mutual TLS files (from ``mixfleetctl certs init``).
        token_file: bearer tokens.
        settings: controller timing (fast by default).
        clock: time source.
        max_receive_message_bytes: request size limit.
        port: port to bind (0 = any; pass the old port to restart on the same address).
        run_loop: start the reconcile loop (False: tests call ``controller.tick()``).
        store: the store to use instead of ``tmp_path / "state.db"`` (e.g. a
            :class:`~controlplane.store.kubernetes.KubernetesStore`); closed on exit too.
    """
    if store is None:
        store = SqliteStore(Path(tmp_path) / "state.db")
    controller = Controller(store, settings=settings, clock=clock)
    options = ServerOptions(
        tls=tls,
        token_file=token_file,
        insecure=insecure and tls is None,
        max_receive_message_bytes=max_receive_message_bytes,
    )
    server, bound = create_server(f"127.0.0.1:{port}", controller, options)
    await server.start()
    await mark_serving(server)
    if run_loop:
        await controller.start()
    db_path = store.path if isinstance(store, SqliteStore) else None
    running = RunningController(f"127.0.0.1:{bound}", bound, controller, server, db_path)
    try:
        yield running
    finally:
        await server.stop(grace=0.2)
        await controller.stop()
        store.close()
