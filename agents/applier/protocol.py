"""What the agent needs from an applier (:class:`Applier`: stage, commit, abort, remove,
what is committed) and its results, plus :class:`MemoryApplier`, which checks assignments
like the disk applier but keeps them in memory (simulated agents, benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from agents.applier.assignment import NodeAssignment, check_assignment


@dataclass(frozen=True)
class ApplyResult:
    """Outcome of a stage, commit or remove.

    Attributes:
        ok: the step succeeded (ack ``prepared`` / ``committed``).
        reason: why not, for the ``failed`` ack; empty when ok.
    """

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class CommittedPlan:
    """What is in force for a deployment on this node."""

    deployment: str
    plan_id: str
    version: int


class Applier(Protocol):
    """What the agent needs from an applier (disk-backed or in memory).

    Attributes:
        blocking: methods block (disk, hook): the agent calls them from a worker thread.
        wants_expert_location: it hands the whole plan's expert location to an engine, so
            the agent inflates and checks it; False: parts are staged without it.
    """

    blocking: bool
    wants_expert_location: bool

    def stage(self, a: NodeAssignment) -> ApplyResult: ...

    def commit(self, deployment: str, version: int) -> ApplyResult: ...

    def abort(self, deployment: str, version: int) -> None: ...

    def committed(self, deployment: str) -> CommittedPlan | None: ...

    def remove(self, deployment: str) -> ApplyResult: ...

    def is_staged(self, deployment: str, version: int) -> bool: ...

    def applied(self) -> dict[str, int]: ...


@dataclass
class MemoryApplier:
    """An :class:`Applier` that keeps plans in memory: checks assignments like the disk
    applier but writes nothing (simulated agents, benchmarks).

    Attributes:
        node: this node's name.
        fail_stage: reason to fail every stage with (fault injection); empty: succeed.
        staged: ``(deployment, version) -> assignment``.
        current: ``deployment -> assignment in force``.
        wants_expert_location: inflate and check the plan's expert location like the disk
            applier. Off by default: a simulated node has no engine to read it, and
            simulating thousands of nodes in one process should not pay thousands of
            inflations a real fleet spreads over its machines.
    """

    node: str
    fail_stage: str = ""
    staged: dict[tuple[str, int], NodeAssignment] = field(default_factory=dict)
    current: dict[str, NodeAssignment] = field(default_factory=dict)
    blocking: bool = False
    wants_expert_location: bool = False

    def is_staged(self, deployment: str, version: int) -> bool:
        return (deployment, version) in self.staged

    def applied(self) -> dict[str, int]:
        return {d: a.version for d, a in self.current.items()}

    def stage(self, a: NodeAssignment) -> ApplyResult:
        problems = check_assignment(a, self.node, with_location=self.wants_expert_location)
        if problems:
            return ApplyResult(False, "invalid assignment: " + "; ".join(problems[:5]))
        if self.fail_stage:
            return ApplyResult(False, self.fail_stage)
        cur = self.current.get(a.deployment)
        if cur is not None and cur.version >= a.version:
            if cur.version == a.version and cur.plan_id == a.plan_id:
                return ApplyResult(True)
            return ApplyResult(
                False, f"stale assignment: version {a.version} <= committed {cur.version}"
            )
        self.staged[(a.deployment, a.version)] = a
        return ApplyResult(True)

    def commit(self, deployment: str, version: int) -> ApplyResult:
        a = self.staged.pop((deployment, version), None)
        if a is None:
            cur = self.current.get(deployment)
            if cur is not None and cur.version == version:
                return ApplyResult(True)
            return ApplyResult(False, f"nothing staged for {deployment} version {version}")
        self.current[deployment] = a
        for key in [k for k in self.staged if k[0] == deployment and k[1] <= version]:
            del self.staged[key]
        return ApplyResult(True)

    def abort(self, deployment: str, version: int) -> None:
        self.staged.pop((deployment, version), None)

    def committed(self, deployment: str) -> CommittedPlan | None:
        a = self.current.get(deployment)
        return None if a is None else CommittedPlan(deployment, a.plan_id, a.version)

    def remove(self, deployment: str) -> ApplyResult:
        self.current.pop(deployment, None)
        return ApplyResult(True)
