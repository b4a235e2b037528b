"""``mixfleetctl fleet show|export``: a fleet's nodes, GPUs, links and totals.

``fleet show FILE`` reads a Fleet file; ``fleet export`` builds the Fleet of the nodes
registered with a live controller (from their agents' inventories: discovered figures,
labels, NVLink domains and NICs), as a Fleet file ``plan solve --fleet`` and the other
offline commands read. ``-o yaml|json`` writes a Fleet document that reads back to the same
fleet, with runs of identical GPUs as one group (``count: 8``).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from controlplane.cli import files
from controlplane.cli.connection import add_client
from controlplane.cli.output import (
    Groups,
    add_group,
    add_leaf,
    add_output_arg,
    emit,
    emit_document,
    format_table,
    gpu_groups,
)
from policies.errors import InputError

if TYPE_CHECKING:
    from policies.hardware.fleet import Fleet


def _group_gpus(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive GPU entries that differ only in ``count`` and ``uuids`` as one entry
    (``{model: H100-SXM5-80GB, count: 8}``); the uuids stay in order."""
    out: list[dict[str, Any]] = []
    for g in gpus:
        rest = {k: v for k, v in g.items() if k not in ("count", "uuids")}
        if out:
            last = out[-1]
            last_rest = {k: v for k, v in last.items() if k not in ("count", "uuids")}
            if last_rest == rest and ("uuids" in last) == ("uuids" in g):
                last["count"] += g.get("count", 1)
                if "uuids" in g:
                    last["uuids"] = [*last["uuids"], *g["uuids"]]
                continue
        out.append({**g, "count": g.get("count", 1)})
    return out


def fleet_document(fleet: Fleet) -> dict[str, Any]:
    """The Fleet document of ``fleet``, GPU groups folded (:func:`_group_gpus`)."""
    from policies.hardware.fleet import fleet_to_doc

    doc = fleet_to_doc(fleet)
    for node in doc["spec"]["nodes"]:
        node["gpus"] = _group_gpus(node["gpus"])
    return doc


def cmd_fleet_show(args: argparse.Namespace) -> int:
    """``fleet show FILE``: nodes, GPUs, links and totals."""
    fleet = files.read_fleet(args.file)
    return _show(fleet, args.output)


def cmd_fleet_export(args: argparse.Namespace) -> int:
    """``fleet export``: the controller's nodes as a Fleet file (stdout or ``--out``)."""
    from mixfleet.v1 import plan_pb2

    from apis.wire.inventory import inventory_from_proto
    from controlplane.cli.connection import call
    from policies.hardware.fleet import Fleet

    reply = call(args, lambda s, md: s.ListNodes(plan_pb2.ListNodesRequest(), metadata=md))
    nodes = []
    for n in reply.nodes:
        if args.node and n.inventory.node not in args.node:
            continue
        node = inventory_from_proto(n.inventory).to_node(healthy_only=not args.all_gpus)
        if node.gpus:
            nodes.append(node)
    if not nodes:
        raise InputError(
            "the controller has no node with a healthy GPU to export. To fix: start the "
            "agents (mixfleet-agent run) or pass --all-gpus",
            field="--controller",
        )
    fleet = Fleet(args.name, tuple(nodes))
    if args.out:
        path = files.write_document(args.out, fleet_document(fleet), "fleet")
        emit(f"fleet/{fleet.name}: {len(nodes)} nodes, {len(fleet.gpus)} GPUs written to {path}")
        return 0
    return _show(fleet, args.output)


def _show(fleet: Fleet, output: str) -> int:
    if output != "table":
        emit_document(fleet_document(fleet), output, [f"fleet/{fleet.name}"])
        return 0
    gpus = fleet.gpus
    memory = sum(g.spec.memory_gib for g in gpus)
    tflops = sum(g.spec.bf16_tflops for g in gpus)
    emit(
        f"fleet {fleet.name}: {len(fleet.nodes)} nodes, {len(gpus)} GPUs, {memory:,.0f} GiB, "
        f"{tflops:,.0f} dense BF16 TFLOPS"
    )
    rows = []
    for n in fleet.nodes:
        nv = (
            f"{n.nvlink.domain} {n.nvlink.per_gpu_bidir_gbytes_per_s:g} GB/s bidirectional"
            if n.nvlink
            else "none (PCIe)"
        )
        nics = ", ".join(
            f"{x.count}x {x.per_direction_gbits_per_s:g} Gb/s {x.fabric} ({'IB' if x.link_layer == 'infiniband' else 'RoCE'})"
            for x in n.nics
        )
        labels = ",".join(f"{k}={v}" for k, v in sorted(n.labels.items()))
        rows.append(
            [
                n.name,
                gpu_groups([g.spec.model for g in n.gpus]),
                nv,
                nics or "-",
                labels or "-",
            ]
        )
    emit(format_table(["node", "GPUs", "NVLink per GPU", "NICs", "labels"], rows))
    for link in fleet.fabric_links:
        emit(
            f"fabric link {link.a} <-> {link.b}: {link.per_direction_gbits_per_s:g} Gb/s, +{link.latency_us:g} us"
        )
    return 0


def register(groups: Groups) -> None:
    """Add the ``fleet`` group."""
    fleet = add_group(groups, "fleet", "inspect fleet files; export a controller's fleet")
    p = add_leaf(fleet, "show", cmd_fleet_show, "show a fleet file's nodes, GPUs and links")
    p.add_argument("file", metavar="FILE")
    add_output_arg(p)
    p = add_client(fleet, "export", cmd_fleet_export, "the controller's nodes as a Fleet file")
    p.add_argument("--name", default="exported", help="the fleet's name (default: %(default)s)")
    p.add_argument("--node", action="append", metavar="NODE", help="only this node (repeatable)")
    p.add_argument("--all-gpus", action="store_true", help="also GPUs the agents report unhealthy")
    p.add_argument("--out", metavar="FILE", help="write the Fleet file (.yaml or .json) here")
