"""SQLite store: schema migrations, durability across reopen and kill -9, versions only
grow, one committed plan, idempotent acks."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from agent_fakes import small_fleet_doc, small_inventories

from controlplane.errors import AlreadyExistsError, NotFoundError, PreconditionError, StoreError
from controlplane.store import LoadWindow, StoredAck, StoredNode, open_store
from controlplane.store.sqlite import SCHEMA_VERSION, SqliteStore
from policies.assignment import split_plan
from policies.estimate.workload import make_workload
from policies.hardware.fleet import parse_fleet
from policies.plan import Plan
from policies.request import PlacementRequest
from policies.solve import solve
from policies.spec.build import DeploymentSpec

SPEC = DeploymentSpec(name="mx", model="mixtral-8x7b", policy="greedy")


def _plan() -> Plan:
    from policies.model.architecture import preset

    model = preset("mixtral-8x7b")
    fleet = parse_fleet(small_fleet_doc())
    w = make_workload(model, phase="decode", tokens_per_gpu=64, context_len=4096)
    return solve(PlacementRequest(fleet, model, w, policy="greedy", redundant_experts=4)).plan


@pytest.fixture(scope="module")
def plan() -> Plan:
    return _plan()


def test_migrations_recorded_and_reopen_keeps_everything(tmp_path: Path, plan: Plan) -> None:
    path = tmp_path / "s.db"
    s = SqliteStore(path)
    assert s.schema_version() == SCHEMA_VERSION
    inv = small_inventories()[0]
    s.upsert_node(StoredNode(inv.node, inv, "sess", 1.0, 2.0, applied={"mx": 1}))
    s.put_deployment(SPEC, now_s=1.0)
    p = s.add_plan("mx", plan, reason="created", inputs_key="k1", now_s=2.0)
    s.set_plan_state("mx", p.version, "preparing", now_s=3.0, prepare_deadline_s=9.0)
    s.commit_plan("mx", p.version, now_s=4.0)
    cid = s.controller_id()
    s.close()

    again = SqliteStore(path)
    assert again.schema_version() == SCHEMA_VERSION
    rows = again._query("SELECT version, description FROM schema_migrations")
    assert [r["version"] for r in rows] == list(range(1, SCHEMA_VERSION + 1))
    assert again.controller_id() == cid
    node = again.get_node(inv.node)
    assert node is not None and node.inventory == inv and node.applied == {"mx": 1}
    committed = again.committed_plan("mx")
    assert committed is not None and committed.plan is not None
    assert committed.version == 1 and committed.plan.version == 1
    assert committed.plan.id == plan.id and committed.state == "committed"
    assert again.get_deployment("mx") is not None
    again.close()


def test_writes_survive_a_kill_minus_9(tmp_path: Path) -> None:
    """A child process commits a plan and SIGKILLs itself before closing anything."""
    path = tmp_path / "k.db"
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        from test_store import _plan, SPEC
        from controlplane.store.sqlite import SqliteStore
        s = SqliteStore({str(path)!r})
        s.put_deployment(SPEC, now_s=1.0)
        p = s.add_plan("mx", _plan(), reason="r", inputs_key="k", now_s=2.0)
        s.commit_plan("mx", p.version, now_s=3.0)
        s.record_ack("mx", p.version, "n0", "committed", now_s=4.0)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    s = SqliteStore(path)
    committed = s.committed_plan("mx")
    assert committed is not None and committed.version == 1
    assert [a.state for a in s.acks("mx", 1)] == ["committed"]
    s.close()


def test_unclosed_store_is_readable_by_a_second_open(tmp_path: Path, plan: Plan) -> None:
    path = tmp_path / "u.db"
    first = SqliteStore(path)  # never closed: the writer is still running
    first.put_deployment(SPEC, now_s=1.0)
    first.add_plan("mx", plan, reason="r", inputs_key="k", now_s=2.0)
    second = SqliteStore(path, read_only=True)  # what `mixfleetctl store check` opens
    assert [p.version for p in second.list_plans("mx")] == [1]
    second.close()
    first.close()


def test_versions_only_grow_across_delete_and_recreate(tmp_path: Path, plan: Plan) -> None:
    s = SqliteStore(tmp_path / "v.db")
    s.put_deployment(SPEC, now_s=1.0)
    versions = [s.add_plan("mx", plan, reason="r", inputs_key="k", now_s=2.0).version]
    versions.append(s.add_plan("mx", plan, reason="r", inputs_key="k", now_s=3.0).version)
    s.commit_plan("mx", 2, now_s=4.0)
    assert s.delete_deployment("mx", now_s=5.0)
    assert s.get_deployment("mx") is None
    assert s.committed_plan("mx") is None
    d = s.put_deployment(SPEC, now_s=6.0)  # re-create: history and counter kept
    assert d.generation == 2
    versions.append(s.add_plan("mx", plan, reason="r", inputs_key="k", now_s=7.0).version)
    assert versions == [1, 2, 3]
    assert {p.version: p.state for p in s.list_plans("mx")} == {
        3: "proposed",
        2: "superseded",
        1: "aborted",  # deleting aborts versions that were never served
    }
    with pytest.raises(sqlite3.IntegrityError, match="only grow"):
        s._db.execute(
            "INSERT INTO plans VALUES ('mx', 2, 'x', 'proposed', '', '', '[]', '{}', '{}',"
            " NULL, 0, 0)"
        )
    s.close()


def test_commit_moves_the_pointer_and_supersedes(tmp_path: Path, plan: Plan) -> None:
    s = SqliteStore(tmp_path / "c.db")
    s.put_deployment(SPEC, now_s=1.0)
    for t in (1.0, 2.0):
        s.add_plan("mx", plan, reason="r", inputs_key="k", now_s=t)
    s.commit_plan("mx", 1, now_s=3.0)
    s.commit_plan("mx", 2, now_s=4.0)
    s.commit_plan("mx", 2, now_s=5.0)  # idempotent
    assert [(p.version, p.state) for p in s.list_plans("mx")] == [
        (2, "committed"),
        (1, "superseded"),
    ]
    d = s.get_deployment("mx")
    assert d is not None and d.committed_version == 2
    with pytest.raises(PreconditionError, match="cannot be committed"):
        s.commit_plan("mx", 1, now_s=6.0)
    with pytest.raises(NotFoundError):
        s.commit_plan("mx", 9, now_s=6.0)
    s.add_plan("mx", plan, reason="r", inputs_key="k", now_s=7.0)
    s.set_plan_state("mx", 3, "aborted", reason="prepare failed", now_s=8.0)
    with pytest.raises(PreconditionError):
        s.set_plan_state("mx", 3, "preparing", now_s=9.0)
    s.close()


def test_acks_are_idempotent_and_need_a_known_plan(tmp_path: Path, plan: Plan) -> None:
    s = SqliteStore(tmp_path / "a.db")
    s.put_deployment(SPEC, now_s=1.0)
    s.add_plan("mx", plan, reason="r", inputs_key="k", now_s=2.0)
    assert s.record_ack("mx", 1, "n0", "prepared", now_s=3.0) is True
    assert s.record_ack("mx", 1, "n0", "prepared", now_s=4.0) is False
    assert s.record_ack("mx", 1, "n0", "committed", now_s=5.0) is True
    assert [(a.node, a.state, a.at_s) for a in s.acks("mx", 1)] == [
        ("n0", "prepared", 3.0),
        ("n0", "committed", 5.0),
    ]
    with pytest.raises(NotFoundError, match="version"):
        s.record_ack("mx", 7, "n0", "prepared", now_s=6.0)
    with pytest.raises(NotFoundError):
        s.record_ack("nope", 1, "n0", "prepared", now_s=6.0)
    s.close()


def test_acks_in_a_batch_skip_duplicates_and_unknown_plans(tmp_path: Path, plan: Plan) -> None:
    s = SqliteStore(tmp_path / "b.db")
    s.put_deployment(SPEC, now_s=1.0)
    s.add_plan("mx", plan, reason="r", inputs_key="k", now_s=2.0)
    s.record_ack("mx", 1, "n0", "prepared", now_s=3.0)
    batch = [
        StoredAck("mx", 1, "n0", "prepared", "", 3.5),  # already stored
        StoredAck("mx", 1, "n1", "prepared", "", 3.6),
        StoredAck("mx", 1, "n1", "prepared", "", 3.7),  # twice in the batch
        StoredAck("mx", 1, "n2", "failed", "disk full", 3.8),
        StoredAck("mx", 9, "n0", "prepared", "", 3.9),  # no such version
    ]
    assert s.record_acks(batch) == 2
    assert [(a.node, a.state, a.reason) for a in s.acks("mx", 1)] == [
        ("n0", "prepared", ""),
        ("n1", "prepared", ""),
        ("n2", "failed", "disk full"),
    ]
    assert s.record_acks([]) == 0
    s.close()


def test_create_update_only_and_generation(tmp_path: Path) -> None:
    s = SqliteStore(tmp_path / "d.db")
    with pytest.raises(NotFoundError):
        s.put_deployment(SPEC, now_s=1.0, update_only=True)
    assert s.put_deployment(SPEC, now_s=1.0, create_only=True).generation == 1
    with pytest.raises(AlreadyExistsError):
        s.put_deployment(SPEC, now_s=2.0, create_only=True)
    assert s.put_deployment(SPEC, now_s=2.0).generation == 1  # same spec: unchanged
    changed = DeploymentSpec(name="mx", model="mixtral-8x7b", policy="ilp")
    assert s.put_deployment(changed, now_s=3.0, update_only=True).generation == 2
    s.close()


def test_load_windows_and_pruning(tmp_path: Path) -> None:
    s = SqliteStore(tmp_path / "l.db")
    with pytest.raises(NotFoundError):
        s.add_load_window(LoadWindow("mx", "e", 0.0, 1.0, 0, ((1.0,),)), now_s=1.0)
    s.put_deployment(SPEC, now_s=1.0)
    for end in (10.0, 20.0, 30.0):
        s.add_load_window(LoadWindow("mx", "e0", end - 10, end, 1, ((1.0, 2.0),)), now_s=end)
    assert [w.end_s for w in s.load_windows("mx", since_s=15.0)] == [20.0, 30.0]
    assert s.load_windows("mx")[0].counts == ((1.0, 2.0),)
    assert s.prune_load_windows(before_s=25.0) == 2
    assert len(s.load_windows("mx")) == 1
    s.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    SqliteStore(path).close()
    db = sqlite3.connect(path)
    db.execute("INSERT INTO schema_migrations VALUES (999, 'future', 0)")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="schema version 999"):
        SqliteStore(path)


def test_open_store_urls(tmp_path: Path) -> None:
    s = open_store(f"sqlite:{tmp_path}/x.db")
    s.close()
    with pytest.raises(StoreError, match="sqlite:PATH"):
        open_store("etcd://nope")


def test_a_plan_document_built_by_the_caller_is_stored_as_if_built_here(
    tmp_path: Path, plan: Plan
) -> None:
    """The controller builds a plan's document once, for the store and for the node parts;
    what is stored, and every node's part, is the same as when each builds its own."""
    s = SqliteStore(tmp_path / "doc.db")
    s.put_deployment(SPEC, now_s=1.0)
    built_here = s.add_plan("mx", plan, reason="r", inputs_key="k", now_s=2.0)
    doc = plan.to_dict()
    given = s.add_plan("mx", plan, reason="r", inputs_key="k", now_s=3.0, document=doc)
    assert doc["version"] == plan.version  # the caller's document is not modified
    a, b = s.get_plan("mx", built_here.version), s.get_plan("mx", given.version)
    assert a is not None and b is not None and a.plan is not None and b.plan is not None
    assert replace(b.plan, version=a.plan.version) == a.plan
    assert b.plan.version == given.version == 2 and b.summary == a.summary
    doc["version"] = given.version
    shared = split_plan(b.plan, "mx", document=doc)
    own = split_plan(b.plan, "mx")
    assert {n: p.json for n, p in shared.items()} == {n: p.json for n, p in own.items()}
    assert "gpus" in doc  # split_plan leaves the document alone
    s.close()
