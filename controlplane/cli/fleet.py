"""``mixfleetctl fleet show FILE``: a fleet file's nodes, GPUs, links and totals."""

from __future__ import annotations

import argparse

from controlplane.cli import files
from controlplane.cli.output import (
    Groups,
    add_group,
    add_leaf,
    add_output_arg,
    emit,
    format_table,
    gpu_groups,
)
from policies.fleet import fleet_to_doc


def cmd_fleet_show(args: argparse.Namespace) -> int:
    """``fleet show FILE``: nodes, GPUs, links and totals."""
    fleet = files.read_fleet(args.file)
    if args.output != "table":
        emit(files.dump_document(fleet_to_doc(fleet), args.output))
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
    fleet = add_group(groups, "fleet", "inspect fleet files")
    p = add_leaf(fleet, "show", cmd_fleet_show, "show a fleet file's nodes, GPUs and links")
    p.add_argument("file", metavar="FILE")
    add_output_arg(p)
