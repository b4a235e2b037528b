"""The operator's hook: a command run after a plan version is staged (``prepare``) or
committed (``commit``), with ``MIXFLEET_HOOK_PHASE`` and the plan's env in its environment,
in its own process group and killed with it on timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

HOOK_PHASES = ("prepare", "commit")


@dataclass(frozen=True)
class HookResult:
    """Outcome of one hook run.

    Attributes:
        ok: exited 0 within the timeout.
        reason: why not (exit code or timeout and the last stderr line); empty when ok.
    """

    ok: bool
    reason: str = ""


def run_hook(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> HookResult:
    """Run ``argv`` with ``env`` added to this process's environment; kill its whole process
    group when it outlives ``timeout_s``."""
    full_env = {**os.environ, **env}
    try:
        proc = subprocess.Popen(
            list(argv),
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        return HookResult(False, f"hook {argv[0]!r} could not start: {exc.strerror or exc}")
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return HookResult(False, f"hook timed out after {timeout_s:g} s")
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        tail = f": {lines[-1][:200]}" if lines else ""
        return HookResult(False, f"hook exited with status {proc.returncode}{tail}")
    return HookResult(True)
