"""Mixed vendors: keep expert-parallel all-to-all groups inside one GPU vendor.

An expert-parallel deployment exchanges every MoE layer's tokens between all of its GPUs
(dispatch and combine). NVIDIA GPUs do this with NCCL or DeepEP, AMD GPUs with RCCL; no
collective library runs one all-to-all group across both, and no engine (SGLang, vLLM,
TensorRT-LLM) builds a mixed-vendor expert-parallel group. So by default a single
deployment of a MoE model must stay on one vendor; a fleet with both vendors is served as
one deployment per vendor (:func:`split_by_vendor`). A policy may opt out
(``allow_cross_vendor``) for runtimes that bridge vendors over the host network.

Dense models have no all-to-all: their data-parallel replicas may span vendors, and the
check lets them through.

Pure: no I/O. Vendors come from the catalog entry of each GPU (``GpuSpec.vendor``).
"""

from __future__ import annotations

from policies.errors import InputError
from policies.hardware.fleet import Fleet, Node
from policies.model.architecture import ModelSpec


def node_vendor(node: Node) -> str:
    """The vendor of a node's GPUs.

    Raises:
        InputError: the node holds GPUs of more than one vendor (no such host exists in
            practice; it would need two drivers and two collective libraries).
    """
    vendors = sorted({g.spec.vendor for g in node.gpus})
    if len(vendors) != 1:
        raise InputError(
            f"node {node.name} holds GPUs of several vendors ({', '.join(vendors)}). To fix: "
            "describe each vendor's GPUs as a separate node in the fleet file",
            field=f"nodes.{node.name}",
        )
    return vendors[0]


def vendors_of(fleet: Fleet) -> tuple[str, ...]:
    """Vendors present in a fleet, sorted (``("amd", "nvidia")``).

    Raises:
        InputError: a node mixes vendors.
    """
    return tuple(sorted({node_vendor(n) for n in fleet.nodes}))


def split_by_vendor(fleet: Fleet) -> list[Fleet]:
    """One fleet per vendor, vendors in sorted order, nodes in fleet order.

    Each part keeps the fabric links whose two fabrics it still uses and is named
    ``<fleet>-<vendor>``; a single-vendor fleet comes back unchanged (same name) as the
    only element.

    Raises:
        InputError: a node mixes vendors.
    """
    by_vendor: dict[str, list[Node]] = {}
    for n in fleet.nodes:
        by_vendor.setdefault(node_vendor(n), []).append(n)
    if len(by_vendor) <= 1:
        return [fleet]
    out: list[Fleet] = []
    for vendor in sorted(by_vendor):
        nodes = by_vendor[vendor]
        fabrics = {f for n in nodes for f in n.fabrics}
        links = tuple(x for x in fleet.fabric_links if x.a in fabrics and x.b in fabrics)
        out.append(Fleet(f"{fleet.name}-{vendor}", tuple(nodes), links))
    return out


def check_vendors(fleet: Fleet, model: ModelSpec, *, allow_cross_vendor: bool = False) -> None:
    """Refuse a single MoE deployment whose expert-parallel group would span vendors.

    Args:
        fleet: the GPUs of ONE deployment (one all-to-all group).
        model: the model; dense models pass (no all-to-all).
        allow_cross_vendor: the policy allows a mixed-vendor all-to-all group.

    Raises:
        InputError: the fleet mixes vendors, the model is MoE and ``allow_cross_vendor`` is
            false; the message counts the GPUs per vendor and says how to fix it. Also when
            a node mixes vendors.
    """
    vendors = vendors_of(fleet)
    if len(vendors) <= 1 or allow_cross_vendor or not model.is_moe:
        return
    counts = dict.fromkeys(vendors, 0)
    for g in fleet.gpus:
        counts[g.spec.vendor] += 1
    detail = ", ".join(f"{counts[v]} {v}" for v in vendors)
    raise InputError(
        f"one deployment of {model.name} would put expert-parallel traffic across vendors "
        f"({detail} GPUs in one all-to-all group); NCCL/DeepEP and RCCL cannot form such a "
        "group. To fix: deploy one copy per vendor (split the fleet: "
        f"{', '.join(f'{fleet.name}-{v}' for v in vendors)}), or set allow_cross_vendor "
        "(--allow-cross-vendor, PlacementPolicy spec.allowCrossVendor) if your runtime "
        "bridges vendors",
        field="fleet",
    )
