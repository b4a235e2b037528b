"""The channel matrix: every pair of GPUs gets the fastest channel that applies."""

from __future__ import annotations

from typing import Any

import networkx as nx
import pytest

from policies.errors import InputError
from policies.hardware.fleet import FabricLink, Fleet, parse_fleet, parse_node
from policies.hardware.topology import Channel, build_topology


def _reference(fleet: Fleet) -> list[list[int]]:
    """The rule, one pair at a time (what the vectorised matrix must equal)."""
    gpus = fleet.gpus
    domain = [
        fleet.node(g.node).nvlink.domain if fleet.node(g.node).nvlink else None  # type: ignore[union-attr]
        for g in gpus
    ]
    fabrics = [set(fleet.node(g.node).fabrics) for g in gpus]
    joined = nx.Graph()
    joined.add_nodes_from({f for fs in fabrics for f in fs})
    joined.add_edges_from((link.a, link.b) for link in fleet.fabric_links)
    component = {f: k for k, comp in enumerate(nx.connected_components(joined)) for f in comp}
    out = []
    for i, a in enumerate(gpus):
        row = []
        for j, b in enumerate(gpus):
            if i == j:
                c = Channel.LOCAL
            elif domain[i] is not None and domain[i] == domain[j]:
                c = Channel.NVLINK
            elif a.node == b.node:
                c = Channel.PCIE
            elif fabrics[i] & fabrics[j]:
                c = Channel.RDMA
            elif any(component[f] == component[h] for f in fabrics[i] for h in fabrics[j]):
                c = Channel.RDMA_CROSS
            else:
                c = Channel.UNREACHABLE
            row.append(int(c))
        out.append(row)
    return out


def _node(name: str, fabric: str | None, nvlink: str | None, count: int = 2) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": name, "gpus": [{"model": "H100-SXM5-80GB", "count": count}]}
    if nvlink is not None:
        doc["nvlink"] = {"domain": nvlink, "per_gpu_bidir_gbytes_per_s": 900}
    if fabric is not None:
        doc["nics"] = [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": fabric}]
    return doc


def _unchecked(doc: dict[str, Any]) -> Fleet:
    """The fleet of ``doc`` without parse_fleet's reachability check (which refuses it):
    the topology still prices unreachable pairs of fleets built in code."""
    with pytest.raises(InputError, match="cannot reach each other"):
        parse_fleet(doc)
    nodes = tuple(parse_node(n) for n in doc["spec"]["nodes"])
    links = tuple(
        FabricLink(x["between"][0], x["between"][1], x["per_direction_gbits_per_s"])
        for x in doc["spec"]["fabric_links"]
    )
    return Fleet(doc["metadata"]["name"], nodes, links)


def test_every_channel_kind_matches_the_pairwise_rule() -> None:
    fleet = _unchecked(
        {
            "metadata": {"name": "all-channels"},
            "spec": {
                "nodes": [
                    _node("nv-a", "ib0", "rack"),  # one NVLink domain across two nodes
                    _node("nv-b", "ib0", "rack"),
                    _node("pcie", "ib0", None),  # no NVLink: PCIe inside the node
                    _node("seg1", "ib1", "seg1"),  # another segment, linked to ib0
                    _node("island", "ib9", "island"),  # a fabric nobody links to
                    _node("offline", None, None, count=1),  # no NIC at all
                ],
                "fabric_links": [{"between": ["ib0", "ib1"], "per_direction_gbits_per_s": 800}],
            },
        }
    )
    topo = build_topology(fleet)
    assert topo.channel.tolist() == _reference(fleet)
    assert {int(c) for c in topo.channel.flatten()} == {int(c) for c in Channel}
    assert topo.channel[0][2] == Channel.NVLINK  # nv-a/gpu0 -> nv-b/gpu0
    assert topo.channel[4][5] == Channel.PCIE
    assert topo.channel[0][6] == Channel.RDMA_CROSS
    assert topo.channel[0][8] == Channel.UNREACHABLE
    assert not topo.channel.flags.writeable
