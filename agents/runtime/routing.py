"""Where the layer's work goes: which rank computes which tokens' attention and holds
which expert replicas (:class:`RankPlacement`, from a plan), which replica each
token-expert pair is sent to (:class:`RoutingTables`, :func:`assign_replicas`), and the
FP8 wire format of dispatch (:func:`fp8_pack`: one float32 scale per 128 values).

Everything is torch (imported by this module: install ``mixfleet[gpu]``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from policies.estimate.evaluation import LayerPlacement
from policies.plan import Plan

Tensor = Any  # torch.Tensor; torch is untyped for mypy here
FP8_GROUP = 128  # values per FP8 scale in dispatch (DeepEP's layout)
FP8_MAX = 448.0  # largest float8_e4m3fn value


@dataclass(frozen=True)
class RankPlacement:
    """What each rank does in the layer.

    Attributes:
        tokens: per rank, tokens whose attention it computes (sums to the step's tokens).
        slots: per rank, its expert slots ``(expert, share)``: the slot's replica serves
            ``share`` of the expert's token-expert pairs.
    """

    tokens: tuple[int, ...]
    slots: tuple[tuple[tuple[int, float], ...], ...]

    @property
    def world(self) -> int:
        return len(self.tokens)


def split_tokens(total: int, shares: Sequence[float]) -> tuple[int, ...]:
    """Whole tokens per rank in proportion to ``shares`` (largest remainder)."""
    s = sum(shares)
    exact = [total * x / s for x in shares]
    base = [math.floor(v) for v in exact]
    order = sorted(range(len(shares)), key=lambda i: exact[i] - base[i], reverse=True)
    for i in order[: total - sum(base)]:
        base[i] += 1
    return tuple(base)


def placement_from_layer(
    layer: LayerPlacement, attention_share: Sequence[float], total_tokens: int
) -> RankPlacement:
    """Rank placement from a cost-model layer placement and attention shares."""
    return RankPlacement(
        tokens=split_tokens(total_tokens, attention_share),
        slots=tuple(tuple((int(e), float(s)) for e, s in g) for g in layer.per_gpu),
    )


def placement_from_plan(plan: Plan, moe_layer: int, total_tokens: int) -> RankPlacement:
    """Rank placement of one MoE layer of a plan (rank = GPU in plan order)."""
    layer = LayerPlacement(
        tuple(tuple((s.expert, s.share) for s in g.experts[moe_layer]) for g in plan.gpus)
    )
    return placement_from_layer(layer, [g.attention_share for g in plan.gpus], total_tokens)


def fp8_pack(x: Tensor) -> Tensor:
    """``[rows, hidden]`` -> ``[rows, hidden + 4 * hidden / 128]`` bytes: float8_e4m3fn
    values with one float32 scale per 128 values (the DeepEP dispatch layout)."""
    rows, h = x.shape
    g = x.float().view(rows, h // FP8_GROUP, FP8_GROUP)
    scale = g.abs().amax(-1).clamp_(min=1e-12) / FP8_MAX
    q = (g / scale[..., None]).to(torch.float8_e4m3fn).view(rows, h)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8).view(rows, -1)], dim=1)


def fp8_unpack(buf: Tensor, hidden: int, dtype: Any) -> Tensor:
    """Inverse of :func:`fp8_pack` into ``dtype``."""
    rows = buf.shape[0]
    q = buf[:, :hidden].contiguous().view(torch.float8_e4m3fn).float()
    scale = buf[:, hidden:].contiguous().view(torch.float32).view(rows, hidden // FP8_GROUP)
    return (q.view(rows, -1, FP8_GROUP) * scale[..., None]).view(rows, hidden).to(dtype)


def fp8_roundtrip(x: Tensor) -> Tensor:
    """What the receiver of an FP8 dispatch sees."""
    return fp8_unpack(fp8_pack(x), x.shape[1], x.dtype)


@dataclass
class RoutingTables:
    """Where each expert's replicas live, on the device.

    Attributes:
        rep_rank, rep_slot: ``[num_experts, max_replicas]`` rank and local slot of each
            replica (padding repeats the last replica).
        rep_cum: ``[num_experts, max_replicas]`` cumulative shares (padding 2.0).
        max_slots: most slots on any rank (the width of the per-rank count vectors).
        slots_per_rank: slots on each rank.
    """

    rep_rank: Tensor
    rep_slot: Tensor
    rep_cum: Tensor
    max_slots: int
    slots_per_rank: tuple[int, ...]


def build_tables(placement: RankPlacement, num_experts: int, device: Any) -> RoutingTables:
    """Routing tables of a placement.

    Raises:
        ValueError: an expert has no replica.
    """
    reps: list[list[tuple[int, int, float]]] = [[] for _ in range(num_experts)]
    for rank, slots in enumerate(placement.slots):
        for slot, (e, share) in enumerate(slots):
            reps[e].append((rank, slot, share))
    missing = [e for e, r in enumerate(reps) if not r]
    if missing:
        raise ValueError(f"experts {missing[:8]} have no replica in the placement")
    width = max(len(r) for r in reps)
    rank_t = torch.zeros((num_experts, width), dtype=torch.int64)
    slot_t = torch.zeros((num_experts, width), dtype=torch.int64)
    cum_t = torch.full((num_experts, width), 2.0, dtype=torch.float32)
    for e, r in enumerate(reps):
        total = sum(s for _, _, s in r) or 1.0
        acc = 0.0
        for j in range(width):
            rank, slot, share = r[min(j, len(r) - 1)]
            rank_t[e, j], slot_t[e, j] = rank, slot
            if j < len(r):
                acc += share / total
                cum_t[e, j] = 2.0 if j == len(r) - 1 else acc
    slots_per_rank = tuple(len(s) for s in placement.slots)
    return RoutingTables(
        rank_t.to(device),
        slot_t.to(device),
        cum_t.to(device),
        max(max(slots_per_rank), 1),
        slots_per_rank,
    )


def assign_replicas(idx: Tensor, tables: RoutingTables) -> tuple[Tensor, Tensor]:
    """Destination rank and slot of every pair (``idx`` ``[tokens, top_k]``, flattened
    token-major). An expert's pairs on this rank go to its replicas in proportion to their
    shares: the pair at position p of the expert's n pairs takes the replica whose
    cumulative share first exceeds ``(p + 0.5) / n``."""
    e = idx.reshape(-1)
    pairs = e.numel()
    order = torch.argsort(e, stable=True)
    counts = torch.bincount(e, minlength=tables.rep_cum.shape[0])
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty(pairs, dtype=torch.int64, device=e.device)
    pos[order] = torch.arange(pairs, device=e.device) - starts[e[order]]
    frac = (pos.float() + 0.5) / counts[e].float()
    replica = (frac[:, None] >= tables.rep_cum[e]).sum(dim=1)
    replica = replica.clamp_(max=tables.rep_cum.shape[1] - 1)
    return tables.rep_rank[e, replica], tables.rep_slot[e, replica]
