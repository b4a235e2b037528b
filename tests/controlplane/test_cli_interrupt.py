"""Ctrl-C during a solve: ``mixfleetctl plan solve`` with two worker processes, as a real
process group that receives SIGINT the way a terminal sends it (to every process of the
group), before the workers exist, while they start (spawned: still importing) and while
they run (forked). Every time: exit status 130, one ``error: interrupted`` line after the
progress lines, no traceback, and no process of the group left behind.

What is asserted is the output and the processes; no timing. The solve is long enough
(DeepSeek-V3 on 24 GPUs, 60 s limit) that the signal always lands inside it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOLVE = [
    *("plan", "solve", "--fleet", str(REPO / "examples" / "fleets" / "mixed-24.yaml")),
    *("--model", "deepseek-v3", "--tokens", "128", "--load", "synthetic:zipf:0.5:seed=1"),
    *("--time-limit", "60", "--workers", "2"),
]


def _children(pid: int) -> list[tuple[int, str]]:
    """Direct children of ``pid``: (pid, command line)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append((int(entry), cmdline))
    return found


def _group_members(pgid: int) -> list[str]:
    """Command lines of the live processes of group ``pgid`` (zombies, which wait for init
    to reap them, are not counted)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(cmdline)
    return members


def _a_spawned_worker_exists(pid: int) -> bool:
    return any("spawn_main" in cmd for _, cmd in _children(pid))


def _a_forked_worker_exists(pid: int) -> bool:
    # a forked worker carries the parent's command line; the resource tracker does not
    return any("controlplane.cli" in cmd for _, cmd in _children(pid))


def _solving(pid: int) -> bool:
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize(
    ("extra", "ready"),
    [
        pytest.param([], _solving, id="before-workers"),
        pytest.param(["--progress"], _a_spawned_worker_exists, id="spawned-workers-starting"),
        pytest.param([], _a_forked_worker_exists, id="forked-workers-running"),
    ],
)
def test_sigint_during_a_solve_exits_with_one_line(
    extra: list[str], ready: Callable[[int], bool], tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "controlplane.cli", *SOLVE, *extra]
    argv += ["--out", str(tmp_path / "plan.json")]
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a job
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # the solve is under way
        assert first, "the solve printed nothing"
        while not ready(proc.pid):
            assert proc.poll() is None, "the solve ended before the signal"
            time.sleep(0.01)  # poll interval, not a bound
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [line for line in (first + err).splitlines() if line.strip()]
    assert proc.returncode == 130, err
    assert lines[-1] == "error: interrupted", err
    assert sum(line.startswith("error") for line in lines) == 1, err
    assert "Traceback" not in err and "Warning" not in err, err
    assert out == ""
    assert not (tmp_path / "plan.json").exists()
    # the group's workers are gone too (the resource tracker leaves once it sees the CLI
    # exit)
    left = _group_members(proc.pid)
    for _ in range(3000):  # a SIGTERMed worker may still be tearing down: wait, do not time
        if not left:
            break
        time.sleep(0.01)
        left = _group_members(proc.pid)
    assert left == []


def _fail_while_leaving(hold: str) -> int:
    """Exit status of a process whose main thread fails (status 1) while a thread plays the
    Ctrl-C handler: it holds the handler's lock, as ``_leave`` does, and exits 130 half a
    second later (an order of events, not a bound); ``hold`` runs on the main thread's way
    out, as ``main``'s ``finally`` does."""
    code = (
        "import os, sys, time, _thread\n"
        "from controlplane.cli import interrupt\n"
        "held = _thread.allocate_lock(); held.acquire()\n"
        "def leave():\n"
        "    interrupt._LEAVING.acquire(); held.release(); time.sleep(0.5); os._exit(130)\n"
        "_thread.start_new_thread(leave, ())\n"
        "held.acquire()\n"
        "try:\n"
        "    raise SystemExit(1)\n"
        "finally:\n"
        f"    {hold}\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=120).returncode


def test_a_command_that_fails_while_ctrl_c_is_handled_still_exits_130() -> None:
    """The race behind a status 1 seen once: the handler stops the workers, the solve then
    fails in the main thread, and the command returned its own status while the handler was
    still leaving. The CLI's way out waits for the handler: 130 (without that wait, ``pass``
    here, the process ends with 1 before the handler's exit; not asserted: that side is a
    race the half second only makes likely)."""
    assert _fail_while_leaving("interrupt.hold_if_leaving()") == 130


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads /proc (Linux)")
def test_the_resource_tracker_does_not_write_to_the_terminal() -> None:
    """The tracker outlives the CLI by a moment and warns about what an interrupted pool
    left (a CI run once printed two ``UserWarning`` lines after ``error: interrupted``): the
    CLI starts it with its stderr on /dev/null, and its own stderr stays where it was."""
    code = (
        "import os\n"
        "from multiprocessing import resource_tracker\n"
        "from controlplane.cli.interrupt import exit_on_interrupt\n"
        "assert exit_on_interrupt(workers=True)\n"
        "pid = resource_tracker._resource_tracker._pid\n"
        "print(os.readlink(f'/proc/{pid}/fd/2'), os.readlink('/proc/self/fd/2'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    tracker, mine = proc.stdout.split()
    assert tracker == "/dev/null"
    assert mine != "/dev/null"
