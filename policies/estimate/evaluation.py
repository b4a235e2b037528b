"""Scoring a placement with the cost model: predicted phase times, memory and violations.

Owns the placement side of the cost model: :class:`LayerPlacement` (which GPU serves which
share of each expert of one MoE layer), :class:`PhaseTimes` and :class:`Evaluation` (what a
placement is predicted to cost), the per-layer helpers :func:`served_fractions`,
:func:`comm_times_us` and :func:`link_time_us`, and :func:`evaluate`, which every policy is
judged by. The coefficients come from a :class:`policies.estimate.costmodel.CostTable`; the phase
formulas are written out in :mod:`policies.estimate.costmodel`.

Units: microseconds (``_us``), bytes, fractions in [0, 1].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from policies.estimate.costmodel import GIB, CostTable
from policies.estimate.forwarding import forwarded_exchange_us, nodes_of, token_copies
from policies.hardware.topology import Channel


@dataclass(frozen=True)
class LayerPlacement:
    """Expert placement of one MoE layer.

    Attributes:
        per_gpu: per GPU (fleet order) a tuple of ``(expert, share)``: the replica of
            ``expert`` on that GPU serves ``share`` of the expert's tokens.
        traffic: when the engine picks replicas by locality, ``traffic[i, j]`` is the
            fraction of the layer's token-expert pairs that GPU i's tokens send to GPU j
            (:func:`policies.estimate.replica_choice.dispatch`); None when every source spreads its
            pairs like the served fractions (even or planned shares).
    """

    per_gpu: tuple[tuple[tuple[int, float], ...], ...]
    traffic: npt.NDArray[np.float64] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class PhaseTimes:
    """Predicted times of one layer, per GPU, microseconds."""

    attention_us: tuple[float, ...]
    comm_us: tuple[float, ...]
    expert_us: tuple[float, ...]
    link_us: float = 0.0

    @property
    def layer_us(self) -> float:
        """Layer time: each phase costs its slowest GPU; dispatch/combine also waits for the
        busiest link between fabric segments (``link_us``)."""
        return (
            max(self.attention_us, default=0.0)
            + max(max(self.comm_us, default=0.0), self.link_us)
            + max(self.expert_us, default=0.0)
        )


@dataclass(frozen=True)
class Evaluation:
    """Predicted performance and memory of a placement.

    Attributes:
        step_time_us: one forward step over all layers.
        tokens_per_s: tokens of one step divided by the step time.
        dense_layer: phase times of one dense layer (None when the model has none).
        num_dense_layers: how many layers ``dense_layer`` stands for.
        moe_layers: phase times per MoE layer.
        memory_bytes: per GPU ``{weights, experts, kv_cache, activations, total, usable}``.
        violations: one line per violated constraint (empty when feasible).
    """

    step_time_us: float
    tokens_per_s: float
    dense_layer: PhaseTimes | None
    num_dense_layers: int
    moe_layers: tuple[PhaseTimes, ...]
    memory_bytes: tuple[Mapping[str, float], ...]
    violations: tuple[str, ...]

    @property
    def feasible(self) -> bool:
        return not self.violations

    def gpu_busy_us(self, i: int) -> float:
        """GPU i's own work over one step (sum of its phase times), us."""
        total = 0.0
        if self.dense_layer is not None:
            total += self.dense_layer.attention_us[i] * self.num_dense_layers
        for t in self.moe_layers:
            total += t.attention_us[i] + t.comm_us[i] + t.expert_us[i]
        return total


def served_fractions(table: CostTable, layer: int, placement: LayerPlacement) -> list[float]:
    """Fraction of the layer's token-expert pairs each GPU serves."""
    row = table.load[layer]
    return [sum(row[e] * share for e, share in slots) for slots in placement.per_gpu]


def comm_times_us(
    table: CostTable,
    attention_share: Sequence[float],
    served: Sequence[float],
    traffic: npt.NDArray[np.float64] | None = None,
) -> list[float]:
    """Dispatch+combine time per GPU for one MoE layer (alpha-beta per channel).

    GPU i sends ``share_i * served_j`` of the layer's pair bytes to each GPU j and receives
    ``share_j * served_i`` from it (or ``traffic[i, j]`` when given: locality-based replica
    choice); per channel the time is the larger direction over the channel's per-GPU
    bandwidth, and the GPU's time is its slowest channel plus alpha.
    """
    volume = table.total_tokens * table.top_k * table.bytes_per_copy
    a = np.asarray(attention_share, dtype=float)
    s = np.asarray(served, dtype=float)
    t = np.zeros(table.num_gpus)
    for k, mask in enumerate(table.channel_masks):
        if k == Channel.LOCAL or mask.size == 0:
            continue
        if traffic is not None:
            crossing = traffic * mask
            send, recv = crossing.sum(axis=1), crossing.sum(axis=0)
        else:
            send = a * (mask @ s)  # i's tokens' pairs served across channel k
            recv = s * (mask @ a)  # pairs i serves for tokens across channel k
        moved = np.maximum(send, recv) * volume
        with np.errstate(divide="ignore", invalid="ignore"):  # no link (0 B/s): inf, not NaN
            t = np.maximum(t, np.where(moved > 0, moved / table.comm_bw[:, k], 0.0))
    busy = (a > 0) | (s > 0)
    out = np.where(busy, t + table.comm_alpha, 0.0)
    return [float(x) for x in out]


def gather_times_us(table: CostTable, attention_share: Sequence[float]) -> list[float]:
    """All-gather + reduce-scatter time per GPU for one MoE layer, us: the exchange of
    backends without all-to-all (SGLang ``--moe-a2a-backend none``, vLLM
    ``allgather_reducescatter``/``naive``), where every GPU receives every token of the
    step, computes its own experts on them and the partial results are reduce-scattered.

    A ring moves ``(1 - share_i)`` of the step's token bytes into GPU i each way, at the
    ring's bandwidth for that GPU (:func:`policies.estimate.costmodel.gather_bandwidth`).
    Independent of the expert placement.
    """
    volume = table.total_tokens * table.bytes_per_copy
    out: list[float] = []
    for i, a in enumerate(attention_share):
        bw = float(table.gather_bw[i])
        out.append(float(table.comm_alpha[i]) + (1.0 - a) * volume / bw if bw > 0 else 0.0)
    return out


def exchange_bytes_by_node(
    table: CostTable,
    attention_share: Sequence[float],
    layers: Sequence[LayerPlacement],
    exchange: str,
) -> npt.NDArray[np.float64]:
    """Dispatch+combine bytes of one step (every MoE layer) from each node to each node
    (``[src][dst]``, nodes in :func:`policies.estimate.forwarding.nodes_of` order; the
    diagonal: sent directly between GPUs of a node, without the NVLink hop that
    ``forwarded`` adds for tokens from other nodes), as ``exchange`` (``alltoall`` or
    ``forwarded``) moves them."""
    nodes = nodes_of(table)
    onehot = nodes.onehot
    a = np.asarray(attention_share, dtype=float)
    grid = np.zeros((onehot.shape[1], onehot.shape[1]))
    for li, placement in enumerate(layers):
        served = served_fractions(table, li, placement)
        pairs = placement.traffic if placement.traffic is not None else np.outer(a, served)
        pairs = pairs * (1.0 - np.eye(len(nodes.index)))
        if exchange == "forwarded":
            gpu, node = token_copies(table, a, pairs, nodes)
            within = onehot.T @ (gpu * (onehot @ onehot.T)) @ onehot
            grid += (onehot.T @ node + within) * table.total_tokens * table.bytes_per_copy
        else:
            pair_bytes = table.total_tokens * table.top_k * table.bytes_per_copy
            grid += onehot.T @ pairs @ onehot * pair_bytes
    return grid


def link_time_us(
    table: CostTable, attention_share: Sequence[float], served: Sequence[float]
) -> float:
    """Time the busiest link between two fabric segments needs for one layer's
    dispatch+combine, us (0 without fabric links).

    Tokens of segment A served in segment B cross the link twice (dispatch A->B, combine
    B->A) and vice versa, so each direction carries about half of
    ``V * (a_A * s_B + a_B * s_A)``, where a and s are the segments' attention and served
    fractions and V the layer's pair bytes.
    """
    if not table.segment_links:
        return 0.0
    volume = table.total_tokens * table.top_k * table.bytes_per_copy
    a_seg: dict[int, float] = {}
    s_seg: dict[int, float] = {}
    for i, seg in enumerate(table.segment):
        a_seg[seg] = a_seg.get(seg, 0.0) + attention_share[i]
        s_seg[seg] = s_seg.get(seg, 0.0) + served[i]
    worst = 0.0
    for sa, sb, bw, alpha in table.segment_links:
        cross = a_seg.get(sa, 0.0) * s_seg.get(sb, 0.0) + a_seg.get(sb, 0.0) * s_seg.get(sa, 0.0)
        if cross > 0:
            worst = max(worst, alpha + volume * cross / 2 / bw)
    return worst


def layer_exchange_us(
    table: CostTable,
    attention_share: Sequence[float],
    li: int,
    placement: LayerPlacement,
    exchange: str | None = None,
) -> float:
    """Dispatch+combine plus expert phase of MoE layer ``li`` (each its slowest GPU; the
    attention phase does not depend on the expert placement), us."""
    zero = (0.0,) * table.num_gpus
    how = exchange or table.exchange
    return _moe_layer(table, attention_share, li, placement, how, zero).layer_us


def _coverage_violation(table: CostTable, li: int, placement: LayerPlacement) -> str | None:
    """The violation line of MoE layer ``li`` when a loaded expert's shares do not sum
    to 1, else None."""
    cover = [0.0] * table.num_experts
    for slots in placement.per_gpu:
        for e, share in slots:
            cover[e] += share
    bad = [e for e, c in enumerate(cover) if abs(c - 1.0) > 1e-6 and table.load[li][e] > 0]
    if not bad:
        return None
    return (
        f"MoE layer {li}: experts {bad[:8]} have token shares summing to "
        f"{[round(cover[e], 4) for e in bad[:8]]}, not 1"
    )


def _moe_layer(
    table: CostTable,
    attention_share: Sequence[float],
    li: int,
    placement: LayerPlacement,
    exchange: str,
    attention: tuple[float, ...],
) -> PhaseTimes:
    """Phase times of MoE layer ``li`` (``attention``: its attention phase per GPU)."""
    served = served_fractions(table, li, placement)
    if exchange == "allgather":
        comm = gather_times_us(table, attention_share)
        link = 0.0  # a ring crosses each fabric link once per step's bytes: in comm
    elif exchange == "forwarded":
        a = np.asarray(attention_share, dtype=float)
        pairs = placement.traffic if placement.traffic is not None else np.outer(a, served)
        comm, link = forwarded_exchange_us(table, a, pairs)
    else:
        comm = comm_times_us(table, attention_share, served, placement.traffic)
        link = link_time_us(table, attention_share, served)
    exp = [
        table.expert_us(i, served[i] * table.total_tokens * table.top_k, len(slots))
        for i, slots in enumerate(placement.per_gpu)
    ]
    return PhaseTimes(attention, tuple(comm), tuple(exp), link)


def _memory(
    table: CostTable, tokens: Sequence[float], replicas: Sequence[int], violations: list[str]
) -> list[dict[str, float]]:
    """Per GPU memory breakdown, bytes; appends a line to ``violations`` per overflow."""
    memory: list[dict[str, float]] = []
    for i, c in enumerate(table.gpus):
        mem = {
            "weights": c.fixed_bytes,
            "experts": replicas[i] * table.expert_bytes,
            "kv_cache": table.kv_cache_bytes(i, tokens[i]),
            "activations": tokens[i] * table.act_bytes_per_token,
        }
        mem["total"] = sum(mem.values())
        mem["usable"] = c.usable_bytes
        if mem["total"] > c.usable_bytes * (1 + 1e-9):
            violations.append(
                f"{table.gpu_ids[i]} ({table.models[i]}) needs {mem['total'] / GIB:.1f} GiB but "
                f"has {c.usable_bytes / GIB:.1f} GiB usable (weights {mem['weights'] / GIB:.1f}, "
                f"experts {mem['experts'] / GIB:.1f}, KV {mem['kv_cache'] / GIB:.1f}, "
                f"activations {mem['activations'] / GIB:.1f})"
            )
        memory.append(mem)
    return memory


def evaluate(
    table: CostTable,
    attention_share: Sequence[float],
    layers: Sequence[LayerPlacement],
    exchange: str | None = None,
) -> Evaluation:
    """Score a placement with the cost model.

    Args:
        table: cost table of the (fleet, model, workload).
        attention_share: per GPU the fraction of the step's tokens its attention serves;
            sums to 1.
        layers: expert placement per MoE layer (empty for dense models).
        exchange: ``alltoall`` (every token-expert pair dispatched and combined,
            :func:`comm_times_us`), ``forwarded`` (DeepEP's normal kernels: a token once per
            GPU and per node, :mod:`policies.estimate.forwarding`) or ``allgather`` (every
            GPU gets every token, :func:`gather_times_us`), as the EP group's backend moves
            tokens in the table's phase (:meth:`policies.estimate.engines.Runtime.exchange_in`);
            None: the table's ``exchange``.

    Returns:
        Predicted step time, throughput, per-layer phase times, memory, and violations of
        coverage (every expert's shares sum to 1) and memory capacity.
    """
    n = table.num_gpus
    exchange = exchange or table.exchange
    tokens = [a * table.total_tokens for a in attention_share]
    violations: list[str] = []
    if abs(sum(attention_share) - 1.0) > 1e-6:
        violations.append(f"attention shares sum to {sum(attention_share):.6f}, not 1")
    dense: PhaseTimes | None = None
    step = 0.0
    if table.num_dense_layers:
        dense = PhaseTimes(
            tuple(table.attention_us(i, tokens[i], "dense") for i in range(n)),
            (0.0,) * n,
            (0.0,) * n,
        )
        step += dense.layer_us * table.num_dense_layers
    moe: list[PhaseTimes] = []
    replicas = [0] * n
    attention = tuple(table.attention_us(i, tokens[i], "moe") for i in range(n))
    for li, placement in enumerate(layers):
        uncovered = _coverage_violation(table, li, placement)
        if uncovered:
            violations.append(uncovered)
        t = _moe_layer(table, attention_share, li, placement, exchange, attention)
        for i, slots in enumerate(placement.per_gpu):
            replicas[i] += len(slots)
        moe.append(t)
        step += t.layer_us
    memory = _memory(table, tokens, replicas, violations)
    tps = table.total_tokens / (step * 1e-6) if step > 0 else 0.0
    return Evaluation(
        step_time_us=step,
        tokens_per_s=tps,
        dense_layer=dense,
        num_dense_layers=table.num_dense_layers,
        moe_layers=tuple(moe),
        memory_bytes=tuple(memory),
        violations=tuple(violations),
    )
