"""Fleet topology as a networkx graph: GPUs, NVLink switches, hosts, NICs and fabrics.

Edges carry per-direction bandwidth (GB/s) and latency (us). The effective bandwidth
between two GPUs is the widest path's bottleneck; the all-to-all cost model uses the
*channel* a pair talks over (same GPU, NVLink, PCIe, RDMA within a fabric, RDMA across a
fabric link) and each GPU's share of that channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import IntEnum

import networkx as nx
import numpy as np
import numpy.typing as npt

from policies.hardware.fleet import Fleet, Gpu

NVLINK_HOP_LATENCY_US = 0.7
PCIE_HOP_LATENCY_US = 1.5
NIC_HOP_LATENCY_US = 2.0


class Channel(IntEnum):
    """How two GPUs exchange expert-parallel traffic, fastest first."""

    LOCAL = 0
    NVLINK = 1
    PCIE = 2
    RDMA = 3
    RDMA_CROSS = 4
    UNREACHABLE = 5


@dataclass(frozen=True, eq=False)
class Topology:
    """Graph plus per-pair channel matrix.

    Attributes:
        graph: networkx Graph; node ids ``gpu:<id>``, ``nvsw:<domain>``, ``host:<node>``,
            ``nic:<node>:<fabric>``, ``fabric:<name>``; edge attrs ``gbytes_per_s`` (GB/s per direction)
            and ``latency_us``.
        gpus: GPUs in fleet order (index = position in every per-GPU array).
        channel: ``channel[i][j]`` (a :class:`Channel` value) for GPU indices i, j; a
            read-only ``int8`` array of shape (GPUs, GPUs).
        nvlink_gbytes_per_s, pcie_gbytes_per_s, rdma_gbytes_per_s: per-GPU per-direction bandwidth of each channel, GB/s.
    """

    graph: nx.Graph
    gpus: tuple[Gpu, ...]
    channel: npt.NDArray[np.int8]
    nvlink_gbytes_per_s: tuple[float, ...]
    pcie_gbytes_per_s: tuple[float, ...]
    rdma_gbytes_per_s: tuple[float, ...]
    cross_link_gbytes_per_s: float

    def bandwidth_gbytes_per_s(self, i: int, j: int) -> float:
        """Bottleneck bandwidth of the widest path between GPU i and GPU j, GB/s."""
        if i == j:
            return float("inf")
        a, b = _gid(self.gpus[i]), _gid(self.gpus[j])
        best: float = 0.0
        # Widest path: maximise the minimum edge bandwidth (modified Dijkstra).
        import heapq

        heap: list[tuple[float, str]] = [(-float("inf"), a)]
        seen: set[str] = set()
        while heap:
            neg_bw, u = heapq.heappop(heap)
            if u in seen:
                continue
            seen.add(u)
            if u == b:
                best = -neg_bw
                break
            for v, attrs in self.graph[u].items():
                if v not in seen and (not v.startswith("gpu:") or v == b):
                    heapq.heappush(heap, (-min(-neg_bw, float(attrs["gbytes_per_s"])), v))
        return best

    def latency_us(self, i: int, j: int) -> float:
        """Latency of the lowest-latency path between GPU i and GPU j, microseconds."""
        if i == j:
            return 0.0
        try:
            return float(
                nx.shortest_path_length(
                    self.graph, _gid(self.gpus[i]), _gid(self.gpus[j]), weight="latency_us"
                )
            )
        except nx.NetworkXNoPath:
            return float("inf")


def _gid(g: Gpu) -> str:
    return f"gpu:{g.id}"


def build_topology(fleet: Fleet) -> Topology:
    """Build the graph and channel matrix of a fleet."""
    g = nx.Graph()
    gpus = fleet.gpus
    nvl: list[float] = []
    pcie: list[float] = []
    rdma: list[float] = []
    for node in fleet.nodes:
        host = f"host:{node.name}"
        g.add_node(host, kind="host")
        n = len(node.gpus)
        per_fabric: dict[str, float] = {}
        for nic in node.nics:
            per_fabric[nic.fabric] = (
                per_fabric.get(nic.fabric, 0.0) + nic.count * nic.per_direction_gbits_per_s / 8.0
            )
        for fabric, gbs in per_fabric.items():
            nic_id = f"nic:{node.name}:{fabric}"
            g.add_edge(nic_id, f"fabric:{fabric}", gbytes_per_s=gbs, latency_us=NIC_HOP_LATENCY_US)
        for gpu in node.gpus:
            gid = _gid(gpu)
            g.add_node(gid, kind="gpu", model=gpu.spec.model)
            g.add_edge(
                gid,
                host,
                gbytes_per_s=gpu.spec.pcie_per_direction_gbytes_per_s,
                latency_us=PCIE_HOP_LATENCY_US,
            )
            pcie.append(gpu.spec.pcie_per_direction_gbytes_per_s)
            if node.nvlink is not None:
                per_dir = node.nvlink.per_gpu_bidir_gbytes_per_s / 2.0
                g.add_edge(
                    gid,
                    f"nvsw:{node.nvlink.domain}",
                    gbytes_per_s=per_dir,
                    latency_us=NVLINK_HOP_LATENCY_US,
                )
                nvl.append(per_dir)
            else:
                nvl.append(0.0)
            # GPUDirect RDMA: each GPU gets an equal share of the node's NICs.
            total = sum(per_fabric.values())
            for fabric, gbs in per_fabric.items():
                g.add_edge(
                    gid,
                    f"nic:{node.name}:{fabric}",
                    gbytes_per_s=gbs / n,
                    latency_us=NIC_HOP_LATENCY_US,
                )
            rdma.append(total / n if per_fabric else 0.0)
    cross = 0.0
    for link in fleet.fabric_links:
        gbs = link.per_direction_gbits_per_s / 8.0
        g.add_edge(
            f"fabric:{link.a}", f"fabric:{link.b}", gbytes_per_s=gbs, latency_us=link.latency_us
        )
        cross += gbs
    nvlink_of = {node.name: node.nvlink for node in fleet.nodes}
    domain = [(nv.domain if (nv := nvlink_of[x.node]) is not None else None) for x in gpus]
    fabrics = [set(fleet.node(x.node).fabrics) for x in gpus]
    linked: set[tuple[str, str]] = set()
    for link in fleet.fabric_links:
        linked |= {(link.a, link.b), (link.b, link.a)}
    # Fabrics joined through a chain of links count as reachable (connected components).
    fab_graph = nx.Graph()
    fab_graph.add_nodes_from({f for fs in fabrics for f in fs})
    fab_graph.add_edges_from(linked)
    component = {f: k for k, comp in enumerate(nx.connected_components(fab_graph)) for f in comp}
    chan = _channel_matrix(
        [x.node for x in gpus], domain, fabrics, [{component[f] for f in fs} for fs in fabrics]
    )
    return Topology(g, gpus, chan, tuple(nvl), tuple(pcie), tuple(rdma), cross)


def _channel_matrix(
    nodes: list[str],
    domains: list[str | None],
    fabrics: list[set[str]],
    components: list[set[int]],
) -> npt.NDArray[np.int8]:
    """Channel of every GPU pair, fastest that applies: the same GPU, one NVLink domain,
    one node (PCIe), a shared fabric (RDMA), fabrics joined by links (RDMA_CROSS), else
    unreachable. Vectorised: a 2,000-GPU fleet has four million pairs."""
    n = len(nodes)

    def ids(values: list[str]) -> npt.NDArray[np.int64]:
        index: dict[str, int] = {}
        return np.array([index.setdefault(v, len(index)) for v in values], dtype=np.int64)

    def share(sets: Sequence[AbstractSet[object]]) -> npt.NDArray[np.bool_]:
        """``out[i, j]``: sets i and j intersect (one boolean membership column per
        distinct element, then a matrix product)."""
        elements = sorted({e for s in sets for e in s}, key=str)
        if not elements:
            return np.zeros((n, n), dtype=bool)
        member = np.zeros((n, len(elements)), dtype=np.float32)
        col = {e: k for k, e in enumerate(elements)}
        for i, s in enumerate(sets):
            for e in s:
                member[i, col[e]] = 1.0
        return np.asarray((member @ member.T) > 0.5)

    chan = np.full((n, n), Channel.UNREACHABLE, dtype=np.int8)
    chan[share(components)] = Channel.RDMA_CROSS
    chan[share(fabrics)] = Channel.RDMA
    node = ids(nodes)
    chan[node[:, None] == node[None, :]] = Channel.PCIE
    dom = ids([d if d is not None else "" for d in domains])
    has = np.array([d is not None for d in domains])
    chan[(dom[:, None] == dom[None, :]) & has[:, None] & has[None, :]] = Channel.NVLINK
    np.fill_diagonal(chan, Channel.LOCAL)
    chan.setflags(write=False)
    return chan
