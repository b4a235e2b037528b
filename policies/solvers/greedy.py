"""``greedy``: speed-aware heuristic, and the ILP's warm start.

1. Attention shares proportional to each GPU's modelled attention speed, capped by memory.
2. Per MoE layer, EPLB's replication (each extra slot to the expert with the largest load
   per replica) up to the slot budget, never more replicas of an expert than GPUs.
3. Longest-processing-time packing weighted by speed: replicas heaviest first, each onto
   the GPU whose predicted expert-phase time after taking it is smallest, among GPUs with a
   free slot that do not already hold that expert. Engine form: every GPU gets exactly
   ``slots_per_gpu`` slots; native form: up to what its memory holds.
"""

from __future__ import annotations

import numpy as np

from policies.estimate.costmodel import CostTable
from policies.estimate.evaluation import LayerPlacement
from policies.request import Infeasible, PlacementRequest, RawPlacement
from policies.solvers.common import (
    attention_speed_shares,
    cap_shares_by_memory,
    make_room,
    replicate_capped,
    slot_cap,
    slots_per_gpu,
)


def greedy_attention(req: PlacementRequest, table: CostTable) -> list[float]:
    """Speed-proportional attention shares with room kept for the GPU's expert slots."""
    n = table.num_gpus
    if req.engine.equal_dp:  # the engine's balancer gives every rank the same share
        return [1.0 / n] * n
    share = attention_speed_shares(table)
    if table.num_moe_layers and req.form == "engine":
        s = slots_per_gpu(table.num_experts, req.redundant_experts, n)
        share = cap_shares_by_memory(table, share, [s] * n)
    elif table.num_moe_layers:
        mean = -(-(table.num_experts + req.redundant_experts) // n)
        share = cap_shares_by_memory(table, share, [mean] * n)
    return share


def capacities(
    req: PlacementRequest, table: CostTable, share: list[float]
) -> list[int] | Infeasible:
    """Slots per GPU per layer: equal in engine form, memory-bound in native form; an
    :class:`Infeasible` when the GPUs cannot hold one replica of every expert."""
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
            return Infeasible("engine-form slots do not fit in memory", tuple(short[:8]))
        return caps
    caps = [slot_cap(table, i, share[i]) for i in range(n)]
    if sum(caps) < table.num_experts:
        return Infeasible(
            "the GPUs cannot hold one replica of every expert",
            (f"{sum(caps)} slots per layer fit in memory, {table.num_experts} experts needed",),
        )
    return caps


def pack_layer(table: CostTable, layer: int, phy2log: list[int], caps: list[int]) -> LayerPlacement:
    """LPT-pack one layer's replicas onto GPUs with capacities ``caps``.

    Replicas go heaviest first (ties by expert id) to the GPU whose expert-phase time after
    taking the replica is smallest (ties to the lowest index) among GPUs with a free slot
    that do not hold that expert yet.
    """
    n = table.num_gpus
    count: dict[int, int] = {}
    for e in phy2log:
        count[e] = count.get(e, 0) + 1
    items = sorted(
        ((table.pairs(layer, e) / count[e], e) for e in phy2log), key=lambda x: (-x[0], x[1])
    )
    flop = np.array([c.expert_flop_us_per_pair for c in table.gpus])
    read = np.array([c.expert_read_us_per_replica for c in table.gpus])
    act = np.array([c.expert_act_us_per_pair for c in table.gpus])
    cap = np.asarray(caps, dtype=float)
    pairs = np.zeros(n)
    slots = np.zeros(n)
    holds = np.zeros((table.num_experts, n), dtype=bool)
    held: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    held_set: list[set[int]] = [set() for _ in range(n)]
    engine = len(set(caps)) == 1 and sum(caps) == len(phy2log)
    for load, e in items:
        finish = np.maximum(flop * (pairs + load), read * (slots + 1) + act * (pairs + load))
        finish[(slots >= cap) | holds[e]] = np.inf
        best = int(np.argmin(finish))
        if not np.isfinite(finish[best]):
            best = -1
            if engine:  # every GPU with room holds e: shift a replica to make room
                load_list = [float(x) for x in pairs]
                best = make_room(held, held_set, load_list, caps, e)
                if best >= 0:
                    pairs[:] = load_list
                    slots[:] = [len(h) for h in held]
                    holds[:] = False
                    for i, hs in enumerate(held_set):
                        holds[list(hs), i] = True
        if best < 0:  # more replicas of e than GPUs can take: drop this one
            count[e] -= 1
            continue
        held[best].append((e, load))
        held_set[best].add(e)
        holds[e, best] = True
        pairs[best] += load
        slots[best] += 1
    per_gpu = tuple(tuple((e, 1.0 / count[e]) for e, _ in h) for h in held)
    return LayerPlacement(per_gpu)


def place(req: PlacementRequest, table: CostTable) -> RawPlacement | Infeasible:
    """Greedy placement (see module docstring)."""
    share = greedy_attention(req, table)
    caps = capacities(req, table, share)
    if isinstance(caps, Infeasible):
        return caps
    budget = min(table.num_experts + req.redundant_experts, sum(caps))
    layers = []
    for li in range(table.num_moe_layers):
        weight = [table.pairs(li, e) for e in range(table.num_experts)]
        phy2log = replicate_capped(weight, budget, table.num_gpus)
        layers.append(pack_layer(table, li, phy2log, caps))
    return RawPlacement(tuple(share), tuple(layers), solver="greedy (no solver)")
