"""The controller after restarts, replaced stores and damaged rows: it never removes what it
has no record of, gives agents the time it was down to reconnect, re-plans around a damaged
committed plan, deletes junk nodes only when they serve nothing, and a tick's cost follows
what changed, not the number of deployments."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from agent_fakes import small_inventories, wait_until
from mixfleet.v1 import plan_pb2
from test_cli_remote import cli
from test_cli_remote import controller as cli_controller  # noqa: F401  (a fixture)
from test_rollout import SPEC, run, world

from controlplane.errors import NotFoundError, PreconditionError
from controlplane.server import reconcile as rc
from controlplane.server.controller import AssignmentEvent, Controller
from controlplane.server.inprocess import FAST, RunningController, start_controller
from controlplane.store.sqlite import SqliteStore
from policies.errors import MixfleetError


async def _first_events(stream: AsyncIterator[AssignmentEvent]) -> list[AssignmentEvent]:
    """What a newly opened assignment stream sends before it waits."""
    out: list[AssignmentEvent] = []
    while True:
        try:
            out.append(await asyncio.wait_for(anext(stream), 0.3))
        except TimeoutError:
            return out


# ----------------------------------------------------------------------------- never remove


def test_a_name_the_store_never_held_is_reported_not_removed(tmp_path: Path) -> None:
    async def main() -> None:
        async with start_controller(tmp_path, run_loop=False) as ctl:
            c = ctl.controller
            c.apply_deployment(replace(SPEC, name="gone"))
            c.delete_deployment("gone")  # a tombstone
            inv = small_inventories(1)[0]
            reg = c.register(inv)
            # The agent runs "mx" from another store (this one is new), and "gone".
            assert c.heartbeat(inv.node, reg.session_id, applied={"mx": 4, "gone": 1})
            events = await _first_events(c.watch_assignments(inv.node, reg.session_id))
            assert [(e.deployment, e.phase) for e in events] == [("gone", "remove")]
            (view,) = c.node_views()
            assert view.unknown_deployments == ("mx",)
            # The agent drops it on its own: the report goes away.
            assert c.heartbeat(inv.node, reg.session_id, applied={})
            assert c.node_views()[0].unknown_deployments == ()
            # A live node serving nothing is not deleted either: its agent would be back.
            with pytest.raises(PreconditionError, match="heartbeated 0 s ago"):
                c.delete_node(inv.node)

    run(main())


def test_a_replaced_store_leaves_the_agents_plans_running(tmp_path: Path) -> None:
    async def main() -> None:
        async with world(tmp_path / "a", nodes=2) as w:
            await w.apply()
            await wait_until(lambda: all("mx" in a.applied for a in w.agents), what="applied")
            agents = w.agents
            port = w.ctl.port
            await w.ctl.crash()
        # The controller comes back on a new, empty store (a mistyped --store, a lost disk).
        async with start_controller(tmp_path / "b", port=port) as ctl2:
            for a in agents:
                await a.start()  # the same agents, still running their plans
            await wait_until(
                lambda: (
                    all(n.unknown_deployments == ("mx",) for n in ctl2.controller.node_views())
                    and len(ctl2.controller.node_views()) == 2
                ),
                what="unknown deployment reported",
            )
            for a in agents:
                await a.register()  # a new session: the stream reopens with the snapshot
            await asyncio.sleep(0.5)
            assert all(a.applied["mx"][0] == 1 for a in agents)
            assert not any(e[0] == "remove" for a in agents for e in a.events)
            async with grpc.aio.insecure_channel(ctl2.address) as ch:
                from mixfleet.v1 import plan_pb2_grpc

                stub = plan_pb2_grpc.PlanServiceStub(ch)
                node = await stub.GetNode(plan_pb2.GetNodeRequest(name="n0"))
                assert list(node.unknown_deployments) == ["mx"]
            for a in agents:
                await a.stop()

    run(main())


# ----------------------------------------------------------------------------- restart grace


def test_a_restarted_controller_gives_agents_the_time_it_was_down(tmp_path: Path) -> None:
    settings = replace(FAST, node_lost_after_s=10.0, restart_grace_max_s=30.0, alive_record_s=1.0)
    now = [1000.0]
    store = SqliteStore(tmp_path / "g.db")
    c = Controller(store, settings=settings, clock=lambda: now[0])
    c.register(small_inventories(1)[0])
    c.tick()  # records the controller alive at 1000
    assert store.last_alive_s() == 1000.0
    now[0] = 1060.0  # down for 60 s: agents backed off meanwhile
    c2 = Controller(store, settings=settings, clock=lambda: now[0])
    now[0] = 1085.0  # 25 s after the restart: without the grace it would be lost at 1070
    c2.tick()
    assert c2.node_views()[0].health == "ready" and not c2.nodes.lost
    now[0] = 1060.0 + 30.0 + 10.0 + 0.5  # grace (capped at 30 s) + node_lost_after_s
    actions = c2.tick()
    assert [a for a in actions if isinstance(a, rc.SetNodeLost)] == [
        rc.SetNodeLost("n0", True, "no heartbeat for 10 s")
    ]
    store.close()


# ----------------------------------------------------------------------------- damaged rows


def test_a_damaged_committed_plan_is_replanned_not_removed(tmp_path: Path) -> None:
    async def main() -> None:
        async with world(tmp_path, nodes=2) as w:
            await w.apply()
            await wait_until(lambda: all("mx" in a.applied for a in w.agents), what="applied")
            agents, port, path = w.agents, w.ctl.port, w.ctl.db_path
            await w.ctl.crash()
            w.ctl.controller.store.close()
        assert path is not None
        db = sqlite3.connect(path)
        db.execute("UPDATE plans SET plan_json = '{\"broken' WHERE version = 1")
        db.commit()
        db.close()
        async with start_controller(tmp_path, port=port) as ctl2:
            c = ctl2.controller
            for a in agents:
                await a.start()

            def committed() -> int | None:
                d = c.store.get_deployment("mx")
                return d.committed_version if d is not None else None

            await wait_until(lambda: committed() == 2, what="re-planned")
            record = c.store.get_plan("mx", 2)
            assert record is not None
            assert record.reason == "committed plan v1 cannot be read from the store"
            await wait_until(lambda: all(a.applied["mx"][0] == 2 for a in agents), what="v2")
            assert not any(e[0] == "remove" for a in agents for e in a.events)
            d = c.store.get_deployment("mx")
            assert d is not None
            assert any("StoreRowQuarantined: plans mx/1" in x for x in d.status["conditions"])
            for a in agents:
                await a.stop()

    run(main())


# ----------------------------------------------------------------------------- nodes delete


def test_nodes_delete_refuses_a_serving_node_and_removes_junk(tmp_path: Path) -> None:
    async def main() -> None:
        async with world(tmp_path, nodes=3) as w:
            c = w.ctl.controller
            await w.apply()
            await wait_until(lambda: w.committed() == 1, what="v1")
            with pytest.raises(PreconditionError, match="node n2 is in use: it serves mx"):
                c.delete_node("n2")
            await w.agents[2].stop()
            await wait_until(lambda: w.committed() == 2, what="re-planned without n2")
            assert c.delete_node("n2") == []
            assert [v.stored.name for v in c.node_views()] == ["n0", "n1"]
            assert c.store.get_node("n2") is None
            with pytest.raises(NotFoundError):
                c.delete_node("n2")
            # Forced, a serving node goes and its deployment re-plans without it.
            reply = await w.plans.DeleteNode(plan_pb2.DeleteNodeRequest(name="n1", force=True))
            assert reply.deleted and list(reply.deployments) == ["mx"]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await w.plans.DeleteNode(plan_pb2.DeleteNodeRequest(name="nope"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

    run(main())


# ----------------------------------------------------------------------------- tick cost


def test_a_tick_reads_only_what_changed(tmp_path: Path) -> None:
    """With every deployment settled, a tick reads nothing per deployment; a change costs
    reads for that deployment only."""
    settings = replace(FAST, node_lost_after_s=1e6)
    store = SqliteStore(tmp_path / "t.db", synchronous="NORMAL")
    c = Controller(store, settings=settings)
    inv = small_inventories(1)[0]
    c.register(inv)
    names = [f"d{i:02d}" for i in range(40)]
    for name in names:  # 40 deployments that cannot be placed: settled as "pending"
        c.apply_deployment(replace(SPEC, name=name, node_selector={"pool": "none"}))
    for _ in range(3):
        c.tick()
    calls: dict[str, int] = {}
    for method in ("get_deployment", "list_deployments", "list_plans", "committed_plan"):
        original = getattr(store, method)

        def counting(
            *args: object, _m: str = method, _f: object = original, **kw: object
        ) -> object:
            calls[_m] = calls.get(_m, 0) + 1
            return _f(*args, **kw)  # type: ignore[operator]

        setattr(store, method, counting)
    for _ in range(5):
        assert c.tick() == []  # nothing to do, nothing read
    assert calls == {}
    c.changed("d07")
    actions = c.tick()
    assert [getattr(a, "deployment", None) for a in actions] == ["d07"]
    assert sum(calls.values()) <= 3, calls
    store.close()


def test_nodes_delete_command(
    cli_controller: RunningController,  # noqa: F811  (the fixture)
    capsys: pytest.CaptureFixture[str],
) -> None:
    controller = cli_controller
    addr = ["--controller", controller.address]
    with pytest.raises(MixfleetError, match="node n0 is in use: it heartbeated"):
        cli(capsys, *addr, "nodes", "delete", "n0")
    with pytest.raises(MixfleetError, match="no node 'nope'"):
        cli(capsys, *addr, "nodes", "delete", "nope")
    assert "node n0 deleted\n" in cli(capsys, *addr, "nodes", "delete", "n0", "--force")
    assert "n0" not in [v.stored.name for v in controller.controller.node_views()]
