"""The controller's view of its nodes: registry, sessions and liveness.

:class:`NodeRegistry` owns the in-memory copy of every stored node (a write-through cache),
each node's session, when each was last heard from, the credit for the controller's own
stalls, and which nodes the reconcile loop has marked lost. Liveness lives in memory; the
store gets a node's last heartbeat time at most every ``heartbeat_persist_s``.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import replace

from controlplane.errors import NotFoundError, PreconditionError
from controlplane.server import reconcile as rc
from controlplane.server.controller.common import Context, NodeHealth, NodeView, RegisterResult
from controlplane.store import NodeState, StoredNode
from policies.errors import InputError
from policies.hardware.fleet import Fleet, check_reachable
from policies.hardware.inventory import GpuHealth, NodeInventory, check_inventory
from policies.plan import Plan

#: Lateness of a tick beyond ``tick_s`` that still counts as on time, s.
STALL_TOLERANCE_S = 0.25


def reachable_or_precondition(fleet: Fleet) -> None:
    """Refuse a fleet of reported nodes that cannot all reach each other (through
    :func:`policies.hardware.fleet.check_reachable`, the check of every entry point): a state of the
    registered nodes, not a bad request, so FAILED_PRECONDITION.

    Raises:
        PreconditionError: naming the two nodes and the fix.
    """
    try:
        check_reachable(fleet, field="")
    except InputError as exc:
        raise PreconditionError(
            f"{exc}. A reported node's fabric is what its agent says: mixfleet-agent "
            "--nic-fabric DEVICE=NAME or --default-fabric NAME",
            field="nodes",
        ) from exc


class NodeRegistry:
    """Registered nodes, their sessions and their liveness (see the module docstring).

    Args:
        ctx: the controller's shared dependencies.
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._nodes: dict[str, StoredNode] = {}  # write-through cache of the store's nodes
        self._sessions: dict[str, str] = {}
        self._last_seen: dict[str, float] = {}
        # Liveness credit for the controller's own stalls (see credit_stall): total stalled
        # seconds so far, and that total when each node was last heard from.
        self._stalled_s = 0.0
        self._stalled_at_seen: dict[str, float] = {}
        self._last_persisted: dict[str, float] = {}
        #: Nodes the reconcile loop marked lost (and plans around).
        self.lost: set[str] = set()
        self._names: list[str] = []  # sorted names of self._nodes
        self._obs: dict[str, tuple[StoredNode, float, bool, rc.NodeObs]] = {}
        # Liveness floor after a restart (Unix s): no node counts as silent from before it.
        self._grace_floor_s = 0.0
        #: node -> deployments its agent runs that the store has no record of.
        self._unknown: dict[str, tuple[str, ...]] = {}

    def recover(self, now_s: float, down_s: float | None = None) -> None:
        """Load every stored node after a (re)start. Each counts as heard from at ``now_s``
        (Unix s) plus a grace of ``down_s`` - how long the controller was down, at most
        ``restart_grace_max_s``; unknown (None) = that maximum - because agents back off
        while the controller is away and need about that long to be back."""
        cap = self.ctx.settings.restart_grace_max_s
        grace = cap if down_s is None else min(max(down_s, 0.0), cap)
        for n in self.ctx.store.list_nodes():
            self._nodes[n.name] = n
            self._sessions[n.name] = n.session_id
            self._last_seen[n.name] = max(now_s, n.last_heartbeat_s)
            self._last_persisted[n.name] = n.last_heartbeat_s
        if self._nodes:  # no grace on a store without nodes (the first start)
            self._grace_floor_s = now_s + grace
            self.ctx.log.info(
                "restart grace",
                nodes=len(self._nodes),
                down_s=None if down_s is None else round(down_s, 1),
                grace_s=round(grace + self.ctx.settings.node_lost_after_s, 1),
            )

    def get(self, name: str) -> StoredNode | None:
        """The node's current record, or None when it never registered."""
        return self._nodes.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def has_session(self, node: str, session_id: str) -> bool:
        """Whether ``session_id`` is the node's current session."""
        return self._sessions.get(node) == session_id

    # ----------------------------------------------------------------- liveness

    def credit_stall(self, gap_s: float) -> None:
        """Account for the event loop having been unable to run the reconcile loop.

        Ticks start at most ``tick_s`` apart while the loop is free; a longer ``gap_s``
        between two tick starts means the loop was stalled (overloaded, or a tick's own work),
        and meanwhile heartbeats waited unread in gRPC's queues. That excess is not counted
        as any node's silence: without this credit an overloaded controller would declare
        healthy nodes lost and re-plan around them, overloading itself further.
        """
        late = gap_s - self.ctx.settings.tick_s - STALL_TOLERANCE_S
        if late > 0:
            self._stalled_s += late
            self.ctx.metrics.loop_stall_seconds.inc(late)
            self.ctx.log.warning("controller stalled", stalled_s=round(late, 3))

    def seen(self, name: str, fallback_s: float) -> float:
        """When ``name`` was last heard from for liveness (Unix s): the last heartbeat, moved
        later by the time this controller has been stalled since (see :meth:`credit_stall`)."""
        seen = self._last_seen.get(name, fallback_s)
        seen += self._stalled_s - self._stalled_at_seen.get(name, self._stalled_s)
        return max(seen, self._grace_floor_s)

    def heard_from(self, name: str, now_s: float) -> None:
        """Record a sign of life from ``name`` at ``now_s`` (Unix s)."""
        self._last_seen[name] = now_s
        self._stalled_at_seen[name] = self._stalled_s

    def set_lost(self, a: rc.SetNodeLost) -> None:
        """Carry out the decision to mark a node lost (or back)."""
        if a.lost:
            self.lost.add(a.node)
            self.ctx.log.warning("node lost", node=a.node, reason=a.reason)
        else:
            self.lost.discard(a.node)
            self.ctx.log.info("node back", node=a.node, reason=a.reason)

    # ----------------------------------------------------------------- observe

    def observe(self) -> tuple[rc.NodeObs, ...]:
        """Every node as the decision sees it (sorted by name); updates the node gauges."""
        if len(self._names) != len(self._nodes):
            self._names = sorted(self._nodes)
        nodes = [self._node_obs(name) for name in self._names]
        alive = sum(1 for n in nodes if not n.marked_lost and n.state != "draining")
        self.ctx.metrics.nodes.set(len(nodes))
        self.ctx.metrics.healthy_nodes.set(alive)
        return tuple(nodes)

    def _node_obs(self, name: str) -> rc.NodeObs:
        """The node as the decision sees it, rebuilt only when its record, liveness or
        lost mark changed (observe runs several times a second over every node)."""
        n = self._nodes[name]
        seen = self.seen(name, n.last_heartbeat_s)
        lost = name in self.lost
        cached = self._obs.get(name)
        if cached is not None and cached[0] is n and cached[1] == seen and cached[2] == lost:
            return cached[3]
        if cached is not None and cached[0].inventory is n.inventory:
            labels, healthy = cached[3].labels, cached[3].healthy_gpus
        else:
            labels, healthy = dict(n.inventory.labels), _healthy_gpu_ids(n.inventory)
        obs = rc.NodeObs(name, labels, seen, n.state, healthy, lost)
        self._obs[name] = (n, seen, lost, obs)
        return obs

    def fleet_for(self, name: str, nodes: Sequence[str]) -> Fleet:
        """The planning core's fleet of the named nodes' healthy GPUs (in the given order)."""
        out = []
        for n in nodes:
            stored = self._nodes.get(n)
            if stored is None:
                continue
            node = stored.inventory.to_node(healthy_only=True)
            if node.gpus:
                out.append(node)
        return Fleet(name, tuple(out))

    def uuids(self, plan: Plan) -> dict[str, str]:
        """GPU id -> hardware UUID of the plan's GPUs, from the nodes' inventories."""
        uuids: dict[str, str] = {}
        for node in {g.node for g in plan.gpus}:
            stored = self._nodes.get(node)
            if stored is not None:
                for g in stored.inventory.gpus:
                    uuids[f"{node}/gpu{g.index}"] = g.uuid
        return uuids

    def node_views(self, only: str | None = None) -> list[NodeView]:
        """Every node (sorted by name), or just the one called ``only`` (none if unknown)."""
        now = self.ctx.clock()
        out = []
        if only is not None:
            chosen = [self._nodes[only]] if only in self._nodes else []
        else:
            chosen = sorted(self._nodes.values(), key=lambda n: n.name)
        for n in chosen:
            seen = self._last_seen.get(n.name, n.last_heartbeat_s)
            health: NodeHealth
            silent = now - self.seen(n.name, n.last_heartbeat_s)
            if n.name in self.lost or silent >= self.ctx.settings.node_lost_after_s:
                health = "lost"
            elif n.state == "draining":
                health = "draining"
            elif n.state == "degraded" or len(n.inventory.healthy_gpus()) < len(n.inventory.gpus):
                health = "degraded"
            else:
                health = "ready"
            out.append(NodeView(n, health, seen, self._unknown.get(n.name, ())))
        return out

    def report_unknown(self, node: str, names: Sequence[str]) -> None:
        """Record what the node's agent runs that the store has no record of (left running,
        never removed); logged when it changes."""
        before = self._unknown.get(node, ())
        now = tuple(sorted(names))
        if now == before:
            return
        if now:
            self._unknown[node] = now
            self.ctx.log.warning(
                "agent runs deployments this store has no record of; left running",
                node=node,
                deployments=list(now),
                hint="a replaced or restored store is the usual cause. To fix: restore the "
                "store, or apply those deployments again, or remove them on the node",
            )
        else:
            self._unknown.pop(node, None)

    def delete(self, name: str) -> bool:
        """Forget a node: the store's record, its session and liveness (the caller checked
        that it may go). True when it existed."""
        existed = self.ctx.store.delete_node(name)
        known = self._nodes.pop(name, None) is not None
        for table in (self._sessions, self._last_seen, self._stalled_at_seen):
            table.pop(name, None)
        self._last_persisted.pop(name, None)
        self._obs.pop(name, None)
        self._unknown.pop(name, None)
        self.lost.discard(name)
        self._names = sorted(self._nodes)
        if existed or known:
            self.ctx.log.info("node deleted", node=name)
            self.ctx.wake()
        return existed or known

    def silent_s(self, name: str) -> float:
        """Seconds since the node was last heard from (liveness clock, s)."""
        n = self._nodes.get(name)
        return self.ctx.clock() - self.seen(name, n.last_heartbeat_s if n else 0.0)

    # ----------------------------------------------------------------- AgentService

    def register(self, inventory: NodeInventory) -> RegisterResult:
        """Register (or re-register) a node; starts a new session. The caller ends the
        node's old assignment stream.

        Raises:
            InputError: naming the field (``inventory.gpus[1].uuid``...).
        """
        check_inventory(inventory)
        now = self.ctx.clock()
        session = secrets.token_hex(8)
        previous = self._nodes.get(inventory.node)
        stored = StoredNode(
            name=inventory.node,
            inventory=inventory,
            session_id=session,
            registered_at_s=now,
            last_heartbeat_s=now,
            state=previous.state if previous is not None else "ready",
            message=previous.message if previous is not None else "",
            applied=previous.applied if previous is not None else {},
        )
        self.ctx.store.upsert_node(stored)
        self._nodes[inventory.node] = stored
        self._sessions[inventory.node] = session
        self.heard_from(inventory.node, now)
        self._last_persisted[inventory.node] = now
        self.ctx.log.info(
            "node registered",
            node=inventory.node,
            gpus=len(inventory.gpus),
            simulated=inventory.simulated,
            agent_version=inventory.agent_version,
            rejoined=previous is not None,
        )
        self.ctx.wake()
        return RegisterResult(
            inventory.node,
            session,
            self.ctx.settings.heartbeat_interval_s,
            self.ctx.settings.node_lost_after_s,
            self.ctx.store.controller_id(),
        )

    def heartbeat(
        self,
        node: str,
        session_id: str,
        *,
        state: NodeState = "ready",
        message: str = "",
        health: Mapping[int, GpuHealth] | None = None,
        applied: Mapping[str, int] | None = None,
    ) -> bool:
        """Record a heartbeat; returns False when the agent must register again.

        Raises:
            InputError: a health report names a GPU index the node does not have.
        """
        if not node:
            raise InputError("node name is empty", field="node")
        if self._sessions.get(node) != session_id:
            return False
        stored = self._nodes.get(node)
        if stored is None:
            return False
        now = self.ctx.clock()
        self.heard_from(node, now)
        inventory = self._with_health(stored, health) if health else None
        new_applied = dict(applied) if applied is not None else None
        if new_applied == dict(stored.applied):
            new_applied = None
        if new_applied is not None and node in self._unknown:
            self.report_unknown(node, [d for d in self._unknown[node] if d in new_applied])
        persist = now - self._last_persisted.get(node, 0.0) >= self.ctx.settings.heartbeat_persist_s
        if (
            inventory is not None
            or new_applied is not None
            or state != stored.state
            or message != stored.message
            or persist
        ):
            self.ctx.store.update_node_status(
                node,
                inventory=inventory,
                last_heartbeat_s=now,
                state=state if state != stored.state else None,
                message=message if message != stored.message else None,
                applied=new_applied,
            )
            self._last_persisted[node] = now
            self._nodes[node] = replace(
                stored,
                inventory=inventory or stored.inventory,
                last_heartbeat_s=now,
                state=state,
                message=message,
                applied=new_applied if new_applied is not None else stored.applied,
            )
        if inventory is not None or state != stored.state or node in self.lost:
            self.ctx.wake()
        return True

    def _with_health(
        self, stored: StoredNode, health: Mapping[int, GpuHealth]
    ) -> NodeInventory | None:
        """The node's inventory with the reported GPU health, or None when nothing changed.

        Raises:
            InputError: a GPU index the node does not have.
        """
        node = stored.name
        by_index = {g.index: g for g in stored.inventory.gpus}
        gpus = list(stored.inventory.gpus)
        changed = False
        for index, h in health.items():
            if index not in by_index:
                raise InputError(f"node {node} has no GPU {index}", field="gpu_health.index")
            if by_index[index].health != h:
                pos = next(i for i, g in enumerate(gpus) if g.index == index)
                gpus[pos] = replace(gpus[pos], health=h)
                changed = True
        if not changed:
            return None
        inventory = replace(stored.inventory, gpus=tuple(gpus))
        self.ctx.log.info(
            "GPU health changed",
            node=node,
            healthy=len(inventory.healthy_gpus()),
            gpus=len(gpus),
        )
        return inventory

    def check_stream(self, node: str, session_id: str) -> None:
        """Check that ``node`` may open its assignment stream with ``session_id``.

        Raises:
            NotFoundError: unregistered node. PreconditionError: stale session.
        """
        if node not in self._nodes:
            raise NotFoundError(
                f"node {node!r} is not registered. To fix: call Register first", field="node"
            )
        if self._sessions.get(node) != session_id:
            raise PreconditionError(
                "stale session. To fix: call Register again and use its session_id",
                field="session_id",
            )

    def check_ack(self, node: str, session_id: str) -> None:
        """Check that ``node`` may ack with ``session_id``: the live session of the node's
        registered agent (an empty or stale session is refused).

        Raises:
            NotFoundError: unregistered node. PreconditionError: stale or empty session.
        """
        if node not in self._nodes:
            raise NotFoundError(f"node {node!r} is not registered", field="node")
        if not session_id:
            raise PreconditionError(
                "missing: an ack carries the session_id of the node agent's Register. To fix: "
                "register, then ack with the session_id it returned",
                field="session_id",
            )
        if self._sessions.get(node) != session_id:
            raise PreconditionError(
                "stale session. To fix: call Register again", field="session_id"
            )


def _healthy_gpu_ids(inv: NodeInventory) -> tuple[str, ...]:
    return tuple(f"{inv.node}/gpu{g.index}" for g in inv.healthy_gpus())
