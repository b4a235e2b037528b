"""Plan applier: atomic two-phase writes, crash safety, hook handling."""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import replace
from hashlib import sha256
from pathlib import Path

import pytest
from agent_builders import small_plan

import agents.applier as applier_mod
from agents.applier import (
    ApplierSettings,
    MemoryApplier,
    NodeAssignment,
    PlanApplier,
    assignment_from_dict,
    assignment_from_json,
    assignment_from_plan,
    atomic_write,
    check_assignment,
    check_expert_location,
    inflate_expert_location,
    parse_env,
)
from policies.errors import InputError
from policies.plan import Plan


def _assignment(version: int = 1, node: str = "n0") -> tuple[Plan, NodeAssignment]:
    plan = small_plan(version=version)
    return plan, assignment_from_plan("mixtral", plan, node)


def _applier(tmp_path: Path, hook: str | None = None, **kw: object) -> PlanApplier:
    settings = ApplierSettings(
        plan_dir=tmp_path / "plans", node="n0", hook=ApplierSettings.parse_hook(hook)
    )
    return PlanApplier(replace(settings, **kw))  # type: ignore[arg-type]


def _hook_script(tmp_path: Path, body: str) -> str:
    script = tmp_path / "hook.py"
    script.write_text("import os, sys, time\n" + body)
    return f"{sys.executable} {script}"


# --------------------------------------------------------------------------- wire form


def test_part_json_round_trip_keeps_every_field() -> None:
    _, a = _assignment()
    again = assignment_from_json(json.dumps(a.to_dict()).encode(), a.expert_location_json)
    assert again == a
    assert again.ranks == (0, 1)
    assert again.world_size == 4
    assert again.slots_per_gpu == 2
    assert again.expert_location is not None
    assert len(again.expert_location["physical_to_logical_map"]) == 32  # every model layer


def test_part_json_missing_field_names_it() -> None:
    _, a = _assignment()
    doc = a.to_dict()
    del doc["gpus"][1]["rank"]
    with pytest.raises(InputError) as err:
        assignment_from_dict(doc)
    assert err.value.field == "part.gpus[1].rank"
    with pytest.raises(InputError, match="part_json"):
        assignment_from_json(b"{not json")


def test_check_assignment_refuses_other_nodes_gpus() -> None:
    plan, a = _assignment()
    foreign = replace(a, gpus=(plan.gpus[2],), ranks=(2,))
    problems = check_assignment(foreign, "n0")
    assert any("belongs to 'n1'" in p for p in problems)
    assert check_assignment(a, "n0") == []
    assert any("this agent is 'n1'" in p for p in check_assignment(a, "n1"))


# --------------------------------------------------------------------------- two phases


def test_stage_then_commit_writes_plan_env_and_experts(tmp_path: Path) -> None:
    plan, a = _assignment()
    ap = _applier(tmp_path)
    assert ap.stage(a).ok
    assert ap.committed("mixtral") is None  # staging switches nothing
    assert not (ap.root / "mixtral").exists()
    assert ap.commit("mixtral", 1).ok
    assert ap.committed("mixtral") == applier_mod.CommittedPlan("mixtral", plan.id, 1)

    doc = json.loads((ap.root / "mixtral.json").read_text())
    assert doc["plan_id"] == plan.id and doc["version"] == 1
    assert [g["gpu"] for g in doc["gpus"]] == ["n0/gpu0", "n0/gpu1"]

    env = parse_env((ap.root / "mixtral" / "gpu1.env").read_text())
    assert env["MIXFLEET_PLAN_ID"] == plan.id
    assert env["MIXFLEET_PLAN_VERSION"] == "1"
    assert env["MIXFLEET_RANK"] == "1"
    assert float(env["MIXFLEET_ATTENTION_SHARE"]) == pytest.approx(plan.gpus[1].attention_share)
    assert float(env["MIXFLEET_DP_WEIGHT"]) == pytest.approx(plan.gpus[1].dp_weight)
    assert env["MIXFLEET_EP_BACKEND"] == plan.gpus[1].hints.ep_backend
    assert env["MIXFLEET_DEEPEP_NUM_SMS"] == str(plan.gpus[1].hints.deepep_num_sms)
    experts = json.loads(Path(env["MIXFLEET_EXPERTS_FILE"]).read_text())
    assert [[e for e, _ in layer] for layer in experts["slots"]] == [
        [s.expert for s in layer] for layer in plan.gpus[1].experts
    ]
    location = json.loads(Path(env["MIXFLEET_EXPERT_LOCATION_FILE"]).read_text())
    assert location["physical_to_logical_map"][0] == plan.physical_to_logical()[0]


def test_commit_switches_all_files_together_and_keeps_history(tmp_path: Path) -> None:
    _, a1 = _assignment(1)
    plan2, a2 = _assignment(2)
    ap = _applier(tmp_path, keep_versions=2)
    assert ap.apply(a1).ok
    env_path = ap.root / "mixtral" / "gpu0.env"
    assert parse_env(env_path.read_text())["MIXFLEET_PLAN_VERSION"] == "1"
    assert ap.stage(a2).ok
    # Staged but not committed: engines still read version 1.
    assert parse_env(env_path.read_text())["MIXFLEET_PLAN_VERSION"] == "1"
    assert ap.commit("mixtral", 2).ok
    assert parse_env(env_path.read_text())["MIXFLEET_PLAN_VERSION"] == "2"
    assert ap.committed("mixtral") == applier_mod.CommittedPlan("mixtral", plan2.id, 2)
    _, a3 = _assignment(3)
    assert ap.apply(a3).ok
    kept = sorted(p.name for p in ap.versions.iterdir())
    assert kept == ["mixtral.v2", "mixtral.v3"]
    assert ap.deployments() == ["mixtral"]


def test_repeated_stage_and_commit_are_idempotent(tmp_path: Path) -> None:
    _, a = _assignment()
    ap = _applier(tmp_path)
    assert ap.stage(a).ok and ap.stage(a).ok
    assert ap.commit("mixtral", 1).ok and ap.commit("mixtral", 1).ok
    assert ap.stage(a).ok  # already in force
    assert ap.committed("mixtral") is not None


def test_stale_and_unstaged_versions_are_refused(tmp_path: Path) -> None:
    _, a1 = _assignment(1)
    _, a2 = _assignment(2)
    ap = _applier(tmp_path)
    assert ap.apply(a2).ok
    stale = ap.stage(replace(a1, plan_id="other"))
    assert not stale.ok and "stale" in stale.reason
    missing = ap.commit("mixtral", 7)
    assert not missing.ok and "nothing staged" in missing.reason


def test_abort_discards_staged_and_keeps_committed(tmp_path: Path) -> None:
    _, a1 = _assignment(1)
    _, a2 = _assignment(2)
    ap = _applier(tmp_path)
    assert ap.apply(a1).ok
    assert ap.stage(a2).ok
    ap.abort("mixtral", 2)
    assert list(ap.staging.iterdir()) == []
    assert ap.committed("mixtral") is not None
    assert ap.committed("mixtral").version == 1  # type: ignore[union-attr]
    assert not ap.commit("mixtral", 2).ok


def test_remove_withdraws_the_deployment(tmp_path: Path) -> None:
    _, a = _assignment()
    ap = _applier(tmp_path)
    assert ap.apply(a).ok
    assert ap.remove("mixtral").ok
    assert ap.committed("mixtral") is None
    assert not (ap.root / "mixtral.json").exists()
    assert list(ap.versions.iterdir()) == []


def test_invalid_assignment_is_refused_with_reason(tmp_path: Path) -> None:
    _, a = _assignment(node="n1")
    result = _applier(tmp_path).stage(a)  # applier is for n0
    assert not result.ok
    assert "invalid assignment" in result.reason and "n1" in result.reason


# --------------------------------------------------------------------------- crash safety


def test_atomic_write_crash_before_rename_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "plan.json"
    atomic_write(target, b'{"version": 1}')

    def crash(src: object, dst: object) -> None:
        raise OSError("simulated crash between write and rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        atomic_write(target, b'{"version": 2}')
    assert target.read_bytes() == b'{"version": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temp file left


def test_crash_after_stage_before_commit_leaves_old_plan_in_force(tmp_path: Path) -> None:
    _, a1 = _assignment(1)
    _, a2 = _assignment(2)
    ap = _applier(tmp_path)
    assert ap.apply(a1).ok
    before = {p.name: p.read_bytes() for p in (ap.root / "mixtral").iterdir()}
    assert ap.stage(a2).ok
    # The process dies here. A new agent starts on the same directory:
    restarted = _applier(tmp_path)
    removed = restarted.recover()
    assert any("mixtral.v2" in r for r in removed)
    after = {p.name: p.read_bytes() for p in (restarted.root / "mixtral").iterdir()}
    assert after == before
    assert restarted.committed("mixtral").version == 1  # type: ignore[union-attr]


def test_failed_link_switch_keeps_old_plan_and_version_stays_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, a1 = _assignment(1)
    _, a2 = _assignment(2)
    ap = _applier(tmp_path)
    assert ap.apply(a1).ok
    assert ap.stage(a2).ok
    real_symlink = os.symlink

    def failing_symlink(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "symlink", failing_symlink)
    result = ap.commit("mixtral", 2)
    assert not result.ok and "disk full" in result.reason
    assert ap.committed("mixtral").version == 1  # type: ignore[union-attr]
    monkeypatch.setattr(os, "symlink", real_symlink)
    assert ap.commit("mixtral", 2).ok  # still staged: a retry succeeds
    assert ap.committed("mixtral").version == 2  # type: ignore[union-attr]


# --------------------------------------------------------------------------- hook


def test_hook_runs_in_both_phases_with_plan_env(tmp_path: Path) -> None:
    log = tmp_path / "hook.log"
    hook = _hook_script(
        tmp_path,
        f"open({str(log)!r}, 'a').write(os.environ['MIXFLEET_HOOK_PHASE'] + ' ' + "
        "os.environ['MIXFLEET_PLAN_VERSION'] + ' ' + "
        "str(os.path.exists(os.path.join(os.environ['MIXFLEET_PLAN_PATH'], 'gpu0.env'))) + '\\n')\n",
    )
    _, a = _assignment()
    ap = _applier(tmp_path, hook)
    assert ap.stage(a).ok
    assert ap.commit("mixtral", 1).ok
    assert log.read_text().splitlines() == ["prepare 1 True", "commit 1 True"]


def test_failing_prepare_hook_means_no_commit(tmp_path: Path) -> None:
    hook = _hook_script(tmp_path, "sys.stderr.write('engine rejected plan\\n'); sys.exit(3)\n")
    _, a = _assignment()
    ap = _applier(tmp_path, hook)
    result = ap.stage(a)
    assert not result.ok
    assert "status 3" in result.reason and "engine rejected plan" in result.reason
    assert list(ap.staging.iterdir()) == []
    assert not ap.commit("mixtral", 1).ok
    assert ap.committed("mixtral") is None


def test_failing_commit_hook_restores_previous_plan(tmp_path: Path) -> None:
    hook = _hook_script(
        tmp_path,
        "sys.exit(1 if os.environ['MIXFLEET_HOOK_PHASE'] == 'commit' "
        "and os.environ['MIXFLEET_PLAN_VERSION'] == '2' else 0)\n",
    )
    _, a1 = _assignment(1)
    _, a2 = _assignment(2)
    ap = _applier(tmp_path, hook)
    assert ap.apply(a1).ok
    result = ap.commit("mixtral", 2) if ap.stage(a2).ok else None
    assert result is not None and not result.ok
    assert "previous plan kept" in result.reason
    assert ap.committed("mixtral").version == 1  # type: ignore[union-attr]
    env = parse_env((ap.root / "mixtral" / "gpu0.env").read_text())
    assert env["MIXFLEET_PLAN_VERSION"] == "1"


def test_hook_timeout_fails_the_step(tmp_path: Path) -> None:
    hook = _hook_script(tmp_path, "time.sleep(30)\n")
    _, a = _assignment()
    ap = _applier(tmp_path, hook, hook_timeout_s=0.3)
    result = ap.stage(a)
    assert not result.ok and "timed out after 0.3 s" in result.reason


def test_missing_hook_binary_fails_cleanly(tmp_path: Path) -> None:
    _, a = _assignment()
    result = _applier(tmp_path, "/nonexistent/hook --flag").stage(a)
    assert not result.ok and "could not start" in result.reason


# --------------------------------------------------------------------------- in memory


def test_memory_applier_follows_the_same_rules() -> None:
    _, a1 = _assignment(1)
    _, a2 = _assignment(2)
    ap = MemoryApplier("n0")
    assert ap.stage(a1).ok and ap.commit("mixtral", 1).ok
    assert ap.commit("mixtral", 1).ok  # repeated
    assert not ap.stage(replace(a1, plan_id="x")).ok  # stale
    assert ap.stage(a2).ok
    ap.abort("mixtral", 2)
    assert not ap.commit("mixtral", 2).ok
    assert ap.committed("mixtral").version == 1  # type: ignore[union-attr]
    failing = MemoryApplier("n0", fail_stage="disk full")
    assert failing.stage(a1).reason == "disk full"


def test_expert_location_must_match_the_digest_the_part_names() -> None:
    _, a = _assignment()
    assert check_assignment(a, a.node) == []
    tampered = replace(a, expert_location_json=a.expert_location_json.replace(b"[0,", b"[1,", 1))
    assert tampered.expert_location_json != a.expert_location_json
    problems = check_assignment(tampered, a.node)
    assert any("expert_location_json" in p and "SHA-256" in p for p in problems)
    missing = replace(a, expert_location_json=b"", expert_location_sha256="")
    assert any("missing" in p for p in check_assignment(missing, a.node))


def test_disk_applier_refuses_an_expert_location_of_the_wrong_shape(tmp_path: Path) -> None:
    _, a = _assignment()
    doc = json.loads(a.expert_location_json)
    doc["physical_to_logical_map"] = doc["physical_to_logical_map"][:-1]  # a layer short
    data = json.dumps(doc).encode()
    bad = replace(a, expert_location_json=data, expert_location_sha256=sha256(data).hexdigest())
    assert check_expert_location(bad) == ["expert_location_json: 31 rows, the model has 32 layers"]
    applier = _applier(tmp_path)
    result = applier.stage(bad)
    assert not result.ok and "31 rows" in result.reason
    assert applier.stage(a).ok and applier.commit(a.deployment, a.version).ok
    written = applier.link(a.deployment) / "expert_location.json"
    assert written.read_bytes() == a.expert_location_json


def test_expert_location_inflates_only_to_the_size_the_part_announces() -> None:
    _, a = _assignment()
    packed = zlib.compress(a.expert_location_json)
    assert inflate_expert_location(packed, a.expert_location_bytes) == a.expert_location_json
    assert inflate_expert_location(b"", 0) == b""
    with pytest.raises(InputError, match="inflates beyond") as err:
        inflate_expert_location(packed, a.expert_location_bytes - 1)
    assert err.value.field == "expert_location_zlib"
    bomb = zlib.compress(b"0" * (1 << 20))  # 1 KiB on the wire, 1 MiB inflated
    with pytest.raises(InputError, match="inflates beyond"):
        inflate_expert_location(bomb, 4096)
    with pytest.raises(InputError, match="not zlib"):
        inflate_expert_location(b"not compressed", 100)


def test_memory_applier_checks_the_expert_location_only_when_it_wants_it() -> None:
    _, a = _assignment()
    without = replace(a, expert_location_json=b"")  # what an agent that did not inflate stages
    assert MemoryApplier(a.node).stage(without).ok
    strict = MemoryApplier(a.node, wants_expert_location=True)
    result = strict.stage(without)
    assert not result.ok and "expert_location_json" in result.reason
    assert strict.stage(a).ok
