"""The disk applier (:class:`PlanApplier`): hands this node's part of a plan to the local
runtime, crash-safely, and owns the layout of ``plan_dir``.

Two phases, matching the controller's rollout:

* :meth:`PlanApplier.stage` writes every file of a new plan version into a staging
  directory (each file written and fsynced, then the directory fsynced), reads them back to
  validate them, and runs the hook with ``MIXFLEET_HOOK_PHASE=prepare``. Nothing visible to
  engines changes. Success means the agent may ack ``prepared``.
* :meth:`PlanApplier.commit` renames the staged directory into ``.versions/`` and switches
  the deployment's link to it with one atomic ``rename(2)`` of a symlink, then runs the hook
  with ``MIXFLEET_HOOK_PHASE=commit``. If the hook fails the link is switched back: the
  previous committed files stay in force. Success means the agent may ack ``committed``.

Layout under ``plan_dir``::

    <deployment>.json   -> <deployment>/plan.json       (one JSON per deployment)
    <deployment>        -> .versions/<deployment>.v<N>  (switched atomically on commit)
    .versions/<deployment>.v<N>/plan.json               this node's part of plan version N
    .versions/<deployment>.v<N>/gpu<i>.env              env file for GPU i's engine container
    .versions/<deployment>.v<N>/gpu<i>.experts.json     GPU i's expert slots per MoE layer
    .staging/<deployment>.v<N>/...                       staged, not yet committed

Engines read ``<plan_dir>/<deployment>/gpu<i>.env`` (``docker run --env-file``); because the
whole directory switches in one rename, they never see a mix of two versions. A crash at
any point leaves either the old or the new version committed, never a torn one;
:meth:`PlanApplier.recover` removes staging leftovers at start-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agents.applier.assignment import (
    NodeAssignment,
    assignment_from_dict,
    check_assignment,
    check_expert_location,
    gpu_index,
)
from agents.applier.env import gpu_env, instance_env, render_env
from agents.applier.files import atomic_symlink, fsync_dir, write_file
from agents.applier.hooks import HOOK_PHASES, HookResult, run_hook
from agents.applier.protocol import ApplyResult, CommittedPlan
from policies.errors import InputError


@dataclass(frozen=True)
class ApplierSettings:
    """Where and how plans are written.

    Attributes:
        plan_dir: directory the plan files go to (created if missing).
        node: this node's name; assignments for other nodes are refused.
        hook: command run after staging and after committing (argv); None for no hook.
        hook_timeout_s: the hook is killed and the step fails after this many seconds.
        hook_phases: phases the hook runs in (``prepare``, ``commit``).
        keep_versions: committed versions kept on disk per deployment (for roll-back and
            inspection), the one in force included.
        fsync: fsync files and directories (off only for throw-away simulations).
    """

    plan_dir: Path
    node: str
    hook: tuple[str, ...] | None = None
    hook_timeout_s: float = 30.0
    hook_phases: tuple[str, ...] = HOOK_PHASES
    keep_versions: int = 3
    fsync: bool = True

    @staticmethod
    def parse_hook(command: str | None) -> tuple[str, ...] | None:
        """A ``--hook`` string split like a shell would (no shell is run)."""
        if not command:
            return None
        argv = tuple(shlex.split(command))
        return argv or None


class PlanApplier:
    """Disk-backed :class:`Applier` (see the module docstring for the layout).

    Methods do blocking file I/O and may run the hook: call them from a worker thread in
    asyncio code (``asyncio.to_thread``).
    """

    blocking = True
    wants_expert_location = True

    def __init__(self, settings: ApplierSettings) -> None:
        self.settings = settings
        self.root = Path(settings.plan_dir)
        self.staging = self.root / ".staging"
        self.versions = self.root / ".versions"
        for d in (self.root, self.staging, self.versions):
            d.mkdir(parents=True, exist_ok=True)
        # deployment -> (link target, what it holds): heartbeats ask often, links rarely move.
        self._committed_cache: dict[str, tuple[str, CommittedPlan]] = {}

    # -- naming

    def _staged_dir(self, deployment: str, version: int) -> Path:
        return self.staging / f"{deployment}.v{version}"

    def _version_dir(self, deployment: str, version: int) -> Path:
        return self.versions / f"{deployment}.v{version}"

    def link(self, deployment: str) -> Path:
        """The path engines read: ``<plan_dir>/<deployment>`` (a symlink)."""
        return self.root / deployment

    # -- queries

    def committed(self, deployment: str) -> CommittedPlan | None:
        """The plan in force for ``deployment``, None when none was committed."""
        try:
            target = os.readlink(self.link(deployment))
        except OSError:
            return None
        cached = self._committed_cache.get(deployment)
        if cached is not None and cached[0] == target:
            return cached[1]
        try:
            doc = json.loads((self.link(deployment) / "plan.json").read_text())
            found = CommittedPlan(deployment, str(doc["plan_id"]), int(doc["version"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._committed_cache[deployment] = (target, found)
        return found

    def is_staged(self, deployment: str, version: int) -> bool:
        return self._staged_dir(deployment, version).is_dir()

    def applied(self) -> dict[str, int]:
        """Deployment -> committed version (for heartbeats)."""
        out: dict[str, int] = {}
        for d in self.deployments():
            c = self.committed(d)
            if c is not None:
                out[d] = c.version
        return out

    def deployments(self) -> list[str]:
        """Deployments with a committed plan on this node."""
        return sorted(
            p.name
            for p in self.root.iterdir()
            if p.is_symlink() and not p.name.endswith(".json") and not p.name.startswith(".")
        )

    def recover(self) -> list[str]:
        """Remove leftovers of an interrupted stage or commit (staged directories, temporary
        files); returns what was removed. Committed plans are untouched."""
        removed: list[str] = []
        for p in sorted(self.staging.iterdir()):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(str(p))
        for p in sorted(self.root.glob(".tmp-*")):
            with contextlib.suppress(OSError):
                p.unlink()
            removed.append(str(p))
        return removed

    # -- phases

    def stage(self, a: NodeAssignment) -> ApplyResult:
        """Write and check ``a``'s files, run the prepare hook; nothing switches."""
        problems = check_assignment(a, self.settings.node)
        if problems:
            return ApplyResult(False, "invalid assignment: " + "; ".join(problems[:5]))
        current = self.committed(a.deployment)
        if current is not None:
            if current.version == a.version and current.plan_id == a.plan_id:
                return ApplyResult(True)  # already in force: acks are idempotent
            if current.version >= a.version:
                return ApplyResult(
                    False,
                    f"stale assignment: version {a.version} <= committed {current.version}",
                )
        staged = self._staged_dir(a.deployment, a.version)
        try:
            if staged.exists():
                shutil.rmtree(staged)
            staged.mkdir()
            expected = self._write_files(a, staged)
            self._verify(staged, expected)
        except (OSError, ValueError, InputError) as exc:
            shutil.rmtree(staged, ignore_errors=True)
            return ApplyResult(False, f"staging failed: {exc}")
        hook = self._hook("prepare", a, staged)
        if not hook.ok:
            shutil.rmtree(staged, ignore_errors=True)
            return ApplyResult(False, f"prepare {hook.reason}")
        return ApplyResult(True)

    def commit(self, deployment: str, version: int) -> ApplyResult:
        """Switch ``deployment`` to its staged ``version`` and run the commit hook; on any
        failure the previous version stays (or is put back) in force."""
        current = self.committed(deployment)
        staged = self._staged_dir(deployment, version)
        if not staged.is_dir():
            if current is not None and current.version == version:
                return ApplyResult(True)  # a repeated commit
            return ApplyResult(False, f"nothing staged for {deployment} version {version}")
        try:
            a = assignment_from_dict(json.loads((staged / "plan.json").read_text()))
        except (OSError, ValueError, InputError) as exc:
            shutil.rmtree(staged, ignore_errors=True)
            return ApplyResult(False, f"staged files of version {version} unreadable: {exc}")
        link = self.link(deployment)
        previous_target = os.readlink(link) if link.is_symlink() else None
        target = self._version_dir(deployment, version)
        fs = self.settings.fsync
        try:
            if target.exists():
                shutil.rmtree(target)
            os.replace(staged, target)
            if fs:
                fsync_dir(self.versions)
                fsync_dir(self.staging)
            atomic_symlink(link, os.path.relpath(target, self.root), fsync=fs)
            json_link = self.root / f"{deployment}.json"
            if not json_link.is_symlink():
                atomic_symlink(json_link, f"{deployment}/plan.json", fsync=fs)
        except OSError as exc:
            self._restore(link, previous_target)
            if target.is_dir() and not staged.exists():
                with contextlib.suppress(OSError):
                    os.replace(target, staged)  # keep it staged so a retry can commit
            return ApplyResult(False, f"commit failed: {exc}")
        hook = self._hook("commit", a, link)
        if not hook.ok:
            self._restore(link, previous_target)
            shutil.rmtree(target, ignore_errors=True)
            return ApplyResult(False, f"commit {hook.reason}; previous plan kept")
        self._drop_staged_before(deployment, version)
        self._gc(deployment)
        return ApplyResult(True)

    def apply(self, a: NodeAssignment) -> ApplyResult:
        """Stage and commit in one go (no two-phase rollout)."""
        staged = self.stage(a)
        if not staged.ok:
            return staged
        return self.commit(a.deployment, a.version)

    def abort(self, deployment: str, version: int) -> None:
        """Forget a staged version (the rollout was aborted)."""
        shutil.rmtree(self._staged_dir(deployment, version), ignore_errors=True)

    def remove(self, deployment: str) -> ApplyResult:
        """Withdraw a deployment from this node (deleted, or the node left the plan)."""
        try:
            for p in (self.root / f"{deployment}.json", self.link(deployment)):
                if p.is_symlink():
                    p.unlink()
            if self.settings.fsync:
                fsync_dir(self.root)
        except OSError as exc:
            return ApplyResult(False, f"remove failed: {exc}")
        for p in self.versions.glob(f"{deployment}.v*"):
            shutil.rmtree(p, ignore_errors=True)
        for p in self.staging.glob(f"{deployment}.v*"):
            shutil.rmtree(p, ignore_errors=True)
        return ApplyResult(True)

    # -- helpers

    def _write_files(self, a: NodeAssignment, d: Path) -> dict[str, bytes]:
        fs = self.settings.fsync
        files: dict[str, bytes] = {}
        files["plan.json"] = json.dumps(a.to_dict(), indent=1, sort_keys=True).encode()
        link = self.link(a.deployment).absolute()
        location_file = None
        if a.expert_location_json:
            problems = check_expert_location(a)
            if problems:
                raise InputError("; ".join(problems), field="expert_location_json")
            files["expert_location.json"] = a.expert_location_json
            location_file = link / "expert_location.json"
        for k, g in enumerate(a.gpus):
            idx = gpu_index(g)
            experts = {
                "deployment": a.deployment,
                "plan_id": a.plan_id,
                "version": a.version,
                "gpu": g.gpu,
                "rank": a.ranks[k],
                "moe_layers": list(a.moe_layers),
                "num_experts": a.num_experts,
                "slots_per_gpu": a.slots_per_gpu,
                "slots": [[[s.expert, round(s.share, 9)] for s in layer] for layer in g.experts],
            }
            files[f"gpu{idx}.experts.json"] = json.dumps(experts, sort_keys=True).encode()
            env = gpu_env(a, k, link / f"gpu{idx}.experts.json", location_file)
            files[f"gpu{idx}.env"] = render_env(env).encode()
        for name, data in files.items():
            write_file(d / name, data, fsync=fs)
        if fs:
            fsync_dir(d)
        return files

    @staticmethod
    def _verify(d: Path, expected: Mapping[str, bytes]) -> None:
        """Read every staged file back: same bytes, and JSON files parse."""
        for name, data in expected.items():
            got = (d / name).read_bytes()
            if got != data:
                raise ValueError(f"{name} reads back different from what was written")
            if name.endswith(".json"):
                json.loads(got)
        assignment_from_dict(json.loads((d / "plan.json").read_bytes()))

    def _hook(self, phase: str, a: NodeAssignment, path: Path) -> HookResult:
        s = self.settings
        if s.hook is None or phase not in s.hook_phases:
            return HookResult(True)
        env = {
            "MIXFLEET_HOOK_PHASE": phase,
            "MIXFLEET_DEPLOYMENT": a.deployment,
            "MIXFLEET_PLAN_ID": a.plan_id,
            "MIXFLEET_PLAN_VERSION": str(a.version),
            "MIXFLEET_PLAN_PATH": str(path),
            "MIXFLEET_NODE": s.node,
            **instance_env(a),
        }
        return run_hook(s.hook, env, s.hook_timeout_s)

    def _restore(self, link: Path, previous_target: str | None) -> None:
        with contextlib.suppress(OSError):
            if previous_target is None:
                if link.is_symlink():
                    link.unlink()
            else:
                atomic_symlink(link, previous_target, fsync=self.settings.fsync)

    def _drop_staged_before(self, deployment: str, version: int) -> None:
        for p in self.staging.glob(f"{deployment}.v*"):
            v = _version_of(p.name, deployment)
            if v is not None and v <= version:
                shutil.rmtree(p, ignore_errors=True)

    def _gc(self, deployment: str) -> None:
        found = sorted(
            (v, p)
            for p in self.versions.glob(f"{deployment}.v*")
            if (v := _version_of(p.name, deployment)) is not None
        )
        for _, p in found[: max(0, len(found) - self.settings.keep_versions)]:
            shutil.rmtree(p, ignore_errors=True)


def _version_of(name: str, deployment: str) -> int | None:
    prefix = f"{deployment}.v"
    if name.startswith(prefix) and name[len(prefix) :].isdigit():
        return int(name[len(prefix) :])
    return None
