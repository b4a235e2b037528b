"""The controller under load: solves in a worker process, a stalled event loop does not
make healthy nodes look lost, and a burst of acks is stored in few transactions."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path

from agent_fakes import small_inventories, wait_until
from test_rollout import run, world

from controlplane.server.inprocess import FAST, start_controller


def test_solves_run_in_a_worker_process_and_the_rollout_commits(tmp_path: Path) -> None:
    async def main() -> None:
        async with world(tmp_path, settings=replace(FAST, solver_processes=1)) as w:
            await w.apply()
            await wait_until(lambda: w.committed() == 1, timeout_s=120, what="v1 committed")
            pool = w.ctl.controller.solver._pool
            assert pool is not None
            workers = list(getattr(pool, "_processes", {}).values())
            assert workers and all(p.pid != os.getpid() and p.is_alive() for p in workers)
            stored = w.ctl.controller.store.get_plan("mx", 1)
            assert stored is not None and stored.plan is not None
            assert stored.plan.summary.step_time_us > 0
        assert w.ctl.controller.solver._pool is None  # stopped with the controller

    run(main())


def test_a_stalled_controller_does_not_declare_its_nodes_lost(tmp_path: Path) -> None:
    settings = replace(FAST, node_lost_after_s=1.0)

    async def main() -> None:
        async with start_controller(tmp_path, settings=settings) as ctl:
            c = ctl.controller
            await asyncio.sleep(0.2)  # the reconcile loop is ticking
            for inv in small_inventories(2):
                c.register(inv)
            time.sleep(1.6)  # the event loop cannot run: heartbeats would wait unread
            await asyncio.sleep(0.3)
            assert c.metrics.loop_stall_seconds._value.get() > 1.0
            assert {v.health for v in c.node_views()} == {"ready"}
            assert not c.nodes.lost
            # Real silence still counts: nobody heartbeats from here on.
            await wait_until(
                lambda: {v.health for v in c.node_views()} == {"lost"}, what="nodes lost"
            )

    run(main())


def test_acks_of_a_rollout_are_written_in_batches(tmp_path: Path) -> None:
    async def main() -> None:
        async with world(tmp_path, nodes=4) as w:
            store = w.ctl.controller.store
            calls: list[int] = []
            original = store.record_acks

            def counting(acks):  # type: ignore[no-untyped-def]
                calls.append(len(acks))
                return original(acks)

            store.record_acks = counting  # type: ignore[method-assign]
            await w.apply()
            await wait_until(lambda: w.committed() == 1, what="v1 committed")
            await wait_until(
                lambda: set(w.ctl.controller.acks_of("mx", 1).values()) == {"committed"},
                what="COMMITTED acks",
            )
            assert sum(calls) == 8  # 4 nodes x (prepared, committed), each stored once
            assert len(store.acks("mx", 1)) == 8

    run(main())
