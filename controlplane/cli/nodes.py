"""``mixfleetctl nodes list|show|delete``: the nodes registered with the controller.

``list``: one row per node (health, healthy GPUs, GPU models, labels, the address its
engines serve at, last heartbeat); ``show NODE``: the node as YAML (health, address, agent,
labels, applied plan versions, the deployments the fleet scheduler assigned it to, those its
agent runs that the controller has no record of: left running), then its GPUs and NICs as
tables; ``delete NODE``: forget a node whose agent is gone (refused while it serves a plan or
still heartbeats, unless ``--force``). ``-o json`` for scripts.
"""

from __future__ import annotations

import argparse
from typing import Any

from controlplane.cli.connection import add_client, age, call, to_json
from controlplane.cli.files import dump_document
from controlplane.cli.output import Groups, add_group, emit, emit_document, table


def cmd_nodes_list(args: argparse.Namespace) -> int:
    from mixfleet.v1 import plan_pb2

    reply = call(args, lambda s, md: s.ListNodes(plan_pb2.ListNodesRequest(), metadata=md))
    if args.output != "table":
        docs = to_json(reply)["nodes"] if reply.nodes else []
        emit_document(docs, args.output, [f"node/{n.inventory.node}" for n in reply.nodes])
        return 0
    from controlplane.wire.plans import NODE_HEALTH_NAMES

    rows = []
    for n in reply.nodes:
        inv = n.inventory
        models = sorted({g.catalog_model or g.name for g in inv.gpus})
        rows.append(
            [
                inv.node,
                NODE_HEALTH_NAMES.get(n.health, "?"),
                f"{n.healthy_gpus}/{len(inv.gpus)}",
                ",".join(models),
                ",".join(f"{k}={v}" for k, v in sorted(inv.labels.items())) or "-",
                inv.address or inv.node,
                "yes" if inv.simulated else "no",
                age(n.last_heartbeat_unix_s),
            ]
        )
    header = ["NODE", "HEALTH", "GPUS", "MODELS", "LABELS", "ADDRESS", "SIMULATED", "SEEN"]
    print(table(header, rows))
    return 0


def cmd_nodes_show(args: argparse.Namespace) -> int:
    from mixfleet.v1 import plan_pb2

    n = call(args, lambda s, md: s.GetNode(plan_pb2.GetNodeRequest(name=args.name), metadata=md))
    if args.output != "table":
        emit_document(to_json(n), args.output, [f"node/{n.inventory.node}"])
        return 0
    from controlplane.wire.plans import NODE_HEALTH_NAMES

    inv = n.inventory
    header: dict[str, Any] = {
        "node": inv.node,
        "health": NODE_HEALTH_NAMES.get(n.health, "?"),
    }
    if n.message:
        header["message"] = n.message
    header["address"] = inv.address or f"{inv.node} (the node name)"  # where its engines serve
    header["agent"] = inv.agent_version + (" (simulated)" if inv.simulated else "")
    header["discoveredBy"] = list(inv.discovered_by)
    header["labels"] = dict(sorted(inv.labels.items()))
    header["seen"] = f"{age(n.last_heartbeat_unix_s)} ago"
    header["applied"] = to_json(n, proto_names=False).get("applied", {})  # deployment: version
    header["assignedTo"] = _holders(args, inv.node)  # by the fleet scheduler
    if n.unknown_deployments:
        # no record in the controller's store; left running
        header["unknownDeployments"] = list(n.unknown_deployments)
    emit(dump_document(header, "yaml"))
    rows = []
    for g in inv.gpus:
        nv = sum(1 for link in g.nvlinks if link.active)
        rows.append(
            [
                g.index,
                g.catalog_model or g.name,
                g.uuid,
                f"{g.memory_bytes / 2**30:.0f}",
                f"{g.hbm_bandwidth_gbytes_per_s:.0f}",
                nv,
                g.nvlink_domain if g.HasField("nvlink_domain") else "-",
            ]
        )
    print(table(["GPU", "MODEL", "UUID", "MEM_GIB", "HBM_GBS", "NVLINKS", "DOMAIN"], rows))
    if inv.nics:
        print(
            table(
                ["NIC", "PORT", "GBIT/S", "STATE", "LAYER", "FABRIC"],
                [
                    [
                        c.device,
                        c.port,
                        f"{c.rate_per_direction_gbits_per_s:g}",
                        c.state,
                        c.link_layer,
                        c.fabric,
                    ]
                    for c in inv.nics
                ],
            )
        )
    return 0


def _holders(args: argparse.Namespace, node: str) -> list[str]:
    """The deployments the fleet scheduler assigned ``node`` to."""
    from mixfleet.v1 import plan_pb2

    reply = call(
        args, lambda s, md: s.ListDeployments(plan_pb2.ListDeploymentsRequest(), metadata=md)
    )
    return [d.spec.name for d in reply.deployments if node in d.status.assigned_nodes]


def cmd_nodes_delete(args: argparse.Namespace) -> int:
    from mixfleet.v1 import plan_pb2

    request = plan_pb2.DeleteNodeRequest(name=args.name, force=args.force)
    reply = call(args, lambda s, md: s.DeleteNode(request, metadata=md))
    if args.output != "table":
        emit_document(to_json(reply), args.output, [f"node/{args.name}"])
        return 0
    moved = f"; re-planning {', '.join(reply.deployments)}" if reply.deployments else ""
    print(f"node {args.name} deleted{moved}")
    return 0


def register(groups: Groups) -> None:
    """Add the ``nodes`` group."""
    nodes = add_group(groups, "nodes", "nodes registered with the controller", required=False)
    add_client(nodes, "list", cmd_nodes_list, "list nodes, their health and GPUs")
    p = add_client(nodes, "show", cmd_nodes_show, "show one node's inventory")
    p.add_argument("name", metavar="NODE")
    p = add_client(nodes, "delete", cmd_nodes_delete, "forget a node whose agent is gone")
    p.add_argument("name", metavar="NODE")
    p.add_argument(
        "--force",
        action="store_true",
        help="also while it serves a plan (its deployments re-plan) or still heartbeats",
    )
