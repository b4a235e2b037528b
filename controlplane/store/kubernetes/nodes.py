"""GPUNodes as the store's nodes: the agent's session and inventory in ``status``."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping
from typing import cast

from apis.kube.client import GPUNODES, Json
from apis.kube.errors import ConflictError
from apis.kube.gpunode import gpu_summary, node_health
from apis.kube.schema import from_wire, to_wire
from apis.kube.v1alpha1 import API_VERSION, AgentSession, GPUNodeSpec, GPUNodeStatus
from controlplane.store.base import NodeState, StoredNode
from controlplane.store.kubernetes.common import KubeBase, from_time, to_time
from policies.errors import InputError
from policies.hardware.inventory import NodeInventory


class NodesMixin(KubeBase):
    """The store's nodes on GPUNode objects."""

    def _node_status(self, node: StoredNode) -> Json:
        inv = dataclasses.replace(node.inventory, node=node.name)
        status = GPUNodeStatus(
            inventory=inv,
            health=node_health(inv),
            last_heartbeat_time=to_time(node.last_heartbeat_s),
            gpu_count=len(inv.gpus),
            gpu_summary=gpu_summary(inv),
            agent=AgentSession(
                session_id=node.session_id,
                registered_time=to_time(node.registered_at_s),
                state=node.state,
                message=node.message[:4096],
                applied=dict(node.applied),
            ),
        )
        return to_wire(status)

    def upsert_node(self, node: StoredNode) -> None:
        def run() -> None:
            if self._kube.get(GPUNODES, node.name) is None:
                # A server-side apply of the labels alone (not a create, not forced): the
                # controller owns the labels it set and nothing of the spec, so an
                # administrator's `kubectl apply --server-side` of spec.cordon or spec.tier
                # needs no --force-conflicts (a create would own the defaulted spec fields).
                body = {
                    "apiVersion": API_VERSION,
                    "kind": "GPUNode",
                    "metadata": {"name": node.name, "labels": dict(node.inventory.labels)},
                }
                # Created meanwhile with other label values: the status write below still
                # applies, the other writer's labels stay.
                with contextlib.suppress(ConflictError):
                    self._kube.apply(GPUNODES, body)
            self._apply_status(node)

        self._call(f"upsert node {node.name}", run)

    def _apply_status(self, node: StoredNode) -> None:
        """Apply the node's status, forced: the controller alone writes GPUNode status."""
        self._kube.apply(
            GPUNODES,
            {"metadata": {"name": node.name}, "status": self._node_status(node)},
            subresource="status",
            force=True,
        )

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
        current = self.get_node(name)
        if current is None:
            return
        updated = dataclasses.replace(
            current,
            inventory=inventory if inventory is not None else current.inventory,
            last_heartbeat_s=(
                last_heartbeat_s if last_heartbeat_s is not None else current.last_heartbeat_s
            ),
            state=state if state is not None else current.state,
            message=message if message is not None else current.message,
            applied=dict(applied) if applied is not None else current.applied,
        )
        self._call(f"update node {name}", lambda: self._apply_status(updated))

    @staticmethod
    def _stored_node(obj: Json) -> StoredNode | None:
        try:
            status = from_wire(GPUNodeStatus, obj.get("status") or {}, "status")
        except InputError:
            return None
        if status.inventory is None or status.agent is None:
            return None
        a = status.agent
        return StoredNode(
            name=str(obj["metadata"]["name"]),
            inventory=status.inventory,
            session_id=a.session_id,
            registered_at_s=from_time(a.registered_time),
            last_heartbeat_s=from_time(status.last_heartbeat_time),
            state=cast(NodeState, a.state),
            message=a.message,
            applied=dict(a.applied),
        )

    def get_node(self, name: str) -> StoredNode | None:
        obj = self._call(f"get node {name}", lambda: self._kube.get(GPUNODES, name))
        return self._stored_node(obj) if obj is not None else None

    def list_nodes(self) -> list[StoredNode]:
        items, _ = self._call("list nodes", lambda: self._kube.list(GPUNODES))
        nodes = [n for n in (self._stored_node(o) for o in items) if n is not None]
        return sorted(nodes, key=lambda n: n.name)

    def cordoned_nodes(self) -> frozenset[str]:
        """GPUNodes an administrator cordoned (``spec.cordon``); a spec that does not parse
        counts as cordoned, as the operator reads it. Listed again at most every
        ``cordon_refresh_s`` (the reconcile loop asks on every tick)."""
        now = time.monotonic()
        if self._cordoned is not None and now - self._cordoned[0] < self.cordon_refresh_s:
            return self._cordoned[1]
        items, _ = self._call("list cordoned nodes", lambda: self._kube.list(GPUNODES))
        out = set()
        for obj in items:
            try:
                cordon = from_wire(GPUNodeSpec, obj.get("spec") or {}, "spec", strict=True).cordon
            except InputError:
                cordon = True
            if cordon:
                out.add(str(obj["metadata"]["name"]))
        self._cordoned = (now, frozenset(out))
        return self._cordoned[1]

    def delete_node(self, name: str) -> bool:
        return bool(self._call(f"delete node {name}", lambda: self._kube.delete(GPUNODES, name)))
