"""The all-gather exchange's bandwidth follows NCCL's rings (costmodel.gather_bandwidth).

A ring passes through a node's GPUs over NVLink and crosses to the next node once, with the
rings spread over the node's NICs: across nodes it runs at a node's whole NIC bandwidth
(nccl-tests' bus bandwidth, whose all-gather time is ``S (n - 1) / (n B)``), capped by each
GPU's own NVLink, and not at one GPU's share of the NICs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from builders import fleet_doc, request, tiny_model, workload

from policies.estimate.costmodel import CostTable, build_cost_table, gather_bandwidth
from policies.estimate.costsettings import Efficiency
from policies.estimate.evaluation import gather_times_us
from policies.hardware.fleet import parse_fleet
from policies.hardware.topology import Channel

EFF = Efficiency()
ROOT = Path(__file__).resolve().parents[2]


def _table(nodes: list[tuple[str, str, int, float | None]], nics: int = 1) -> CostTable:
    doc = fleet_doc(nodes)
    for node in doc["spec"]["nodes"]:
        node["nics"][0]["count"] = nics
    model = tiny_model()
    req = request(parse_fleet(doc), model, workload(model))
    return build_cost_table(req.fleet, req.model, req.workload, req.settings)


def test_one_node_runs_at_each_gpus_nvlink() -> None:
    table = _table([("a", "H100-SXM5-80GB", 8, 900.0)])
    bw = table.gather_bw
    nvlink = table.comm_bw[:, Channel.NVLINK]
    assert list(bw) == pytest.approx(list(nvlink))


def test_across_nodes_the_ring_runs_at_a_nodes_nic_total() -> None:
    """Two 8-GPU nodes with four 400 Gb/s NICs each: the cross-node hops carry the ring at
    4 x 50 GB/s x the RDMA efficiency, eight times one GPU's NIC share; NVLink is faster."""
    table = _table([("a", "A100-SXM4-80GB", 8, 600.0), ("h", "H100-SXM5-80GB", 8, 900.0)], 4)
    bw = table.gather_bw
    per_gpu_nic = table.comm_bw[:, Channel.RDMA]
    node_total = 4 * 400 / 8 * EFF.rdma * 1e3  # bytes/us
    assert per_gpu_nic[0] == pytest.approx(node_total / 8)
    assert list(bw) == pytest.approx([node_total] * 16)
    # the gather time is the ring's: (1 - share) of the step's token bytes at that bandwidth
    share = [1 / 16] * 16
    volume = table.total_tokens * table.bytes_per_copy
    expected = [float(table.comm_alpha[i]) + 15 / 16 * volume / node_total for i in range(16)]
    assert gather_times_us(table, share) == pytest.approx(expected)


def test_nvlink_caps_the_ring_when_the_nics_are_faster() -> None:
    table = _table([("a", "A100-SXM4-80GB", 8, 600.0), ("b", "A100-SXM4-80GB", 8, 600.0)], 16)
    bw = table.gather_bw
    nvlink = table.comm_bw[:, Channel.NVLINK]
    assert list(bw) == pytest.approx(list(nvlink))


def test_one_gpu_per_node_uses_its_own_nics_and_the_smallest_node_sets_the_pace() -> None:
    table = _table([("a", "H100-SXM5-80GB", 1, None), ("b", "H100-SXM5-80GB", 2, 900.0)])
    bw = table.gather_bw
    one_nic = 400 / 8 * EFF.rdma * 1e3
    # node a's one GPU has the whole NIC; node b's two GPUs share theirs: one NIC each way
    assert list(bw) == pytest.approx([one_nic] * 3)
    assert list(gather_bandwidth(table.topology, table.comm_bw)) == list(bw)


def test_a_link_between_fabric_segments_caps_the_ring() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "fleets" / "two-segments.yaml").read_text())
    f = parse_fleet(doc)
    model = tiny_model()
    req = request(f, model, workload(model))
    table = build_cost_table(req.fleet, req.model, req.workload, req.settings)
    assert (table.topology.channel == Channel.RDMA_CROSS).any()
    link = min(bw for _, _, bw, _ in table.segment_links)
    without = gather_bandwidth(table.topology, table.comm_bw)
    assert min(without) > link  # the NICs alone would carry more than the link
    assert list(table.gather_bw) == pytest.approx([link] * len(f.gpus))


def test_gpus_that_cannot_reach_each_other_get_no_bandwidth() -> None:
    table = _table([("a", "H100-SXM5-80GB", 2, 900.0), ("b", "H100-SXM5-80GB", 2, 900.0)])
    chan = table.topology.channel.copy()
    chan[chan == Channel.RDMA] = Channel.UNREACHABLE
    cut = dataclasses.replace(table.topology, channel=chan)
    bw = gather_bandwidth(cut, table.comm_bw)
    assert all(b <= table.comm_bw[0, Channel.UNREACHABLE] for b in bw)
