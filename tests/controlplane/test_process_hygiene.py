"""Solver workers die with their controller: a controller process killed with SIGKILL (no
cleanup code runs) leaves no worker, and no process a solve started, behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.waits import hang_guard_s

pytestmark = pytest.mark.skipif(os.name != "posix", reason="process groups and fork are POSIX")

#: The "controller": a solver pool whose one worker runs a busy solve that has started a
#: child of its own (as the ILP's layer processes and a CBC subprocess are).
CONTROLLER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from controlplane.server.solver_pool import SolverPool
    from process_hygiene_work import busy_with_child

    pool = SolverPool(1)
    future = pool._executor().submit(busy_with_child, {pidfile!r})
    while True:
        time.sleep(1)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead, only not yet reaped
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state != "Z"


def _wait_for(pred: object, timeout_s: float) -> bool:
    """Whether ``pred()`` came true within ``timeout_s`` (at least the hang guard)."""
    deadline = time.monotonic() + hang_guard_s(timeout_s)
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_sigkill_of_the_controller_leaves_no_solver_worker(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    script = CONTROLLER.format(tests=str(Path(__file__).parent), pidfile=str(pidfile))
    ctl = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    try:
        assert _wait_for(lambda: pidfile.exists() and len(pidfile.read_text().split()) == 2, 60), (
            "the worker never started its solve"
        )
        worker, child = (int(x) for x in pidfile.read_text().split())
        assert worker != ctl.pid and _alive(worker) and _alive(child)
        time.sleep(0.3)  # the solve is busy
        assert _alive(worker) and _alive(child)
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        assert _wait_for(lambda: not _alive(worker), 5.0), "the worker outlived its controller"
        assert _wait_for(lambda: not _alive(child), 5.0), "the solve's child outlived it"
    finally:
        if ctl.poll() is None:
            ctl.kill()
        if pidfile.exists():
            for pid in (int(x) for x in pidfile.read_text().split()):
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)


def test_a_closed_pool_stops_its_workers() -> None:
    from controlplane.server.solver_pool import SolverPool

    pool = SolverPool(1)
    pool.warm_up()
    assert _wait_for(lambda: bool(pool.worker_pids()), 30)
    pids = pool.worker_pids()
    pool.close()
    assert _wait_for(lambda: not any(_alive(p) for p in pids), 10)


def test_a_solve_over_its_time_bound_is_stopped_and_the_pool_recovers() -> None:
    import asyncio

    from agent_fakes import small_fleet_doc

    from controlplane.errors import PreconditionError
    from controlplane.server.solver_pool import SolverPool
    from policies.hardware.fleet import parse_fleet
    from policies.spec.build import DeploymentSpec, build_request

    nic = [{"count": 8, "per_direction_gbits_per_s": 400, "fabric": "ib0"}]
    nodes = [
        {"name": f"n{i}", "gpus": [{"model": "H100-SXM5-80GB", "count": 8}], "nics": nic}
        for i in range(1000)
    ]
    big = parse_fleet({"metadata": {"name": "big"}, "spec": {"nodes": nodes}})  # 8,000 GPUs
    spec = DeploymentSpec(name="s", model="mixtral-8x7b", policy="uniform")

    async def main() -> None:
        pool = SolverPool(1)
        try:
            with pytest.raises(PreconditionError, match="ran over 1 s and was stopped"):
                await pool.solve(build_request(spec, big), timeout_s=1.0)
            small = parse_fleet(small_fleet_doc())
            result = await pool.solve(build_request(spec, small), timeout_s=60.0)
            assert result.plan is not None and len(result.plan.gpus) == 6
        finally:
            pool.close()

    asyncio.run(main())
