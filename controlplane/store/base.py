"""The controller's state store: the contract every backend implements.

What is stored (and nothing else: liveness timers, open streams and in-flight solves are
rebuilt from the world after a restart):

* nodes: the last inventory each agent registered, its session, health state and the plan
  versions it says it applied;
* deployments: the spec (desired state), a generation bumped on each spec change, a
  soft-delete mark, the status the controller last wrote, and the *committed pointer*
  (the version the deployment serves);
* plans: every plan version of every deployment with its state
  (proposed -> preparing -> committed -> superseded, or -> aborted), the reason it was
  made, the inputs it was made for, and the plan document;
* acks: what each agent acked for each (deployment, version), one row per state;
* load windows: expert-load counts engines reported.

Guarantees every backend gives:

1. Durability: a method that returned has persisted its change (a crash right after, even a
   kill -9, loses nothing).
2. Versions only grow: :meth:`Store.add_plan` allocates ``max(version ever used) + 1`` for
   the deployment, also after a delete and re-create of the same name; a version is never
   reused or overwritten.
3. One committed plan: :meth:`Store.commit_plan` atomically marks the new version
   committed, the previous one superseded and moves the pointer.
4. Idempotent acks: :meth:`Store.record_ack` of an ack already stored changes nothing and
   returns False.
5. Tombstones: a deleted deployment stays readable (``include_deleted=True``, ``deleted``
   set) so the controller can tell "deleted here" (agents remove it) from "never known here"
   (agents keep it; the controller reports it). A name the store never held is never
   removed from an agent.

Backends: :class:`controlplane.store.sqlite.SqliteStore` (``sqlite:PATH``) and
:class:`controlplane.store.kubernetes.KubernetesStore` (``kubernetes:NAMESPACE``, the
mixfleet.io custom resources). :func:`controlplane.store.open_store` picks one from a URL. Methods are synchronous and fast (one small transaction); callers on an event loop may
call them directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from policies.hardware.inventory import NodeInventory
from policies.plan import Plan
from policies.spec.build import DeploymentSpec

PlanState = Literal["proposed", "preparing", "committed", "aborted", "superseded"]
AckState = Literal["prepared", "committed", "failed"]
NodeState = Literal["ready", "draining", "degraded"]
PLAN_STATES: tuple[PlanState, ...] = ("proposed", "preparing", "committed", "aborted", "superseded")
ACK_STATES: tuple[AckState, ...] = ("prepared", "committed", "failed")


#: Who decides a store's plans (see :attr:`Store.plan_author`).
PlanAuthor = Literal["controller", "operator"]


@dataclass(frozen=True)
class StoredNode:
    """A node as last registered.

    Attributes:
        name: node name.
        inventory: last registered inventory, with the latest GPU health folded in.
        session_id: the agent's current session (from Register).
        registered_at_s: Unix time of the last Register.
        last_heartbeat_s: Unix time of the last heartbeat the store was told about (the
            controller keeps exact liveness in memory and persists it lazily).
        state: what the agent says (``ready`` | ``draining`` | ``degraded``).
        message: the agent's free-text status.
        applied: deployment -> plan version the agent says it applied.
    """

    name: str
    inventory: NodeInventory
    session_id: str
    registered_at_s: float
    last_heartbeat_s: float
    state: NodeState = "ready"
    message: str = ""
    applied: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StoredDeployment:
    """A deployment.

    Attributes:
        spec: desired state.
        generation: bumped on every spec change (1 at creation).
        created_at_s, updated_at_s: Unix times.
        deleted: soft-deleted (history kept; a create of the same name revives it and its
            versions keep growing).
        committed_version: the committed pointer; None before the first commit.
        status: what the controller last wrote (free-form JSON object, see
            :class:`controlplane.server.controller.Controller`).
        rollout_hold: why no plan of it may start rolling out now, as the plan's decision
            maker reports it (Kubernetes: the operator's ``Solved=False``); empty: none.
    """

    spec: DeploymentSpec
    generation: int
    created_at_s: float
    updated_at_s: float
    deleted: bool = False
    committed_version: int | None = None
    status: Mapping[str, Any] = field(default_factory=dict)
    rollout_hold: str = ""

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class StoredPlan:
    """One plan version.

    Attributes:
        deployment: deployment name.
        version: per-deployment version (only grows).
        plan_id: content hash of the placement.
        state: ``proposed`` | ``preparing`` | ``committed`` | ``aborted`` | ``superseded``.
        reason: why it was made, then why it was aborted ("node h100-0 lost"...).
        inputs_key: fingerprint of what it was solved for (spec generation and fleet);
            the reconcile loop compares it with the current one.
        nodes: nodes holding a part.
        summary: ``Plan.to_dict()["summary"]``.
        created_at_s, state_changed_at_s: Unix times.
        prepare_deadline_s: while preparing, when the rollout times out (Unix time).
        plan: the plan document; None in listings (``with_plan=False``).
    """

    deployment: str
    version: int
    plan_id: str
    state: PlanState
    reason: str
    inputs_key: str
    nodes: tuple[str, ...]
    summary: Mapping[str, Any]
    created_at_s: float
    state_changed_at_s: float
    prepare_deadline_s: float | None = None
    plan: Plan | None = None


@dataclass(frozen=True)
class StoredAck:
    """One ack of one node for one plan version."""

    deployment: str
    version: int
    node: str
    state: AckState
    reason: str
    at_s: float


@dataclass(frozen=True)
class LoadWindow:
    """Expert token counts an engine reported over a window.

    Attributes:
        counts: ``[moe_layers][experts]`` token counts.
        plan_version: the plan version the engine ran (0 when unknown).
    """

    deployment: str
    engine_id: str
    start_s: float
    end_s: float
    plan_version: int
    counts: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class QuarantinedRow:
    """A stored row that does not decode (a damaged file, a hand edit): readers skip it,
    the rest of the store loads.

    Attributes:
        table: ``nodes`` | ``deployments`` | ``plans`` | ...; a part of a row is named
            ``TABLE.COLUMN`` (``deployments.status_json``: the deployment loads without it).
        key: the row's key (``mx``, ``mx/3`` for version 3 of ``mx``, a node name).
        error: why it does not decode.
    """

    table: str
    key: str
    error: str


@runtime_checkable
class RowHealth(Protocol):
    """A store that quarantines rows it cannot decode instead of failing (SQLite)."""

    def quarantined(self) -> list[QuarantinedRow]:
        """Rows found damaged since the store was opened, in the order found."""
        ...


@runtime_checkable
class AliveRecord(Protocol):
    """A store that remembers when its writer was last alive, so a restarted controller
    knows how long it was down (SQLite)."""

    def record_alive(self, now_s: float) -> None:
        """Remember that the writer was alive at ``now_s`` (Unix s)."""
        ...

    def last_alive_s(self) -> float | None:
        """When the writer last recorded itself alive (Unix s); None when never."""
        ...


@runtime_checkable
class PlanWithdrawal(Protocol):
    """A store whose writer may take a deployment's committed plan back without a new one
    (the fleet scheduler preempted it to Pending; SQLite, standalone mode)."""

    def withdraw_plan(self, deployment: str, *, reason: str, now_s: float) -> bool:
        """The committed version becomes superseded and the committed pointer is cleared;
        True when there was one."""
        ...


@runtime_checkable
class DeletionRecord(Protocol):
    """A store that keeps no tombstone of a deleted deployment but knows which versions it
    allocated (Kubernetes: the ModelDeployment is gone, the version counter stays)."""

    def deleted_here(self, deployment: str, version: int) -> bool:
        """Whether ``deployment`` is gone (or being deleted) and ``version`` of it was
        allocated in this store - a plan an agent still runs of a deleted deployment, not
        one from another store."""
        ...


class Store(Protocol):
    """The controller's persistent state. See the module docstring for the guarantees.

    Every method raises :class:`controlplane.errors.StoreError` when the backend fails.

    Attributes:
        plan_author: who decides this store's plans, and so may call :meth:`add_plan`:
            ``controller`` (SQLite, standalone) or ``operator`` (Kubernetes: the operator
            writes PartitionPlans, the controller only rolls them out).
    """

    plan_author: PlanAuthor

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Release the backend (idempotent)."""
        ...

    def controller_id(self) -> str:
        """A stable id of this store's data (made on first open), reported to agents."""
        ...

    # ----------------------------------------------------------------- nodes
    def upsert_node(self, node: StoredNode) -> None:
        """Insert or replace a node (Register)."""
        ...

    def update_node_status(
        self,
        name: str,
        *,
        inventory: NodeInventory | None = None,
        last_heartbeat_s: float | None = None,
        state: NodeState | None = None,
        message: str | None = None,
        applied: Mapping[str, int] | None = None,
    ) -> None:
        """Change some fields of a known node (no-op for an unknown one)."""
        ...

    def get_node(self, name: str) -> StoredNode | None: ...

    def list_nodes(self) -> list[StoredNode]:
        """All nodes, by name."""
        ...

    def cordoned_nodes(self) -> frozenset[str]:
        """Nodes an administrator cordoned: no rollout starts onto them (Kubernetes:
        ``GPUNode.spec.cordon``; SQLite: none)."""
        ...

    def delete_node(self, name: str) -> bool:
        """Forget a node; True when it existed (``mixfleetctl nodes delete``)."""
        ...

    # ----------------------------------------------------------------- deployments
    def put_deployment(
        self,
        spec: DeploymentSpec,
        *,
        now_s: float,
        create_only: bool = False,
        update_only: bool = False,
    ) -> StoredDeployment:
        """Create, revive or update a deployment; the generation grows only when the spec
        changed.

        Raises:
            AlreadyExistsError: ``create_only`` and a live deployment has the name.
            NotFoundError: ``update_only`` and no live deployment has the name.
        """
        ...

    def get_deployment(
        self, name: str, *, include_deleted: bool = False
    ) -> StoredDeployment | None: ...

    def list_deployments(self, *, include_deleted: bool = False) -> list[StoredDeployment]:
        """Deployments by name."""
        ...

    def delete_deployment(self, name: str, *, now_s: float) -> bool:
        """Soft-delete; clears the committed pointer (the committed plan becomes superseded).
        True when a live deployment was deleted."""
        ...

    def set_deployment_status(self, name: str, status: Mapping[str, Any]) -> None:
        """Replace the status object of a deployment."""
        ...

    # ----------------------------------------------------------------- plans
    def add_plan(
        self,
        deployment: str,
        plan: Plan,
        *,
        reason: str,
        inputs_key: str,
        now_s: float,
        document: Mapping[str, Any] | None = None,
    ) -> StoredPlan:
        """Store a new version (state ``proposed``); the version is allocated here and
        written into the stored plan document. ``document`` is ``plan.to_dict()`` when the
        caller has built it already (a backend may use it instead of building it again).

        Raises:
            NotFoundError: unknown deployment.
        """
        ...

    def set_plan_state(
        self,
        deployment: str,
        version: int,
        state: PlanState,
        *,
        reason: str | None = None,
        now_s: float,
        prepare_deadline_s: float | None = None,
    ) -> None:
        """Move a version to ``preparing`` or ``aborted`` (use :meth:`commit_plan` to commit).

        Raises:
            NotFoundError: unknown version.
            PreconditionError: the move is not allowed (e.g. committed -> aborted).
        """
        ...

    def commit_plan(self, deployment: str, version: int, *, now_s: float) -> None:
        """Atomically: the version becomes committed, the previously committed one
        superseded, and the deployment's committed pointer moves to it.

        Raises:
            NotFoundError: unknown version.
            PreconditionError: the version is aborted or superseded.
        """
        ...

    def get_plan(
        self, deployment: str, version: int, *, with_plan: bool = True
    ) -> StoredPlan | None:
        """One version; with its plan document unless ``with_plan`` is False."""
        ...

    def committed_plan(self, deployment: str) -> StoredPlan | None:
        """The committed version, with its plan document."""
        ...

    def list_plans(
        self,
        deployment: str | None = None,
        *,
        states: Sequence[PlanState] | None = None,
        limit: int = 50,
    ) -> list[StoredPlan]:
        """Versions newest first (per deployment), without plan documents."""
        ...

    # ----------------------------------------------------------------- acks
    def record_ack(
        self,
        deployment: str,
        version: int,
        node: str,
        state: AckState,
        *,
        reason: str = "",
        now_s: float,
    ) -> bool:
        """Store an ack; False when the same (deployment, version, node, state) was
        already stored (idempotent).

        Raises:
            NotFoundError: unknown deployment or version.
        """
        ...

    def record_acks(self, acks: Sequence[StoredAck]) -> int:
        """Store many acks at once (one transaction where the backend has them); acks
        already stored, or for a plan version that no longer exists, are skipped. Returns
        how many were new."""
        ...

    def acks(self, deployment: str, version: int) -> list[StoredAck]:
        """Acks of one version, oldest first."""
        ...

    # ----------------------------------------------------------------- load
    def add_load_window(self, window: LoadWindow, *, now_s: float) -> None:
        """Store a load window.

        Raises:
            NotFoundError: unknown deployment.
        """
        ...

    def load_windows(self, deployment: str, *, since_s: float = 0.0) -> list[LoadWindow]:
        """Windows of a deployment ending after ``since_s``, oldest first."""
        ...

    def prune_load_windows(self, *, before_s: float) -> int:
        """Delete windows that ended before ``before_s``; returns how many."""
        ...
