"""Damage a SQLite store can meet and how the controller copes: text that is not UTF-8 in a
row (quarantined, the rest loads, the controller starts, ``store check`` names it)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
from agent_fakes import small_inventories
from test_store import SPEC, _plan

from controlplane.server.inprocess import start_controller
from controlplane.store import StoredNode
from controlplane.store.sqlite import SqliteStore
from controlplane.store.sqlite.check import check_store
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
