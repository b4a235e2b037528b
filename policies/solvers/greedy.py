"""``greedy``: speed-aware heuristic, and the ILP's warm start.

1. Attention shares proportional to each GPU's modelled attention speed, capped by memory.
2. Per MoE layer, EPLB's replication (each extra slot to the expert with the largest load
   per replica) up to the slot budget.
3. Longest-processing-time packing weighted by speed: replicas heaviest first, each onto
   the GPU whose predicted expert-phase time after taking it is smallest, among GPUs with a
   free slot that do not already hold that expert. Engine form: every GPU gets exactly
   ``slots_per_gpu`` slots; native form: up to what its memory holds.
"""

from __future__ import annotations

from policies.costmodel import CostTable, LayerPlacement
from policies.errors import InfeasibleError
from policies.request import PlacementRequest, RawPlacement
from policies.solvers.common import (
    attention_speed_shares,
    cap_shares_by_memory,
    slot_cap,
    slots_per_gpu,
)
from policies.solvers.eplb_core import replicate_experts


def greedy_attention(req: PlacementRequest, table: CostTable) -> list[float]:
    """Speed-proportional attention shares with room kept for the GPU's expert slots."""
    n = table.num_gpus
    share = attention_speed_shares(table)
    if table.num_moe_layers and req.form == "engine":
        s = slots_per_gpu(table.num_experts, req.redundant_experts, n)
        share = cap_shares_by_memory(table, share, [s] * n)
    elif table.num_moe_layers:
        mean = -(-(table.num_experts + req.redundant_experts) // n)
        share = cap_shares_by_memory(table, share, [mean] * n)
    return share


def capacities(req: PlacementRequest, table: CostTable, share: list[float]) -> list[int]:
    """Slots per GPU per layer: equal in engine form, memory-bound in native form.

    Raises:
        InfeasibleError: the GPUs cannot hold one replica of every expert.
    """
    n = table.num_gpus
    if req.form == "engine":
        s = slots_per_gpu(table.num_experts, req.redundant_experts, n)
        caps = [s] * n
        short = [
            f"{table.gpu_ids[i]} can hold {slot_cap(table, i, share[i])} slots per layer, "
            f"engine form needs {s}"
            for i in range(n)
            if slot_cap(table, i, share[i]) < s
        ]
        if short and all(slot_cap(table, i, 0.0) < s for i in range(n) if short):
            raise InfeasibleError("engine-form slots do not fit in memory", tuple(short[:8]))
        return caps
    caps = [slot_cap(table, i, share[i]) for i in range(n)]
    if sum(caps) < table.num_experts:
        raise InfeasibleError(
            "the GPUs cannot hold one replica of every expert",
            (f"{sum(caps)} slots per layer fit in memory, {table.num_experts} experts needed",),
        )
    return caps


def pack_layer(table: CostTable, layer: int, phy2log: list[int], caps: list[int]) -> LayerPlacement:
    """LPT-pack one layer's replicas onto GPUs with capacities ``caps``."""
    n = table.num_gpus
    count: dict[int, int] = {}
    for e in phy2log:
        count[e] = count.get(e, 0) + 1
    items = sorted(
        ((table.pairs(layer, e) / count[e], e) for e in phy2log), key=lambda x: (-x[0], x[1])
    )
    pairs = [0.0] * n
    held: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    held_set: list[set[int]] = [set() for _ in range(n)]
    for load, e in items:
        best, best_t = -1, float("inf")
        for i in range(n):
            if len(held[i]) >= caps[i] or e in held_set[i]:
                continue
            t = table.expert_us(i, pairs[i] + load, len(held[i]) + 1)
            if t < best_t - 1e-12:
                best, best_t = i, t
        if best < 0:  # every GPU with room already holds e: drop this replica
            count[e] -= 1
            continue
        held[best].append((e, 0.0))
        held_set[best].add(e)
        pairs[best] += load
    per_gpu = tuple(tuple((e, 1.0 / count[e]) for e, _ in h) for h in held)
    return LayerPlacement(per_gpu)


def place(req: PlacementRequest, table: CostTable) -> RawPlacement:
    """Greedy placement (see module docstring)."""
    share = greedy_attention(req, table)
    caps = capacities(req, table, share)
    budget = min(table.num_experts + req.redundant_experts, sum(caps))
    layers = []
    for li in range(table.num_moe_layers):
        weight = [table.pairs(li, e) for e in range(table.num_experts)]
        phy2log, _, _ = replicate_experts(weight, budget)
        layers.append(pack_layer(table, li, phy2log, caps))
    return RawPlacement(tuple(share), tuple(layers), solver="greedy (no solver)")
