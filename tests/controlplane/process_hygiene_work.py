"""Work for a solver worker in tests/controlplane/test_process_hygiene.py (a module, so the
spawned worker can import it)."""

from __future__ import annotations

import os
import subprocess
import sys


def busy_with_child(pidfile: str) -> None:
    """Start a child that sleeps, write ``worker_pid child_pid`` to ``pidfile``, then keep a
    core busy (what a long solve does) until killed."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    tmp = pidfile + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")
    os.replace(tmp, pidfile)
    n = 0
    while True:
        n += 1
