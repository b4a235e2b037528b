"""Conversions between :mod:`policies.hardware.inventory` dataclasses and the ``mixfleet.v1`` messages.

Both sides of AgentService use these: the agent to send its inventory and GPU health, the
controller to read them back. They only copy fields; validation is
:func:`policies.hardware.inventory.check_inventory` (the controller runs it on every Register).

This is the one proto codec of :class:`policies.hardware.inventory.NodeInventory`; its JSON mapping
(:func:`inventory_to_proto_json`, what the SQLite store keeps) goes through it too. The
plain JSON codec is :func:`policies.hardware.inventory.inventory_to_dict`, the CRD codec
:func:`apis.kube.gpunode.inventory_to_crd`.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format
from mixfleet.v1 import inventory_pb2 as pb

from policies.hardware.inventory import (
    GpuHealth,
    GpuInventory,
    NicInventory,
    NodeInventory,
    NvLinkInfo,
)


def health_to_proto(h: GpuHealth) -> pb.GpuHealth:
    msg = pb.GpuHealth(xid_errors=list(h.xid_errors))
    if h.ecc_uncorrected_volatile is not None:
        msg.ecc_uncorrected_volatile = h.ecc_uncorrected_volatile
    if h.retired_pages is not None:
        msg.retired_pages = h.retired_pages
    if h.remapped_rows_pending is not None:
        msg.remapped_rows_pending = h.remapped_rows_pending
    if h.remapped_rows_failed is not None:
        msg.remapped_rows_failed = h.remapped_rows_failed
    return msg


def health_from_proto(msg: pb.GpuHealth) -> GpuHealth:
    return GpuHealth(
        ecc_uncorrected_volatile=(
            msg.ecc_uncorrected_volatile if msg.HasField("ecc_uncorrected_volatile") else None
        ),
        retired_pages=msg.retired_pages if msg.HasField("retired_pages") else None,
        remapped_rows_pending=(
            msg.remapped_rows_pending if msg.HasField("remapped_rows_pending") else None
        ),
        remapped_rows_failed=(
            msg.remapped_rows_failed if msg.HasField("remapped_rows_failed") else None
        ),
        xid_errors=tuple(msg.xid_errors),
    )


def gpu_to_proto(g: GpuInventory) -> pb.Gpu:
    msg = pb.Gpu(
        index=g.index,
        uuid=g.uuid,
        name=g.name,
        catalog_model=g.catalog_model,
        architecture=g.architecture,
        compute_capability=g.compute_capability,
        sms=g.sms,
        memory_bytes=g.memory_bytes,
        hbm_bandwidth_gbytes_per_s=g.hbm_bandwidth_gbytes_per_s,
        sm_clock_mhz=g.sm_clock_mhz,
        power_limit_w=g.power_limit_w,
        pci_bus_id=g.pci_bus_id,
        pcie_generation=g.pcie_generation,
        pcie_width=g.pcie_width,
        nvlinks=[
            pb.NvLink(
                link=n.link, active=n.active, generation=n.generation, remote_bus_id=n.remote_bus_id
            )
            for n in g.nvlinks
        ],
        measured=dict(g.measured),
        health=health_to_proto(g.health),
    )
    if g.nvlink_domain is not None:
        msg.nvlink_domain = g.nvlink_domain
    return msg


def gpu_from_proto(msg: pb.Gpu) -> GpuInventory:
    return GpuInventory(
        index=msg.index,
        uuid=msg.uuid,
        name=msg.name,
        catalog_model=msg.catalog_model,
        architecture=msg.architecture,
        compute_capability=msg.compute_capability,
        sms=msg.sms,
        memory_bytes=msg.memory_bytes,
        hbm_bandwidth_gbytes_per_s=msg.hbm_bandwidth_gbytes_per_s,
        sm_clock_mhz=msg.sm_clock_mhz,
        power_limit_w=msg.power_limit_w,
        pci_bus_id=msg.pci_bus_id,
        pcie_generation=msg.pcie_generation,
        pcie_width=msg.pcie_width,
        nvlinks=tuple(
            NvLinkInfo(n.link, n.active, n.generation, n.remote_bus_id) for n in msg.nvlinks
        ),
        nvlink_domain=msg.nvlink_domain if msg.HasField("nvlink_domain") else None,
        measured=dict(msg.measured),
        health=health_from_proto(msg.health),
    )


def inventory_to_proto(inv: NodeInventory) -> pb.Inventory:
    """The wire form of a node's inventory (AgentService.Register)."""
    return pb.Inventory(
        node=inv.node,
        gpus=[gpu_to_proto(g) for g in inv.gpus],
        nics=[
            pb.Nic(
                device=n.device,
                port=n.port,
                rate_per_direction_gbits_per_s=n.rate_per_direction_gbits_per_s,
                state=n.state,
                link_layer=n.link_layer,
                fabric=n.fabric,
                numa_node=n.numa_node,
            )
            for n in inv.nics
        ],
        labels=dict(inv.labels),
        agent_version=inv.agent_version,
        simulated=inv.simulated,
        discovered_by=list(inv.discovered_by),
        address=inv.address,
    )


def inventory_from_proto(msg: pb.Inventory) -> NodeInventory:
    """A node's inventory as the controller stores it (validate with ``check_inventory``)."""
    return NodeInventory(
        node=msg.node,
        gpus=tuple(gpu_from_proto(g) for g in msg.gpus),
        nics=tuple(
            NicInventory(
                n.device,
                n.port,
                n.rate_per_direction_gbits_per_s,
                n.state,
                n.link_layer,
                n.fabric or "default",
                n.numa_node,
            )
            for n in msg.nics
        ),
        labels=dict(msg.labels),
        agent_version=msg.agent_version,
        simulated=msg.simulated,
        discovered_by=tuple(msg.discovered_by),
        address=msg.address,
    )


#: Proto-JSON names of the fields renamed for their unit (field numbers kept): stored
#: documents written before the rename use the old names. Old name -> new JSON name.
LEGACY_GPU_JSON_NAMES = {
    "hbmBandwidthGbps": "hbmBandwidthGbytesPerS",
    "hbm_bandwidth_gbps": "hbmBandwidthGbytesPerS",
}
LEGACY_NIC_JSON_NAMES = {
    "rateGbps": "ratePerDirectionGbitsPerS",
    "rate_gbps": "ratePerDirectionGbitsPerS",
}


def inventory_to_proto_json(inv: NodeInventory) -> str:
    """The inventory message in protobuf's JSON mapping (one line, sorted keys)."""
    return json_format.MessageToJson(inventory_to_proto(inv), indent=None, sort_keys=True)


def inventory_from_proto_json(text: str) -> NodeInventory:
    """Inverse of :func:`inventory_to_proto_json`; reads the pre-rename field names too.

    Raises:
        json_format.ParseError: not an Inventory message in JSON.
    """
    doc: Any = json.loads(text)
    if isinstance(doc, dict):
        for key, legacy in (("gpus", LEGACY_GPU_JSON_NAMES), ("nics", LEGACY_NIC_JSON_NAMES)):
            for item in doc.get(key) or ():
                if isinstance(item, dict):
                    for old, new in legacy.items():
                        if old in item and new not in item:
                            item[new] = item.pop(old)
    return inventory_from_proto(json_format.ParseDict(doc, pb.Inventory()))
