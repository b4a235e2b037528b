"""Damage a SQLite store can meet and how the controller copes: text that is not UTF-8 in a
row (quarantined, the rest loads, the controller starts, ``store check`` names it); a second
controller however it names the file (refused), or one that did not see the lock (the first
stops writing, ``store check`` reports the split)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_fakes import small_inventories
from test_store import SPEC, _plan

from controlplane.errors import StoreError
from controlplane.server.inprocess import start_controller
from controlplane.store import StoredNode
from controlplane.store.sqlite import SqliteStore
from controlplane.store.sqlite.check import check_store
from controlplane.store.sqlite.guard import lock_path
from policies.plan import Plan

#: ``{"`` then two bytes that are not UTF-8, then ``"``.
NOT_UTF8 = "CAST(X'7B22FFFE22' AS TEXT)"


@pytest.fixture(scope="module")
def plan() -> Plan:
    return _plan()


def _filled(path: Path, plan: Plan) -> None:
    """Two nodes, two deployments, a committed plan of ``mx``."""
    s = SqliteStore(path, new=True)
    for inv in small_inventories(2):
        s.upsert_node(StoredNode(inv.node, inv, "sess", 1.0, 2.0))
    s.put_deployment(SPEC, now_s=1.0)
    s.put_deployment(SPEC.__class__(name="ok", model="mixtral-8x7b"), now_s=1.0)
    p = s.add_plan("mx", plan, reason="created", inputs_key="k1", now_s=2.0)
    s.commit_plan("mx", p.version, now_s=3.0)
    s.close()


def _damage(path: Path, sql: str) -> None:
    db = sqlite3.connect(path)
    db.execute(sql)
    db.commit()
    db.close()


@pytest.mark.parametrize(
    ("column", "where", "quarantined"),
    [
        ("deployments.spec_json", "name = 'ok'", ("deployments", "ok")),
        ("nodes.inventory_json", "name = 'n0'", ("nodes", "n0")),
        ("plans.plan_json", "deployment = 'mx'", ("plans", "mx/1")),
        ("deployments.status_json", "name = 'mx'", ("deployments.status_json", "mx")),
    ],
)
def test_a_row_that_is_not_utf8_is_quarantined_and_the_rest_loads(
    tmp_path: Path, plan: Plan, column: str, where: str, quarantined: tuple[str, str]
) -> None:
    path = tmp_path / "state.db"
    _filled(path, plan)
    table, col = column.split(".")
    _damage(path, f"UPDATE {table} SET {col} = {NOT_UTF8} WHERE {where}")

    s = SqliteStore(path, new=False)
    nodes = [n.name for n in s.list_nodes()]
    deps = [d.name for d in s.list_deployments()]
    assert nodes == (["n1"] if table == "nodes" else ["n0", "n1"])
    assert deps == (["mx"] if col == "spec_json" else ["mx", "ok"])
    assert (s.committed_plan("mx") is None) == (col == "plan_json")
    assert [p.version for p in s.list_plans("mx")] == [1]  # the listing reads no document
    assert quarantined in {(q.table, q.key) for q in s.quarantined()}
    assert "UnicodeDecodeError" in s.quarantined()[0].error
    s.close()

    report = check_store(path)
    assert not report.ok
    assert any("does not decode (UnicodeDecodeError" in p for p in report.problems)


def test_the_controller_starts_beside_a_row_that_is_not_utf8(tmp_path: Path, plan: Plan) -> None:
    path = tmp_path / "state.db"
    _filled(path, plan)
    _damage(path, f"UPDATE deployments SET spec_json = {NOT_UTF8} WHERE name = 'ok'")
    _damage(path, f"UPDATE nodes SET inventory_json = {NOT_UTF8} WHERE name = 'n0'")

    async def main() -> None:
        async with start_controller(tmp_path) as ctl:
            c = ctl.controller
            for _ in range(3):
                c.tick()
            assert [d.name for d in c.views.records()] == ["mx"]
            found = {(q.table, q.key) for q in c.store.quarantined()}  # type: ignore[attr-defined]
            assert {("deployments", "ok"), ("nodes", "n0")} <= found

    asyncio.run(main())


# ----------------------------------------------------------------------------- one writer

#: A second process that opens the store at argv[1] for writing, says so, and holds it until
#: its stdin closes. With argv[2] == "no-lock" the file system's locks are taken as absent
#: (``flock`` does nothing, as on a network file system without lock support).
HOLDER = textwrap.dedent(
    """
    import sys
    from controlplane.store.sqlite import guard
    if sys.argv[2] == "no-lock":
        guard.fcntl.flock = lambda fd, op: None
    from controlplane.store.sqlite import SqliteStore
    from policies.spec.build import DeploymentSpec
    s = SqliteStore(sys.argv[1], new=False)
    if sys.argv[2] == "no-lock":
        s.put_deployment(DeploymentSpec(name="b", model="mixtral-8x7b"), now_s=9.0)
    print("holding", flush=True)
    sys.stdin.read()
    s.close()
    """
)


@contextlib.contextmanager
def _holder(path: Path, mode: str = "lock") -> Iterator[subprocess.Popen[str]]:
    """Another process holding the store at ``path`` open for writing."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "holding", proc.stderr.read() if proc.stderr else ""
        yield proc
    finally:
        proc.communicate(timeout=60)


@pytest.mark.parametrize("way", ["symlink", "hard link", "symlinked directory", "lock deleted"])
def test_a_second_writer_is_refused_however_it_names_the_file(tmp_path: Path, way: str) -> None:
    path = tmp_path / "state.db"
    SqliteStore(path, new=True).close()
    with _holder(path) as proc:
        other = path
        if way == "symlink":
            other = tmp_path / "link.db"
            other.symlink_to(path)
        elif way == "hard link":
            other = tmp_path / "hard.db"
            os.link(path, other)
        elif way == "symlinked directory":
            (tmp_path / "dir").symlink_to(tmp_path)
            other = tmp_path / "dir" / "state.db"
        else:
            lock_path(path).unlink()
        who = "another process" if way == "hard link" else f"pid {proc.pid} "
        with pytest.raises(StoreError, match=rf"in use by the controller {who}"):
            SqliteStore(other, new=False)
    if way == "hard link":  # two names of one file: two write-ahead logs
        with pytest.raises(StoreError, match=r"has 2 hard links.*To fix: remove the other"):
            SqliteStore(path, new=False)
        other.unlink()
    SqliteStore(path, new=False).close()  # the holder is gone: the store opens again


def test_two_store_objects_of_one_process_on_one_file(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = SqliteStore(path, new=True)
    link = tmp_path / "link.db"
    link.symlink_to(path)
    with pytest.raises(StoreError, match=rf"in use by the controller pid {os.getpid()} "):
        SqliteStore(link, new=False)
    first.put_deployment(SPEC, now_s=1.0)  # the refusal left the holder's locks alone
    assert [d.name for d in first.list_deployments()] == ["mx"]
    first.close()
    SqliteStore(link, new=False).close()


def test_a_writer_whose_lock_was_side_stepped_stops_writing_and_check_says_split(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    first = SqliteStore(path, new=True)
    first.put_deployment(SPEC, now_s=1.0)
    with _holder(path, "no-lock"):  # a second controller that did not see the lock
        with pytest.raises(StoreError, match=r"taken over by the controller pid \d+ .*To fix"):
            first.put_deployment(SPEC.__class__(name="a", model="mixtral-8x7b"), now_s=2.0)
        with pytest.raises(StoreError, match="taken over"):  # every later write, too
            first.delete_deployment("mx", now_s=3.0)
    first.close()
    reader = SqliteStore(path, read_only=True)
    assert sorted(d.name for d in reader.list_deployments()) == ["b", "mx"]  # not "a"
    reader.close()
    report = check_store(path)
    assert not report.ok
    assert any("two controllers wrote this store" in p for p in report.problems), report.problems


# ----------------------------------------------------------------------------- versions


def test_a_next_version_below_a_stored_plan_is_repaired(tmp_path: Path, plan: Plan) -> None:
    path = tmp_path / "state.db"
    _filled(path, plan)  # mx has v1 committed
    _damage(path, "UPDATE deployments SET next_version = 1 WHERE name = 'mx'")
    s = SqliteStore(path, new=False)
    p = s.add_plan("mx", plan, reason="r", inputs_key="k2", now_s=5.0)
    assert p.version == 2
    assert s.add_plan("mx", plan, reason="r", inputs_key="k3", now_s=6.0).version == 3
    s.close()
    assert check_store(path).ok


def test_the_controller_plans_past_a_damaged_next_version(tmp_path: Path) -> None:
    from agent_fakes import FakeAgent, wait_until
    from test_schedule_e2e import BASE

    path = tmp_path / "state.db"
    s = SqliteStore(path, new=True)
    s.put_deployment(BASE, now_s=1.0)
    for k in range(3):  # three old attempts, aborted
        v = s.add_plan("x", _plan(), reason="old", inputs_key=f"k{k}", now_s=2.0).version
        s.set_plan_state("x", v, "aborted", reason="old", now_s=3.0)
    s.close()
    _damage(path, "UPDATE deployments SET next_version = 2 WHERE name = 'x'")

    async def main() -> None:
        async with start_controller(tmp_path) as ctl:
            agent = FakeAgent(ctl.address, small_inventories(1)[0])
            await agent.start()
            store = ctl.controller.store
            try:

                def ready() -> bool:
                    d = store.get_deployment("x")
                    return d is not None and d.status.get("phase") == "ready"

                await wait_until(ready, timeout_s=60, what="x ready")
                d = store.get_deployment("x")
                assert d is not None and d.committed_version == 4
                assert [p.version for p in store.list_plans("x")] == [4, 3, 2, 1]
            finally:
                await agent.stop()

    asyncio.run(main())


def test_a_plan_the_store_refuses_is_a_failure_retried_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent_fakes import FakeAgent, wait_until
    from test_schedule_e2e import BASE

    calls: list[str] = []

    def refuse(self: SqliteStore, deployment: str, *args: object, **kwargs: object) -> None:
        calls.append(deployment)
        raise StoreError("the disk is full", field="store")

    async def main() -> None:
        async with start_controller(tmp_path) as ctl:
            agent = FakeAgent(ctl.address, small_inventories(1)[0])
            await agent.start()
            store = ctl.controller.store
            monkeypatch.setattr(SqliteStore, "add_plan", refuse)
            try:
                ctl.controller.apply_deployment(BASE)

                def failed() -> bool:
                    d = store.get_deployment("x")
                    return d is not None and "cannot store the plan" in d.status.get("message", "")

                await wait_until(failed, timeout_s=60, what="the failure in the status")
                d = store.get_deployment("x")
                assert d is not None and "the disk is full" in d.status["message"]
            finally:
                await agent.stop()

    asyncio.run(main())
