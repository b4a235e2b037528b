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

Workers die with their controller, also when it is killed with SIGKILL (no cleanup code of
the controller runs then). Each worker, as it starts (:func:`_guard_worker`):

* becomes the leader of its own process group, so everything a solve starts (the ILP's layer
  processes, a CBC subprocess) is in that group;
* forks a tiny reaper that waits on two pipes: the controller's end of the worker's start-up
  pipe (``multiprocessing``'s parent sentinel: readable once the controller is gone) and its
  own parent, the worker. When either goes away it kills the whole group with SIGKILL. This
  is the portable fallback, and the only guard for the worker's own children; it is a
  process rather than a thread in the worker so the worker stays single-threaded (the ILP
  forks its layer processes only from a single-threaded process);
* on Linux, asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``):
  the worker stops at once, mid-solve, and its reaper then clears the group. The kernel
  signals on the death of the parent *thread* that spawned the worker, so a pool is only
  used from one long-lived thread (the controller's event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import os
import select
import signal
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from controlplane.errors import PreconditionError
from policies.request import PlacementRequest, PlacementResult
from policies.solve import solve
from policies.solvers.milp import work_only

#: ``PR_SET_PDEATHSIG`` of ``<linux/prctl.h>``.
_PR_SET_PDEATHSIG = 1
#: How often the reaper checks that its worker is alive, s.
_REAPER_POLL_S = 0.2


def _guard_worker(parent_pid: int, parent_death_signal: bool, nice: int) -> None:
    """Initializer of every solver worker (see the module docstring).

    Args:
        parent_pid: the controller's pid.
        parent_death_signal: ask the kernel for SIGKILL when the controller dies (the pool
            was started from the controller's main thread).
        nice: scheduling niceness to add (background solves yield the CPU).
    """
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None) if parent is not None else None
    _start_reaper(sentinel if isinstance(sentinel, int) else None)
    if parent_death_signal and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the controller died before the guard was in place
        os._exit(1)


def _start_reaper(controller_sentinel: int | None) -> None:
    """Fork the worker's reaper: it kills the worker's process group (the worker, whatever
    the worker started, and itself) once the controller or the worker is gone."""
    worker = os.getpid()
    if os.fork() != 0:
        return
    try:  # the reaper: only system calls from here on
        watched = [controller_sentinel] if controller_sentinel is not None else []
        while os.getppid() == worker:
            ready, _, _ = select.select(watched, [], [], _REAPER_POLL_S)
            if ready:
                break
        os.killpg(worker, signal.SIGKILL)
    finally:
        os._exit(0)


def _warm() -> int:
    """Run in a fresh worker: import the planning core and its solvers before the first
    real solve needs them."""
    import policies.solvers.ilp  # noqa: F401  (import cost is the point)

    return 0


class SolverPool:
    """Solves :class:`PlacementRequest` s away from the caller's event loop.

    Use a pool from one thread (the event loop's): its workers are started from there.

    Args:
        processes: worker processes (solves that can run at once); 0 = a thread of this
            process instead.
        nice: niceness the workers add to their own (background solves: 10).
    """

    def __init__(self, processes: int = 1, *, nice: int = 0) -> None:
        if processes < 0:
            raise ValueError(f"processes must be >= 0, got {processes}")
        self.processes = processes
        self.nice = nice
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            main = threading.current_thread() is threading.main_thread()
            self._pool = ProcessPoolExecutor(
                max_workers=self.processes,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_guard_worker,
                initargs=(os.getpid(), main, self.nice),
            )
        return self._pool

    def worker_pids(self) -> list[int]:
        """Process ids of the running workers (none before the first solve or warm-up)."""
        pool = self._pool
        procs: dict[Any, Any] = dict(getattr(pool, "_processes", None) or {}) if pool else {}
        return [int(pid) for pid in procs]

    def warm_up(self) -> None:
        """Start the workers now (in the background) so the first solve does not wait for
        them. Nothing to do for ``processes=0``."""
        if self.processes > 0:
            pool = self._executor()
            for _ in range(self.processes):
                pool.submit(_warm)

    async def solve(
        self, request: PlacementRequest, *, timeout_s: float | None = None
    ) -> PlacementResult:
        """``policies.solve.solve(request)`` in a worker; the caller's loop keeps running.

        A cancelled call stops waiting; a solve already running in a worker finishes there
        and its result is dropped.

        Args:
            timeout_s: stop the solve after this long, s (the workers are killed and
                replaced; with ``processes=0`` the thread runs on, its result dropped).

        Raises:
            Whatever :func:`policies.solve.solve` raises (InputError ...), re-raised here;
            InfeasibleError when the policy found no placement (``require_placed``);
            PreconditionError when it ran over ``timeout_s``;
            ``concurrent.futures.process.BrokenProcessPool`` when a worker died (the pool is
            replaced for the next call).
        """
        if self.processes == 0:
            work: Any = asyncio.to_thread(solve, request)
            return (await _bounded(work, timeout_s, self._stop_nothing)).require_placed()
        loop = asyncio.get_running_loop()
        pool = self._executor()
        try:
            work = loop.run_in_executor(pool, solve, request)
            return (await _bounded(work, timeout_s, self.close)).require_placed()
        except Exception as exc:
            if type(exc).__name__ == "BrokenProcessPool":
                self._discard(pool)
            raise

    def _stop_nothing(self) -> None:
        """A thread cannot be stopped: its result is dropped when it ends."""

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


def background_timeout_s(solver_time_limit_s: float) -> float | None:
    """How long a background solve (a contingency plan, a dry run) may run before it is
    stopped: twice the spec's solver time limit and 30 s, s. None (no limit) where the
    solvers run on work limits alone (:func:`policies.solvers.milp.work_only`, set by the
    test suite): there a solve takes as long as its work takes, and a busy machine must not
    turn that into a failure."""
    return None if work_only() else 2.0 * solver_time_limit_s + 30.0


async def _bounded(work: Any, timeout_s: float | None, stop: Any) -> PlacementResult:
    """Await ``work`` for at most ``timeout_s`` (None: no limit); on time out call ``stop()``.

    Raises:
        PreconditionError: it ran over ``timeout_s``.
    """
    if timeout_s is None:
        result: PlacementResult = await work
        return result
    try:
        result = await asyncio.wait_for(work, timeout_s)
    except TimeoutError:
        stop()
        raise PreconditionError(
            f"the solve ran over {timeout_s:.0f} s and was stopped. To fix: a smaller fleet or "
            "model, or a lower solverTimeLimitS",
            field="spec.solver_time_limit_s",
        ) from None
    return result
