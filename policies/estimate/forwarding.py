"""The token exchange of DeepEP's normal kernels: each token sent once per GPU and once per
node, forwarded over NVLink (the ``forwarded`` exchange of
:meth:`policies.estimate.engines.Runtime.exchange_in`).

DeepEP's normal (high-throughput) dispatch works from ``is_token_in_rank``: a token goes
once to every GPU that holds at least one of its experts, whatever the number of those
experts there. Across nodes it goes once to every node that holds one, over RDMA to the GPU
of the sender's local rank, which forwards it over NVLink to the node's GPUs that need it;
the combine runs the same paths back, reducing on the way. The low-latency kernels (and
the ``alltoall`` exchange, :func:`policies.estimate.evaluation.comm_times_us`) send every
token-expert pair on its own.

The model, per MoE layer. ``P[i, j]`` is the fraction of the layer's token-expert pairs that
GPU i's tokens send to GPU j (``a_i s_j`` without a replayed replica choice), ``a_i`` GPU i's
share of the tokens and ``k`` the experts per token. Taking a token's k picks as independent,
each landing on GPU j with probability ``p = P[i, j] / a_i``, the token reaches j with
probability ``1 - (1 - p)^k`` and a node N with ``1 - (1 - sum_{j in N} p_j)^k``. Then:

* **direct** (same node, and any pair the engine reaches without RDMA): ``a_i hit(i, j)``
  tokens from i to j over their channel;
* **RDMA**: ``a_i hit(i, N)`` tokens from i to node N, received by N's GPUs in equal parts
  (the sender's local rank is uniform over a node's GPUs when a node's GPUs take equal
  token shares, as DP attention gives them);
* **forwarding**: each token reaching GPU j of node N from another node arrives at one of
  N's GPUs and is forwarded over NVLink unless j received it itself (``(G - 1) / G`` of
  them, G the node's GPUs).

Bytes are copies of ``bytes_per_copy`` (dispatch + combine of one token); per channel a GPU's
time is the larger direction over its bandwidth, and its time is its slowest channel plus
alpha, as for the all-to-all. DeepEP's internode efficiency (``Efficiency.rdma`` in
:mod:`policies.estimate.costsettings`, 43-58 of 50 GB/s) is quoted on these deduplicated
RDMA bytes. Unmeasured here: no multi-node machine has run it (docs/planning.md, "Token
exchange").

Units: fractions of the layer's tokens, bytes, microseconds. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from policies.estimate.costmodel import CostTable
from policies.hardware.topology import Channel

REMOTE = (Channel.RDMA, Channel.RDMA_CROSS)
"""Channels whose traffic DeepEP's normal kernels send once per node and forward."""


@dataclass(frozen=True)
class Nodes:
    """The nodes of a cost table's GPUs (first appearance order).

    Attributes:
        index: per GPU its node.
        onehot: GPUs x nodes, 1 where the GPU is on the node.
    """

    index: npt.NDArray[np.int64]
    onehot: npt.NDArray[np.float64]

    @property
    def size(self) -> npt.NDArray[np.float64]:
        """Per GPU the number of GPUs of its node (G)."""
        size: npt.NDArray[np.float64] = self.onehot.sum(axis=0)[self.index]
        return size

    @property
    def first(self) -> npt.NDArray[np.int64]:
        """Per node its first GPU."""
        first: npt.NDArray[np.int64] = np.argmax(self.onehot, axis=0)
        return first


def nodes_of(table: CostTable) -> Nodes:
    """The nodes of ``table``'s GPUs."""
    names: dict[str, int] = {}
    index = np.array(
        [names.setdefault(g.node, len(names)) for g in table.topology.gpus], dtype=np.int64
    )
    onehot = np.zeros((len(index), len(names)))
    onehot[np.arange(len(index)), index] = 1.0
    return Nodes(index, onehot)


def _hit(p: npt.NDArray[np.float64], k: int) -> npt.NDArray[np.float64]:
    """Probability that at least one of k independent picks lands where one pick does with
    probability ``p`` (clipped to [0, 1])."""
    return 1.0 - np.power(1.0 - np.clip(p, 0.0, 1.0), k)


def token_copies(
    table: CostTable,
    attention_share: npt.NDArray[np.float64],
    pairs: npt.NDArray[np.float64],
    nodes: Nodes | None = None,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """``(gpu, node)``: tokens (fractions of the layer's) each GPU i sends to each GPU j
    (``gpu[i, j]``, every j; 0 on the diagonal) and to each node N (``node[i, N]``, 0 for
    its own node), as DeepEP's normal kernels send them; ``pairs`` is ``P`` of the module
    docstring."""
    k = max(table.top_k, 1)
    nodes = nodes or nodes_of(table)
    a = np.asarray(attention_share, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_token = np.where(a[:, None] > 0, pairs / a[:, None], 0.0)
    gpu = a[:, None] * _hit(per_token, k)
    np.fill_diagonal(gpu, 0.0)
    node = a[:, None] * _hit(per_token @ nodes.onehot, k)
    node[np.arange(len(nodes.index)), nodes.index] = 0.0
    return gpu, node


def forwarded_exchange_us(
    table: CostTable,
    attention_share: npt.NDArray[np.float64],
    pairs: npt.NDArray[np.float64],
) -> tuple[list[float], float]:
    """One MoE layer's dispatch+combine under DeepEP's normal kernels (module docstring;
    ``pairs`` is ``P``): ``(time per GPU, us; the busiest link between fabric segments, us,
    0 without fabric links)``."""
    nodes = nodes_of(table)
    gpu, node = token_copies(table, attention_share, pairs, nodes)
    a = np.asarray(attention_share, dtype=float)
    busy = (a > 0) | (pairs.sum(axis=0) > 0)
    times = np.where(busy, _slowest_channel_us(table, nodes, gpu, node) + table.comm_alpha, 0.0)
    return [float(x) for x in times], _link_us(table, nodes, node)


def forwarded_times_us(
    table: CostTable,
    attention_share: npt.NDArray[np.float64],
    pairs: npt.NDArray[np.float64],
) -> list[float]:
    """Dispatch+combine time per GPU for one MoE layer under DeepEP's normal kernels, us
    (:func:`forwarded_exchange_us`)."""
    return forwarded_exchange_us(table, attention_share, pairs)[0]


def _slowest_channel_us(
    table: CostTable,
    nodes: Nodes,
    gpu: npt.NDArray[np.float64],
    node: npt.NDArray[np.float64],
) -> npt.NDArray[np.float64]:
    """Per GPU its slowest channel's time for the copies ``gpu`` and ``node``, us."""
    size = nodes.size
    same_node = nodes.onehot @ nodes.onehot.T
    # Tokens reaching GPU j from other nodes: each lands on one of its node's G GPUs
    # (1/G each) and is forwarded to j from there unless it landed on j.
    from_afar = (gpu * np.isin(table.topology.channel, REMOTE)).sum(axis=0)
    to_node = np.zeros((len(nodes.index), nodes.onehot.shape[1]))
    # The channel to a node is the channel to its first GPU.
    to_node[nodes.first, np.arange(nodes.onehot.shape[1])] = 1.0
    volume = table.total_tokens * table.bytes_per_copy
    t = np.zeros(table.num_gpus)
    for k, mask in enumerate(table.channel_masks):
        if k == Channel.LOCAL or mask.size == 0:
            continue
        if k in REMOTE:
            into = node * (mask @ to_node)  # i -> N over channel k
            send = into.sum(axis=1)
            recv = into.sum(axis=0)[nodes.index] / size
        else:
            direct = gpu * mask
            hop = mask * same_node  # forwarder -> target over channel k
            send = direct.sum(axis=1) + (hop @ from_afar) / size
            recv = direct.sum(axis=0) + from_afar * hop.sum(axis=0) / size
        moved = np.maximum(send, recv) * volume
        with np.errstate(divide="ignore", invalid="ignore"):  # no link (0 B/s): inf, not NaN
            t = np.maximum(t, np.where(moved > 0, moved / table.comm_bw[:, k], 0.0))
    return t


def _link_us(table: CostTable, nodes: Nodes, node: npt.NDArray[np.float64]) -> float:
    """The busiest link between two fabric segments: the tokens sent from nodes of one
    segment to nodes of the other, once per node, as
    :func:`policies.estimate.evaluation.link_time_us` counts pairs, us."""
    if not table.segment_links:
        return 0.0
    seg_of_gpu = np.asarray(table.segment)
    seg_of_node = seg_of_gpu[nodes.first]
    volume = table.total_tokens * table.bytes_per_copy
    worst = 0.0
    for sa, sb, bw, alpha in table.segment_links:
        ab = node[np.ix_(seg_of_gpu == sa, seg_of_node == sb)].sum()
        ba = node[np.ix_(seg_of_gpu == sb, seg_of_node == sa)].sum()
        if ab + ba > 0:
            worst = max(worst, alpha + volume * float(ab + ba) / 2 / bw)
    return worst
