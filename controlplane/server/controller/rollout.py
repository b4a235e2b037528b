"""Two-phase rollout of plans to the nodes, and the acks that drive it.

:class:`Rollouts` owns the rollout in flight per deployment, the node parts of each newly
proposed plan (split off the event loop), the committed plan and parts per deployment (a
cache of the store's committed pointer), and the acks: buffered until the next tick stores
them in one transaction, and cached per version for duplicate detection.

Two-phase rollout of version V of a deployment (the wire protocol is in
``proto/mixfleet/v1/agent.proto``):

* start: V becomes ``preparing`` with a deadline; every node holding a part of V gets
  PREPARE on its WatchAssignments stream (or on connect, when it is not connected);
* each PREPARED / FAILED ack is stored (idempotently) and wakes the loop;
* commit: the store moves the committed pointer to V in one transaction (the commit point);
  then nodes of V get COMMIT, nodes only in the old plan get REMOVE, engines watching the
  routing get V;
* abort (a FAILED ack, a lost target, the deadline): V becomes ``aborted``; nodes that got
  PREPARE get ABORT; the previous committed version stays.

After a restart the rollouts are rebuilt from ``preparing`` versions and their stored acks,
giving agents a fresh prepare deadline to reconnect.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from controlplane.errors import NotFoundError, PreconditionError
from controlplane.server import reconcile as rc
from controlplane.server.controller.common import AssignmentEvent, Context
from controlplane.server.controller.instance_records import InstanceRecord
from controlplane.server.controller.nodes import NodeRegistry
from controlplane.server.controller.watchers import Watchers
from controlplane.store import AckState, DeletionRecord, StoredAck, StoredDeployment
from policies.assignment import NodePart, split_plan
from policies.plan import Plan
from policies.spec.build import usd_per_million_tokens


@dataclass
class _Rollout:
    version: int
    plan_id: str
    plan: Plan
    parts: dict[str, NodePart]
    deadline_s: float
    started_s: float
    prepared: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    instance: InstanceRecord | None = None  # the deployment is an engine instance

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.parts)


@dataclass
class Committed:
    """The committed version of a deployment, its plan and its node parts (split from the
    plan on first use: the decision only needs the plan's GPUs), and its instance record
    when the deployment is an engine instance (role and ports go out with its parts)."""

    version: int
    plan: Plan
    _parts: dict[str, NodePart] | None = None
    _split: Callable[[], dict[str, NodePart]] | None = None
    instance: InstanceRecord | None = None

    @property
    def parts(self) -> dict[str, NodePart]:
        """Node name -> its part of the plan."""
        if self._parts is None:
            self._parts = self._split() if self._split is not None else {}
        return self._parts

    def nodes(self) -> frozenset[str]:
        """Nodes holding a part (without splitting the plan)."""
        return frozenset(g.node for g in self.plan.gpus)


class Rollouts:
    """Rollouts in flight, committed plans and acks (see the module docstring).

    Args:
        ctx: the controller's shared dependencies.
        nodes: the node registry (GPU UUIDs for node parts, liveness from acks).
        watchers: where assignment events and plan records go.
        on_commit: called with the deployment's name at each commit point.
    """

    def __init__(
        self,
        ctx: Context,
        nodes: NodeRegistry,
        watchers: Watchers,
        on_commit: Callable[[str], None],
    ) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self.watchers = watchers
        self._on_commit = on_commit
        self._rollouts: dict[str, _Rollout] = {}
        self._ack_buffer: list[StoredAck] = []
        # deployment -> (version, plan, node parts) of its latest proposed plan, split off
        # the event loop
        self._proposed: dict[str, tuple[int, Plan, dict[str, NodePart]]] = {}
        self._ack_cache: dict[tuple[str, int], dict[str, set[AckState]]] = {}
        self._committed: dict[str, Committed] = {}

    def recover(self, now_s: float) -> None:
        """Rebuild the rollouts in flight from the store after a (re)start (``now_s``: Unix
        s; each gets at least a fresh prepare timeout from then)."""
        store = self.ctx.store
        for d in store.list_deployments():
            for p in store.list_plans(d.name, states=["preparing"], limit=10):
                stored = store.get_plan(d.name, p.version)
                if stored is None or stored.plan is None:
                    continue
                deadline = max(p.prepare_deadline_s or 0.0, now_s + d.spec.prepare_timeout_s)
                r = _Rollout(
                    p.version,
                    p.plan_id,
                    stored.plan,
                    self.split(stored.plan, d.name),
                    deadline,
                    now_s,
                    instance=InstanceRecord.from_status(d.status),
                )
                for a in store.acks(d.name, p.version):
                    if a.state == "prepared":
                        r.prepared.add(a.node)
                    elif a.state == "failed":
                        r.failed[a.node] = a.reason
                self._rollouts[d.name] = r
                self.ctx.log.info(
                    "rollout resumed",
                    deployment=d.name,
                    version=p.version,
                    plan_id=p.plan_id,
                    prepared=len(r.prepared),
                    targets=len(r.targets),
                )

    def split(self, plan: Plan, deployment: str) -> dict[str, NodePart]:
        """The plan's node parts (node name -> part)."""
        return split_plan(plan, deployment, self.nodes.uuids(plan))

    def propose(
        self, deployment: str, version: int, plan: Plan, parts: dict[str, NodePart]
    ) -> None:
        """Keep a newly stored plan and its parts for its rollout."""
        self._proposed[deployment] = (version, plan, parts)

    def observed(self, deployment: str) -> rc.RolloutObs | None:
        """The deployment's rollout in flight as the decision sees it."""
        r = self._rollouts.get(deployment)
        if r is None:
            return None
        return rc.RolloutObs(
            r.version, r.deadline_s, r.targets, frozenset(r.prepared), dict(r.failed)
        )

    # ----------------------------------------------------------------- phases

    def start(self, deployment: str, version: int) -> None:
        """Start rolling out ``version``: PREPARE to every node holding a part of it."""
        store = self.ctx.store
        d = store.get_deployment(deployment)
        stored = store.get_plan(deployment, version, with_plan=False)
        if d is None or stored is None:
            return
        proposed = self._proposed.pop(deployment, None)
        plan: Plan | None
        if proposed is not None and proposed[0] == version:
            _, plan, parts = proposed
        else:  # proposed before a restart: read it back
            full = store.get_plan(deployment, version)
            plan = full.plan if full is not None else None
            parts = self.split(plan, deployment) if plan is not None else {}
        if plan is None:
            return
        now = self.ctx.clock()
        deadline = now + d.spec.prepare_timeout_s
        store.set_plan_state(
            deployment, version, "preparing", now_s=now, prepare_deadline_s=deadline
        )
        r = _Rollout(
            version,
            stored.plan_id,
            plan,
            parts,
            deadline,
            now,
            instance=InstanceRecord.from_status(d.status),
        )
        self._rollouts[deployment] = r
        self.ctx.log.info(
            "rollout started",
            deployment=deployment,
            version=version,
            plan_id=r.plan_id,
            nodes=len(r.targets),
            deadline_s=round(d.spec.prepare_timeout_s, 1),
        )
        for node, part in r.parts.items():
            self.watchers.send(node, self._prepare_event(deployment, r, part))
        self.watchers.emit_version(deployment, version)

    def _prepare_event(self, deployment: str, r: _Rollout, part: NodePart) -> AssignmentEvent:
        return AssignmentEvent(
            deployment,
            r.plan_id,
            r.version,
            "prepare",
            len(r.plan.gpus),
            part,
            r.deadline_s,
            r.instance,
        )

    @staticmethod
    def _commit_event(deployment: str, c: Committed, node: str) -> AssignmentEvent:
        """COMMIT of ``c`` to ``node`` with its part (a stream opening replays it)."""
        return AssignmentEvent(
            deployment,
            c.plan.id,
            c.version,
            "commit",
            len(c.plan.gpus),
            c.parts[node],
            instance=c.instance,
        )

    def commit(self, deployment: str, version: int) -> None:
        """Commit ``version`` (every target prepared): COMMIT to its nodes, REMOVE to nodes
        only in the previous plan, the new plan to routing watchers."""
        r = self._rollouts.get(deployment)
        if r is None or r.version != version:
            return
        store, metrics = self.ctx.store, self.ctx.metrics
        now = self.ctx.clock()
        before = self.committed_state(deployment)
        store.commit_plan(deployment, version, now_s=now)  # the commit point
        del self._rollouts[deployment]
        self._committed[deployment] = Committed(version, r.plan, r.parts, instance=r.instance)
        self._on_commit(deployment)
        # Every target acked PREPARED on its current stream, so COMMIT carries no part: the
        # agent switches to what it staged (a stream opened later replays it with the part).
        for node in r.parts:
            self.watchers.send(
                node, AssignmentEvent(deployment, r.plan_id, version, "commit", len(r.plan.gpus))
            )
        if before is not None:
            for node in before.parts:
                if node not in r.parts:
                    self.watchers.send(
                        node, AssignmentEvent(deployment, r.plan_id, version, "remove")
                    )
        s = r.plan.summary
        metrics.rollout_seconds.labels(deployment, "committed").observe(now - r.started_s)
        metrics.rollouts.labels(deployment, "committed").inc()
        metrics.predicted_step_us.labels(deployment).set(s.step_time_us)
        metrics.predicted_imbalance.labels(deployment).set(s.imbalance)
        metrics.committed_version.labels(deployment).set(version)
        self.ctx.log.info(
            "plan committed",
            deployment=deployment,
            version=version,
            plan_id=r.plan_id,
            nodes=len(r.targets),
            rollout_s=round(now - r.started_s, 3),
        )
        d = store.get_deployment(deployment)
        if d is not None:
            status = dict(d.status)
            status.update(
                step_time_us=s.step_time_us,
                imbalance=s.imbalance,
                nodes=list(r.targets),
                committed_plan_id=r.plan_id,
                cost_per_million_tokens_usd=usd_per_million_tokens(d.spec, r.plan),
            )
            store.set_deployment_status(deployment, status)
        stored = self.watchers.emit_version(deployment, version)
        if stored is not None:
            self.watchers.emit_routing(deployment, stored)

    def abort(self, deployment: str, version: int, reason: str) -> None:
        """Abort ``version``: ABORT to the nodes that got PREPARE; the committed one stays."""
        store, metrics = self.ctx.store, self.ctx.metrics
        now = self.ctx.clock()
        r = self._rollouts.pop(deployment, None)
        stored = store.get_plan(deployment, version, with_plan=False)
        if stored is not None and stored.state in ("proposed", "preparing"):
            store.set_plan_state(deployment, version, "aborted", reason=reason, now_s=now)
        if r is not None and r.version == version:
            for node in r.parts:
                self.watchers.send(node, AssignmentEvent(deployment, r.plan_id, version, "abort"))
            metrics.rollout_seconds.labels(deployment, "aborted").observe(now - r.started_s)
        metrics.rollouts.labels(deployment, "aborted").inc()
        self.ctx.log.warning(
            "rollout aborted", deployment=deployment, version=version, reason=reason
        )
        self.watchers.emit_version(deployment, version)

    def committed_state(
        self, deployment: str, record: StoredDeployment | None = None
    ) -> Committed | None:
        """The committed plan and its parts (cached; loaded from the store once). ``record``:
        the deployment's current record when the caller has it (saves a store read)."""
        store = self.ctx.store
        d = record if record is not None else store.get_deployment(deployment)
        if d is None or d.committed_version is None:
            self._committed.pop(deployment, None)
            return None
        cached = self._committed.get(deployment)
        if cached is not None and cached.version == d.committed_version:
            return cached
        plan = store.committed_plan(deployment)
        if plan is None or plan.plan is None:
            return None
        doc = plan.plan
        c = Committed(
            plan.version,
            doc,
            _split=lambda: self.split(doc, deployment),
            instance=InstanceRecord.from_status(d.status),
        )
        self._committed[deployment] = c
        return c

    def serving(self, node: str) -> list[str]:
        """The deployments whose committed plan (as loaded) or rollout in flight gives
        ``node`` a part, by name."""
        out = [name for name, c in self._committed.items() if node in c.nodes()]
        out += [name for name, r in self._rollouts.items() if node in r.parts]
        return sorted(set(out))

    def held(self) -> set[str]:
        """Every deployment with a committed plan loaded or a rollout in flight."""
        return set(self._committed) | set(self._rollouts)

    def committed_cached(self, deployment: str) -> Committed | None:
        """The cached committed state, without reading the store."""
        return self._committed.get(deployment)

    def delete(self, name: str) -> tuple[_Rollout | None, Committed | None]:
        """Take the deployment's rollout in flight (it ends) and its committed state, before
        the deployment is deleted; :meth:`deleted` finishes the job."""
        c = self.committed_state(name)
        return self._rollouts.pop(name, None), c

    def deleted(self, name: str, r: _Rollout | None, c: Committed | None) -> None:
        """The deployment is gone: ABORT its rollout's parts, REMOVE its committed parts."""
        if r is not None:
            for node in r.parts:
                self.watchers.send(node, AssignmentEvent(name, r.plan_id, r.version, "abort"))
        if c is not None:
            for node in c.parts:
                self.watchers.send(node, AssignmentEvent(name, c.plan.id, c.version, "remove"))
        self._committed.pop(name, None)
        self._proposed.pop(name, None)

    def snapshot(
        self, node: str, applied: Mapping[str, int], *, cached: bool = False
    ) -> tuple[list[AssignmentEvent], list[str]]:
        """What a node gets when its stream opens: its committed parts, any PREPARE in
        flight, and REMOVE for deployments it runs (``applied``: name -> version) that the
        store knows no longer use it - deleted ones (a tombstone) and live ones whose
        committed plan leaves it out, and deleted ones of a store without tombstones that
        allocated the version (:class:`~controlplane.store.base.DeletionRecord`). Never
        REMOVE for a name the store has no record of (a replaced store, a damaged row):
        those are returned as unknown, to report.

        Args:
            cached: take the committed plans from memory instead of reading every
                deployment (the controller is the store's only writer and has loaded them).

        Returns:
            ``(events, unknown deployment names)``.
        """
        store = self.ctx.store
        events: list[AssignmentEvent] = []
        with_work: set[str] = set()
        if cached:
            committed = dict(self._committed)
        else:
            states = ((d.name, self.committed_state(d.name, d)) for d in store.list_deployments())
            committed = {name: c for name, c in states if c is not None}
        for name in sorted(committed.keys() | self._rollouts.keys()):
            c = committed.get(name)
            if c is not None and node in c.nodes():
                with_work.add(name)
                events.append(self._commit_event(name, c, node))
            r = self._rollouts.get(name)
            if r is not None and node in r.parts:
                events.append(self._prepare_event(name, r, r.parts[node]))
        unknown: list[str] = []
        for name in sorted(set(applied) - with_work):
            record = store.get_deployment(name, include_deleted=True)
            if record is None:
                if deleted_here(store, name, applied[name]):
                    events.append(AssignmentEvent(name, "", applied[name], "remove"))
                else:
                    unknown.append(name)
                continue
            c = None if record.deleted else self.committed_state(name)
            if c is not None and node in c.nodes():  # not in memory yet: send it
                events.append(self._commit_event(name, c, node))
            elif self._known_here(record, c, applied[name]):
                events.append(AssignmentEvent(name, "", record.committed_version or 0, "remove"))
            else:
                unknown.append(name)
        return events, unknown

    def unknown_of(self, applied: Mapping[str, int]) -> list[str]:
        """The deployments of ``applied`` (name -> version an agent runs) this store has no
        record of: never held here, or at a version it never allocated."""
        out = []
        for name, version in sorted(applied.items()):
            if self._committed.get(name) is not None and self._committed[name].version == version:
                continue  # what it was sent
            store = self.ctx.store
            d = store.get_deployment(name, include_deleted=True)
            if d is None and deleted_here(store, name, version):
                continue  # deleted: REMOVEd when its stream opens, or by the sweep
            latest = store.list_plans(name, limit=1) if d is not None else []
            if d is None or not latest or version > latest[0].version:
                out.append(name)
        return out

    def _known_here(self, d: StoredDeployment, c: Committed | None, applied_version: int) -> bool:
        """Whether the store holds the record that makes removing ``d`` from a node right: a
        tombstone, or a live deployment whose committed plan ``c`` (readable) leaves the node
        out, and a version the node runs that this store allocated."""
        if d.deleted:
            return True
        latest = self.ctx.store.list_plans(d.name, limit=1)
        if not latest or applied_version > latest[0].version:
            return False  # a version from another store
        return d.committed_version is None or c is not None

    # ----------------------------------------------------------------- acks

    def ack(
        self, node: str, deployment: str, plan_id: str, version: int, state: AckState, reason: str
    ) -> bool:
        """Record an ack of a registered node (session checked by the caller); returns True
        when it was a duplicate.

        Raises:
            NotFoundError: unknown deployment or version. PreconditionError: wrong plan id,
            the node has no part, or PREPARED for a rollout that is over.
        """
        r = self._rollouts.get(deployment)
        c = self._committed.get(deployment)
        plan_state, stored_id, nodes = self._acked_plan(deployment, version, r, c)
        _check_ack(deployment, version, node, plan_id, state, plan_state, stored_id, nodes)
        now = self.ctx.clock()
        self.nodes.heard_from(node, now)  # an ack is as good a sign of life as a heartbeat
        known = self._known_acks(deployment, version)
        duplicate = state in known.get(node, ())
        if not duplicate:
            known.setdefault(node, set()).add(state)
            self._ack_buffer.append(
                StoredAck(deployment, version, node, state, reason, self.ctx.clock())
            )
        if r is not None and r.version == version:
            if state == "prepared":
                r.prepared.add(node)
            elif state == "failed":
                r.failed[node] = reason
        self.ctx.wake()  # the next tick stores the buffered acks (and commits when all prepared)
        if state == "failed":
            self.ctx.log.warning(
                "agent failed", node=node, deployment=deployment, version=version, reason=reason
            )
        return duplicate

    def _acked_plan(
        self, deployment: str, version: int, r: _Rollout | None, c: Committed | None
    ) -> tuple[str, str, Collection[str]]:
        """(plan state, plan id, nodes with a part) of the acked version, from memory for
        the rollout in flight and the committed version, else from the store.

        Raises:
            NotFoundError: unknown deployment or version.
        """
        store = self.ctx.store
        if (r is None and c is None) and store.get_deployment(
            deployment, include_deleted=True
        ) is None:
            raise NotFoundError(f"no deployment {deployment!r}", field="deployment")
        if r is not None and r.version == version:
            return "preparing", r.plan_id, r.parts
        if c is not None and c.version == version:  # COMMITTED acks: no store read
            return "committed", c.plan.id, c.parts
        stored = store.get_plan(deployment, version, with_plan=False)
        if stored is None:
            raise NotFoundError(
                f"deployment {deployment!r} has no plan version {version}", field="version"
            )
        return stored.state, stored.plan_id, frozenset(stored.nodes)

    def _known_acks(self, deployment: str, version: int) -> dict[str, set[AckState]]:
        """node -> ack states recorded for a version (stored or buffered), cached for the
        few versions being acked at a time."""
        key = (deployment, version)
        known = self._ack_cache.get(key)
        if known is None:
            self.flush_acks()
            known = {}
            for a in self.ctx.store.acks(deployment, version):
                known.setdefault(a.node, set()).add(a.state)
            self._ack_cache[key] = known
            while len(self._ack_cache) > 32:
                self._ack_cache.pop(next(iter(self._ack_cache)))
        return known

    def flush_acks(self) -> None:
        """Store buffered acks in one transaction. Acks are buffered because a rollout
        brings one per node and phase; an ack lost in a crash before its flush is sent
        again by the agent (a new stream replays the PREPARE, acks are idempotent), and the
        commit point is only reached in a tick, after the flush."""
        if self._ack_buffer:
            batch, self._ack_buffer = self._ack_buffer, []
            self.ctx.store.record_acks(batch)

    def acks_of(self, deployment: str, version: int) -> dict[str, str]:
        """node -> latest ack state (``failed: reason`` for failures)."""
        self.flush_acks()
        out: dict[str, str] = {}
        for a in self.ctx.store.acks(deployment, version):
            out[a.node] = f"failed: {a.reason}" if a.state == "failed" else a.state
        return out


def _check_ack(
    deployment: str,
    version: int,
    node: str,
    plan_id: str,
    state: AckState,
    plan_state: str,
    stored_id: str,
    nodes: Collection[str],
) -> None:
    """Refuse an ack that does not fit the acked version.

    Raises:
        PreconditionError: wrong plan id, the node has no part, PREPARED for a rollout that
        is over, or COMMITTED for a version that is not committed.
    """
    if plan_id and plan_id != stored_id:
        raise PreconditionError(
            f"version {version} of {deployment!r} is plan {stored_id}, not {plan_id}",
            field="plan_id",
        )
    if node not in nodes:
        raise PreconditionError(
            f"node {node} has no part in version {version} of {deployment!r}", field="node"
        )
    if state == "prepared" and plan_state not in ("preparing", "committed"):
        raise PreconditionError(
            f"version {version} of {deployment!r} is {plan_state}; discard the staged part",
            field="version",
        )
    if state == "committed" and plan_state not in ("committed", "superseded"):
        raise PreconditionError(
            f"version {version} of {deployment!r} is {plan_state}, not committed",
            field="version",
        )


def deleted_here(store: object, name: str, version: int) -> bool:
    """Whether a store without tombstones knows ``name`` at ``version`` as deleted
    (:class:`~controlplane.store.base.DeletionRecord`); False for other stores."""
    return isinstance(store, DeletionRecord) and store.deleted_here(name, version)
