"""Running the router: one process, or several worker processes on one port.

With ``--workers N`` (N > 1) the first process binds the port with ``SO_REUSEPORT`` and
starts N - 1 more that bind the same port; the kernel spreads new client connections over
them. Each worker is a whole router: it watches the controller itself (every worker gets
every committed routing, so the weights are fanned out to all), checks the engines itself
and keeps its own stride state. The stride rule gives each worker's own requests the
plan's shares to within one request per rank, so the sum over workers is within N
requests per rank of the plan (a test holds the summed shares of two workers to the
plan's). ``/metrics`` and ``/router/status`` answer for the worker that took the
connection. Each worker reports the traffic it measured itself, as ``<reporter>/<i>`` (i = 0
for the first process), so that the controller can add the workers' reports of a window. A
worker whose parent is gone stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
from typing import Any

import structlog

from controlplane.router.settings import RouterSettings
from policies.errors import InputError, MixfleetError

log = structlog.get_logger("mixfleet.router")

#: Seconds between a worker's checks that its parent is still there.
PARENT_CHECK_S = 1.0


def as_worker(settings: RouterSettings, index: int) -> RouterSettings:
    """The settings of worker ``index`` of several: its own traffic reporter name."""
    return dataclasses.replace(settings, reporter=f"{settings.reporter}/{index}")


def use_uvloop(wanted: bool | None) -> None:
    """Run the next event loops on uvloop (``wanted`` None: when installed).

    Raises:
        InputError: ``wanted`` is True and uvloop is not installed.
    """
    if wanted is False:
        return
    try:
        import uvloop
    except ImportError as exc:
        if wanted:
            raise InputError("uvloop is not installed", field="--uvloop") from exc
        return
    uvloop.install()


def _token_counter(settings: RouterSettings) -> Any:
    from controlplane.router.requests import chars_estimate, load_tokenizer

    return load_tokenizer(settings.tokenizer) if settings.tokenizer else chars_estimate


async def _serve(settings: RouterSettings, *, reuse_port: bool, parent: int = 0) -> None:
    """Serve until cancelled (or, with ``parent``, until that process is gone)."""
    from controlplane.router.proxy import Router, tune_gc

    router = Router(settings, _token_counter(settings))
    try:
        await router.start(reuse_port=reuse_port)
    except OSError as exc:
        where = f"{settings.listen_host}:{settings.listen_port}"
        raise MixfleetError(f"cannot listen on {where}: {exc}") from exc
    tune_gc()
    try:
        if parent:
            while os.getppid() == parent:
                await asyncio.sleep(PARENT_CHECK_S)
        else:
            await asyncio.Event().wait()
    finally:
        await router.stop()


def _worker_main(settings: RouterSettings, log_format: str, log_level: str, uv: bool) -> None:
    from controlplane.server.logs import configure_logging

    configure_logging(log_format, log_level)
    use_uvloop(uv)
    parent = os.getppid()
    asyncio.run(_serve(settings, reuse_port=True, parent=parent))


def run(
    settings: RouterSettings,
    *,
    workers: int = 1,
    log_format: str = "json",
    log_level: str = "info",
    uvloop: bool | None = None,
) -> None:
    """Serve with ``workers`` processes (this one included) until interrupted."""
    use_uvloop(uvloop)
    if workers <= 1:
        asyncio.run(_serve(settings, reuse_port=False))
        return

    async def main() -> None:
        from controlplane.router.proxy import Router, tune_gc

        first = Router(as_worker(settings, 0), _token_counter(settings))
        try:
            port = await first.start(reuse_port=True)
        except OSError as exc:
            where = f"{settings.listen_host}:{settings.listen_port}"
            raise MixfleetError(f"cannot listen on {where}: {exc}") from exc
        same_port = dataclasses.replace(settings, listen_port=port)
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(
                target=_worker_main,
                args=(as_worker(same_port, i), log_format, log_level, uvloop is not False),
                name=f"mixfleet-router-worker-{i}",
                daemon=True,
            )
            for i in range(1, workers)
        ]
        for p in procs:
            p.start()
        log.info("router workers started", workers=workers, port=port)
        tune_gc()
        try:
            await asyncio.Event().wait()
        finally:
            for p in procs:
                p.terminate()
            await first.stop()
            for p in procs:
                await asyncio.to_thread(p.join, 10)

    asyncio.run(main())
