"""Planning-core solves off the controller's event loop.

A solve is CPU-bound Python (the cost model, the ILP's model building, the greedy and
realisation stages). Run in a thread of the controller process it holds the GIL for most of
its time, and every heartbeat, ack and stream write waits behind it: on a 2-core machine with
2,000 agents heartbeat p99 rose from milliseconds to seconds during a solve. A
:class:`SolverPool` runs each solve in a separate worker process instead (spawned, so the
gRPC threads of the controller are never forked), kept warm between solves so only the
first pays the interpreter and import start-up. The ILP fans its layers out to its own
processes from inside the worker, as it does from the command line.

``processes=0`` keeps the old behaviour (a thread of this process): quicker to start, for
tests and tiny fleets.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from policies.request import PlacementRequest, PlacementResult
from policies.solve import solve


def _warm() -> int:
    """Run in a fresh worker: import the planning core and its solvers before the first
    real solve needs them."""
    import policies.solvers.ilp  # noqa: F401  (import cost is the point)

    return 0


class SolverPool:
    """Solves :class:`PlacementRequest` s away from the caller's event loop.

    Args:
        processes: worker processes (solves that can run at once); 0 = a thread of this
            process instead.
    """

    def __init__(self, processes: int = 1) -> None:
        if processes < 0:
            raise ValueError(f"processes must be >= 0, got {processes}")
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.processes, mp_context=multiprocessing.get_context("spawn")
            )
        return self._pool

    def warm_up(self) -> None:
        """Start the workers now (in the background) so the first solve does not wait for
        them. Nothing to do for ``processes=0``."""
        if self.processes > 0:
            pool = self._executor()
            for _ in range(self.processes):
                pool.submit(_warm)

    async def solve(self, request: PlacementRequest) -> PlacementResult:
        """``policies.solve.solve(request)`` in a worker; the caller's loop keeps running.

        A cancelled call stops waiting; a solve already running in a worker finishes there
        and its result is dropped.

        Raises:
            Whatever :func:`policies.solve.solve` raises (InputError ...), re-raised here;
            InfeasibleError when the policy found no placement (``require_placed``); ``concurrent.futures.process.BrokenProcessPool`` when a worker
            died (the pool is replaced for the next call).
        """
        if self.processes == 0:
            return (await asyncio.to_thread(solve, request)).require_placed()
        loop = asyncio.get_running_loop()
        pool = self._executor()
        try:
            return (await loop.run_in_executor(pool, solve, request)).require_placed()
        except Exception as exc:
            if type(exc).__name__ == "BrokenProcessPool":
                self._discard(pool)
            raise

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        if self._pool is pool:
            self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the workers, also any solve still running in one (its result is not wanted:
        the controller is stopping)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        processes: dict[Any, Any] = dict(getattr(pool, "_processes", None) or {})
        pool.shutdown(wait=False, cancel_futures=True)
        for p in processes.values():
            with contextlib.suppress(Exception):
                p.terminate()
        for p in processes.values():
            with contextlib.suppress(Exception):
                p.join(timeout=5.0)
