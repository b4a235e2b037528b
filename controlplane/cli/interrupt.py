"""Ctrl-C ends a ``mixfleetctl`` command with one line, ``error: interrupted``, and exit
status 130, also while a solve's worker processes start or run.

A terminal sends SIGINT to every process of the foreground group: the CLI and each solver
worker. Left to Python, every worker (forked, or spawned and still importing) raises
``KeyboardInterrupt`` and prints its own traceback, and the parent's process pool may print
more while it shuts down. So :func:`exit_on_interrupt`, before any worker exists, sets
SIGINT to be ignored and blocks it in the main thread: a worker inherits both (an ignored
signal stays ignored across ``exec``, and Python then leaves it so) and never sees it. The
CLI itself still receives it: a blocked signal is kept pending even when ignored, and a
thread waits for it with ``sigwait``, prints the line, stops the workers (SIGTERM: no
Python handler, no traceback), releases their semaphores and leaves at once, even while the
main thread is inside the solver's C code.

Two details keep that true. multiprocessing's resource tracker (started before the first
spawned worker) unblocks SIGINT in the thread that starts it, so a command that may start
workers starts the tracker first (its stderr on /dev/null: its warnings about what an
interrupted pool left are not the user's). And the waiting thread is a bare ``_thread`` one, not
counted by ``threading.active_count()``: it holds no lock while it waits, so the solver
still forks its workers when no other thread runs (it spawns them in a threaded process).

Commands that handle signals themselves (``controller run``, ``router run``: a graceful
stop) are not switched over; see :data:`OWN_SIGNALS`.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import os
import signal
import sys
import threading

EXIT_INTERRUPTED = 130

#: ``(group, command)`` of the commands that stop gracefully on SIGINT on their own.
OWN_SIGNALS = frozenset({("controller", "run"), ("router", "run")})


def handles_its_own_signals(args: argparse.Namespace) -> bool:
    """Whether the parsed command is one of :data:`OWN_SIGNALS`."""
    group = getattr(args, "command", None)
    sub = getattr(args, f"{group}_command", None) if group else None
    return (group, sub) in OWN_SIGNALS


def _children() -> set[int]:
    """Process ids of this process's children: multiprocessing's, and on Linux every direct
    child (one forked a moment ago is not yet multiprocessing's)."""
    import multiprocessing

    pids = {p.pid for p in multiprocessing.active_children() if p.pid is not None}
    me = os.getpid()
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(f"/proc/{entry.name}/stat", "rb") as f:
                        ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
                    if ppid == me:
                        pids.add(int(entry.name))
    return pids


def _stop_children() -> None:
    """SIGTERM every child: workers die without a word (they have no handler for it); the
    resource tracker ignores it and unlinks what is left once this process is gone."""
    for pid in _children():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


#: Held by the thread that leaves (:func:`_leave`) from its first step to its ``os._exit``:
#: the main thread must not end the process first (:func:`hold_if_leaving`).
_LEAVING = _thread.allocate_lock()


def hold_if_leaving() -> None:
    """Called by the CLI on its way out: while a Ctrl-C is being handled, wait for it to end
    the process with 130. Stopping the workers makes the solve fail in the main thread,
    which would otherwise return its own error status (1) before the exit below ran."""
    if _LEAVING.locked():
        _LEAVING.acquire()  # never released: the leaving thread ends the process


def _leave() -> None:
    """Print the one line, silence this process, stop the worker processes, exit 130."""
    _LEAVING.acquire()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.write("error: interrupted\n")
        sys.stderr.flush()
    # The main thread runs on until the exit below: whatever it would print now (the pool
    # breaking under it) is not for the user.
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    _stop_children()
    _stop_children()  # and any the main thread started meanwhile
    import multiprocessing.util

    with contextlib.suppress(Exception):  # unlink the pool's semaphores, as exit would
        multiprocessing.util._run_finalizers(0)  # type: ignore[attr-defined]
    os._exit(EXIT_INTERRUPTED)


def _wait_and_leave() -> None:
    signal.sigwait({signal.SIGINT})
    _leave()


def _start_quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker with its stderr on /dev/null. It outlives
    this process by a moment and unlinks what a worker pool left behind; a Ctrl-C while the
    pool's semaphores are being created leaves one it then warns about on the terminal
    after ``error: interrupted`` (two ``UserWarning`` lines, nothing the user can act on).
    The tracker takes the stderr it is started with (Python 3.11-3.13:
    ``resource_tracker.ensure_running`` passes ``sys.stderr``'s descriptor), so that is
    /dev/null for the moment it starts."""
    from multiprocessing import resource_tracker

    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(devnull, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def exit_on_interrupt(*, workers: bool) -> bool:
    """From now on, SIGINT prints ``error: interrupted`` and exits 130 (module docstring);
    ``workers``: the command may start worker processes. Call it from the main thread
    before any worker process or other thread starts; returns False (and changes nothing)
    where that is not possible (not the main thread, no ``pthread_sigmask``, SIGINT already
    ignored as in a background job)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if not hasattr(signal, "pthread_sigmask") or not hasattr(signal, "sigwait"):
        return False
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background (&)
        return False
    if workers:
        _start_quiet_resource_tracker()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _thread.start_new_thread(_wait_and_leave, ())
    return True
