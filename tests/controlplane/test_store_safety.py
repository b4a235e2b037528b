"""What keeps a SQLite store safe to open: one writer (a second is refused, naming the
holder), the right file (missing, empty, foreign or replaced files refused unless the store
is said to be new), damaged rows quarantined while the rest loads, and ``store check`` /
``store backup``."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from agent_fakes import small_inventories
from test_store import SPEC, _plan

from controlplane.cli import main as cli_main
from controlplane.errors import StoreError
from controlplane.store import StoredNode
from controlplane.store.sqlite import SqliteStore
from controlplane.store.sqlite.check import backup_store, check_store
from controlplane.store.sqlite.guard import lock_path
from policies.plan import Plan


@pytest.fixture(scope="module")
def plan() -> Plan:
    return _plan()


def _filled(path: Path, plan: Plan) -> str:
    """A store with a node, a deployment and a committed plan; returns its identity."""
    s = SqliteStore(path, new=True)
    inv = small_inventories()[0]
    s.upsert_node(StoredNode(inv.node, inv, "sess", 1.0, 2.0, applied={"mx": 1}))
    s.put_deployment(SPEC, now_s=1.0)
    p = s.add_plan("mx", plan, reason="created", inputs_key="k1", now_s=2.0)
    s.commit_plan("mx", p.version, now_s=3.0)
    ident = s.controller_id()
    s.close()
    return ident


# ----------------------------------------------------------------------------- one writer


def test_a_second_writer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    first = SqliteStore(path, new=True)
    with pytest.raises(
        StoreError, match=rf"in use by the controller pid {os.getpid()} on .* since"
    ):
        SqliteStore(path)
    reader = SqliteStore(path, read_only=True)  # store check beside a running controller
    assert reader.list_deployments() == []
    reader.close()
    first.close()
    SqliteStore(path, new=False).close()  # the lock went with the first writer


def test_a_killed_writer_does_not_keep_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    SqliteStore(path, new=True).close()
    script = textwrap.dedent(
        f"""
        import os, signal
        from controlplane.store.sqlite import SqliteStore
        s = SqliteStore({str(path)!r}, new=False)
        print("holding", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL and "holding" in proc.stdout, proc.stderr
    holder = json.loads(lock_path(path).read_text())
    assert holder["pid"] != os.getpid()  # the killed process's record is left...
    SqliteStore(path, new=False).close()  # ...but not its lock


def test_store_files_are_private(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "p.db"
    SqliteStore(path, new=True).close()
    assert path.stat().st_mode & 0o777 == 0o600
    assert lock_path(path).stat().st_mode & 0o777 == 0o600


# ----------------------------------------------------------------------------- the right file


def test_a_missing_store_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    path = tmp_path / "typo" / "state.db"
    with pytest.raises(StoreError, match=r"does not exist.*--store-new"):
        SqliteStore(path, new=False)
    assert not path.parent.exists()


def test_an_emptied_store_is_refused(tmp_path: Path, plan: Plan) -> None:
    path = tmp_path / "e.db"
    _filled(path, plan)
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    path.write_bytes(b"")  # truncated to 0 bytes
    with pytest.raises(StoreError, match=r"is empty \(0 bytes\)"):
        SqliteStore(path, new=False)
    s = SqliteStore(path, new=True)  # the user says it is new
    assert s.list_deployments() == []
    s.close()


def test_a_replaced_store_is_refused_unless_adopted(tmp_path: Path, plan: Plan) -> None:
    path = tmp_path / "r.db"
    first_id = _filled(path, plan)
    other = tmp_path / "other.db"
    other_id = _filled(other, plan)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    backup_store(other, path)  # another store's file put in place
    with pytest.raises(StoreError, match=f"holds store {other_id}.*used store {first_id}"):
        SqliteStore(path, new=False)
    adopted = SqliteStore(path, new=True)
    assert adopted.controller_id() == other_id
    adopted.close()
    SqliteStore(path, new=False).close()  # adopted: now it is the one last used here


def test_a_backup_of_the_same_store_opens(tmp_path: Path, plan: Plan) -> None:
    path = tmp_path / "b.db"
    ident = _filled(path, plan)
    copy = tmp_path / "backup.db"
    backup_store(path, copy)
    assert copy.stat().st_mode & 0o777 == 0o600
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    copy.rename(path)  # restored
    s = SqliteStore(path, new=False)
    assert s.controller_id() == ident and s.committed_plan("mx") is not None
    s.close()


def test_a_foreign_sqlite_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE t (x)")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="not a mixfleet store"):
        SqliteStore(path, new=True)


# ----------------------------------------------------------------------------- damaged rows


def _damage(path: Path, sql: str, *args: object) -> None:
    db = sqlite3.connect(path)
    db.execute(sql, args)
    db.commit()
    db.close()


def test_damaged_rows_are_quarantined_and_the_rest_loads(tmp_path: Path, plan: Plan) -> None:
    path = tmp_path / "d.db"
    _filled(path, plan)
    s = SqliteStore(path)
    s.put_deployment(SPEC.__class__(name="ok", model="mixtral-8x7b"), now_s=5.0)
    inv = small_inventories(2)[1]
    s.upsert_node(StoredNode(inv.node, inv, "sess", 1.0, 2.0))
    s.close()
    _damage(path, "UPDATE nodes SET inventory_json = '{not json' WHERE name = 'n0'")
    _damage(path, "UPDATE plans SET plan_json = '[1, 2' WHERE deployment = 'mx'")
    _damage(path, "UPDATE deployments SET status_json = 'null' WHERE name = 'mx'")
    _damage(path, "UPDATE deployments SET spec_json = '{}' WHERE name = 'ok'")

    s = SqliteStore(path, new=False)
    assert [n.name for n in s.list_nodes()] == ["n1"]
    assert [d.name for d in s.list_deployments()] == ["mx"]  # "ok" has no valid spec
    d = s.get_deployment("mx")
    assert d is not None and "StoreRowQuarantined" in d.status["conditions"][0]
    assert s.committed_plan("mx") is None  # its document does not decode
    assert [p.version for p in s.list_plans("mx")] == [1]  # the listing does not need it
    found = {(q.table, q.key) for q in s.quarantined()}
    assert found == {
        ("nodes", "n0"),
        ("plans", "mx/1"),
        ("deployments.status_json", "mx"),
        ("deployments", "ok"),
    }
    s.upsert_node(StoredNode("n0", small_inventories()[0], "new", 9.0, 9.0))  # re-registered
    assert ("nodes", "n0") not in {(q.table, q.key) for q in s.quarantined()}
    s.close()

    report = check_store(path)
    assert not report.ok
    text = "\n".join(report.problems)
    assert "plan mx v1: does not decode" in text and "deployment ok: does not decode" in text
    assert "deployment mx: does not decode" in text  # its status


def test_store_check_finds_a_whole_store_whole_and_history_faults(
    tmp_path: Path, plan: Plan
) -> None:
    path = tmp_path / "c.db"
    ident = _filled(path, plan)
    report = check_store(path)
    assert report.ok, report.problems
    assert report.store_id == ident and report.counts["plans"] == 1
    _damage(path, "UPDATE deployments SET committed_version = NULL WHERE name = 'mx'")
    _damage(path, "UPDATE deployments SET next_version = 1 WHERE name = 'mx'")
    problems = "\n".join(check_store(path).problems)
    assert "v1 committed, no pointer" in problems
    assert "at or above the deployment's next version 1" in problems


def test_store_check_and_backup_commands(
    tmp_path: Path, plan: Plan, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cli.db"
    _filled(path, plan)
    holder = SqliteStore(path, new=False)  # a running controller
    assert cli_main(["store", "check", "--store", f"sqlite:{path}"]) == 0
    assert capsys.readouterr().out.strip().endswith("ok")
    assert cli_main(["store", "backup", "--store", f"sqlite:{path}", str(tmp_path / "b.db")]) == 0
    assert "backed up" in capsys.readouterr().out
    holder.close()
    assert check_store(tmp_path / "b.db").ok
    _damage(path, "UPDATE plans SET summary_json = 'x' WHERE deployment = 'mx'")
    assert cli_main(["store", "check", "--store", f"sqlite:{path}", "-o", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and "plan mx v1" in doc["problems"][0]
    assert cli_main(["store", "check", "--store", f"sqlite:{tmp_path}/none.db"]) == 1
    assert "does not exist" in capsys.readouterr().err
